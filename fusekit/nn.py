"""Layers for CuPy users and notebooks: forward / backward on fused cuDNN graphs, parameters with
gradients, SGD and Adam, MSE and cross-entropy losses.

A layer keeps only what the math needs (its parameters and the activations its backward reads);
graphs, plans and workspaces live in fusekit's plan cache. Images are (N, C, H, W) CuPy arrays,
NHWC (channels-last) in memory by default (``fusekit.nhwc`` views an (N, H, W, C) buffer).
The losses and the optimizers' updates are CuPy element-wise kernels (no cuDNN graph needed).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Sequence

from .errors import import_or_explain

cp = import_or_explain("cupy", "fusekit.nn", "fusekit[cu12] (CUDA 12) or fusekit[cu13] (CUDA 13), or use fusekit.torch with PyTorch", "CuPy")

from . import ops
from .ops import pool
from .ops.common import ACTIVATIONS, clip_attrs
from .errors import OperandError
from .tensors import nhwc


class Parameter:
    """A trainable array and its gradient (accumulated by backward, cleared by zero_grad)."""

    def __init__(self, data: cp.ndarray) -> None:
        self.data = data
        self.grad: cp.ndarray | None = None

    def accumulate(self, g: cp.ndarray | None) -> None:
        if g is None:
            return
        g = g.reshape(self.data.shape)
        self.grad = g.copy() if self.grad is None else self.grad + g


def _image(shape: Sequence[int], dtype: Any, layout: str) -> cp.ndarray:
    n, c, h, w = shape
    return nhwc(cp.empty((n, h, w, c), dtype)) if layout == "NHWC" else cp.empty(shape, dtype)


def _as_layout(a: cp.ndarray, like: cp.ndarray) -> cp.ndarray:
    """``a`` dense in ``like``'s memory order (NCHW or NHWC)."""
    if a.ndim != 4:
        return cp.ascontiguousarray(a)
    if like.strides[1] == like.itemsize and like.shape[1] > 1:  # channels-last
        if a.strides[1] == a.itemsize and a.flags.c_contiguous is False and a.transpose(0, 2, 3, 1).flags.c_contiguous:
            return a
        return nhwc(cp.ascontiguousarray(a.transpose(0, 2, 3, 1)))
    return cp.ascontiguousarray(a)


def _uniform(shape: Sequence[int], bound: float, dtype: Any, rng: cp.random.RandomState) -> cp.ndarray:
    return rng.uniform(-bound, bound, size=tuple(shape)).astype(dtype)


class Module:
    training = True

    def forward(self, x: cp.ndarray) -> cp.ndarray:
        raise NotImplementedError

    def backward(self, dy: cp.ndarray) -> cp.ndarray:
        raise NotImplementedError

    def __call__(self, x: cp.ndarray) -> cp.ndarray:
        return self.forward(x)

    def parameters(self) -> list[Parameter]:
        return [v for v in self.__dict__.values() if isinstance(v, Parameter)]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def train(self, mode: bool = True) -> "Module":
        self.training = mode
        return self

    def eval(self) -> "Module":
        return self.train(False)


def _act(activation: str | None, allowed: tuple[str, ...] = ("relu",)) -> str | None:
    if activation is not None and activation not in allowed:
        raise OperandError("fusekit.nn", "activation", f"expected None or {' or '.join(map(repr, allowed))}, got {activation!r}")
    return activation


class Conv2d(Module):
    """2-D convolution + bias (+ ReLU, or ReLU6 with ``activation="relu6"``), one cuDNN graph forward.
    Weight (K, C, R, S) in the layout's order."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0, dilation: int = 1,
        activation: str | None = None, dtype: Any = cp.float32, layout: str = "NHWC", seed: int | None = None,
    ) -> None:
        rng = cp.random.RandomState(seed)
        fan_in = in_channels * kernel_size * kernel_size
        w = _uniform((out_channels, kernel_size, kernel_size, in_channels), 1 / math.sqrt(fan_in), dtype, rng)
        self.weight = Parameter(nhwc(w) if layout == "NHWC" else cp.ascontiguousarray(w.transpose(0, 3, 1, 2)))
        self.bias = Parameter(_uniform((out_channels,), 1 / math.sqrt(fan_in), dtype, rng))
        self.conv = dict(padding=padding, stride=stride, dilation=dilation)
        self.activation = _act(activation, ("relu", "relu6"))
        self._saved: tuple | None = None

    def forward(self, x: cp.ndarray) -> cp.ndarray:
        f = {"relu": ops.conv_bias_relu, "relu6": ops.conv_bias_relu6}.get(self.activation or "", ops.conv_bias)
        y = f(x, self.weight.data, self.bias.data, **self.conv)
        self._saved = (x, y if self.activation else None)
        return y

    def backward(self, dy: cp.ndarray) -> cp.ndarray:
        if self._saved is None:
            raise OperandError("fusekit.nn.Conv2d", "dy", "backward() before forward()")
        x, y = self._saved
        dy = _as_layout(dy, x)
        if self.activation:
            dx, dw, db = ops.conv_bias_relu_backward(dy, x, self.weight.data, y, upper_clip=ACTIVATIONS[self.activation], **self.conv)
        else:
            dx, dw, db = ops.conv_bias_backward(dy, x, self.weight.data, **self.conv)
        self.weight.accumulate(dw)
        self.bias.accumulate(db)
        return dx


class ConvTranspose2d(Module):
    """Transposed convolution + bias (+ ReLU): cuDNN dgrad as the forward op. Weight (C_in, C_out, R, S)."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0,
        output_padding: int = 0, dilation: int = 1, activation: str | None = None, dtype: Any = cp.float32,
        layout: str = "NHWC", seed: int | None = None,
    ) -> None:
        rng = cp.random.RandomState(seed)
        fan_in = out_channels * kernel_size * kernel_size  # as torch.nn.ConvTranspose2d
        w = _uniform((in_channels, kernel_size, kernel_size, out_channels), 1 / math.sqrt(fan_in), dtype, rng)
        self.weight = Parameter(nhwc(w) if layout == "NHWC" else cp.ascontiguousarray(w.transpose(0, 3, 1, 2)))
        self.bias = Parameter(_uniform((out_channels,), 1 / math.sqrt(fan_in), dtype, rng))
        self.conv = dict(padding=padding, stride=stride, dilation=dilation)
        self.output_padding = output_padding
        self.activation = _act(activation)
        self._saved: tuple | None = None

    def forward(self, x: cp.ndarray) -> cp.ndarray:
        f = ops.conv_transpose_bias_relu if self.activation == "relu" else ops.conv_transpose_bias
        y = f(x, self.weight.data, self.bias.data, output_padding=self.output_padding, **self.conv)
        self._saved = (x, y if self.activation else None)
        return y

    def backward(self, dy: cp.ndarray) -> cp.ndarray:
        if self._saved is None:
            raise OperandError("fusekit.nn.ConvTranspose2d", "dy", "backward() before forward()")
        x, y = self._saved
        dy = _as_layout(dy, x)
        dx, dw, db = ops.conv_transpose_bias_relu_backward(dy, x, self.weight.data, y, relu=self.activation == "relu", **self.conv)
        self.weight.accumulate(dw)
        self.bias.accumulate(db)
        return dx


class Linear(Module):
    """y = x @ W.T + b (+ ReLU) as one cuDNN matmul graph; W (out, in) as torch.nn.Linear."""

    def __init__(self, in_features: int, out_features: int, activation: str | None = None, dtype: Any = cp.float32, seed: int | None = None) -> None:
        rng = cp.random.RandomState(seed)
        bound = 1 / math.sqrt(in_features)
        self.weight = Parameter(_uniform((out_features, in_features), bound, dtype, rng))
        self.bias = Parameter(_uniform((out_features,), bound, dtype, rng))
        self.activation = _act(activation)
        self._saved: tuple | None = None

    def forward(self, x: cp.ndarray) -> cp.ndarray:
        x = cp.ascontiguousarray(x)
        f = ops.linear_bias_relu if self.activation == "relu" else ops.linear_bias
        y = f(x, self.weight.data, self.bias.data)
        self._saved = (x, y if self.activation else None)
        return y

    def backward(self, dy: cp.ndarray) -> cp.ndarray:
        if self._saved is None:
            raise OperandError("fusekit.nn.Linear", "dy", "backward() before forward()")
        x, y = self._saved
        dy = cp.ascontiguousarray(dy)
        if self.activation == "relu":
            dx, dw, db = ops.linear_bias_relu_backward(dy, x, self.weight.data, y)
        else:
            dx, dw, db = ops.linear_bias_backward(dy, x, self.weight.data)
        self.weight.accumulate(dw)
        self.bias.accumulate(db)
        return dx


class ReLU(Module):
    """max(x, 0) as a cuDNN pointwise graph; backward by the relu_backward graph."""

    upper_clip = math.inf

    def __init__(self) -> None:
        self._y: cp.ndarray | None = None

    def forward(self, x: cp.ndarray) -> cp.ndarray:
        self._y = ops.call("relu", x, **clip_attrs(self.upper_clip))
        return self._y

    def backward(self, dy: cp.ndarray) -> cp.ndarray:
        if self._y is None:
            raise OperandError(f"fusekit.nn.{type(self).__name__}", "dy", "backward() before forward()")
        return ops.relu_backward(_as_layout(dy, self._y), self._y, upper_clip=self.upper_clip)


class ReLU6(ReLU):
    """min(max(x, 0), 6) (MobileNet's); its backward passes dy where 0 < y < 6, as PyTorch's."""

    upper_clip = ACTIVATIONS["relu6"]


class Flatten(Module):
    """(N, C, H, W) -> (N, C*H*W) in C, H, W order (as torch.nn.Flatten on NCHW)."""

    def __init__(self) -> None:
        self._like: cp.ndarray | None = None

    def forward(self, x: cp.ndarray) -> cp.ndarray:
        self._like = x
        return cp.ascontiguousarray(x).reshape(x.shape[0], -1)

    def backward(self, dy: cp.ndarray) -> cp.ndarray:
        assert self._like is not None
        return _as_layout(dy.reshape(self._like.shape), self._like)


class Sequential(Module):
    """Layers in order. With ``fuse=True`` (default) adjacent normalize -> scale/shift -> ReLU layers
    run as one cuDNN graph (see ``_fuse``); results are the same as running them one by one."""

    def __init__(self, *layers: Module, fuse: bool = True) -> None:
        self.layers = list(layers)
        self.fuse = fuse
        self._plan: list[Module] | None = None

    def _steps(self) -> list[Module]:
        if self._plan is None:
            self._plan = _fuse(self.layers) if self.fuse else list(self.layers)
        return self._plan

    def forward(self, x: cp.ndarray) -> cp.ndarray:
        self._ran = self._steps()
        for layer in self._ran:
            x = layer(x)
        return x

    def backward(self, dy: cp.ndarray) -> cp.ndarray:
        for layer in reversed(self._ran):
            dy = layer.backward(dy)
        return dy

    def parameters(self) -> list[Parameter]:
        return [p for layer in self.layers for p in layer.parameters()]

    def train(self, mode: bool = True) -> "Sequential":
        for layer in self.layers:
            layer.train(mode)
        self.training = mode
        return self

    def __iter__(self) -> Iterator[Module]:
        return iter(self.layers)

    def __getitem__(self, i: int) -> Module:
        return self.layers[i]


class MSELoss:
    """mean((pred - target)^2); backward() gives d loss / d pred."""

    def __call__(self, pred: cp.ndarray, target: cp.ndarray) -> cp.ndarray:
        self._diff = pred.astype(cp.float32) - target.astype(cp.float32)
        self._pred = pred
        return cp.mean(self._diff * self._diff)

    def backward(self) -> cp.ndarray:
        g = (2.0 / self._diff.size) * self._diff
        return _as_layout(g.astype(self._pred.dtype), self._pred)


class CrossEntropyLoss:
    """Mean cross-entropy of logits (B, classes) against integer labels (B,), by a stable log-softmax."""

    def __call__(self, logits: cp.ndarray, labels: cp.ndarray) -> cp.ndarray:
        if logits.ndim != 2 or labels.shape != (logits.shape[0],):
            raise OperandError("fusekit.nn.CrossEntropyLoss", "labels", f"expected logits (B, C) and labels (B,), got {logits.shape} and {labels.shape}")
        z = logits.astype(cp.float32)
        z = z - z.max(axis=1, keepdims=True)
        logp = z - cp.log(cp.exp(z).sum(axis=1, keepdims=True))
        self._p, self._labels, self._dtype = cp.exp(logp), labels, logits.dtype
        return -logp[cp.arange(labels.shape[0]), labels].mean()

    def backward(self) -> cp.ndarray:
        g = self._p.copy()
        g[cp.arange(self._labels.shape[0]), self._labels] -= 1.0
        return (g / self._labels.shape[0]).astype(self._dtype)


class SGD:
    def __init__(self, params: Iterable[Parameter], lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.params, self.lr, self.momentum, self.wd = list(params), lr, momentum, weight_decay
        self._v: dict[int, cp.ndarray] = {}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad + self.wd * p.data if self.wd else p.grad
            if self.momentum:
                v = self._v.get(id(p))
                v = g.copy() if v is None else self.momentum * v + g
                self._v[id(p)] = v
                g = v
            p.data -= self.lr * g.astype(p.data.dtype)


_adam_update = cp.ElementwiseKernel(
    "T g, float32 lr, float32 b1, float32 b2, float32 eps, float32 c1, float32 c2",
    "T p, float32 m, float32 v",
    """
    float gf = (float)g;
    m = b1 * m + (1.0f - b1) * gf;
    v = b2 * v + (1.0f - b2) * gf * gf;
    p = (T)((float)p - lr * (m / c1) / (sqrtf(v / c2) + eps));
    """,
    "fusekit_adam",
)


class Adam:
    def __init__(self, params: Iterable[Parameter], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.params, self.lr, self.betas, self.eps = list(params), lr, betas, eps
        self._state: dict[int, tuple[cp.ndarray, cp.ndarray]] = {}
        self.t = 0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1**self.t, 1 - b2**self.t
        for p in self.params:
            if p.grad is None:
                continue
            m, v = self._state.setdefault(id(p), (cp.zeros(p.data.shape, cp.float32), cp.zeros(p.data.shape, cp.float32)))
            # the kernel writes p, m and v in place; p may be a channels-last view, so go through its base order
            _adam_update(p.grad.reshape(p.data.shape), self.lr, b1, b2, self.eps, c1, c2, p.data, m, v)


class BatchNorm2d(Module):
    """Batch norm over (N, H, W) per channel. ``affine=False``: normalize only (no gamma/beta and no
    gradients for them); ``track_running_stats=False``: batch statistics in eval mode too.
    ``relu=True`` fuses a ReLU behind it (what Sequential does for BatchNorm2d -> ReLU)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 track_running_stats: bool = True, relu: bool = False) -> None:
        if not eps > 0:
            raise OperandError("fusekit.nn.BatchNorm2d", "eps", f"expected a positive float, got {eps!r}")
        if not 0.0 <= momentum <= 1.0:
            raise OperandError("fusekit.nn.BatchNorm2d", "momentum", f"expected a float in [0, 1], got {momentum!r}")
        self.num_features, self.eps, self.momentum, self.relu = num_features, eps, momentum, relu
        self.affine, self.track_running_stats = affine, track_running_stats
        if affine:
            self.weight = Parameter(cp.ones(num_features, cp.float32))
            self.bias = Parameter(cp.zeros(num_features, cp.float32))
        self.running_mean = cp.zeros(num_features, cp.float32) if track_running_stats else None
        self.running_var = cp.ones(num_features, cp.float32) if track_running_stats else None
        self._saved: tuple | None = None

    def _affine(self, x: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
        if self.affine:
            return self.weight.data, self.bias.data
        ones, zeros, _ = ops.affine_identity(x)
        return ones, zeros

    def forward(self, x: cp.ndarray) -> cp.ndarray:
        if x.ndim != 4 or x.shape[1] != self.num_features:
            raise OperandError("fusekit.nn.BatchNorm2d", "x", f"expected (N, {self.num_features}, H, W), got shape {x.shape}")
        gamma, beta = self._affine(x)
        if self.training or not self.track_running_stats:
            if self.track_running_stats and self.training:
                y, mean, inv, rm, rv = ops.batchnorm(x, gamma, beta, self.running_mean, self.running_var,
                                                     epsilon=self.eps, momentum=self.momentum, relu=self.relu)
                self.running_mean, self.running_var = rm, rv
            else:
                y, mean, inv = ops.batchnorm(x, gamma, beta, epsilon=self.eps, relu=self.relu)
            self._saved = (x, mean, inv, y if self.relu else None)
            return y
        self._saved = None
        return ops.batchnorm_inference(x, self.running_mean, ops.inv_std(self.running_var, self.eps), gamma, beta, relu=self.relu)

    def backward(self, dy: cp.ndarray) -> cp.ndarray:
        if self._saved is None:
            raise OperandError("fusekit.nn.BatchNorm2d", "dy", "backward() needs a forward() in training mode")
        x, mean, inv, y = self._saved
        dy = _as_layout(dy, x)
        if not self.affine and y is None:
            return ops.bn_normalize_backward(dy, x, mean, inv)
        gamma, _ = self._affine(x)
        dx, dg, db = ops.batchnorm_backward(dy, x, gamma, mean, inv, y=y, needs=(True, self.affine, self.affine))
        if self.affine:
            self.weight.accumulate(dg)
            self.bias.accumulate(db)
        return dx


class ChannelScaleShift(Module):
    """y = x * gamma + beta per channel (``scale``/``shift`` pick which exist); ``relu=True`` fuses a ReLU."""

    def __init__(self, num_features: int, scale: bool = True, shift: bool = True, relu: bool = False) -> None:
        if not (scale or shift):
            raise OperandError("fusekit.nn.ChannelScaleShift", "scale", "needs a scale, a shift or both")
        if relu and not (scale and shift):
            raise OperandError("fusekit.nn.ChannelScaleShift", "shift", "relu=True needs both a scale and a shift")
        self.num_features, self.relu = num_features, relu
        self.weight = Parameter(cp.ones(num_features, cp.float32)) if scale else None
        self.bias = Parameter(cp.zeros(num_features, cp.float32)) if shift else None
        self._saved: tuple | None = None

    def parameters(self) -> list[Parameter]:
        return [p for p in (self.weight, self.bias) if p is not None]

    def forward(self, x: cp.ndarray) -> cp.ndarray:
        g = self.weight.data if self.weight is not None else None
        b = self.bias.data if self.bias is not None else None
        y = ops.channel_scale_shift(x, g, b, relu=self.relu)
        self._saved = (x, y if self.relu else None)
        return y

    def backward(self, dy: cp.ndarray) -> cp.ndarray:
        assert self._saved is not None, "backward() before forward()"
        x, y = self._saved
        dy = _as_layout(dy, x)
        g = self.weight.data if self.weight is not None else None
        dx, dg, db = ops.channel_scale_shift_backward(dy, x, g, y=y, needs=(True, self.weight is not None, self.bias is not None))
        if self.weight is not None:
            self.weight.accumulate(dg)
        if self.bias is not None:
            self.bias.accumulate(db)
        return dx


class _FusedNorm(Module):
    """BatchNorm2d(affine=False) [+ ChannelScaleShift(scale, shift)] [+ ReLU] run as one graph;
    made by Sequential, holding no state of its own (it drives the member layers' state)."""

    def __init__(self, bn: BatchNorm2d, ss: ChannelScaleShift | None, relu: bool) -> None:
        self.bn, self.ss, self.relu = bn, ss, relu

    def forward(self, x: cp.ndarray) -> cp.ndarray:
        bn, ss = self.bn, self.ss
        gamma, beta = (ss.weight.data, ss.bias.data) if ss is not None else bn._affine(x)
        if bn.training or not bn.track_running_stats:
            if bn.training and bn.track_running_stats:
                y, mean, inv, bn.running_mean, bn.running_var = ops.batchnorm(
                    x, gamma, beta, bn.running_mean, bn.running_var, epsilon=bn.eps, momentum=bn.momentum, relu=self.relu)
            else:
                y, mean, inv = ops.batchnorm(x, gamma, beta, epsilon=bn.eps, relu=self.relu)
            self._saved = (x, mean, inv, y if self.relu else None)
            return y
        return ops.batchnorm_inference(x, bn.running_mean, ops.inv_std(bn.running_var, bn.eps), gamma, beta, relu=self.relu)

    def backward(self, dy: cp.ndarray) -> cp.ndarray:
        x, mean, inv, y = self._saved
        dy = _as_layout(dy, x)
        ss = self.ss
        gamma = ss.weight.data if ss is not None else self.bn._affine(x)[0]
        has_affine = ss is not None or self.bn.affine
        dx, dg, db = ops.batchnorm_backward(dy, x, gamma, mean, inv, y=y, needs=(True, has_affine, has_affine))
        owner = ss if ss is not None else (self.bn if self.bn.affine else None)
        if owner is not None:
            owner.weight.accumulate(dg)
            owner.bias.accumulate(db)
        return dx

    def parameters(self) -> list[Parameter]:
        return []  # the member layers own them


def _fuse(layers: Sequence[Module]) -> list[Module]:
    """Group adjacent BatchNorm2d -> [ChannelScaleShift(scale and shift)] -> [ReLU] into one graph, and
    ChannelScaleShift(scale and shift) -> ReLU likewise; everything else runs as it is."""
    out: list[Module] = []
    i = 0
    while i < len(layers):
        layer = layers[i]
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        if isinstance(layer, BatchNorm2d) and not layer.relu:
            ss = None
            j = i + 1
            if not layer.affine and isinstance(nxt, ChannelScaleShift) and nxt.weight is not None and nxt.bias is not None and not nxt.relu:
                ss, j = nxt, i + 2
            relu = j < len(layers) and type(layers[j]) is ReLU  # (not ReLU6: the fused norm graph has the plain ReLU)
            if ss is not None or relu:
                out.append(_FusedNorm(layer, ss, relu))
                i = j + (1 if relu else 0)
                continue
        out.append(layer)
        i += 1
    return out


class MaxPool2d(Module):
    """Max pooling (CuPy kernel; cuDNN's Python graph API has no pooling node), ``dilation`` and
    ``ceil_mode`` as PyTorch's. The argmax is kept as an int32 array for the backward."""

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False) -> None:
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.dilation, self.ceil_mode = dilation, ceil_mode
        self._saved: tuple | None = None

    def forward(self, x: cp.ndarray) -> cp.ndarray:
        y, argmax = pool.max_pool2d(x, self.kernel_size, self.stride, self.padding, dilation=self.dilation, ceil_mode=self.ceil_mode)
        self._saved = (argmax, x.shape)
        return y

    def backward(self, dy: cp.ndarray) -> cp.ndarray:
        assert self._saved is not None, "backward() before forward()"
        argmax, shape = self._saved
        return pool.max_pool2d_backward(dy, argmax, shape)


class AvgPool2d(Module):
    """Average pooling (CuPy kernel), PyTorch semantics (``count_include_pad``, ``ceil_mode``,
    ``divisor_override``)."""

    def __init__(
        self, kernel_size: Any, stride: Any = None, padding: Any = 0, count_include_pad: bool = True, ceil_mode: bool = False,
        divisor_override: int | None = None,
    ) -> None:
        self.args = (kernel_size, stride, padding)
        self.count_include_pad, self.ceil_mode, self.divisor_override = count_include_pad, ceil_mode, divisor_override
        self._shape: tuple | None = None

    def _kw(self) -> dict[str, Any]:
        return dict(count_include_pad=self.count_include_pad, ceil_mode=self.ceil_mode, divisor_override=self.divisor_override)

    def forward(self, x: cp.ndarray) -> cp.ndarray:
        self._shape = x.shape
        return pool.avg_pool2d(x, *self.args, **self._kw())

    def backward(self, dy: cp.ndarray) -> cp.ndarray:
        assert self._shape is not None, "backward() before forward()"
        return pool.avg_pool2d_backward(dy, self._shape, *self.args, **self._kw())


class Softmax(Module):
    """Softmax over ``axis`` (channels by default); the backward reads the output y, not x."""

    def __init__(self, axis: int = 1, log: bool = False) -> None:
        self.axis, self.log = axis, log
        self._y: cp.ndarray | None = None

    def forward(self, x: cp.ndarray) -> cp.ndarray:
        self._y = (pool.log_softmax if self.log else pool.softmax)(x, self.axis)
        return self._y

    def backward(self, dy: cp.ndarray) -> cp.ndarray:
        assert self._y is not None, "backward() before forward()"
        return (pool.log_softmax_backward if self.log else pool.softmax_backward)(dy, self._y, self.axis)


class NLLLoss:
    """Mean negative log-likelihood of log-probabilities (B, classes) (after Softmax(log=True))."""

    def __call__(self, logp: cp.ndarray, labels: cp.ndarray) -> cp.ndarray:
        self._shape, self._labels, self._dtype = logp.shape, labels, logp.dtype
        return -logp[cp.arange(labels.shape[0]), labels].astype(cp.float32).mean()

    def backward(self) -> cp.ndarray:
        g = cp.zeros(self._shape, self._dtype)
        g[cp.arange(self._labels.shape[0]), self._labels] = -1.0 / self._labels.shape[0]
        return g
