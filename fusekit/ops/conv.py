"""Convolutions: forward (with bias, ReLU and residual-add epilogues), transposed, and backward
(dgrad, wgrad, bias gradient, ReLU backward), each a thin layer over dispatch."""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

from ..dispatch import call, fused_or_split, run
from ..engine.patterns import get_pattern
from ..adapters import adapter_for
from .common import bias_grad, cast_like, clip_attrs, empty_as, few_channels_last, relu_bias_grad, tag
from .norm import affine_identity

_CONV_ATTRS = ("padding", "stride", "dilation", "groups")


def conv_bias_relu(x: Any, w: Any, b: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, groups: int = 1, out: Any = None) -> Any:
    """``relu(conv2d(x, w) + b)`` as one cuDNN graph. x: (N, C, H, W), w: (K, C / groups, R, S), b: (K,)."""
    return _conv_epilogue("conv_bias_relu", (x, w, b), (padding, stride, dilation, groups), out)


def conv_bias(x: Any, w: Any, b: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, groups: int = 1, out: Any = None) -> Any:
    """``conv2d(x, w) + b`` as one cuDNN graph."""
    return _conv_epilogue("conv_bias", (x, w, b), (padding, stride, dilation, groups), out)


def conv_bias_relu6(x: Any, w: Any, b: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, groups: int = 1, out: Any = None) -> Any:
    """``min(max(conv2d(x, w) + b, 0), 6)`` (ReLU6, as MobileNet) as one cuDNN graph."""
    return _conv_epilogue("conv_bias_relu6", (x, w, b), (padding, stride, dilation, groups), out)


def conv_bias_add(x: Any, w: Any, b: Any, z: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, groups: int = 1, out: Any = None) -> Any:
    """``conv2d(x, w) + b + z``: a residual tail without activation (MobileNetV2) in one cuDNN graph."""
    return run("conv_bias_add", _CONV_ATTRS, (padding, stride, dilation, groups), (x, w, b, z), out)


def _conv_epilogue(name: str, operands: tuple, values: tuple, out: Any) -> Any:
    """A conv with a bias (+ residual add) (+ ReLU) epilogue as one graph. Grouped convolutions, for
    which cuDNN may have no fused engine, and ReLU6 epilogues, timed against the conv graph and a
    pointwise one (fused_or_split): cuDNN 9.19's heuristics give a dense conv + bias + ReLU6 its
    fallback engine, 0.5-2.8 ms for a MobileNetV2 1x1 conv at batch 32 on an H100, where the split
    runs in tens of microseconds."""
    if values[-1] == 1 and name != "conv_bias_relu6":
        return run(name, _CONV_ATTRS, values, operands, out)
    x, w, b = operands[:3]

    def split() -> Any:
        y = call("conv", x, w, **dict(zip(_CONV_ATTRS, values)))
        if name == "conv_bias_add_relu":
            return call("add_relu", _bias_act(y, b, False, None), operands[3], out=out)
        return _bias_act(y, b, name in _RELU_CLIP, out, _RELU_CLIP.get(name, math.inf))

    return fused_or_split(tag(name, *operands, attrs=values), lambda: run(name, _CONV_ATTRS, values, operands, out), split, like=x)


_RELU_CLIP = {"conv_bias_relu": math.inf, "conv_bias_relu6": 6.0}


def _bias_act(y: Any, b: Any, relu: bool, out: Any, upper_clip: float = math.inf) -> Any:
    """``[relu](y + b)`` per channel as a pointwise graph (the bias in float32, as the fused graphs
    take it; the ReLU clipped above at ``upper_clip``)."""
    b32 = adapter_for(b).astype(b, "float32")
    if relu:
        return call("channel_scale_shift_relu", y, affine_identity(y)[0], b32, out=out, **clip_attrs(upper_clip))
    return call("channel_shift", y, b32, out=out)


def conv2d(x: Any, w: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, groups: int = 1, out: Any = None) -> Any:
    """``conv2d(x, w)`` (cross-correlation, as in PyTorch) as a cuDNN graph."""
    return run("conv", _CONV_ATTRS, (padding, stride, dilation, groups), (x, w), out)


_CONVT_ATTRS = ("padding", "stride", "dilation", "output_padding", "groups")


def conv_transpose_bias_relu(
    x: Any, w: Any, b: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, output_padding: Any = 0, groups: int = 1,
    out: Any = None,
) -> Any:
    """``relu(conv_transpose2d(x, w) + b)``: cuDNN dgrad as the forward op. w: (C_in, C_out, R, S)."""
    return _conv_transpose(True, x, w, b, (padding, stride, dilation, output_padding, groups), out)


def conv_transpose_bias(
    x: Any, w: Any, b: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, output_padding: Any = 0, groups: int = 1,
    out: Any = None,
) -> Any:
    """``conv_transpose2d(x, w) + b`` as one cuDNN graph. w: (C_in, C_out, R, S)."""
    return _conv_transpose(False, x, w, b, (padding, stride, dilation, output_padding, groups), out)


def conv_transpose_bias_act(
    x: Any, w: Any, b: Any, *, activation: str = "relu", alpha: float = 0.0, padding: Any = 0, stride: Any = 1, dilation: Any = 1,
    output_padding: Any = 0, groups: int = 1, out: Any = None,
) -> Any:
    """``act(conv_transpose2d(x, w) + b)`` (``activation`` one of fusekit.patterns.ACTIVATIONS, ``alpha`` its
    parameter) as one cuDNN graph, or the dgrad then one pointwise graph where that measures faster or
    cuDNN refuses the fusion. w: (C_in, C_out, R, S)."""
    values = (padding, stride, dilation, output_padding, groups)

    def split() -> Any:
        y = call("conv_dgrad", x, w, **dict(zip(_CONVT_ATTRS, values)))
        b32 = adapter_for(b).astype(b, "float32")
        return call("channel_scale_shift_act", y, affine_identity(y)[0], b32, out=out, activation=activation, alpha=float(alpha))

    attrs = values + (activation, float(alpha))
    names = _CONVT_ATTRS + ("activation", "alpha")
    return fused_or_split(tag("conv_transpose_bias_act", x, w, b, attrs=attrs), lambda: run("conv_transpose_bias_act", names, attrs, (x, w, b), out),
                          split, like=x)


def _conv_transpose(relu: bool, x: Any, w: Any, b: Any, values: tuple, out: Any) -> Any:
    name = "conv_transpose_bias_relu" if relu else "conv_transpose_bias"
    attrs = dict(zip(_CONVT_ATTRS, values))

    def split() -> Any:  # dgrad alone, then bias (and ReLU) as a pointwise graph
        return _bias_act(call("conv_dgrad", x, w, **attrs), b, relu, out)

    def split_nchw() -> Any:  # the dgrad writes NCHW; the pointwise graph reads it and writes channels-last
        y = call("conv_dgrad", x, w, out=empty_as(x, convt_shape(x, w, values), "NCHW"), **attrs)
        return _bias_act(y, b, relu, empty_as(x, y.shape, "NHWC"))

    alt = split
    if out is None and few_channels_last(x, int(w.shape[1]) * int(values[4])):
        alt = lambda: fused_or_split(  # noqa: E731
            tag(name + "_split_nchw", x, w, attrs=values), split, split_nchw, like=x, instead="with its dgrad writing NCHW"
        )
    return fused_or_split(tag(name, x, w, attrs=values), lambda: run(name, _CONVT_ATTRS, values, (x, w, b), out), alt, like=x)


def convt_shape(x: Any, w: Any, values: tuple) -> tuple[int, ...]:
    """(N, C_out, H, W) of ``conv_transpose2d(x, w)`` with (padding, stride, dilation, output_padding, groups)
    ``values``: the conv_dgrad pattern's own shape inference (remembered per shapes and values: a hot path)."""
    vals = tuple(tuple(v) if isinstance(v, list) else v for v in values)
    return _dgrad_shape(tuple(int(d) for d in x.shape), tuple(int(d) for d in w.shape), vals)


@functools.lru_cache(maxsize=256)
def _dgrad_shape(dy: tuple, w: tuple, values: tuple) -> tuple[int, ...]:
    pat = get_pattern("conv_dgrad")
    return tuple(pat.infer_shapes({"dy": dy, "w": w}, dict(pat.normalize_attrs(dict(zip(_CONVT_ATTRS, values)))))["dx"])


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if not hasattr(v, "__len__") else (int(v[0]), int(v[1]))


def _output_padding(x_hw: Sequence[int], dy_hw: Sequence[int], k_hw: Sequence[int], padding, stride, dilation) -> tuple[int, int]:
    """Rows/columns of x that a strided convolution never read (what dgrad must add back)."""
    p, s, d = _pair(padding), _pair(stride), _pair(dilation)
    return tuple(int(x_hw[i]) - ((int(dy_hw[i]) - 1) * s[i] - 2 * p[i] + d[i] * (int(k_hw[i]) - 1) + 1) for i in range(2))  # type: ignore[return-value]


def conv_grads(dz, x, w, padding, stride, dilation, groups, need_dx, need_dw, input_relu, input_clip=math.inf):
    conv = dict(padding=padding, stride=stride, dilation=dilation, groups=groups)
    dx = dw = None
    if need_dx:
        op = _output_padding(x.shape[2:], dz.shape[2:], w.shape[2:], padding, stride, dilation)
        if input_relu:
            clip = clip_attrs(input_clip)
            dx = fused_or_split(
                tag("conv_dgrad_drelu", dz, w, x, attrs=(op, padding, stride, dilation, groups, *clip.values())),
                lambda: call("conv_dgrad_drelu", dz, w, x, output_padding=op, **conv, **clip),
                lambda: call("relu_backward", call("conv_dgrad", dz, w, output_padding=op, **conv), x, **clip),
                like=dz,
            )
        else:
            dx = _dgrad(dz, w, tuple(x.shape), op, conv)
    if need_dw:
        dw = _wgrad(x, dz, tuple(w.shape[2:]), conv)
    return dx, dw


def _dgrad(dz: Any, w: Any, x_shape: tuple, output_padding: tuple, conv: dict) -> Any:
    """conv_dgrad of ``dz``; a channels-last result of few channels also times a route that writes
    it NCHW and copies it to channels-last (see few_channels_last)."""
    direct = lambda: call("conv_dgrad", dz, w, output_padding=output_padding, **conv)  # noqa: E731
    if not few_channels_last(dz, int(x_shape[1])):
        return direct()

    def via_nchw() -> Any:
        y = call("conv_dgrad", dz, w, output_padding=output_padding, out=empty_as(dz, x_shape, "NCHW"), **conv)
        return adapter_for(y).relayout(y, "NHWC")

    return fused_or_split(
        tag("conv_dgrad_via_nchw", dz, w, attrs=(x_shape, output_padding, *conv.values())), direct, via_nchw, like=dz,
        instead="writing NCHW, then a channels-last copy",
    )


def _wgrad(x: Any, dz: Any, kernel: tuple, conv: dict) -> Any:
    """conv_wgrad with image ``x``; a channels-last image of few channels also times a route through
    an NCHW copy of it (see few_channels_last)."""
    direct = lambda: call("conv_wgrad", x, dz, kernel=kernel, **conv)  # noqa: E731
    if not few_channels_last(x):
        return direct()
    via_nchw = lambda: call("conv_wgrad", adapter_for(x).relayout(x, "NCHW"), dz, kernel=kernel, **conv)  # noqa: E731
    return fused_or_split(
        tag("conv_wgrad_via_nchw", x, dz, attrs=(kernel, *conv.values())), direct, via_nchw, like=x,
        instead="on an NCHW copy of the image",
    )


def relu_backward(dy: Any, y: Any, *, upper_clip: float = math.inf) -> Any:
    """``dy * (0 < y < upper_clip)``, y the ReLU's output (or input); ``upper_clip=6`` for ReLU6."""
    return call("relu_backward", dy, y, **clip_attrs(upper_clip))


def conv_bias_relu_backward(
    dy: Any, x: Any, w: Any, y: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, groups: int = 1,
    needs: Sequence[bool] = (True, True, True), input_relu: bool = False, upper_clip: float = math.inf,
    input_clip: float = math.inf,
) -> tuple[Any, Any, Any]:
    """(dx, dw, db) of ``y = relu(conv2d(x, w) + b)`` (the ReLU clipped at ``upper_clip``: 6 for
    :func:`conv_bias_relu6`); saved: x, w, y.

    ``input_relu``: x is the output of a ReLU (clipped at ``input_clip``); dx then also carries that
    ReLU's backward (the fused dgrad + dReLU graph), so the caller skips it."""
    need_dx, need_dw, need_db = needs
    dz, db = relu_bias_grad(dy, y, need_db, upper_clip)
    dx, dw = conv_grads(dz, x, w, padding, stride, dilation, groups, need_dx, need_dw, input_relu, input_clip)
    return dx, dw, cast_like(db, dy)


def conv_bias_backward(
    dy: Any, x: Any, w: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, groups: int = 1,
    needs: Sequence[bool] = (True, True, True), input_relu: bool = False, input_clip: float = math.inf,
) -> tuple[Any, Any, Any]:
    """(dx, dw, db) of ``y = conv2d(x, w) + b``; saved: x, w."""
    need_dx, need_dw, need_db = needs
    db = bias_grad(dy) if need_db else None
    dx, dw = conv_grads(dy, x, w, padding, stride, dilation, groups, need_dx, need_dw, input_relu, input_clip)
    return dx, dw, cast_like(db, dy)


def conv2d_backward(
    dy: Any, x: Any, w: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, groups: int = 1,
    needs: Sequence[bool] = (True, True), input_relu: bool = False, input_clip: float = math.inf,
) -> tuple[Any, Any]:
    """(dx, dw) of ``y = conv2d(x, w)``; saved: x, w."""
    return conv_grads(dy, x, w, padding, stride, dilation, groups, needs[0], needs[1], input_relu, input_clip)


def conv_transpose_bias_relu_backward(
    dy: Any, x: Any, w: Any, y: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, groups: int = 1,
    needs: Sequence[bool] = (True, True, True), relu: bool = True,
) -> tuple[Any, Any, Any]:
    """(dx, dw, db) of ``y = [relu](conv_transpose2d(x, w) + b)``: dx is a forward convolution of
    dz with w, dw is wgrad with the roles of image and gradient swapped; saved: x, w, y."""
    need_dx, need_dw, need_db = needs
    conv = dict(padding=padding, stride=stride, dilation=dilation, groups=groups)
    if relu:
        dz, db = relu_bias_grad(dy, y, need_db)
    else:
        dz, db = dy, (bias_grad(dy) if need_db else None)
    dx = call("conv", dz, w, **conv) if need_dx else None
    dw = _wgrad(dz, x, tuple(w.shape[2:]), conv) if need_dw else None
    return dx, dw, cast_like(db, dy)


def conv_bias_add_relu(x: Any, w: Any, b: Any, z: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, groups: int = 1, out: Any = None) -> Any:
    """``relu(conv2d(x, w) + b + z)``: a residual block's tail in one cuDNN graph."""
    return _conv_epilogue("conv_bias_add_relu", (x, w, b, z), (padding, stride, dilation, groups), out)


def conv_genstats(x: Any, w: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, groups: int = 1) -> tuple[Any, Any, Any]:
    """(y, sum, sq_sum): a training convolution that also emits the per-channel sums of its output
    the next batch norm needs (cuDNN genstats), in one graph."""
    return run("conv_genstats", _CONV_ATTRS, (padding, stride, dilation, groups), (x, w), None, None)
