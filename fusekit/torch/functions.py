"""The autograd Functions under fusekit.torch's modules: each forward and backward is one or a few
fused fusekit graphs."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..dispatch import taped
from ..ops.common import clip_attrs
from . import common
from .common import _clip, _f32, _like, _mark_relu_done, _relu_done, _zero_bias

def conv_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kw: dict, act: str | None) -> torch.Tensor:
    """act(conv2d(x, w) [+ b]) (act None, "relu" or "relu6") as one fusekit graph; w already in x's
    layout (a ReLU without ``b`` runs the bias graph with a zero bias: :func:`conv_bias_of`)."""
    b = conv_bias_of(b, w, x, act)
    if b is None:
        return common.ops.conv2d(x, w, **kw)
    f = common.ops.conv_bias if _clip(act) is None else common.ops.conv_bias_relu6 if act == "relu6" else common.ops.conv_bias_relu
    return f(x, w, b, **kw)


def conv_bias_of(b: torch.Tensor | None, w: torch.Tensor, x: torch.Tensor, act: str | None) -> torch.Tensor | None:
    """The bias :func:`conv_forward` takes: ``b``, or a zero bias where a ReLU needs the bias graph."""
    return b if b is not None or _clip(act) is None else _zero_bias(int(w.shape[0]), x)


def conv_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor | None, kw: dict, clip: float | None,
                  has_bias: bool, needs: tuple[bool, bool, bool], input_clip: float | None = None) -> tuple[Any, Any, Any]:
    """(dx, dw, db) of :func:`conv_forward` (None where ``needs`` says no): the ReLU's mask from y
    (where ``clip`` is not None and ``y`` given) fused into the backward graphs; ``input_clip``: x is
    the output of a ReLU used only here, whose mask dx then carries too (the dgrad + dReLU graph)."""
    fed = input_clip is not None
    needs, kw = (needs[0], needs[1], needs[2] and has_bias), dict(kw, input_relu=fed, input_clip=input_clip if fed else math.inf)
    if clip is not None and y is not None:
        return common.ops.conv_bias_relu_backward(dy, x, w, y, needs=needs, upper_clip=clip, **kw)
    if has_bias:
        return common.ops.conv_bias_backward(dy, x, w, needs=needs, **kw)
    dx, dw = common.ops.conv2d_backward(dy, x, w, needs=needs[:2], **kw)
    return dx, dw, None


class ConvBiasAct(torch.autograd.Function):
    """y = act(conv2d(x, w) [+ b]), act in {None, "relu", "relu6"}: one cuDNN graph forward, fused
    graphs backward. ``b`` None: the plain conv graph (a zero bias when the ReLU is fused), no bias
    gradient. ``input_clip``: x is the output of a ReLU (upper clip: inf, or 6 for ReLU6) used only
    here; dx then carries that ReLU's backward (the dgrad + dReLU graph)."""

    @staticmethod
    def forward(ctx: Any, x, w, b, padding, stride, dilation, groups, act, input_clip=None):  # type: ignore[override]
        w = _like(w, x)
        kw = {"padding": padding, "stride": stride, "dilation": dilation, "groups": groups}
        clip = _clip(act)
        args = (x, w, conv_bias_of(b, w, x, act))
        y = taped(("conv_forward", act, b is None, padding, stride, dilation, groups), lambda: conv_forward(*args, kw, act), args)
        ctx.save_for_backward(x, w, y if clip is not None else None)
        ctx.kw, ctx.clip, ctx.has_bias = kw, clip, b is not None
        ctx.input_clip = input_clip
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        x, w, y = ctx.saved_tensors
        relu = ctx.clip is not None and not _relu_done(dy, y)  # a consumer's dgrad may have applied this ReLU's mask
        dy = _like(dy, x)
        needs = tuple(ctx.needs_input_grad[:3])
        key = ("conv_backward", relu, ctx.has_bias, needs, ctx.clip, ctx.input_clip, *ctx.kw.values())
        dx, dw, db = taped(key, lambda: conv_backward(dy, x, w, y if relu else None, ctx.kw, ctx.clip, ctx.has_bias, needs, ctx.input_clip),
                           (dy, x, w, y if relu else None))
        if dx is not None and ctx.input_clip is not None:
            _mark_relu_done(dx, x)
        return dx, dw, db, None, None, None, None, None, None


class ConvTransposeBiasAct(torch.autograd.Function):
    """y = act(conv_transpose2d(x, w) [+ b]): cuDNN dgrad as the forward op; backward by conv fprop and wgrad."""

    @staticmethod
    def forward(ctx: Any, x, w, b, padding, stride, dilation, output_padding, groups, act):  # type: ignore[override]
        w = _like(w, x)
        kw = {"padding": padding, "stride": stride, "dilation": dilation, "groups": groups}
        relu = act == "relu"
        bias = b if b is not None else _zero_bias(int(w.shape[1]) * groups, x)
        f = common.ops.conv_transpose_bias_relu if relu else common.ops.conv_transpose_bias
        y = f(x, w, bias, output_padding=output_padding, **kw)
        ctx.save_for_backward(x, w, y if relu else None)
        ctx.kw, ctx.relu, ctx.has_bias = kw, relu, b is not None
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        x, w, y = ctx.saved_tensors
        dy = _like(dy, x)
        nx, nw, nb = ctx.needs_input_grad[:3]
        dx, dw, db = common.ops.conv_transpose_bias_relu_backward(
            dy, x, w, y, needs=(nx, nw, nb and ctx.has_bias), relu=ctx.relu, **ctx.kw
        )
        return dx, dw, db, None, None, None, None, None, None


class LinearBiasAct(torch.autograd.Function):
    """y = act(x @ w.T [+ b]) as one cuDNN graph (matmul + epilogue) for a dense (rows, features) x;
    backward by fused graphs. ``b`` None runs the same graph with a zero bias (no weight transpose
    copy, as the plain matmul pattern would need), and makes no bias gradient."""

    @staticmethod
    def forward(ctx: Any, x, w, b, act):  # type: ignore[override]
        w = w.contiguous()
        relu = act == "relu"
        bias = b if b is not None else _zero_bias(int(w.shape[0]), x)
        y = common.ops.linear_bias_relu(x, w, bias) if relu else common.ops.linear_bias(x, w, bias)
        ctx.save_for_backward(x, w, y if relu else None)
        ctx.relu, ctx.has_bias = relu, b is not None
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        x, w, y = ctx.saved_tensors
        dy = dy.contiguous()
        nx, nw, nb = ctx.needs_input_grad[:3]
        needs = (nx, nw, nb and ctx.has_bias)
        if ctx.relu:
            dx, dw, db = common.ops.linear_bias_relu_backward(dy, x, w, y, needs=needs)
        else:
            dx, dw, db = common.ops.linear_bias_backward(dy, x, w, needs=needs)
        return dx, dw, db, None


def bn_forward(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
               eps: float, momentum: float, clip: float | None, residual: torch.Tensor | None = None) -> tuple[Any, ...]:
    """Training batch norm [+ residual] [+ ReLU clipped at ``clip``] as one fusekit graph (gamma, beta
    and the running stats float32): (y, mean, inv_std[, new running mean, new running var])."""
    relu = dict(relu=clip is not None, upper_clip=math.inf if clip is None else clip, residual=residual)
    if running_mean is None:
        return common.ops.batchnorm(x, gamma, beta, epsilon=eps, **relu)
    return common.ops.batchnorm(x, gamma, beta, running_mean, running_var, epsilon=eps, momentum=momentum, **relu)


def bn_backward(dy: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, mean: torch.Tensor, inv: torch.Tensor, y: torch.Tensor | None,
                needs: tuple[bool, bool, bool], clip: float) -> tuple[Any, Any, Any]:
    """(dx, dgamma, dbeta) of :func:`bn_forward` as one graph, the ReLU's mask from ``y`` in front (y None: no ReLU)."""
    return common.ops.batchnorm_backward(dy, x, gamma, mean, inv, y=y, needs=needs, upper_clip=clip)


class BatchNormAct(torch.autograd.Function):
    """Training batch norm (+ ReLU with ``act`` "relu" or "relu6"): one cuDNN graph forward, the BN
    backward (with the dReLU fused in front) as one graph. gamma and beta are float32; running stats
    of any dtype are updated in place (computed in float32, written back in their own dtype)."""

    @staticmethod
    def forward(ctx: Any, x, gamma, beta, running_mean, running_var, eps, momentum, act, residual=None):  # type: ignore[override]
        clip = _clip(act)
        key = ("batchnorm", eps, momentum, clip)
        if running_mean is not None:
            args = (x, gamma, beta, _f32(running_mean), _f32(running_var), residual)
            y, mean, inv, rm, rv = taped(key, lambda: bn_forward(*args[:5], eps, momentum, clip, residual), args)
            torch._foreach_copy_([running_mean, running_var], [rm, rv])  # one launch for both
        else:
            y, mean, inv = taped(key, lambda: bn_forward(x, gamma, beta, None, None, eps, momentum, clip, residual), (x, gamma, beta, residual))
        ctx.save_for_backward(x, gamma, mean, inv, y if clip is not None else None)
        ctx.clip, ctx.residual = math.inf if clip is None else clip, residual is not None
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        x, gamma, mean, inv, y = ctx.saved_tensors
        dy, needs = _like(dy, x), ctx.needs_input_grad[:3]
        if _relu_done(dy, y):  # the consuming conv's dgrad applied the ReLU's mask
            y = None
        args = (dy, x, gamma, mean, inv, y)
        if ctx.residual and y is not None:  # relu(bn(x) + residual): dReLU, the residual's gradient and the BN backward in one graph
            dx, dg, db, dz = taped(("batchnorm_add_relu_backward", needs),
                                   lambda: common.ops.batchnorm_backward(dy, x, gamma, mean, inv, y=y, needs=needs, residual=True), args)
        else:
            dx, dg, db = taped(("batchnorm_backward", needs, ctx.clip), lambda: bn_backward(*args, needs, ctx.clip), args)
            dz = dy if ctx.residual else None
        return dx, dg, db, None, None, None, None, None, dz


class _AddReLU(torch.autograd.Function):
    """relu(a + b) as one pointwise graph; both get the gradient dy * (y > 0)."""

    @staticmethod
    def forward(ctx: Any, a, b):  # type: ignore[override]
        y = common.ops.call("add_relu", a, _like(b, a))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        dz = dy if _relu_done(dy, y) else common.ops.relu_backward(_like(dy, y), y)
        return dz, dz


class ScaleShiftAct(torch.autograd.Function):
    """y = act(x * gamma + beta) per channel (gamma, beta float32 (C,), either may be None; act None,
    "relu" or "relu6")."""

    @staticmethod
    def forward(ctx: Any, x, gamma, beta, act):  # type: ignore[override]
        clip = _clip(act)
        ctx.clip = math.inf if clip is None else clip
        y = common.ops.channel_scale_shift(x, gamma, beta, relu=clip is not None, upper_clip=ctx.clip)
        ctx.save_for_backward(x, gamma, y if clip is not None else None)
        ctx.has = (gamma is not None, beta is not None)
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        x, gamma, y = ctx.saved_tensors
        n = ctx.needs_input_grad
        dx, dg, db = common.ops.channel_scale_shift_backward(
            _like(dy, x), x, gamma, y=y, needs=(n[0], ctx.has[0] and n[1], ctx.has[1] and n[2]), upper_clip=ctx.clip
        )
        return dx, dg, db, None


class _ReLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, inplace, clip):  # type: ignore[override]
        clip_kw = clip_attrs(clip)
        if inplace:
            common.ops.call("relu", x, out=x, **clip_kw)
            ctx.mark_dirty(x)
            y = x
        else:
            y = common.ops.call("relu", x, **clip_kw)
        ctx.save_for_backward(y)
        ctx.clip = clip
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        if _relu_done(dy, y):
            return dy, None, None
        return common.ops.relu_backward(_like(dy, y), y, upper_clip=ctx.clip), None, None


class _MaxPool(torch.autograd.Function):
    """(y, argmax): max pooling and its int32 argmax (not differentiable), which the backward scatters through."""

    @staticmethod
    def forward(ctx: Any, x, kernel_size, stride, padding, ceil_mode, dilation):  # type: ignore[override]
        y, argmax = common.pool.max_pool2d(x, kernel_size, stride, padding, ceil_mode=ceil_mode, dilation=dilation)
        ctx.save_for_backward(argmax)
        ctx.mark_non_differentiable(argmax)
        ctx.shape = tuple(x.shape)
        return y, argmax

    @staticmethod
    def backward(ctx: Any, dy, _):  # type: ignore[override]
        (argmax,) = ctx.saved_tensors
        return common.pool.max_pool2d_backward(_like(dy, argmax), argmax, ctx.shape), None, None, None, None, None


class _AvgPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, kernel_size, stride, padding, count_include_pad, ceil_mode, divisor_override):  # type: ignore[override]
        ctx.args, ctx.shape = (kernel_size, stride, padding), tuple(x.shape)
        ctx.kw = dict(count_include_pad=count_include_pad, ceil_mode=ceil_mode, divisor_override=divisor_override)
        return common.pool.avg_pool2d(x, kernel_size, stride, padding, **ctx.kw)

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        return common.pool.avg_pool2d_backward(dy.contiguous(), ctx.shape, *ctx.args, **ctx.kw), None, None, None, None, None, None


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, axis, log):  # type: ignore[override]
        y = (common.pool.log_softmax if log else common.pool.softmax)(x, axis)
        ctx.save_for_backward(y)
        ctx.axis, ctx.log = axis, log
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        f = common.pool.log_softmax_backward if ctx.log else common.pool.softmax_backward
        return f(_like(dy, y), y, ctx.axis), None, None


