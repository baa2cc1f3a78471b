"""PyTorch integration: autograd Functions over fusekit's fused forward and backward graphs, and
drop-in modules (subclasses of torch.nn.Conv2d / ConvTranspose2d / Linear, so initialization and
state dicts are PyTorch's own).

    import fusekit.torch as ft
    model = torch.nn.Sequential(ft.Conv2d(3, 16, 3, stride=2, padding=1, activation="relu"), ...)
    model = model.cuda().to(memory_format=torch.channels_last)
"""

from __future__ import annotations

from typing import Any

from .errors import import_or_explain

torch = import_or_explain("torch", "fusekit.torch", "fusekit[torch]", "PyTorch")

from . import ops
from .ops import pool
from .errors import OperandError


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` dense in ``ref``'s memory format (autograd may hand over strided gradients)."""
    if ref.dim() == 4 and ref.is_contiguous(memory_format=torch.channels_last) and not ref.is_contiguous():
        return t.contiguous(memory_format=torch.channels_last)
    return t.contiguous()


class ConvBiasAct(torch.autograd.Function):
    """y = act(conv2d(x, w) + b), act in {None, "relu"}: one cuDNN graph forward, fused graphs backward."""

    @staticmethod
    def forward(ctx: Any, x, w, b, padding, stride, dilation, act):  # type: ignore[override]
        w = _like(w, x)
        kw = dict(padding=padding, stride=stride, dilation=dilation)
        y = ops.conv_bias_relu(x, w, b, **kw) if act == "relu" else ops.conv_bias(x, w, b, **kw)
        ctx.save_for_backward(x, w, y if act == "relu" else None)
        ctx.kw, ctx.act = kw, act
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        x, w, y = ctx.saved_tensors
        dy = _like(dy, x)
        needs = ctx.needs_input_grad[:3]
        if ctx.act == "relu":
            dx, dw, db = ops.conv_bias_relu_backward(dy, x, w, y, needs=needs, **ctx.kw)
        else:
            dx, dw, db = ops.conv_bias_backward(dy, x, w, needs=needs, **ctx.kw)
        return dx, dw, db, None, None, None, None


class ConvTransposeBiasAct(torch.autograd.Function):
    """y = act(conv_transpose2d(x, w) + b): cuDNN dgrad as the forward op; backward by conv fprop and wgrad."""

    @staticmethod
    def forward(ctx: Any, x, w, b, padding, stride, dilation, output_padding, act):  # type: ignore[override]
        w = _like(w, x)
        kw = dict(padding=padding, stride=stride, dilation=dilation)
        f = ops.conv_transpose_bias_relu if act == "relu" else ops.conv_transpose_bias
        y = f(x, w, b, output_padding=output_padding, **kw)
        ctx.save_for_backward(x, w, y if act == "relu" else None)
        ctx.kw, ctx.act = kw, act
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        x, w, y = ctx.saved_tensors
        dy = _like(dy, x)
        dx, dw, db = ops.conv_transpose_bias_relu_backward(
            dy, x, w, y, needs=ctx.needs_input_grad[:3], relu=ctx.act == "relu", **ctx.kw
        )
        return dx, dw, db, None, None, None, None, None


class LinearBiasAct(torch.autograd.Function):
    """y = act(x @ w.T + b) as one cuDNN graph (matmul + epilogue); backward by fused graphs."""

    @staticmethod
    def forward(ctx: Any, x, w, b, act):  # type: ignore[override]
        x, w = x.contiguous(), w.contiguous()
        y = ops.linear_bias_relu(x, w, b) if act == "relu" else ops.linear_bias(x, w, b)
        ctx.save_for_backward(x, w, y if act == "relu" else None)
        ctx.act = act
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        x, w, y = ctx.saved_tensors
        dy = dy.contiguous()
        needs = ctx.needs_input_grad[:3]
        if ctx.act == "relu":
            dx, dw, db = ops.linear_bias_relu_backward(dy, x, w, y, needs=needs)
        else:
            dx, dw, db = ops.linear_bias_backward(dy, x, w, needs=needs)
        return dx, dw, db, None


def _check_act(act: str | None) -> str | None:
    if act not in (None, "relu"):
        raise OperandError("fusekit.torch", "activation", f"expected None or 'relu', got {act!r}")
    return act


class Conv2d(torch.nn.Conv2d):
    """torch.nn.Conv2d run as a fused cuDNN graph, with an optional fused ReLU (``activation="relu"``)."""

    def __init__(self, *args: Any, activation: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.activation = _check_act(activation)
        if self.groups != 1 or self.padding_mode != "zeros" or self.bias is None or isinstance(self.padding, str):
            raise OperandError("fusekit.torch.Conv2d", "arguments", "supports groups=1, zero numeric padding and bias=True")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return ConvBiasAct.apply(x, self.weight, self.bias, self.padding, self.stride, self.dilation, self.activation)


class ConvTranspose2d(torch.nn.ConvTranspose2d):
    """torch.nn.ConvTranspose2d as cuDNN dgrad-as-forward, with an optional fused ReLU."""

    def __init__(self, *args: Any, activation: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.activation = _check_act(activation)
        if self.groups != 1 or self.bias is None:
            raise OperandError("fusekit.torch.ConvTranspose2d", "arguments", "supports groups=1 and bias=True")

    def forward(self, x: torch.Tensor, output_size: Any = None) -> torch.Tensor:  # type: ignore[override]
        if output_size is not None:
            raise OperandError("fusekit.torch.ConvTranspose2d", "output_size", "give output_padding at construction instead")
        return ConvTransposeBiasAct.apply(
            x, self.weight, self.bias, self.padding, self.stride, self.dilation, self.output_padding, self.activation
        )


class Linear(torch.nn.Linear):
    """torch.nn.Linear as a fused cuDNN matmul graph, with an optional fused ReLU."""

    def __init__(self, *args: Any, activation: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.activation = _check_act(activation)
        if self.bias is None:
            raise OperandError("fusekit.torch.Linear", "bias", "supports bias=True")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return LinearBiasAct.apply(x, self.weight, self.bias, self.activation)


class BatchNormAct(torch.autograd.Function):
    """Training batch norm (+ ReLU): one cuDNN graph forward (running stats updated in place of the
    module's buffers), the BN backward (with the dReLU fused in front) as one graph."""

    @staticmethod
    def forward(ctx: Any, x, gamma, beta, running_mean, running_var, eps, momentum, relu):  # type: ignore[override]
        if running_mean is not None:
            y, mean, inv, rm, rv = ops.batchnorm(x, gamma, beta, running_mean, running_var, epsilon=eps, momentum=momentum, relu=relu)
            running_mean.copy_(rm)
            running_var.copy_(rv)
        else:
            y, mean, inv = ops.batchnorm(x, gamma, beta, epsilon=eps, relu=relu)
        ctx.save_for_backward(x, gamma, mean, inv, y if relu else None)
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        x, gamma, mean, inv, y = ctx.saved_tensors
        dx, dg, db = ops.batchnorm_backward(_like(dy, x), x, gamma, mean, inv, y=y, needs=ctx.needs_input_grad[:3])
        return dx, dg, db, None, None, None, None, None


class BatchNorm2d(torch.nn.BatchNorm2d):
    """torch.nn.BatchNorm2d on cuDNN graphs (train: fused BN [+ ReLU]; eval: inference BN [+ ReLU]).
    ``affine=False`` runs normalize only; gamma/beta gradients are then neither made nor stored."""

    def __init__(self, *args: Any, activation: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.activation = _check_act(activation)

    def _identity(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ones, zeros, _ = ops.affine_identity(x)
        return ones, zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        relu = self.activation == "relu"
        gamma, beta = (self.weight, self.bias) if self.affine else self._identity(x)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if self.training or not self.track_running_stats:
            use_running = self.training and self.track_running_stats
            momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            return BatchNormAct.apply(
                x, gamma, beta, self.running_mean if use_running else None, self.running_var if use_running else None,
                self.eps, momentum, relu,
            )
        return ops.batchnorm_inference(x, self.running_mean, ops.inv_std(self.running_var, self.eps), gamma.detach(), beta.detach(), relu=relu)


class ScaleShiftAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, gamma, beta, relu):  # type: ignore[override]
        y = ops.channel_scale_shift(x, gamma, beta, relu=relu)
        ctx.save_for_backward(x, gamma, y if relu else None)
        ctx.has = (gamma is not None, beta is not None)
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        x, gamma, y = ctx.saved_tensors
        n = ctx.needs_input_grad
        dx, dg, db = ops.channel_scale_shift_backward(_like(dy, x), x, gamma, y=y, needs=(n[0], ctx.has[0] and n[1], ctx.has[1] and n[2]))
        return dx, dg, db, None


class ChannelScaleShift(torch.nn.Module):
    """y = x * gamma + beta per channel (``scale``/``shift`` choose which exist), optional fused ReLU."""

    def __init__(self, num_features: int, scale: bool = True, shift: bool = True, activation: str | None = None, device: Any = None) -> None:
        super().__init__()
        self.activation = _check_act(activation)
        if not (scale or shift) or (self.activation and not (scale and shift)):
            raise OperandError("fusekit.torch.ChannelScaleShift", "scale", "needs a scale or a shift, and both for a fused ReLU")
        self.weight = torch.nn.Parameter(torch.ones(num_features, device=device)) if scale else None
        self.bias = torch.nn.Parameter(torch.zeros(num_features, device=device)) if shift else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return ScaleShiftAct.apply(x, self.weight, self.bias, self.activation == "relu")


class _MaxPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, kernel_size, stride, padding):  # type: ignore[override]
        y, argmax = pool.max_pool2d(x, kernel_size, stride, padding)
        ctx.save_for_backward(argmax)
        ctx.shape = tuple(x.shape)
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        (argmax,) = ctx.saved_tensors
        return pool.max_pool2d_backward(_like(dy, argmax), argmax, ctx.shape), None, None, None


class MaxPool2d(torch.nn.Module):
    """Max pooling through fusekit's CuPy kernel (int32 argmax saved for the backward)."""

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _MaxPool.apply(x, self.kernel_size, self.stride, self.padding)


class _AvgPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, kernel_size, stride, padding, count_include_pad):  # type: ignore[override]
        ctx.args, ctx.shape, ctx.cip = (kernel_size, stride, padding), tuple(x.shape), count_include_pad
        return pool.avg_pool2d(x, kernel_size, stride, padding, count_include_pad)

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        return pool.avg_pool2d_backward(dy.contiguous(), ctx.shape, *ctx.args, count_include_pad=ctx.cip), None, None, None, None


class AvgPool2d(torch.nn.Module):
    """Average pooling through fusekit's CuPy kernel (PyTorch semantics)."""

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0, count_include_pad: bool = True) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding, self.count_include_pad = kernel_size, stride, padding, count_include_pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _AvgPool.apply(x, self.kernel_size, self.stride, self.padding, self.count_include_pad)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, axis, log):  # type: ignore[override]
        y = (pool.log_softmax if log else pool.softmax)(x, axis)
        ctx.save_for_backward(y)
        ctx.axis, ctx.log = axis, log
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        f = pool.log_softmax_backward if ctx.log else pool.softmax_backward
        return f(_like(dy, y), y, ctx.axis), None, None


class Softmax(torch.nn.Module):
    """Softmax (``log=True``: log-softmax) over ``dim``; the backward reads the output, not the input."""

    def __init__(self, dim: int = 1, log: bool = False) -> None:
        super().__init__()
        self.dim, self.log = dim, log

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _Softmax.apply(x, self.dim, self.log)
