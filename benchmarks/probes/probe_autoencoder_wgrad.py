"""The fp32 batch-64 autoencoder's weight gradient alone: fusekit's autotuned conv_wgrad plan against
PyTorch's cuDNN ``convolution_backward`` (weight only, cudnn.benchmark) on the same operands.

Both of the autoencoder's weight gradients have one shape: image (64, 3, 64, 64), gradient
(64, 16, 32, 32), 3x3 stride 2 padding 1 (the transposed conv's with the roles swapped). The seventh
session saw the same cuDNN kernel take 70.4 us per step in fusekit against 60.8 us in eager. Here:
each side's time per call (timing.graph_time_us), the autotuner's
candidates (time, engine, knobs), and the relative error of each side's result to float64.

    python benchmarks/probes/probe_autoencoder_wgrad.py [--batch 64] [--nchw]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from timing import graph_time_us

import fusekit
from fusekit import dispatch
from fusekit.engine.autotune import TuneOptions, autotune


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--nchw", action="store_true")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    fusekit.configure(mode="autotune", disk=False)
    fmt = torch.contiguous_format if args.nchw else torch.channels_last
    torch.manual_seed(0)
    n = args.batch
    x = torch.randn(n, 3, 64, 64, device="cuda").contiguous(memory_format=fmt)
    dz = torch.randn(n, 16, 32, 32, device="cuda").contiguous(memory_format=fmt)
    w = torch.randn(16, 3, 3, 3, device="cuda").contiguous(memory_format=fmt)
    conv = dict(padding=(1, 1), stride=(2, 2), dilation=(1, 1), groups=1)
    res = autotune("conv_wgrad", x, dz, kernel=(3, 3), **conv, options=TuneOptions(max_candidates=64, budget_s=20.0))
    print(f"autotune: {len(res.candidates)} candidates, heuristic {res.heuristic_us:.1f} us, best {res.best_us:.1f} us")
    ok = sorted((c for c in res.candidates if c.verdict == "ok"), key=lambda c: c.time_us)
    for c in ok[:10]:
        print(f"   {c.time_us:7.1f} us  {c.name:<14} knobs {c.knobs}  ws {c.workspace}")
    for c in res.candidates:
        if c.verdict != "ok":
            print(f"   {c.name}: {c.verdict[:100]}")

    def fk() -> torch.Tensor:
        return dispatch.call("conv_wgrad", x, dz, kernel=(3, 3), **conv)

    def pt() -> torch.Tensor:
        return torch.ops.aten.convolution_backward(dz, x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False])[1]

    ref = torch.ops.aten.convolution_backward(
        dz.double(), x.double(), w.double(), None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False]
    )[1]
    for name, fn in (("fusekit", fk), ("torch", pt)):
        out = fn().double()
        err = ((out - ref).norm() / ref.norm()).item()
        us = [graph_time_us(lambda i: fn()) for _ in range(2)]
        print(f"{name:<8} {us[0]:7.1f} us per call (then {us[1]:7.1f}), rel err {err:.2e}, "
              f"out strides {tuple(fn().stride())}")
    prof_rows = []
    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("fusekit", fk), ("torch", pt)):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                prof_rows.append((name, e.key[:120], e.count, getattr(e, "device_time", 0.0)))
    for r in prof_rows:
        print(f"  {r[0]:<8} x{r[2]:<4} {r[3]:8.1f} us avg  {r[1]}")


if __name__ == "__main__":
    main()
