"""CPU: the plan cache when its disk store fails (cannot be made, read-only, full, unlockable), leftovers
of interrupted writes, and which entries it trusts (no GPU, no cuDNN: fake plans)."""

import errno
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import filelock
import pytest

from fusekit.config import TUNABLES
from fusekit.engine.cache import CacheWarning, DiskStore, PlanCache

from plankeys import key  # noqa: E402
from test_cpu_store import Builder, _bad_files, _load, _no_build, _tmp_files, _write_entry  # noqa: E402

IS_ROOT = os.geteuid() == 0


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _run(cache: PlanCache, n: int = 3) -> tuple[list, list[str]]:
    """get_or_build n keys (two calls each); (plans, CacheWarning messages)."""
    plans = []
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for i in range(n):
            k = key(pattern=f"p{i}")
            build = Builder(k)
            p = cache.get_or_build(k, build, _load)
            assert cache.get_or_build(k, _no_build, _load) is p  # kept in memory
            plans.append(p)
    assert all(issubclass(w.category, CacheWarning) for w in rec), [str(w.message) for w in rec]
    return plans, [str(w.message) for w in rec]


def _assert_degraded(cache: PlanCache, msgs: list[str], *needles: str) -> None:
    assert len(msgs) == 1, msgs  # one warning per store, not one per call
    assert str(cache.store.root) in msgs[0] and "going on with plans in memory" in msgs[0]
    for n in needles:
        assert n in msgs[0], msgs[0]
    assert cache.stats.builds == 3 and len(cache) == 3 and cache.stats.disk_errors >= 3
    assert cache.store.fault is not None


# ----------------------------------------------------------------------------------------------
# a store that cannot be used: the cache goes on in memory, with one warning
# ----------------------------------------------------------------------------------------------
def test_store_below_a_regular_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    cache = PlanCache(store=DiskStore(f / "cache"))
    _, msgs = _run(cache)
    _assert_degraded(cache, msgs, "a file is in the way", str(f))
    assert f.read_text() == "x"


def test_store_whose_parent_cannot_be_made(tmp_path, monkeypatch):
    real_mkdir = os.mkdir
    denied = tmp_path / "denied"

    def mkdir(path, mode=0o777, **kw):
        if Path(path) == denied:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_mkdir(path, mode, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir)
    cache = PlanCache(store=DiskStore(denied / "a" / "cache"))
    _, msgs = _run(cache)
    _assert_degraded(cache, msgs, "Permission denied", str(denied))
    assert not denied.exists()


def _read_only(monkeypatch, root: Path) -> None:
    """Make every write below ``root`` fail with EROFS, as on a read-only mount (root ignores chmod)."""
    real_open, real_mkdir = os.open, os.mkdir
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def below(path) -> bool:
        return Path(path).is_relative_to(root)

    def fake_open(path, flags, *a, **kw):
        if below(path) and flags & writing:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a, **kw)

    def fake_mkdir(path, *a, **kw):
        if below(path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_mkdir(path, *a, **kw)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)


def test_read_only_store_still_serves_its_plans(tmp_path, monkeypatch):
    store = DiskStore(tmp_path / "store")
    stored, _ = _write_entry(store, key(pattern="p0"))
    _read_only(monkeypatch, store.root)
    cache = PlanCache(store=DiskStore(store.root))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        p0 = cache.get_or_build(key(pattern="p0"), _no_build, _load)  # no lock, but the entry is read
        for i in (1, 2, 3):
            k = key(pattern=f"p{i}")
            assert cache.get_or_build(k, Builder(k), _load).key == k
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 1 and "Read-only file system" in msgs[0] and str(store.root) in msgs[0], msgs
    assert p0.graph.blob == stored.graph.blob and cache.stats.disk_hits == 1 and cache.stats.builds == 3
    monkeypatch.undo()
    assert [p.name for p in store.entries()] == [store.path(key(pattern="p0")).name]
    assert not _tmp_files(store.root)


@pytest.mark.skipif(IS_ROOT, reason="root writes into a 0o555 directory")
def test_read_only_directory_for_real(tmp_path):
    store = DiskStore(tmp_path / "store")
    _write_entry(store, key(pattern="x"))
    for d in (store.root, *store.plans_dir.rglob("*"), store.plans_dir):
        if d.is_dir():
            d.chmod(0o555)
    try:
        cache = PlanCache(store=DiskStore(store.root))
        _, msgs = _run(cache)
        _assert_degraded(cache, msgs, "Permission denied")
    finally:
        for d in (store.root, store.plans_dir, *store.plans_dir.rglob("*")):
            if d.is_dir():
                d.chmod(0o700)


def _enospc(*a, **kw):
    raise OSError(errno.ENOSPC, "No space left on device")


def _half_then_enospc(real):
    def write(fd, data):
        if len(data) > 100:  # some bytes reach the disk, then it is full
            real(fd, bytes(data[:100]))
        raise OSError(errno.ENOSPC, "No space left on device")

    return write


@pytest.mark.parametrize("where", ["os.write", "os.fsync", "os.replace", "tempfile.mkstemp"])
def test_full_disk_keeps_plans_in_memory_and_leaves_no_file(tmp_path, monkeypatch, where):
    store = DiskStore(tmp_path / "store")
    before, path = _write_entry(store, key(pattern="p0"))  # an older entry of p0: kept as it was
    old_bytes = path.read_bytes()
    mod, name = where.split(".")
    target = {"os": os, "tempfile": tempfile}[mod]
    monkeypatch.setattr(target, name, _half_then_enospc(os.write) if where == "os.write" else _enospc)
    cache = PlanCache(store=DiskStore(store.root))
    cache.get_or_build(key(pattern="p0"), _no_build, _load)  # reads still work
    plans, msgs = _run(cache, n=4)
    monkeypatch.undo()
    assert len(msgs) == 1 and "cannot write" in msgs[0] and "No space left on device" in msgs[0], msgs
    assert str(store.root) in msgs[0]
    assert cache.stats.builds == 3 and cache.stats.disk_writes == 0 and cache.stats.disk_errors == 3
    assert not _tmp_files(store.root) and not store.leftovers()  # no partial file behind
    assert path.read_bytes() == old_bytes
    assert [p for p in store.entries()] == [path]
    assert plans[0].graph.blob == before.graph.blob


@pytest.mark.parametrize("how", ["lock_raises", "acquire_raises", "acquire_times_out"])
def test_lock_that_cannot_be_taken(tmp_path, monkeypatch, how):
    if how == "lock_raises":
        monkeypatch.setattr(DiskStore, "lock", lambda self, k: _enospc())
    elif how == "acquire_raises":
        monkeypatch.setattr(filelock.FileLock, "acquire", lambda self, *a, **kw: _enospc())
    else:
        def timeout(self, *a, **kw):
            raise filelock.Timeout(str(self.lock_file))

        monkeypatch.setattr(filelock.FileLock, "acquire", timeout)
    store = DiskStore(tmp_path / "store")
    cache = PlanCache(store=store)
    _, msgs = _run(cache)
    assert len(msgs) == 1 and "cannot lock" in msgs[0] and str(store.root) in msgs[0], msgs
    assert cache.stats.builds == 3 and len(cache) == 3
    # without the lock the plans are still written (a write is atomic on its own)
    assert cache.stats.disk_writes == 3 and len(list(store.entries())) == 3


def test_each_store_warns_once(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    for _ in range(2):
        cache = PlanCache(store=DiskStore(f / "c"))
        _, msgs = _run(cache)
        assert len(msgs) == 1


def test_build_errors_still_propagate_through_a_failing_store(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    cache = PlanCache(store=DiskStore(f / "c"))

    def boom():
        raise RuntimeError("no engine")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        with pytest.raises(RuntimeError, match="no engine"):
            cache.get_or_build(key(), boom, _load)
    assert len(cache) == 0


# ----------------------------------------------------------------------------------------------
# leftovers of interrupted writes
# ----------------------------------------------------------------------------------------------
def _leftover(store: DiskStore, age_s: float, size: int = 1000, shard: str = "ab") -> Path:
    d = store.plans_dir / shard
    d.mkdir(parents=True, exist_ok=True)
    p = d / f".{shard}cdef01.k3j_x9.tmp"  # as tempfile.mkstemp names them
    p.write_bytes(b"\0" * size)
    t = time.time() - age_s
    os.utime(p, (t, t))
    return p


def test_leftovers_found_and_only_stale_ones_removed(tmp_path):
    store = DiskStore(tmp_path)
    _, entry = _write_entry(store, key())
    young = _leftover(store, 5, shard="ab")
    old = _leftover(store, TUNABLES.leftover_age_s + 60, shard="cd")
    assert store.leftovers() == sorted([young, old])
    assert store.leftovers(TUNABLES.leftover_age_s) == [old]
    assert list(store.entries()) == [entry]  # not entries
    assert store.remove_leftovers() == [old]
    assert store.leftovers() == [young] and young.exists() and not old.exists()
    assert store.read(key()) is not None


def test_clear_keeps_a_live_writers_temp_file(tmp_path):
    store = DiskStore(tmp_path)
    _write_entry(store, key())
    young = _leftover(store, 5, shard="ab")
    old = _leftover(store, TUNABLES.leftover_age_s + 1, shard="cd")
    assert store.clear() == 1
    assert young.exists() and not old.exists()


_KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, sys.argv[2])
    from fusekit.engine.cache import DiskStore
    from plankeys import key

    real_write = os.write

    def stalled_write(fd, data):
        n = real_write(fd, bytes(data[: 1 << 16]))  # 64 KiB of the entry reach the file, then we stall
        print("writing", flush=True)
        time.sleep(120)
        return n

    os.write = stalled_write
    DiskStore(sys.argv[1]).write(key(), {"engine": "e"}, os.urandom(8 << 20))
    """
)


def test_writer_killed_mid_write_leaves_a_leftover(tmp_path):
    root = tmp_path / "store"
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(root), str(Path(__file__).resolve().parents[1])],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "writing"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    store = DiskStore(root)
    left = store.leftovers()
    assert len(left) == 1 and left[0].name.startswith(".") and left[0].name.endswith(".tmp")
    assert left[0].stat().st_size == 1 << 16
    assert list(store.entries()) == [] and store.read(key()) is None
    assert store.remove_leftovers() == []  # young: it could be a live writer's
    t = time.time() - TUNABLES.leftover_age_s - 1
    os.utime(left[0], (t, t))
    assert store.remove_leftovers() == left and store.leftovers() == []


# ----------------------------------------------------------------------------------------------
# trust: only entries this user alone can have written are loaded
# ----------------------------------------------------------------------------------------------
def test_store_makes_private_directories_and_files(tmp_path):
    store = DiskStore(tmp_path / "a" / "store")
    k = key()
    PlanCache(store=store).get_or_build(k, Builder(k), _load)
    for d in (tmp_path / "a", store.root, store.plans_dir, store.path(k).parent, store.root / "locks"):
        assert _mode(d) == 0o700, d
    assert _mode(store.path(k)) == 0o600
    locks = list((store.root / "locks").iterdir())
    assert locks and all(_mode(p) & 0o077 == 0 for p in locks)
    n, _ = DiskStore(tmp_path / "b").import_(_export(store, tmp_path))
    assert n == 1 and _mode(DiskStore(tmp_path / "b").path(k)) == 0o600


def _export(store: DiskStore, tmp_path: Path) -> Path:
    dest = tmp_path / "x.tar.gz"
    store.export(dest)
    return dest


def _refused_and_rebuilt(tmp_path, spoil, *needles: str) -> None:
    store = DiskStore(tmp_path / "store")
    k = key()
    old, path = _write_entry(store, k)
    spoil(path)
    build = Builder(k)
    cache = PlanCache(store=DiskStore(store.root))
    with pytest.warns(CacheWarning) as rec:
        p = cache.get_or_build(k, build, _load)
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 1 and str(path) in msgs[0] and "engine code" in msgs[0], msgs
    for n in needles:
        assert n in msgs[0], msgs[0]
    assert build.calls == 1 and p is build.built[0] and p.graph.blob != old.graph.blob
    assert cache.stats.disk_hits == 0 and cache.stats.rejected == 1 and cache.stats.disk_writes == 1
    assert len(_bad_files(store.root)) == 1  # moved aside
    assert _mode(path) == 0o600 and path.stat().st_uid == os.getuid()  # the rebuilt entry is ours
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = PlanCache(store=DiskStore(store.root)).get_or_build(k, _no_build, _load)
    assert again.graph.blob == p.graph.blob


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602, 0o777])
def test_entry_writable_by_others_is_refused(tmp_path, mode):
    _refused_and_rebuilt(tmp_path, lambda p: p.chmod(mode), f"writable by group or others (mode {mode:#o})")


@pytest.mark.skipif(not IS_ROOT, reason="giving a file to another user needs root")
def test_entry_of_another_user_is_refused(tmp_path):
    _refused_and_rebuilt(tmp_path, lambda p: os.chown(p, 4242, 4242), "owned by uid 4242")


@pytest.mark.parametrize("which", ["root", "plans", "shard"])
def test_store_directory_writable_by_others_is_not_used(tmp_path, which):
    store = DiskStore(tmp_path / "store")
    _, path = _write_entry(store, key(pattern="p0"))
    d = {"root": store.root, "plans": store.plans_dir, "shard": path.parent}[which]
    d.chmod(0o777)
    cache = PlanCache(store=DiskStore(store.root))
    _, msgs = _run(cache)  # p0 included: its entry is not loaded
    assert len(msgs) == 1 and f"{d} is writable by group or others (mode 0o777)" in msgs[0], msgs
    assert "engine code" in msgs[0] and str(store.root) in msgs[0]
    assert cache.stats.builds == 3 and cache.stats.disk_hits == 0
    assert path.exists() and not _bad_files(store.root)  # nothing moved: the directory is the problem


def test_store_of_another_user_is_not_used(tmp_path, monkeypatch):
    store = DiskStore(tmp_path / "store")
    _, path = _write_entry(store, key(pattern="p0"))
    before = path.read_bytes()
    monkeypatch.setattr(os, "getuid", lambda: 4242)
    cache = PlanCache(store=DiskStore(store.root))
    _, msgs = _run(cache)
    assert len(msgs) == 1 and f"owned by uid {os.geteuid()}, not by this user (uid 4242)" in msgs[0], msgs
    assert cache.stats.builds == 3 and cache.stats.disk_hits == 0 and cache.stats.disk_writes == 0
    monkeypatch.undo()
    assert path.read_bytes() == before and len(list(store.entries())) == 1  # nothing written into it


def test_verify_reports_untrusted_entries(tmp_path):
    store = DiskStore(tmp_path / "store")
    _, path = _write_entry(store, key())
    path.chmod(0o646)
    bad = store.verify()
    assert len(bad) == 1 and bad[0][0] == path and "writable by group or others (mode 0o646)" in bad[0][1]
    store.verify(fix=True)
    assert not path.exists() and len(_bad_files(store.root)) == 1
