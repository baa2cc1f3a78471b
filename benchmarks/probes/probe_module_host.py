"""Where a fusekit.torch conv -> BN+ReLU block spends host time, forward + backward (fp16
channels-last, small maps so the host bounds): per-variant host microseconds, then cProfile
(own time) and torch.profiler (self CPU time per op) of the fusekit block.

    python benchmarks/probes/probe_module_host.py
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fusekit.torch as ft
from report import profile_text, profiled
from timing import host_us


def main() -> None:
    cl = torch.channels_last
    x = torch.randn(8, 256, 7, 7, device="cuda", dtype=torch.half).contiguous(memory_format=cl).requires_grad_(True)
    dy = torch.randn(8, 256, 7, 7, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    mods = {}
    for name, lib in (("torch", torch.nn), ("fusekit", ft)):
        conv = lib.Conv2d(256, 256, 3, padding=1, bias=False).cuda().half().to(memory_format=cl)
        bn = lib.BatchNorm2d(256, **({"activation": "relu"} if lib is ft else {})).cuda()
        mods[name] = (conv, bn)

    def variants(name):
        conv, bn = mods[name]
        relu = F.relu if name == "torch" else (lambda t: t)
        return {
            "conv fwd": lambda: conv(x.detach()),
            "conv fwd+bwd": lambda: conv(x).backward(dy),
            "bn+relu fwd": lambda: relu(bn(x.detach())),
            "bn+relu fwd+bwd": lambda: relu(bn(x)).backward(dy),
            "conv+bn+relu fwd+bwd": lambda: relu(bn(conv(x))).backward(dy),
            "conv+bn+relu fwd+bwd autocast": lambda: _amp(lambda: relu(bn(conv(x)))).backward(dy),
            "conv+bn+relu fwd (no_grad)": lambda: _nograd(lambda: relu(bn(conv(x)))),
        }

    rows = {}
    for name in ("torch", "fusekit"):
        for k, fn in variants(name).items():
            rows.setdefault(k, {})[name] = host_us(fn, 200)
    print(f"{'variant':<34} {'torch us':>9} {'fusekit us':>11}")
    for k, v in rows.items():
        print(f"{k:<34} {v['torch']:9.1f} {v['fusekit']:11.1f}")

    fn = variants("fusekit")["conv+bn+relu fwd+bwd"]
    prof = profiled(fn, 100, torch.cuda.synchronize)
    print("==== cProfile, 100 fusekit blocks, by own time ====")
    print(profile_text(prof, "tottime", 40))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    print("==== torch.profiler, 20 fusekit blocks, by self CPU time ====")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


def _amp(f):
    with torch.autocast("cuda", dtype=torch.float16):
        return f()


def _nograd(f):
    with torch.no_grad():
        return f()


if __name__ == "__main__":
    main()
