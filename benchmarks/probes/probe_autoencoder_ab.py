"""What would close the float32 batch-64 autoencoder's gap to eager (captured steps, both autotuned;
probe_autoencoder_timeline: 263 vs 246 us). Two differences seen kernel by kernel:

- the output layer's fused ReLU-backward + bias-gradient on 3 channels took 18.5 us (eager's
  threshold_backward + sum 9.2); fusekit now reads few-channel memory as rows of pixels
  (fusekit.ops.common._pixels_per_row; probe_bias_grad_view: 9.2 us alone): variant ``norows``
  turns that off;
- the first layer's weight gradient takes 36-38 us in fusekit's step against 28-30 in eager's and
  29 alone on the step's own arrays: variant ``fence`` puts a one-element torch kernel before each
  conv_wgrad, variant ``clone`` gives conv_wgrad fresh copies of both operands, ``clone-image`` /
  ``clone-grad`` of its image-role (x) or gradient-role (dy) operand alone.

Variants alternate over rounds in one process; per variant the median captured step and the two
wgrad kernels' durations (torch.profiler over 20 replays).

    python benchmarks/probes/probe_autoencoder_ab.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_train import autoencoder_case, graphed_time_us
from probe_autoencoder_timeline import captured, timeline

import fusekit
import fusekit.ops.common as common_ops
import fusekit.ops.conv as conv_ops

REAL_CALL, ROWS = conv_ops.call, common_ops.ROW_CHANNELS
_ONE = {}


def fence_call(name, *args, **kw):
    if name == "conv_wgrad":
        one = _ONE.setdefault("t", torch.zeros(1, device="cuda"))
        one.add_(1)
    return REAL_CALL(name, *args, **kw)


def cloning(which: tuple[int, ...]):
    def clone_call(name, *args, **kw):
        if name == "conv_wgrad":
            args = tuple(a.clone(memory_format=torch.channels_last) if i in which else a for i, a in enumerate(args))
        return REAL_CALL(name, *args, **kw)
    return clone_call


@contextlib.contextmanager
def variant(name: str):
    if "norows" in name:
        common_ops.ROW_CHANNELS = 1
    if "fence" in name:
        conv_ops.call = fence_call
    if name.startswith("clone"):
        conv_ops.call = cloning({"clone": (0, 1), "clone-image": (0,), "clone-grad": (1,)}[name])
    try:
        yield
    finally:
        conv_ops.call, common_ops.ROW_CHANNELS = REAL_CALL, ROWS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    fusekit.configure(mode="autotune", disk=False)
    variants = ["eager", "fusekit", "norows", "clone", "clone-image", "clone-grad"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    wgrads: dict[str, list[list[float]]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants:
            torch.manual_seed(0)
            _, fused, eager, x = autoencoder_case(64, torch.float32)
            model = eager if v == "eager" else fused
            with variant(v):
                times[v].append(graphed_time_us(model, x))
                if r == 0:
                    runs = timeline(captured(model, x))
                    wgrads[v] = [[k["dur"] for k in run if "wgrad" in k["name"]] for run in runs]
                    if v in ("norows", "fusekit"):
                        print(f"{v}: kernels of one replay: " + ", ".join(f"{k['name'][:28]} {k['dur']:.1f}" for k in runs[len(runs) // 2]))
    print("autoencoder 64x64x3 (batch 64) fp32, captured step, both autotuned")
    base = statistics.median(times["eager"])
    for v in variants:
        t = statistics.median(times[v])
        w = wgrads[v]
        ws = " / ".join(f"{statistics.median(col):.1f}" for col in zip(*w)) if w and all(w) else "n/a"
        print(f"   {v:12s} {t:7.1f} us (rounds {' '.join(f'{s:.1f}' for s in times[v])})  eager/this {base / t:.3f}  wgrad kernels us: {ws}")


if __name__ == "__main__":
    main()
