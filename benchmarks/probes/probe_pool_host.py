"""Host microseconds per call of fusekit's CuPy pooling ops at ResNet-50's stem shape (fp16
channels-last, batch 64, 112x112 -> 56x56) and PyTorch's, plus a cProfile of the fusekit calls:
where a replayed step's ~0.36 ms per pool op goes.

    python benchmarks/probes/probe_pool_host.py [--batch 8]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import timing
from fusekit import ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8, help="small: the GPU never bounds the host")
    args = ap.parse_args()
    x = torch.randn(args.batch, 64, 112, 112, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    y, am = ops.pool.max_pool2d(x, 3, 2, 1)
    dy = torch.randn_like(y)
    calls = {
        "fusekit max_pool2d": lambda: ops.pool.max_pool2d(x, 3, 2, 1),
        "fusekit max_pool2d_backward": lambda: ops.pool.max_pool2d_backward(dy, am, x.shape),
        "torch max_pool2d_with_indices": lambda: torch.ops.aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1]),
        "fusekit avg_pool2d": lambda: ops.pool.avg_pool2d(x, 2, 2),
        "torch adaptive_avg_pool2d": lambda: F.adaptive_avg_pool2d(x, 1),
    }
    print(f"{torch.cuda.get_device_name()}: x {tuple(x.shape)} fp16 channels-last")
    for k, f in calls.items():
        print(f"  {k:32s} {timing.host_us(f, 200):8.1f} us host per call")
    for k in ("fusekit max_pool2d", "fusekit max_pool2d_backward"):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            calls[k]()
        pr.disable()
        torch.cuda.synchronize()
        print(f"== cProfile, 200 calls of {k} (top 22 by own time)")
        pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
