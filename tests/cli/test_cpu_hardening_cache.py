"""The store's edge cases: special files where entries or shards belong are reported, never waited
on; decision files of an unexpected layout are reported, not a traceback."""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest

from fusekit.engine.cache import DiskStore, fusion_digest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_cli_cache import BUILT, invoke, store  # noqa: E402,F401  (the fixture)


def _within(seconds, fn):
    """fn() run in a thread; fails the test if it has not returned in ``seconds`` (a hang)."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s (blocked on a special file?)"
    return out["r"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("cmd", [("cache", "ls"), ("cache", "verify"), ("cache", "show", "0a"), ("cache", "verify", "--fix")])
def test_a_fifo_in_the_store_is_reported_not_waited_on(store, cmd, tmp_path):
    fifo = store.plans_dir / "0a" / ("0a" + "0" * 38 + ".plan")
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    r = _within(20, lambda: invoke(*cmd, "--cache-dir", store.root))
    assert "Traceback" not in r.output
    if cmd[1] == "verify":
        assert "not a regular file" in r.output and r.exit_code == (0 if "--fix" in cmd else 1), r.output


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_export_and_the_librarys_lookup_skip_a_fifo(store, tmp_path):
    from plankeys import key, specs

    k = key(specs=specs(n=6))
    fifo = store.path(k)
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    r = _within(20, lambda: invoke("cache", "export", tmp_path / "out.tar.gz", "--cache-dir", store.root))
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    with pytest.warns(Warning, match="not a regular file"):
        got = _within(20, lambda: store.read(k))
    assert got is None  # moved aside, to be rebuilt


def test_a_shard_replaced_by_a_file_is_reported_by_verify(store):
    shard = store.plans_dir / BUILT[:2]
    for p in shard.iterdir():
        p.unlink()
    shard.rmdir()
    shard.write_text("not a directory")
    r = invoke("cache", "verify", "--cache-dir", store.root)
    assert r.exit_code == 1 and "not a directory" in r.output and BUILT[:2] in r.output, r.output
    r = invoke("cache", "verify", "--fix", "--cache-dir", store.root)
    assert r.exit_code == 0 and not shard.exists(), r.output


@pytest.mark.parametrize("bad_key", [{"tag": "conv_bias_act", "arrays": "abc", "cc": [9, 0]},
                                     {"tag": "conv_bias_act", "arrays": [[[1, 2], "float16"]], "cc": [9, 0]},
                                     {"tag": 7, "arrays": [], "cc": [9, 0]}, {"tag": "t", "arrays": [], "cc": 90}])
def test_a_decision_file_with_an_unexpected_key_is_reported(store, bad_key):
    digest = fusion_digest(bad_key)
    p = store.fusion_dir / digest[:2] / f"{digest}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"format": 1, "key": bad_key, "key_digest": digest, "fused_ms": 1.0, "split_ms": 2.0}))
    from fusekit.engine.cache import FUSION_FORMAT

    rec = json.loads(p.read_text())
    rec["format"] = FUSION_FORMAT
    p.write_text(json.dumps(rec))
    r = invoke("cache", "ls", "--cache-dir", store.root)
    assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception, SystemExit), r.output
    r = invoke("cache", "verify", "--cache-dir", store.root)
    assert r.exit_code == 1 and "key" in r.output and digest[:12] in r.output, r.output


def test_concurrent_imports_count_each_new_plan_once(store, tmp_path):
    """Eight processes importing the same export: the "new" counts they report add up to the plans
    the store gained, and every one exits 0."""
    import subprocess

    archive = tmp_path / "plans.tar.gz"
    assert invoke("cache", "export", archive, "--cache-dir", store.root).exit_code == 0
    dest = tmp_path / "dest"
    procs = [subprocess.Popen([sys.executable, "-m", "fusekit", "cache", "import", str(archive), "--cache-dir", str(dest)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(8)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    import re

    news = [int(re.search(r"\((\d+) new, (\d+) replaced\)", o).group(1)) for o in outs]
    assert sum(news) == len(list(DiskStore(dest).entries())) == 2, outs
