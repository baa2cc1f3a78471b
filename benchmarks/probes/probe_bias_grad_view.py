"""The fused ReLU-backward + bias-gradient graph on few channels (the autoencoder's 3-channel output:
18.5 us in the captured step against eager's 9.2 us of threshold_backward + sum). Prediction: cuDNN's
channel reduction tiles 8-32 channels per row of threads, so with C = 3 most lanes idle; the same
dense NHWC memory read as (P / k, k * C) with k pixels per row, reduced to k * C partial sums and
folded to C, runs near memory speed. Each variant timed alone in a CUDA graph (autotuned plans),
checked against float64.

    python benchmarks/probes/probe_bias_grad_view.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from timing import graph_time_us

import fusekit
from fusekit.ops.common import relu_bias_grad


def rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """Channels-last (N, C, H, W) memory as (N*H*W / k, k*C, 1, 1): k pixels' channels per row."""
    n, c, h, w = t.shape
    return t.permute(0, 2, 3, 1).reshape(n * h * w // k, k * c, 1, 1)


def main() -> None:
    fusekit.configure(mode="autotune", disk=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape, dtype in (((64, 3, 64, 64), torch.float32), ((64, 16, 32, 32), torch.float32),
                         ((64, 3, 64, 64), torch.float16), ((256, 3, 64, 64), torch.float16)):
        dy = torch.randn(shape, generator=g, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)
        y = torch.randn(shape, generator=g, device="cuda").relu().to(dtype).contiguous(memory_format=torch.channels_last)
        ref = (dy.double() * (y.double() > 0)).sum((0, 2, 3))
        c = shape[1]
        te = graph_time_us(lambda i: torch.ops.aten.threshold_backward(dy, y, 0).sum((0, 2, 3), dtype=torch.float32))
        print(f"{tuple(shape)} {str(dtype)[6:]}: eager threshold_backward + sum {te:.1f} us")
        for k in (1, 2, 4, 8, 16, 32, 64, 128):
            d2, y2 = rows(dy, k), rows(y, k)
            try:
                def run(i: int) -> torch.Tensor:
                    dz, db = relu_bias_grad(d2, y2, True)
                    return db.view(k, c).sum(0)
                db = run(0)
                err = float((db.double() - ref).norm() / ref.norm())
                t = graph_time_us(run)
            except Exception as e:  # noqa: BLE001 - a probe: report and go on
                print(f"   k={k:4d}: {type(e).__name__}: {str(e)[:160]}")
                continue
            print(f"   k={k:4d}: view {tuple(d2.shape)} {t:6.1f} us, db err {err:.1e}")


if __name__ == "__main__":
    main()
