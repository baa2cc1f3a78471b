"""Where a replayed training step's host time goes (fusekit.torch.replayed, converted ResNet-50, batch
64, amp-fp16, bench_train_models' make_step): the host time of each tape entry (perf_counter around
it, grouped by aten op / fusekit pattern), the step's host time against its GPU time, and the CUDA
runtime calls and kernels per step (torch.profiler).

    python benchmarks/probes/probe_replay_host.py [--model resnet50] [--precision amp-fp16] [--steps 10]
"""
from __future__ import annotations

import argparse
import collections
import time

import torch
from common import converted

from bench_train_models import PRECISIONS, make_step
import fusekit.torch as ft
from fusekit import dispatch
from fusekit.pipeline.bench import cuda_time_ms
from fusekit.torch_replay import _name, _Tape


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--precision", default="amp-fp16", choices=list(PRECISIONS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    _, fk, data = converted(args.model, args.batch)
    rp = ft.replayed(fk)
    step, _ = make_step(rp, data, args.precision, captured=False)
    data.reset(3)
    for _ in range(8):
        step()
    assert rp.forward.tapes, rp.forward.refused
    tape = next(iter(rp.forward.tapes.values()))
    for _ in range(3):
        step()
    print(f"{torch.cuda.get_device_name()}: {args.model} b{args.batch} {args.precision}; step {cuda_time_ms(step, iters=10, trials=3, warmup=2, before_trial=data.refill):.2f} ms (events)")

    # host time of each entry (per-entry run calls; the GPU never backs the host up: host-bound)
    took: dict[str, list[float]] = collections.defaultdict(list)
    execs: dict[str, list[float]] = collections.defaultdict(list)
    run0, exe0 = _Tape.run, dispatch._execute

    def run(self: _Tape, vals: list, start: int, stop: int, pool: list | None = None) -> None:
        pc = time.perf_counter
        for i in range(start, stop):
            t = pc()
            run0(self, vals, i, i + 1, pool)
            took[_name(self.entries[i]) + (" fwd" if i < self.fwd_end else " bwd")].append(pc() - t)

    def exe(c: object, arrays: object, handle: object) -> None:
        t = time.perf_counter()
        exe0(c, arrays, handle)
        execs[getattr(c.plan.key, "pattern", "?")].append(time.perf_counter() - t)

    _Tape.run, dispatch._execute = run, exe
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    host = (time.perf_counter() - t0) / args.steps
    torch.cuda.synchronize()
    _Tape.run, dispatch._execute = run0, exe0
    n = args.steps
    tot = sum(map(sum, took.values())) / n
    print(f"host per step {host * 1e3:.2f} ms (timed entries), of which tape entries {tot * 1e3:.2f} ms; "
          f"{len(tape.entries)} entries ({tape.fwd_end} forward)")
    print("by entry (ms per step, count per step, us each):")
    for k, v in sorted(took.items(), key=lambda kv: -sum(kv[1]))[:30]:
        print(f"  {k:50s} {sum(v) / n * 1e3:7.2f} ms {len(v) // n:4d} x {sum(v) / len(v) * 1e6:7.1f} us")
    print("fusekit _execute alone, by pattern (ms per step, count, us each):")
    for k, v in sorted(execs.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {k:50s} {sum(v) / n * 1e3:7.2f} ms {len(v) // n:4d} x {sum(v) / len(v) * 1e6:7.1f} us")

    # CUDA runtime calls and kernels per step
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"profiler: GPU kernel time per step {gpu_us / 3 / 1e3:.2f} ms")
    rows = sorted((e for e in ev if e.key.startswith(("cuda", "cu")) and e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: -e.self_cpu_time_total)[:15]
    for e in rows:
        print(f"  {e.key:40s} {e.count // 3:5d} per step, {e.self_cpu_time_total / 3 / 1e3:7.2f} ms per step")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)[:6000])


if __name__ == "__main__":
    main()
