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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import converted, staged_step

GC = {"t": 0.0, "start": 0.0, "n": [0, 0, 0]}


def _gc_cb(phase: str, info: dict) -> None:
    if phase == "start":
        GC["start"] = time.perf_counter()
    else:
        GC["t"] += time.perf_counter() - GC["start"]
        GC["n"][info["generation"]] += 1


def stages(model, data, n: int = 8) -> dict:
    step, fw, bw, st, whole = staged_step(model, data), [], [], [], []
    for i in range(n + 3):
        GC["t"], GC["n"] = 0.0, [0, 0, 0]
        f, b, o = step()
        if i >= 3:
            fw.append(f)
            bw.append(b)
            st.append(o)
            whole.append((GC["t"] * 1e3, list(GC["n"])))
    med = statistics.median
    return {"forward": med(fw), "backward": med(bw), "optimizer": med(st), "gc_ms": med(w[0] for w in whole), "gc_collections": whole[-1][1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    gc.callbacks.append(_gc_cb)
    base, fk, data = converted(args.model, args.batch)
    fmt = "{:<22} forward {forward:7.2f}  backward {backward:7.2f}  optimizer {optimizer:6.2f}  gc {gc_ms:6.2f} ms {gc_collections}"
    for name, model in (("torch", base), ("fusekit", fk)):
        print(fmt.format(name, **stages(model, data)), flush=True)
    print(f"gc thresholds {gc.get_threshold()}, objects tracked {len(gc.get_objects())}")
    gc.freeze()
    print(fmt.format("fusekit, gc.freeze()", **stages(fk, data)), flush=True)
    gc.disable()
    print(fmt.format("fusekit, gc disabled", **stages(fk, data)), flush=True)
    print(fmt.format("torch, gc disabled", **stages(base, data)), flush=True)


if __name__ == "__main__":
    main()
