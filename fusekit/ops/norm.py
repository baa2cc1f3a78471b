"""Normalization: batch norm split into normalize / scale / shift and fused back together (with
ReLU), its backward, inference BN and folding into a conv, layer norm and instance norm."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from .. import session
from ..dispatch import call, fused_or_split
from ..errors import OperandError
from ..tensors import TensorSpec, make_spec
from ..adapters import adapter_for
from .common import bias_grad, clip_attrs, tag



def channel_vectors(x: Any, values: tuple[float | None, ...], c: int | None = None, op: str = "channel_vectors",
                    name: str = "x") -> tuple[Any, ...]:
    """float32 (C,) vectors in x's array library and device, one per entry of ``values`` (filled with
    it; None: left unset, scratch), for ``c`` channels (default x's), cached per library, device, C and
    values: the constant operands fused graphs read like a bias. ``op`` and ``name``: what an
    OperandError about ``x`` names (the calling op, its operand)."""
    ad = adapter_for(x, op, name)
    shape, _, _, dev = ad.describe(x)
    if dev is None:
        raise OperandError(op, name, "expected a CUDA device array, got an array in host (CPU) memory")
    if c is None and len(shape) < 2:
        raise OperandError(op, name, f"expected an (N, C, ...) array, got shape {tuple(shape)}")
    c = int(shape[1]) if c is None else int(c)
    key = (type(x), int(dev), c, values)
    table = session.current().table("channel_vectors")
    v = table.get(key)
    if v is None:
        spec = TensorSpec.build((1, c, 1, 1), "float32", int(dev), "NCHW", view=(c,))
        v = tuple(ad.kept(lambda: ad.empty(spec), int(dev)) for _ in values)
        for t, fill in zip(v, values):
            if fill is not None:
                t[...] = fill
        table[key] = v
    return v


def affine_identity(x: Any, op: str = "affine_identity", name: str = "x") -> tuple[Any, Any, Any]:
    """(ones, zeros, (scratch, scratch)) float32 channel vectors for x's channels (:func:`channel_vectors`).
    cuDNN's batch-norm node always applies gamma and beta; normalize-only runs it with these, and
    its backward writes the unused dgamma/dbeta into ``scratch`` (never returned, never allocated per call).
    ``op`` and ``name``: what an OperandError about ``x`` names (the calling op, its operand)."""
    ones, zeros, s1, s2 = channel_vectors(x, (1.0, 0.0, None, None), op=op, name=name)
    return ones, zeros, (s1, s2)


def bn_normalize(
    x: Any, running_mean: Any = None, running_var: Any = None, *, epsilon: float = 1e-5, momentum: float = 0.1
) -> tuple[Any, ...]:
    """Batch normalization without scale or shift: (x - mean) * inv_std over N, H, W.

    Returns (y, mean, inv_var), plus (new_running_mean, new_running_var) when running stats are
    given (updated with ``momentum``, unbiased variance, as PyTorch). Statistics are float32 (C,)."""
    ones, zeros, _ = affine_identity(x, "bn_normalize")
    return batchnorm(x, ones, zeros, running_mean, running_var, epsilon=epsilon, momentum=momentum)


def bn_normalize_backward(dy: Any, x: Any, mean: Any, inv_var: Any) -> Any:
    """dx of :func:`bn_normalize` (no gamma/beta gradients are produced for the caller)."""
    ones, _, (dg, db) = affine_identity(x, "bn_normalize_backward")

    def node() -> Any:
        dx = _empty_like(x)
        call("batchnorm_backward", dy, x, ones, mean, inv_var, out=(dx, dg, db))
        return dx

    return fused_or_split(tag("batchnorm_backward_node", dy, x), node, lambda: bn_split_backward(dy, x, ones, mean, inv_var)[0])


def _empty_like(x: Any, op: str = "fusekit", name: str = "x") -> Any:
    """An uninitialised 4-D array like ``x``: same library, dtype, device and layout (NCHW / NHWC)."""
    ad = adapter_for(x, op, name)
    return ad.empty(make_spec(op, name, "image", *ad.describe(x)))


def batchnorm(
    x: Any, gamma: Any, beta: Any, running_mean: Any = None, running_var: Any = None, *,
    epsilon: float = 1e-5, momentum: float = 0.1, relu: bool = False, upper_clip: float = math.inf, residual: Any = None,
) -> tuple[Any, ...]:
    """Training batch norm (normalize, scale, shift fused; + ReLU with ``relu``, clipped above at
    ``upper_clip``: 6 for ReLU6): (y, mean, inv_var [, new_running_mean, new_running_var]).
    ``residual``: an array like x added before a plain ReLU, y = relu(bn(x) + residual) in one graph
    (a ResNet block's end; its backward: :func:`batchnorm_backward` with ``residual=True``)."""
    if residual is not None and (not relu or not math.isinf(upper_clip)):
        raise OperandError("batchnorm", "residual", "a residual is added in front of a plain ReLU: pass relu=True (upper_clip inf)", what="argument")
    stats_only = running_mean is None
    if stats_only:  # the frontend's batchnorm node cannot drop its running-stat ports: feed it (0, 1), momentum 0
        ones, zeros, _ = affine_identity(x, "batchnorm")
        running_mean, running_var, momentum = zeros, ones, 0.0
    kw = dict(epsilon=epsilon, momentum=momentum)
    res = fused_or_split(
        tag("batchnorm_node", x),
        lambda: _bn_node_forward(x, gamma, beta, running_mean, running_var, relu, kw, upper_clip, residual),
        lambda: _add_relu(
            bn_split_forward(x, gamma, beta, running_mean, running_var, relu and residual is None, epsilon, momentum, upper_clip), residual
        ),
    )
    return tuple(res[:3]) if stats_only else tuple(res)


def _add_relu(res: tuple, residual: Any) -> tuple:
    """A batch norm's results with relu(y + residual) in place of its output y (none: as they are)."""
    if residual is None:
        return res
    return (call("add_relu", res[0], residual, out=res[0]),) + tuple(res[1:])


def _bn_node_forward(x: Any, gamma: Any, beta: Any, rm: Any, rv: Any, relu: bool, kw: dict, upper_clip: float, residual: Any = None) -> tuple:
    if residual is not None:
        return fused_or_split(
            tag("batchnorm_add_relu", x, residual),
            lambda: call("batchnorm_add_relu", x, gamma, beta, rm, rv, residual, **kw),
            lambda: _add_relu(call("batchnorm", x, gamma, beta, rm, rv, **kw), residual),
            like=x,  # side-effect free: the running statistics come back as new arrays
        )
    if not relu:
        return call("batchnorm", x, gamma, beta, rm, rv, **kw)
    clip = clip_attrs(upper_clip)
    return fused_or_split(
        tag("batchnorm_relu", x, attrs=tuple(clip.values())),
        lambda: call("batchnorm_relu", x, gamma, beta, rm, rv, **kw, **clip),
        lambda: (lambda r: (call("relu", r[0], **clip),) + tuple(r[1:]))(call("batchnorm", x, gamma, beta, rm, rv, **kw)),
        like=x,  # side-effect free: the running statistics come back as new arrays
    )


def _count(x: Any) -> int:
    n, c, h, w = (int(d) for d in x.shape)
    return n * h * w


def bn_split_forward(
    x: Any, gamma: Any, beta: Any, rm: Any, rv: Any, relu: bool, epsilon: float, momentum: float, upper_clip: float = math.inf,
) -> tuple:
    """Training batch norm from reductions and one pointwise graph, for keys cuDNN's batch-norm node
    refuses (its engines want C a multiple of their vector width): mean = sum(x) / M, then the
    two-pass variance sum((x - mean)^2) / M, the C-length statistics in array math, and
    (x - mean) * inv_std * gamma + beta [+ ReLU] as one graph."""
    m = _count(x)
    gamma, beta, rm, rv = (v.reshape(-1) for v in (gamma, beta, rm, rv))
    mean = bias_grad(x) / m
    var = call("centered_sq_sum", x, mean) / m
    inv = (var + epsilon) ** -0.5
    y = batchnorm_inference(x, mean, inv, gamma, beta, relu=relu, upper_clip=upper_clip)
    new_rm = rm * (1 - momentum) + mean * momentum
    new_rv = rv * (1 - momentum) + var * (momentum * m / max(m - 1, 1))
    return y, mean, inv, new_rm, new_rv


def bn_split_backward(dy: Any, x: Any, gamma: Any, mean: Any, inv: Any) -> tuple[Any, Any, Any]:
    """Batch-norm backward from two reductions (sum dy, sum dy * x) and one pointwise graph for dx."""
    m = _count(x)
    gamma, mean, inv = (v.reshape(-1) for v in (gamma, mean, inv))
    dbeta = bias_grad(dy)
    dgamma = (call("scale_grad", dy, x) - mean * dbeta) * inv
    a = gamma * inv
    b = -a * inv * dgamma / m
    c = -a * dbeta / m - b * mean
    return call("bn_dx", dy, x, a, b, c), dgamma, dbeta


def batchnorm_backward(
    dy: Any, x: Any, gamma: Any, mean: Any, inv_var: Any, *, y: Any = None, needs: Sequence[bool] = (True, True, True),
    upper_clip: float = math.inf, residual: bool = False,
) -> tuple[Any, ...]:
    """(dx, dgamma, dbeta) of training batch norm; with ``y`` (the ReLU output of batchnorm(relu=True),
    clipped at ``upper_clip``) the ReLU backward is fused in front (the dReLU + BN backward graph).
    ``residual``: y came from batchnorm(residual=...): (dx, dgamma, dbeta, dresidual), where
    dresidual = dy * (y > 0), also what the BN backward reads, comes out of the same graph where cuDNN
    has an engine for it (else the dReLU graph first, then the BN backward)."""
    if residual:
        if y is None or not math.isinf(upper_clip):
            raise OperandError("batchnorm_backward", "y", "residual=True needs y, the output of batchnorm(relu=True, residual=...)", what="argument")
        return _bn_add_relu_backward(dy, x, gamma, mean, inv_var, y, needs)
    clip = clip_attrs(upper_clip)

    def node() -> tuple:
        if y is None:
            return call("batchnorm_backward", dy, x, gamma, mean, inv_var)
        return fused_or_split(
            tag("batchnorm_relu_backward", dy, x, attrs=tuple(clip.values())),
            lambda: call("batchnorm_relu_backward", dy, y, x, gamma, mean, inv_var, **clip),
            lambda: call("batchnorm_backward", call("relu_backward", dy, y, **clip), x, gamma, mean, inv_var),
            like=dy,
        )

    res = fused_or_split(
        tag("batchnorm_backward_node", dy, x), node,
        lambda: bn_split_backward(dy if y is None else call("relu_backward", dy, y, **clip), x, gamma, mean, inv_var),
    )
    return tuple(r if n else None for r, n in zip(res, needs))  # type: ignore[return-value]


def _bn_add_relu_backward(dy: Any, x: Any, gamma: Any, mean: Any, inv_var: Any, y: Any, needs: Sequence[bool]) -> tuple[Any, ...]:
    """batchnorm_backward(residual=True): one graph, else the masked gradient first and the BN backward on it."""
    def split() -> tuple:
        dz = call("relu_backward", dy, y)
        return batchnorm_backward(dz, x, gamma, mean, inv_var) + (dz,)

    def node() -> tuple:
        dx, dz, dg, db = call("batchnorm_add_relu_backward", dy, y, x, gamma, mean, inv_var)
        return dx, dg, db, dz

    res = fused_or_split(tag("batchnorm_add_relu_backward", dy, x), node, split, like=dy)
    return tuple(r if n else None for r, n in zip(res, tuple(needs) + (True,)))


def inv_std(running_var: Any, epsilon: float = 1e-5) -> Any:
    """1 / sqrt(running_var + epsilon), what inference batch norm reads."""
    return (running_var + epsilon) ** -0.5


def batchnorm_inference(
    x: Any, mean: Any, inv_stdev: Any, gamma: Any, beta: Any, *, relu: bool = False, upper_clip: float = math.inf,
) -> Any:
    """Inference batch norm from running statistics (``inv_stdev`` = :func:`inv_std` of the running
    variance), + ReLU with ``relu`` (clipped above at ``upper_clip``)."""
    if not relu:
        return call("batchnorm_inference", x, mean, inv_stdev, gamma, beta)
    clip = clip_attrs(upper_clip)
    return fused_or_split(
        tag("batchnorm_inference_relu", x, attrs=tuple(clip.values())),
        lambda: call("batchnorm_inference_relu", x, mean, inv_stdev, gamma, beta, **clip),
        lambda: call("relu", call("batchnorm_inference", x, mean, inv_stdev, gamma, beta), **clip),
        like=x,
    )


def channel_scale_shift(x: Any, gamma: Any = None, beta: Any = None, *, relu: bool = False, upper_clip: float = math.inf) -> Any:
    """y = x * gamma + beta per channel (either may be None), + ReLU with ``relu`` (clipped above at
    ``upper_clip``); pointwise cuDNN graphs."""
    if gamma is not None and beta is not None:
        if relu:
            return call("channel_scale_shift_relu", x, gamma, beta, **clip_attrs(upper_clip))
        return call("channel_scale_shift", x, gamma, beta)
    if relu:
        raise OperandError("channel_scale_shift", "beta", "relu=True needs both gamma and beta (fuse the ReLU behind a full scale and shift)")
    if gamma is not None:
        return call("channel_scale", x, gamma)
    if beta is not None:
        return call("channel_shift", x, beta)
    raise OperandError("channel_scale_shift", "gamma", "give gamma, beta or both")


def channel_scale_shift_backward(
    dy: Any, x: Any, gamma: Any = None, *, y: Any = None, needs: Sequence[bool] = (True, True, True),
    upper_clip: float = math.inf,
) -> tuple[Any, Any, Any]:
    """(dx, dgamma, dbeta) of :func:`channel_scale_shift`; ``y``: its output when relu=True (the mask;
    the ReLU clipped at ``upper_clip``). dgamma needs x; dx needs gamma (dx = dy when there is no gamma)."""
    need_dx, need_dg, need_db = needs
    if y is not None:
        dy = call("relu_backward", dy, y, **clip_attrs(upper_clip))
    dx = (call("channel_scale", dy, gamma) if gamma is not None else dy) if need_dx else None
    dg = call("scale_grad", dy, x) if need_dg else None
    db = call("shift_grad", dy) if need_db else None
    return dx, dg, db


def fold_batchnorm(
    w: Any, b: Any, mean: Any, var: Any, gamma: Any = None, beta: Any = None, epsilon: float = 1e-5, *, dtype: str | None = None,
) -> tuple[Any, Any]:
    """Fold inference batch norm into the convolution before it: conv(x, w') + b' = BN(conv(x, w) + b).

    One kernel: scale = gamma / sqrt(var + epsilon), w' = w * scale, b' = (b - mean) * scale + beta,
    computed in float32 and stored in ``dtype`` (default w's): w' with w's strides (KCRS or KRSC),
    b' of shape (K,). ``b`` None: no conv bias; ``gamma`` and ``beta`` None: BN without
    affine. The BN vectors share one float dtype (float32, or float16 / bfloat16 for a half model);
    w and b may each have any of the three.
    Run the result with :func:`conv_bias_relu` (or conv_bias, conv_bias_add_relu)."""
    from .pool import FLOAT_DTYPES, Launch, operand, same_place, cuda_function, dtype_prelude, kernel_file

    P = "fold_batchnorm"
    wo = operand(P, "w", w, (4,), FLOAT_DTYPES)
    k = wo.shape[0]
    if (gamma is None) != (beta is None):
        raise OperandError(P, "gamma" if gamma is None else "beta", "expected gamma and beta both given (affine BN) or both None")
    vecs = {n: operand(P, n, a, (1,), FLOAT_DTYPES) for n, a in (("var", var), ("mean", mean), ("gamma", gamma), ("beta", beta)) if a is not None}
    for n, v in vecs.items():
        if v.shape != (k,):
            raise OperandError(P, n, f"expected shape ({k},) (one per output channel of w {wo.shape}), got {v.shape}")
        same_place(P, ("var", vecs["var"]), (n, v))
        same_place(P, ("w", wo), (n, v), dtype=False)
    bo = None
    if b is not None:
        bo = operand(P, "b", b, (1,), FLOAT_DTYPES)
        if bo.shape != (k,):
            raise OperandError(P, "b", f"expected shape ({k},) (one per output channel of w {wo.shape}), got {bo.shape}")
        same_place(P, ("w", wo), ("b", bo), dtype=False)
    out = dtype or wo.dtype
    if out not in FLOAT_DTYPES:
        raise OperandError(P, "dtype", f"expected one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}", what="argument")
    if not epsilon >= 0:
        raise OperandError(P, "epsilon", f"expected a number >= 0, got {epsilon!r}", what="argument")
    pd = vecs["var"].dtype
    dtypes = (wo.dtype, bo.dtype if bo is not None else wo.dtype, pd, out)  # w, b, the BN vectors, the output
    with Launch(P, wo) as L:  # (the module loads on w's device)
        kernel = cuda_function(
            (P, *dtypes), lambda: "".join(dtype_prelude(d, s) for d, s in zip(dtypes, ("_w", "_b", "_p", "_o"))) + kernel_file("fold_batchnorm.cu"), P)
        w2, w2v = L.empty_as(wo, out)  # w's very strides: a 1x1 or depthwise filter keeps the layout it came with
        b2, b2v = L.empty(vecs["var"], (k,), "ROW", out)
        v = {n: L.view(o) for n, o in vecs.items()}
        affine = gamma is not None
        n = wo.shape[0] * wo.shape[1] * wo.shape[2] * wo.shape[3]
        L.launch(kernel, n, (
            L.view(wo), L.view(bo) if bo is not None else v["var"], v["gamma"] if affine else v["var"], v["beta"] if affine else v["var"],
            v["mean"], v["var"], np.float32(epsilon), np.int64(n // k), np.int64(n), np.int32(bo is not None), np.int32(affine), w2v, b2v))
    return w2, b2


def _channels_last(x: Any, op: str, name: str) -> bool:
    ad = adapter_for(x, op, name)
    return make_spec(op, name, "image", *ad.describe(x)).layout == "NHWC"


def layernorm(x: Any, gamma: Any, beta: Any, *, epsilon: float = 1e-5) -> tuple[Any, Any, Any]:
    """Layer norm over (C, H, W) per sample (training): (y, mean, inv_var); gamma, beta (1, C, H, W) float32.

    cuDNN 9.19's layer norm gave wrong values for channels-last x on the device (its (1, C, H, W)
    affine is not read in x's order), so channels-last x runs on an NCHW copy; y comes back channels-last."""
    if _channels_last(x, "layernorm", "x"):
        ad = adapter_for(x)
        y, mean, inv = call("layernorm", ad.relayout(x, "NCHW"), gamma, beta, epsilon=epsilon)
        return ad.relayout(y, "NHWC"), mean, inv
    return call("layernorm", x, gamma, beta, epsilon=epsilon)


def layernorm_backward(dy: Any, x: Any, gamma: Any, mean: Any, inv_var: Any) -> tuple[Any, Any, Any]:
    """(dx, dgamma, dbeta) of :func:`layernorm` (channels-last arrays run on NCHW copies, as the forward)."""
    if _channels_last(x, "layernorm_backward", "x") or _channels_last(dy, "layernorm_backward", "dy"):
        ad = adapter_for(x)
        dx, dg, db = call("layernorm_backward", ad.relayout(dy, "NCHW"), ad.relayout(x, "NCHW"), gamma, mean, inv_var)
        return ad.relayout(dx, "NHWC"), dg, db
    return call("layernorm_backward", dy, x, gamma, mean, inv_var)


def instancenorm(x: Any, gamma: Any, beta: Any, *, epsilon: float = 1e-5) -> tuple[Any, Any, Any]:
    """Instance norm over (H, W) per sample and channel (training): (y, mean, inv_var); gamma, beta (C,) float32."""
    return call("instancenorm", x, gamma, beta, epsilon=epsilon)


def instancenorm_backward(dy: Any, x: Any, gamma: Any, mean: Any, inv_var: Any) -> tuple[Any, Any, Any]:
    """(dx, dgamma, dbeta) of :func:`instancenorm`."""
    return call("instancenorm_backward", dy, x, gamma, mean, inv_var)
