"""The fp32 batch-64 autoencoder's three-channel graphs in other memory layouts.

Its largest graphs are two dgrads writing 64x3x64x64 (the transposed conv's forward, the first
conv's input gradient; 43.8 us each autotuned, of a 252 us step) and two wgrads reading a
64x3x64x64 image (29 us each). cuDNN's kernels for 3-channel NHWC tensors transpose internally.
Here each is timed alone (timing.graph_time_us) with the three-channel tensor channels-last (as
now), NCHW (through ``out=`` / the operand's strides), and with the channels padded to 4 or 8;
plus the bias + ReLU pointwise reading NCHW or a [:, :3] view of 4 channels and writing NHWC; and
PyTorch's own calls as the peer. Relative errors against float64.

    python benchmarks/probes/probe_few_channel_layouts.py [--batch 64] [--modes heuristic autotune]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from timing import graph_time_us

import fusekit
from fusekit import dispatch

CONV = dict(padding=(1, 1), stride=(2, 2), dilation=(1, 1), groups=1)


def cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def line(name: str, fn, ref: torch.Tensor | None) -> None:
    try:
        out = fn()
        err = rel(out, ref) if ref is not None else float("nan")
        us = graph_time_us(lambda i: fn())
        print(f"  {name:<58} {us:8.1f} us  err {err:.1e}  out strides {tuple(out.stride())}", flush=True)
    except Exception as e:  # noqa: BLE001 - a probe reports what cuDNN refused
        print(f"  {name:<58} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["heuristic", "autotune"])
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    n = args.batch
    g = torch.Generator(device="cuda").manual_seed(0)
    dz = cl(torch.randn(n, 16, 32, 32, device="cuda", generator=g))
    x3 = cl(torch.randn(n, 3, 64, 64, device="cuda", generator=g))
    w3 = torch.randn(16, 3, 3, 3, device="cuda", generator=g)
    b3 = torch.randn(3, device="cuda", generator=g)
    pad = {c: (torch.cat([w3, torch.zeros(16, c - 3, 3, 3, device="cuda")], 1), cl(torch.cat([x3, torch.zeros(n, c - 3, 64, 64, device="cuda")], 1)))
           for c in (4, 8)}
    ref_dx = F.conv_transpose2d(dz.double(), w3.double(), stride=2, padding=1, output_padding=1)
    ref_dw = torch.ops.aten.convolution_backward(dz.double(), x3.double(), w3.double(), None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1,
                                                 [False, True, False])[1]
    y3 = cl(torch.randn(n, 3, 64, 64, device="cuda", generator=g))
    ref_act = torch.relu(y3.double() + b3.double()[None, :, None, None])
    one = torch.ones(3, device="cuda")
    for mode in args.modes:
        fusekit.configure(mode=mode, disk=False)
        dispatch.clear_dispatch()
        print(f"== {mode} plans, batch {n}, fp32", flush=True)
        print(" dgrad 64x16x32x32 -> 64xCx64x64 (the transposed conv's forward, the first conv's dx)")
        line("C=3 NHWC out (as now)", lambda: dispatch.call("conv_dgrad", dz, w3, output_padding=(1, 1), **CONV), ref_dx)
        o_nchw = torch.empty(n, 3, 64, 64, device="cuda")
        line("C=3 NCHW out", lambda: dispatch.call("conv_dgrad", dz, w3, output_padding=(1, 1), out=o_nchw, **CONV), ref_dx)
        for c in (4, 8):
            wc = pad[c][0]
            line(f"C={c} NHWC out (zero-padded filter), [:, :3] compared",
                 lambda wc=wc: dispatch.call("conv_dgrad", dz, wc, output_padding=(1, 1), **CONV)[:, :3], ref_dx)
        line("torch conv_transpose2d (cudnn.benchmark)", lambda: F.conv_transpose2d(dz, w3, stride=2, padding=1, output_padding=1), ref_dx)
        print(" wgrad x 64xCx64x64, dy 64x16x32x32 -> 16xCx3x3")
        line("C=3 x NHWC (as now)", lambda: dispatch.call("conv_wgrad", x3, dz, kernel=(3, 3), **CONV), ref_dw)
        x3n = x3.contiguous()
        line("C=3 x NCHW", lambda: dispatch.call("conv_wgrad", x3n, dz, kernel=(3, 3), **CONV), ref_dw)
        for c in (4, 8):
            xc = pad[c][1]
            line(f"C={c} x NHWC (zero-padded), [:3] compared",
                 lambda xc=xc: dispatch.call("conv_wgrad", xc, dz, kernel=(3, 3), **CONV)[:, :3], ref_dw)
        line("torch convolution_backward, weight only",
             lambda: torch.ops.aten.convolution_backward(dz, x3, w3, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False])[1],
             ref_dw)
        line("pad copy 64x3x64x64 -> 64x4x64x64 (torch cat, channels-last)",
             lambda: cl(torch.cat([x3, x3[:, :1]], 1)), None)
        print(" bias + ReLU on 64x3x64x64 (the transposed conv's split epilogue), NHWC out")
        line("NHWC in (as now)", lambda: dispatch.call("channel_scale_shift_relu", y3, one, b3), ref_act)
        y3n = y3.contiguous()
        o_cl = cl(torch.empty(n, 3, 64, 64, device="cuda"))
        line("NCHW in, NHWC out", lambda: dispatch.call("channel_scale_shift_relu", y3n, one, b3, out=o_cl), ref_act)
        y4 = cl(torch.cat([y3, y3[:, :1]], 1))
        line("[:, :3] of 4 channels NHWC in, NHWC out", lambda: dispatch.call("channel_scale_shift_relu", y4[:, :3], one, b3, out=o_cl), ref_act)
        line("torch relu(y + b)", lambda: torch.relu(y3 + b3[None, :, None, None]), ref_act)
        print(" relu_bias_grad on 64x3x64x64 (the output layer's backward)")
        line("NHWC (rows view, as now)", lambda: fusekit.ops.common.relu_bias_grad(y3, y3, True)[0], None)
        line("NCHW", lambda: fusekit.ops.common.relu_bias_grad(y3n, y3n, True)[0], None)


if __name__ == "__main__":
    main()
