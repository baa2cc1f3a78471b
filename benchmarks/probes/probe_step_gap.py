"""Why the converted ResNet-50's uncaptured AMP training step (bench_train_models: 49.7 ms on the H100,
2026-12-06) costs so much more than its forward + backward on the host (probe_train_partition, the
same day: 30.7 ms; eager 21.1 against its 23.4 ms step).

In one process, each side (eager, fusekit) alternated over rounds:
  fwd_bwd      host ms of forward + loss + backward (GPU synchronized before; the final sync not counted)
  step         bench_train_models' step (autocast, GradScaler, SGD momentum), CUDA events over 10 steps
  step-host    the same 10 steps, host ms until the last one is queued (its waits included)
  no-scaler    the step without GradScaler (loss.backward(), opt.step()), CUDA events over 10 steps
and over the 10 steps: the caching allocator's device allocations / frees / retries, and the
synchronizing calls torch.profiler sees in one step.

    python benchmarks/probes/probe_step_gap.py [--model resnet50] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import converted, fwd_bwd, host_ms

from bench_train_models import make_step
from fusekit.pipeline.bench import cuda_time_ms


def no_scaler_step(model: torch.nn.Module, data) -> callable:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(data.x), data.y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def waits_in_one_step(step) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    torch.cuda.synchronize()
    keys = ("ynchron", "Malloc", "Free", "Memcpy", "EventQuery", "StreamWait", "item", "_local_scalar")
    rows = [e for e in prof.key_averages() if any(k in e.key for k in keys)]
    return ", ".join(f"{e.key} x{e.count} {e.cpu_time_total / 1e3:.2f} ms" for e in rows) or "none"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    base, fk, data = converted(args.model, args.batch)
    sides = {"eager": base, "fusekit": fk}
    steps = {k: make_step(m, data, "amp-fp16", captured=False)[0] for k, m in sides.items()}
    plain = {k: no_scaler_step(m, data) for k, m in sides.items()}
    for k in sides:  # warm-up: plans, the autocast cache, the allocator's pools
        for _ in range(3):
            steps[k]()
            plain[k]()
            fwd_bwd(sides[k], data)
    torch.cuda.synchronize()
    res: dict[str, dict[str, list[float]]] = {k: {"fwd_bwd": [], "step": [], "step-host": [], "no-scaler": []} for k in sides}
    for r in range(args.rounds):
        for k, m in sides.items():
            res[k]["fwd_bwd"] += [host_ms(lambda: fwd_bwd(m, data)) for _ in range(3)]
            res[k]["step"].append(cuda_time_ms(steps[k], iters=10, trials=3, warmup=1))
            before = torch.cuda.memory_stats()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                steps[k]()
            res[k]["step-host"].append((time.perf_counter() - t) * 1e3 / 10)
            torch.cuda.synchronize()
            after = torch.cuda.memory_stats()
            res[k]["no-scaler"].append(cuda_time_ms(plain[k], iters=10, trials=3, warmup=1))
            alloc = ", ".join(f"{s} +{after.get(s, 0) - before.get(s, 0)}" for s in ("num_device_alloc", "num_device_free", "num_alloc_retries"))
            print(f"round {r} {k:<8} " + ", ".join(f"{n} {statistics.median(v[-3:]) if n == 'fwd_bwd' else v[-1]:.2f}" for n, v in res[k].items())
                  + f"; over 10 steps: {alloc}", flush=True)
    print(f"\n{args.model} b{args.batch} amp-fp16, ms (medians over {args.rounds} rounds):")
    for k in sides:
        print(f"  {k:<8} " + "  ".join(f"{n} {statistics.median(v):7.2f}" for n, v in res[k].items()))
    for k in sides:
        print(f"{k}: calls that can wait in one step: {waits_in_one_step(steps[k])}")


if __name__ == "__main__":
    main()
