"""Is a cuDNN execute slower on PyTorch's autograd device thread, or when plans interleave?

The module probe (probe_module_host.py) found fusekit.torch's conv -> BN+ReLU block 450 us slower
than torch.nn's on the host, with the frontend's execute at ~52 us per call inside the model
against 14-21 us in a tight loop. This times, in host microseconds per call (fp16 channels-last,
8x256x7x7, so the host bounds):
  1. ops.conv2d_backward on the main thread, in a tight loop;
  2. the same call made from a custom autograd Function's backward (the autograd device thread);
  3. the main-thread call with three other plans (BN forward, BN backward, conv forward) run
     between repetitions, per call of the four.

    python benchmarks/probes/probe_execute_thread.py
"""
from __future__ import annotations

import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fusekit import ops
from timing import host_us


def main() -> None:
    cl = torch.channels_last
    x = torch.randn(8, 256, 7, 7, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    w = torch.randn(256, 256, 3, 3, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    dy = torch.randn_like(x)
    gamma, beta = torch.rand(256, device="cuda") + 0.5, torch.randn(256, device="cuda")
    rm, rv = torch.zeros(256, device="cuda"), torch.ones(256, device="cuda")

    def bwd():
        return ops.conv2d_backward(dy, x, w, padding=1)

    main_us = host_us(bwd)
    threads = set()

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):  # type: ignore[override]
            return t.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            threads.add(threading.get_ident())
            for _ in range(10):
                bwd()
            return g

    leaf = torch.zeros(1, device="cuda", requires_grad=True)

    def ten_in_backward():
        Probe.apply(leaf).sum().backward()

    plain = host_us(lambda: torch.zeros(1, device="cuda", requires_grad=True).clone().sum().backward(), 100)
    in_bwd = (host_us(ten_in_backward, 100) - plain) / 10
    y, mean, inv, _, _ = ops.batchnorm(x, gamma, beta, rm, rv, relu=True)

    def four():
        ops.conv2d(x, w, padding=1)
        ops.batchnorm(x, gamma, beta, rm, rv, relu=True)
        ops.batchnorm_backward(dy, x, gamma, mean, inv, y=y)
        bwd()

    t0 = time.perf_counter()
    alone = [host_us(f) for f in (lambda: ops.conv2d(x, w, padding=1), lambda: ops.batchnorm(x, gamma, beta, rm, rv, relu=True),
                                  lambda: ops.batchnorm_backward(dy, x, gamma, mean, inv, y=y), bwd)]
    mixed = host_us(four)
    print(f"ops.conv2d_backward, main thread, tight loop:          {main_us:7.1f} us")
    print(f"ops.conv2d_backward, inside an autograd backward:      {in_bwd:7.1f} us (thread {'other' if threading.get_ident() not in threads else 'main'})")
    print(f"four ops, each alone in a tight loop (sum):             {sum(alone):7.1f} us  {[round(a, 1) for a in alone]}")
    print(f"the same four interleaved, per round:                   {mixed:7.1f} us")
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
