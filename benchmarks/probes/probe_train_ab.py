"""A/B in one process: the converted ResNet-50's uncaptured AMP step (host ms of forward and of
backward, the GPU synchronized between stages) with the cuDNN workspace handed to the frontend as
an address (A, fusekit's way) or as the torch buffer (B), alternated round by
round so that drift over the process's life (seen at +-30% on the H200 host) falls on both; with
PyTorch eager in the same rounds for scale.

    python benchmarks/probes/probe_train_ab.py [--rounds 8]

Ran once, device call 5 of 2026-12-03, on tree 7770b93 where Workspace had an ``arg`` slot (the
buffer): B was 16% slower (58.9 vs 50.6 ms forward + backward, 24 steps each), so B was reverted
and this probe no longer runs as is (it sets ``arg``, which dispatch no longer reads).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fusekit.torch as ft
from bench_train_models import Data
from fusekit.engine.runtime import RUNTIME


def stepper(model, data):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gs = torch.amp.GradScaler("cuda", init_scale=2.0**10)

    def step():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(data.x), data.y)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        gs.scale(loss).backward()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        gs.step(opt)
        gs.update()
        return (t1 - t0) * 1e3, (t3 - t2) * 1e3

    return step


def workspaces_as(buffer: bool) -> None:
    for ws in list(RUNTIME._workspaces.values()):
        ws.arg = ws._owner if buffer and ws._owner is not None else ws.ptr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    import torchvision

    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    base = getattr(torchvision.models, args.model)(weights=None).to(memory_format=torch.channels_last)
    fk, _ = ft.convert(base)
    data = Data(args.batch, 224)
    data.reset()
    runs = {"torch eager": stepper(base.cuda().train(), data), "fusekit": stepper(fk.cuda().train(), data)}
    for s in runs.values():
        for _ in range(3):
            s()
    seen: dict[str, list] = {"torch eager": [], "fusekit, workspace as address": [], "fusekit, workspace as buffer": []}
    for r in range(args.rounds):
        order = [("fusekit, workspace as address", False), ("fusekit, workspace as buffer", True)]
        for label, buffer in (order if r % 2 == 0 else order[::-1]):
            workspaces_as(buffer)
            runs["fusekit"]()
            seen[label] += [runs["fusekit"]() for _ in range(3)]
        seen["torch eager"] += [runs["torch eager"]() for _ in range(3)]
    workspaces_as(True)
    for label, xs in seen.items():
        f, b = statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)
        print(f"{label:<32} forward {f:7.2f} ms  backward {b:7.2f} ms  sum {f + b:7.2f} ms  ({len(xs)} steps)")


if __name__ == "__main__":
    main()
