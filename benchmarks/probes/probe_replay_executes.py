"""Is the uncaptured training step's host cost in cuDNN's executes, or in what surrounds them?

Records every frontend ``execute`` of one converted ResNet-50 AMP training step (batch 64,
channels-last): its arguments and its host time inside the step. Then replays the recorded
executes alone, in order, on the same arrays, with nothing between them (no fusekit, no autograd).
Prints, in host ms per step (no synchronize inside): the step, the executes inside it, and the
replay (with the workspace as an int and as a tensor). If the replay is near the in-step execute
time, the executes themselves bound the step; if far below, the cost lies around them.

    python benchmarks/probes/probe_replay_executes.py [--model resnet50] [--batch 64]
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
from bench_train_models import make_step
from common import converted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    _, fk, data = converted(args.model, args.batch)
    step, _ = make_step(fk, data, "amp-fp16", captured=False)
    for _ in range(3):
        step()
    torch.cuda.synchronize()

    cls = cudnn.pygraph
    original = cls.execute
    record: list[tuple] = []
    spent = [0.0]

    def timed(self, tensors, workspace=None, handle=None, *rest, **kw):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        r = original(self, tensors, workspace, handle, *rest, **kw)
        spent[0] += time.perf_counter() - t
        record.append((self, tuple(tensors), workspace, handle, kw.get("tensor_uids")))
        return r

    cls.execute = timed
    n = 5
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    step_ms = (time.perf_counter() - t0) * 1e3 / n
    torch.cuda.synchronize()
    cls.execute = original
    per_step = len(record) // n
    in_step_ms = spent[0] * 1e3 / n
    one = record[-per_step:]
    kinds = collections.Counter(id(r[0]) for r in one)
    print(f"{args.model} b{args.batch} amp-fp16: {per_step} executes per step on {len(kinds)} graphs")
    print(f"step host:                          {step_ms:8.2f} ms")
    print(f"executes inside the step:           {in_step_ms:8.2f} ms ({in_step_ms / step_ms:.0%}, {in_step_ms * 1e3 / per_step:.1f} us each)")

    def replay(ws_as_tensor: bool) -> float:
        wss = {}
        calls = []
        for g, tensors, ws, h, uids in one:
            if ws_as_tensor and isinstance(ws, int) and ws:
                wss.setdefault(ws, torch.empty(1, dtype=torch.uint8, device="cuda"))
            calls.append((g, tensors, ws, h, uids))
        for g, tensors, ws, h, uids in calls:  # warm
            g.execute(tensors, ws, handle=h, tensor_uids=uids)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for g, tensors, ws, h, uids in calls:
                g.execute(tensors, ws, handle=h, tensor_uids=uids)
            best = min(best, (time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
        return best

    r = replay(False)
    print(f"the same executes replayed alone:   {r:8.2f} ms ({r * 1e3 / per_step:.1f} us each)")
    # the same executes with nothing else in the process's way, ordered by graph (warm caches)
    by_graph = sorted(one, key=lambda c: id(c[0]))
    for g, tensors, ws, h, uids in by_graph:
        g.execute(tensors, ws, handle=h, tensor_uids=uids)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for g, tensors, ws, h, uids in by_graph:
        g.execute(tensors, ws, handle=h, tensor_uids=uids)
    sorted_ms = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    print(f"replayed grouped by graph:          {sorted_ms:8.2f} ms ({sorted_ms * 1e3 / per_step:.1f} us each)")
    slow = collections.defaultdict(list)
    for g, tensors, ws, h, uids in one:
        t = time.perf_counter()
        for _ in range(20):
            g.execute(tensors, ws, handle=h, tensor_uids=uids)
        slow[id(g)].append((time.perf_counter() - t) * 1e6 / 20)
        torch.cuda.synchronize()
    each = sorted(((min(v), k) for k, v in slow.items()), reverse=True)
    print("slowest graphs, host us per execute in a tight loop of 20:", [round(u, 1) for u, _ in each[:12]])
    print("median graph:", round(each[len(each) // 2][0], 1), "us")


if __name__ == "__main__":
    main()
