"""Per-channel pointwise work as CuPy kernels (``kernels/pool.cu`` ``channel_pointwise``,
``channel_gate_mul`` and their 16-byte channels-last forms), on fusekit.ops.pool's operand checks and
launcher: an inference batch norm or a lone activation (``pointwise``), a residual add and its
activation, and squeeze-excitation's channel gate (``gate``), each one pass over memory. cuDNN's
pointwise graphs refuse some of these shapes and measure slower than PyTorch's kernels on others;
the pipeline times these kernels beside both, per stage."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dispatch import recorded_whole
from ..errors import OperandError
from . import pool
from .depthwise import check_activation
from .pool import FLOAT_DTYPES, Operand, channel_vector, i32, i64, lanes16, operand, result_of, same_place

__all__ = ["gate", "pointwise"]


def _like_x(P: str, name: str, a: Any, x: Operand) -> Operand:
    o = operand(P, name, a, (4,), FLOAT_DTYPES)
    same_place(P, ("x", x), (name, o))
    if o.shape != x.shape or o.lib != x.lib:
        raise OperandError(P, name, f"expected a {x.lib} image of x's shape {x.shape}, got a {o.lib} array of shape {o.shape}")
    return o


@recorded_whole
def pointwise(x: Any, gamma: Any = None, beta: Any = None, z: Any = None, *, activation: str = "identity", alpha: float = 0.0,
              out: Any = None) -> Any:
    """``act(x * gamma + beta + z)`` of an (N, C, H, W) image in one pass, computed in float32:
    ``gamma``, ``beta`` float32 vectors of C (both or neither: without them ``act(x + z)``), ``z`` an
    image of x's shape and dtype or None, ``activation`` one of fusekit.patterns.ACTIVATIONS with
    ``alpha`` its parameter. y has x's dtype and layout, or is ``out`` (dense NCHW or NHWC)."""
    P = "channelwise.pointwise"
    xo = operand(P, "x", x, (4,), FLOAT_DTYPES)
    if (gamma is None) != (beta is None):
        raise OperandError(P, "gamma" if gamma is None else "beta", "pass gamma and beta together, or neither")
    g, b = (None, None) if gamma is None else (channel_vector(P, "gamma", gamma, xo), channel_vector(P, "beta", beta, xo))
    zo = None if z is None else _like_x(P, "z", z, xo)
    code = check_activation(P, activation, alpha)
    n, c, h, w = xo.shape
    total = n * c * h * w
    with pool.Launch(P, xo) as L:  # (looked up at each call: tests run the kernels on the host through it)
        y, yv, ystr, ylayout = result_of(P, L, xo, out, xo.shape)
        xv = L.view(xo)
        zv = L.view(zo) if zo is not None else xv  # (unread without z)
        gv, bv = (L.view(g), L.view(b)) if g is not None else (L.zeros_f32(1), L.zeros_f32(1))
        flags = (g is not None, zo is not None, code)
        vec = lanes16(L, xo.dtype, c, total, (xo.layout, ylayout) + ((zo.layout,) if zo is not None else ()), (xv, yv, zv))
        if vec:
            L.run(xo.dtype, "channel_pointwise_nhwc_vec", total // vec, [xv, gv, bv, zv, yv, *i32(total // vec, c, *flags), np.float32(alpha)])
            return y
        zs = zo.strides if zo is not None else xo.strides
        L.run(xo.dtype, "channel_pointwise", total, [
            xv, gv, bv, zv, yv, *i64(total), *i32(c, h, w, ylayout == "NHWC"), *i64(*xo.strides), *i64(*zs), *i64(*ystr),
            *i32(*flags), np.float32(alpha)])
    return y


@recorded_whole
def gate(x: Any, s: Any, *, out: Any = None) -> Any:
    """``x * s`` for an (N, C, H, W) image and a gate ``s`` of shape (N, C, 1, 1) in x's dtype (a
    squeeze-excitation block's channel multiply), in float32. y has x's dtype and layout, or is
    ``out`` (dense NCHW or NHWC)."""
    P = "channelwise.gate"
    xo = operand(P, "x", x, (4,), FLOAT_DTYPES)
    so = operand(P, "s", s, (4,), FLOAT_DTYPES)
    same_place(P, ("x", xo), ("s", so))
    n, c, h, w = xo.shape
    if so.shape != (n, c, 1, 1) or so.lib != xo.lib:
        raise OperandError(P, "s", f"expected a {xo.lib} gate of shape {(n, c, 1, 1)}, got a {so.lib} array of shape {so.shape}")
    total = n * c * h * w
    with pool.Launch(P, xo) as L:
        y, yv, ystr, ylayout = result_of(P, L, xo, out, xo.shape)
        xv, sv = L.view(xo), L.view(so)
        vec = lanes16(L, xo.dtype, c, total, (xo.layout, ylayout), (xv, yv))
        if vec:
            L.run(xo.dtype, "channel_gate_nhwc_vec", total // vec, [xv, sv, yv, *i32(total // vec, c, h * w), *i64(so.strides[0], so.strides[1])])
            return y
        L.run(xo.dtype, "channel_gate_mul", total, [
            xv, sv, yv, *i64(total), *i32(c, h, w, ylayout == "NHWC"), *i64(*xo.strides), *i64(so.strides[0], so.strides[1]), *i64(*ystr)])
    return y
