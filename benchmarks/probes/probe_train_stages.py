"""Where a converted ResNet-50's uncaptured AMP training step spends host time, by stage, and how
much of it is Python's garbage collector.

For PyTorch eager and the fusekit-converted model (batch 64, channels-last, GradScaler): host ms
(no synchronize inside a stage; the GPU is synchronized between stages so no stage waits on an
earlier one's work) of forward + loss, backward, optimizer step; the time gc.callbacks see spent in
collections per step, and collections per generation; then the fusekit step again after
gc.freeze() (objects alive now move out of the collector's reach) and with gc disabled.

    python benchmarks/probes/probe_train_stages.py [--model resnet50] [--batch 64]
"""
from __future__ import annotations

import argparse
import gc
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

GC = {"t": 0.0, "start": 0.0, "n": [0, 0, 0]}


def _gc_cb(phase: str, info: dict) -> None:
    if phase == "start":
        GC["start"] = time.perf_counter()
    else:
        GC["t"] += time.perf_counter() - GC["start"]
        GC["n"][info["generation"]] += 1


def stages(model, data, n: int = 8) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gs = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    fw, bw, st, whole = [], [], [], []
    for i in range(n + 3):
        torch.cuda.synchronize()
        GC["t"], GC["n"] = 0.0, [0, 0, 0]
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
        t4 = time.perf_counter()
        gs.step(opt)
        gs.update()
        t5 = time.perf_counter()
        if i >= 3:
            fw.append((t1 - t0) * 1e3)
            bw.append((t3 - t2) * 1e3)
            st.append((t5 - t4) * 1e3)
            whole.append((GC["t"] * 1e3, list(GC["n"])))
    med = statistics.median
    return dict(forward=med(fw), backward=med(bw), optimizer=med(st), gc_ms=med(w[0] for w in whole), gc_collections=whole[-1][1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    import torchvision

    gc.callbacks.append(_gc_cb)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    base = getattr(torchvision.models, args.model)(weights=None).to(memory_format=torch.channels_last)
    fk, _ = ft.convert(base)
    data = Data(args.batch, 224)
    data.reset()
    fmt = "{:<22} forward {forward:7.2f}  backward {backward:7.2f}  optimizer {optimizer:6.2f}  gc {gc_ms:6.2f} ms {gc_collections}"
    for name, model in (("torch", base.cuda().train()), ("fusekit", fk.cuda().train())):
        print(fmt.format(name, **stages(model, data)), flush=True)
    print(f"gc thresholds {gc.get_threshold()}, objects tracked {len(gc.get_objects())}")
    gc.freeze()
    print(fmt.format("fusekit, gc.freeze()", **stages(fk, data)), flush=True)
    gc.disable()
    print(fmt.format("fusekit, gc disabled", **stages(fk, data)), flush=True)
    print(fmt.format("torch, gc disabled", **stages(base, data)), flush=True)


if __name__ == "__main__":
    main()
