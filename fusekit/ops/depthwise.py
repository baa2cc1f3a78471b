"""Depthwise convolution (+ bias + activation) as a CuPy kernel (``kernels/pool.cu`` ``depthwise_conv``),
on fusekit.ops.pool's operand checks and launcher: cuDNN's depthwise graphs and PyTorch's kernel
measure slower than one pass over memory on some shapes, which the pipeline times per stage."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..adapters import adapter_for, as_device_array
from ..dispatch import recorded_whole
from ..errors import OperandError
from . import pool
from ..tensors import nchw_strides, nhwc_strides
from ..engine.patterns import conv_out_size
from ..engine.pooling import checked_pair
from .pool import FLOAT_DTYPES, Operand, channel_vector, i32, i64, lanes16, operand, same_place

__all__ = ["ACT_CODES", "check_activation", "depthwise_conv2d", "depthwise_taps"]

TILE_Q, TILE_MAX_S = 4, 9  # pool.cu's DW_TQ and DW_MAXS: outputs per thread and widest filter of the tiled kernel


#: The activations of the depthwise kernel, in the order of its codes (pool.cu ``activate``).
ACT_CODES = ("identity", "relu", "clip", "silu", "gelu", "gelu_tanh", "sigmoid", "tanh", "hardswish", "hardsigmoid", "leaky_relu", "elu")


def check_activation(P: str, activation: str, alpha: float) -> int:
    """The kernels' code of ``activation`` (one of :data:`ACT_CODES`), ``alpha`` its finite parameter
    (> 0 for clip); a fusekit error naming the argument otherwise."""
    if activation not in ACT_CODES:
        raise OperandError(P, "activation", f"expected one of {ACT_CODES}, got {activation!r}", what="argument")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not np.isfinite(alpha) or (activation == "clip" and not alpha > 0):
        raise OperandError(P, "alpha", f"expected a finite number (> 0 for clip), got {alpha!r}", what="argument")
    return ACT_CODES.index(activation)


def _described(P: str, name: str, a: Any) -> tuple[Any, Any, tuple[int, ...], tuple[int, ...], str, int | None]:
    """(device array, its adapter, shape, element strides, dtype name, device) of ``a`` as given."""
    arr = as_device_array(a, P, name)
    ad = adapter_for(arr, P, name)
    shape, strides, dtype, device = ad.describe(arr)
    return arr, ad, tuple(int(e) for e in shape), tuple(int(e) for e in strides), dtype, device


def _taps_operand(P: str, w: Any, x: Operand) -> Operand:
    """The filter: float32 (C, 1, R, S) at any strides (the kernel indexes through them)."""
    a, ad, shape, strides, dtype, device = _described(P, "w", w)
    if device is None:
        raise OperandError(P, "w", "expected a CUDA device array, got an array in host (CPU) memory")
    if len(shape) != 4 or shape[:2] != (x.shape[1], 1) or min(shape) < 1 or dtype != "float32" or ad.name != x.lib:
        raise OperandError(P, "w", f"expected a float32 {x.lib} filter of shape ({x.shape[1]}, 1, R, S) (one per channel of x), "
                           f"got a {dtype} {ad.name} array of shape {shape}")
    op = Operand(a, ad.name, shape, strides, "ANY", dtype, int(device))
    same_place(P, ("x", x), ("w", op), dtype=False)
    return op


def _image(P: str, name: str, a: Any, x: Operand | None = None) -> Operand:
    """An image (N, C, H, W) dense in NCHW or NHWC, or at other non-overlapping strides (a channel
    slice of a larger image: what a concatenation's part or a ``chunk`` is); those run the strided kernel."""
    try:
        op = operand(P, name, a, (4,), FLOAT_DTYPES)
    except OperandError:
        arr, ad, shape, strides, dtype, device = _described(P, name, a)
        if device is None or len(shape) != 4 or min(shape) < 1 or dtype not in FLOAT_DTYPES or not _non_overlapping(shape, strides):
            raise  # the dense operand's own message says what was expected
        op = Operand(arr, ad.name, shape, strides, "ANY", dtype, int(device))
    if x is not None:
        same_place(P, ("x", x), (name, op))
    return op


def _non_overlapping(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether distinct indices of ``shape`` at element ``strides`` reach distinct elements."""
    span = 1
    for st, d in sorted((st, d) for d, st in zip(shape, strides) if d > 1):
        if st < span:
            return False
        span = st * d
    return True


def depthwise_taps(w: Any) -> Any:
    """A depthwise filter (C, 1, R, S) as the kernel reads it fastest: a float32 (C, 1, R, S) view of a
    dense (R, S, C) copy (a warp's 32 channels read 32 adjacent taps). Same array type as ``w``."""
    if hasattr(w, "permute"):  # torch
        return w.float().permute(2, 3, 0, 1).contiguous().permute(2, 3, 0, 1)
    return w.astype("float32").transpose(2, 3, 0, 1).copy().transpose(2, 3, 0, 1)


@recorded_whole
def depthwise_conv2d(x: Any, w: Any, b: Any = None, *, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
                     activation: str = "identity", alpha: float = 0.0, extra_padding: Any = 0, out: Any = None) -> Any:
    """``act(conv2d(x, w, b, groups=C))`` of an (N, C, H, W) image with one R x S filter per channel,
    as PyTorch's depthwise Conv2d then the activation (``activation``: one of fusekit.patterns.ACTIVATIONS,
    ``alpha`` its parameter), accumulated in float32 in one pass. ``w``: float32 (C, 1, R, S) at any
    strides (:func:`depthwise_taps` gives the fastest); ``b``: float32 (C,) or None. y has x's dtype and
    layout (channels-last for a strided x), or is ``out``. x and ``out`` may be strided views such as
    channel slices of larger images (a concatenation's parts, ``chunk``): the strided kernel runs them.
    ``extra_padding``: zero rows / columns after x (bottom, right) beyond ``padding``, as conv_bias_act's."""
    P = "depthwise_conv2d"
    xo = _image(P, "x", x)
    wo = _taps_operand(P, w, xo)
    bo = None if b is None else channel_vector(P, "b", b, xo)
    (sh, sw), (ph, pw), (dh, dw), (eh, ew) = (checked_pair(P, name, v, low, "argument") for name, v, low in
                                              (("stride", stride, 1), ("padding", padding, 0), ("dilation", dilation, 1),
                                               ("extra_padding", extra_padding, 0)))
    code = check_activation(P, activation, alpha)
    n, c, h, wd = xo.shape
    r, s = wo.shape[2:]
    ho, wout = conv_out_size(h, r, ph, sh, dh, eh), conv_out_size(wd, s, pw, sw, dw, ew)  # (the kernels read zeros past x)
    if ho < 1 or wout < 1:
        raise OperandError(P, "w", f"a {r}x{s} filter (dilation {dh}, {dw}) does not fit x's {h}x{wd} with padding {ph}, {pw}")
    shape = (n, c, ho, wout)
    oo = None if out is None else _image(P, "out", out, xo)
    if oo is not None and (oo.shape != shape or oo.lib != xo.lib):
        raise OperandError(P, "out", f"expected a {xo.lib} array of shape {shape}, got a {oo.lib} array of shape {oo.shape}")
    with pool.Launch(P, xo) as L:  # (looked up at each call: tests run the kernels on the host through it)
        if oo is None:  # y dense in x's layout (channels-last for a strided x)
            ylayout = "NHWC" if xo.layout == "ANY" else xo.layout
            y, yv = L.empty(xo, shape, ylayout)
            ystr = nhwc_strides(shape) if ylayout == "NHWC" else nchw_strides(shape)
        else:
            y, yv, ystr, ylayout = out, L.view(oo), oo.strides, oo.layout
        bias = L.view(bo) if bo is not None else L.zeros_f32(1)
        total = n * c * ho * wout
        xv, wv = L.view(xo), L.view(wo)
        dense_taps = wo.strides[0] == 1 and wo.strides[2:] == (s * c, c)  # an (R, S, C) buffer
        vec = lanes16(L, xo.dtype, c, total, (xo.layout, ylayout), (xv, wv, yv)) if dense_taps else 0
        if vec:  # 16-byte lanes of channels
            if sw == dw == 1 and s <= TILE_MAX_S:  # and TILE_Q adjacent outputs per thread from one window of loads
                threads = n * ho * -(-wout // TILE_Q) * (c // vec)
                L.run(xo.dtype, "depthwise_conv_nhwc_tile", threads, [
                    xv, wv, bias, yv, *i32(threads, c, h, wd, ho, wout, r, s, sh, ph, pw, dh, bo is not None, code), np.float32(alpha)])
                return y
            L.run(xo.dtype, "depthwise_conv_nhwc_vec", total // vec, [
                xv, wv, bias, yv, *i32(total // vec, c, h, wd, ho, wout, r, s, sh, sw, ph, pw, dh, dw, bo is not None, code), np.float32(alpha)])
            return y
        L.run(xo.dtype, "depthwise_conv", total, [
            L.view(xo), L.view(wo), bias, yv, *i64(n * c * ho * wout), *i32(c, h, wd, ho, wout, r, s, sh, sw, ph, pw, dh, dw),
            *i64(*xo.strides), *i64(wo.strides[0], wo.strides[2], wo.strides[3]), *i64(*ystr),
            *i32(ylayout == "NHWC" or (ylayout == "ANY" and ystr[1] == 1), bo is not None, code), np.float32(alpha)])
    return y
