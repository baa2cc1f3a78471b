"""GPU: the autotuner, autotune mode, and plans persisted on disk across processes."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fusekit
from fusekit.engine import oracle
from fusekit.engine.autotune import TuneOptions
from fusekit.engine.cache import CacheWarning, DiskStore, PlanCache
from fusekit.dispatch import choice

pytestmark = pytest.mark.gpu

SHAPES = {"x": (8, 64, 28, 28), "w": (128, 64, 1, 1), "b": (128,)}


def _torch():
    return pytest.importorskip("torch")


def _operands(torch, shapes=SHAPES, dtype="float16"):
    dt = getattr(torch, dtype)
    x = torch.randn(shapes["x"], device="cuda").to(dt).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(shapes["w"], device="cuda") * 0.1).to(dt).contiguous(memory_format=torch.channels_last)
    b = torch.randn(shapes["b"], device="cuda").to(dt)
    return x, w, b


def test_tuner_no_slower_than_heuristic(tmp_path):
    torch = _torch()
    cache = PlanCache(store=DiskStore(tmp_path))
    x, w, b = _operands(torch)
    res = fusekit.autotune("conv_bias_relu", x, w, b, cache=cache, options=TuneOptions(budget_s=5.0))
    ok = [c for c in res.candidates if c.verdict == "ok"]
    assert len(ok) >= 2, [c.verdict for c in res.candidates]
    assert res.best_us <= res.heuristic_us
    assert res.best_us == min(c.time_us for c in ok)
    best = next(c for c in res.candidates if c.index == res.best)
    assert best.verdict == "ok" and best.error is not None and best.workspace >= 0
    # the tuned plan is what calls now run, and it is on disk
    plan = fusekit.plan_for("conv_bias_relu", x, w, b, cache=cache)
    assert plan.source == "tuned" and plan.engine == best.name
    assert cache.store.read(plan.key) is not None
    y = fusekit.call("conv_bias_relu", x, w, b, cache=cache)
    torch.cuda.synchronize()
    (ref,) = oracle.evaluate("conv_bias_relu", x.double().cpu().numpy(), w.double().cpu().numpy(), b.double().cpu().numpy())
    err = np.linalg.norm(y.double().cpu().numpy() - ref) / np.linalg.norm(ref)
    assert err < 2e-3


def test_tuner_rejects_a_wrong_candidate(tmp_path):
    torch = _torch()
    seen = []

    def corrupt(index, outs):
        seen.append(index)
        if len(seen) == 2:  # the first candidate checked after the reference
            outs[0].add_(0.5)

    x, w, b = _operands(torch)
    res = fusekit.autotune(
        "conv_bias_relu", x, w, b, cache=PlanCache(store=DiskStore(tmp_path)), options=TuneOptions(budget_s=5.0, corrupt=corrupt)
    )
    bad = next(c for c in res.candidates if c.index == seen[1])
    assert bad.verdict.startswith("rejected"), bad.verdict
    assert res.best != bad.index
    assert all(c.verdict != "rejected" or c.index == bad.index for c in res.candidates if c.verdict.startswith("rejected"))


def test_autotune_mode_on_first_use(tmp_path):
    torch = _torch()
    cache = PlanCache(store=DiskStore(tmp_path), mode="autotune")
    x, w, b = _operands(torch, {"x": (2, 32, 14, 14), "w": (32, 32, 3, 3), "b": (32,)})
    plan = fusekit.plan_for("conv_bias_relu", x, w, b, padding=1, cache=cache)
    assert plan.source == "tuned" and plan.tuning and any(c["verdict"] == "ok" for c in plan.tuning)
    header = cache.store.read(plan.key).header
    assert header["plan"]["source"] == "tuned" and header["plan"]["engine"] == plan.engine


CHILD = textwrap.dedent(
    """
    import json, sys, time, torch, fusekit
    torch.manual_seed(int(sys.argv[1]))
    x = torch.randn(8, 64, 28, 28, device="cuda").half().contiguous(memory_format=torch.channels_last)
    w = (torch.randn(128, 64, 1, 1, device="cuda") * 0.1).half().contiguous(memory_format=torch.channels_last)
    b = torch.randn(128, device="cuda").half()
    if sys.argv[2] == "tune":
        fusekit.autotune("conv_bias_relu", x, w, b, options=fusekit.TuneOptions(budget_s=5.0))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = fusekit.conv_bias_relu(x, w, b)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    ref = torch.relu(torch.nn.functional.conv2d(x.double(), w.double(), b.double()))
    err = float((y.double() - ref).norm() / ref.norm())
    plan = fusekit.plan_for("conv_bias_relu", x, w, b)
    st = fusekit.default_cache().stats
    print(json.dumps(dict(source=plan.source, engine=plan.engine, builds=st.builds, disk_hits=st.disk_hits,
                          first_ms=first_ms, err=err)))
    """
)


def _child(tmp_path, seed, mode):
    env = dict(os.environ, FUSEKIT_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", CHILD, str(seed), mode], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_second_process_loads_tuned_plan_from_disk(tmp_path):
    first = _child(tmp_path, 1, "tune")
    assert first["source"] == "tuned" and first["err"] < 2e-3
    second = _child(tmp_path, 2, "run")  # fresh process, fresh data, same key
    assert second["source"] == "disk" and second["builds"] == 0 and second["disk_hits"] == 1
    assert second["engine"] == first["engine"]
    assert second["err"] < 2e-3
    print(f"first call in a warm process: {second['first_ms']:.1f} ms")


def test_bad_blob_is_rebuilt_with_a_warning(tmp_path):
    torch = _torch()
    store = DiskStore(tmp_path)
    cache = PlanCache(store=store)
    x, w, b = _operands(torch)
    plan = fusekit.plan_for("conv_bias_relu", x, w, b, cache=cache)
    entry = store.read(plan.key)
    # a well-formed entry (valid checksum) whose graph bytes cuDNN cannot load
    store.write(plan.key, entry.header["plan"], b"\x00not a cudnn graph" * 8)
    cache2 = PlanCache(store=store)
    with pytest.warns(CacheWarning, match="could not load"):
        plan2 = fusekit.plan_for("conv_bias_relu", x, w, b, cache=cache2)
    assert plan2.source == "built" and cache2.stats.rejected == 1 and cache2.stats.builds == 1
    assert list(store.plans_dir.glob("*/*.bad"))
    y = fusekit.call("conv_bias_relu", x, w, b, cache=cache2)
    ref = torch.relu(torch.nn.functional.conv2d(x.double(), w.double(), b.double()))
    assert float((y.double() - ref).norm() / ref.norm()) < 2e-3


FUSION_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from fusekit import dispatch, ops, session
    from fusekit.dispatch import choice

    if sys.argv[1] == "no-timing":  # a later process must read the decisions, not time them again
        def refuse(*a, **k):
            raise AssertionError("fused_or_split timed again")
        choice.device_ms = refuse
    g = torch.Generator(device="cuda").manual_seed(int(sys.argv[2]))
    cl = torch.channels_last
    x = torch.randn(64, 16, 32, 32, device="cuda", generator=g).contiguous(memory_format=cl)
    w = (torch.randn(16, 3, 3, 3, device="cuda", generator=g) * 0.2).contiguous(memory_format=cl)
    b = torch.rand(3, device="cuda", generator=g)
    y = ops.conv_transpose_bias_relu(x, w, b, padding=1, stride=2, output_padding=1)
    ref = torch.relu(torch.nn.functional.conv_transpose2d(x.double(), w.double(), b.double(), padding=1, stride=2, output_padding=1))
    err = float((y.double() - ref).norm() / ref.norm())
    times = sorted([k[0][0], k[1], list(t)] for k, t in session.current().fusion_times.items())
    print(json.dumps(dict(times=times, err=err)))
    """
)


def test_second_process_reads_fused_or_split_decisions_from_disk(tmp_path):
    """The float32 transposed conv + bias + ReLU to 3 channels times fused against split (and, for the
    split, its NCHW route) on first use; a second process with the same cache directory reads both
    decisions from the disk store and runs the kept graphs without timing (device_ms raises there)."""
    env = dict(os.environ, FUSEKIT_CACHE_DIR=str(tmp_path))

    def child(*args):
        r = subprocess.run([sys.executable, "-c", FUSION_CHILD, *args], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = child("time", "1")
    names = [t[0] for t in first["times"]]
    assert "conv_transpose_bias_relu" in names and all(f > 0 and s > 0 for _, _, (f, s) in first["times"]), first
    assert len(list((tmp_path / "fusion").glob("*/*.json"))) == len(first["times"])
    second = child("no-timing", "2")  # fresh process, fresh data
    # the inner decision (the split's NCHW route) is read only when the outer one keeps the split
    outer = [t for t in first["times"] if t[0] == "conv_transpose_bias_relu"]
    assert outer == [t for t in second["times"] if t[0] == "conv_transpose_bias_relu"], (first, second)
    assert all(t in first["times"] for t in second["times"]), (first, second)
    if choice.split_wins(tuple(outer[0][2])):
        assert second["times"] == first["times"], (first, second)
    assert first["err"] < 2e-3 and second["err"] < 2e-3
    print(f"decisions {first['times']}; errors {first['err']:.1e} / {second['err']:.1e}")
