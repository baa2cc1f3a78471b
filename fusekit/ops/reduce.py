"""Global average pooling as two CuPy kernels (``kernels/pool.cu`` ``channel_sums``, ``scaled_store``)
on fusekit.ops.pool's operand checks and launcher: float32 partial sums over slices of each plane
added atomically, then one scaled store, so that small planes with many channels and large planes
with few both fill the GPU."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dispatch import recorded_whole
from . import pool
from .pool import FLOAT_DTYPES, i32, i64, operand, result_of

__all__ = ["global_avg_pool"]

#: Threads in flight the first pass aims for (a few per SM slot of a large GPU).
TARGET_THREADS = 1 << 18


@recorded_whole
def global_avg_pool(x: Any, *, out: Any = None) -> Any:
    """The mean over H and W of an (N, C, H, W) image, as ``x.mean((2, 3), keepdim=True)``, summed in
    float32: (N, C, 1, 1) in x's dtype, or ``out`` (dense, that shape and x's dtype). The order of the
    float32 additions depends on the run (atomic adds), so the last bits may differ between runs."""
    P = "global_avg_pool"
    xo = operand(P, "x", x, (4,), FLOAT_DTYPES)
    n, c, h, w = xo.shape
    hw = h * w
    splits = max(1, min(hw, -(-TARGET_THREADS // (n * c))))
    with pool.Launch(P, xo) as L:  # (looked up at each call: tests run the kernels on the host through it)
        y, yv, ystr, _ = result_of(P, L, xo, out, (n, c, 1, 1))
        sums = L.zeros_f32(n * c)
        L.run(xo.dtype, "channel_sums", n * c * splits, [
            L.view(xo), sums, *i64(n * c * splits), *i32(n, c, hw, w, splits), *i64(*xo.strides)])
        L.run(xo.dtype, "scaled_store", n * c, [sums, yv, *i64(n * c), *i32(c), *i64(ystr[0], ystr[1]), np.float32(1.0 / hw)])
    return y
