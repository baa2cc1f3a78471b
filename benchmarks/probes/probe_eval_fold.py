"""Converted models in eval: the BN fold by PyTorch ops against ops.fold_batchnorm's one kernel
(fusekit.torch's since the fifth session of 2026-12-06), in one process. Device run 4 of 2026-12-06 (H100) ran the kernel
route: converted ResNets' captured eval forward 1.5-1.7x PyTorch's CUDA graph, but MobileNetV2 16.9
ms uncaptured and captured against 5.8 / 2.8 with PyTorch ops, and the ResNets' uncaptured forward
~2x slower (as if the held folds missed every call). Per model and route: uncaptured and captured ms,
how often a fold was computed, the folded filters' strides where the routes differ, the top
kernels of one uncaptured forward (torch.profiler), and the fused-or-split decisions its first forward
timed (grouped convolutions are keyed on their filter's strides, so a new stride is timed anew).

    python benchmarks/probes/probe_eval_fold.py [--models mobilenet_v2 resnet50] [--batch 32] [--with-pipeline]

Device run 4 ran bench_pipeline, which compiles each model as a pipeline before timing the drop-in
route in the same process. The kernel allocates a depthwise filter NCHW-contiguous, strides (9, 9, 3, 1),
as the pipeline's own weights may be, where PyTorch's ops keep the parameter's (9, 1, 3, 1); grouped
convolutions' fused-or-split timings are kept per tag, raw strides included, so only the kernel route
would share the pipeline's decisions. Run it with and without --with-pipeline.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fusekit.torch as ft
from fusekit import dispatch
from fusekit.pipeline.bench import capture, cuda_time_ms

COMPUTED: Counter = Counter()


def torch_fold(self, bn, dtype):
    """Conv2d._folded with the fold by PyTorch ops as the no-autograd value too (the fourth session's
    route; fusekit.torch's own _folded now folds by ops.fold_batchnorm's kernel without autograd)."""
    def fold():
        scale, shift = bn._scale_shift()
        w = (self.weight.float() * scale.reshape(-1, 1, 1, 1)).to(dtype)
        return w, (shift if self.bias is None else self.bias.float() * scale + shift).to(dtype)

    return self._memo(fold, (self.weight, self.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var), (dtype, bn.eps, bn))


def counting(memo):
    """_Fusekit._memo counting the values it computes (a held fold reused counts nothing)."""
    def wrapped(self, fn, tensors, extra=(), fast=None):
        def counted(f):
            def g():
                COMPUTED["computed"] += 1
                return f()
            return g
        return memo(self, counted(fn), tensors, extra, None if fast is None else counted(fast))
    return wrapped


def run(name: str, batch: int, route: str) -> dict:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).eval().cuda().half().to(memory_format=torch.channels_last)
    orig, orig_memo = ft.Conv2d._folded, ft._Fusekit._memo
    ft.Conv2d._folded = torch_fold if route == "torch" else orig
    ft._Fusekit._memo = counting(orig_memo)
    try:
        fk, _ = ft.convert(model)
        x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        before = set(dispatch.FUSION_TIMES)
        with torch.no_grad():
            fk(x)
            decided = [(tag, t) for (tag, mode), t in dispatch.FUSION_TIMES.items() if (tag, mode) not in before]
            COMPUTED.clear()
            unc = cuda_time_ms(lambda: fk(x), iters=20, trials=10, before_trial=lambda: x.normal_())
            computed_uncaptured = dict(COMPUTED)
            g = capture(lambda: fk(x))
            cap = cuda_time_ms(g.replay, iters=20, trials=10, before_trial=lambda: x.normal_())
            strides = [(n, tuple(m._fk_memo[2][0].stride()), tuple(m.weight.stride())) for n, m in fk.named_modules()
                       if isinstance(m, ft.Conv2d) and "_fk_memo" in m.__dict__]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fk(x)
                torch.cuda.synchronize()
        top = sorted(((e.key, e.device_time_total, e.count) for e in prof.key_averages()), key=lambda t: -t[1])[:8]
        return {"uncaptured_ms": unc, "captured_ms": cap, "computed": computed_uncaptured, "strides": strides, "top": top,
                "decided": decided}
    finally:
        ft.Conv2d._folded, ft._Fusekit._memo = orig, orig_memo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mobilenet_v2", "resnet50"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--with-pipeline", action="store_true",
                    help="compile each model with fusekit.pipeline first, in this process, as bench_pipeline does")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), f"batch {args.batch}, float16 channels-last, eval, no_grad"
          + (", each model compiled as a pipeline first" if args.with_pipeline else ""))
    for name in args.models:
        if args.with_pipeline:  # its stages' timings of fused against split are kept per tag, which the drop-in may share
            import torchvision
            import fusekit.pipeline as fp

            torch.manual_seed(0)
            fp.compile(getattr(torchvision.models, name)(weights=None).eval(), (args.batch, 3, 224, 224), dtype="float16")
        res = {"torch": run(name, args.batch, "torch"), "kernel": run(name, args.batch, "kernel"),
               "torch, again": run(name, args.batch, "torch")}  # the machine's drift
        for route, r in res.items():
            print(f"{name} {route}: uncaptured {r['uncaptured_ms']:.3f} ms, captured {r['captured_ms']:.3f} ms; "
                  f"folds computed over the timed uncaptured calls: {r['computed'].get('computed', 0)}")
            for k, us, n in r["top"]:
                print(f"    {us / 1e3:9.3f} ms  x{n:<4d} {k[:110]}")
            print(f"    fused-or-split decisions timed in its first forward: {len(r['decided'])}")
            for tag, (tf, ts) in r["decided"][:12]:  # (name, attrs, (shape, dtype, strides) per array)
                arrays = " ".join(f"{list(a[0])}@{tuple(a[2])}" for a in tag[2:])
                print(f"      {tag[0]} {arrays}: fused {tf:.4f} ms, split {ts:.4f} ms -> {'split' if dispatch._split_wins((tf, ts)) else 'fused'}")
        a, b = res["torch"]["strides"], res["kernel"]["strides"]
        diff = [(n, sa, sb, w) for (n, sa, w), (_, sb, _) in zip(a, b) if sa != sb]
        print(f"{name}: folded filters whose strides differ between the routes: {len(diff)} of {len(a)}")
        for n, sa, sb, w in diff[:8]:
            print(f"    {n}: torch {sa}, kernel {sb}, the parameter's {w}")


if __name__ == "__main__":
    main()
