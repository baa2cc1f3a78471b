"""Helpers the op families share: call tags for split-and-warn, dtype casts, the ReLU + bias-gradient step."""

from __future__ import annotations

from typing import Any

from ..dispatch import call, fused_or_split
from ..tensors import adapter_for


def cast_like(a: Any, like: Any) -> Any:
    """``a`` in ``like``'s dtype (bias gradients come out of cuDNN reductions in float32)."""
    if a is None or a.dtype == like.dtype:
        return a
    ad = adapter_for(a)
    return ad.astype(a, ad.describe(like)[2])


def tag(name: str, *arrays: Any) -> tuple:
    """What fused_or_split remembers a refusal by: the pattern and each array's shape and dtype
    (as the array library gives them: this runs at every call of a fused-or-split op)."""
    return (name,) + tuple((a.shape, a.dtype) for a in arrays)


def relu_bias_grad(dy: Any, y: Any, need_db: bool) -> tuple[Any, Any]:
    """(dz, db) of ``relu(z)`` with upstream ``dy``: relu_backward, fused with the bias gradient when wanted."""
    if not need_db:
        return call("relu_backward", dy, y), None
    return fused_or_split(
        tag("relu_bias_grad", dy, y),
        lambda: call("relu_bias_grad", dy, y),
        lambda: (lambda d: (d, call("bias_grad", d)))(call("relu_backward", dy, y)),
        like=dy,
    )
