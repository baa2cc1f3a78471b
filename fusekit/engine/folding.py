"""Inference batch norm as a per-channel affine map, and that map folded into the convolution before
it: the one formula the pipeline's lowering (float64 NumPy) and ``fusekit.torch`` (float32 tensors,
differentiable) use. Any arrays with arithmetic work (NumPy, torch, CuPy); ``ops.fold_batchnorm`` is
the same formula as one CUDA kernel."""

from __future__ import annotations

from typing import Any


def bn_scale_shift(mean: Any, var: Any, eps: float, gamma: Any = None, beta: Any = None) -> tuple[Any, Any]:
    """Per-channel (scale, shift) with ``bn(x) = x * scale + shift`` in eval mode: scale = gamma /
    sqrt(var + eps), shift = beta - mean * scale (gamma 1 and beta 0 when None: no affine)."""
    scale = (var + eps) ** -0.5
    if gamma is not None:
        scale = gamma * scale
    shift = -mean * scale
    return scale, (shift if beta is None else shift + beta)


def fold_into_conv(w: Any, b: Any, scale: Any, shift: Any) -> tuple[Any, Any]:
    """(w', b') with ``conv(x, w') + b' = (conv(x, w) + b) * scale + shift`` per output channel (the
    outermost dim of ``w``); ``b`` None: a convolution without bias."""
    w2 = w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
    return w2, (shift if b is None else b * scale + shift)
