"""Host time of a converted ResNet-50's uncaptured AMP training step, layer by layer: every
fusekit.torch module's forward, every autograd Function's forward and backward, every dispatch run
(by pattern) and every frontend execute, each wrapped in a perf_counter timer (about 1 us each).
Nested: a module's forward includes its Function's, which includes its runs, which include their
executes. Printed as ms per step (median of steps), calls per step, and us per call.

    python benchmarks/probes/probe_train_breakdown.py [--model resnet50] [--batch 64]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cudnn
from bench_train import wrapped_run
from common import converted, staged_step

import fusekit.torch as ft

SPENT: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])


def timed(label, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            s = SPENT[label]
            s[0] += time.perf_counter() - t
            s[1] += 1
    return wrapper


def install() -> None:
    for name in ("Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d", "AvgPool2d", "Linear"):
        cls = getattr(ft, name)
        cls.forward = timed(f"module {name}.forward", cls.forward)
    for fn in ("ConvBiasAct", "BatchNormAct", "LinearBiasAct", "_MaxPool", "_AvgPool", "_ReLUFn", "ScaleShiftAct"):
        cls = getattr(ft, fn, None)
        if cls is None:
            continue
        for which in ("forward", "backward"):
            setattr(cls, which, staticmethod(timed(f"function {fn}.{which}", getattr(cls, which))))
    cudnn.pygraph.execute = timed("frontend execute", cudnn.pygraph.execute)
    torch.empty = timed("torch.empty", torch.empty)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    _, fk, data = converted(args.model, args.batch)
    staged = staged_step(fk, data)

    def step(stage_times=None):
        f, b, _ = staged()
        if stage_times is not None:
            stage_times.append((f, b))

    for _ in range(3):
        step()
    plain: list = []
    for _ in range(args.steps):
        step(plain)
    install()

    def timed_run(real):
        def run(pattern, names, values, operands, out, cache=None):
            label = f"run {pattern if isinstance(pattern, str) else pattern.name}"
            return timed(label, real)(pattern, names, values, operands, out, cache)
        return run

    wrapped: list = []
    with wrapped_run(timed_run):
        step()
        SPENT.clear()
        for _ in range(args.steps):
            step(wrapped)
    n = args.steps
    mean = lambda xs, i: sum(x[i] for x in xs) / len(xs)
    print(f"{args.model} b{args.batch} amp-fp16, host ms per step: forward {mean(plain, 0):.2f}, backward {mean(plain, 1):.2f} "
          f"(with the timers: {mean(wrapped, 0):.2f}, {mean(wrapped, 1):.2f})")
    for label, (t, c) in sorted(SPENT.items(), key=lambda kv: -kv[1][0]):
        print(f"  {label:<44} {t * 1e3 / n:8.2f} ms  {c / n:6.0f} calls  {t * 1e6 / c:7.1f} us/call")


if __name__ == "__main__":
    main()
