"""Kernel timeline of one captured training step of the float32 batch-64 autoencoder (bench_train's
case: 0.92x of eager autotuned in the seventh session), fusekit against eager, both autotuned and both replayed as CUDA
graphs. torch.profiler records the kernels of 20 replays; per side one replay (the median by span)
is printed kernel by kernel in launch order: start offset from the replay's first kernel, duration,
gap to the previous kernel's end (negative = overlap, e.g. programmatic dependent launch).

    python benchmarks/probes/probe_autoencoder_timeline.py [--batch 64] [--fp16] [--no-input-grad]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_train import graph_step
from common import autotuned_autoencoder
from timing import capture


def captured(model, x) -> torch.cuda.CUDAGraph:
    """One step (gradients cleared first) captured in a CUDA graph after 3 warm steps."""
    fn_i, reset = graph_step(model, x)
    return capture(fn_i, reps=1, warm=3, reset=reset)


def timeline(g: torch.cuda.CUDAGraph, replays: int = 20) -> list[list[dict]]:
    """Kernels of each replay: dicts name/ts/dur (us), sorted by start."""
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(replays):
            g.replay()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    ks = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not ks or len(ks) % replays:
        print(f"   {len(ks)} kernels over {replays} replays: not one list per replay")
        return [ks] if ks else []
    n = len(ks) // replays
    return [ks[i * n:(i + 1) * n] for i in range(replays)]


def show(side: str, runs: list[list[dict]]) -> None:
    spans = [r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"] for r in runs]
    med = sorted(range(len(runs)), key=lambda i: spans[i])[len(runs) // 2]
    run = runs[med]
    t0 = run[0]["ts"]
    busy = sum(k["dur"] for k in run)
    print(f"{side}: {len(run)} kernels per step, span median {statistics.median(spans):.1f} us "
          f"(min {min(spans):.1f}), kernel time {busy:.1f} us in the median replay")
    prev_end = None
    for k in run:
        gap = "" if prev_end is None else f"{k['ts'] - prev_end:+6.1f}"
        print(f"   {k['ts'] - t0:7.1f} {k['dur']:6.1f} {gap:>7}  {k['name'][:140]}")
        prev_end = k["ts"] + k["dur"] if prev_end is None else max(prev_end, k["ts"] + k["dur"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--no-input-grad", action="store_true", help="the image does not require grad (no first-layer dgrad)")
    args = ap.parse_args()
    fused, eager, x = autotuned_autoencoder(args.batch, args.fp16, input_grad=not args.no_input_grad)
    print("columns: start us, duration us, gap to the previous kernel's end (negative = overlap), kernel")
    for side, model in (("fusekit", fused), ("eager", eager)):
        show(side, timeline(captured(model, x)))


if __name__ == "__main__":
    main()
