"""Operands: TensorSpec (what makes a plan valid for an array), layouts and operand kinds (the
adapters that read CuPy, PyTorch and ``__dlpack__`` arrays are in :mod:`fusekit.adapters`).

Arrays are always seen in cuDNN's logical dim order (N, C, H, W); memory layout comes from the
strides. A CuPy NHWC buffer of shape (N, H, W, C) is passed as ``fusekit.nhwc(a)``, a zero-copy
(N, C, H, W) view, exactly as a channels-last torch tensor already is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import OperandError

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
#: Bytes per element of each supported dtype.
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def alignment(ptr: int) -> int:
    """Largest power of two up to 32 that divides ``ptr`` (as PyTorch's cuDNN plan keys do)."""
    low = ptr & 31
    return 32 if low == 0 else low & -low


def nchw_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    n, c, h, w = shape
    return (c * h * w, h * w, w, 1)


def nhwc_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def pitched_nhwc_strides(shape: tuple[int, ...], pitch: int) -> tuple[int, ...]:
    """Channels-last strides with ``pitch`` elements between pixels: a channel slice of a wider
    channels-last buffer (what a concatenation's parts are)."""
    n, c, h, w = shape
    return (h * w * pitch, 1, w * pitch, pitch)


def nhwc_pitch(shape: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The pixel pitch of a channels-last channel slice with more than one channel (pitch > C), else None."""
    n, c, h, w = shape
    if c < 2 or strides[1] != 1 or h * w * n == 1:
        return None
    pitch = strides[3] if w > 1 else strides[2] if h > 1 else strides[0]
    pitch = pitch if w > 1 or h > 1 else pitch // (h * w)
    if pitch <= c or not matches(strides, pitched_nhwc_strides(shape, pitch), shape):
        return None
    return pitch


def row_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def col_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """[1, A, B] seen over a row-major (B, A) matrix: its transpose, without a copy."""
    _, a, b = shape
    return (a * b, 1, a)


LAYOUT_STRIDES = {"NCHW": nchw_strides, "NHWC": nhwc_strides, "ROW": row_strides, "COL": col_strides}


def matches(strides: tuple[int, ...], canon: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    return all(s == c for s, c, d in zip(strides, canon, shape) if d != 1)


@dataclass(frozen=True)
class TensorSpec:
    """Everything about an operand that a cuDNN plan depends on (the pointer's alignment is kept
    beside it in the key). ``shape``/``strides`` are as cuDNN sees the tensor; ``view`` is the
    shape users see (a bias (C,) is (1, C, 1, 1) to cuDNN, a matrix (M, N) is (1, M, N))."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements, canonical for the layout (or a channels-last channel slice's)
    dtype: str  # "float16" | "bfloat16" | "float32"
    device: int  # CUDA ordinal
    layout: str  # "NCHW" | "NHWC" (4-D; filters KCRS | KRSC) | "ROW" (row-major) | "COL" (transposed view)
    view: tuple[int, ...] = field(default=(), compare=False)  # not part of a plan's validity

    @staticmethod
    def build(shape: tuple[int, ...], dtype: str, device: int, layout: str, view: tuple[int, ...] | None = None) -> "TensorSpec":
        shape = tuple(shape)
        return TensorSpec(shape, LAYOUT_STRIDES[layout](shape), dtype, device, layout, tuple(view) if view else shape)


#: Operand kinds: how a user's array maps to the tensor cuDNN sees.


def logical_shape(pattern: str, name: str, kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The operand's shape as cuDNN sees it; rank checked. Channel vectors become (1, C, 1, 1),
    matrices (M, N) become (1, M, N) (``matrix_t``: (1, N, M)), row vectors (N,) become (1, 1, N)."""
    shape = tuple(int(s) for s in shape)
    if kind == "tensor":  # any array of an elementwise op: 4-D as an image, else as a matrix or vector
        if len(shape) not in (1, 2, 4):
            raise OperandError(pattern, name, f"expected a 1-D, 2-D or 4-D array, got shape {shape}")
        kind = {1: "row", 2: "matrix", 4: "image"}[len(shape)]
    if kind == "channel":
        if len(shape) == 1:
            return (1, shape[0], 1, 1)
        if len(shape) == 4 and shape[0] == shape[2] == shape[3] == 1:
            return shape
        raise OperandError(pattern, name, f"expected shape (C,) or (1, C, 1, 1), got {shape}")
    if kind == "row":
        if len(shape) == 1:
            return (1, 1, shape[0])
        raise OperandError(pattern, name, f"expected a vector of shape (N,), got {shape}")
    if kind == "batch_matrix":
        if len(shape) != 3 or min(shape) < 1:
            raise OperandError(pattern, name, f"expected a 3-D batch of matrices (batch, rows, columns) with every dim >= 1, got shape {shape}")
        return shape
    if kind in ("matrix", "matrix_t"):
        if len(shape) != 2:
            raise OperandError(pattern, name, f"expected a 2-D matrix (rows, columns), got rank {len(shape)} shape {shape}")
        if min(shape) < 1:
            raise OperandError(pattern, name, f"expected every dim >= 1, got shape {shape}")
        return (1, shape[0], shape[1]) if kind == "matrix" else (1, shape[1], shape[0])
    if len(shape) != 4:
        dims = "(K, C, R, S)" if kind == "filter" else "(N, C, H, W)"
        raise OperandError(pattern, name, f"expected a 4-D {kind} with logical dims {dims}, got rank {len(shape)} shape {shape}")
    if min(shape) < 1:
        raise OperandError(pattern, name, f"expected every dim >= 1, got shape {shape}")
    return shape


def view_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The user-facing shape of a cuDNN-shaped tensor of ``kind`` (inverse of logical_shape)."""
    if kind == "channel":
        return (shape[1],)
    if kind == "row":
        return (shape[2],)
    if kind == "matrix":
        return (shape[1], shape[2])
    if kind == "matrix_t":
        return (shape[2], shape[1])
    if kind == "tensor" and len(shape) == 3:
        return (shape[2],) if shape[1] == 1 else (shape[1], shape[2])
    return tuple(shape)


def make_spec(pattern: str, name: str, kind: str, shape, strides, dtype: str, device: int | None) -> TensorSpec:
    """Check one operand against its kind and return its canonical spec, or raise OperandError."""
    strides = tuple(int(s) for s in strides)
    if device is None:
        raise OperandError(pattern, name, "expected a CUDA device array, got an array in host (CPU) memory")
    if dtype not in SUPPORTED_DTYPES:
        raise OperandError(pattern, name, f"unsupported dtype {dtype}; expected one of {', '.join(SUPPORTED_DTYPES)}")
    given = tuple(int(s) for s in shape)
    shape = logical_shape(pattern, name, kind, given)
    if kind == "tensor":
        kind = {1: "row", 2: "matrix", 4: "image"}[len(given)]
    if kind in ("channel", "row"):
        if max(given) > 1 and strides[given.index(max(given))] != 1:
            raise OperandError(pattern, name, f"expected a contiguous vector, got strides {strides}")
        return TensorSpec.build(shape, dtype, device, "NCHW" if kind == "channel" else "ROW", view=given if len(given) == 1 else None)
    if kind in ("matrix", "matrix_t", "batch_matrix"):
        if not matches(strides, row_strides(given), given):
            raise OperandError(pattern, name, f"expected a dense row-major matrix, got strides {strides}; pass a contiguous copy")
        if kind == "batch_matrix":
            return TensorSpec.build(shape, dtype, device, "ROW")
        return TensorSpec.build(shape, dtype, device, "ROW" if kind == "matrix" else "COL", view=given)
    nchw, nhwc = nchw_strides(shape), nhwc_strides(shape)
    # With H = W = 1 both layouts describe the same memory: call it channels-last, which cuDNN's
    # pointwise and reduction engines require (a Linear layer's (N, C) viewed as (N, C, 1, 1)).
    if matches(strides, nhwc, shape) and shape[2] * shape[3] == 1:
        layout = "NHWC"
    elif matches(strides, nchw, shape):
        layout = "NCHW"
    elif matches(strides, nhwc, shape):
        layout = "NHWC"
    elif kind == "image" and (pitch := nhwc_pitch(shape, strides)) is not None:
        # a channel slice of a wider channels-last buffer: cuDNN reads and writes it in place (its
        # strides are part of the plan's key)
        return TensorSpec(shape, pitched_nhwc_strides(shape, pitch), dtype, device, "NHWC", shape)
    else:
        raise OperandError(
            pattern,
            name,
            f"strides {strides} are neither dense NCHW {nchw} nor dense NHWC (channels-last) {nhwc}; "
            "pass a contiguous or channels-last copy",
        )
    return TensorSpec.build(shape, dtype, device, layout)


def nhwc(a: Any) -> Any:
    """View a channels-last buffer of shape (N, H, W, C) as fusekit's logical (N, C, H, W)."""
    shape = getattr(a, "shape", None)
    if shape is None or len(shape) != 4:
        got = f"shape {tuple(int(d) for d in shape)}" if shape is not None else f"{type(a).__module__}.{type(a).__name__}"
        raise OperandError("nhwc", "a", f"expected a 4-D (N, H, W, C) array, got {got}")
    if hasattr(a, "permute"):
        return a.permute(0, 3, 1, 2)
    return a.transpose(0, 3, 1, 2)

