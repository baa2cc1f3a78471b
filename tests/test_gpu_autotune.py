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
