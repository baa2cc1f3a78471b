"""The GPU fuzzer's conv_bias_add_relu failure of 2026-12-04 (seed 3436473350): float16 NCHW,
x 2x2x1x2, w 2x2x1x1, stride (1, 2), output 2x2x1x1, relative error 0.67 against float64.

Prediction: not a wrong kernel but an ill-conditioned check (a ReLU-boundary cancellation over eight
outputs). Seen (device runs 5-7 of 2026-12-04): refuted. The fused graph returns negative values
after its ReLU (relative error 0.50 / 2.5 / 1.08 for data seeds 0 / 1 / 2, 0.67 in float32) while
conv_bias alone, the pieces and PyTorch are at 2e-4; stride 1 (cuDNN refuses all-NCHW: fusekit runs
channels-last copies) and channels-last x are right; describing the 1x1 z and y NCHW too (run 7)
changed nothing: cuDNN accepts the NCHW graph with engine 7 (eng7_k24=29) and computes it wrong.
Open (tests/test_gpu_fuzz.py OPEN_CONV_ADD, strict xfail).

    python benchmarks/probes/probe_fuzz_conv_add.py
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", ".."))
sys.path.insert(0, os.path.join(here, "..", "..", "tests"))
from fusekit import ops  # noqa: E402
from test_gpu_fuzz import _conv_inputs, rnd  # noqa: E402
from torchref import float64_nchw  # noqa: E402

CASE = {"n": 2, "c": 2, "k": 2, "hw": (1, 2), "kernel": (1, 1), "padding": (0, 0), "stride": (1, 2), "dilation": (1, 1),
        "dtype": "float16", "layout": "NCHW", "data_seed": 0, "op": "conv_bias_add_relu"}


def rel(a: torch.Tensor, r: torch.Tensor) -> float:
    return float((a.double() - r).norm() / r.norm().clamp_min(1e-30))


def run(case: dict) -> None:
    g, x, w, b, kw = _conv_inputs(case)
    pre64 = F.conv2d(float64_nchw(x), float64_nchw(w), float64_nchw(b), **kw)
    z = rnd(g, tuple(pre64.shape), case["dtype"], case["layout"])
    ref = torch.relu(pre64 + float64_nchw(z))
    got = ops.conv_bias_add_relu(x, w, b, z, **kw)
    cb = ops.conv_bias(x, w, b, **kw)
    pieces = torch.relu(float64_nchw(cb) + float64_nchw(z))
    pt = torch.relu(F.conv2d(x, w, b, **kw) + z)
    print(f"case {case}")
    print(f"  fused {rel(float64_nchw(got), ref):.3e}  conv_bias alone {rel(float64_nchw(cb), pre64):.3e}  "
          f"pieces {rel(pieces, ref):.3e}  pytorch {case['dtype']} {rel(float64_nchw(pt), ref):.3e}  |ref| {float(ref.norm()):.3e}")
    if ref.numel() <= 16:
        for name, t in (("conv+bias f64", pre64), ("z", float64_nchw(z)), ("ref", ref), ("fused", float64_nchw(got)),
                        ("conv_bias", float64_nchw(cb)), ("pytorch", float64_nchw(pt))):
            print(f"  {name:14s}", " ".join(f"{v:+.5f}" for v in t.flatten().tolist()))


def strided(t: torch.Tensor, strides: tuple) -> torch.Tensor:
    """``t``'s values in a tensor of the same shape with ``strides`` (dense for those strides)."""
    out = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def variants() -> None:
    """The failing case with each operand's strides chosen explicitly: which operand's description matters."""
    from fusekit import dispatch

    g, x, w, b, kw = _conv_inputs(CASE)
    pre64 = F.conv2d(float64_nchw(x), float64_nchw(w), float64_nchw(b), **kw)
    z = rnd(g, tuple(pre64.shape), CASE["dtype"], CASE["layout"])
    ref = torch.relu(pre64 + float64_nchw(z))
    xc, xl = strided(x, (4, 2, 2, 1)), strided(x, (4, 1, 4, 2))
    zc, zl = strided(z, (2, 1, 1, 1)), strided(z, (2, 1, 2, 2))
    for name, xx, zz in (("x NCHW, z (2,1,1,1)", xc, zc), ("x NCHW, z (2,1,2,2)", xc, zl), ("x NHWC, z (2,1,1,1)", xl, zc),
                         ("x NHWC, z (2,1,2,2)", xl, zl)):
        got = ops.conv_bias_add_relu(xx, w, b, zz, **kw)
        plan = dispatch.plan_for("conv_bias_add_relu", xx, w, b, zz, **kw)
        print(f"variant {name}: error {rel(float64_nchw(got), ref):.3e}; out strides {got.stride()}; plan {plan.engine}; "
              f"key {plan.key.describe()[:400]}")


def candidates() -> None:
    """Every plan cuDNN offers for the failing key (the autotuner, private cache, no disk): each
    candidate's verdict and difference to the heuristic plan's output; then the failing case run on
    the tuned plan against float64. Is only the heuristic engine wrong?"""
    import fusekit
    from fusekit import dispatch

    g, x, w, b, kw = _conv_inputs(CASE)
    pre64 = F.conv2d(float64_nchw(x), float64_nchw(w), float64_nchw(b), **kw)
    z = rnd(g, tuple(pre64.shape), CASE["dtype"], CASE["layout"])
    ref = torch.relu(pre64 + float64_nchw(z))
    cache = fusekit.PlanCache(mode="autotune")
    res = fusekit.autotune("conv_bias_add_relu", x, w, b, z, cache=cache, options=fusekit.TuneOptions(budget_s=20.0), **kw)
    for c in res.candidates:
        err = "-" if c.error is None else f"{c.error:.2e}"
        print(f"candidate {c.index:2d} {c.name:28s} engine {c.engine_id} {c.verdict[:90]:90s} vs heuristic {err}")
    got = dispatch.call("conv_bias_add_relu", x, w, b, z, cache=cache, **kw)
    print(f"tuned plan {res.candidates[res.best].name}: error {rel(float64_nchw(got), ref):.3e} against float64")


def main() -> None:
    try:
        candidates()
    except Exception as e:  # noqa: BLE001 - the rest of the probe still runs
        print(f"candidates: {type(e).__name__}: {e}")
    variants()
    run(CASE)
    for change in ({"stride": (1, 1)}, {"layout": "NHWC"}, {"dtype": "float32"}, {"data_seed": 1}, {"data_seed": 2},
                   {"hw": (4, 4), "stride": (1, 1)}):
        run({**CASE, **change})
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
