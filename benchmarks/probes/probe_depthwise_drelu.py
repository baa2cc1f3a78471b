"""MobileNetV2's graphed amp-fp16 step (H100, 2026-12-05: fusekit 11.44 ms against PyTorch's 10.88)
spends 1.46 ms per step in a generic runtime-fusion kernel for the fused depthwise dgrad + dReLU6,
though fused_or_split timed fused and split on their first call and kept fused. Question: does the
split route win inside the step, and by how much?

After warm-up (each fused-or-split op timed on its first call), prints every conv_dgrad_drelu choice
with groups > 1 (fused / split us as timed), re-times each such pair now, warm, alone (device_ms,
median of 5); then captures the step three times (fusekit.torch.graphed): as chosen, depthwise
dgrad+dReLU forced split, every dgrad+dReLU forced split; and times the replayed steps alternately
(CUDA events, median of rounds), with PyTorch's graphed step as the reference.

    python benchmarks/probes/probe_depthwise_drelu.py [--model mobilenet_v2] [--rounds 5] [--steps 10]
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import converted, fwd_bwd  # noqa: E402  (puts benchmarks/ on sys.path)

from bench_train_models import make_step  # noqa: E402
from probe_graphed_kernels import graphed_model  # noqa: E402

from fusekit import dispatch  # noqa: E402


def groups_of(tag: tuple) -> int:
    """The groups attribute of a conv_dgrad_drelu tag (attrs: output_padding, padding, stride, dilation, groups, clip...)."""
    return int(tag[1][4])


def events_ms(run, refill, steps: int) -> float:
    """Milliseconds per step over ``steps`` replayed steps (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        refill()
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    base, fk, data = converted(args.model, args.batch)
    for _ in range(3):
        fwd_bwd(fk, data)
    chosen = dict(dispatch.FUSION_TIMES)
    drelu = {k: t for k, t in chosen.items() if k[0][0] == "conv_dgrad_drelu"}
    deep = {k: t for k, t in drelu.items() if groups_of(k[0]) > 1}
    print(f"{len(chosen)} fused-or-split ops timed; conv_dgrad_drelu {len(drelu)}, of them grouped {len(deep)}")
    for (tag, mode), (f, s) in sorted(drelu.items(), key=lambda kv: -groups_of(kv[0][0])):
        print(f"  groups {groups_of(tag):4d} {dispatch._describe_tag(tag)}: fused {f * 1e3:.1f} us, split {s * 1e3:.1f} us "
              f"-> {dispatch.fusion_choice(tag, mode)}")
    variants = {
        "as chosen": chosen,
        "depthwise split": {**chosen, **{k: (f, 0.0) for k, (f, s) in deep.items()}},
        "all dgrad+dReLU split": {**chosen, **{k: (f, 0.0) for k, (f, s) in drelu.items()}},
    }
    runs = {}
    for name, times in variants.items():
        dispatch.FUSION_TIMES.clear()
        dispatch.FUSION_TIMES.update(times)
        data.reset()
        g = graphed_model(copy.deepcopy(fk), "fusekit", data.x, torch.float16)  # a model is graphed once: a copy each
        runs[name], _ = make_step(g, data, "amp-fp16", captured=False)
        for _ in range(3):
            data.refill()
            runs[name]()
    dispatch.FUSION_TIMES.clear()
    dispatch.FUSION_TIMES.update(chosen)
    data.reset()
    runs["torch graphed"], _ = make_step(graphed_model(base, "torch", data.x, torch.float16), data, "amp-fp16", captured=False)
    for _ in range(3):
        data.refill()
        runs["torch graphed"]()
    ms: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            ms[name].append(events_ms(run, data.refill, args.steps))
    ref = statistics.median(ms["torch graphed"])
    for name, ts in ms.items():
        m = statistics.median(ts)
        print(f"{name:24s} {m:7.2f} ms per graphed step (torch/this {ref / m:.2f}x; rounds {', '.join(f'{t:.2f}' for t in ts)})")
    print("finite:", all(math.isfinite(v) for t in ms.values() for v in t))


if __name__ == "__main__":
    main()
