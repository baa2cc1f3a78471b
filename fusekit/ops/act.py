"""Layers with an activation attribute (``activation=``: one of ``fusekit.patterns.ACTIVATIONS``,
``alpha``: its parameter) as fused cuDNN graphs, forward only: convolution, fully connected,
per-channel scale-shift, a plain activation, add + activation and the squeeze-excitation gate."""

from __future__ import annotations

from typing import Any

from ..dispatch import call, fused_or_split, run
from ..adapters import adapter_for
from .common import tag
from .norm import affine_identity, channel_vectors

_CONV_ATTRS = ("padding", "stride", "dilation", "groups")
_ACT_ATTRS = ("activation", "alpha")


def hardswish_constants(x: Any, c: int) -> tuple[Any, Any]:
    """(1/6, 1/2) as float32 channel vectors of ``c`` channels in x's array library and device (cached):
    hardswish's constants as operands of :func:`conv_bias_hardswish`."""
    return channel_vectors(x, (1.0 / 6.0, 0.5), c, op="conv_bias_hardswish")


def conv_bias_act(x: Any, w: Any, b: Any, *, activation: str = "relu", alpha: float = 0.0, padding: Any = 0, stride: Any = 1,
                  dilation: Any = 1, groups: int = 1, extra_padding: Any = 0, out: Any = None) -> Any:
    """``act(conv2d(x, w) + b)`` as one cuDNN graph, or as the convolution then one pointwise graph
    where that measures faster or cuDNN refuses the fusion (``dispatch.fused_or_split``).
    ``extra_padding``: zero rows / columns after x (bottom, right) beyond ``padding`` (then one graph)."""
    values = (padding, stride, dilation, groups, activation, float(alpha))
    names = _CONV_ATTRS + _ACT_ATTRS
    if extra_padding not in (0, (0, 0), [0, 0]):
        return run("conv_bias_act", names + ("extra_padding",), values + (extra_padding,), (x, w, b), out)

    def split() -> Any:
        y = call("conv", x, w, padding=padding, stride=stride, dilation=dilation, groups=groups)
        b32 = adapter_for(b).astype(b, "float32")
        return call("channel_scale_shift_act", y, affine_identity(y)[0], b32, out=out, activation=activation, alpha=float(alpha))

    if activation == "hardswish":  # its constants as channel operands (cuDNN compiles those; scalar constants it may not)
        def fused() -> Any:
            return conv_bias_hardswish(x, w, b, *hardswish_constants(x, int(w.shape[0])), padding=padding, stride=stride,
                                       dilation=dilation, groups=groups, out=out)
    else:
        def fused() -> Any:
            return run("conv_bias_act", names, values, (x, w, b), out)
    return fused_or_split(tag("conv_bias_act", x, w, b, attrs=values), fused, split, like=x)


def conv_bias_hardswish(x: Any, w: Any, b: Any, gs: Any, gb: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1,
                        groups: int = 1, out: Any = None) -> Any:
    """``hardswish(conv2d(x, w) + b)`` as ``z * clip(z * gs + gb, 0, 1)`` in one cuDNN graph; gs, gb float32
    (C,) hold 1/6 and 1/2 (:func:`hardswish_constants`)."""
    return run("conv_bias_hardswish", _CONV_ATTRS, (padding, stride, dilation, groups), (x, w, b, gs, gb), out)


def conv_bias_add_act(x: Any, w: Any, b: Any, z: Any, *, activation: str = "relu", alpha: float = 0.0, padding: Any = 0, stride: Any = 1,
                      dilation: Any = 1, groups: int = 1, extra_padding: Any = 0, out: Any = None) -> Any:
    """``act(conv2d(x, w) + b + z)`` (a residual tail) as one cuDNN graph (``extra_padding`` as :func:`conv_bias_act`)."""
    return run("conv_bias_add_act", _CONV_ATTRS + _ACT_ATTRS + ("extra_padding",),
               (padding, stride, dilation, groups, activation, float(alpha), extra_padding), (x, w, b, z), out)


def linear_bias_act(x: Any, w: Any, b: Any, *, activation: str = "relu", alpha: float = 0.0, out: Any = None) -> Any:
    """``act(x @ w.T + b)``: x (B, in), w (out, in) as in torch.nn.Linear, b (out,)."""
    return run("linear_bias_act", _ACT_ATTRS, (activation, float(alpha)), (x, w, b), out)


def channel_scale_shift_act(x: Any, gamma: Any, beta: Any, *, activation: str = "relu", alpha: float = 0.0, out: Any = None) -> Any:
    """``act(x * gamma + beta)`` per channel (gamma, beta float32 (C,)): an inference batch norm and its activation."""
    return run("channel_scale_shift_act", _ACT_ATTRS, (activation, float(alpha)), (x, gamma, beta), out)


def act(x: Any, *, activation: str = "relu", alpha: float = 0.0, out: Any = None) -> Any:
    """``act(x)`` as one pointwise cuDNN graph."""
    return run("act", _ACT_ATTRS, (activation, float(alpha)), (x,), out)


def add_act(a: Any, b: Any, *, activation: str = "relu", alpha: float = 0.0, out: Any = None) -> Any:
    """``act(a + b)`` (b may broadcast over a) as one pointwise cuDNN graph."""
    return run("add_act", _ACT_ATTRS, (activation, float(alpha)), (a, b), out)


def channel_gate(x: Any, s: Any, *, out: Any = None) -> Any:
    """``x * s`` with s (N, C, 1, 1): squeeze-excitation's channel multiply, one pointwise cuDNN graph."""
    return run("channel_gate", (), (), (x, s), out)
