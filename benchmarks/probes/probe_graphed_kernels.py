"""Kernel by kernel: where a graphed training step spends GPU time, fusekit's converted model against
the unconverted one. Question (2026-12-05): why is MobileNetV2's graphed amp-fp16 step 0.92x of
PyTorch's graphed one (10.66 against 9.80 ms, H200) when the ResNets were 0.97-1.19x, while the whole
step captured is at parity (8.35 against 8.24)?

--mode graphed (default): bench_train_models' "graphed" column: the ordinary step (autocast,
GradScaler, SGD) around the model's forward and backward replayed as CUDA graphs (fusekit.torch.graphed
/ torch.cuda.make_graphed_callables). --mode captured: its "captured" column, the whole step in one
graph (no GradScaler). torch.profiler records 10 steps on fresh random batches. Per side: wall ms per
step (synchronized), device us per step by kernel family (convolution forward / dgrad / wgrad, batch
norm, elementwise, reductions, pooling, GEMM, copies), kernels per step, and the top kernels.

    python benchmarks/probes/probe_graphed_kernels.py [--model mobilenet_v2] [--precision amp-fp16] [--mode graphed] [--top 12]
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import converted, profile_kernels  # noqa: E402  (puts benchmarks/ on sys.path)

from bench_train_models import PRECISIONS, make_step  # noqa: E402
from fusekit.pipeline.bench import capture  # noqa: E402

FAMILIES = (  # first match wins; names as cuDNN 9 / PyTorch 2.11 kernels print them
    ("conv wgrad", r"wgrad|dgrad_weight|conv_depthwise2d_grad_weight|weight_grad"),
    ("conv dgrad", r"dgrad|conv_depthwise2d_backward|backward_input"),
    ("conv fprop", r"fprop|implicit_gemm|conv_depthwise2d_forward|convolution|xmma_conv|conv2d"),
    ("batch norm", r"bn_|batch_norm|batchnorm|welford|norm"),
    ("gemm", r"gemm|cublas|cutlass.*gemm|sm90_xmma_gemm"),
    ("pooling", r"pool"),
    ("reduction", r"reduce|sum_kernel"),
    ("copy / layout", r"copy|transpose|nchwToNhwc|nhwcToNchw|permute|cat"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|fill|mul|add"),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, pat in FAMILIES:
        if re.search(pat, low, re.IGNORECASE):
            return fam
    return "other"


def kernel_times(step, refill, steps: int) -> tuple[dict[str, float], int, float]:
    """(kernel name -> device us per step, kernels per step, wall ms per step) over ``steps`` steps
    (torch.profiler's CUDA activity; the refill of the batch excluded from neither)."""
    for _ in range(3):
        refill()
        step()
    torch.cuda.synchronize()
    ks, wall = profile_kernels(lambda: (refill(), step()), steps)
    out = {k: us / steps for k, (_, us) in ks.items()}
    return out, int(sum(n for n, _ in ks.values())) // steps, wall / steps


def graphed_model(model: torch.nn.Module, side: str, x: torch.Tensor, dtype) -> torch.nn.Module:
    """``model`` with its forward and backward replayed as CUDA graphs, as bench_train_models graphs each side."""
    import fusekit.torch as ft

    if side == "fusekit":
        return ft.graphed(model, warmup=2)
    with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None, cache_enabled=False):
        return torch.cuda.make_graphed_callables(model, (x.clone(),))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--precision", default="amp-fp16", choices=("amp-fp16", "bf16", "fp32"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--mode", default="graphed", choices=("graphed", "captured"))
    args = ap.parse_args()
    base, fk, data = converted(args.model, args.batch)
    sides, counts, walls = {}, {}, {}
    for side, model in (("torch", base), ("fusekit", fk)):
        data.reset()
        if args.mode == "captured":
            step, _ = make_step(model, data, args.precision, captured=True)
            g = capture(step, warmup=3)
            run = g.replay
        else:
            model = graphed_model(model, side, data.x, PRECISIONS[args.precision])
            run, _ = make_step(model, data, args.precision, captured=False)
        sides[side], counts[side], walls[side] = kernel_times(run, data.refill, args.replays)
        torch.cuda.synchronize()
    fams = sorted({family(k) for s in sides.values() for k in s})
    print(f"{args.model} {args.precision} batch {args.batch}, {args.mode}: wall ms per step torch {walls['torch']:.2f}, "
          f"fusekit {walls['fusekit']:.2f}; kernels per step torch {counts['torch']}, fusekit {counts['fusekit']}")
    print("device us per step by family")
    print(f"{'family':16s} {'torch':>10s} {'fusekit':>10s} {'fk - torch':>11s}")
    tot = {s: sum(v.values()) for s, v in sides.items()}
    for fam in fams:
        t = {s: sum(us for k, us in v.items() if family(k) == fam) for s, v in sides.items()}
        print(f"{fam:16s} {t['torch']:10.1f} {t['fusekit']:10.1f} {t['fusekit'] - t['torch']:+11.1f}")
    print(f"{'total':16s} {tot['torch']:10.1f} {tot['fusekit']:10.1f} {tot['fusekit'] - tot['torch']:+11.1f}")
    for side, ks in sides.items():
        print(f"\n{side}: top {args.top} kernels (us per step, family)")
        for name, us in sorted(ks.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {us:9.1f}  {family(name):14s} {name[:150]}")


if __name__ == "__main__":
    main()
