"""Does anything in a converted model's uncaptured training step wait for the GPU?

A long ``torch.cuda._sleep`` kernel is queued first; then the step's forward + backward is issued.
Without a host-side wait the host finishes issuing long before the sleep ends; with one, the host
time includes the rest of the sleep. Then the first call that waited is named: dispatch.run and
every leaf module's forward are timed while the sleep runs. Last, the frontend's execute of one
plan with the same buffers every call against buffers rotated among 32 sets (pointer-dependent
host work in cuDNN, such as re-encoded TMA descriptors), each with and without a sleep queued.

    python benchmarks/probes/probe_train_sync.py
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import converted, fwd_bwd

from fusekit import dispatch, ops

SLEEP_MS = 300.0


def sleep(ms: float) -> None:
    torch.cuda._sleep(int(ms * 1.98e6))


def host_ms(fn, queued: bool) -> float:
    torch.cuda.synchronize()
    if queued:
        sleep(SLEEP_MS)
    t = time.perf_counter()
    fn()
    dt = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return dt


def first_waits(model, data) -> None:
    """While a sleep runs, time every dispatch.run and every leaf module forward; print the slow ones."""
    slow: list[tuple[str, float]] = []
    run0 = dispatch.run

    def run(pattern, *a, **k):
        t = time.perf_counter()
        try:
            return run0(pattern, *a, **k)
        finally:
            dt = (time.perf_counter() - t) * 1e3
            if dt > 20:
                slow.append((f"dispatch.run {pattern if isinstance(pattern, str) else pattern.name}", dt))

    hooks = []
    for name, m in model.named_modules():
        if next(m.children(), None) is None:
            def pre(mod, inp, name=name):
                mod._probe_t = time.perf_counter()

            def post(mod, inp, out, name=name):
                dt = (time.perf_counter() - mod._probe_t) * 1e3
                if dt > 20:
                    slow.append((f"module {name} ({type(mod).__name__})", dt))
            hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    dispatch.run = run
    try:
        for mod in list(sys.modules.values()):  # op modules imported `run` by name
            if getattr(mod, "__name__", "").startswith("fusekit") and getattr(mod, "run", None) is run0:
                mod.run = run
        host_ms(lambda: fwd_bwd(model, data), True)
    finally:
        dispatch.run = run0
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("fusekit") and getattr(mod, "run", None) is run:
                mod.run = run0
        for h in hooks:
            h.remove()
    print(f"  calls that took > 20 ms while the sleep ran: {len(slow)}")
    for what, dt in slow[:8]:
        print(f"    {what}: {dt:.1f} ms")


def pointer_rotation() -> None:
    cl = torch.channels_last
    x = [torch.randn(8, 256, 7, 7, device="cuda", dtype=torch.half).contiguous(memory_format=cl) for _ in range(32)]
    w = [torch.randn(256, 256, 3, 3, device="cuda", dtype=torch.half).contiguous(memory_format=cl) for _ in range(32)]
    y = [ops.conv2d(a, b, padding=1) for a, b in zip(x, w)]
    c = list(dispatch._FAST.values())[-1]
    h, ws = c.handle, c.workspace.ptr
    g = torch.rand(256, device="cuda") + 0.5
    bt = torch.randn(256, device="cuda")
    rm, rv = torch.zeros(256, device="cuda"), torch.ones(256, device="cuda")
    bn_outs = [ops.batchnorm(a, g, bt, rm, rv, relu=True) for a in x]
    cb = list(dispatch._FAST.values())[-1]
    n = 320

    def loop(call, arrays, rotate: bool, queued: bool) -> float:
        for i in range(20):
            call.graph.execute(arrays[0], ws, handle=h, tensor_uids=call.uids)
        torch.cuda.synchronize()
        if queued:
            sleep(SLEEP_MS)
        t = time.perf_counter()
        for i in range(n):
            call.graph.execute(arrays[i % 32 if rotate else 0], call.workspace.ptr, handle=h, tensor_uids=call.uids)
        dt = (time.perf_counter() - t) * 1e6 / n
        torch.cuda.synchronize()
        return dt

    conv_sets = [(a, b, o) for a, b, o in zip(x, w, y)]
    bn_sets = [(a, g, bt, rm, rv) + tuple(o) for a, o in zip(x, bn_outs)]
    bn_sets = [s[: len(cb.uids)] for s in bn_sets]
    for label, call, sets in (("conv fwd 8x256x7x7", c, conv_sets), ("bn+relu fwd", cb, bn_sets)):
        for rotate in (False, True):
            for queued in (False, True):
                us = loop(call, sets, rotate, queued)
                print(f"  {label:<20} {'32 buffer sets' if rotate else 'same buffers  '} {'sleep queued' if queued else 'GPU idle    '}"
                      f" {us:8.1f} us per execute{'  <- waited' if us * n / 1e3 > 0.8 * SLEEP_MS else ''}", flush=True)
    # PyTorch's cuDNN convolution, same and rotated
    for rotate in (False, True):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(n):
            j = i % 32 if rotate else 0
            F.conv2d(x[j], w[j], padding=1)
        print(f"  torch F.conv2d       {'32 buffer sets' if rotate else 'same buffers  '} GPU idle     {(time.perf_counter() - t) * 1e6 / n:8.1f} us per call")
        torch.cuda.synchronize()


def main() -> None:
    base, fk, data = converted("resnet50", 64)
    for name, model in (("torch eager", base), ("fusekit", fk)):
        for _ in range(3):
            host_ms(lambda: fwd_bwd(model, data), False)
        idle = sorted(host_ms(lambda: fwd_bwd(model, data), False) for _ in range(5))[2]
        queued = sorted(host_ms(lambda: fwd_bwd(model, data), True) for _ in range(3))[1]
        print(f"{name:<12} forward+backward host ms: GPU idle at start {idle:7.2f}; with a {SLEEP_MS:.0f} ms sleep queued {queued:7.2f}"
              f"{'  <- the host waited for the GPU' if queued > 0.8 * SLEEP_MS else ''}", flush=True)
    print("fusekit while a sleep runs:")
    first_waits(fk, data)
    print("one plan's execute, host us per call:")
    pointer_rotation()


if __name__ == "__main__":
    main()
