"""A ResNet block's end, relu(bn(x) + r), at ResNet-50's four stage shapes (batch 64, channels-last):
does cuDNN take the one-graph BN + add + ReLU (and its dReLU + BN backward with the residual's
gradient), and what does it save against the unfused routes? Device us per forward + backward (CUDA
graph of 20 calls, median of 15 replays) for:

- fused: ops.batchnorm(relu=True, residual=r) and ops.batchnorm_backward(residual=True);
- split: fusekit's BN graph, then the add + ReLU graph; backward dReLU graph, then the BN backward graph;
- torch: F.batch_norm, add, relu and their autograd backward (cuDNN BN, PyTorch's elementwise kernels).

    python benchmarks/probes/probe_residual_end.py [--dtype float16]
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from timing import cl, graph_time_us

from fusekit import ops
from fusekit.errors import FusionWarning

SHAPES = [(64, 256, 56, 56), (64, 512, 28, 28), (64, 1024, 14, 14), (64, 2048, 7, 7)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    args = ap.parse_args()
    dt = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}, {args.dtype}: device us per forward + backward (fused / split / torch)")
    for shape in SHAPES:
        c = shape[1]
        x, r, dy = (cl(torch.randn(shape, device="cuda", dtype=dt)) for _ in range(3))
        g, b = torch.rand(c, device="cuda") + 0.5, torch.randn(c, device="cuda")
        rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")

        def fused(i: int) -> None:
            y, mean, inv, _, _ = ops.batchnorm(x, g, b, rm, rv, relu=True, residual=r)
            ops.batchnorm_backward(dy, x, g, mean, inv, y=y, residual=True)

        def split(i: int) -> None:
            y, mean, inv, _, _ = ops.batchnorm(x, g, b, rm, rv)
            y = ops.call("add_relu", y, r, out=y)
            dz = ops.relu_backward(dy, y)
            ops.batchnorm_backward(dz, x, g, mean, inv)

        xt, rt, gt, bt = x.detach().requires_grad_(), r.detach().requires_grad_(), g.detach().requires_grad_(), b.detach().requires_grad_()

        def eager(i: int) -> None:
            y = torch.relu(F.batch_norm(xt, rm, rv, gt, bt, True, 0.1, 1e-5) + rt)
            torch.autograd.grad(y, (xt, rt, gt, bt), dy)

        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always", FusionWarning)
            fused(0)
        said = [str(m.message)[:160] for m in w if issubclass(m.category, FusionWarning)]
        # numerics: fused against split (the same math in two routes)
        y1, m1, i1, _, _ = ops.batchnorm(x, g, b, rm, rv, relu=True, residual=r)
        dx1 = ops.batchnorm_backward(dy, x, g, m1, i1, y=y1, residual=True)[0]
        y2 = ops.call("add_relu", ops.batchnorm(x, g, b, rm, rv)[0], r)
        dx2 = ops.batchnorm_backward(ops.relu_backward(dy, y2), x, g, m1, i1)[0]
        err = float((y1.double() - y2.double()).norm() / y2.double().norm()), float((dx1.double() - dx2.double()).norm() / dx2.double().norm())
        t = [graph_time_us(f) for f in (fused, split, eager)]
        print(f"  {list(shape)}: {t[0]:8.1f} {t[1]:8.1f} {t[2]:8.1f}   split/fused {t[1] / t[0]:.2f}x, torch/fused {t[2] / t[0]:.2f}x; "
              f"fused vs split rel y {err[0]:.1e} dx {err[1]:.1e}; {'SPLIT: ' + said[0] if said else 'one graph each way'}")


if __name__ == "__main__":
    main()
