"""CPU: the on-disk plan store (DiskStore) behind PlanCache, with fake graphs (no GPU, no cuDNN).

A fake graph only has to ``serialize(as_bytes=True)``; ``_load`` rebuilds a Plan from an entry's
blob and recorded meta, so every test can check that both came back exactly.
"""

import functools
import io
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path

import pytest

from fusekit.engine import cache as cache_mod
from fusekit.engine.cache import (
    ENTRY_FORMAT,
    CacheWarning,
    DiskStore,
    EntryError,
    Plan,
    PlanCache,
    PlanKey,
    configure,
    default_cache,
    default_cache_dir,
)


# ----------------------------------------------------------------------------------------------
# keys, fake graphs and plans
# ----------------------------------------------------------------------------------------------
from plankeys import BASE, key  # noqa: E402



class FakeGraph:
    """Stands in for a cuDNN frontend graph: serializes to fixed bytes."""

    def __init__(self, blob: bytes):
        self.blob = bytes(blob)
        self.serialize_calls = 0

    def serialize(self, as_bytes=False):
        assert as_bytes is True
        self.serialize_calls += 1
        return self.blob


class UnserializableGraph:
    def serialize(self, as_bytes=False):
        raise RuntimeError("this engine cannot be serialized")


def make_plan(k, blob=None, tuning=True, graph=None):
    return Plan(
        k,
        graph=graph if graph is not None else FakeGraph(blob if blob is not None else os.urandom(1024)),
        uids=(7, 3, 11, 2),
        workspace_size=123456,
        engine="eng12_k2=1_k5=3",
        candidates=4,
        build_ms=12.5,
        source="tuned" if tuning else "built",
        engine_id=12,
        knobs={"k2": 1, "k5": 3},
        tuning=[
            {"engine": "eng12", "ms": 0.1234567891234, "ok": True},
            {"engine": "eng0", "ms": None, "ok": False, "error": "not supported"},
        ]
        if tuning
        else None,
    )


def _load(entry):
    """What the real loader does with an entry: rebuild a Plan from the blob and recorded meta."""
    m = entry.header["plan"]
    return Plan(
        entry.key,
        graph=FakeGraph(entry.blob),
        uids=tuple(m["uids"]),
        workspace_size=m["workspace_size"],
        engine=m["engine"],
        candidates=m["candidates"],
        build_ms=m["build_ms"],
        source="disk",
        engine_id=m["engine_id"],
        knobs=dict(m["knobs"]),
        tuning=m["tuning"],
    )


def _refusing_load(entry):
    raise RuntimeError("CUDNN_STATUS_BAD_PARAM: deserialization failed")


class Builder:
    """A build callable that counts its calls and remembers what it built."""

    def __init__(self, k, blob=None):
        self.k = k
        self.blob = blob
        self.calls = 0
        self.built = []

    def __call__(self):
        self.calls += 1
        p = make_plan(self.k, self.blob)
        self.built.append(p)
        return p


def _no_build():
    raise AssertionError("build() called although the plan is on disk")


def _bad_files(root):
    return sorted(Path(root).rglob("*.bad"))


def _tmp_files(root):
    return sorted(p for p in Path(root).rglob("*") if p.name.endswith(".tmp"))


def _split(path):
    data = Path(path).read_bytes()
    nl = data.index(b"\n")
    return json.loads(data[:nl]), data[nl + 1 :]


def _write_entry(store, k, blob=None):
    p = make_plan(k, blob)
    path = store.write(k, p.meta(), p.graph.blob)
    return p, path


# ----------------------------------------------------------------------------------------------
# round trip
# ----------------------------------------------------------------------------------------------
def test_round_trip_through_disk(tmp_path):
    k = key()
    blob = os.urandom(4096)
    build = Builder(k, blob)
    c1 = PlanCache(store=DiskStore(tmp_path))
    p1 = c1.get_or_build(k, build, _load)
    assert build.calls == 1 and p1 is build.built[0]
    assert (c1.stats.builds, c1.stats.disk_writes, c1.stats.disk_hits) == (1, 1, 0)
    assert c1.get_or_build(k, build, _load) is p1 and build.calls == 1  # memory hit
    assert c1.stats.hits == 1
    assert len(list(c1.store.entries())) == 1

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a good entry is never moved aside
        c2 = PlanCache(store=DiskStore(tmp_path))
        p2 = c2.get_or_build(k, _no_build, _load)
    assert c2.stats.disk_hits == 1 and c2.stats.builds == 0 and c2.stats.rejected == 0
    assert p2.key == k
    assert p2.graph.blob == blob
    assert p2.uids == p1.uids and p2.engine == p1.engine and p2.workspace_size == p1.workspace_size
    assert p2.engine_id == p1.engine_id and p2.knobs == p1.knobs and p2.candidates == p1.candidates
    assert p2.tuning == p1.tuning
    assert p2.meta() == p1.meta()
    assert p2.source == "disk"
    assert not _bad_files(tmp_path)


def test_entry_file_layout(tmp_path):
    k = key()
    store = DiskStore(tmp_path)
    c = PlanCache(store=store)
    p = c.get_or_build(k, Builder(k), _load)
    fp = k.fingerprint()
    path = tmp_path / "plans" / fp[:2] / f"{fp}.plan"
    assert store.path(k) == path and path.is_file()
    assert list(store.entries()) == [path]

    data = path.read_bytes()
    head, sep, blob = data.partition(b"\n")
    assert sep == b"\n"
    header = json.loads(head)  # exactly one JSON line, then the raw blob
    assert blob == p.graph.blob
    assert header["format"] == ENTRY_FORMAT
    assert header["key_digest"] == fp
    assert header["blob_len"] == len(blob)
    import hashlib

    assert header["blob_sha256"] == hashlib.sha256(blob).hexdigest()
    assert header["plan"] == p.meta()
    assert PlanKey.from_json(header["key"]) == k
    # the store's own reader agrees
    e = store.load(path)
    assert e.key == k and e.blob == blob and e.header == header


def test_key_json_round_trip_and_stable_fingerprint():
    k = key()
    d = k.to_json()
    assert PlanKey.from_json(d) == k
    via_json = json.loads(json.dumps(d))  # lists instead of tuples, as read back from a file
    k2 = PlanKey.from_json(via_json)
    assert k2 == k and hash(k2) == hash(k)
    assert k2.fingerprint() == k.fingerprint() == key().fingerprint()
    assert len(k.fingerprint()) == 40
    assert key(pattern="other").fingerprint() != k.fingerprint()
    # independent of the process (hash randomization) that computes it
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import plankeys; print(plankeys.key().fingerprint())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).resolve().parents[1])],
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == k.fingerprint()


def test_plan_that_cannot_serialize_stays_in_memory(tmp_path):
    k = key()
    c = PlanCache(store=DiskStore(tmp_path))
    with pytest.warns(CacheWarning, match="cannot be serialized"):
        p = c.get_or_build(k, lambda: make_plan(k, graph=UnserializableGraph()), _load)
    assert c.get(k) is p
    assert c.stats.disk_writes == 0 and list(c.store.entries()) == []


# ----------------------------------------------------------------------------------------------
# corrupt entries: moved aside, warned about, rebuilt
# ----------------------------------------------------------------------------------------------
def _flip_blob_byte(path, other):
    data = bytearray(path.read_bytes())
    nl = data.index(b"\n")
    i = nl + 1 + (len(data) - nl - 1) // 2
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate_blob(path, other):
    data = path.read_bytes()
    path.write_bytes(data[:-100])


def _truncate_header(path, other):
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b"\n") // 2])


def _empty_file(path, other):
    path.write_bytes(b"")


def _header_not_json(path, other):
    data = path.read_bytes()
    path.write_bytes(b"{this is not json" + data[data.index(b"\n") :])


def _header_not_utf8(path, other):
    data = path.read_bytes()
    path.write_bytes(b"\xff\xfe\x00garbage" + data[data.index(b"\n") :])


def _header_json_list(path, other):
    data = path.read_bytes()
    path.write_bytes(b"[1, 2, 3]" + data[data.index(b"\n") :])


def _wrong_format(path, other):
    header, blob = _split(path)
    header["format"] = "fusekit-plan/0"
    path.write_bytes(json.dumps(header).encode() + b"\n" + blob)


def _wrong_blob_len(path, other):
    header, blob = _split(path)
    header["blob_len"] += 1
    path.write_bytes(json.dumps(header).encode() + b"\n" + blob)


def _entry_of_other_key(path, other):
    """The (valid) file of another key copied over this key's file."""
    path.write_bytes(other.read_bytes())


def _header_key_edited(path, other):
    """Header claims another key (digest updated too) but sits in this key's file."""
    header, blob = _split(path)
    ok = PlanKey.from_json(header["key"])
    fake = PlanKey(**{**{f: getattr(ok, f) for f in BASE}, "gpu": "NVIDIA A100-SXM4-80GB"})
    header["key"] = json.loads(json.dumps(fake.to_json()))
    header["key_digest"] = fake.fingerprint()
    path.write_bytes(json.dumps(header).encode() + b"\n" + blob)


CORRUPTIONS = {
    "flipped_blob_byte": (_flip_blob_byte, "checksum"),
    "truncated_blob": (_truncate_blob, "checksum"),
    "truncated_header": (_truncate_header, "no header line"),
    "empty_file": (_empty_file, "no header line"),
    "header_not_json": (_header_not_json, "not JSON"),
    "header_not_utf8": (_header_not_utf8, "not JSON"),
    "header_json_list": (_header_json_list, "unknown format"),
    "wrong_format": (_wrong_format, "unknown format"),
    "wrong_blob_len": (_wrong_blob_len, "checksum"),
    "file_of_other_key": (_entry_of_other_key, "does not match"),
    "header_key_edited": (_header_key_edited, "does not match"),
}


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_corrupt_entry_moved_aside_and_rebuilt(tmp_path, how):
    corrupt, why = CORRUPTIONS[how]
    store = DiskStore(tmp_path)
    k, other = key(), key(pattern="conv_bias")
    old, path = _write_entry(store, k)
    _, other_path = _write_entry(store, other)
    assert path != other_path
    corrupt(path, other_path)
    assert store.read  # sanity: the file is still there, now bad
    with pytest.raises(EntryError):
        store.load(path)

    new_blob = os.urandom(2048)
    build = Builder(k, new_blob)
    c = PlanCache(store=DiskStore(tmp_path))
    with pytest.warns(CacheWarning, match=why) as rec:
        p = c.get_or_build(k, build, _load)
    assert any("moved aside" in str(w.message) for w in rec)
    assert build.calls == 1 and p.graph.blob == new_blob
    assert c.stats.builds == 1 and c.stats.disk_hits == 0 and c.stats.disk_writes == 1

    bad = _bad_files(tmp_path)
    assert len(bad) == 1 and bad[0].name.startswith(path.name + ".")
    assert bad[0].parent == path.parent
    # the rebuilt entry replaced it and is good; the other key's entry is untouched
    e = store.load(path)
    assert e.key == k and e.blob == new_blob
    assert store.load(other_path).key == other
    assert store.verify() == []

    # and a fresh process-level cache now loads it without warning or building
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p2 = PlanCache(store=DiskStore(tmp_path)).get_or_build(k, _no_build, _load)
    assert p2.graph.blob == new_blob


def test_store_read_of_a_bad_entry(tmp_path):
    store = DiskStore(tmp_path)
    k = key()
    _, path = _write_entry(store, k)
    assert store.read(k).blob == _split(path)[1]
    _flip_blob_byte(path, None)
    with pytest.warns(CacheWarning, match="checksum"):
        assert store.read(k) is None
    assert not path.exists() and len(_bad_files(tmp_path)) == 1
    assert store.read(k) is None  # now simply absent


def test_blob_refused_by_load_is_rejected_and_rebuilt(tmp_path):
    k = key()
    _, path = _write_entry(DiskStore(tmp_path), k)
    new_blob = os.urandom(512)
    build = Builder(k, new_blob)
    c = PlanCache(store=DiskStore(tmp_path))
    with pytest.warns(CacheWarning, match="could not load it: RuntimeError: CUDNN_STATUS_BAD_PARAM"):
        p = c.get_or_build(k, build, _refusing_load)
    assert c.stats.rejected == 1 and c.stats.disk_hits == 0
    assert build.calls == 1 and p is build.built[0]
    assert len(_bad_files(tmp_path)) == 1
    assert DiskStore(tmp_path).load(path).blob == new_blob


# ----------------------------------------------------------------------------------------------
# entries of other library versions / GPUs are never used
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("cudnn_backend", 90500),
        ("frontend", "1.31.0"),
        ("gpu", "NVIDIA A100-SXM4-80GB"),
        ("cc", (8, 0)),
    ],
    ids=lambda v: f"v_{v}",  # no bare "gpu" id: conftest skips items with the "gpu" keyword
)
def test_other_versions_or_gpu_use_other_files(tmp_path, field, value):
    a, b = key(), key(**{field: value})
    store = DiskStore(tmp_path)
    assert store.path(a) != store.path(b)
    pa = PlanCache(store=store).get_or_build(a, Builder(a), _load)

    build = Builder(b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = PlanCache(store=DiskStore(tmp_path))
        pb = c.get_or_build(b, build, _load)
    assert build.calls == 1 and c.stats.disk_hits == 0
    assert pb.graph.blob != pa.graph.blob
    assert len(list(store.entries())) == 2
    assert store.load(store.path(a)).blob == pa.graph.blob  # a's entry untouched
    assert store.load(store.path(b)).key == b
    assert not _bad_files(tmp_path)


# ----------------------------------------------------------------------------------------------
# concurrency (processes, spawn)
# ----------------------------------------------------------------------------------------------
N_KEYS = 20


def _logged_build(k, logdir, sleep):
    with open(os.path.join(logdir, f"{k.pattern}.log"), "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(sleep)
    return make_plan(k)


def _worker_get_or_build(root, logdir, order, barrier, q):
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            c = PlanCache(store=DiskStore(root))
            barrier.wait(timeout=60)
            blobs = {}
            for i in order:
                k = key(pattern=f"p{i}")
                p = c.get_or_build(k, functools.partial(_logged_build, k, logdir, 0.01), _load)
                blobs[i] = p.graph.blob
        q.put((os.getpid(), c.stats.builds, c.stats.disk_hits, blobs, [str(w.message) for w in rec], None))
    except BaseException as e:  # noqa: BLE001
        q.put((os.getpid(), -1, -1, {}, [], repr(e)))


def _collect(procs, q, n, timeout=60):
    results = [q.get(timeout=timeout) for _ in range(n)]
    for p in procs:
        p.join(timeout=timeout)
        assert p.exitcode == 0
    return results


def test_concurrent_processes_build_each_key_once(tmp_path):
    ctx = mp.get_context("spawn")
    root, logdir = tmp_path / "store", tmp_path / "logs"
    logdir.mkdir()
    n_proc = 4
    orders = []
    for w in range(n_proc):
        o = list(range(N_KEYS))
        if w % 2:
            o.reverse()
        o = o[w * 5 :] + o[: w * 5]  # rotate too: every process starts somewhere else
        orders.append(o)
    barrier, q = ctx.Barrier(n_proc), ctx.Queue()
    procs = [ctx.Process(target=_worker_get_or_build, args=(str(root), str(logdir), o, barrier, q)) for o in orders]
    for p in procs:
        p.start()
    results = _collect(procs, q, n_proc)
    for pid, builds, hits, blobs, warned, err in results:
        assert err is None, err
        assert warned == []
        assert builds + hits == N_KEYS
    assert sum(r[1] for r in results) == N_KEYS  # each key built by exactly one process
    # every process got the same plan (blob) for a key: the builder's, read back by the others
    for i in range(N_KEYS):
        assert len({r[3][i] for r in results}) == 1

    store = DiskStore(root)
    for i in range(N_KEYS):
        k = key(pattern=f"p{i}")
        log = (logdir / f"p{i}.log").read_text().split()
        assert len(log) == 1, f"key p{i} built {len(log)} times"
        e = store.load(store.path(k))
        assert e.key == k and e.blob == results[0][3][i]
    assert len(list(store.entries())) == N_KEYS
    assert store.verify() == []
    assert not _bad_files(root) and not _tmp_files(root)


def _writer_blob(w, j):
    return (f"writer{w}-iter{j}|".encode() * 4096)[: 64 * 1024 + 97 * w + j]


def _worker_write(root, w, n, barrier, q):
    try:
        store = DiskStore(root)
        k = key()
        barrier.wait(timeout=60)
        for j in range(n):
            store.write(k, {"writer": w, "iter": j}, _writer_blob(w, j))
        q.put((w, None))
    except BaseException as e:  # noqa: BLE001
        q.put((w, repr(e)))


def test_concurrent_writes_never_expose_a_bad_entry(tmp_path):
    ctx = mp.get_context("spawn")
    n_proc, n_writes = 3, 40
    barrier, q = ctx.Barrier(n_proc + 1), ctx.Queue()
    procs = [ctx.Process(target=_worker_write, args=(str(tmp_path), w, n_writes, barrier, q)) for w in range(n_proc)]
    for p in procs:
        p.start()
    store = DiskStore(tmp_path)
    k = key()
    seen_none = seen = 0
    seen_writers = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)  # a reader moving a torn entry aside fails here
        barrier.wait(timeout=60)
        deadline = time.monotonic() + 60
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            e = store.read(k)
            if e is None:
                seen_none += 1
                continue
            seen += 1
            m = e.header["plan"]
            assert e.blob == _writer_blob(m["writer"], m["iter"])  # header and blob from one write
            seen_writers.add(m["writer"])
        results = _collect(procs, q, n_proc)
    assert [err for _, err in results] == [None] * n_proc
    assert seen > 0
    final = store.read(k)
    assert final is not None
    assert final.blob == _writer_blob(final.header["plan"]["writer"], n_writes - 1)  # some writer's last
    assert list(store.entries()) == [store.path(k)]
    assert not _bad_files(tmp_path) and not _tmp_files(tmp_path)


# ----------------------------------------------------------------------------------------------
# atomic write
# ----------------------------------------------------------------------------------------------
def test_failed_rename_keeps_previous_entry_and_no_temp_files(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    k = key()
    old, path = _write_entry(store, k)
    before = path.read_bytes()

    calls = []

    def failing_replace(src, dst, *a, **kw):
        calls.append((src, dst))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_mod.os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        store.write(k, {"engine": "new"}, os.urandom(4096))
    # through the cache: one warning, and the plan is built and kept in memory
    c = PlanCache(store=store)
    k2 = key(pattern="p2")
    with pytest.warns(CacheWarning, match="No space left"):
        p2 = c.get_or_build(k2, Builder(k2), _load)
    assert c.get(k2) is p2 and c.stats.disk_writes == 0 and c.stats.disk_errors == 1
    monkeypatch.undo()

    assert len(calls) == 2 and Path(calls[0][1]) == path
    assert path.read_bytes() == before
    e = store.read(k)
    assert e is not None and e.blob == old.graph.blob and e.header["plan"] == old.meta()
    assert not store.path(k2).exists()
    assert not _tmp_files(tmp_path)
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file() and "locks" not in p.parts) == [path]


# ----------------------------------------------------------------------------------------------
# verify / clear / export / import
# ----------------------------------------------------------------------------------------------
def _populate(root, n=5):
    store = DiskStore(root)
    ks = [key(pattern=f"p{i}") for i in range(n)]
    plans = {k: _write_entry(store, k)[0] for k in ks}
    return store, ks, plans


def test_verify_finds_and_fixes_bad_entries(tmp_path):
    store, ks, _ = _populate(tmp_path)
    assert store.verify() == []
    bad_paths = {store.path(ks[1]), store.path(ks[3])}
    _flip_blob_byte(store.path(ks[1]), None)
    _header_not_json(store.path(ks[3]), None)

    found = store.verify()
    assert {p for p, _ in found} == bad_paths
    assert any("checksum" in why for _, why in found) and any("not JSON" in why for _, why in found)
    assert all(p.exists() for p in bad_paths)  # only reported
    assert not _bad_files(tmp_path)

    assert {p for p, _ in store.verify(fix=True)} == bad_paths
    assert not any(p.exists() for p in bad_paths)
    assert len(_bad_files(tmp_path)) == 2
    assert store.verify() == []
    assert len(list(store.entries())) == 3
    for k in (ks[0], ks[2], ks[4]):
        assert store.read(k).key == k


def test_clear_removes_everything(tmp_path):
    store, ks, _ = _populate(tmp_path)
    _flip_blob_byte(store.path(ks[0]), None)
    store.verify(fix=True)
    assert len(_bad_files(tmp_path)) == 1
    assert store.clear() == 4
    assert list(store.entries()) == []
    assert not _bad_files(tmp_path)
    assert store.read(ks[1]) is None
    assert store.clear() == 0
    assert DiskStore(tmp_path / "never-created").clear() == 0


def _without_created(h):
    return {k: v for k, v in h.items() if k != "created"}


def test_export_import_round_trip(tmp_path):
    src, ks, plans = _populate(tmp_path / "a", n=6)
    _truncate_blob(src.path(ks[2]), None)  # invalid entries are not exported
    dest_file = tmp_path / "plans.tar.gz"
    assert src.export(dest_file) == 5
    assert tarfile.is_tarfile(dest_file)
    assert not list(tmp_path.glob(".*.tmp"))

    dst = DiskStore(tmp_path / "b")
    n, problems = dst.import_(dest_file)
    assert (n, problems) == (5, [])
    assert dst.verify() == []
    rel = lambda s: sorted(p.relative_to(s.root) for p in s.entries())  # noqa: E731
    assert rel(dst) == [p for p in rel(src) if p != src.path(ks[2]).relative_to(src.root)]
    for k in ks:
        if k == ks[2]:
            assert dst.read(k) is None
            continue
        a, b = src.load(src.path(k)), dst.load(dst.path(k))
        assert b.blob == a.blob == plans[k].graph.blob
        assert _without_created(b.header) == _without_created(a.header)
        # and a cache on the imported store loads it without building
        p = PlanCache(store=dst).get_or_build(k, _no_build, _load)
        assert p.graph.blob == a.blob and p.meta() == plans[k].meta()


def test_import_skips_corrupt_members(tmp_path):
    src, ks, plans = _populate(tmp_path / "a", n=3)
    archive = tmp_path / "mixed.tar.gz"

    def add(tar, name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    good = [src.path(k) for k in ks]
    corrupt = bytearray(good[1].read_bytes())
    corrupt[-1] ^= 0xFF
    with tarfile.open(archive, "w:gz") as tar:
        add(tar, f"plans/{good[0].parent.name}/{good[0].name}", good[0].read_bytes())
        add(tar, f"plans/{good[1].parent.name}/{good[1].name}", bytes(corrupt))
        add(tar, f"plans/{good[2].parent.name}/{good[2].name}", good[2].read_bytes())
        # a valid entry under the wrong file name (claims another key's digest)
        add(tar, "plans/00/" + "0" * 40 + ".plan", good[0].read_bytes())
        add(tar, "README.txt", b"not an entry")  # ignored: not a .plan member

    dst = DiskStore(tmp_path / "b")
    n, problems = dst.import_(archive)
    assert n == 2
    assert len(problems) == 2
    assert any("checksum" in p and good[1].name in p for p in problems)
    assert any("does not match" in p for p in problems)
    assert dst.read(ks[1]) is None
    for k in (ks[0], ks[2]):
        assert dst.read(k).blob == plans[k].graph.blob
    assert len(list(dst.entries())) == 2
    assert dst.verify() == []


# ----------------------------------------------------------------------------------------------
# cache directory, configure(), mode
# ----------------------------------------------------------------------------------------------
def test_default_cache_dir_honors_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEKIT_CACHE_DIR", str(tmp_path / "plans-here"))
    assert default_cache_dir() == tmp_path / "plans-here"
    assert DiskStore().root == tmp_path / "plans-here"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FUSEKIT_CACHE_DIR", "~/c")
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("FUSEKIT_CACHE_DIR")
    d = default_cache_dir()
    assert d.name == "fusekit" and d != tmp_path / "c"


def test_default_cache_off_and_on(tmp_path, monkeypatch, fresh_session):
    monkeypatch.setenv("FUSEKIT_CACHE_DIR", "off")
    assert default_cache().store is None
    fresh_session.cache = None
    monkeypatch.setenv("FUSEKIT_CACHE_DIR", str(tmp_path))
    c = default_cache()
    assert c.store is not None and c.store.root == tmp_path
    assert default_cache() is c


def test_configure(tmp_path, monkeypatch, fresh_session):
    monkeypatch.delenv("FUSEKIT_MODE", raising=False)
    c = configure(cache_dir=tmp_path, mode="autotune")
    assert isinstance(c, PlanCache) and default_cache() is c
    assert c.mode == "autotune"
    assert isinstance(c.store, DiskStore) and c.store.root == tmp_path
    k = key()
    c.get_or_build(k, Builder(k), _load)
    assert c.store.path(k).is_file() and c.store.path(k).is_relative_to(tmp_path)

    evicted = []
    c.on_evict(evicted.append)
    c2 = configure(disk=False)
    assert c2 is not c and default_cache() is c2
    assert c2.store is None and c2.mode == "heuristic"
    assert len(evicted) == 1 and evicted[0].evicted  # the old cache's plans were dropped

    with pytest.raises(ValueError, match="mode"):
        configure(cache_dir=tmp_path, mode="fastest")
    assert default_cache() is c2  # a bad call leaves the current cache in place


def test_mode_validation_and_env(monkeypatch):
    monkeypatch.delenv("FUSEKIT_MODE", raising=False)
    assert PlanCache().mode == "heuristic"
    assert PlanCache(mode="autotune").mode == "autotune"
    with pytest.raises(ValueError, match="mode must be one of"):
        PlanCache(mode="Autotune")
    monkeypatch.setenv("FUSEKIT_MODE", "autotune")
    assert PlanCache().mode == "autotune"
    assert PlanCache(mode="heuristic").mode == "heuristic"  # the argument wins
    monkeypatch.setenv("FUSEKIT_MODE", "turbo")
    with pytest.raises(ValueError, match="turbo"):
        PlanCache()


def test_two_bad_entries_moved_aside_in_one_millisecond_are_both_kept(tmp_path, monkeypatch):
    """Moved-aside files were named <name>.<ms>.bad: a second one within the same millisecond
    replaced the first (seen in CI, where a test quarantined three files back to back)."""
    import time

    from fusekit.engine.cache import DiskStore

    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    store = DiskStore(tmp_path)
    p = tmp_path / "x.plan"
    for i in range(3):
        p.write_bytes(b"bad %d" % i)
        with pytest.warns(Warning, match="ignoring"):
            store.quarantine(p, "test")
    kept = sorted(q.read_bytes() for q in tmp_path.glob("x.plan.*.bad"))
    assert kept == [b"bad 0", b"bad 1", b"bad 2"]
