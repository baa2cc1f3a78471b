"""Nearest-neighbour upsampling of images as a CuPy kernel (``pool.cu``), on the pooling kernels'
operand layer and launcher: HRNet's and FPN-style fuse layers in a pipeline without PyTorch."""

from __future__ import annotations

from typing import Any

from ..dispatch import recorded_whole
from ..engine.pooling import checked_pair
from . import pool
from .pool import FLOAT_DTYPES, i32, i64, operand, result_of

__all__ = ["upsample_nearest2d"]


@recorded_whole
def upsample_nearest2d(x: Any, scale: int | tuple[int, int], *, out: Any = None) -> Any:
    """Nearest-neighbour upsampling of an (N, C, H, W) image by integer factors ``scale`` (an int or
    (sh, sw)): output (h, w) is input (h // sh, w // sw), as ``F.interpolate(x, scale_factor=scale,
    mode="nearest")``. One pass; y has x's dtype and layout, or is ``out`` (dense, (N, C, H*sh, W*sw))."""
    P = "upsample_nearest2d"
    xo = operand(P, "x", x, (4,), FLOAT_DTYPES)
    sh, sw = checked_pair(P, "scale", scale, 1, what="attribute")
    n, c, h, w = xo.shape
    shape = (n, c, h * sh, w * sw)
    total = n * c * h * sh * w * sw
    with pool.Launch(P, xo) as L:  # (looked up at each call: tests run the kernels on the host through it)
        y, yv, ystr, ylayout = result_of(P, L, xo, out, shape)
        L.run(xo.dtype, "upsample_nearest", total, [
            L.view(xo), yv, *i64(total), *i32(c, h * sh, w * sw, sh, sw), *i64(*xo.strides), *i64(*ystr), *i32(ylayout == "NHWC")])
    return y
