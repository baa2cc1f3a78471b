"""ReLU backward in the next conv's dgrad (convert's cross-module fusion), on against off, one process.

The converted ResNet-50 (amp-fp16, batch 64, channels-last): per side the GPU time of the forward +
backward made CUDA graphs (fusekit.torch.graphed; events, median of 20 steps per round) and the host
time of the uncaptured forward + backward (median of 3 per round), alternated over rounds; the
number of executes per uncaptured pass; and which ResNet-50 dgrad + dReLU shapes cuDNN refused.

    python benchmarks/probes/probe_drelu_ab.py [--rounds 4]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import converted, fwd_bwd, host_ms

import fusekit.torch as ft
from fusekit import dispatch
from fusekit.errors import FusionWarning


def gpu_ms(fn, steps: int = 20) -> float:
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    _, on, data = converted("resnet50", 64)
    off = copy.deepcopy(on)
    marked = 0
    for m in off.modules():
        if getattr(m, "_fk_drelu", False):
            m.__dict__["_fk_drelu"] = False
            marked += 1
    print(f"convs with the dReLU in their dgrad: {marked}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FusionWarning)
        for _ in range(3):
            host_ms(lambda: fwd_bwd(on, data))
            host_ms(lambda: fwd_bwd(off, data))
    refused = [str(w.message)[:160] for w in caught if "conv_dgrad_drelu" in str(w.message)]
    print(f"dgrad + dReLU refused by cuDNN for {len(refused)} shape(s)" + "".join(f"\n  {r}" for r in refused[:6]))
    counts = {}
    for name, model in (("on", on), ("off", off)):
        n = [0]
        run0 = dispatch.run

        def run(*a, **k):
            n[0] += 1
            return run0(*a, **k)

        mods = [m for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("fusekit") and getattr(m, "run", None) is run0]
        for m in mods:
            m.run = run
        try:
            fwd_bwd(model, data)
        finally:
            for m in mods:
                m.run = run0
        counts[name] = n[0]
    print(f"executes per uncaptured pass: on {counts['on']}, off {counts['off']}")
    graphs = {name: ft.graphed(model, data.x, autocast=torch.float16) for name, model in (("on", copy.deepcopy(on)), ("off", copy.deepcopy(off)))}

    def graphed_pass(model):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(data.x), data.y)
        loss.backward()

    res: dict[str, list[float]] = {k: [] for k in ("gpu on", "gpu off", "host on", "host off")}
    for r in range(args.rounds):
        for name in ("on", "off"):
            res[f"gpu {name}"].append(gpu_ms(lambda: graphed_pass(graphs[name])))
            res[f"host {name}"].append(statistics.median(host_ms(lambda: fwd_bwd(on if name == "on" else off, data)) for _ in range(3)))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in res.items()), flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print("medians, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    print(f"graphed forward+backward: off / on = {med['gpu off'] / med['gpu on']:.3f}x; "
          f"uncaptured host: off / on = {med['host off'] / med['host on']:.3f}x")


if __name__ == "__main__":
    main()
