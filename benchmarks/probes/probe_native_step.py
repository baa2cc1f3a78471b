"""What a native convolution layer would give the converted ResNet-50's uncaptured step.

The converted model's plain convolutions (no bias, no fused ReLU, in training: 52 of ResNet-50's 53)
run through probe_native_layer's C++ autograd node over the very plans fusekit resolved for them
(each signature's conv, conv_dgrad and conv_wgrad calls recorded once from fusekit's own path; a
signature whose calls relayout or split stays on fusekit's path). Everything else (BN+ReLU, adds,
pooling, the classifier) stays fusekit's Python path. Variants alternated over rounds in one process:
eager, fusekit, fusekit + native convs; per pass the host ms (GPU synchronized before, not after) and
the wall ms (synchronized after too). Gradients of the last two compared (the native convs skip the
dgrad + dReLU fusion, so BN+ReLU's backward masks instead: not bit-equal, close).

Seen (2026-12-04, third session, 12 rounds): eager 19.46 ms host, fusekit 39.71, fusekit + native convs
35.21 (saved 4.53 ms paired median, quartiles -1.64 / 10.66); 22 of 23 signatures native; loss equal
to the printed digits, largest gradient difference 2.1e-2 (bn1.bias, a sum that nearly cancels).

    CXX=/usr/bin/g++ python benchmarks/probes/probe_native_step.py [--rounds 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import converted, fwd_bwd, host_ms, rel  # noqa: E402
from probe_native_layer import build_native, conv_plans  # noqa: E402

import fusekit.torch as ft  # noqa: E402


class NativeConvs:
    """Routes plain fusekit.torch.Conv2d training calls to the extension's conv node, per signature."""

    def __init__(self, native) -> None:
        self.native, self.on = native, False
        self.sigs: dict[tuple, tuple | None] = {}

    def resolve(self, m: ft.Conv2d, x: torch.Tensor, w: torch.Tensor) -> tuple | None:
        """(plan ids, handle, workspace pointer, output shape) from one run of fusekit's own path, or None."""
        return conv_plans(self.native, x, w, padding=m._fk_pad, stride=m.stride, dilation=m.dilation, groups=m.groups)

    def patch(self, model: torch.nn.Module) -> int:
        n = 0
        for m in model.modules():
            if type(m) is ft.Conv2d and m.bias is None and m._fk_relu is None and m.activation is None and m._fk_extra is None:
                m.forward = self._forward(m, m.forward)
                n += 1
        return n

    def _forward(self, m: ft.Conv2d, fusekit_forward):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if not self.on or not m.training or not torch.is_grad_enabled() or not x.is_cuda:
                return fusekit_forward(x)
            amp = ft._amp_dtype()
            x = ft._cast(x, amp)
            w = ft._cast(m.weight, amp)
            if not x.is_contiguous(memory_format=torch.channels_last) or x.dtype != torch.float16:
                return fusekit_forward(x)
            key = (tuple(x.shape), x.stride(), tuple(w.shape), w.stride(), x.dtype, m._fk_pad, m.stride, m.dilation, m.groups)
            hit = self.sigs.get(key, False)
            if hit is False:
                hit = self.sigs[key] = self.resolve(m, x.detach(), w.detach())
            if hit is None:
                return fusekit_forward(x)
            ids, h, ws, shape = hit
            return self.native.conv(x, w, ids, h, ws, shape)

        return forward


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    native = build_native()
    base, fk, data = converted(args.model, args.batch)
    nc = NativeConvs(native)
    print(f"{nc.patch(fk)} plain convolutions patched", flush=True)

    def run(on: bool):
        def go():
            nc.on = on
            fwd_bwd(fk, data)
        return go

    sides = {"eager": lambda: fwd_bwd(base, data), "fusekit": run(False), "fusekit + native convs": run(True)}
    for go in sides.values():
        for _ in range(3):
            host_ms(go)
    native_sigs = sum(v is not None for v in nc.sigs.values())
    print(f"signatures: {len(nc.sigs)}, {native_sigs} run natively", flush=True)

    grads = {}
    for on in (False, True):
        nc.on = on
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(fk(data.x), data.y)
        loss.backward()
        grads[on] = (float(loss), {n: p.grad.detach().clone() for n, p in fk.named_parameters() if p.grad is not None})
        fk.zero_grad(set_to_none=True)
    worst = max((rel(grads[True][1][n], g), n) for n, g in grads[False][1].items())
    print(f"loss fusekit {grads[False][0]:.6f}, with native convs {grads[True][0]:.6f}; "
          f"largest gradient difference {worst[0]:.2e} ({worst[1]}), {len(grads[False][1])} parameters", flush=True)

    host: dict[str, list[float]] = {s: [] for s in sides}
    wall: dict[str, list[float]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for s, go in sides.items():
            for _ in range(3):
                host[s].append(host_ms(go))
                torch.cuda.synchronize()
                t = time.perf_counter()
                go()
                torch.cuda.synchronize()
                wall[s].append((time.perf_counter() - t) * 1e3)
        print(f"round {r}: " + ", ".join(f"{s} {statistics.median(host[s][-3:]):.2f}" for s in sides), flush=True)
    saved = [a - b for a, b in zip(host["fusekit"], host["fusekit + native convs"])]
    print(f"host ms saved by the native convolutions, paired within rounds: median {statistics.median(saved):.2f} "
          f"(quartiles {', '.join(f'{q:.2f}' for q in statistics.quantiles(saved, n=4))})")
    print(f"\n{args.model} b{args.batch} amp-fp16 forward + backward, medians of {3 * args.rounds}:")
    e = statistics.median(wall["eager"])
    for s in sides:
        w = statistics.median(wall[s])
        print(f"  {s:24s} host {statistics.median(host[s]):7.2f} ms, wall {w:7.2f} ms ({e / w:.2f}x eager's wall)")


if __name__ == "__main__":
    torch.backends.cudnn.benchmark = True
    main()
