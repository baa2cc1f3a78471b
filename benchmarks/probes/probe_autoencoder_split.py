"""The small autoencoder's training step with autotune mode's fused-vs-split timing (sixth session of
2026-12-03): bench_train's autotuned pass had fp32 batch 64 at 0.68x eager, its fused transposed conv
+ bias + ReLU taking 149 us against 44 us for the dgrad alone. Per case: the autotuned step's
CUDA-graph time against eager's (bench_train.graphed_time_us, same process, alternating twice), the
fused/split times each timed op measured and which it kept, and the gradient error against float64.

    python benchmarks/probes/probe_autoencoder_split.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_train import autoencoder_case, compare, grads, graphed_time_us, reference

import fusekit
from fusekit import dispatch


def main() -> None:
    torch.backends.cudnn.benchmark = True
    fusekit.configure(mode="autotune", disk=False)
    for batch, dtype in ((64, torch.float32), (16, torch.float32), (64, torch.float16), (256, torch.float16)):
        name, fused, eager, x = autoencoder_case(batch, dtype)
        before = set(dispatch.FUSION_TIMES)
        err = compare(grads(fused, x), reference(eager, x))
        tf = [graphed_time_us(fused, x), None]
        te = [graphed_time_us(eager, x), None]
        tf[1], te[1] = graphed_time_us(fused, x), graphed_time_us(eager, x)
        print(f"{name}: fusekit autotuned {tf[0]:.1f} / {tf[1]:.1f} us, eager {te[0]:.1f} / {te[1]:.1f} us -> "
              f"{te[0] / tf[0]:.2f}x / {te[1] / tf[1]:.2f}x; grad err {err:.1e}", flush=True)
        for (tag, mode), (a, b) in dispatch.FUSION_TIMES.items():
            if (tag, mode) not in before:
                kept = dispatch.fusion_choice(tag, mode)
                print(f"   {tag[0]} {dispatch._describe_tag(tag)}: fused {a * 1e3:.1f} us, split {b * 1e3:.1f} us -> {kept}")


if __name__ == "__main__":
    main()
