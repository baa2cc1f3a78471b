"""Which cuDNN heuristics mode ranks a fast engine first for a dense conv + bias + ReLU6 graph.
fusekit's heuristic plans take the first that builds of modes A, then FALLBACK; on an H100 with
cuDNN 9.19 that was eng0 (3785 us) for a MobileNetV2 1x1 conv + ReLU6 where `fusekit autotune`
(modes A, B and FALLBACK) found eng52 at 46 us (2026-12-06, fifth session). Per graph and mode
alone (A, B, FALLBACK): the engine of the first plan that builds and its time (CUDA events over a
CUDA graph of 20 calls, median of 5), beside the same graph with a plain ReLU.

    python benchmarks/probes/probe_heuristic_modes.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from fusekit import dispatch
from fusekit.engine.cache import PlanCache
from fusekit.errors import FusekitError
from fusekit.pipeline.bench import capture, cuda_time_ms

CASES = [  # (x shape, w shape, padding): MobileNetV2 batch 32 expansions and its stem
    ((32, 96, 56, 56), (144, 96, 1, 1), 0),
    ((32, 16, 112, 112), (96, 16, 1, 1), 0),
    ((32, 320, 7, 7), (1280, 320, 1, 1), 0),
    ((32, 3, 224, 224), (32, 3, 3, 3), 1),
]


def main() -> None:
    print(torch.cuda.get_device_name(), "float16 channels-last; us per call")
    cl = torch.channels_last
    for xs, ws, pad in CASES:
        x = torch.randn(xs, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        w = (torch.randn(ws, device="cuda", dtype=torch.float16) / ws[1] ** 0.5).contiguous(memory_format=cl)
        b = torch.randn(ws[0], device="cuda", dtype=torch.float16)
        line = []
        for pattern in ("conv_bias_relu6", "conv_bias_relu"):
            for modes in (("A",), ("B",), ("FALLBACK",), ("A", "FALLBACK")):
                cache = PlanCache(heuristics=modes, mode="heuristic")
                try:
                    plan = dispatch.plan_for(pattern, x, w, b, padding=pad, cache=cache)
                    out = dispatch.call(pattern, x, w, b, padding=pad, cache=cache)
                    g = capture(lambda: [dispatch.call(pattern, x, w, b, padding=pad, cache=cache, out=out) for _ in range(20)])
                    us = cuda_time_ms(g.replay, iters=1, trials=5) * 1e3 / 20
                    line.append(f"{pattern} {'+'.join(modes)}: {plan.engine} {us:.1f}")
                except FusekitError as e:
                    line.append(f"{pattern} {'+'.join(modes)}: none ({str(e).splitlines()[0][:300]})")
        print(f"x{list(xs)} w{list(ws)} pad {pad}:")
        for entry in line:
            print("   ", entry)


if __name__ == "__main__":
    main()
