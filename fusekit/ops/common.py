"""Helpers the op families share: call tags for split-and-warn, dtype casts, the ReLU + bias-gradient
step and the per-channel sums over few channels."""

from __future__ import annotations

import math
from typing import Any

from .. import config
from ..dispatch import call, fused_or_split
from ..tensors import TensorSpec, matches, nhwc_strides
from ..adapters import adapter_for

#: Per-channel sums over fewer channels than this read their channels-last operands as rows of
#: several pixels (see :func:`pixels_per_row`).
#: Convolution gradients whose few-channel side (the dgrad output, the wgrad image) is channels-last
#: with more than one and fewer than this many channels also time a route through an NCHW copy
#: (see :func:`few_channels_last`).
NCHW_CHANNELS = 4


def cast_like(a: Any, like: Any) -> Any:
    """``a`` in ``like``'s dtype (bias gradients come out of cuDNN reductions in float32)."""
    if a is None or a.dtype == like.dtype:
        return a
    ad = adapter_for(a)
    return ad.astype(a, ad.describe(like)[2])


def tag(name: str, *arrays: Any, attrs: tuple = ()) -> tuple:
    """What fused_or_split remembers a refusal or a timing by: ``(name, attrs, *arrays)``, each array
    as (shape, dtype, strides) the way its library gives them (this runs at every call of a
    fused-or-split op). ``attrs``: whatever else selects the graphs (padding, stride, ...): two calls
    with the same arrays but another stride or layout may rank fused and split the other way."""
    if attrs:
        attrs = tuple(tuple(v) if type(v) is list else v for v in attrs)
    return (name, attrs) + tuple((a.shape, a.dtype, _strides(a)) for a in arrays)


def _strides(a: Any) -> tuple:
    s = getattr(a, "strides", None)  # CuPy / NumPy (bytes); torch has stride() (elements)
    return a.stride() if s is None else s


#: The fused activations: name -> the ReLU's upper clip (the patterns' ``upper_clip``).
ACTIVATIONS = {"relu": math.inf, "relu6": 6.0}


def module_activation(mod: Any) -> tuple[str, float] | None:
    """(activation, alpha) of a torch.nn activation module as the fused graphs name it (ReLU6: clip 6), else None."""
    import torch.nn as nn

    simple = {nn.ReLU: "relu", nn.SiLU: "silu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.Hardswish: "hardswish", nn.Hardsigmoid: "hardsigmoid"}
    for cls, name in simple.items():
        if isinstance(mod, cls):
            return name, 0.0
    if isinstance(mod, nn.Hardtanh) and float(mod.min_val) == 0.0:  # ReLU6 is a Hardtanh(0, 6)
        return "clip", float(mod.max_val)
    if isinstance(mod, nn.GELU):
        return ("gelu_tanh" if mod.approximate == "tanh" else "gelu"), 0.0
    if isinstance(mod, nn.LeakyReLU):
        return "leaky_relu", float(mod.negative_slope)
    if isinstance(mod, nn.ELU):
        return "elu", float(mod.alpha)
    return None


def clip_attrs(upper_clip: float) -> dict[str, float]:
    """The ``upper_clip`` attribute of the ReLU patterns: none for a plain ReLU (inf, their default),
    so plain calls keep their dispatch keys; ``{"upper_clip": 6.0}`` for ReLU6."""
    return {} if math.isinf(upper_clip) else {"upper_clip": float(upper_clip)}


def relu_bias_grad(dy: Any, y: Any, need_db: bool, upper_clip: float = math.inf) -> tuple[Any, Any]:
    """(dz, db) of ``relu(z)`` (clipped above at ``upper_clip``: ReLU6 with 6) with upstream ``dy``:
    relu_backward, fused with the bias gradient when wanted."""
    clip = clip_attrs(upper_clip)
    if not need_db:
        return call("relu_backward", dy, y, **clip), None
    k = pixels_per_row(dy, y)
    if k > 1:
        dz, db = relu_bias_grad(_as_rows(dy, k), _as_rows(y, k), True, upper_clip)
        return _from_rows(dz, dy.shape), _fold(db, k)
    return fused_or_split(
        tag("relu_bias_grad", dy, y, attrs=tuple(clip.values())),
        lambda: call("relu_bias_grad", dy, y, **clip),
        lambda: (lambda d: (d, call("bias_grad", d)))(call("relu_backward", dy, y, **clip)),
        like=dy,
    )


def bias_grad(dy: Any) -> Any:
    """The (C,) per-channel sum of ``dy`` in float32: the bias gradient."""
    k = pixels_per_row(dy)
    if k > 1:
        return _fold(call("bias_grad", _as_rows(dy, k)), k)
    return call("bias_grad", dy)


def pixels_per_row(*arrays: Any) -> int:
    """k such that the per-channel sums of ``arrays`` (same shape, dense channels-last (N, C, H, W),
    C < config.TUNABLES.row_channels) run on their memory read as (N*H*W / k, k*C, 1, 1), the k*C sums folded to C;
    1 where that does not apply. cuDNN's reductions give each row of threads a tile of channels, most
    of it idle when C is a few: ReLU backward + bias gradient of a 64x3x64x64 float32 image took
    22.9 us, 9.2 us as rows of 16 pixels; 256x3x64x64 float16 64.9 -> 10.7 us (H200, probe_bias_grad_view)."""
    shape = arrays[0].shape
    if len(shape) != 4 or not 0 < shape[1] < config.TUNABLES.row_channels:
        return 1
    n, c, h, w = (int(d) for d in shape)
    p, k = n * h * w, 1
    if p == 0 or p % 2:  # empty (handled as it is) or no pairs of pixels
        return 1
    if not _dense_channels_last(*arrays):
        return 1
    while k * c < config.TUNABLES.row_channels and p % (2 * k) == 0:
        k *= 2
    return k


def _as_rows(a: Any, k: int) -> Any:
    """Dense channels-last (N, C, H, W) ``a`` as the (N*H*W / k, k*C, 1, 1) view of the same memory."""
    n, c, h, w = (int(d) for d in a.shape)
    t = a.permute(0, 2, 3, 1) if hasattr(a, "permute") else a.transpose(0, 2, 3, 1)
    return t.reshape(n * h * w // k, k * c, 1, 1)


def _from_rows(a: Any, shape: Any) -> Any:
    """The channels-last (N, C, H, W) view of an array shaped by :func:`_as_rows`."""
    n, c, h, w = (int(d) for d in shape)
    t = a.reshape(n, h, w, c)
    return t.permute(0, 3, 1, 2) if hasattr(t, "permute") else t.transpose(0, 3, 1, 2)


def _fold(db: Any, k: int) -> Any:
    """k*C per-column sums -> the C per-channel sums (column j sums channel j % C)."""
    return db.reshape(k, -1).sum(0)


def few_channels_last(a: Any, channels: int | None = None) -> bool:
    """Whether ``a`` (a torch / CuPy array) is dense channels-last (N, C, H, W) with 1 < C < NCHW_CHANNELS
    (``channels``: that C instead of ``a``'s own, for an output shaped like ``a`` but for its channels).
    cuDNN's NHWC convolution kernels transpose such tensors internally: a float32 64x16x32x32 ->
    64x3x64x64 stride-2 dgrad took 41.7 us writing NHWC and 31.1 us writing NCHW; the heuristic plan
    of the matching wgrad 51.6 us reading the image NHWC and 35.9 us reading it NCHW (H200,
    probe_few_channel_layouts). Which route runs is timed on first use (fused_or_split)."""
    shape = a.shape
    c = int(shape[1]) if channels is None and len(shape) == 4 else channels
    if len(shape) != 4 or c is None or not 1 < c < NCHW_CHANNELS:
        return False
    return 0 not in shape and shape[1] > 1 and _dense_channels_last(a)


def _dense_channels_last(*arrays: Any) -> bool:
    """Whether ``arrays`` (torch / CuPy) are 4-D, all of the first one's shape, with dense channels-last
    strides (the memory the row views and the NCHW routes rely on; other array types are never viewed)."""
    if type(arrays[0]).__module__.split(".")[0] not in ("torch", "cupy"):
        return False
    shape = tuple(int(d) for d in arrays[0].shape)
    if len(shape) != 4:
        return False
    ad, dense = adapter_for(arrays[0]), nhwc_strides(shape)
    for a in arrays:
        s, strides = ad.describe(a)[:2]
        if tuple(s) != shape or not matches(tuple(strides), dense, shape):
            return False
    return True


def empty_as(like: Any, shape: Any, layout: str) -> Any:
    """A new array of ``like``'s library, dtype and device, of ``shape`` in ``layout`` ("NCHW" / "NHWC")."""
    ad = adapter_for(like)
    _, _, dtype, device = ad.describe(like)
    return ad.empty(TensorSpec.build(tuple(int(d) for d in shape), dtype, device, layout))
