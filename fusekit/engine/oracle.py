"""The NumPy float64 interpreter of pattern files: the correctness oracle and the CPU backend.

It executes the same Pattern object the cuDNN lowering reads, op by op, in float64, with the same
shape checks (``Pattern.infer_shapes``) and the same attribute normalization.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import ArityError, OperandError
from .patterns import OPS, Pattern, get_pattern
from .pooling import PoolGeometry, pool2d_geometry
from ..tensors import logical_shape, view_shape


def conv2d_nchw(x: np.ndarray, w: np.ndarray, padding=(0, 0), stride=(1, 1), dilation=(1, 1), extra=(0, 0)) -> np.ndarray:
    """Cross-correlation of x (N, C, H, W) with w (K, C, R, S), as cuDNN's CROSS_CORRELATION mode;
    ``extra``: zero rows / columns after x beyond ``padding``."""
    n, c, h, wd = x.shape
    k, _, r, s = w.shape
    (ph, pw), (sh, sw), (dh, dw), (eh, ew) = padding, stride, dilation, extra
    ho = (h + 2 * ph + eh - (r - 1) * dh - 1) // sh + 1
    wo = (wd + 2 * pw + ew - (s - 1) * dw - 1) // sw + 1
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph + eh), (pw, pw + ew)))
    out = np.zeros((n, k, ho, wo), dtype=np.result_type(x, w))
    for i in range(r):
        for j in range(s):
            win = xp[:, :, i * dh : i * dh + (ho - 1) * sh + 1 : sh, j * dw : j * dw + (wo - 1) * sw + 1 : sw]
            out += np.einsum("nchw,kc->nkhw", win, w[:, :, i, j], optimize=True)
    return out


def conv2d_dgrad_nchw(dy: np.ndarray, w: np.ndarray, out_hw, padding=(0, 0), stride=(1, 1), dilation=(1, 1)) -> np.ndarray:
    """Gradient of conv2d_nchw with respect to its input (a transposed convolution), output (N, C, *out_hw)."""
    n, k, ho, wo = dy.shape
    _, c, r, s = w.shape
    (ph, pw), (sh, sw), (dh, dw) = padding, stride, dilation
    h, wd = out_hw
    dxp = np.zeros((n, c, h + 2 * ph + sh + (r - 1) * dh, wd + 2 * pw + sw + (s - 1) * dw), dtype=np.result_type(dy, w))
    for i in range(r):
        for j in range(s):
            dxp[:, :, i * dh : i * dh + (ho - 1) * sh + 1 : sh, j * dw : j * dw + (wo - 1) * sw + 1 : sw] += np.einsum(
                "nkhw,kc->nchw", dy, w[:, :, i, j], optimize=True
            )
    return dxp[:, :, ph : ph + h, pw : pw + wd]


def conv2d_wgrad_nchw(x: np.ndarray, dy: np.ndarray, kernel, padding=(0, 0), stride=(1, 1), dilation=(1, 1)) -> np.ndarray:
    """Gradient of conv2d_nchw with respect to its filter, shape (K, C, *kernel)."""
    n, c, h, wd = x.shape
    _, k, ho, wo = dy.shape
    r, s = kernel
    (ph, pw), (sh, sw), (dh, dw) = padding, stride, dilation
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    out = np.zeros((k, c, r, s), dtype=np.result_type(x, dy))
    for i in range(r):
        for j in range(s):
            win = xp[:, :, i * dh : i * dh + (ho - 1) * sh + 1 : sh, j * dw : j * dw + (wo - 1) * sw + 1 : sw]
            out[:, :, i, j] = np.einsum("nchw,nkhw->kc", win, dy, optimize=True)
    return out


def _channel_sum(x: np.ndarray) -> np.ndarray:
    ax = 1 if x.ndim == 4 else x.ndim - 1
    return x.sum(axis=tuple(i for i in range(x.ndim) if i != ax), keepdims=True)


def _bn_stats(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    var = x.var(axis=(0, 2, 3), keepdims=True)
    return mean, var, 1.0 / np.sqrt(var + eps)


def _batchnorm(i: Mapping[str, np.ndarray], a: Mapping[str, Any]) -> tuple:
    x = i["input"]
    mean, var, inv = _bn_stats(x, a["epsilon"])
    y = (x - mean) * inv * i["scale"] + i["bias"]
    m, count = a["momentum"], x.size // x.shape[1]
    unbiased = var * count / max(count - 1, 1)
    return y, mean, inv, (1 - m) * i["in_running_mean"] + m * mean, (1 - m) * i["in_running_var"] + m * unbiased


def _batchnorm_backward(i: Mapping[str, np.ndarray]) -> tuple:
    dy, x, gamma, mean, inv = i["loss"], i["input"], i["scale"], i["mean"], i["inv_variance"]
    axes = (0, 2, 3)
    m = x.size // x.shape[1]
    xhat = (x - mean) * inv
    dbeta = dy.sum(axis=axes, keepdims=True)
    dgamma = (dy * xhat).sum(axis=axes, keepdims=True)
    dx = gamma * inv / m * (m * dy - dbeta - xhat * dgamma)
    return dx, dgamma, dbeta


def _norm(i: Mapping[str, np.ndarray], a: Mapping[str, Any], axes: tuple[int, ...]) -> tuple:
    x = i["input"]
    mean = x.mean(axis=axes, keepdims=True)
    inv = 1.0 / np.sqrt(x.var(axis=axes, keepdims=True) + a["epsilon"])
    return (x - mean) * inv * i["scale"] + i["bias"], mean, inv


def _grouped(f: Callable, groups: int, *args: Any, axis: int = 1) -> np.ndarray:
    """A grouped convolution as ``groups`` independent ones: each (array, channel axis) pair in
    ``args`` is split along that axis, the rest passed through; results joined along ``axis``."""
    if groups == 1:
        return f(*(a[0] if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], np.ndarray) else a for a in args))
    parts = []
    for g in range(groups):
        call = [np.split(a[0], groups, axis=a[1])[g] if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], np.ndarray) else a for a in args]
        parts.append(f(*call))
    return np.concatenate(parts, axis=axis)


def _norm_backward(i: Mapping[str, np.ndarray], axes: tuple[int, ...], affine_sum: tuple[int, ...]) -> tuple:
    dy, x, gamma, mean, inv = i["loss"], i["input"], i["scale"], i["mean"], i["inv_variance"]
    m = np.prod([x.shape[k] for k in axes])
    xhat = (x - mean) * inv
    g = dy * gamma
    dx = inv / m * (m * g - g.sum(axis=axes, keepdims=True) - xhat * (g * xhat).sum(axis=axes, keepdims=True))
    return dx, (dy * xhat).sum(axis=affine_sum, keepdims=True), dy.sum(axis=affine_sum, keepdims=True)


_erf = np.frompyfunc(math.erf, 1, 1)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # exact, and no overflow for large |x|


def activation(x: np.ndarray, act: str, alpha: float = 0.0) -> np.ndarray:
    """``act`` (patterns.ACTIVATIONS) of x in float64, as PyTorch defines it."""
    x = np.asarray(x, dtype=np.float64)
    if act == "identity":
        return x.copy()
    if act == "relu":
        return np.maximum(x, 0.0)
    if act == "clip":
        return np.minimum(np.maximum(x, 0.0), alpha)
    if act == "silu":
        return x * _sigmoid(x)
    if act == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))
    if act == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if act == "sigmoid":
        return _sigmoid(x)
    if act == "tanh":
        return np.tanh(x)
    if act == "hardswish":
        return x * np.clip(x + 3.0, 0.0, 6.0) / 6.0
    if act == "hardsigmoid":
        return np.clip(x / 6.0 + 0.5, 0.0, 1.0)
    if act == "leaky_relu":
        return np.where(x > 0, x, alpha * x)
    if act == "elu":
        return np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0)))
    raise ValueError(f"unknown activation {act!r}")


EVAL: dict[str, Callable[[Mapping[str, np.ndarray], Mapping[str, Any]], np.ndarray]] = {
    "conv_fprop": lambda i, a: _grouped(conv2d_nchw, a["groups"], (i["image"], 1), (i["weight"], 0), a["padding"], a["stride"], a["dilation"],
                                        a.get("extra_padding", (0, 0))),
    "conv_dgrad": lambda i, a: _grouped(
        conv2d_dgrad_nchw, a["groups"], (i["loss"], 1), (i["filter"], 0), a["_out"][2:], a["padding"], a["stride"], a["dilation"]
    ),
    "conv_wgrad": lambda i, a: _grouped(
        conv2d_wgrad_nchw, a["groups"], (i["image"], 1), (i["loss"], 1), a["kernel"], a["padding"], a["stride"], a["dilation"], axis=0
    ),
    "matmul": lambda i, a: np.matmul(i["a"], i["b"]),
    "act": lambda i, a: activation(i["input"], a["activation"], a["alpha"]),
    "relu_backward": lambda i, a: i["loss"] * ((i["input"] > 0) & (i["input"] < a["upper_clip"])),
    "channel_sum": lambda i, a: _channel_sum(i["input"]),
    "batchnorm": lambda i, a: _batchnorm(i, a),
    "batchnorm_backward": lambda i, a: _batchnorm_backward(i),
    "layernorm": lambda i, a: _norm(i, a, (1, 2, 3)),
    "layernorm_backward": lambda i, a: _norm_backward(i, (1, 2, 3), (0,)),
    "instancenorm": lambda i, a: _norm(i, a, (2, 3)),
    "instancenorm_backward": lambda i, a: _norm_backward(i, (2, 3), (0, 2, 3)),
    "genstats": lambda i, a: (i["input"].sum(axis=(0, 2, 3), keepdims=True), (i["input"] ** 2).sum(axis=(0, 2, 3), keepdims=True)),
    "bias": lambda i, a: i["input"] + i["bias"],
    "relu": lambda i, a: np.minimum(np.maximum(i["input"], 0.0), a["upper_clip"]),
    "add": lambda i, a: i["a"] + i["b"],
    "mul": lambda i, a: i["a"] * i["b"],
    "sub": lambda i, a: i["a"] - i["b"],
}
assert set(EVAL) == set(OPS), "every op needs an oracle"


def _real_array(pattern: str, name: str, a: Any) -> np.ndarray:
    """Operand ``a`` as a float64 host array; OperandError for what has no real numbers (strings, objects,
    complex values) and for a torch tensor that requires grad (detach it)."""
    if getattr(a, "requires_grad", False):
        raise OperandError(pattern, name, "expected a tensor without autograd history (pass tensor.detach())")
    if hasattr(a, "detach") and hasattr(a, "cpu"):  # a torch tensor (on any device)
        a = a.detach().cpu().numpy()
    elif hasattr(a, "get") and hasattr(a, "__cuda_array_interface__"):  # CuPy
        a = a.get()
    raw = np.asarray(a)
    if raw.dtype.kind not in "biuf":
        what = {"c": "complex values", "U": "strings", "S": "bytes", "O": "Python objects"}.get(raw.dtype.kind, f"dtype {raw.dtype}")
        raise OperandError(pattern, name, f"expected a real-valued numeric array, got {what} ({type(a).__name__})")
    return raw.astype(np.float64)


def evaluate(pattern: Pattern | str, *operands: Any, **attrs: Any) -> tuple[np.ndarray, ...]:
    """Run ``pattern`` in float64 on host arrays (logical NCHW dims); returns its outputs in order.

    Operands may be anything ``np.asarray`` takes (CuPy/torch callers pass ``.get()`` / ``.cpu()``).
    """
    if not isinstance(pattern, (str, Pattern)):
        raise OperandError("oracle", "pattern", f"expected a pattern name or Pattern, got {type(pattern).__name__} {pattern!r}", what="argument")
    pat = get_pattern(pattern) if isinstance(pattern, str) else pattern
    if len(operands) != len(pat.operands):
        raise ArityError(f"{pat.name} takes {len(pat.operands)} operands {pat.operand_names}, got {len(operands)}")
    norm = dict(pat.normalize_attrs(attrs))
    env: dict[str, np.ndarray] = {}
    for o, a in zip(pat.operands, operands):
        arr = _real_array(pat.name, o.name, a)
        shape = logical_shape(pat.name, o.name, o.kind, arr.shape)
        env[o.name] = arr.T.reshape(shape) if o.kind == "matrix_t" else arr.reshape(shape)
    shapes = pat.infer_shapes({k: v.shape for k, v in env.items()}, norm)  # the same checks as the GPU path
    for op in pat.ops:
        res = EVAL[op.op]({p: env[v] for p, v in op.inputs.items()}, {**pat.op_attrs(op, norm), "_out": shapes[op.out]})
        env.update(zip(op.produces, res) if len(op.produces) > 1 else [(op.out, res)])
    return tuple(env[name].reshape(view_shape(pat.output_kinds[name], env[name].shape)) for name in pat.outputs)


# ----------------------------------------------------------------------------------------------
# Pooling and softmax in float64: the references of fusekit.ops.pool's kernels (no pattern files)
# ----------------------------------------------------------------------------------------------
def _offsets(g: PoolGeometry, h: int, w: int, i: int, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Input rows and columns under window tap (i, j) of every output position, and their validity."""
    rows = np.arange(g.ho) * g.sh - g.ph + i * g.dh
    cols = np.arange(g.wo) * g.sw - g.pw + j * g.dw
    valid = ((rows >= 0) & (rows < h))[:, None] & ((cols >= 0) & (cols < w))[None, :]
    return np.clip(rows, 0, h - 1), np.clip(cols, 0, w - 1), valid


def _avg_divisor(g: PoolGeometry, h: int, w: int, count_include_pad: bool, divisor_override: int | None = None) -> np.ndarray:
    """(Ho, Wo) divisors as PyTorch: window clipped to the padded input, or to the input without pad
    (or ``divisor_override`` everywhere)."""
    if divisor_override is not None:
        return np.full((g.ho, g.wo), float(divisor_override))
    def span(n_out: int, s: int, p: int, k: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        start = np.arange(n_out) * s - p
        end = np.minimum(start + k, size + p)
        return end - start, np.minimum(end, size) - np.maximum(start, 0)

    padded_h, real_h = span(g.ho, g.sh, g.ph, g.kh, h)
    padded_w, real_w = span(g.wo, g.sw, g.pw, g.kw, w)
    return np.outer(padded_h, padded_w) if count_include_pad else np.outer(real_h, real_w)


def max_pool2d_reference(
    x: np.ndarray, kernel_size: Any, stride: Any = None, padding: int | tuple = 0, ceil_mode: bool = False, dilation: Any = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """float64 max pooling of (N, C, H, W) and int64 argmax (flat h*W+w in the input plane).

    As PyTorch: padding never wins, ties keep the first position in row-major window order, NaN wins.
    """
    x = np.asarray(x, dtype=np.float64)
    g = pool2d_geometry(x.shape, kernel_size, stride, padding, "max_pool2d_reference", ceil_mode, dilation)
    n, c, h, w = x.shape
    best = np.full((n, c, g.ho, g.wo), -np.inf)

    def first(n_out: int, s: int, p: int, d: int) -> np.ndarray:  # the window's first tap inside the input
        start = np.arange(n_out) * s - p
        return np.where(start < 0, start + (-start + d - 1) // d * d, start)

    first_h, first_w = first(g.ho, g.sh, g.ph, g.dh), first(g.wo, g.sw, g.pw, g.dw)
    idx = np.broadcast_to((first_h[:, None] * w + first_w[None, :]), best.shape).astype(np.int64)
    for i in range(g.kh):
        for j in range(g.kw):
            rows, cols, valid = _offsets(g, h, w, i, j)
            v = x[:, :, rows[:, None], cols[None, :]]
            take = valid & ((v > best) | np.isnan(v))
            best = np.where(take, v, best)
            idx = np.where(take, rows[:, None] * w + cols[None, :], idx)
    return best, idx


def max_pool2d_backward_reference(dy: np.ndarray, argmax: np.ndarray, input_shape: Sequence[int]) -> np.ndarray:
    """float64 gradient of max pooling: dy scatter-added at argmax into zeros of ``input_shape``."""
    dy = np.asarray(dy, dtype=np.float64)
    n, c, h, w = (int(s) for s in input_shape)
    dx = np.zeros((n * c, h * w))
    rows = np.repeat(np.arange(n * c), dy.shape[2] * dy.shape[3])
    np.add.at(dx, (rows, np.asarray(argmax).reshape(-1)), dy.reshape(-1))
    return dx.reshape(n, c, h, w)


def avg_pool2d_reference(
    x: np.ndarray, kernel_size: Any, stride: Any = None, padding: Any = 0, count_include_pad: bool = True, ceil_mode: bool = False,
    divisor_override: int | None = None,
) -> np.ndarray:
    """float64 average pooling of (N, C, H, W) with PyTorch's divisors (zero padding)."""
    x = np.asarray(x, dtype=np.float64)
    g = pool2d_geometry(x.shape, kernel_size, stride, padding, "avg_pool2d_reference", ceil_mode)
    n, c, h, w = x.shape
    total = np.zeros((n, c, g.ho, g.wo))
    for i in range(g.kh):
        for j in range(g.kw):
            rows, cols, valid = _offsets(g, h, w, i, j)
            total += np.where(valid, x[:, :, rows[:, None], cols[None, :]], 0.0)
    return total / _avg_divisor(g, h, w, count_include_pad, divisor_override)


def avg_pool2d_backward_reference(
    dy: np.ndarray, input_shape: Sequence[int], kernel_size: Any, stride: Any = None, padding: Any = 0,
    count_include_pad: bool = True, ceil_mode: bool = False, divisor_override: int | None = None,
) -> np.ndarray:
    """float64 gradient of avg_pool2d_reference with respect to its input."""
    dy = np.asarray(dy, dtype=np.float64)
    n, c, h, w = (int(s) for s in input_shape)
    g = pool2d_geometry((n, c, h, w), kernel_size, stride, padding, "avg_pool2d_backward_reference", ceil_mode)
    if dy.shape != (n, c, g.ho, g.wo):
        raise OperandError("avg_pool2d_backward_reference", "dy", f"expected shape {(n, c, g.ho, g.wo)}, got {dy.shape}")
    share = dy / _avg_divisor(g, h, w, count_include_pad, divisor_override)
    dxp = np.zeros((n, c, h + 2 * g.ph + g.kh, w + 2 * g.pw + g.kw))
    for i in range(g.kh):
        for j in range(g.kw):
            dxp[:, :, i : i + (g.ho - 1) * g.sh + 1 : g.sh, j : j + (g.wo - 1) * g.sw + 1 : g.sw] += share
    return dxp[:, :, g.ph : g.ph + h, g.pw : g.pw + w]


def softmax_reference(x: np.ndarray, axis: int = 1) -> np.ndarray:
    """float64 softmax along ``axis``."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax_reference(x: np.ndarray, axis: int = 1) -> np.ndarray:
    """float64 log-softmax along ``axis``."""
    x = np.asarray(x, dtype=np.float64)
    z = x - x.max(axis=axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))


def softmax_backward_reference(dy: np.ndarray, y: np.ndarray, axis: int = 1) -> np.ndarray:
    """float64 softmax gradient from its output: y * (dy - sum(dy * y))."""
    dy, y = np.asarray(dy, dtype=np.float64), np.asarray(y, dtype=np.float64)
    return y * (dy - (dy * y).sum(axis=axis, keepdims=True))


def log_softmax_backward_reference(dy: np.ndarray, y: np.ndarray, axis: int = 1) -> np.ndarray:
    """float64 log-softmax gradient from its output: dy - exp(y) * sum(dy)."""
    dy, y = np.asarray(dy, dtype=np.float64), np.asarray(y, dtype=np.float64)
    return dy - np.exp(y) * dy.sum(axis=axis, keepdims=True)




def channel_layer_norm_reference(x: np.ndarray, weight: np.ndarray | None = None, bias: np.ndarray | None = None,
                                 eps: float = 1e-5) -> np.ndarray:
    """float64 LayerNorm over the channels (axis 1) of an (N, C, H, W) image at each position."""
    x = np.asarray(x, dtype=np.float64)
    z = (x - x.mean(axis=1, keepdims=True)) / np.sqrt(x.var(axis=1, keepdims=True) + eps)
    if weight is None:
        return z
    shape = (1, -1, 1, 1)
    return z * np.asarray(weight, np.float64).reshape(shape) + np.asarray(bias, np.float64).reshape(shape)


def channel_shuffle_reference(x: np.ndarray, groups: int) -> np.ndarray:
    """ShuffleNet's channel shuffle of an (N, C, H, W) image: (N, g, C/g, H, W), swap g and C/g, back."""
    n, c, h, w = np.shape(x)
    return np.asarray(x).reshape(n, groups, c // groups, h, w).transpose(0, 2, 1, 3, 4).reshape(n, c, h, w)


def radix_softmax_reference(z: np.ndarray, radix: int, cardinality: int = 1) -> np.ndarray:
    """float64 softmax over ``radix`` paths of an (N, cardinality*radix*C, 1, 1) vector laid out as
    (cardinality, radix, C), returned laid out as (radix, cardinality, C) (ResNeSt's rSoftMax)."""
    z = np.asarray(z, np.float64)
    n = z.shape[0]
    v = z.reshape(n, cardinality, radix, -1).transpose(0, 2, 1, 3)
    e = np.exp(v - v.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).reshape(z.shape)


def upsample_nearest2d_reference(x: np.ndarray, scale: Any) -> np.ndarray:
    """Nearest upsampling of an (N, C, H, W) image by integer factors (sh, sw) (an int: both)."""
    sh, sw = (scale, scale) if isinstance(scale, (int, np.integer)) else scale
    return np.repeat(np.repeat(np.asarray(x), int(sh), axis=2), int(sw), axis=3)


def depthwise_conv2d_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, padding=(0, 0), stride=(1, 1), dilation=(1, 1),
                               act: str = "identity", alpha: float = 0.0) -> np.ndarray:
    """float64 ``act(conv2d(x, w, b, groups=C))``: x (N, C, H, W), one filter per channel w (C, 1, R, S)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    c = x.shape[1]
    out = _grouped(conv2d_nchw, c, (x, 1), (w, 0), padding, stride, dilation)
    if b is not None:
        out = out + np.asarray(b, np.float64).reshape(1, c, 1, 1)
    return activation(out, act, alpha)
