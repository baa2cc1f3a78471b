"""Kernels per block: MobileNetV2's graphed amp-fp16 step runs ~180 more kernels than PyTorch's (957
against 779 per step, H100, 2026-12-05) at equal device time, though fusekit calls fewer ops (no
standalone ReLU6 forward or backward: NOTES 2026-12-06). Which blocks, and which kernels?

Each block of ``model.features`` alone, training mode, fp16 autocast, channels-last, on the
activation the unconverted model feeds it (batch 64, 224x224): forward + backward with a fixed random
output gradient, 3 warm-up passes, then ``--iters`` passes under torch.profiler. Per block and side:
kernels per pass and device us per pass; then, for the ``--show`` blocks with the most extra kernels,
both sides' kernels by name (count per pass, us per pass).

    python benchmarks/probes/probe_block_kernels.py [--model mobilenet_v2] [--iters 5] [--show 2]
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import converted, profile_kernels  # noqa: E402


def kernels(block: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, iters: int) -> dict[str, tuple[float, float]]:
    """kernel name -> (launches per pass, device us per pass) over ``iters`` forward + backward passes."""
    def run() -> None:
        xi = x.detach().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.float16):
            y = block(xi)
        y.backward(dy)
        block.zero_grad(set_to_none=True)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    ks, _ = profile_kernels(run, iters)
    return {k: (n / iters, us / iters) for k, (n, us) in ks.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--show", type=int, default=2)
    args = ap.parse_args()
    base, fk, data = converted(args.model, args.batch)
    x = data.x
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for i, (tb, fb) in enumerate(zip(base.features, fk.features)):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            y = tb(x)
        dy = torch.randn(y.shape, device="cuda", dtype=y.dtype, generator=gen).contiguous(memory_format=torch.channels_last)
        sides = {"torch": kernels(tb, x, dy, args.iters), "fusekit": kernels(fb, x, dy, args.iters)}
        rows.append((i, type(tb).__name__, tuple(x.shape), sides))
        x = y
    print(f"{args.model} amp-fp16 batch {args.batch}: kernels and device us per forward + backward, block by block")
    print(f"{'block':>5s} {'kind':22s} {'input':22s} {'torch k':>8s} {'fk k':>6s} {'torch us':>9s} {'fk us':>8s}")
    tot = defaultdict(float)
    for i, kind, shape, sides in rows:
        k = {s: sum(c for c, _ in v.values()) for s, v in sides.items()}
        us = {s: sum(u for _, u in v.values()) for s, v in sides.items()}
        for s in sides:
            tot[s + "k"] += k[s]
            tot[s + "us"] += us[s]
        print(f"{i:5d} {kind:22s} {str(list(shape)):22s} {k['torch']:8.1f} {k['fusekit']:6.1f} {us['torch']:9.1f} {us['fusekit']:8.1f}")
    print(f"{'all':>5s} {'':22s} {'':22s} {tot['torchk']:8.1f} {tot['fusekitk']:6.1f} {tot['torchus']:9.1f} {tot['fusekitus']:8.1f}")
    worst = sorted(rows, key=lambda r: -(sum(c for c, _ in r[3]["fusekit"].values()) - sum(c for c, _ in r[3]["torch"].values())))
    for i, kind, shape, sides in worst[: args.show]:
        for side, ks in sides.items():
            print(f"\nblock {i} ({kind}, {list(shape)}) {side}: kernels per pass, us per pass")
            for name, (c, us) in sorted(ks.items(), key=lambda kv: -kv[1][1]):
                print(f"  {c:4.1f} {us:8.1f}  {name[:140]}")


if __name__ == "__main__":
    main()
