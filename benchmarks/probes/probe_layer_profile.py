"""Where one fusekit.torch layer's training host time goes: forward + backward of a bias-free 3x3
convolution (and a conv -> BN+ReLU pair), timed against torch.nn, then cProfile (top functions by
own time) and the CUDA runtime calls torch.profiler sees (synchronizations show up there).

    python benchmarks/probes/probe_layer_profile.py [--calls 300]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import fusekit.torch as ft  # noqa: E402
from common import per_call_us  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    for n, c, hw in ((8, 64, 7), (64, 256, 14)):
        x = torch.randn(n, c, hw, hw, device="cuda", dtype=torch.float16).contiguous(memory_format=cl).requires_grad_(True)
        dy = torch.randn(n, c, hw, hw, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        layers = {
            "conv eager": torch.nn.Conv2d(c, c, 3, padding=1, bias=False),
            "conv fusekit": ft.Conv2d(c, c, 3, padding=1, bias=False),
            "conv+bn+relu eager": torch.nn.Sequential(torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c), torch.nn.ReLU()),
        }
        layers["conv+bn+relu fusekit"] = ft.convert(layers["conv+bn+relu eager"])[0]
        steps = {}
        for name, m in layers.items():
            m = m.cuda().to(memory_format=cl).half()

            def go(m=m):
                x.grad = None
                m(x).backward(dy)
            steps[name] = go
        times: dict[str, list[float]] = {s: [] for s in steps}
        for _ in range(5):
            for s, go in steps.items():
                times[s].append(per_call_us(go, args.calls))
        print(f"\n{n}x{c}x{hw}x{hw} fp16 channels-last, forward + backward:")
        for s, ts in times.items():
            print(f"  {s:22s} {statistics.median(ts):8.1f} us", flush=True)
        for name in ("conv fusekit", "conv+bn+relu fusekit"):
            go = steps[name]
            prof = cProfile.Profile()
            torch.cuda.synchronize()
            prof.enable()
            for _ in range(args.calls):
                go()
            torch.cuda.synchronize()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
            print(f"\ncProfile of {args.calls} x {name} (tottime):")
            print("\n".join(line[:200] for line in s.getvalue().splitlines()[6:34]))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as p:
                for _ in range(20):
                    go()
                torch.cuda.synchronize()
            ev = p.key_averages()
            rows = sorted((e for e in ev if e.key.startswith("cuda") or "ynchron" in e.key or "aten::" in e.key),
                          key=lambda e: -e.count)[:24]
            print(f"torch.profiler, 20 x {name}: runtime calls and aten ops (count / 20, self CPU us per call)")
            for e in rows:
                print(f"  {e.key[:60]:60s} {e.count / 20:6.1f}  {e.self_cpu_time_total / max(e.count, 1):8.1f}")


if __name__ == "__main__":
    main()
