"""How far cuDNN's heuristic plans are from the best plan for every graph a converted model's
training step (and eval forward) runs. Device run 6 of 2026-12-06 (fifth session), `fusekit
autotune conv_bias_relu6` on a MobileNetV2 1x1 conv: the heuristics' first plan (eng0) 3785 us,
the best 46 us (82x); the same engine had made the converted model's eval forward 17 ms. This probe
looks for more such plans: it records each distinct dispatch key of one steady-state step (the
operands cloned), autotunes each (all candidates of heuristics A, B and FALLBACK, timed in CUDA
graphs), and lists the keys whose heuristic plan is slowest against the best, weighted by how
often the step calls them.

    python benchmarks/probes/probe_heuristic_audit.py [--model mobilenet_v2] [--batch 32] [--budget 150]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fusekit
import fusekit.torch as ft
from fusekit import dispatch
from fusekit.engine.autotune import TuneOptions
from fusekit.ops import conv as ops_conv, linear as ops_linear

SEEN: dict[tuple, tuple] = {}  # key -> (pattern, attrs, cloned operands)
COUNT: Counter = Counter()


def _sig(a: object) -> object:
    return (tuple(a.shape), str(a.dtype), tuple(a.stride())) if isinstance(a, torch.Tensor) else a


def _clone(a: object) -> object:
    if not isinstance(a, torch.Tensor):
        return a
    c = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
    return c.copy_(a.detach())


def recording(run):
    def wrapped(pattern, names, values, operands, out, cache=None):
        name = pattern if isinstance(pattern, str) else pattern.name
        key = (name, tuple(names), tuple(values), tuple(_sig(a) for a in operands))
        COUNT[key] += 1
        if key not in SEEN:
            SEEN[key] = (name, dict(zip(names, values)), tuple(_clone(a) for a in operands))
        return run(pattern, names, values, operands, out, cache)
    return wrapped


def main() -> None:
    import torchvision

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--budget", type=float, default=150.0, help="seconds of tuning in all; keys left then are listed as untuned")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(weights=None).cuda().to(memory_format=torch.channels_last)
    fk, _ = ft.convert(model)
    opt = torch.optim.SGD(fk.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device="cuda")

    def train_step() -> None:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(fk(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def eval_forward() -> None:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            fk(x)

    for _ in range(3):  # first calls: plans built, fused-or-split timings
        fk.train()
        train_step()
        fk.eval()
        eval_forward()
    torch.cuda.synchronize()
    orig = dispatch.run
    for mod in (dispatch, ops_conv, ops_linear):
        mod.run = recording(orig)
    counts = {}
    for phase, fn, mode in (("train", train_step, True), ("eval", eval_forward, False)):
        fk.train(mode)
        COUNT.clear()
        fn()
        counts[phase] = dict(COUNT)
    for mod in (dispatch, ops_conv, ops_linear):
        mod.run = orig
    torch.cuda.synchronize()
    keys = sorted(SEEN, key=lambda k: -(counts["train"].get(k, 0) + counts["eval"].get(k, 0)))
    print(torch.cuda.get_device_name(), f"{args.model} batch {args.batch} amp-fp16 channels-last: "
          f"{len(keys)} distinct keys ({sum(counts['train'].values())} calls per training step, {sum(counts['eval'].values())} per eval forward)")
    rows, t0, untuned = [], time.perf_counter(), []
    for k in keys:
        if time.perf_counter() - t0 > args.budget:
            untuned.append(k)
            continue
        name, attrs, operands = SEEN[k]
        try:
            used = dispatch.plan_for(name, *operands, **attrs).engine
            r = fusekit.autotune(name, *operands, options=TuneOptions(budget_s=1.0), **attrs)
        except Exception as e:  # noqa: BLE001 - a probe: say it and go on
            print(f"  {name} {[a[0] for a in k[3] if isinstance(a, tuple)]}: {type(e).__name__}: {str(e)[:160]}")
            continue
        best = next((c for c in r.candidates if c.index == r.best), None)
        n = counts["train"].get(k, 0) + counts["eval"].get(k, 0)
        rows.append((n * (r.heuristic_us - r.best_us), name, k, used, r, best, n))
    print(f"tuned {len(rows)} keys in {time.perf_counter() - t0:.0f} s; untuned (budget): {len(untuned)}")
    rows.sort(key=lambda t: -t[0])
    total = sum(max(0.0, t[0]) for t in rows)
    print(f"heuristic - best, summed over one training step + one eval forward: {total / 1e3:.3f} ms")
    for lost, name, k, used, r, best, n in rows[:25]:
        shapes = " ".join("x".join(map(str, a[0])) + ("h" if "16" in a[1] else "f") for a in k[3] if isinstance(a, tuple))
        attrs = ",".join(f"{a}={v}" for a, v in zip(k[1], k[2]))
        print(f"  {lost / 1e3:7.3f} ms  x{n:<3d} {name:24s} {shapes} {attrs}: heuristic {used} {r.heuristic_us:.1f} us, "
              f"best {best.name if best else '?'} {r.best_us:.1f} us ({r.speedup:.2f}x), {len(r.candidates)} candidates")


if __name__ == "__main__":
    main()
