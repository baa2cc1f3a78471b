"""Which fused-or-split choices the converted ResNet-50 makes on heuristic plans, and what they do
to its uncaptured step (host-bound: a split is one more execute on the host).

In one process: the model warmed up (each fused-or-split op's first call times fused against split
on the GPU), the choices printed; then the uncaptured AMP fp16 forward + backward, wall ms for
``--steps`` steps (GPU synchronized at the end), alternated over rounds: as chosen, every choice
forced to the fused graph, and eager.

    python benchmarks/probes/probe_fusion_choices.py [--model resnet50] [--rounds 4] [--steps 10]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import converted, fwd_bwd

from fusekit import dispatch


def wall_ms(model, data, steps: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fwd_bwd(model, data)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    base, fk, data = converted(args.model)
    for _ in range(3):
        fwd_bwd(fk, data)
        fwd_bwd(base, data)
    chosen = dict(dispatch.FUSION_TIMES)
    splits = {k: t for k, t in chosen.items() if dispatch.fusion_choice(*k) == "split"}
    print(f"{len(chosen)} fused-or-split ops timed, {len(splits)} kept split")
    for (tag, mode), (f, s) in sorted(chosen.items(), key=lambda kv: -(kv[1][0] - kv[1][1]) if math.isfinite(kv[1][1]) else 0):
        print(f"  {mode} {tag[0]} {dispatch._describe_tag(tag)}: fused {f * 1e3:.1f} us, split {s * 1e3:.1f} us -> {dispatch.fusion_choice(tag, mode)}")
    forced = {k: (f, math.inf) for k, (f, s) in chosen.items()}
    times: dict[str, list[float]] = {"as chosen": [], "all fused": [], "eager": []}
    for _ in range(args.rounds):
        for name in times:
            if name == "eager":
                times[name].append(wall_ms(base, data, args.steps))
                continue
            dispatch.FUSION_TIMES.update(chosen if name == "as chosen" else forced)
            fwd_bwd(fk, data)  # a warm pass for the fused graphs' first use
            times[name].append(wall_ms(fk, data, args.steps))
    dispatch.FUSION_TIMES.update(chosen)
    for name, ts in times.items():
        print(f"{name}: {statistics.median(ts):.2f} ms per uncaptured forward + backward (rounds {', '.join(f'{t:.2f}' for t in ts)})")


if __name__ == "__main__":
    main()
