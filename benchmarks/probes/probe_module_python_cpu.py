"""fusekit.torch's own Python cost per conv -> BN+ReLU block, forward + backward, on the CPU: the
op calls (ops.conv2d, ops.batchnorm and their backwards) replaced by stubs that return empty
arrays, tiny tensors so nothing computes; against two no-op autograd Functions and torch.nn's
block on the same tensors. No GPU needed.

    python benchmarks/probes/probe_module_python_cpu.py
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fusekit.torch as ft
from fusekit import ops


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) * 1e6 / n


def main() -> None:
    c1 = lambda x: torch.empty(x.shape[1])  # noqa: E731
    ops.conv2d = lambda x, w, **kw: torch.empty_like(x)
    ops.batchnorm = lambda x, g, b, rm=None, rv=None, **kw: (torch.empty_like(x), c1(x), c1(x)) + ((c1(x), c1(x)) if rm is not None else ())
    ops.batchnorm_backward = lambda dy, x, g, m, i, y=None, needs=(1, 1, 1), **kw: (torch.empty_like(x), c1(x), c1(x))
    ops.conv2d_backward = lambda dy, x, w, needs=(1, 1), **kw: (torch.empty_like(x), torch.empty_like(w))
    ft._on_graphs = lambda x, who, ranks=(4,): isinstance(x, torch.Tensor) and x.numel() > 0

    cl = torch.channels_last
    x = torch.randn(2, 8, 4, 4).contiguous(memory_format=cl).requires_grad_(True)
    dy = torch.randn(2, 8, 4, 4).contiguous(memory_format=cl)
    conv, bn = ft.Conv2d(8, 8, 3, padding=1, bias=False).to(memory_format=cl), ft.BatchNorm2d(8, activation="relu")
    tconv, tbn = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False).to(memory_format=cl), torch.nn.BatchNorm2d(8)

    class Nop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):  # type: ignore[override]
            return torch.empty_like(t)

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            return torch.empty_like(g)

    print(f"fusekit.torch block, ops stubbed:   {per_call_us(lambda: bn(conv(x)).backward(dy)):7.1f} us")
    print(f"two no-op autograd Functions:       {per_call_us(lambda: Nop.apply(Nop.apply(x)).backward(dy)):7.1f} us")
    print(f"torch.nn block, real CPU kernels:   {per_call_us(lambda: F.relu(tbn(tconv(x))).backward(dy)):7.1f} us")


if __name__ == "__main__":
    main()
