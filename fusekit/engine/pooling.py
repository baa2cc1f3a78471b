"""Pooling geometry (pure Python): attributes checked against an (N, C, H, W) shape and the output
size by PyTorch's formula. Shared by fusekit's pooling kernels (``fusekit.ops.pool``) and their
float64 references (``fusekit.engine.oracle``)."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from ..errors import OperandError

class PoolGeometry(NamedTuple):
    """Normalized pooling attributes and the output's spatial size."""

    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    ho: int
    wo: int
    dh: int = 1  # dilation (max pooling): window taps dh rows / dw columns apart
    dw: int = 1


def checked_pair(pattern: str, name: str, v: Any, minimum: int, what: str = "operand") -> tuple[int, int]:
    """(h, w) of a window / stride / padding / dilation given as an int or a pair of ints, each >= ``minimum``."""
    vals = (v, v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else v
    try:
        a, b = vals
    except (TypeError, ValueError):
        raise OperandError(pattern, name, f"expected an int or a pair of ints, got {v!r}", what) from None
    for e in (a, b):
        if isinstance(e, bool) or not isinstance(e, (int, np.integer)):
            raise OperandError(pattern, name, f"expected an int or a pair of ints, got {v!r}", what)
        if e < minimum:
            raise OperandError(pattern, name, f"expected values >= {minimum}, got {v!r}", what)
    return int(a), int(b)


def pool2d_geometry(
    input_shape: Sequence[int], kernel_size: Any, stride: Any = None, padding: Any = 0, pattern: str = "pool2d",
    ceil_mode: bool = False, dilation: Any = 1,
) -> PoolGeometry:
    """Check pooling attributes against an (N, C, H, W) shape; output size by PyTorch's formula (floor,
    or with ``ceil_mode`` one more window where the last would start inside the input or its left
    padding; every window then still covers real input, and the kernels clip windows to it).
    ``dilation`` (max pooling) spreads a window's taps, its extent (k - 1) * d + 1.

    Raises OperandError for a non-4-D shape, kernel, stride or dilation < 1, padding < 0 or more than
    half the kernel (PyTorch's limit), or a (dilated) kernel larger than the padded input.
    """
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 4:
        raise OperandError(pattern, "x", f"expected a 4-D image (N, C, H, W), got rank {len(shape)} shape {shape}")
    if min(shape) < 1:
        raise OperandError(pattern, "x", f"expected every dim >= 1, got shape {shape}")
    kh, kw = checked_pair(pattern, "kernel_size", kernel_size, 1)
    sh, sw = checked_pair(pattern, "stride", kernel_size if stride is None else stride, 1)
    ph, pw = checked_pair(pattern, "padding", padding, 0)
    dh, dw = checked_pair(pattern, "dilation", dilation, 1)
    _, _, h, w = shape
    for axis, k, p, d, size in (("height", kh, ph, dh, h), ("width", kw, pw, dw, w)):
        if 2 * p > k:
            raise OperandError(pattern, "padding", f"{axis} padding {p} is more than half the kernel {k}")
        extent = (k - 1) * d + 1
        if extent > size + 2 * p:
            what = f"kernel {k}" + (f" dilated by {d} (extent {extent})" if d > 1 else "")
            raise OperandError(pattern, "kernel_size", f"{what} larger than padded input {axis} {size} + 2*{p} = {size + 2 * p}")
    ho, wo = _out_size(h, (kh - 1) * dh + 1, sh, ph, ceil_mode), _out_size(w, (kw - 1) * dw + 1, sw, pw, ceil_mode)
    return PoolGeometry(kh, kw, sh, sw, ph, pw, ho, wo, dh, dw)


def _out_size(size: int, extent: int, s: int, p: int, ceil_mode: bool) -> int:
    if not ceil_mode:
        return (size + 2 * p - extent) // s + 1
    out = -(-(size + 2 * p - extent) // s) + 1
    return out - 1 if (out - 1) * s >= size + p else out


def checked_axis(pattern: str, axis: Any, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise OperandError(pattern, "axis", f"expected an int in [{-ndim}, {ndim}), got {axis!r}")
    return int(axis) % ndim


