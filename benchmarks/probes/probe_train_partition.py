"""Where the converted ResNet-50's uncaptured forward + backward host time goes, in one process.

Variants, alternated over rounds (host ms of forward + backward, GPU synchronized before each):
  eager         torch.nn as is
  fusekit       the converted model
  no-execute    the converted model with dispatch's execute (dispatch._execute: the frontend's native
                entry or graph.execute) a no-op (everything else real: keys, allocations,
                autograd): the host time that is not cuDNN's
  timed         the converted model with each execute timed (perf_counter_ns): executes in the model
  replay        the executes the timed pass recorded, replayed alone in order
  replay+work   the same, with a fixed chunk of Python + torch host work between executes
                (two torch.empty and a small dict loop): does work in between slow the executes?
  replay+alloc  the recorded executes with their outputs allocated afresh each time (as a
                recorded-dispatch "tape" per block would run them) and one no-op autograd
                Function per 17 executes (a Bottleneck's forward or backward): the host floor
                of replaying recorded dispatch from Python

    python benchmarks/probes/probe_train_partition.py [--model resnet50] [--rounds 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import converted, fwd_bwd, host_ms

from fusekit import dispatch


def profile_passes(base, fk, data, noop) -> None:
    """cProfile of 5 no-execute passes (the host work that is not cuDNN's), then the aten ops each
    side issues in one pass (torch.profiler, CPU), most frequent first."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    dispatch._execute, real = noop, dispatch._execute
    try:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            fwd_bwd(fk, data)
        pr.disable()
    finally:
        dispatch._execute = real
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(30)
    for name, model in (("eager", base), ("fusekit", fk)):
        before = torch.cuda.memory_stats()
        fwd_bwd(model, data)
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        print(f"{name}: caching allocator over one pass: " + ", ".join(
            f"{k} +{after.get(k, 0) - before.get(k, 0)}" for k in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fwd_bwd(model, data)
        torch.cuda.synchronize()
        rows = sorted(prof.key_averages(), key=lambda e: -e.count)
        total = sum(e.count for e in rows)
        print(f"{name}: {total} profiled CPU events in one pass; most frequent:")
        for e in rows[:28]:
            print(f"  x{e.count:<5} {e.cpu_time_total / max(e.count, 1):8.1f} us avg  {e.key[:90]}")
        waits = [e for e in rows if any(w in e.key for w in ("ynchron", "Malloc", "Free", "Memcpy", "EventQuery", "StreamWait", "item", "_local_scalar"))]
        print(f"{name}: calls that can wait on the GPU or the allocator: " +
              (", ".join(f"{e.key} x{e.count} ({e.cpu_time_total / 1e3:.2f} ms)" for e in waits) or "none"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--profile", action="store_true", help="instead: cProfile of the no-execute pass, and aten op counts per side")
    args = ap.parse_args()
    base, fk, data = converted(args.model, args.batch)
    for _ in range(3):
        host_ms(lambda: fwd_bwd(base, data))
        host_ms(lambda: fwd_bwd(fk, data))
    real = dispatch._execute  # the one execute every call goes through
    native = sum(c.native is not None for c in dispatch._FAST.values())
    print(f"dispatch entries {len(dispatch._FAST)}, {native} through the frontend's native entry", flush=True)
    record: list[tuple] = []
    spent = [0, 0]

    def noop(c, arrays, handle):
        return None

    def timed(c, arrays, handle):
        t = time.perf_counter_ns()
        real(c, arrays, handle)
        spent[0] += time.perf_counter_ns() - t
        spent[1] += 1
        record.append((c, tuple(arrays), handle))

    class Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    leaf = torch.zeros(1, device="cuda", requires_grad=True)

    def replay_alloc() -> None:
        y = leaf
        for i, (c, arrays, h) in enumerate(record):
            k = len(c.outs)
            fresh = tuple([c.out_adapter.empty(s) for s in c.outs])
            real(c, arrays[:len(arrays) - k] + fresh, h)
            if i % 17 == 0:
                y = Noop.apply(y)

    def replay(work: bool) -> None:
        sink = {}
        for c, arrays, h in record:
            real(c, arrays, h)
            if work:
                a = torch.empty(64, device="cuda")
                b = torch.empty(64, device="cuda")
                for i in range(20):
                    sink[i] = (a, b, i)

    if args.profile:
        profile_passes(base, fk, data, noop)
        return
    results: dict[str, list[float]] = {k: [] for k in ("eager", "fusekit", "no-execute", "timed", "replay", "replay+work", "replay+alloc")}
    per_exec: list[float] = []
    for r in range(args.rounds):
        results["eager"] += [host_ms(lambda: fwd_bwd(base, data)) for _ in range(3)]
        results["fusekit"] += [host_ms(lambda: fwd_bwd(fk, data)) for _ in range(3)]
        dispatch._execute = noop
        try:
            results["no-execute"] += [host_ms(lambda: fwd_bwd(fk, data)) for _ in range(3)]
        finally:
            dispatch._execute = real
        for _ in range(3):
            record.clear()
            spent[:] = [0, 0]
            dispatch._execute = timed
            try:
                results["timed"].append(host_ms(lambda: fwd_bwd(fk, data)))
            finally:
                dispatch._execute = real
            per_exec.append(spent[0] / 1e3 / max(spent[1], 1))
        n = len(record)
        results["replay"] += [host_ms(lambda: replay(False)) for _ in range(3)]
        results["replay+work"] += [host_ms(lambda: replay(True)) for _ in range(3)]
        results["replay+alloc"] += [host_ms(replay_alloc) for _ in range(3)]
        print(f"round {r}: " + ", ".join(f"{k} {statistics.median(v[-3:]):.2f}" for k, v in results.items()), flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{args.model} b{args.batch} amp-fp16, forward + backward host ms (median of {3 * args.rounds}):")
    for k, v in med.items():
        print(f"  {k:<12} {v:8.2f}")
    print(f"executes per pass: {n}; timed in the model: {statistics.median(per_exec):.1f} us each "
          f"({statistics.median(per_exec) * n / 1e3:.2f} ms); replayed alone: {med['replay'] * 1e3 / n:.1f} us each; "
          f"with work between: {med['replay+work'] * 1e3 / n:.1f} us each (the work alone is not subtracted); "
          f"outputs allocated afresh + a Function per 17: {med['replay+alloc'] * 1e3 / n:.1f} us each")
    work = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        sink = {}
        for _ in range(n):
            a = torch.empty(64, device="cuda")
            b = torch.empty(64, device="cuda")
            for i in range(20):
                sink[i] = (a, b, i)
        work.append((time.perf_counter() - t) * 1e3)
    print(f"the work alone: {statistics.median(work):.2f} ms for {n} chunks")
    print(f"not cuDNN (fusekit - timed executes): {med['fusekit'] - statistics.median(per_exec) * n / 1e3:.2f} ms; "
          f"no-execute pass {med['no-execute']:.2f} ms")


if __name__ == "__main__":
    main()
