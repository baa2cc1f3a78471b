"""Kernel by kernel: where the float32 batch-64 autoencoder step (bench_train's case, 0.93x of eager
autotuned in the sixth session) spends GPU time on each side. Both sides autotuned (fusekit's
"autotune" mode, eager's cudnn.benchmark), then torch.profiler over 20 uncaptured steps; per side the
kernels by total device time per step.

    python benchmarks/probes/probe_autoencoder_kernels.py [--batch 64] [--fp16]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_train import graph_step
from common import autotuned_autoencoder, profile_kernels


def kernels(model, x, steps: int = 20) -> list[tuple[str, float, int]]:
    fn_i, reset = graph_step(model, x)

    def run() -> None:
        reset()
        fn_i(0)

    for _ in range(5):
        run()
    torch.cuda.synchronize()
    ks, _ = profile_kernels(run, steps, skip=())
    return sorted(((k, us / steps, int(n) // steps) for k, (n, us) in ks.items()), key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--fp16", action="store_true")
    args = ap.parse_args()
    fused, eager, x = autotuned_autoencoder(args.batch, args.fp16)
    for side, model in (("fusekit", fused), ("eager", eager)):
        rows = kernels(model, x)
        print(f"{side}: {sum(r[1] for r in rows):.1f} us of kernels per step")
        for k, us, n in rows[:12]:
            print(f"   {us:7.1f} us  x{n}  {k[:150]}")


if __name__ == "__main__":
    main()
