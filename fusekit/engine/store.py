"""The on-disk store of built plans (see :mod:`fusekit.engine.cache`): one file per key, a JSON header
line and the serialized graph, written under a temporary name and renamed, checked on every read;
and the fused-or-split decisions beside it."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import stat
import tarfile
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from .. import config
from ..errors import CacheWarning, FusekitError
from .plans import ENTRY_FORMAT, FUSION_FORMAT, PlanKey


def default_cache_dir() -> Path:
    """$FUSEKIT_CACHE_DIR, else the user cache directory (platformdirs) / fusekit."""
    return config.cache_dir()


@dataclass
class Entry:
    """One stored plan: its header (JSON) and the serialized graph."""

    path: Path
    header: dict
    blob: bytes

    @property
    def key(self) -> PlanKey:
        return PlanKey.from_json(self.header["key"])


class EntryError(FusekitError):
    """A store entry failed a check (format, checksum, key)."""


def _encode(key: PlanKey, meta: dict, blob: bytes) -> bytes:
    header = {
        "format": ENTRY_FORMAT,
        "key": key.to_json(),
        "key_digest": key.fingerprint(),
        "plan": meta,
        "blob_len": len(blob),
        "blob_sha256": hashlib.sha256(blob).hexdigest(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    header["fusekit"] = config.__version__
    return json.dumps(header, separators=(",", ":")).encode() + b"\n" + blob


def _decode(data: bytes, path: Path) -> Entry:
    nl = data.find(b"\n")
    if nl < 0:
        raise EntryError(f"{path.name}: no header line")
    try:
        header = json.loads(data[:nl])
    except ValueError as e:
        raise EntryError(f"{path.name}: header is not JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != ENTRY_FORMAT:
        raise EntryError(f"{path.name}: unknown format {header.get('format') if isinstance(header, dict) else header!r}")
    blob = data[nl + 1 :]
    if len(blob) != header.get("blob_len") or hashlib.sha256(blob).hexdigest() != header.get("blob_sha256"):
        raise EntryError(f"{path.name}: checksum mismatch (truncated or corrupted)")
    try:
        key = PlanKey.from_json(header["key"])
    except (KeyError, TypeError, ValueError) as e:
        raise EntryError(f"{path.name}: unreadable key ({e})") from None
    if key.fingerprint() != header.get("key_digest") or path.stem != header.get("key_digest"):
        raise EntryError(f"{path.name}: key does not match the file it is stored in")
    return Entry(path, header, blob)


def fusion_digest(key: Mapping[str, Any]) -> str:
    """Stable hash of a fused-or-split decision's key (its file name in the store)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:40]


def _fusion_key_problem(key: dict) -> str | None:
    """What is wrong with a decision key's layout (as dispatch writes it), None if nothing."""
    def array_ok(a: Any) -> bool:
        return (isinstance(a, list) and len(a) == 3 and isinstance(a[1], str)
                and all(isinstance(x, list) and all(type(v) is int for v in x) for x in (a[0], a[2])))

    if not isinstance(key.get("tag"), str):
        return "has no pattern tag"
    if not isinstance(key.get("arrays"), list) or not all(array_ok(a) for a in key["arrays"]):
        return "arrays are not [shape, dtype, strides] lists"
    if not isinstance(key.get("attrs", []), list):
        return "attrs are not a list"
    cc = key.get("cc")
    if cc is not None and not (isinstance(cc, list) and len(cc) == 2):
        return "compute capability is not a pair"
    return None


def _decode_fusion(data: bytes, path: Path) -> dict:
    """A decision file's record, checked: format, key against its digest and file name, timings."""
    try:
        d = json.loads(data)
    except ValueError as e:
        raise EntryError(f"{path.name}: not JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FUSION_FORMAT:
        raise EntryError(f"{path.name}: unknown format {d.get('format') if isinstance(d, dict) else d!r}")
    key = d.get("key")
    if not isinstance(key, dict) or fusion_digest(key) != d.get("key_digest") or path.stem != d.get("key_digest"):
        raise EntryError(f"{path.name}: key does not match the file it is stored in")
    why = _fusion_key_problem(key)
    if why:
        raise EntryError(f"{path.name}: key {why}")
    t = (d.get("fused_ms"), d.get("split_ms"))
    if not all(type(v) in (int, float) and math.isfinite(v) and v > 0 for v in t):
        raise EntryError(f"{path.name}: timings {t} are not two positive numbers of milliseconds")
    return d


def _aside(path: Path) -> Path:
    """A free name to move a bad entry to: ``<name>.<ms>.bad``, or ``<name>.<ms>-<n>.bad`` when two
    were moved aside within one millisecond (the second rename would replace the first)."""
    stamp = int(time.time() * 1e3)
    p, n = path.with_name(f"{path.name}.{stamp}.bad"), 0
    while p.exists():
        n += 1
        p = path.with_name(f"{path.name}.{stamp}-{n}.bad")
    return p


def _mkdirs(path: Path) -> None:
    """Make directory ``path`` and its missing parents, each 0o700 (existing ones are left as they are)."""
    if path.is_dir():
        return
    if path.parent != path:
        _mkdirs(path.parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "a file is in the way", str(path)) from None


def _unsafe(st: os.stat_result) -> str | None:
    """Why a file or directory with stat ``st`` may hold another user's data, else None."""
    uid = os.getuid()
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {st.st_mode & 0o777:#o})"
    return None


_TRUST = "a cuDNN plan can carry engine code, so only what this user alone can write is loaded"


class DiskStore:
    """Directory of plan entries, ``<root>/plans/<digest[:2]>/<digest>.plan``, and of fused-or-split
    decisions, ``<root>/fusion/<digest[:2]>/<digest>.json``."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()
        self.quarantined = 0  # entries this store object moved aside
        self.imported_new = 0  # plans the last import_ created (see import_)
        self.fault: str | None = None  # the first failure reported through fail() (then warned about)

    @property
    def plans_dir(self) -> Path:
        return self.root / "plans"

    @property
    def fusion_dir(self) -> Path:
        return self.root / "fusion"

    def path(self, key: PlanKey) -> Path:
        d = key.fingerprint()
        return self.plans_dir / d[:2] / f"{d}.plan"

    def fusion_path(self, key: Mapping[str, Any]) -> Path:
        d = fusion_digest(key)
        return self.fusion_dir / d[:2] / f"{d}.json"

    def lock(self, key: PlanKey) -> Any:
        """Inter-process lock for one key (held while it is built and written)."""
        from filelock import FileLock

        locks = self.root / "locks"
        _mkdirs(locks)
        return FileLock(str(locks / f"{key.fingerprint()}.lock"), mode=0o600)

    def fail(self, why: str) -> None:
        """Report that the store could not be used for one operation; only a store's first failure is warned about."""
        if self.fault is None:
            self.fault = why
            warnings.warn(f"fusekit plan cache at {self.root}: {why}; going on with plans in memory", CacheWarning, stacklevel=4)

    def access_problem(self) -> str | None:
        """Why this user could not keep plans in the store (a directory on the way they cannot enter,
        or the nearest existing one not writable), None if they can; creates nothing."""
        p = self.root
        while True:
            try:
                if p.exists():
                    break
            except PermissionError:
                return f"cannot enter {p.parent} (permission denied)"
            if p.parent == p:
                return None
            p = p.parent
        if not p.is_dir():
            return f"{p} is not a directory"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"{p} is not writable by this user"
        return None

    def check_dirs(self, entry_dir: Path | None = None) -> None:
        """PermissionError if the store's directories (and ``entry_dir``) could hold another user's files."""
        for d in (self.root, self.plans_dir) + ((entry_dir,) if entry_dir is not None else ()):
            try:
                why = _unsafe(os.stat(d))
            except FileNotFoundError:
                continue
            if why:
                raise PermissionError(f"{d} is {why}; {_TRUST}")

    def read(self, key: PlanKey) -> Entry | None:
        """The valid entry for ``key``, None if absent; a bad or untrusted entry is moved aside with a
        warning. Raises OSError if the store cannot be read or its directories are not trusted."""
        # header["key"] came from JSON (lists); compare as PlanKeys
        return self._read_checked(self.path(key), self.load, lambda e: e.key, key)

    def _read_checked(self, p: Path, load: Callable[[Path], Any], key_of: Callable[[Any], Any], key: Any) -> Any:
        """``load(p)`` if its key (``key_of`` of it) is ``key``; None if absent; a bad file is moved aside."""
        try:
            got = load(p)
            if key_of(got) != key:
                raise EntryError(f"{p.name}: stored for another key")
        except FileNotFoundError:
            return None
        except EntryError as e:
            self.quarantine(p, str(e))
            return None
        return got

    def write(self, key: PlanKey, meta: dict, blob: bytes) -> Path:
        """Atomically write (temporary file + rename) the entry for ``key``."""
        p = self.path(key)
        self._write_bytes(p, _encode(key, meta, blob))
        return p

    def _write_bytes(self, p: Path, data: bytes, count_new: bool = False) -> bool:
        """Write ``p`` (0o600) through a hidden temporary file, removed again if anything fails. With
        ``count_new``: True if this call created ``p`` (linked in atomically where it did not exist),
        False if it replaced it."""
        _mkdirs(p.parent)
        self.check_dirs(p.parent)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.stem[:8]}.", suffix=".tmp")  # mode 0o600
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            if count_new:
                try:
                    os.link(tmp, p)  # only where p does not exist yet: tells a new entry from a replaced one
                except OSError:  # it exists (or no hard links here): replace it
                    pass
                else:
                    os.unlink(tmp)
                    return True
            os.replace(tmp, p)
            return False
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read_fusion(self, key: Mapping[str, Any]) -> tuple[float, float] | None:
        """The stored (fused ms, split ms) for decision ``key`` (JSON values), None if absent; a bad
        file is moved aside with a warning (the pair is timed again). OSError as :meth:`read`."""
        d = self._read_checked(self.fusion_path(key), self.load_fusion, lambda d: d["key"], key)
        return None if d is None else (float(d["fused_ms"]), float(d["split_ms"]))

    def write_fusion(self, key: Mapping[str, Any], fused_ms: float, split_ms: float, choice: str) -> Path:
        """Atomically write the decision for ``key``: both timings and the path kept (``choice``)."""
        p = self.fusion_path(key)
        record = {
            "format": FUSION_FORMAT, "key": key, "key_digest": p.stem, "fused_ms": fused_ms, "split_ms": split_ms, "choice": choice,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "fusekit": config.__version__,
        }
        self._write_bytes(p, json.dumps(record, separators=(",", ":")).encode() + b"\n")
        return p

    def load_fusion(self, path: Path) -> dict:
        """Read and check one decision file (EntryError / PermissionError as :meth:`load`)."""
        return _decode_fusion(self._read_trusted(path), path)

    def decisions(self) -> Iterator[Path]:
        """The fused-or-split decision files."""
        if self.fusion_dir.is_dir():
            yield from sorted(self.fusion_dir.glob("*/*.json"))

    def quarantine(self, path: Path, why: str) -> None:
        """Move a bad entry aside (``*.bad``) and warn; it will be rebuilt."""
        self.quarantined += 1
        done = "moved aside and rebuilding"
        try:
            os.replace(path, _aside(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            done = f"rebuilding (cannot move it aside: {e})"
        warnings.warn(f"fusekit plan cache: ignoring {path} ({why}); {done}", CacheWarning, stacklevel=3)

    def entries(self) -> Iterator[Path]:
        if self.plans_dir.is_dir():
            yield from sorted(self.plans_dir.glob("*/*.plan"))

    def leftovers(self, min_age_s: float = 0.0) -> list[Path]:
        """Hidden temporary files (``.<name>.tmp``) of writes in progress or interrupted (a killed
        writer's), untouched for at least ``min_age_s`` seconds."""
        found = []
        for p in [t for d in (self.plans_dir, self.fusion_dir) if d.is_dir() for t in sorted(d.glob("*/.*.tmp"))]:
            with contextlib.suppress(FileNotFoundError):
                if time.time() - p.stat().st_mtime >= min_age_s:
                    found.append(p)
        return found

    def remove_leftovers(self, min_age_s: float | None = None) -> list[Path]:
        """Delete the leftovers untouched for ``min_age_s`` seconds (default ``config.TUNABLES.leftover_age_s``;
        no live writer's); returns them."""
        gone = self.leftovers(config.TUNABLES.leftover_age_s if min_age_s is None else min_age_s)
        for p in gone:
            p.unlink(missing_ok=True)
        return gone

    def load(self, path: Path) -> Entry:
        """Read and check one entry file: EntryError if it fails a check or another user could have
        written it; PermissionError if the store's directories are not trusted (see check_dirs)."""
        return _decode(self._read_trusted(path), path)

    def _read_trusted(self, path: Path) -> bytes:
        """The bytes of a store file that only this user could have written (else EntryError). Opened
        without blocking and refused unless a regular file: a FIFO in the store is reported, not waited on."""
        self.check_dirs(path.parent)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise EntryError(f"{path.name}: not a regular file")
            why = _unsafe(st)
            if why:
                raise EntryError(f"{path.name}: refused, {why}; {_TRUST}")
            return f.read()

    def shard_problems(self) -> list[tuple[Path, str]]:
        """[(path, problem)] for what sits in the store's plan and decision directories where a shard
        directory belongs (a file put there by hand or by another program)."""
        bad = []
        for d in (self.plans_dir, self.fusion_dir):
            if d.exists() and not d.is_dir():
                bad.append((d, "not a directory: the store keeps its entries in this directory"))
                continue
            for p in sorted(d.iterdir()) if d.is_dir() else ():
                if not p.is_dir() and not p.name.endswith(".bad"):
                    bad.append((p, "not a directory: a shard of the store must be one"))
        return bad

    def verify(self, fix: bool = False) -> list[tuple[Path, str]]:
        """[(path, problem)] for every entry that fails its checks or cannot be read; ``fix`` moves those aside."""
        bad = self.shard_problems()
        if fix:
            for p, _ in bad:
                with contextlib.suppress(FileNotFoundError):
                    os.replace(p, _aside(p))
        for p, load in [(p, self.load) for p in self.entries()] + [(p, self.load_fusion) for p in self.decisions()]:
            try:
                load(p)
            except (EntryError, OSError) as e:
                bad.append((p, str(e)))
                if fix:
                    with contextlib.suppress(FileNotFoundError):
                        os.replace(p, _aside(p))
        return bad

    def clear(self) -> int:
        """Delete every entry and fused-or-split decision, moved-aside file and stale leftover (a live
        writer's temporary file stays); returns how many plan entries were removed."""
        n = 0
        for d in (self.plans_dir, self.fusion_dir):
            if not d.is_dir():
                continue
            for p in list(d.glob("*/*")):
                if p.name.endswith(".tmp"):
                    continue
                if p.suffix == ".plan":
                    n += 1
                p.unlink(missing_ok=True)
        self.remove_leftovers()
        return n

    def export(self, dest: str | os.PathLike[str]) -> int:
        """Write every valid entry into one tar.gz file; returns the count."""
        n = 0
        dest = Path(dest)
        tmp = dest.with_name(f".{dest.name}.tmp")
        try:
            with tarfile.open(tmp, "w:gz") as tar:
                for p in self.entries():
                    try:
                        self.load(p)
                    except (EntryError, OSError):
                        continue
                    tar.add(p, arcname=f"plans/{p.parent.name}/{p.name}")
                    n += 1
                for p in self.decisions():  # the fused-or-split decisions travel with the plans they were timed on
                    try:
                        self.load_fusion(p)
                    except (EntryError, OSError):
                        continue
                    tar.add(p, arcname=f"fusion/{p.parent.name}/{p.name}")
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return n

    def import_(self, src: str | os.PathLike[str]) -> tuple[int, list[str]]:
        """Add the entries of an exported file; returns (imported, [problems]). Bad entries are skipped.
        ``imported_new`` then holds how many of the imported plans this call created (not replaced),
        exact with other processes importing at the same time."""
        n, problems = 0, []
        self.imported_new = 0
        with tarfile.open(src, "r:gz") as tar:
            for m in tar.getmembers():
                if not m.isfile() or not m.name.endswith((".plan", ".json")):
                    continue
                name = Path(m.name).name
                f = tar.extractfile(m)
                data = f.read() if f is not None else b""
                if name.endswith(".json"):  # a fused-or-split decision: checked, not counted among the plans
                    try:
                        d = _decode_fusion(data, Path(name))
                    except EntryError as e:
                        problems.append(str(e))
                        continue
                    self._write_bytes(self.fusion_path(d["key"]), data)
                    continue
                try:
                    entry = _decode(data, Path(name))
                except EntryError as e:
                    problems.append(str(e))
                    continue
                self.imported_new += self._write_bytes(self.path(entry.key), data, count_new=True)  # byte for byte, header included
                n += 1
        return n, problems
