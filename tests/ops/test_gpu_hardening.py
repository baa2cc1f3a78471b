"""GPU: the numerics policy on real plans (a float32 Linear must be IEEE or say it is not), a workspace the device
has no room for (torch.cuda.set_per_process_memory_fraction, in a child process), eight threads on
eight streams calling different keys at once, and a stream of new keys through a small plan cache.

Child processes run with FUSEKIT_CACHE_DIR=off: each builds its own plans, and the memory limit
or the cache size set there leaves the other tests alone. Each prints one JSON line of figures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import threading

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from helpers import float64_nchw, rel

import fusekit
from fusekit import ops
from fusekit.ops import pool

F = torch.nn.functional


def child(code: str, timeout: int = 300, **env: str) -> dict:
    """Run ``code`` in a fresh Python (memory cache only, plus ``env``); its last stdout line, as JSON."""
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, "FUSEKIT_CACHE_DIR": "off", **env},
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, r.stdout[-4000:] + r.stderr[-4000:]
    print(lines[-1])
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------------------------
# numerics policy
# ----------------------------------------------------------------------------------------------
def test_float32_linear_is_ieee_or_says_it_is_not():
    """A float32 fusekit.torch.Linear (7x300 -> 77) must not come out at TF32's error (2.9e-4 relative
    to float64) without a word. Under the default policy (PyTorch's: no TF32 for
    matmuls) the module is IEEE float32 (~1e-6; it runs PyTorch's linear, cuDNN 9.19 having no IEEE
    float32 matmul plan), silently; the linear_bias pattern itself is IEEE or a NumericsWarning names the key."""
    res = child("""
        import json, warnings, torch, fusekit, fusekit.torch as ft
        torch.manual_seed(0)
        lin = ft.Linear(300, 77).cuda()
        x = torch.randn(7, 300, device="cuda")
        w, b = lin.weight.detach(), lin.bias.detach()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            with torch.no_grad():
                y = lin(x)
            torch.cuda.synchronize()
        module_warned = [str(m.message) for m in got]
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            yp = fusekit.call("linear_bias", x, w, b)
            torch.cuda.synchronize()
        ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
        plan = fusekit.plan_for("linear_bias", x, w, b)
        print(json.dumps(dict(
            err=float((y.double() - ref).norm() / ref.norm()), pattern_err=float((yp.double() - ref).norm() / ref.norm()),
            module_warned=module_warned, warned=[str(w.message) for w in got if issubclass(w.category, fusekit.NumericsWarning)],
            engine=plan.engine, tf32=plan.key.tf32,
        )))
    """)
    assert res["err"] < 1e-5 and not res["module_warned"], res
    assert res["tf32"] is False  # matmuls: IEEE by default, as torch.backends.cuda.matmul.allow_tf32
    if res["warned"]:
        assert len(res["warned"]) == 1, res
        msg = res["warned"][0]
        assert "linear_bias(" in msg and "x=float32[1, 7, 300]" in msg and "allow_tf32" in msg
        assert "TF32" in res["engine"] and res["pattern_err"] < 5e-3, res
    else:
        assert res["pattern_err"] < 1e-5, f"float32 linear_bias at {res['pattern_err']:.2e} relative error with no NumericsWarning: {res}"


def test_fusekit_torch_follows_pytorchs_tf32_switches():
    """With torch.backends.cudnn.allow_tf32 = False (no FUSEKIT_ALLOW_TF32, no configure), a float32
    fusekit.torch.Conv2d with a fused ReLU gives IEEE float32 results, forward and backward, as
    PyTorch's does; switched back on, the same module's plans are TF32 again (a new dispatch key)."""
    res = child("""
        import json, torch, fusekit, fusekit.torch as ft
        torch.manual_seed(0)
        conv = ft.Conv2d(32, 64, 3, padding=1, activation="relu").cuda()
        x = torch.randn(4, 32, 16, 16, device="cuda").contiguous(memory_format=torch.channels_last).requires_grad_()
        w, b = conv.weight.detach().double(), conv.bias.detach().double()
        xd = x.detach().double().requires_grad_()
        ref = torch.relu(torch.nn.functional.conv2d(xd, w, b, padding=1))
        g = torch.randn_like(ref)
        ref.backward(g)
        def run():
            x.grad = None
            y = conv(x)
            y.backward(g.float())
            torch.cuda.synchronize()
            rel = lambda a, r: float((a.double() - r).norm() / r.norm())
            key = fusekit.plan_for("conv_bias_relu", x.detach(), conv.weight.detach(), conv.bias.detach(), padding=(1, 1)).key
            return dict(fwd=rel(y, ref), dx=rel(x.grad, xd.grad), tf32=key.tf32)
        torch.backends.cudnn.allow_tf32 = False
        off = run()
        torch.backends.cudnn.allow_tf32 = True
        on = run()
        print(json.dumps(dict(off=off, on=on)))
    """, FUSEKIT_ALLOW_TF32="")
    assert res["off"]["tf32"] is False and res["on"]["tf32"] is True, res
    assert res["off"]["fwd"] < 1e-5 and res["off"]["dx"] < 1e-4, res  # IEEE float32 (TF32: ~5e-4 forward)
    assert res["on"]["fwd"] < 5e-3, res


def test_policy_is_part_of_the_key_and_chooses_the_plans():
    """Under each policy: float32 conv and Linear keys record it; IEEE keys give float32 accuracy
    (under 5e-5 for the conv, whose IEEE engines include Winograd; TF32 gives ~5e-4) or warn;
    TF32-allowed keys never warn and stay within TF32's error."""
    res = child("""
        import json, warnings, torch, fusekit
        from fusekit import ops
        torch.manual_seed(0)
        x = torch.randn(4, 32, 16, 16, device="cuda").contiguous(memory_format=torch.channels_last)
        w = (torch.randn(64, 32, 3, 3, device="cuda") / 17).contiguous(memory_format=torch.channels_last)
        b = torch.randn(64, device="cuda")
        xl, wl, bl = torch.randn(7, 300, device="cuda"), torch.randn(77, 300, device="cuda") / 17, torch.randn(77, device="cuda")
        conv_ref = torch.nn.functional.conv2d(x.double(), w.double(), b.double(), padding=1)
        lin_ref = torch.nn.functional.linear(xl.double(), wl.double(), bl.double())
        rel = lambda a, r: float((a.double() - r).norm() / r.norm())
        out = {}
        for name, policy in (("default", None), ("none", False), ("all", True), ("matmul", "matmul")):
            fusekit.configure(disk=False, allow_tf32=policy)
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                yc, yl = ops.conv_bias(x, w, b, padding=1), ops.linear_bias(xl, wl, bl)
                torch.cuda.synchronize()
            out[name] = dict(
                conv_tf32=fusekit.plan_for("conv_bias", x, w, b, padding=1).key.tf32,
                linear_tf32=fusekit.plan_for("linear_bias", xl, wl, bl).key.tf32,
                conv_err=rel(yc, conv_ref), linear_err=rel(yl, lin_ref),
                warned=sorted({str(m.message).split("for ")[1].split("(")[0] for m in got if issubclass(m.category, fusekit.NumericsWarning)}),
            )
        print(json.dumps(out))
    """)
    expect = {"default": (True, False), "none": (False, False), "all": (True, True), "matmul": (False, True)}
    said: set[str] = set()  # NumericsWarning is said once per key and process; the policies ran in expect's order
    for name, (conv_tf32, lin_tf32) in expect.items():
        r = res[name]
        assert (r["conv_tf32"], r["linear_tf32"]) == (conv_tf32, lin_tf32), (name, r)
        for what, allowed in (("conv", conv_tf32), ("linear", lin_tf32)):
            pattern = "conv_bias" if what == "conv" else "linear_bias"
            err = r[f"{what}_err"]
            if allowed:
                assert pattern not in r["warned"] and err < 5e-3, (name, what, r)
            else:
                ieee = 5e-5 if what == "conv" else 1e-5
                assert err < ieee or ((pattern in r["warned"] or pattern in said) and err < 5e-3), (name, what, r)
        said |= set(r["warned"])


# ----------------------------------------------------------------------------------------------
# workspace out of memory
# ----------------------------------------------------------------------------------------------
OOM_CHILD = """
import json, warnings, torch, torch.nn.functional as F, fusekit
from fusekit.engine import lower
from fusekit.engine.runtime import current_runtime, forget_stream
from fusekit.adapters import library

torch.manual_seed(0)
ad, side = library("torch"), torch.cuda.Stream()
cl = lambda t: t.contiguous(memory_format=torch.channels_last)
h16, f32 = torch.float16, torch.float32

def case(pattern, dtype, layout, shapes, out_shape, attrs, ref):
    mk = (lambda t: cl(t)) if layout == "NHWC" else (lambda t: t.contiguous())
    arrays = [mk(torch.randn(s, device="cuda", dtype=dtype)) for s in shapes]
    return pattern, arrays, mk(torch.empty(out_shape, device="cuda", dtype=dtype)), attrs, ref

d = lambda t: t.double()
CANDIDATES = [
    case("conv_wgrad", h16, "NHWC", [(16, 64, 28, 28), (16, 128, 28, 28)], (128, 64, 3, 3), dict(kernel=(3, 3), padding=1),
         lambda a, at: torch.nn.grad.conv2d_weight(d(a[0]), (128, 64, 3, 3), d(a[1]), padding=1)),
    case("conv_wgrad", f32, "NCHW", [(8, 32, 32, 32), (8, 64, 32, 32)], (64, 32, 3, 3), dict(kernel=(3, 3), padding=1),
         lambda a, at: torch.nn.grad.conv2d_weight(d(a[0]), (64, 32, 3, 3), d(a[1]), padding=1)),
    case("conv", f32, "NCHW", [(4, 32, 32, 32), (64, 32, 5, 5)], (4, 64, 32, 32), dict(padding=2),
         lambda a, at: F.conv2d(d(a[0]), d(a[1]), padding=2)),
    case("conv_dgrad", h16, "NHWC", [(8, 128, 14, 14), (128, 64, 3, 3)], (8, 64, 28, 28), dict(padding=1, stride=2, output_padding=(1, 1)),
         lambda a, at: torch.nn.grad.conv2d_input((8, 64, 28, 28), d(a[1]), d(a[0]), stride=2, padding=1)),
    case("conv", h16, "NCHW", [(8, 64, 28, 28), (64, 64, 3, 3)], (8, 64, 28, 28), dict(padding=1),
         lambda a, at: F.conv2d(d(a[0]), d(a[1]), padding=1)),
    case("conv", h16, "NHWC", [(32, 256, 14, 14), (256, 256, 3, 3)], (32, 256, 14, 14), dict(padding=1),
         lambda a, at: F.conv2d(d(a[0]), d(a[1]), padding=1)),
    case("conv", f32, "NHWC", [(8, 64, 56, 56), (64, 64, 7, 7)], (8, 64, 56, 56), dict(padding=3),
         lambda a, at: F.conv2d(d(a[0]), d(a[1]), padding=3)),
]

# A key whose heuristic plan needs a workspace, and a plan of that key needing none: probed on a side
# stream, so this (default) stream's workspace stays empty.
chosen, seen = None, []
for pattern, arrays, out, attrs, ref in CANDIDATES:
    with torch.cuda.stream(side):
        plan = fusekit.plan_for(pattern, *arrays, out=out, **attrs)
    seen.append((pattern, str(arrays[0].dtype), plan.workspace_size))
    if plan.workspace_size == 0:
        continue
    h = current_runtime().handle(ad, 0, side.cuda_stream)
    key = plan.key
    try:
        b = lower.build(fusekit.get_pattern(pattern), dict(key.specs), dict(key.attrs), h, fusekit.default_cache().heuristics,
                        workspace_limit=0, tf32=key.tf32)
    except fusekit.UnsupportedError:
        continue
    finally:
        forget_stream(h)
    if b.workspace_size == 0:
        chosen = (pattern, arrays, out, attrs, ref, plan)
        break
torch.cuda.synchronize()
if chosen is None:
    print(json.dumps(dict(skip=f"no candidate key has a workspace and a plan without one: {seen}")))
    raise SystemExit(0)
pattern, arrays, out, attrs, ref, plan = chosen
expected = ref(arrays, attrs)
torch.cuda.synchronize()

# No room: fill every free block the allocator holds, on the stream whose pool holds it (fusekit
# allocates workspaces on a side stream of its own), then cap the process at what it has reserved,
# so the workspace needs memory the cap refuses.
torch.cuda.empty_cache()
fillers = []
for _ in range(256):
    free = [(b["size"], s["stream"]) for s in torch.cuda.memory_snapshot() for b in s["blocks"] if b["state"] == "inactive"]
    if not free:
        break
    size, stream = max(free)
    with torch.cuda.stream(torch.cuda.default_stream() if stream == 0 else torch.cuda.ExternalStream(stream)):
        fillers.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(min(1.0, torch.cuda.memory_reserved() / total), 0)
try:
    torch.empty(plan.workspace_size, dtype=torch.uint8, device="cuda")
    pressure = False
except torch.OutOfMemoryError:
    pressure = True

with warnings.catch_warnings(record=True) as got:
    warnings.simplefilter("always")
    fusekit.call(pattern, *arrays, out=out, **attrs)
    fusekit.call(pattern, *arrays, out=out, **attrs)  # the dispatch table: no second warning
    torch.cuda.synchronize()
ran = fusekit.plan_for(pattern, *arrays, out=out, **attrs)
torch.cuda.set_per_process_memory_fraction(1.0, 0)
del fillers
err = float((out.double() - expected).norm() / expected.norm())
s3 = torch.cuda.Stream()
with torch.cuda.stream(s3):  # memory is back: another stream's call gets the key's own plan
    again = fusekit.plan_for(pattern, *arrays, out=out, **attrs)
print(json.dumps(dict(
    pattern=pattern, dtype=str(arrays[0].dtype), heuristic_ws=plan.workspace_size, heuristic=plan.engine, pressure=pressure,
    ran_ws=ran.workspace_size, ran=ran.engine, err=err, again_ws=again.workspace_size, candidates=seen,
    warned=[str(w.message) for w in got if issubclass(w.category, fusekit.WorkspaceWarning)],
)))
"""


def test_workspace_out_of_memory_falls_back_to_a_plan_with_a_smaller_workspace():
    res = child(OOM_CHILD)
    if "skip" in res:
        pytest.skip(res["skip"])
    assert res["pressure"], f"the memory cap did not bite: {res}"
    assert len(res["warned"]) == 1 and res["pattern"] in res["warned"][0], res
    assert res["ran_ws"] < res["heuristic_ws"], res
    assert res["err"] < 5e-3, res
    assert res["again_ws"] == res["heuristic_ws"], res  # the cache kept the key's own plan


# ----------------------------------------------------------------------------------------------
# threads: eight threads, eight streams, different keys at once
# ----------------------------------------------------------------------------------------------
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 5e-3}


def _cl(t):
    return t.contiguous(memory_format=torch.channels_last)


def _work(i: int, n: int):
    """Thread ``i``'s call for batch ``n``: (fusekit result, float64 reference, tolerance); each thread
    its own pattern, each batch size its own key."""
    r = lambda *s, dt=torch.float16: torch.randn(*s, device="cuda", dtype=dt)
    if i == 0:
        x, w, b = _cl(r(n, 16, 12, 12)), _cl(r(32, 16, 3, 3) / 12), r(32)
        return ops.conv_bias_relu(x, w, b, padding=1), torch.relu(F.conv2d(x.double(), w.double(), b.double(), padding=1)), TOL[torch.float16]
    if i == 1:
        x, w, b = r(n, 8, 11, 11, dt=torch.float32), r(12, 8, 3, 3, dt=torch.float32) / 8, r(12, dt=torch.float32)
        return ops.conv_bias(x, w, b, padding=1, stride=2), F.conv2d(x.double(), w.double(), b.double(), padding=1, stride=2), TOL[torch.float32]
    if i == 2:
        x, w, b = r(n * 8, 64), r(48, 64) / 8, r(48)
        return ops.linear_bias_relu(x, w, b), torch.relu(F.linear(x.double(), w.double(), b.double())), TOL[torch.float16]
    if i == 3:
        x, w, b = r(n * 5, 40, dt=torch.bfloat16), r(24, 40, dt=torch.bfloat16) / 6, r(24, dt=torch.bfloat16)
        return ops.linear_bias(x, w, b), F.linear(x.double(), w.double(), b.double()), TOL[torch.bfloat16]
    if i == 4:
        x, w, b = _cl(r(n, 16, 6, 6)), _cl(r(16, 8, 3, 3) / 12), r(8)
        kw = {"padding": 1, "stride": 2, "output_padding": 1}
        return ops.conv_transpose_bias(x, w, b, **kw), F.conv_transpose2d(x.double(), w.double(), b.double(), **kw), TOL[torch.float16]
    if i == 5:
        x = _cl(r(n, 32, 8, 8)) * 2 + 0.5
        g, b = torch.rand(32, device="cuda") + 0.5, torch.randn(32, device="cuda")
        y = ops.batchnorm(x, g, b)[0]
        return y, F.batch_norm(x.double(), None, None, g.double(), b.double(), True, 0.0, 1e-5), 4e-3
    if i == 6:
        x = r(n, 6, 5, 7, dt=torch.float32)
        g, b = torch.rand(1, 6, 5, 7, device="cuda") + 0.5, torch.randn(1, 6, 5, 7, device="cuda")
        return ops.layernorm(x, g, b)[0], F.layer_norm(x.double(), (6, 5, 7), g[0].double(), b[0].double(), 1e-5), 1e-4
    x = _cl(r(n, 24, 9, 11))
    return pool.max_pool2d(x, 3, 2, 1)[0], F.max_pool2d(float64_nchw(x), 3, 2, 1), 1e-6


def test_eight_threads_on_eight_streams_calling_different_keys():
    threads, rounds = 8, 12
    barrier = threading.Barrier(threads)
    errors: list[str] = []
    done = [0] * threads

    def worker(i: int) -> None:
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                barrier.wait(timeout=60)
                pending = []
                for k in range(rounds):
                    pending.append(_work(i, 2 + k % 2))  # two keys per thread, the first call of each built concurrently
                s.synchronize()
                for k, (got, ref, tol) in enumerate(pending):
                    err = rel(got, ref)
                    if not err < tol:
                        errors.append(f"thread {i} round {k}: relative error {err:.3e} over {tol:.0e}")
                    done[i] += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in ts), "a thread hung"
    assert not errors, errors
    assert done == [rounds] * threads


# ----------------------------------------------------------------------------------------------
# a stream of new keys through a small cache
# ----------------------------------------------------------------------------------------------
@pytest.mark.alone
def test_many_keys_through_a_small_cache_stay_bounded():
    """400 distinct keys through FUSEKIT_CACHE_SIZE=16: the memory cache and the dispatch table stay
    at 16, results stay right, host and device memory settle (benchmarks/bench_cache_memory.py
    measures 10,000 keys). The device figure is the whole GPU's used memory, so other processes
    on the GPU must not run beside it (marked ``alone``: beside other GPU tests it fails)."""
    res = child("""
        import json, os, torch, fusekit
        from fusekit import dispatch
        page = os.sysconf("SC_PAGE_SIZE")
        rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
        used = lambda: (lambda f, t: t - f)(*torch.cuda.mem_get_info())
        cache, samples, worst = fusekit.default_cache(), [], 0.0
        w = (torch.randn(8, 8, 3, 3, device="cuda") / 8).half().contiguous(memory_format=torch.channels_last)
        for i in range(400):  # 3x3 convs: precompiled engines build in ms (a pointwise graph compiles a kernel per shape)
            x = torch.randn(1, 8, 2 + i // 20, 2 + i % 20, device="cuda").half().contiguous(memory_format=torch.channels_last)
            y = fusekit.call("conv", x, w, padding=(1, 1), stride=(1, 1), dilation=(1, 1))
            want = torch.nn.functional.conv2d(x.float(), w.float(), padding=1)
            worst = max(worst, float((y.float() - want).norm() / want.norm()))
            if (i + 1) % 100 == 0:
                torch.cuda.synchronize()
                samples.append(dict(keys=i + 1, rss=rss(), device_used=used(), cached=len(cache), fast=dispatch.resolved_calls()))
        print(json.dumps(dict(samples=samples, worst=worst, maxsize=cache.maxsize, builds=cache.stats.builds, evictions=cache.stats.evictions)))
    """, FUSEKIT_CACHE_SIZE="16")
    assert res["maxsize"] == 16 and res["builds"] == 400 and res["evictions"] == 384
    assert res["worst"] < 2e-3, res["worst"]
    for s in res["samples"]:
        assert s["cached"] <= 16 and s["fast"] <= 16, s
    first, last = res["samples"][0], res["samples"][-1]
    assert last["rss"] - first["rss"] < 256 << 20, res
    assert last["device_used"] - first["device_used"] < 256 << 20, res


@pytest.mark.parametrize("batch", [16, 64])
def test_float32_training_gradients_stay_within_tf32_error_under_the_default_policy(batch):
    """The fp32 autoencoder's convolutions (conv 3->16 s2, transposed conv 16->3 s2, 64x64 images):
    under the default policy (TF32 convolutions, as PyTorch) every gradient is within TF32's error of
    a float64 copy, and plans that down-convert float32 inputs to 16 bits are filtered. The ReLUs are
    left out: with a random-sign upstream gradient, a TF32-sized change that flips a few ReLU masks
    moves a bias gradient by ~1e-2 (the autoencoder bench's 1e-2 at batch 64, gone with TF32
    off), which says nothing about the convolutions."""
    import fusekit
    import fusekit.torch as ft

    fusekit.configure(disk=False)
    torch.manual_seed(0)
    cl = torch.channels_last
    ref = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ConvTranspose2d(16, 3, 3, stride=2, padding=1, output_padding=1),
    ).cuda().double()
    fk = torch.nn.Sequential(
        ft.Conv2d(3, 16, 3, stride=2, padding=1), ft.ConvTranspose2d(16, 3, 3, stride=2, padding=1, output_padding=1),
    ).cuda()
    fk.load_state_dict(ref.state_dict())
    fk = fk.float().to(memory_format=cl)
    x = torch.rand(batch, 3, 64, 64, device="cuda").contiguous(memory_format=cl)
    g = torch.randn(batch, 3, 64, 64, device="cuda")
    grads = []
    for model, xx in ((fk, x.clone()), (ref, x.double())):
        xx.requires_grad_(True)
        (model(xx) * g.to(xx.dtype)).sum().backward()
        grads.append([p.grad for p in model.parameters()] + [xx.grad])
    names = ["conv.weight", "conv.bias", "convT.weight", "convT.bias", "input"]
    errs = {n: float((a.double() - b).norm() / b.norm()) for n, a, b in zip(names, *grads)}
    assert max(errs.values()) < 2e-3, errs


@pytest.mark.parametrize("mode", ["heuristic", "autotune"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_first_call_times_fused_against_split_and_keeps_the_faster(monkeypatch, dtype, mode, fresh_session):
    """The autoencoder's transposed conv + bias + ReLU at batch 64 (float32: cuDNN's fused graph took
    149 us against 44 us for its dgrad alone): in either plan mode the first call times the fused
    graph against the split graphs, keeps the faster, and both give the float64 result."""
    import torch.nn.functional as F

    import fusekit
    from fusekit import dispatch

    cl = torch.channels_last
    x = torch.randn(64, 16, 32, 32, device="cuda").to(dtype).contiguous(memory_format=cl)
    w = (torch.randn(16, 3, 3, 3, device="cuda") * 0.2).to(dtype).contiguous(memory_format=cl)
    b = (torch.rand(3, device="cuda") * 0.5).to(dtype)
    kw = dict(padding=1, stride=2, output_padding=1)
    fusekit.configure(mode=mode, disk=False)
    try:
        y = ops.conv_transpose_bias_relu(x, w, b, **kw)
        y2 = ops.conv_transpose_bias_relu(x, w, b, **kw)
    finally:
        fusekit.configure()
    ref = F.relu(F.conv_transpose2d(x.double(), w.double(), b.double(), **kw))
    for out in (y, y2):
        assert out.dtype == dtype and out.shape == ref.shape
        assert float((out.double() - ref).norm() / ref.norm()) < 5e-3
    # the split's own layout (channels-last or through an NCHW dgrad output) is timed inside it
    ((tag, timed_mode), (t_fused, t_split)), = [(k, t) for k, t in fresh_session.fusion_times.items() if k[0][0] == "conv_transpose_bias_relu"]
    kept = dispatch.fusion_choice(tag, mode)
    print(f"{dtype} {mode}: fused {t_fused * 1e3:.1f} us, split {t_split * 1e3:.1f} us -> {kept}")
    assert tag[0] == "conv_transpose_bias_relu" and timed_mode == mode and t_fused > 0 and t_split > 0
    assert kept == ("split" if t_split < fusekit.config.TUNABLES.split_margin * t_fused else "fused")
