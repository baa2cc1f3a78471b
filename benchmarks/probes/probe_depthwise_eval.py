"""Where a converted MobileNetV2's eval forward loses its time (device run 1 of 2026-12-06, fifth
session: 17 ms at batch 32 against 5.8 the session before, 16.3 ms of it in 18 calls of cuDNN's
``conv2d_grouped_direct_kernel``, on both fold routes, in a process that had compiled the model as
a pipeline first). Per depthwise conv of the converted model: its eval forward alone (CUDA events,
median), the fused-or-split choice for its tag, and the engines of the fused graph and of the plain
conv graph the split runs; then the top kernels of one whole forward.

    python benchmarks/probes/probe_depthwise_eval.py [--with-pipeline] [--batch 32]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fusekit.torch as ft
from fusekit import dispatch
from fusekit.ops.common import tag
from fusekit.pipeline.bench import cuda_time_ms


def main() -> None:
    import torchvision

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--with-pipeline", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), f"cache {os.environ.get('FUSEKIT_CACHE_DIR')}, batch {args.batch}"
          + (", pipeline compiled first" if args.with_pipeline else ""))
    torch.manual_seed(0)
    if args.with_pipeline:
        import fusekit.pipeline as fp

        p = fp.compile(torchvision.models.mobilenet_v2(weights=None).eval(), (args.batch, 3, 224, 224), dtype="float16")
        print("pipeline:", getattr(p, "summary", lambda: "")() if callable(getattr(p, "summary", None)) else type(p).__name__)
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2(weights=None).eval().cuda().half().to(memory_format=torch.channels_last)
    fk, _ = ft.convert(model)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    inputs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: inputs.__setitem__(n, a[0]))
             for n, m in fk.named_modules() if isinstance(m, ft.Conv2d)]
    with torch.no_grad():
        fk(x)
        for h in hooks:
            h.remove()
        total = 0.0
        for n, xi in inputs.items():
            m = dict(fk.named_modules())[n]
            ms = cuda_time_ms(lambda: m(xi), iters=20, trials=5)
            total += ms
            if ms < 0.3 and m.groups == 1:
                continue
            w, b = m._folded(m._fk_bn, xi.dtype) if m._fk_bn is not None else (m.weight, m.bias)
            kw = dict(padding=m._fk_pad, stride=m.stride, dilation=m.dilation, groups=m.groups)
            act = m._fk_bn._fk_act() if m._fk_bn is not None else m._fk_act()
            name = {"relu6": "conv_bias_relu6", "relu": "conv_bias_relu", None: "conv_bias"}[act]
            t = tag(name, xi, w, b, attrs=tuple(kw.values()))
            fused = dispatch.plan_for(name, xi, w, b, **kw)
            plain = dispatch.plan_for("conv", xi, w, **kw)
            print(f"{n}: {ms * 1e3:8.1f} us  x{list(xi.shape)}@{tuple(xi.stride())} w{list(w.shape)}@{tuple(w.stride())} "
                  f"{dispatch.fusion_choice(t)} {dispatch.FUSION_TIMES.get((t, 'heuristic'))}; fused {fused.engine} ({fused.source}), "
                  f"conv {plain.engine} ({plain.source})")
        print(f"convs alone: {total:.3f} ms; whole forward {cuda_time_ms(lambda: fk(x), iters=10, trials=5):.3f} ms")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fk(x)
            torch.cuda.synchronize()
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:6]:
        print(f"    {e.device_time_total / 1e3:9.3f} ms  x{e.count:<4d} {e.key[:120]}")


if __name__ == "__main__":
    main()
