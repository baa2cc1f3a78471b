"""Plan keys and the plan cache: an in-memory LRU in front of an on-disk store of built plans.

A miss goes memory -> disk -> build. The disk store keeps one file per key: a JSON header line
(the full key, the chosen plan, candidate timings, versions, the blob's length and SHA-256)
followed by the serialized cuDNN graph. Files are written to a temporary name and renamed, so a
reader never sees half an entry; a per-key file lock makes concurrent processes build a key once.
Beside the plans it keeps fused-or-split decisions (``<root>/fusion``, one small JSON file each):
the two timings of a fused graph and its split, per call configuration, plan mode, GPU and versions.
An entry that fails its checks is moved aside with a warning and rebuilt, never trusted; so is one
that another user could have written (a cuDNN plan can carry engine code). A store that cannot be
used (not writable, full, unlockable) costs one warning and the cache goes on in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import stat
import tarfile
import tempfile
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from .. import config
from ..errors import CacheWarning, FusekitError, SettingError
from ..tensors import TensorSpec

DEFAULT_HEURISTICS: tuple[str, ...] = ("A", "FALLBACK")
#: Temporary files of interrupted writes older than this (seconds) are removed: no live writer
#: leaves its temporary file untouched for so long.
MODES = config.MODES
#: /2: float32 convolution and matmul plans never down-convert inputs (entries of /1 may: rebuilt)
ENTRY_FORMAT = "fusekit-plan/2"
FUSION_FORMAT = "fusekit-fusion/1"


@dataclass(frozen=True)
class PlanKey:
    """Everything that makes a built plan valid."""

    pattern: str
    digest: str  # content hash of the pattern file
    specs: tuple[tuple[str, TensorSpec], ...]  # operands then outputs
    alignments: tuple[int, ...]  # per entry of ``specs``: largest power of two <= 32 dividing the pointer
    attrs: tuple[tuple[str, Any], ...]
    compute_dtype: str
    gpu: str
    cc: tuple[int, int]
    cudnn_backend: int
    frontend: str
    #: Whether the key's float32 convolutions / matmuls may run on TF32 tensor cores (the numerics
    #: policy, config.allow_tf32(), for its op families); False where TF32 does not apply (other dtypes, ops).
    tf32: bool = False

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for _, spec in d["specs"]:
            spec.pop("view", None)  # the user's view of an array does not change the plan
        return d

    @staticmethod
    def from_json(d: dict) -> "PlanKey":
        def tup(v: Any) -> Any:
            return tuple(tup(x) for x in v) if isinstance(v, list) else v

        missing = sorted({f.name for f in dataclasses.fields(PlanKey)} - set(d))
        if missing:  # a key of an older format (before ``tf32``): its plan may not follow the policy now asked for
            raise ValueError(f"the key has no {', '.join(missing)} (an entry of an older fusekit)")
        specs = tuple((n, TensorSpec(**{k: tup(v) for k, v in sd.items()})) for n, sd in d["specs"])
        fields = {k: tup(v) for k, v in d.items() if k != "specs"}
        return PlanKey(specs=specs, **fields)

    def fingerprint(self) -> str:
        """Stable hash of the whole key (the store's file name)."""
        canon = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:40]

    def describe(self) -> str:
        shapes = ", ".join(f"{n}={s.dtype}{list(s.shape)}:{s.layout}" for n, s in self.specs)
        attrs = ", ".join(f"{k}={v}" for k, v in self.attrs)
        tf32 = ", TF32 allowed" if self.tf32 else ""
        return f"{self.pattern}({shapes}; {attrs}{tf32}) on {self.gpu} sm_{self.cc[0]}{self.cc[1]}"


@dataclass(eq=False)
class Plan:
    """A built cuDNN plan for one key: execute ``graph`` with buffers in ``uids`` order."""

    key: PlanKey
    graph: Any
    uids: tuple[int, ...]
    workspace_size: int
    engine: str
    candidates: int
    build_ms: float
    source: str = "built"  # "built" (heuristics) | "tuned" | "disk"
    engine_id: int | None = None
    knobs: dict[str, int] = field(default_factory=dict)
    tuning: list[dict] | None = field(default=None, repr=False)  # per-candidate timings and verdicts
    evicted: bool = field(default=False, repr=False)

    @classmethod
    def from_entry(cls, key: PlanKey, graph: Any, meta: Mapping[str, Any], load_ms: float) -> "Plan":
        """A plan deserialized from a store entry whose header ``plan`` section is ``meta``."""
        return cls(
            key, graph, tuple(meta["uids"]), int(meta["workspace_size"]), meta["engine"], int(meta.get("candidates", 0)),
            load_ms, source="disk", engine_id=meta.get("engine_id"), knobs=meta.get("knobs") or {}, tuning=meta.get("tuning"),
        )

    def meta(self) -> dict:
        """What the disk store records about the plan (beside the serialized graph)."""
        return {
            "engine": self.engine,
            "engine_id": self.engine_id,
            "knobs": self.knobs,
            "uids": list(self.uids),
            "workspace_size": self.workspace_size,
            "candidates": self.candidates,
            "build_ms": self.build_ms,
            "source": "tuned" if self.source == "tuned" or self.tuning else self.source,
            "tuning": self.tuning,
        }


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    builds: int = 0
    evictions: int = 0
    disk_hits: int = 0
    disk_writes: int = 0
    rejected: int = 0  # disk entries moved aside (failed checks, or cuDNN refused the blob)
    disk_errors: int = 0  # store operations that failed (unwritable, full, unlockable, untrusted)


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


class PlanCache:
    """LRU of plans keyed by :class:`PlanKey`, optionally backed by a :class:`DiskStore`.

    ``maxsize``: $FUSEKIT_CACHE_SIZE or 512. ``mode``: "heuristic" (first plan the heuristics
    offer) or "autotune" (time every candidate on first use of a key); $FUSEKIT_MODE.
    """

    def __init__(
        self,
        maxsize: int | None = None,
        heuristics: tuple[str, ...] = DEFAULT_HEURISTICS,
        store: DiskStore | None = None,
        mode: str | None = None,
    ) -> None:
        self.maxsize = int(maxsize if maxsize is not None else config.cache_size())
        if self.maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {self.maxsize}")
        self.mode = mode or config.mode()
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        self.heuristics = tuple(heuristics)
        self.store = store
        self.stats = CacheStats()
        self._plans: OrderedDict[PlanKey, Plan] = OrderedDict()
        self._lock = threading.RLock()
        self._on_evict: list[Callable[[Plan], None]] = []

    def __len__(self) -> int:
        return len(self._plans)

    def __bool__(self) -> bool:  # an empty cache is still a cache (``cache or default`` must not skip it)
        return True

    def __contains__(self, key: PlanKey) -> bool:
        return key in self._plans

    def __iter__(self) -> Iterator[PlanKey]:
        return iter(list(self._plans))

    def get(self, key: PlanKey) -> Plan | None:
        """The cached plan (marked most recently used), or None."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
            return plan

    def get_or_build(self, key: PlanKey, build: Callable[[], Plan], load: Callable[[Entry], Plan] | None = None) -> Plan:
        """The plan for ``key``: from memory, else from the disk store (through ``load``), else
        ``build()`` (then written to the store). A store that fails is skipped (see DiskStore.fail)."""
        with self._lock:
            plan = self.get(key)
            if plan is not None:
                self.stats.hits += 1
                return plan
            self.stats.misses += 1
            if self.store is None or load is None:
                plan = build()
                self.stats.builds += 1
            else:
                with self._store_lock(key):
                    plan = self._from_store(key, load)
                    if plan is None:
                        plan = build()
                        self.stats.builds += 1
                        self.save(plan)
            self.put(plan)
            return plan

    @contextlib.contextmanager
    def _store_lock(self, key: PlanKey) -> Iterator[None]:
        """Hold the store's lock for ``key``, or no lock if it cannot be taken."""
        assert self.store is not None
        lock = None
        try:
            lock = self.store.lock(key)
            lock.acquire()
        except OSError as e:
            lock = None
            self._store_failed("cannot lock", e)
        try:
            yield
        finally:
            if lock is not None:
                lock.release()

    def _store_failed(self, what: str, e: OSError) -> None:
        assert self.store is not None
        self.stats.disk_errors += 1
        self.store.fail(f"{what} ({e})")

    def _from_store(self, key: PlanKey, load: Callable[[Entry], Plan]) -> Plan | None:
        assert self.store is not None
        before = self.store.quarantined
        try:
            entry = self.store.read(key)
        except OSError as e:
            self._store_failed("cannot read", e)
            return None
        self.stats.rejected += self.store.quarantined - before
        if entry is None:
            return None
        try:
            plan = load(entry)
        except Exception as e:  # noqa: BLE001 - a blob the library will not load is rebuilt, not trusted
            self.stats.rejected += 1
            self.store.quarantined -= 1  # counted just above
            self.store.quarantine(entry.path, f"cuDNN could not load it: {type(e).__name__}: {e}")
            return None
        self.stats.disk_hits += 1
        return plan

    def save(self, plan: Plan) -> None:
        """Write ``plan`` to the disk store (if any); a plan cuDNN cannot serialize, or the store cannot
        take, stays in memory."""
        if self.store is None:
            return
        try:
            blob = plan.graph.serialize(as_bytes=True)
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"fusekit: plan for {plan.key.describe()} cannot be serialized ({e}); kept in memory only", CacheWarning, stacklevel=2)
            return
        try:
            self.store.write(plan.key, plan.meta(), bytes(blob))
        except OSError as e:
            self._store_failed("cannot write", e)
            return
        self.stats.disk_writes += 1

    def stored_fusion(self, key: Mapping[str, Any]) -> tuple[float, float] | None:
        """The disk store's (fused ms, split ms) for a fused-or-split decision ``key``, if it has one."""
        if self.store is None:
            return None
        try:
            return self.store.read_fusion(key)
        except OSError as e:
            self._store_failed("cannot read", e)
            return None

    def store_fusion(self, key: Mapping[str, Any], fused_ms: float, split_ms: float, choice: str) -> None:
        """Keep a fused-or-split decision in the disk store (if any), for later processes."""
        if self.store is None:
            return
        try:
            self.store.write_fusion(key, fused_ms, split_ms, choice)
        except OSError as e:
            self._store_failed("cannot write", e)

    def put(self, plan: Plan) -> None:
        with self._lock:
            old = self._plans.get(plan.key)
            if old is not None and old is not plan:
                self._evicted(old)
            self._plans[plan.key] = plan
            self._plans.move_to_end(plan.key)
            while len(self._plans) > self.maxsize:
                _, old = self._plans.popitem(last=False)
                self._evicted(old)

    def clear(self) -> None:
        with self._lock:
            plans = list(self._plans.values())
            self._plans.clear()
            for p in plans:
                self._evicted(p)

    def on_evict(self, callback: Callable[[Plan], None]) -> None:
        """Call ``callback(plan)`` whenever a plan leaves the cache (dispatch tables drop it)."""
        self._on_evict.append(callback)

    def _evicted(self, plan: Plan) -> None:
        plan.evicted = True
        self.stats.evictions += 1
        for cb in self._on_evict:
            cb(plan)


_default: PlanCache | None = None


def default_cache() -> PlanCache:
    """The process-wide cache: on-disk store unless $FUSEKIT_CACHE_DIR is "off"/"none", or the store's
    directory cannot be used by this user (then plans stay in memory, with one CacheWarning)."""
    global _default
    if _default is None:
        store = None if config.disk_cache_off() else DiskStore()
        why = store.access_problem() if store is not None else None
        if why:
            warnings.warn(f"fusekit plan cache at {store.root}: {why}; going on with plans in memory", CacheWarning, stacklevel=2)
            store = None
        _default = PlanCache(store=store)
    return _default


def configure(
    *, cache_dir: str | os.PathLike[str] | None = None, disk: bool = True, mode: str | None = None, maxsize: int | None = None,
    allow_tf32: config.Tf32Setting = None,
) -> PlanCache:
    """Replace the process-wide cache and numerics policy (e.g. ``configure(mode="autotune", cache_dir=...)``);
    what is not given comes from the environment ($FUSEKIT_*), as at start-up.

    ``allow_tf32``: which op families' float32 graphs may run on TF32 tensor cores (config.Tf32Policy):
    True / False for all, ``{"conv": True, "matmul": False}`` (PyTorch's defaults, used when None and
    $FUSEKIT_ALLOW_TF32 is unset), or a string as that variable takes ("conv", "matmul", "all", "none").
    A bad value raises SettingError and leaves everything as it was."""
    global _default
    old = _default
    config.tf32_policy(allow_tf32)  # checked before anything changes
    if maxsize is not None:
        maxsize = config.checked_cache_size(maxsize)
    if mode is not None and mode not in MODES:
        raise SettingError("mode", mode, f"one of {', '.join(MODES)}")
    if cache_dir is not None and disk:
        cache_dir = config.checked_cache_dir(cache_dir)
    new = PlanCache(maxsize=maxsize, store=DiskStore(cache_dir) if disk else None, mode=mode)
    config.set_allow_tf32(allow_tf32)
    _default = new
    if old is not None:
        old.clear()  # dispatch tables drop its plans
    return _default
