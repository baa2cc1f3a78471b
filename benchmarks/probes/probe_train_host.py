"""Where a converted ResNet-50's AMP training step spends host time: cProfile of a few steps
(top functions by own time and by cumulative time), dispatch calls per step, and the step's
host-only time (no synchronize) against PyTorch eager's.

    python benchmarks/probes/probe_train_host.py [--model resnet50] [--batch 64]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_train_models import make_step
from common import converted
from report import profile_text, profiled


def host_ms(step, n: int = 10) -> tuple[float, float]:
    """(host ms per step without synchronizing, wall ms per step with a final synchronize)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - t) * 1e3 / n
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t) * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()
    base, fk, data = converted(args.model, args.batch, args.size)
    for name, model in (("torch", base), ("fusekit", fk)):
        model.train()
        step, _ = make_step(model, data, "amp-fp16", captured=False)
        for _ in range(3):
            step()
        h, w = host_ms(step)
        print(f"{name}: host {h:.2f} ms/step (no sync), wall {w:.2f} ms/step")
    step, _ = make_step(fk, data, "amp-fp16", captured=False)
    step()
    torch.cuda.synchronize()
    prof = profiled(step, 3, torch.cuda.synchronize)
    for order in ("tottime", "cumulative"):
        print(f"==== by {order} (3 steps) ====")
        print(profile_text(prof, order, 45))


if __name__ == "__main__":
    main()
