"""Host microseconds per call at ResNet-50 training shapes (fp16 channels-last, batch 64):
PyTorch's op, fusekit's op, and the frontend's ``execute`` of the same plan alone (workspace as an
int address, and as a tensor). Host time = perf_counter over N back-to-back calls (no sync
inside), GPU work kept small enough to never block the queue.

    python benchmarks/probes/probe_execute_host.py
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import timing
from fusekit import dispatch, ops


def host_us(fn, n: int = 300) -> float:
    try:
        return timing.host_us(fn, n)
    except Exception as e:  # noqa: BLE001 - a probe: report and go on
        print(f"  failed: {type(e).__name__}: {str(e)[:200]}")
        return float("nan")


def last_call() -> dispatch._Call:
    return list(dispatch._FAST.values())[-1]


def raw(c, arrays):
    h = c.handle
    ws_t = c.workspace._owner

    def by_int():
        c.graph.execute(arrays, c.workspace.ptr, handle=h, tensor_uids=c.uids)

    def by_tensor():
        c.graph.execute(arrays, ws_t, handle=h, tensor_uids=c.uids)

    return by_int, by_tensor


def main() -> None:
    cl = torch.channels_last
    dev = "cuda"
    # small spatial size: GPU time per call below host time, so host time is what is measured
    x = torch.randn(8, 256, 7, 7, device=dev, dtype=torch.half).contiguous(memory_format=cl)
    w = torch.randn(256, 256, 3, 3, device=dev, dtype=torch.half).contiguous(memory_format=cl)
    gamma = torch.rand(256, device=dev) + 0.5
    beta = torch.randn(256, device=dev)
    rm, rv = torch.zeros(256, device=dev), torch.ones(256, device=dev)
    rows = []

    rows.append(("conv fwd", "torch F.conv2d", host_us(lambda: F.conv2d(x, w, padding=1))))
    rows.append(("conv fwd", "fusekit ops.conv2d", host_us(lambda: ops.conv2d(x, w, padding=1))))
    y = ops.conv2d(x, w, padding=1)
    c = last_call()
    a, b = raw(c, (x, w, y))
    rows.append(("conv fwd", "frontend execute, ws int", host_us(a)))
    rows.append(("conv fwd", "frontend execute, ws tensor", host_us(b)))
    rows.append(("conv fwd", "torch.empty alone", host_us(lambda: torch.empty_like(y))))

    rows.append(("bn+relu fwd", "torch F.batch_norm + relu", host_us(lambda: F.relu(F.batch_norm(x, rm, rv, gamma, beta, True)))))
    rows.append(("bn+relu fwd", "fusekit ops.batchnorm", host_us(lambda: ops.batchnorm(x, gamma, beta, rm, rv, relu=True))))
    yb, mean, inv, nrm, nrv = ops.batchnorm(x, gamma, beta, rm, rv, relu=True)
    c = last_call()
    a, b = raw(c, (x, gamma, beta, rm, rv, yb, mean, inv, nrm, nrv)[: len(c.uids)])
    rows.append(("bn+relu fwd", "frontend execute, ws int", host_us(a)))

    dy = torch.randn_like(x)
    rows.append(("bn bwd", "fusekit ops.batchnorm_backward", host_us(lambda: ops.batchnorm_backward(dy, x, gamma, mean, inv, y=yb))))
    rows.append(("conv bwd", "fusekit ops.conv2d_backward", host_us(lambda: ops.conv2d_backward(dy, x, w, padding=1))))
    rows.append(("conv bwd", "torch dgrad+wgrad (conv_backward)",
                 host_us(lambda: torch.ops.aten.convolution_backward(dy, x, w, None, (1, 1), (1, 1), (1, 1), False, (0, 0), 1, (True, True, False)))))

    import fusekit.torch as ft

    tconv = torch.nn.Conv2d(256, 256, 3, padding=1, bias=False).cuda().half().to(memory_format=cl)
    fconv = ft.Conv2d(256, 256, 3, padding=1, bias=False).cuda().half().to(memory_format=cl)
    tbn, fbn = torch.nn.BatchNorm2d(256).cuda(), ft.BatchNorm2d(256, activation="relu").cuda()
    xg = x.detach().requires_grad_(True)

    def block(conv, bn, relu):
        def f():
            with torch.autocast("cuda", dtype=torch.float16):
                out = bn(conv(xg))
                out = relu(out) if relu else out
            out.backward(dy)
        return f

    rows.append(("conv+bn+relu module fwd+bwd", "torch.nn (autocast)", host_us(block(tconv, tbn, F.relu), 200)))
    rows.append(("conv+bn+relu module fwd+bwd", "fusekit.torch (autocast)", host_us(block(fconv, fbn, None), 200)))
    print(f"{'op':<30} {'path':<40} host us/call")
    for op, path, us in rows:
        print(f"{op:<30} {path:<40} {us:8.1f}")


if __name__ == "__main__":
    main()
