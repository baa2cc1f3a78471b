"""Pooling, softmax, a layer norm over channels and the channel shuffle as CuPy kernels (depthwise
convolution: ``depthwise.py``, on this module's operand layer and launcher).

The cuDNN frontend's graph API has no pooling or softmax node, so these run as ``cupy.RawModule``
kernels (the layer norm is an alternative to cuDNN's layer-norm graph where that measures slower). Images are in logical (N, C, H, W) dim order with NCHW or NHWC (channels-last) memory; the
kernels index through each array's strides, so neither layout is copied, and results keep the
layout of the input they are computed from. Inputs are CuPy arrays or torch CUDA tensors (imported
zero-copy through DLPack and run on torch's current stream); results are of the first operand's
type. float16, bfloat16 and float32 are computed in float32 and stored in the input's dtype.
Every user error is an OperandError raised before anything is launched.
"""

from __future__ import annotations

import string
import threading
import warnings
from contextlib import ExitStack
from importlib import resources
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from .. import session
from ..dispatch import recorded_whole
from ..engine.pooling import PoolGeometry, checked_axis, pool2d_geometry
from ..errors import NoGPUError, OperandError
from ..tensors import ITEMSIZE, matches, nchw_strides, nhwc_strides, row_strides
from ..adapters import adapter_for, as_device_array

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
INDEX_DTYPES = ("int32", "int64")
_BLOCK = 256
_MAX_BLOCKS = 1 << 20  # kernels loop grid-stride past this

__all__ = [
    "PoolGeometry", "pool2d_geometry",
    "max_pool2d", "max_pool2d_backward", "avg_pool2d", "avg_pool2d_backward",
    "softmax", "log_softmax", "softmax_backward", "log_softmax_backward", "channel_layer_norm", "channel_shuffle",
    "radix_softmax",
]


# ----------------------------------------------------------------------------------------------
# CUDA source (fusekit/ops/kernels/): one module per storage dtype. Values are loaded to float32 and
# stored rounded to nearest even; float16 converts with PTX cvt, bfloat16 with bit operations.
# ----------------------------------------------------------------------------------------------
def kernel_file(name: str) -> str:
    """The text of CUDA source file ``name`` shipped in ``fusekit/ops/kernels/``."""
    return resources.files("fusekit.ops").joinpath("kernels", name).read_text(encoding="utf-8")


def dtype_prelude(dtype: str, suffix: str = "") -> str:
    """CUDA source of storage type ``T<suffix>`` for ``dtype`` with ``ld<suffix>`` (to float32) and
    ``st<suffix>`` (from float32, rounded to nearest even): kernels over several dtypes use several suffixes."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"no CUDA storage type for dtype {dtype!r}")
    return string.Template(kernel_file(f"dtype_{dtype}.cuh")).substitute(s=suffix)

WARP_KERNELS = frozenset({"softmax_rows_warp", "layer_norm_channels"})
_MODULES_LOCK = threading.Lock()


def kernel_source(dtype: str) -> str:
    """The CUDA source of the module for storage dtype ``dtype`` (float16 | bfloat16 | float32)."""
    return dtype_prelude(dtype) + kernel_file("pool.cu")


def cuda_function(key: Any, source: Callable[[], str], name: str) -> Any:
    """Kernel ``name`` of the CUDA module compiled once per session from ``source()`` and kept under ``key``."""
    modules = session.current().table("cuda_modules")  # key -> cupy.RawModule (pool's: its storage dtype)
    mod = modules.get(key)
    if mod is None:
        import cupy

        with _MODULES_LOCK:
            mod = modules.get(key)
            if mod is None:
                mod = modules[key] = cupy.RawModule(code=source())
    return mod.get_function(name)


def pool_kernel(dtype: str, name: str) -> Any:
    return cuda_function(dtype, lambda: kernel_source(dtype), name)


# ----------------------------------------------------------------------------------------------
# Operands
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Operand:
    """A checked array: its library, logical shape, canonical element strides and layout."""

    array: Any
    lib: str  # "cupy" | "torch"
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    layout: str  # "NCHW" | "NHWC" | "ROW"
    dtype: str
    device: int


def _layout_strides(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    if layout == "NHWC":
        return nhwc_strides(shape)
    return nchw_strides(shape) if layout == "NCHW" else row_strides(shape)


def operand(pattern: str, name: str, a: Any, ranks: tuple[int, ...], dtypes: tuple[str, ...]) -> Operand:
    """Check one array (device, rank, dtype, dense NCHW/NHWC or row-major strides); no GPU work."""
    a = as_device_array(a, pattern, name)
    ad = adapter_for(a, pattern, name)
    shape, strides, dtype, device = ad.describe(a)
    shape, strides = tuple(int(s) for s in shape), tuple(int(s) for s in strides)
    if device is None:
        raise OperandError(pattern, name, "expected a CUDA device array, got an array in host (CPU) memory")
    if len(shape) not in ranks:
        what = "a 4-D image (N, C, H, W)" if ranks == (4,) else "a 2-D (batch, classes) array or a 4-D image (N, C, H, W)"
        raise OperandError(pattern, name, f"expected {what}, got rank {len(shape)} shape {shape}")
    if min(shape) < 1:
        raise OperandError(pattern, name, f"expected every dim >= 1, got shape {shape}")
    if dtype not in dtypes:
        raise OperandError(pattern, name, f"unsupported dtype {dtype}; expected one of {', '.join(dtypes)}")
    if len(shape) == 4:
        if matches(strides, nchw_strides(shape), shape):
            layout = "NCHW"
        elif matches(strides, nhwc_strides(shape), shape):
            layout = "NHWC"
        else:
            raise OperandError(
                pattern, name, f"strides {strides} are neither dense NCHW {nchw_strides(shape)} nor dense NHWC "
                f"(channels-last) {nhwc_strides(shape)}; pass a contiguous or channels-last copy",
            )
    elif matches(strides, row_strides(shape), shape):
        layout = "ROW"
    else:
        raise OperandError(pattern, name, f"expected a dense row-major array, got strides {strides}; pass a contiguous copy")
    return Operand(a, ad.name, shape, _layout_strides(shape, layout), layout, dtype, int(device))


def same_place(pattern: str, first: tuple[str, Operand], other: tuple[str, Operand], dtype: bool = True) -> None:
    (fname, f), (oname, o) = first, other
    if o.device != f.device:
        raise OperandError(pattern, oname, f"is on cuda:{o.device} but '{fname}' is on cuda:{f.device}; put all operands on one device")
    if dtype and o.dtype != f.dtype:
        raise OperandError(pattern, oname, f"expected dtype {f.dtype} like '{fname}', got {o.dtype}")


def _input_shape(pattern: str, input_shape: Any, dy: Operand) -> tuple[int, int, int, int]:
    try:
        shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError):
        raise OperandError(pattern, "input_shape", f"expected 4 ints (N, C, H, W), got {input_shape!r}") from None
    if len(shape) != 4 or min(shape) < 1:
        raise OperandError(pattern, "input_shape", f"expected 4 positive ints (N, C, H, W), got {shape}")
    if shape[:2] != dy.shape[:2]:
        raise OperandError(pattern, "input_shape", f"N, C of {shape} differ from dy's {dy.shape[:2]}")
    return shape  # type: ignore[return-value]


def _check_plane(pattern: str, name: str, h: int, w: int) -> None:
    if h * w >= 2**31:
        raise OperandError(pattern, name, f"plane {h}x{w} has 2**31 or more elements; int32 argmax cannot index it")


def lanes16(L: "Launch", dtype: str, c: int, total: int, layouts: Sequence[str], views: Sequence[Any]) -> int:
    """The elements of ``dtype`` in 16 bytes (VEC) where the 16-byte channels-last kernels take these
    operands: every layout NHWC, C a multiple of VEC, total / VEC an int, every pointer 16-byte
    aligned; else 0."""
    vec = 16 // ITEMSIZE[dtype]
    ok = (all(lay == "NHWC" for lay in layouts) and c % vec == 0 and total // vec < 2**31
          and all(L.address(v) % 16 == 0 for v in views))
    return vec if ok else 0


def i32(*v: int) -> list[np.int32]:
    return [np.int32(x) for x in v]


def i64(*v: int) -> list[np.int64]:
    return [np.int64(x) for x in v]


def _external_stream(cp: Any, ptr: int, dev: int) -> Any:
    """CuPy's handle on a torch stream (its address and device, owning nothing), made once per pair."""
    streams = session.current().table("external_streams")  # (torch stream address, device) -> cupy ExternalStream
    s = streams.get((ptr, dev))
    if s is None:
        with warnings.catch_warnings():  # deprecated in CuPy 14 in favour of Stream.from_external
            warnings.simplefilter("ignore", DeprecationWarning)
            s = streams[(ptr, dev)] = cp.cuda.ExternalStream(ptr, dev)
    return s


class Launch:
    """One call's GPU side: the operands' device, the stream (torch's current one for a torch
    caller, else CuPy's current one), kernel arguments for the operands and outputs of the
    caller's type. A CuPy caller's arrays go to the kernels as CuPy arrays; a torch caller's as
    their device addresses (uint64: what a ``T*`` parameter takes), the tensors kept alive by the
    caller until the launch is queued on their stream (DLPack views cost ~40 us of host each)."""

    def __init__(self, pattern: str, first: Operand) -> None:
        try:
            import cupy
        except ImportError as e:
            raise NoGPUError(f"{pattern} runs CuPy kernels and CuPy is not installed ({e}); install fusekit[cu12] or fusekit[cu13]") from None
        self.cp, self.first, self._stack = cupy, first, ExitStack()
        self.torch = first.lib == "torch"
        self._keep: list[Any] = []  # scratch tensors the queued kernels read

    def __enter__(self) -> "Launch":
        cp, dev = self.cp, self.first.device
        self._stack.enter_context(cp.cuda.Device(dev))
        if self.torch:
            import torch

            self._stack.enter_context(_external_stream(cp, torch.cuda.current_stream(dev).cuda_stream, dev))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)
        self._keep.clear()

    def view(self, op: Operand) -> Any:
        """``op`` as a kernel argument (zero-copy)."""
        return op.array if op.lib == "cupy" else np.uint64(op.array.data_ptr())

    def empty(self, like: Operand, shape: tuple[int, ...], layout: str, dtype: str | None = None, zero: bool = False) -> tuple[Any, Any]:
        """(result of the caller's type, its kernel argument): dense in ``layout``, uninitialised or
        (``zero``) zero-filled."""
        name = dtype or like.dtype
        dev = self.first.device
        if self.torch:
            import torch

            fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
            t = torch.empty(shape, dtype=getattr(torch, name), device=f"cuda:{dev}", memory_format=fmt)
            if zero:  # (torch.zeros takes no memory_format)
                t.zero_()
            return t, np.uint64(t.data_ptr())
        cp = self.cp
        dt = like.array.dtype if dtype is None and like.lib == "cupy" else cp.dtype(name)
        if layout == "NHWC":
            n, c, h, w = shape
            a = cp.empty((n, h, w, c), dtype=dt).transpose(0, 3, 1, 2)
        else:
            a = cp.empty(shape, dtype=dt)
        if zero:
            a.fill(0)
        return a, a

    def empty_as(self, op: Operand, dtype: str) -> tuple[Any, Any]:
        """(result of the caller's type, its kernel argument): uninitialised, ``op``'s shape and very
        strides in ``dtype``. A 1x1 or one-input-channel filter is dense in NCHW and channels-last
        alike; its raw strides, which fused-or-split decisions are keyed on, stay as they came."""
        a = op.array
        if self.torch:
            import torch

            t = torch.empty_strided(tuple(a.shape), tuple(a.stride()), dtype=getattr(torch, dtype), device=f"cuda:{self.first.device}")
            return t, np.uint64(t.data_ptr())
        cp, dt = self.cp, self.cp.dtype(dtype)  # (op is dense: its extent is its size)
        out = cp.ndarray(a.shape, dtype=dt, memptr=cp.empty(a.size, dtype=dt).data, strides=tuple(st // a.itemsize * dt.itemsize for st in a.strides))
        return out, out

    def zeros_f32(self, size: int) -> Any:
        """A zeroed float32 scratch vector from the caller's allocator (PyTorch's for a torch caller:
        capture-safe, stream-ordered), as a kernel argument."""
        if self.torch:
            import torch

            t = torch.zeros(size, dtype=torch.float32, device=f"cuda:{self.first.device}")
            self._keep.append(t)
            return np.uint64(t.data_ptr())
        return self.cp.zeros(size, dtype=self.cp.float32)

    @staticmethod
    def address(view: Any) -> int:
        """Device address of a kernel argument's first element."""
        return int(view) if isinstance(view, np.integer) else int(view.data.ptr)

    def run(self, dtype: str, name: str, threads: int, args: Sequence[Any]) -> None:
        """Launch ``name`` of ``dtype``'s module with ``threads`` threads (grid-stride past the cap)."""
        self.launch(pool_kernel(dtype, name), threads, args)

    @staticmethod
    def launch(kernel: Any, threads: int, args: Sequence[Any]) -> None:
        """Launch ``kernel`` (a grid-stride loop) over ``threads`` threads, in blocks of 256 up to the cap."""
        blocks = max(1, min(-(-threads // _BLOCK), _MAX_BLOCKS))
        kernel((blocks,), (_BLOCK,), tuple(args))


# ----------------------------------------------------------------------------------------------
# Pooling
# ----------------------------------------------------------------------------------------------
@recorded_whole
def max_pool2d(
    x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, *, ceil_mode: bool = False, out: Any = None,
    indices: bool = True, dilation: Any = 1,
) -> tuple[Any, Any]:
    """Max pooling of an (N, C, H, W) image, as torch.nn.functional.max_pool2d(return_indices=True)
    (``ceil_mode`` and ``dilation`` as PyTorch's).

    Padding is -inf (it never wins). Returns (y, argmax): y of x's dtype and memory layout (or
    ``out``, dense NCHW or NHWC, if given), shape (N, C, Ho, Wo); argmax int32 of y's shape and
    layout, holding the flat index h*W+w of the maximum in the input plane (first position in
    row-major window order on ties; NaN wins), or None with ``indices=False`` (inference: not made).
    """
    P = "max_pool2d"
    xo = operand(P, "x", x, (4,), FLOAT_DTYPES)
    g = pool2d_geometry(xo.shape, kernel_size, stride, padding, P, ceil_mode, dilation)
    n, c, h, w = xo.shape
    _check_plane(P, "x", h, w)
    yshape = (n, c, g.ho, g.wo)
    total = n * c * g.ho * g.wo
    with Launch(P, xo) as L:
        y, yv, ystr, ylayout = result_of(P, L, xo, out, yshape)
        xv = L.view(xo)
        vec = 0 if indices else lanes16(L, xo.dtype, c, total, (xo.layout, ylayout), (xv, yv))
        if vec:  # inference, channels-last: 16-byte lanes
            L.run(xo.dtype, "max_pool_fwd_nhwc_vec", total // vec, [
                xv, yv, *i32(total // vec, c, h, w, g.ho, g.wo, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw)])
            return y, None
        am, amv = L.empty(xo, yshape if indices else (1, 1, 1, 1), ylayout, "int32")  # without indices: never written
        am = am if indices else None
        L.run(xo.dtype, "max_pool_fwd", total, [
            L.view(xo), yv, amv, *i64(total), *i32(c, h, w, g.ho, g.wo, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw),
            *i64(*xo.strides), *i64(*ystr), *i32(ylayout == "NHWC", bool(indices)),
        ])
    return y, am


def result_of(P: str, L: "Launch", like: Operand, out: Any, shape: tuple[int, ...]) -> tuple[Any, Any, tuple[int, ...], str]:
    """(result, its CuPy view, its strides, its layout): a new array dense in ``like``'s layout, or
    the caller's ``out`` checked against the expected shape, dtype, device and array type."""
    if out is None:
        y, yv = L.empty(like, shape, like.layout)
        return y, yv, _layout_strides(shape, like.layout), like.layout
    o = operand(P, "out", out, (len(shape),), FLOAT_DTYPES)
    same_place(P, ("x", like), ("out", o))
    if o.shape != tuple(shape) or o.lib != like.lib:
        raise OperandError(P, "out", f"expected a {like.lib} array of shape {tuple(shape)}, got a {o.lib} array of shape {o.shape}")
    return out, L.view(o), o.strides, o.layout


@recorded_whole
def max_pool2d_backward(dy: Any, argmax: Any, input_shape: Sequence[int]) -> Any:
    """Gradient of max_pool2d: dy scatter-added at argmax into zeros of ``input_shape`` (N, C, H, W).

    Uses float32 atomicAdd (then one rounding to dy's dtype), so overlapping windows accumulate
    correctly but the order of the additions, hence the last bits, may differ between runs.
    argmax is int32 or int64 (PyTorch's indices), shaped like dy; entries outside [0, H*W) are
    dropped. dx has dy's dtype and memory layout.
    """
    P = "max_pool2d_backward"
    d = operand(P, "dy", dy, (4,), FLOAT_DTYPES)
    a = operand(P, "argmax", argmax, (4,), INDEX_DTYPES)
    same_place(P, ("dy", d), ("argmax", a), dtype=False)
    if a.shape != d.shape:
        raise OperandError(P, "argmax", f"expected dy's shape {d.shape}, got {a.shape}")
    n, c, h, w = _input_shape(P, input_shape, d)
    _check_plane(P, "input_shape", h, w)
    xs = _layout_strides((n, c, h, w), d.layout)
    total_in, total_out = n * c * h * w, d.shape[0] * d.shape[1] * d.shape[2] * d.shape[3]
    with Launch(P, d) as L:
        dx, dxv = L.empty(d, (n, c, h, w), d.layout, zero=d.dtype == "float32")
        # float32: dy scatter-added into dx itself; else into float32 scratch with dx's strides (both dense in d.layout)
        acc = dxv if d.dtype == "float32" else L.zeros_f32(total_in)
        L.run(d.dtype, f"max_pool_bwd_i{a.dtype[3:]}", total_out, [
            L.view(d), L.view(a), acc, *i64(total_out), *i32(c, d.shape[2], d.shape[3], h, w),
            *i64(*d.strides), *i64(*a.strides), *i64(*xs), *i32(d.layout == "NHWC"),
        ])
        if d.dtype != "float32":
            L.run(d.dtype, "cast_f32", total_in, [acc, dxv, *i64(total_in)])
    return dx


def _divisor(pattern: str, divisor_override: Any) -> int:
    """``divisor_override`` as the kernels take it: a positive int, or 0 for PyTorch's own divisors."""
    if divisor_override is None:
        return 0
    if isinstance(divisor_override, bool) or not isinstance(divisor_override, (int, np.integer)) or not 0 < divisor_override < 2**31:
        raise OperandError(pattern, "divisor_override", f"expected None or a positive int, got {divisor_override!r}", what="argument")
    return int(divisor_override)


@recorded_whole
def avg_pool2d(
    x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, count_include_pad: bool = True, *,
    ceil_mode: bool = False, out: Any = None, divisor_override: int | None = None,
) -> Any:
    """Average pooling of an (N, C, H, W) image, as torch.nn.functional.avg_pool2d (zero padding;
    PyTorch's divisors, ``ceil_mode``'s extra windows included, or ``divisor_override``); y has x's
    dtype and memory layout, or is ``out`` (dense NCHW or NHWC) if given."""
    P = "avg_pool2d"
    xo = operand(P, "x", x, (4,), FLOAT_DTYPES)
    div = _divisor(P, divisor_override)
    g = pool2d_geometry(xo.shape, kernel_size, stride, padding, P, ceil_mode)
    n, c, h, w = xo.shape
    yshape = (n, c, g.ho, g.wo)
    total = n * c * g.ho * g.wo
    with Launch(P, xo) as L:
        y, yv, ystr, ylayout = result_of(P, L, xo, out, yshape)
        L.run(xo.dtype, "avg_pool_fwd", total, [
            L.view(xo), yv, *i64(total),
            *i32(c, h, w, g.ho, g.wo, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, bool(count_include_pad), div),
            *i64(*xo.strides), *i64(*ystr), *i32(ylayout == "NHWC"),
        ])
    return y


@recorded_whole
def avg_pool2d_backward(
    dy: Any, input_shape: Sequence[int], kernel_size: Any, stride: Any = None, padding: Any = 0,
    count_include_pad: bool = True, ceil_mode: bool = False, divisor_override: int | None = None,
) -> Any:
    """Gradient of avg_pool2d with respect to its input of ``input_shape`` (N, C, H, W).

    Deterministic: each dx element sums dy/divisor over the windows that cover it. dx has dy's
    dtype and memory layout.
    """
    P = "avg_pool2d_backward"
    d = operand(P, "dy", dy, (4,), FLOAT_DTYPES)
    div = _divisor(P, divisor_override)
    n, c, h, w = _input_shape(P, input_shape, d)
    g = pool2d_geometry((n, c, h, w), kernel_size, stride, padding, P, ceil_mode)
    if d.shape != (n, c, g.ho, g.wo):
        raise OperandError(P, "dy", f"expected shape {(n, c, g.ho, g.wo)} (avg_pool2d's output for input_shape), got {d.shape}")
    total = n * c * h * w
    with Launch(P, d) as L:
        dx, dxv = L.empty(d, (n, c, h, w), d.layout)
        L.run(d.dtype, "avg_pool_bwd", total, [
            L.view(d), dxv, *i64(total),
            *i32(c, h, w, g.ho, g.wo, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, bool(count_include_pad), div),
            *i64(*d.strides), *i64(*_layout_strides((n, c, h, w), d.layout)), *i32(d.layout == "NHWC"),
        ])
    return dx


# ----------------------------------------------------------------------------------------------
# Softmax
# ----------------------------------------------------------------------------------------------
def _row_args(ops: Sequence[Operand], axis: int) -> tuple[int, int, int, int, list[np.int64]]:
    """(rows, L, o1, o2, strides): the non-axis dims ordered by the first operand's stride, largest
    first (so adjacent rows are adjacent in its memory), padded to three."""
    shape = ops[0].shape
    others = sorted((d for d in range(len(shape)) if d != axis), key=lambda d: -ops[0].strides[d])
    others = [None] * (3 - len(others)) + others
    sizes = [1 if d is None else shape[d] for d in others]
    strides: list[np.int64] = []
    for op in ops:
        strides += i64(*(0 if d is None else op.strides[d] for d in others), op.strides[axis])
    return sizes[0] * sizes[1] * sizes[2], shape[axis], sizes[1], sizes[2], strides


def _softmax_call(P: str, mode: int, a_name: str, a: Any, dy: Any, axis: int) -> Any:
    """mode 0 / 1: softmax / log_softmax of a = x; 2 / 3: their gradients from a = y and dy."""
    D = operand(P, "dy", dy, (2, 4), FLOAT_DTYPES) if dy is not None else None
    A = operand(P, a_name, a, (2, 4), FLOAT_DTYPES)
    if D is not None:
        same_place(P, ("dy", D), (a_name, A))
        if D.shape != A.shape:
            raise OperandError(P, a_name, f"expected dy's shape {D.shape}, got {A.shape}")
    ax = checked_axis(P, axis, len(A.shape))
    like = A if D is None else D  # the result: x's (forward) or dy's (backward) type, dtype and layout
    with Launch(P, like) as L:
        out, outv = L.empty(like, like.shape, like.layout)
        Q = replace(like, array=out)
        # rows walk the result's memory order; the kernel's b is dy (backward) or unread (forward)
        rows, length, o1, o2, strides = _row_args([Q, A, like], ax)
        q_str, a_str, b_str = strides[0:4], strides[4:8], strides[8:12]
        av = L.view(A)
        bv = av if D is None else L.view(D)
        name = "softmax_rows_warp" if A.strides[ax] == 1 and length >= 32 else "softmax_rows"
        threads = rows * 32 if name in WARP_KERNELS else rows
        L.run(A.dtype, name, threads, [av, bv, outv, *i64(rows), *i32(length, o1, o2), *a_str, *b_str, *q_str, *i32(mode)])
    return out


@recorded_whole
def softmax(x: Any, axis: int = 1) -> Any:
    """Numerically stable softmax of a 2-D (batch, classes) array or an (N, C, H, W) image along
    ``axis`` (default: classes / channels), accumulated in float32; y has x's dtype and layout."""
    return _softmax_call("softmax", 0, "x", x, None, axis)


@recorded_whole
def log_softmax(x: Any, axis: int = 1) -> Any:
    """Numerically stable log-softmax along ``axis`` (as softmax), computed as (x - max) - log(sum exp)."""
    return _softmax_call("log_softmax", 1, "x", x, None, axis)


@recorded_whole
def softmax_backward(dy: Any, y: Any, axis: int = 1) -> Any:
    """Gradient of softmax from its output y: dx = y * (dy - sum(dy * y)) along ``axis``; dx has dy's
    dtype and layout."""
    return _softmax_call("softmax_backward", 2, "y", y, dy, axis)


@recorded_whole
def log_softmax_backward(dy: Any, y: Any, axis: int = 1) -> Any:
    """Gradient of log_softmax from its output y: dx = dy - exp(y) * sum(dy) along ``axis``; dx has dy's
    dtype and layout."""
    return _softmax_call("log_softmax_backward", 3, "y", y, dy, axis)


# ----------------------------------------------------------------------------------------------
# Layer norm over channels
# ----------------------------------------------------------------------------------------------
def channel_vector(P: str, name: str, v: Any, x: Operand) -> Operand:
    o = operand(P, name, v, (1,), ("float32",))
    same_place(P, ("x", x), (name, o), dtype=False)
    if o.shape != (x.shape[1],) or o.lib != x.lib:
        raise OperandError(P, name, f"expected a float32 {x.lib} vector of x's {x.shape[1]} channels, got a {o.lib} array of shape {o.shape}")
    return o


@recorded_whole
def channel_layer_norm(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5, *, out: Any = None) -> Any:
    """LayerNorm over the channels of an (N, C, H, W) image at each position (what ConvNeXt's
    channels-last LayerNorm computes), in float32: y = (x - mean) / sqrt(var + eps) * weight + bias.
    ``weight`` and ``bias``: float32 vectors of C (both or neither). y has x's dtype and layout, or
    is ``out`` (dense NCHW or NHWC, x's shape and dtype)."""
    P = "channel_layer_norm"
    xo = operand(P, "x", x, (4,), FLOAT_DTYPES)
    if (weight is None) != (bias is None):
        raise OperandError(P, "weight" if weight is None else "bias", "pass weight and bias together, or neither")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise OperandError(P, "eps", f"expected a positive number, got {eps!r}")
    vecs = [channel_vector(P, k, v, xo) for k, v in (("weight", weight), ("bias", bias)) if v is not None]
    n, c, h, w = xo.shape
    with Launch(P, xo) as L:
        y, yv, ystr, _ = result_of(P, L, xo, out, xo.shape)
        gb = [L.view(v) for v in vecs] or [L.zeros_f32(1)] * 2  # unread without weight and bias
        L.run(xo.dtype, "layer_norm_channels", n * h * w * 32, [
            L.view(xo), *gb, yv, *i64(n * h * w), *i32(c, h, w), *i64(*xo.strides), *i64(*ystr),
            np.float32(eps), *i32(bool(vecs))])
    return y


# ----------------------------------------------------------------------------------------------
# Channel shuffle
# ----------------------------------------------------------------------------------------------
@recorded_whole
def channel_shuffle(x: Any, groups: int, *, out: Any = None) -> Any:
    """ShuffleNet's channel shuffle of an (N, C, H, W) image, as torch.nn.functional.channel_shuffle:
    output channel k is input channel (k % groups) * (C / groups) + k // groups. One pass over
    memory; y has x's dtype and layout, or is ``out`` (dense NCHW or NHWC, x's shape and dtype)."""
    P = "channel_shuffle"
    xo = operand(P, "x", x, (4,), FLOAT_DTYPES)
    n, c, h, w = xo.shape
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1 or c % groups:
        raise OperandError(P, "groups", f"expected a positive int dividing x's {c} channels, got {groups!r}")
    total = n * c * h * w
    with Launch(P, xo) as L:
        y, yv, ystr, ylayout = result_of(P, L, xo, out, xo.shape)
        L.run(xo.dtype, "channel_shuffle", total, [
            L.view(xo), yv, *i64(total), *i32(c, h, w, int(groups)), *i64(*xo.strides), *i64(*ystr), *i32(ylayout == "NHWC")])
    return y


# ----------------------------------------------------------------------------------------------
# Softmax over the paths of a split-attention gate
# ----------------------------------------------------------------------------------------------
@recorded_whole
def radix_softmax(z: Any, radix: int, cardinality: int = 1, *, out: Any = None) -> Any:
    """ResNeSt's rSoftMax (SKNet's softmax over its paths with ``cardinality`` 1): z, an
    (N, cardinality*radix*C, 1, 1) vector laid out as (cardinality, radix, C), softmax over the radix
    in float32, the result laid out as (radix, cardinality, C); y has z's shape and dtype, or is ``out``."""
    P = "radix_softmax"
    zo = operand(P, "z", z, (4,), FLOAT_DTYPES)
    n, k, h, w = zo.shape
    for name, v in (("radix", radix), ("cardinality", cardinality)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise OperandError(P, name, f"expected a positive int, got {v!r}", what="attribute")
    if (h, w) != (1, 1) or k % (radix * cardinality):
        raise OperandError(P, "z", f"expected an (N, K, 1, 1) vector with K a multiple of cardinality * radix = "
                           f"{radix * cardinality}, got shape {zo.shape}")
    c = k // (radix * cardinality)
    with Launch(P, zo) as L:
        y, yv, ystr, _ = result_of(P, L, zo, out, zo.shape)
        L.run(zo.dtype, "radix_softmax", n * cardinality * c, [
            L.view(zo), yv, *i64(n * cardinality * c), *i32(cardinality, radix, c), *i64(zo.strides[0], zo.strides[1], ystr[0], ystr[1])])
    return y
