"""PyTorch integration: drop-in modules over fusekit's fused forward and backward graphs, the
autograd Functions under them, and :func:`convert`, which moves a whole model onto them.

The modules subclass their ``torch.nn`` counterparts: same constructor arguments, initialization,
parameters, buffers and state-dict keys. ``Conv2d``, ``ConvTranspose2d``, ``Linear`` and
``BatchNorm2d`` take ``activation="relu"`` to fuse a ReLU into their graph (``Conv2d`` and
``BatchNorm2d`` also ``"relu6"``, MobileNet's ReLU6).

    import fusekit.torch as ft
    model, report = ft.convert(torchvision.models.resnet50())
    print(report)                      # what was replaced, fused, left alone
    model = model.cuda().to(memory_format=torch.channels_last)
    model = ft.graphed(model)          # training forward + backward replayed as CUDA graphs
    # or model = ft.replayed(model): training steps replayed from a recorded tape, no CUDA graphs

Where a module runs:

- CUDA tensors of float16, bfloat16 or float32 (4-D images for convolutions, batch norm and
  pooling): on fusekit's graphs. Under ``torch.autocast("cuda")`` they compute as ``torch.nn`` does:
  convolutions and Linear in the autocast dtype (their float32 parameters get float32 gradients),
  Softmax in float32, batch norm, ReLU and pooling in their input's dtype.
- Empty batches and ``torch.fx`` tracing: PyTorch's own implementation (exact ``torch.nn``
  behaviour, gradients included).
- CPU tensors, float64 and input ranks the graphs do not take: PyTorch's own implementation, with a
  :class:`TorchFallbackWarning` once per module type and case.

Inputs that are neither dense NCHW nor dense channels-last (slices, transposes) run on a dense copy,
with a :class:`fusekit.errors.LayoutWarning` once per module type.
"""

from __future__ import annotations

import copy
import itertools
import math
import operator
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

from .errors import import_or_explain

torch = import_or_explain("torch", "fusekit.torch", "fusekit[torch]", "PyTorch")

from . import config, ops
from .dispatch import taped
from .engine.folding import bn_scale_shift, fold_into_conv
from .errors import CaptureError, LayoutWarning, OperandError, TorchFallbackWarning, warn_once
from .ops import pool
from .ops.common import ACTIVATIONS, clip_attrs
from .torch_replay import ReplayedForward
from .torch_replay import amp_dtype as _amp_dtype
from .torch_replay import autocast_as as _autocast_as

F = torch.nn.functional

__all__ = [
    "AvgPool2d",
    "BatchNorm2d",
    "BatchNormAct",
    "ChannelScaleShift",
    "Conv2d",
    "ConvBiasAct",
    "ConvTranspose2d",
    "ConvTransposeBiasAct",
    "ConvertReport",
    "FxTracer",
    "Linear",
    "LinearBiasAct",
    "LogSoftmax",
    "MaxPool2d",
    "ReLU",
    "ReLU6",
    "ScaleShiftAct",
    "Softmax",
    "TorchFallbackWarning",
    "convert",
    "graphed",
    "replayed",
]


# ----------------------------------------------------------------------------------------------
# Input handling shared by the modules
# ----------------------------------------------------------------------------------------------
_GRAPH_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _on_graphs(x: Any, who: str, ranks: tuple[int, ...] | None = (4,)) -> bool:
    """Whether ``x`` runs on fusekit's graphs; else the caller runs PyTorch's implementation (warned
    once per module type and reason, except for empty tensors and fx Proxies, which are exact)."""
    if not isinstance(x, torch.Tensor):
        return False  # a torch.fx Proxy: record PyTorch's ops
    if x.is_cuda and x.dtype in _GRAPH_DTYPES and (ranks is None or x.dim() in ranks):
        return x.numel() > 0
    if x.numel() == 0:
        return False
    if not x.is_cuda:
        reason = f"a {x.device.type} tensor (fusekit's graphs run on CUDA)"
    elif x.dtype not in _GRAPH_DTYPES:
        reason = f"a {x.dtype} tensor (fusekit's graphs take float16, bfloat16 and float32)"
    else:
        reason = f"a {x.dim()}-D input (fusekit's {who} takes rank {' or '.join(map(str, ranks or ()))})"
    warn_once((who, reason), f"fusekit.torch.{who} got {reason}: running PyTorch's own implementation", TorchFallbackWarning, stacklevel=4)
    return False


def _is_dense(x: torch.Tensor) -> bool:
    return x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))


def _dense(x: torch.Tensor, who: str, rows: bool = False) -> torch.Tensor:
    """``x`` if dense NCHW or channels-last (``rows``: row-major only), else a dense copy (LayoutWarning once per ``who``)."""
    if x.is_contiguous() or (not rows and x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)):
        return x
    warn_once(("fusekit.torch", who), f"fusekit.torch.{who}: input strides {tuple(x.stride())} are not dense "
              f"{'row-major' if rows else 'NCHW or channels-last'}; running on a dense copy (pass a contiguous tensor to avoid it)",
              LayoutWarning, stacklevel=4)
    channels_last = not rows and x.dim() == 4 and x.stride(1) == min(x.stride())
    return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` dense in ``ref``'s memory format (autograd may hand over strided gradients)."""
    if ref.dim() == 4 and ref.is_contiguous(memory_format=torch.channels_last) and not ref.is_contiguous():
        return t.contiguous(memory_format=torch.channels_last)
    return t.contiguous()


def _cast(t: Any, dtype: Any) -> Any:
    """``t`` in ``dtype`` as autocast casts (differentiably; None, float64 and matching tensors stay)."""
    if t is None or dtype is None or t.dtype == dtype or t.dtype == torch.float64:
        return t
    return t.to(dtype)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


_ZERO_BIAS: dict[tuple, torch.Tensor] = {}


def _zero_bias(n: int, like: torch.Tensor) -> torch.Tensor:
    """A cached zero bias of ``n`` channels in ``like``'s dtype and device (bias=False with a fused epilogue)."""
    key = (like.device, like.dtype, n)
    z = _ZERO_BIAS.get(key)
    if z is None:
        z = _ZERO_BIAS[key] = torch.zeros(n, device=like.device, dtype=like.dtype)
    return z


def _needs_grad(*tensors: Any) -> bool:
    """Whether autograd will record an op on ``tensors`` (None entries allowed)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter; None for an inference tensor (``torch.inference_mode``), which has none."""
    return None if t.is_inference() else t._version


def _tag(t: torch.Tensor, name: str, value: Any) -> torch.Tensor:
    """Attach ``value`` to ``t`` under ``name``, valid while ``t`` is unmodified (its version; an
    inference tensor's modifications cannot be seen, and its tag is trusted)."""
    setattr(t, name, (value, _version(t)))
    return t


def _tagged(t: Any, name: str) -> Any:
    """The value :func:`_tag` attached to ``t`` under ``name``, or None (no tag, or ``t`` modified since)."""
    tag = getattr(t, name, None) if isinstance(t, torch.Tensor) else None
    return tag[0] if tag is not None and tag[1] == _version(t) else None


# Fusion across modules (set up by convert): a producer computes its followers' work too and tags
# its output with them; each follower, given exactly that tensor (same object, unmodified), passes
# it on instead of computing again. Any other input is computed as usual.
_DONE = "_fusekit_done"
_ADDED = "_fusekit_added"  # a conv's output that already holds relu(. + residual): id(residual)


def _hand_on(y: torch.Tensor, followers: tuple) -> torch.Tensor:
    return _tag(y, _DONE, tuple(id(m) for m in followers)) if followers else y


def _already_done(x: Any, m: torch.nn.Module) -> bool:
    """Whether ``x`` is a producer's output that already holds ``m``'s work (then ``m`` passes it on)."""
    ids = _tagged(x, _DONE)
    if ids is None or ids[0] != id(m):
        return False
    if len(ids) > 1:
        _tag(x, _DONE, ids[1:])
    else:
        delattr(x, _DONE)
    return True


# ReLU backward across modules (set up by convert): a ReLU output (BN+ReLU, ReLU, conv+ReLU) used
# only by a convolution lets that convolution's backward compute its input gradient with the ReLU's
# mask applied (cuDNN's dgrad + dReLU graph) and tag it; the producer's backward, given exactly that
# tensor (unmodified: autograd accumulating another gradient into it bumps the version, and a sum
# is a new tensor), skips its own dReLU. Masking is idempotent: an untagged gradient is masked again.
_RELU_OUT = "_fusekit_relu_out"
_RELU_DONE = "_fusekit_relu_done"


def _mark_relu_output(y: torch.Tensor, clip: float = math.inf) -> torch.Tensor:
    return _tag(y, _RELU_OUT, clip)


def _relu_output_clip(x: Any) -> float | None:
    """The upper clip (inf: ReLU, 6: ReLU6) of the fusekit ReLU whose unmodified output ``x`` is (its
    gradient may carry the dReLU), or None."""
    return _tagged(x, _RELU_OUT)


def _mark_relu_done(dx: torch.Tensor, relu_out: torch.Tensor) -> torch.Tensor:
    return _tag(dx, _RELU_DONE, relu_out.data_ptr())


def _relu_done(dy: Any, y: torch.Tensor | None) -> bool:
    """Whether ``dy`` already has the mask of the ReLU whose output is ``y`` applied (by the consumer's dgrad)."""
    return y is not None and _tagged(dy, _RELU_DONE) == y.data_ptr()


def _check_act(act: str | None, who: str = "fusekit.torch", allowed: tuple[str, ...] = ("relu", "relu6")) -> str | None:
    if act is not None and act not in allowed:
        raise OperandError(who, "activation", f"expected None or {' or '.join(map(repr, allowed))}, got {act!r}", what="argument")
    return act


def _clip(act: str | bool | None) -> float | None:
    """The upper clip of activation ``act`` (None: no activation; the Functions' older bool: ReLU or none)."""
    if isinstance(act, bool):
        act = "relu" if act else None
    return None if act is None else ACTIVATIONS[act]


def _act_of(relu: Any) -> str:
    """The activation a ReLU / ReLU6 module computes."""
    return "relu6" if isinstance(relu, torch.nn.ReLU6) else "relu"


def _explicit_padding(padding: Any, kernel: tuple, dilation: tuple) -> tuple[tuple[int, int], tuple[int, int, int, int] | None]:
    """(symmetric padding, extra (left, right, top, bottom) zero padding of the input or None) of a
    Conv2d ``padding``. "same" pads d * (k - 1) in all, the odd one at the bottom / right as PyTorch
    does; cuDNN pads symmetrically, so that row / column is padded onto the input first."""
    if not isinstance(padding, str):
        return (int(padding[0]), int(padding[1])), None
    if padding == "valid":
        return (0, 0), None
    total = [int(d) * (int(k) - 1) for k, d in zip(kernel, dilation)]
    left = [t // 2 for t in total]
    extra = [t - 2 * p for t, p in zip(total, left)]
    return (left[0], left[1]), ((0, extra[1], 0, extra[0]) if any(extra) else None)


def _padded(x: torch.Tensor, pad: tuple[int, int, int, int], mode: str) -> torch.Tensor:
    """``F.pad(x, pad, mode)`` in x's memory format (the non-constant modes write NCHW)."""
    y = F.pad(x, pad, mode=mode)
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        y = y.contiguous(memory_format=torch.channels_last)
    return y


# ----------------------------------------------------------------------------------------------
# autograd Functions
# ----------------------------------------------------------------------------------------------
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
        if b is None and clip is None:
            f, bias = ops.conv2d, None
        else:
            bias = b if b is not None else _zero_bias(int(w.shape[0]), x)
            f = ops.conv_bias if clip is None else ops.conv_bias_relu6 if act == "relu6" else ops.conv_bias_relu
        args = (x, w) if bias is None else (x, w, bias)
        y = taped((f, padding, stride, dilation, groups), lambda: f(*args, **kw), args)
        ctx.save_for_backward(x, w, y if clip is not None else None)
        ctx.kw, ctx.clip, ctx.has_bias = kw, clip, b is not None
        ctx.input_clip = input_clip
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        x, w, y = ctx.saved_tensors
        relu = ctx.clip is not None and not _relu_done(dy, y)  # a consumer's dgrad may have applied this ReLU's mask
        dy = _like(dy, x)
        nx, nw, nb = ctx.needs_input_grad[:3]
        fed = ctx.input_clip is not None
        needs, kw = (nx, nw, nb and ctx.has_bias), dict(ctx.kw, input_relu=fed, input_clip=ctx.input_clip if fed else math.inf)
        key = ("conv_backward", relu, ctx.has_bias, needs, ctx.clip, *kw.values())
        if relu:
            dx, dw, db = taped(key, lambda: ops.conv_bias_relu_backward(dy, x, w, y, needs=needs, upper_clip=ctx.clip, **kw), (dy, x, w, y))
        elif ctx.has_bias:
            dx, dw, db = taped(key, lambda: ops.conv_bias_backward(dy, x, w, needs=needs, **kw), (dy, x, w))
        else:
            (dx, dw), db = taped(key, lambda: ops.conv2d_backward(dy, x, w, needs=(nx, nw), **kw), (dy, x, w)), None
        if dx is not None and fed:
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
        f = ops.conv_transpose_bias_relu if relu else ops.conv_transpose_bias
        y = f(x, w, bias, output_padding=output_padding, **kw)
        ctx.save_for_backward(x, w, y if relu else None)
        ctx.kw, ctx.relu, ctx.has_bias = kw, relu, b is not None
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        x, w, y = ctx.saved_tensors
        dy = _like(dy, x)
        nx, nw, nb = ctx.needs_input_grad[:3]
        dx, dw, db = ops.conv_transpose_bias_relu_backward(
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
        y = ops.linear_bias_relu(x, w, bias) if relu else ops.linear_bias(x, w, bias)
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
            dx, dw, db = ops.linear_bias_relu_backward(dy, x, w, y, needs=needs)
        else:
            dx, dw, db = ops.linear_bias_backward(dy, x, w, needs=needs)
        return dx, dw, db, None


class BatchNormAct(torch.autograd.Function):
    """Training batch norm (+ ReLU with ``act`` "relu" or "relu6"): one cuDNN graph forward, the BN
    backward (with the dReLU fused in front) as one graph. gamma and beta are float32; running stats
    of any dtype are updated in place (computed in float32, written back in their own dtype)."""

    @staticmethod
    def forward(ctx: Any, x, gamma, beta, running_mean, running_var, eps, momentum, act, residual=None):  # type: ignore[override]
        clip = _clip(act)
        relu = dict(relu=clip is not None, upper_clip=math.inf if clip is None else clip, residual=residual)
        key = ("batchnorm", eps, momentum, relu["relu"], relu["upper_clip"])
        if running_mean is not None:
            args = (x, gamma, beta, _f32(running_mean), _f32(running_var), residual)
            y, mean, inv, rm, rv = taped(key, lambda: ops.batchnorm(*args[:5], epsilon=eps, momentum=momentum, **relu), args)
            torch._foreach_copy_([running_mean, running_var], [rm, rv])  # one launch for both
        else:
            y, mean, inv = taped(key, lambda: ops.batchnorm(x, gamma, beta, epsilon=eps, **relu), (x, gamma, beta, residual))
        ctx.save_for_backward(x, gamma, mean, inv, y if clip is not None else None)
        ctx.clip, ctx.residual = relu["upper_clip"], residual is not None
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
                                   lambda: ops.batchnorm_backward(dy, x, gamma, mean, inv, y=y, needs=needs, residual=True), args)
        else:
            dx, dg, db = taped(("batchnorm_backward", needs, ctx.clip),
                               lambda: ops.batchnorm_backward(dy, x, gamma, mean, inv, y=y, needs=needs, upper_clip=ctx.clip), args)
            dz = dy if ctx.residual else None
        return dx, dg, db, None, None, None, None, None, dz


class _AddReLU(torch.autograd.Function):
    """relu(a + b) as one pointwise graph; both get the gradient dy * (y > 0)."""

    @staticmethod
    def forward(ctx: Any, a, b):  # type: ignore[override]
        y = ops.call("add_relu", a, _like(b, a))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        dz = dy if _relu_done(dy, y) else ops.relu_backward(_like(dy, y), y)
        return dz, dz


class ScaleShiftAct(torch.autograd.Function):
    """y = act(x * gamma + beta) per channel (gamma, beta float32 (C,), either may be None; act None,
    "relu" or "relu6")."""

    @staticmethod
    def forward(ctx: Any, x, gamma, beta, act):  # type: ignore[override]
        clip = _clip(act)
        ctx.clip = math.inf if clip is None else clip
        y = ops.channel_scale_shift(x, gamma, beta, relu=clip is not None, upper_clip=ctx.clip)
        ctx.save_for_backward(x, gamma, y if clip is not None else None)
        ctx.has = (gamma is not None, beta is not None)
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        x, gamma, y = ctx.saved_tensors
        n = ctx.needs_input_grad
        dx, dg, db = ops.channel_scale_shift_backward(
            _like(dy, x), x, gamma, y=y, needs=(n[0], ctx.has[0] and n[1], ctx.has[1] and n[2]), upper_clip=ctx.clip
        )
        return dx, dg, db, None


class _ReLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, inplace, clip):  # type: ignore[override]
        clip_kw = clip_attrs(clip)
        if inplace:
            ops.call("relu", x, out=x, **clip_kw)
            ctx.mark_dirty(x)
            y = x
        else:
            y = ops.call("relu", x, **clip_kw)
        ctx.save_for_backward(y)
        ctx.clip = clip
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        if _relu_done(dy, y):
            return dy, None, None
        return ops.relu_backward(_like(dy, y), y, upper_clip=ctx.clip), None, None


class _MaxPool(torch.autograd.Function):
    """(y, argmax): max pooling and its int32 argmax (not differentiable), which the backward scatters through."""

    @staticmethod
    def forward(ctx: Any, x, kernel_size, stride, padding, ceil_mode, dilation):  # type: ignore[override]
        y, argmax = pool.max_pool2d(x, kernel_size, stride, padding, ceil_mode=ceil_mode, dilation=dilation)
        ctx.save_for_backward(argmax)
        ctx.mark_non_differentiable(argmax)
        ctx.shape = tuple(x.shape)
        return y, argmax

    @staticmethod
    def backward(ctx: Any, dy, _):  # type: ignore[override]
        (argmax,) = ctx.saved_tensors
        return pool.max_pool2d_backward(_like(dy, argmax), argmax, ctx.shape), None, None, None, None, None


class _AvgPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, kernel_size, stride, padding, count_include_pad, ceil_mode, divisor_override):  # type: ignore[override]
        ctx.args, ctx.shape = (kernel_size, stride, padding), tuple(x.shape)
        ctx.kw = dict(count_include_pad=count_include_pad, ceil_mode=ceil_mode, divisor_override=divisor_override)
        return pool.avg_pool2d(x, kernel_size, stride, padding, **ctx.kw)

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[override]
        return pool.avg_pool2d_backward(dy.contiguous(), ctx.shape, *ctx.args, **ctx.kw), None, None, None, None, None, None


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


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------
class _Fusekit:
    """Marker and defaults of the fusekit.torch modules. ``_fk_bn`` / ``_fk_relu``: the module whose
    work this one does too (set by :func:`convert`, never registered as submodules)."""

    _fk_bn: Any = None
    _fk_relu: Any = None
    _fk_drelu = False  # (convolutions) every call's input is a ReLU output used only by this module
    activation: str | None = None

    def _fk_setup(self) -> None:
        """Check the torch attributes and set fusekit's (also run on a torch module :func:`convert` re-classes)."""

    def train(self, mode: bool = True) -> Any:
        self.__dict__.pop("_fk_memo", None)  # .train() / .eval() recompute what eval reuses (see _memo)
        return super().train(mode)  # type: ignore[misc]

    def _memo(self, fn: Any, tensors: tuple, extra: tuple = (), fast: Any = None) -> Any:
        """A value computed from ``tensors`` (eval's folded weights): ``fn()`` (differentiable) at every
        call when autograd needs it; ``fast()`` (default ``fn``; the same value without autograd) at every
        call while a CUDA graph is being captured (each replay computes it again from the tensors as they
        are then); else ``fast()`` once, reused while ``tensors`` are the same objects at the same
        addresses and versions. An in-place write through ``.data`` (which PyTorch's version counters do
        not count) is seen after the next ``.train()`` / ``.eval()``."""
        if _needs_grad(*tensors):
            return fn()
        fast = fast or fn
        if tensors[-1].is_cuda and torch.cuda.is_current_stream_capturing():  # (the last: a tensor, never None)
            return fast()
        key = (extra, tuple(None if t is None else (t.data_ptr(), _version(t)) for t in tensors))
        memo = self.__dict__.get("_fk_memo")
        if memo is not None and memo[0] == key and all(a is b for a, b in zip(memo[1], tensors)):
            return memo[2]
        with torch.inference_mode(False), torch.no_grad():  # ordinary tensors, usable outside inference_mode too
            value = fast()
        self.__dict__["_fk_memo"] = (key, tensors, value)
        return value

    def _fk_followers(self) -> str:
        chain = [m for m in (self._fk_bn, self._fk_bn._fk_relu if self._fk_bn is not None else None, self._fk_relu) if m is not None]
        return ", fused with " + " -> ".join(type(m).__name__ for m in chain) if chain else ""

    def _fk_repr(self, base: str) -> str:
        act = f", activation={self.activation!r}" if self.activation else ""
        return base + act + self._fk_followers()


class _FusekitAct(_Fusekit):
    """A fusekit module over a torch layer with an optional fused ReLU (``activation="relu"``, or
    ``"relu6"`` where the module says so)."""

    def __init__(self, *args: Any, activation: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fk_setup(activation)

    def extra_repr(self) -> str:
        return self._fk_repr(super().extra_repr())

    def _torch_forward(self, x: Any, *args: Any) -> Any:
        """The torch layer's own forward, then the ReLU: CPU tensors, tracing, what cuDNN cannot run."""
        y = super().forward(x, *args)
        return F.relu6(y) if self.activation == "relu6" else F.relu(y) if self.activation == "relu" else y

    def _fk_act(self) -> str | None:
        """The activation this module's graph ends with: its own, or that of the ReLU / ReLU6 module it
        does the work of (set by convert)."""
        return _act_of(self._fk_relu) if self._fk_relu is not None else self.activation


class Conv2d(_FusekitAct, torch.nn.Conv2d):
    """torch.nn.Conv2d as a fused cuDNN graph, with an optional fused ReLU (``activation="relu"`` or
    ``"relu6"``).

    Takes every torch argument cuDNN can run: ``bias=False``, ``groups`` (grouped and depthwise),
    ``padding`` as ints, "valid" or "same" (an odd total "same" padding pads the input's last row /
    column first, as PyTorch). ``padding_mode`` "reflect", "replicate" and "circular" pad the input
    with ``F.pad`` and convolve unpadded, as PyTorch does."""

    def _fk_setup(self, activation: str | None = None) -> None:  # type: ignore[override]
        self.activation = _check_act(activation, "fusekit.torch.Conv2d")
        if self.padding_mode == "zeros":
            self._fk_pad, self._fk_extra = _explicit_padding(self.padding, self.kernel_size, self.dilation)
        else:  # cuDNN pads with zeros only: the input is padded first (torch.nn.Conv2d's own route), the conv pads nothing
            pad = tuple(int(p) for p in self._reversed_padding_repeated_twice)
            self._fk_pad, self._fk_extra = (0, 0), (pad if any(pad) else None)

    def _folded(self, bn: torch.nn.BatchNorm2d, dtype: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(w', b') in ``dtype`` with conv(x, w') + b' = bn(conv(x, w) + b) for ``bn`` in eval mode,
        computed in float32: differentiable at every call when autograd needs it (gradients reach the
        conv's and BN's parameters as in PyTorch), else by ops.fold_batchnorm (one kernel) at every call
        inside a CUDA-graph capture or once while the tensors are unchanged (_memo)."""

        def fold() -> tuple[torch.Tensor, torch.Tensor]:
            scale, shift = bn._scale_shift()  # bn(y) = y * scale + shift
            w, b = fold_into_conv(_f32(self.weight), None if self.bias is None else _f32(self.bias), scale, shift)
            return w.to(dtype), b.to(dtype)

        def kernel() -> tuple[torch.Tensor, torch.Tensor]:
            gamma, beta = (bn.weight, bn.bias) if bn.affine else (None, None)
            if len({t.dtype for t in (bn.running_mean, bn.running_var, gamma, beta) if t is not None}) > 1:
                return fold()  # the kernel takes the BN vectors in one dtype
            return ops.fold_batchnorm(self.weight, self.bias, bn.running_mean, bn.running_var, gamma, beta, bn.eps,
                                      dtype=str(dtype).removeprefix("torch."))

        return self._memo(fold, (self.weight, self.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var), (dtype, bn.eps, bn), kernel)

    def _out_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """The output shape of this conv on (padded) ``x``."""
        from .pipeline.ir import conv_out_hw

        hw = conv_out_hw(int(x.shape[2]), int(x.shape[3]), self.kernel_size, self._fk_pad, self.stride, self.dilation)
        return (int(x.shape[0]), self.out_channels, *hw)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        """conv(x) [+ the fused BN / ReLU work]. ``residual``: what :func:`convert`'s rewrite of a
        residual block end passes when this conv's BN is then called as bn(y, residual); in eval
        without autograd the conv, the folded BN, the add and the ReLU run as one graph (else unused)."""
        if not _on_graphs(x, "Conv2d"):
            return self._torch_forward(x)
        amp = _amp_dtype()
        x = _cast(_dense(x, "Conv2d"), amp)
        act, done = self._fk_act(), ()
        bn = self._fk_bn
        folded = bn is not None and not bn.training and bn.running_mean is not None and bn.running_var is not None
        if folded:
            w, b = self._folded(bn, x.dtype)  # eval: BN folded into this conv's weights and bias
            act = bn._fk_act()
            done = (bn,) + ((bn._fk_relu,) if bn._fk_relu is not None else ())
        else:
            w, b = _cast(self.weight, amp), _cast(self.bias, amp)
            if self._fk_relu is not None:
                done = (self._fk_relu,)
        if self._fk_extra is not None:
            x = _padded(x, self._fk_extra, "constant" if self.padding_mode == "zeros" else self.padding_mode)
        if (folded and act is None and residual is not None and _on_graphs(residual, "Conv2d") and residual.shape == self._out_shape(x)
                and not _needs_grad(x, w, b, residual)):
            z = _like(_cast(_dense(residual, "Conv2d"), x.dtype), x)
            y = ops.conv_bias_add_relu(x, w, b, z, padding=self._fk_pad, stride=self.stride, dilation=self.dilation, groups=self.groups)
            return _hand_on(_tag(_mark_relu_output(y), _ADDED, id(residual)), done)
        input_clip = _relu_output_clip(x) if self._fk_drelu else None
        y = ConvBiasAct.apply(x, w, b, self._fk_pad, self.stride, self.dilation, self.groups, act, input_clip)
        return _hand_on(y if act is None else _mark_relu_output(y, ACTIVATIONS[act]), done)


class ConvTranspose2d(_FusekitAct, torch.nn.ConvTranspose2d):
    """torch.nn.ConvTranspose2d as cuDNN dgrad-as-forward (``bias=False`` and ``groups`` too), with an
    optional fused ReLU; ``output_size`` in forward works as in PyTorch."""

    def _fk_setup(self, activation: str | None = None) -> None:  # type: ignore[override]
        self.activation = _check_act(activation, "fusekit.torch.ConvTranspose2d", ("relu",))
        if self.padding_mode != "zeros":
            raise OperandError("fusekit.torch.ConvTranspose2d", "padding_mode", "only 'zeros' is supported", what="argument")

    def forward(self, x: torch.Tensor, output_size: Any = None) -> torch.Tensor:  # type: ignore[override]
        if not _on_graphs(x, "ConvTranspose2d"):
            return self._torch_forward(x, output_size)
        amp = _amp_dtype()
        x = _cast(_dense(x, "ConvTranspose2d"), amp)
        op = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size, 2, self.dilation)  # type: ignore[arg-type]
        relu, done = self.activation == "relu", ()
        if self._fk_relu is not None:
            relu, done = True, (self._fk_relu,)
        y = ConvTransposeBiasAct.apply(
            x, _cast(self.weight, amp), _cast(self.bias, amp), self.padding, self.stride, self.dilation, tuple(op), self.groups,
            "relu" if relu else None,
        )
        return _hand_on(y, done)


class Linear(_FusekitAct, torch.nn.Linear):
    """torch.nn.Linear as a fused cuDNN matmul graph (inputs of any rank >= 1, ``bias=False`` too),
    with an optional fused ReLU. Float32 under a numerics policy that keeps matmuls IEEE (the default,
    as PyTorch's) runs PyTorch's own linear: cuDNN 9.19 has no IEEE float32 matmul plan, and its TF32
    one is ~3e-4 off float64 where PyTorch's is ~1e-7 (float16 / bfloat16 and autocast run cuDNN)."""

    def _fk_setup(self, activation: str | None = None) -> None:  # type: ignore[override]
        self.activation = _check_act(activation, "fusekit.torch.Linear", ("relu",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not _on_graphs(x, "Linear", None) or x.dim() == 0:
            return self._torch_forward(x)
        if x.shape[-1] != self.in_features:
            raise OperandError("fusekit.torch.Linear", "x", f"expected last dim {self.in_features} (in_features), got shape {tuple(x.shape)}")
        amp = _amp_dtype()
        if (amp or x.dtype) == torch.float32 and not config.allow_tf32().matmul:
            return self._torch_forward(x)
        x2 = _cast(_dense(x, "Linear", rows=True), amp)
        if x2.dim() != 2:
            x2 = x2.reshape(-1, self.in_features)
        relu, done = self.activation == "relu", ()
        if self._fk_relu is not None:
            relu, done = True, (self._fk_relu,)
        y = LinearBiasAct.apply(x2, _cast(self.weight, amp), _cast(self.bias, amp), "relu" if relu else None)
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], self.out_features)
        return _hand_on(y, done)


class BatchNorm2d(_FusekitAct, torch.nn.BatchNorm2d):
    """torch.nn.BatchNorm2d on cuDNN graphs (train: fused BN [+ ReLU / ReLU6]; eval: one scale-shift
    [+ ReLU / ReLU6] graph from the running statistics, with gradients as PyTorch's). Parameters and buffers may be
    float16 / bfloat16 (``model.half()``): statistics are computed in float32 and the running stats
    written back in their own dtype. ``affine=False`` runs normalize only."""

    def _fk_setup(self, activation: str | None = None) -> None:  # type: ignore[override]
        self.activation = _check_act(activation, "fusekit.torch.BatchNorm2d")

    def _check_input_dim(self, input: Any) -> None:
        if isinstance(input, torch.Tensor):  # an fx Proxy (tracing) has no dim() to check
            super()._check_input_dim(input)

    def _affine(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.affine:
            return _f32(self.weight), _f32(self.bias)
        ones, zeros, _ = ops.affine_identity(x)
        return ones, zeros

    def _scale_shift(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Eval mode: float32 (scale, shift) with bn(x) = x * scale + shift, from the running statistics
        (differentiable in weight and bias at every call when autograd needs it, else reused: _memo)."""

        def fold() -> tuple[torch.Tensor, torch.Tensor]:
            return bn_scale_shift(_f32(self.running_mean), _f32(self.running_var), self.eps,
                                  _f32(self.weight) if self.affine else None, _f32(self.bias) if self.affine else None)

        return self._memo(fold, (self.weight, self.bias, self.running_mean, self.running_var), (self.eps,))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        """bn(x) [+ the fused ReLU]; with ``residual`` (how :func:`convert` rewrites a residual block's
        end), relu(bn(x) + residual): training runs BN + add + ReLU as one graph."""
        if residual is not None:
            if self._fk_act() is not None:
                raise OperandError("fusekit.torch.BatchNorm2d", "residual", "is added before a ReLU of its own: this module's activation must be None",
                                   what="argument")
            if _tagged(x, _ADDED) == id(residual) and _already_done(x, self):  # eval: the conv before did BN, add and ReLU
                return x
            if not (isinstance(residual, torch.Tensor) and residual.shape == x.shape  # else: a broadcast, or off cuDNN's graphs
                    and _on_graphs(x, "BatchNorm2d") and _on_graphs(residual, "BatchNorm2d")):
                return F.relu(self.forward(x) + residual)  # as written (bn(x) passes a folded conv's output on)
            residual = _dense(residual, "BatchNorm2d")
        if _already_done(x, self):  # eval: folded into the conv before
            return x if residual is None else _mark_relu_output(_AddReLU.apply(x, _cast(residual, x.dtype)))
        if not _on_graphs(x, "BatchNorm2d"):
            return self._torch_forward(x)
        x = _dense(x, "BatchNorm2d")
        after, act = self._fk_relu, ("relu" if residual is not None else self._fk_act())
        if residual is not None:
            residual = _like(_cast(residual, x.dtype), x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if batch_stats:
            n, _, h, w = x.shape
            if n * h * w == 1:
                raise OperandError("fusekit.torch.BatchNorm2d", "x", f"expected more than 1 value per channel when training, got shape {tuple(x.shape)}")
            track = self.training and self.track_running_stats and self.running_mean is not None
            gamma, beta = self._affine(x)
            y = BatchNormAct.apply(
                x, gamma, beta, self.running_mean if track else None, self.running_var if track else None, self.eps, factor, act, residual
            )
        else:
            scale, shift = self._scale_shift()
            if residual is None:
                y = ScaleShiftAct.apply(x, scale, shift, act)
            else:
                y = _AddReLU.apply(ScaleShiftAct.apply(x, scale, shift, None), residual)
        if act is not None and (batch_stats or residual is not None):
            _mark_relu_output(y, ACTIVATIONS[act])
        return _hand_on(y, (after,) if after is not None else ())


def _relu_forward(m: Any, x: Any, clip: float, who: str, torch_forward: Any) -> Any:
    if _already_done(x, m):
        return x
    if not _on_graphs(x, who, (1, 2, 4)):
        return torch_forward(m, x)
    if not _is_dense(x):
        if m.inplace:
            return torch_forward(m, x)  # write through the caller's strides, as PyTorch does
        x = _dense(x, who)
    return _mark_relu_output(_ReLUFn.apply(x, m.inplace, clip), clip)


class ReLU(_Fusekit, torch.nn.ReLU):
    """torch.nn.ReLU as a cuDNN pointwise graph (1-, 2- and 4-D inputs; ``inplace=True`` writes into x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _relu_forward(self, x, math.inf, "ReLU", torch.nn.ReLU.forward)


class ReLU6(_Fusekit, torch.nn.ReLU6):
    """torch.nn.ReLU6 (min(max(x, 0), 6)) as a cuDNN pointwise graph (1-, 2- and 4-D inputs;
    ``inplace=True`` writes into x). Its backward passes the gradient where 0 < y < 6, as PyTorch's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _relu_forward(self, x, ACTIVATIONS["relu6"], "ReLU6", torch.nn.ReLU6.forward)


class ChannelScaleShift(_Fusekit, torch.nn.Module):
    """y = x * gamma + beta per channel (``scale``/``shift`` choose which exist), optional fused ReLU
    (``activation="relu"`` or ``"relu6"``)."""

    def __init__(self, num_features: int, scale: bool = True, shift: bool = True, activation: str | None = None, device: Any = None) -> None:
        super().__init__()
        self.activation = _check_act(activation, "fusekit.torch.ChannelScaleShift")
        if not (scale or shift) or (self.activation and not (scale and shift)):
            raise OperandError("fusekit.torch.ChannelScaleShift", "scale", "needs a scale or a shift, and both for a fused ReLU", what="argument")
        self.weight = torch.nn.Parameter(torch.ones(num_features, device=device)) if scale else None
        self.bias = torch.nn.Parameter(torch.zeros(num_features, device=device)) if shift else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return ScaleShiftAct.apply(x, self.weight, self.bias, self.activation)


class MaxPool2d(_Fusekit, torch.nn.MaxPool2d):
    """torch.nn.MaxPool2d through fusekit's CuPy kernel (int32 argmax saved for the backward), with
    ``ceil_mode``, ``dilation`` and ``return_indices`` (int64 indices, as PyTorch's, for
    ``F.max_unpool2d``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fk_setup()

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        if not _on_graphs(x, "MaxPool2d"):
            return torch.nn.MaxPool2d.forward(self, x)
        x = _dense(x, "MaxPool2d")
        args = (self.kernel_size, self.stride, self.padding)
        if not _needs_grad(x):  # no backward: argmax written only for return_indices
            y, argmax = pool.max_pool2d(x, *args, ceil_mode=self.ceil_mode, dilation=self.dilation, indices=self.return_indices)
        else:
            y, argmax = _MaxPool.apply(x, *args, self.ceil_mode, self.dilation)
        return (y, argmax.long()) if self.return_indices else y


class AvgPool2d(_Fusekit, torch.nn.AvgPool2d):
    """torch.nn.AvgPool2d through fusekit's CuPy kernel (PyTorch's divisors; ``count_include_pad``,
    ``ceil_mode`` and ``divisor_override`` too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fk_setup()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not _on_graphs(x, "AvgPool2d"):
            return torch.nn.AvgPool2d.forward(self, x)
        stride = self.stride if self.stride is not None else self.kernel_size
        return _AvgPool.apply(
            _dense(x, "AvgPool2d"), self.kernel_size, stride, self.padding, self.count_include_pad, self.ceil_mode, self.divisor_override
        )


def _softmax_forward(m: Any, x: Any, log: bool, who: str) -> Any:
    if not _on_graphs(x, who, (2, 4)):
        return (F.log_softmax if log else F.softmax)(x, m.dim)
    if _amp_dtype() is not None:
        x = _cast(x, torch.float32)  # autocast runs softmax and log_softmax in float32
    dim = 1 if m.dim is None else m.dim  # PyTorch's implicit dim for 2-D and 4-D inputs
    return _Softmax.apply(_dense(x, who), dim, log)


class Softmax(_Fusekit, torch.nn.Softmax):
    """Softmax (``log=True``: log-softmax) over ``dim`` (default 1) through fusekit's kernel, for 2-D
    and 4-D inputs; the backward reads the output, not the input."""

    def __init__(self, dim: int | None = 1, log: bool = False) -> None:
        super().__init__(dim)
        self._fk_setup(log)

    def _fk_setup(self, log: bool = False) -> None:  # type: ignore[override]
        self.log = bool(log)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _softmax_forward(self, x, self.log, "Softmax")


class LogSoftmax(_Fusekit, torch.nn.LogSoftmax):
    """torch.nn.LogSoftmax through fusekit's kernel (2-D and 4-D inputs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _softmax_forward(self, x, True, "LogSoftmax")


# ----------------------------------------------------------------------------------------------
# convert
# ----------------------------------------------------------------------------------------------
_TARGETS: dict[type, type] = {
    torch.nn.Conv2d: Conv2d, torch.nn.ConvTranspose2d: ConvTranspose2d, torch.nn.Linear: Linear,
    torch.nn.BatchNorm2d: BatchNorm2d, torch.nn.ReLU: ReLU, torch.nn.ReLU6: ReLU6, torch.nn.MaxPool2d: MaxPool2d,
    torch.nn.AvgPool2d: AvgPool2d,
    torch.nn.Softmax: Softmax, torch.nn.LogSoftmax: LogSoftmax,
}


@dataclass
class ConvertReport:
    """What :func:`convert` did. ``replaced``: (name, torch type, fusekit type); ``fused``: (module
    names in call order, what runs); ``left_alone``: (name, type, reason) for leaf modules kept as
    PyTorch's; ``notes``: fusion chances missed; ``analysis``: how the call order was found."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    fused: list[tuple[tuple[str, ...], str]] = field(default_factory=list)
    left_alone: list[tuple[str, str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    analysis: str = ""

    def counts(self) -> dict[str, int]:
        """Replaced modules per torch type."""
        out: dict[str, int] = {}
        for _, t, _ in self.replaced:
            out[t] = out.get(t, 0) + 1
        return out

    def __str__(self) -> str:
        lines = [
            (f"fusekit.torch.convert: {len(self.replaced)} modules replaced, {len(self.fused)} fused groups, "
             f"{len(self.left_alone)} left alone ({self.analysis})"),
            "replaced: " + (", ".join(f"{t} x{n}" for t, n in self.counts().items()) or "nothing"),
        ]
        if self.fused:
            lines.append("fused:")
            lines += [f"  {' -> '.join(names)}: {what}" for names, what in self.fused]
        if self.left_alone:
            lines.append("left alone:")
            groups: dict[tuple[str, str], list[str]] = {}
            for name, t, why in self.left_alone:
                groups.setdefault((t, why), []).append(name)
            for (t, why), names in groups.items():
                shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                lines.append(f"  {shown} ({t}): {why}")
        if self.notes:
            lines.append("notes:")
            lines += [f"  {n}" for n in self.notes]
        if self.replaced:
            lines.append("training: uncaptured, every fusekit layer pays Python and cuDNN host time per call; for speed run "
                         "forward and backward as CUDA graphs: fusekit.torch.graphed(model)")
        return "\n".join(lines)


_PRODUCERS = (torch.nn.Conv2d, torch.nn.ConvTranspose2d, torch.nn.Linear, torch.nn.BatchNorm2d)


class FxTracer(torch.fx.Tracer):
    """A ``torch.fx`` tracer that keeps fusekit.torch modules as leaves (``call_module`` nodes), as the
    default tracer keeps ``torch.nn`` modules; tracing through them records PyTorch's ops instead."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:  # type: ignore[override]
        return isinstance(m, _Fusekit) or super().is_leaf_module(m, module_qualified_name)


def _relu_node(model: torch.nn.Module, n: Any) -> bool:
    """Whether fx node ``n`` calls a module whose output is a ReLU's (a ReLU or ReLU6, or a layer with a fused one)."""
    if n.op != "call_module":
        return False
    m = model.get_submodule(n.target)
    return isinstance(m, (torch.nn.ReLU, torch.nn.ReLU6)) or getattr(m, "activation", None) in ACTIVATIONS


def _fx_consumers(model: torch.nn.Module) -> tuple[dict[int, int], list[str], dict[int, str]]:
    """From ``torch.fx`` traces of ``model`` in training and in eval mode: producer -> consumer (module
    ids) where every call of the producer feeds exactly one call of the same module and nothing else,
    in both traces; notes on outputs that feed a functional ReLU; and the convolutions (module id ->
    the ReLU module's name) whose every training call takes a ReLU module's output that nothing else
    uses. Raises what tracing raises."""
    modes = [(m, m.training) for m in model.modules()]
    found: list[dict[int, int]] = []
    notes: list[str] = []
    relu_fed: dict[int, str] = {}
    relu_fns = {F.relu, torch.relu, F.relu6}
    try:
        for mode in (True, False):
            model.train(mode)
            graph = FxTracer().trace(model)
            calls: dict[str, list[Any]] = {}
            for n in graph.nodes:
                if n.op == "call_module":
                    calls.setdefault(n.target, []).append(n)
            links: dict[int, int] = {}
            for target, nodes in calls.items():
                consumers = set()
                for n in nodes:
                    users = list(n.users)
                    u = users[0] if len(users) == 1 else None
                    if u is not None and u.op == "call_module" and len(u.args) == 1 and u.args[0] is n and not u.kwargs:
                        consumers.add(u.target)
                    else:
                        consumers.add(None)
                        functional_relu = u is not None and (
                            (u.op == "call_function" and u.target in relu_fns) or (u.op == "call_method" and u.target in ("relu", "relu_"))
                        )
                        if mode and functional_relu and isinstance(model.get_submodule(target), _PRODUCERS):
                            notes.append(f"{target}: its output goes to a functional ReLU in forward(); not fused (no module to swap)")
                if len(consumers) == 1 and None not in consumers:
                    links[id(model.get_submodule(target))] = id(model.get_submodule(consumers.pop()))
                if mode and isinstance(model.get_submodule(target), torch.nn.Conv2d) and all(
                    len(n.args) == 1 and not n.kwargs and isinstance(n.args[0], torch.fx.Node) and _relu_node(model, n.args[0])
                    and len(n.args[0].users) == 1 for n in nodes
                ):
                    relu_fed[id(model.get_submodule(target))] = str(nodes[0].args[0].target)
            found.append(links)
    finally:
        for m, t in modes:
            m.training = t
    train, evaluate = found
    return {p: c for p, c in train.items() if evaluate.get(p) == c}, notes, relu_fed


def _sequential_consumers(model: torch.nn.Module) -> dict[int, int]:
    """Producer -> consumer (module ids) for consecutive children of plain nn.Sequential containers,
    each producer appearing once in the model."""
    seen: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        seen[id(m)] = seen.get(id(m), 0) + 1
    links: dict[int, int] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Sequential) and type(m).forward is torch.nn.Sequential.forward:
            kids = [k for k in m._modules.values() if k is not None]
            for a, b in itertools.pairwise(kids):
                if seen.get(id(a)) == 1:
                    links[id(a)] = id(b)
    return links


def _link(producer: Any, consumer: Any) -> bool:
    """Make ``producer`` do ``consumer``'s work too, where fusekit has the fused graph."""
    if producer.activation is not None or producer._fk_bn is not None or producer._fk_relu is not None:
        return False
    if isinstance(producer, Conv2d) and isinstance(consumer, BatchNorm2d):
        if consumer.num_features != producer.out_channels:
            return False
        producer.__dict__["_fk_bn"] = consumer
        return True
    if isinstance(producer, (Conv2d, ConvTranspose2d, Linear, BatchNorm2d)) and isinstance(consumer, ReLU):
        producer.__dict__["_fk_relu"] = consumer
        return True
    if isinstance(producer, (Conv2d, BatchNorm2d)) and isinstance(consumer, ReLU6):  # the graphs with a clipped ReLU
        producer.__dict__["_fk_relu"] = consumer
        return True
    return False


def _describe_groups(model: torch.nn.Module, names: dict[int, str]) -> list[tuple[tuple[str, ...], str]]:
    groups: list[tuple[tuple[str, ...], str]] = []
    in_chain: set[int] = set()
    mods = [m for m in model.modules() if isinstance(m, _Fusekit)]
    for m in mods:
        bn = m._fk_bn
        if bn is not None:
            after = bn._fk_relu
            in_chain.add(id(bn))
            if after is not None:
                a = type(after).__name__
                groups.append(((names[id(m)], names[id(bn)], names[id(after)]),
                               f"training: conv, then BN+{a} as one graph; eval: one conv+bias+{a} graph (BN folded into the conv)"))
            else:
                groups.append(((names[id(m)], names[id(bn)]), "training: conv, then BN; eval: one conv+bias graph (BN folded into the conv)"))
    for m in mods:
        r = m._fk_relu
        if r is None or id(m) in in_chain:
            continue
        a = type(r).__name__
        what = {BatchNorm2d: f"BN+{a} as one graph (batch statistics in training, running statistics in eval)",
                Conv2d: f"conv+bias+{a} as one graph", ConvTranspose2d: f"transposed conv+bias+{a} as one graph",
                Linear: f"matmul+bias+{a} as one graph (float16 / bfloat16 / autocast; float32 with IEEE matmuls: PyTorch's linear, then {a})"}[type(m)]
        groups.append(((names[id(m)], names[id(r)]), what))
    return groups


class _ChildrenAsLeaves(torch.fx.Tracer):
    """Traces one module's own forward: every submodule it calls is a ``call_module`` node."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:  # type: ignore[override]
        return True


_ADDS = {operator.add, operator.iadd, torch.add}


def _is_add(n: Any) -> bool:
    return len(n.args) == 2 and not n.kwargs and (
        (n.op == "call_function" and n.target in _ADDS) or (n.op == "call_method" and n.target in ("add", "add_")))


def _is_plain_relu(block: torch.nn.Module, n: Any) -> bool:
    """Whether fx node ``n`` is a plain ReLU of its one argument: a fusekit ReLU module, F.relu / torch.relu, or .relu()."""
    if len(n.args) != 1:
        return False
    if n.op == "call_module":
        return type(block.get_submodule(n.target)) is ReLU and not n.kwargs
    if n.op == "call_function":
        return n.target in (F.relu, torch.relu) and set(n.kwargs) <= {"inplace"}
    return n.op == "call_method" and n.target in ("relu", "relu_") and not n.kwargs


def _residual_ends(block: torch.nn.Module, graph: Any) -> list[tuple[Any, Any, Any]]:
    """(bn, add, relu) nodes of ``graph`` (``block``'s forward) computing relu(bn(x) + r): a fusekit
    BatchNorm2d without an activation of its own, its output used by the add alone, the sum by the ReLU alone."""
    found = []
    for add in graph.nodes:
        if not _is_add(add) or len(add.users) != 1:
            continue
        relu = next(iter(add.users))
        if not _is_plain_relu(block, relu):
            continue
        for i, bn in enumerate(add.args):
            other = add.args[1 - i]
            if (isinstance(bn, torch.fx.Node) and isinstance(other, torch.fx.Node) and other is not bn and bn.op == "call_module"
                    and len(bn.args) == 1 and not bn.kwargs and len(bn.users) == 1):
                m = block.get_submodule(bn.target)
                if type(m) is BatchNorm2d and m._fk_act() is None:
                    found.append((bn, add, relu))
                    break
    return found


def _feeds_only(block: torch.nn.Module, x: Any, bn: Any) -> bool:
    """Whether fx node ``x`` is a call of a fusekit Conv2d on one tensor whose only user is ``bn``, the BN it folds into in eval."""
    return (x.op == "call_module" and len(x.args) == 1 and not x.kwargs and len(x.users) == 1
            and type(block.get_submodule(x.target)) is Conv2d and block.get_submodule(x.target)._fk_bn is block.get_submodule(bn.target))


def _fuse_residual_ends(model: torch.nn.Module, names: dict[int, str], report: ConvertReport) -> None:
    """Rewrite the forward of every module that ends a residual block as relu(bn(x) + r) (torchvision's
    BasicBlock / Bottleneck: ``out = bn3(...); out += identity; out = relu(out)``) into one call
    ``bn3(x, r)``: training runs BN + add + ReLU as one graph, its backward the residual's gradient and
    the BN backward (one graph where cuDNN has an engine). The conv before bn3, when it folds bn3 in eval, is handed r
    too (``conv3(h, r)``, called where r is ready): eval without autograd runs one conv + bias + add +
    ReLU graph. The module's forward becomes the rewritten trace (an instance
    attribute; the class, parameters and state-dict keys stay). A forward traced differently in training
    and eval mode, or not traceable, stays as it is."""
    for m in list(model.modules()):
        if isinstance(m, _Fusekit) or next(m.children(), None) is None or "forward" in m.__dict__:
            continue
        if type(m).forward is torch.nn.Sequential.forward:
            continue
        mode = m.training
        try:
            traces = []
            for training in (True, False):
                m.train(training)
                traces.append(_ChildrenAsLeaves().trace(m))
        except Exception:  # noqa: BLE001 - not traceable: left as it is
            continue
        finally:
            m.train(mode)
        graph = traces[0]
        if str(graph) != str(traces[1]):
            continue
        ends = _residual_ends(m, graph)
        if not ends:
            continue
        for bn, add, relu in ends:
            x, r = bn.args[0], add.args[1] if add.args[0] is bn else add.args[0]
            conv = x if _feeds_only(m, x, bn) else None
            with graph.inserting_before(add):  # after r's producer: a conv handed r is called there
                if conv is not None:
                    x = graph.call_module(conv.target, (conv.args[0], r))
                fused = graph.call_module(bn.target, (x, r))
            relu.replace_all_uses_with(fused)
            for n in (relu, add, bn) + ((conv,) if conv is not None else ()):
                graph.erase_node(n)
            prefix = "" if m is model else names[id(m)] + "."
            after = prefix + str(relu.target) if relu.op == "call_module" else "relu"
            report.fused.append(((prefix + str(bn.target), f"+ {r.name}", after),
                                 "training: BN + residual add + ReLU as one graph (backward: the residual's gradient and the BN "
                                 "backward, one graph where cuDNN has an engine); eval: "
                                 + ("conv + folded BN + add + ReLU as one graph without autograd, " if conv is not None else "")
                                 + "add + ReLU as one graph"))
        graph.lint()
        code = torch.fx.GraphModule(m, graph)
        m.forward = types.MethodType(type(code).forward, m)


def convert(module: torch.nn.Module, *, inplace: bool = False, fuse: bool = True, fuse_residual: bool = True
            ) -> tuple[torch.nn.Module, ConvertReport]:
    """Move ``module`` onto fusekit: every ``nn.Conv2d``, ``nn.ConvTranspose2d``, ``nn.Linear``,
    ``nn.BatchNorm2d``, ``nn.ReLU``, ``nn.ReLU6``, ``nn.MaxPool2d``, ``nn.AvgPool2d``, ``nn.Softmax``
    and ``nn.LogSoftmax`` (exact types, not subclasses) becomes its fusekit.torch module: the same
    object re-classed, so parameters, buffers, hooks, state-dict keys and optimizer references stay.

    With ``fuse``, modules whose every call feeds exactly one call of the next (found from a
    ``torch.fx`` trace in training and eval mode, else from nn.Sequential order) run together:
    conv -> BN [-> ReLU or ReLU6] (training: conv, then the fused BN+ReLU graph; eval: BN folded into
    one conv+bias[+ReLU] graph), BN -> ReLU / ReLU6, conv -> ReLU / ReLU6, transposed conv / Linear ->
    ReLU. The producer then computes its followers' work and they pass its output on: calling a fused
    producer on its own returns the fused result (as torch.ao.quantization.fuse_modules does). A conv
    whose input is a ReLU or ReLU6 module's output that nothing else uses runs that ReLU's backward in
    its dgrad (training).
    With ``fuse_residual`` (and ``fuse``), each module whose forward ends a residual block as
    relu(bn(x) + r) (torchvision's BasicBlock / Bottleneck) is rewritten to end in one
    ``BatchNorm2d(x, r)`` call: BN + add + ReLU as one graph in training (backward: the residual's
    gradient with the BN backward, one graph where cuDNN has an engine); in eval without autograd the
    conv before it, its folded BN, the add and the ReLU as one graph (with autograd: the folded conv,
    then add + ReLU as one graph). That module's forward becomes its rewritten
    ``torch.fx`` trace (an instance attribute; class, parameters and state-dict keys stay);
    ``fuse_residual=False`` leaves every forward as it is.
    The links are plain attributes (not submodules, not in the state dict; deepcopy keeps them
    within the copy); nn.DataParallel's replicas would share the original's, so use
    DistributedDataParallel or ``fuse=False``.

    ``inplace=False`` converts a deep copy. Returns (model, report); ``print(report)`` lists what was
    replaced, fused and left alone, with reasons."""
    if not isinstance(module, torch.nn.Module):
        raise OperandError("fusekit.torch.convert", "module", f"expected a torch.nn.Module, got {type(module).__name__}", what="argument")
    model = module if inplace else copy.deepcopy(module)
    report = ConvertReport()
    names: dict[int, str] = {}
    for name, m in model.named_modules():
        names.setdefault(id(m), name or "(root)")

    links: dict[int, int] = {}
    relu_fed: dict[int, str] = {}
    if not fuse:
        report.analysis = "fusion off"
    else:
        try:
            links, report.notes, relu_fed = _fx_consumers(model)
            report.analysis = "call order from torch.fx traces in training and eval mode"
        except Exception as e:  # noqa: BLE001 - any tracing failure: fall back to Sequential order
            links = _sequential_consumers(model)
            report.analysis = f"call order from nn.Sequential containers only (torch.fx could not trace: {type(e).__name__}: {str(e)[:120]})"

    converted: dict[int, Any] = {}
    for name, m in model.named_modules():
        if isinstance(m, _Fusekit):
            converted[id(m)] = m
            continue
        target = _TARGETS.get(type(m))
        if target is None:
            if next(m.children(), None) is None:  # a leaf: say why it stays PyTorch's
                base = next((t.__name__ for t in _TARGETS if isinstance(m, t)), None)
                why = (f"a subclass of torch.nn.{base} (its forward may differ): runs in PyTorch" if base
                       else "no fusekit module: runs in PyTorch")
                report.left_alone.append((name or "(root)", type(m).__name__, why))
            continue
        original = type(m)
        try:
            m.__class__ = target
            m._fk_setup()
        except OperandError as e:
            m.__class__ = original
            report.left_alone.append((name or "(root)", original.__name__, str(e)))
            continue
        converted[id(m)] = m
        report.replaced.append((name or "(root)", original.__name__, f"fusekit.torch.{target.__name__}"))

    for p, c in links.items():
        if p in converted and c in converted:
            _link(converted[p], converted[c])
    report.fused = _describe_groups(model, names)
    if fuse and fuse_residual:
        _fuse_residual_ends(model, names, report)
    for i, relu in relu_fed.items():
        if isinstance(converted.get(i), Conv2d):
            converted[i].__dict__["_fk_drelu"] = True
            report.fused.append(((relu, names[i]), "training backward: the ReLU's backward runs in the conv's dgrad (one dgrad + dReLU graph)"))
    return model, report


# ----------------------------------------------------------------------------------------------
# CUDA graphs
# ----------------------------------------------------------------------------------------------
_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)


def graphed(model: torch.nn.Module, sample: torch.Tensor | None = None, *, autocast: Any = None, warmup: int = 3,
            max_graphs: int = 4, eval_graphs: bool = True) -> torch.nn.Module:
    """``model`` with its training forward and backward replayed as CUDA graphs: the fast way to
    train a converted model (each graph replays every layer's work in one launch; fusekit's host
    work per layer is paid at capture only). The loop around it stays as it is: loss, GradScaler,
    optimizer, gradient accumulation. Returns ``model`` itself (same parameters and state-dict keys).

    A training-mode call with grad enabled and one CUDA tensor ``x`` is captured per input
    signature (shape, strides, dtype, device, requires_grad, the autocast dtype in force): the
    first ``warmup`` calls of a signature run uncaptured (ordinary training steps, which build
    fusekit's plans), the next one captures the forward and backward and every later one replays
    them. Eval-mode calls without autograd (``torch.no_grad()`` / ``inference_mode()``: validation,
    inference) are captured the same way per signature, forward only (``eval_graphs=False``: they
    run uncaptured); each replay reads the weights and running statistics as they are then (BN
    folds are inside the graph). At most ``max_graphs`` signatures are captured, training and eval
    together; further ones, eval calls with autograd and train-mode calls without it run
    uncaptured. Moving the model (``.to``, ``.half``) drops its graphs; copies (``copy.deepcopy``)
    and pickles of it carry none and capture their own.

    ``sample`` (optional): capture ``sample``'s signature now, under ``autocast`` (float16 /
    bfloat16, or None for the model's own dtypes), after ``warmup`` forward + backward passes on a
    copy of it (these move batch-norm running statistics as training steps would).

    Outputs are the caller's own tensors (copied out of the graphs' buffers); gradients accumulate
    into ``.grad`` as uncaptured ones do. A call made while an earlier replay's backward is still to
    come (two forwards, then one backward) runs uncaptured. Submodules must not have hooks, and the forward must be
    capturable (no host synchronisation, no data-dependent control flow)."""
    who = "fusekit.torch.graphed"
    _check_wrappable(model, who)
    if autocast is not None and autocast not in _AUTOCAST_DTYPES:
        raise OperandError(who, "autocast", f"expected None, torch.float16 or torch.bfloat16, got {autocast!r}", what="argument")
    _check_count(who, "warmup", warmup, " (fusekit builds its plans in those passes)")
    _check_count(who, "max_graphs", max_graphs)
    if sample is not None:
        if not isinstance(sample, torch.Tensor):
            raise OperandError(who, "sample", f"expected a CUDA tensor, got {type(sample).__name__}")
        if not sample.is_cuda:
            raise OperandError(who, "sample", f"expected a CUDA tensor, got one on {sample.device} (CUDA graphs run on the GPU)")
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            if t.device != sample.device:
                raise OperandError(who, f"model.{name}", f"expected on {sample.device} (the sample's device), got {t.device}")
    if not isinstance(eval_graphs, bool):
        raise OperandError(who, "eval_graphs", f"expected True or False, got {eval_graphs!r}", what="argument")
    fwd = _GraphedForward(model, model.forward, warmup, max_graphs, eval_graphs)
    if sample is not None:
        model.train()
        fwd.capture_now(sample, autocast)
    model.forward = fwd
    return model


def replayed(model: torch.nn.Module, *, warmup: int = 2, max_tapes: int = 4) -> torch.nn.Module:
    """``model`` with its training steps replayed from tapes: the fast way to train a converted model
    uncaptured (no CUDA graph; any input shape). Returns ``model`` itself (same parameters and
    state-dict keys); the loop around it stays as it is.

    For a training-mode call with grad enabled on one tensor ``x``, per input signature (shape,
    strides, dtype, device, requires_grad, the CUDA autocast dtype, the current stream, the thread):
    the first ``warmup`` calls run as modules (fusekit builds its plans), the next ones are recorded
    (the aten ops and fusekit graphs the forward and its backward ran), and once two recordings
    agree every later call replays them under one autograd node: the same kernels, new outputs,
    none of the modules' Python. Batch-norm running statistics move as they would. Autocast casts
    and buffer updates replay merged into foreach launches, and fusekit's intermediate outputs go
    into buffers kept from step to step (one input signature's at a time, about the memory one step
    peaks at); the results are the same.

    Calls in eval mode or without grad, inside a CUDA-graph capture, and signatures the forward
    cannot be replayed for (a host read such as ``.item()``, an in-place write to the input or a
    parameter, an output that is not one tensor, recordings that differ) run as modules; the last
    warn once. At most ``max_tapes`` signatures get tapes. Moving the model (``.to``, ``.half``),
    replacing a parameter or clearing fusekit's dispatch re-records. A replay's backward runs once
    (no ``retain_graph``); ``model.forward.enabled = False`` turns replays off. Submodules must not
    have hooks (a replay would skip them)."""
    who = "fusekit.torch.replayed"
    _check_wrappable(model, who)
    _check_count(who, "warmup", warmup)
    _check_count(who, "max_tapes", max_tapes)
    model.forward = ReplayedForward(model, model.forward, warmup, max_tapes)
    return model


def _check_count(who: str, name: str, v: Any, why: str = "") -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise OperandError(who, name, f"expected an int >= 1{why}, got {v!r}", what="argument")


def _check_wrappable(model: Any, who: str) -> None:
    """A module whose forward graphed / replayed may take over: no hooks, not wrapped already."""
    if not isinstance(model, torch.nn.Module):
        raise OperandError(who, "model", f"expected a torch.nn.Module, got {type(model).__name__}", what="argument")
    hooked = [n or "model" for n, m in model.named_modules()
              if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or getattr(m, "_backward_pre_hooks", None)]
    if hooked:
        raise OperandError(who, "model", f"has hooks registered on it ({', '.join(hooked[:3])}): a replay would skip them; "
                           "remove them first", what="argument")
    wrapped = model.__dict__.get("forward")
    if isinstance(wrapped, (_GraphedForward, ReplayedForward)):
        kind = "graphed" if isinstance(wrapped, _GraphedForward) else "replayed"
        raise OperandError(who, "model", f"is {kind} already", what="argument")


def _flat_outputs(out: Any) -> tuple:
    """A forward's result as a tuple of tensors (a tensor, or a tuple / list of them), else TypeError."""
    outs = (out,) if isinstance(out, torch.Tensor) else tuple(out) if isinstance(out, (tuple, list)) else None
    if outs is None or not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        raise TypeError(f"the forward returned {type(out).__name__}; graphs are made for a tensor or a tuple / list of tensors")
    return outs


class _Captured:
    """One input signature's forward and backward CUDA graphs and their static buffers.

    The forward is captured with the parameters swapped for fresh leaves sharing their memory
    (``torch.func.functional_call``): gradients are taken for those, so autograd nodes kept alive
    from earlier steps (on another stream) take no part in the capture. ``train`` False: an eval
    forward without autograd, no backward graph (:meth:`replay_eval`)."""

    def __init__(self, graphed: "_GraphedForward", x: torch.Tensor, amp: Any, train: bool = True) -> None:
        self.handed: tuple = ()
        self.pending: Any = None  # weak reference to the autograd node of a replay whose backward is still to come
        if not train:
            self._capture_eval(graphed, x, amp)
            return
        named = [(n, p) for n, p in graphed.model.named_parameters() if p.requires_grad]
        self.params = tuple(p for _, p in named)
        leaves = {n: p.detach().requires_grad_() for n, p in named}
        self.x = x.detach().clone(memory_format=torch.preserve_format).requires_grad_(x.requires_grad)
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        wrt = ((self.x,) if self.x.requires_grad else ()) + tuple(leaves.values())
        torch.cuda.synchronize()
        graphed.capturing = True
        try:
            with _autocast_as(amp):
                with torch.cuda.graph(self.fwd):
                    out = torch.func.functional_call(graphed.model, leaves, (self.x,))
                self.outs = _flat_outputs(out)
                self.kind = None if isinstance(out, torch.Tensor) else type(out)
                self.diff = tuple(o.requires_grad for o in self.outs)
                self.grad_outs = tuple(torch.empty_like(o) for o, d in zip(self.outs, self.diff) if d)
                with torch.cuda.graph(self.bwd, pool=self.fwd.pool()):
                    self.grads = torch.autograd.grad([o for o, d in zip(self.outs, self.diff) if d], wrt, self.grad_outs,
                                                     allow_unused=True) if any(self.diff) and wrt else ()
        finally:
            graphed.capturing = False
        torch.cuda.synchronize()

    def _capture_eval(self, graphed: "_GraphedForward", x: torch.Tensor, amp: Any) -> None:
        """The forward alone, without autograd; buffers that are ordinary tensors (not inference
        tensors), so a capture made under ``inference_mode`` replays under ``no_grad`` too."""
        self.params, self.bwd, self.grad_outs, self.grads = (), None, (), ()
        with torch.inference_mode(False), torch.no_grad():
            self.x = x.detach().clone(memory_format=torch.preserve_format)
            self.fwd = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            graphed.capturing = True
            try:
                with _autocast_as(amp), torch.cuda.graph(self.fwd):
                    out = graphed.original(self.x)
            finally:
                graphed.capturing = False
            torch.cuda.synchronize()
        self.outs = _flat_outputs(out)
        self.kind = None if isinstance(out, torch.Tensor) else type(out)
        self.diff = (False,) * len(self.outs)

    def replay_eval(self, x: torch.Tensor) -> Any:
        """An eval capture replayed on ``x``: the outputs are the caller's own copies."""
        self.x.copy_(x)
        self.fwd.replay()
        return self.result(tuple(o.clone(memory_format=torch.preserve_format) for o in self.outs))

    def result(self, outs: tuple) -> Any:
        return outs[0] if self.kind is None else self.kind(outs)


class _Replay(torch.autograd.Function):
    """A captured forward replayed (input copied in, outputs copied out), its backward replayed."""

    @staticmethod
    def forward(ctx: Any, cap: _Captured, x: torch.Tensor, *params: torch.Tensor) -> tuple:
        ctx.cap = cap
        cap.x.copy_(x)
        cap.fwd.replay()
        outs = tuple(o.detach().clone(memory_format=torch.preserve_format) for o in cap.outs)  # the next replay overwrites cap.outs
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, cap.diff) if not d])
        cap.pending = weakref.ref(ctx) if any(cap.diff) else None  # alive while this replay's backward can still run
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Any) -> tuple:
        cap = ctx.cap
        cap.pending = None
        for buf, g in zip(cap.grad_outs, [g for g, d in zip(grads, cap.diff) if d]):
            buf.zero_() if g is None else buf.copy_(g)
        cap.bwd.replay()
        # Kept referenced: autograd then copies them into (or adds them to) .grad instead of adopting
        # the graph's buffers as .grad, which the next replay would overwrite.
        cap.handed = tuple(None if g is None else g.detach() for g in cap.grads) or (None,) * (cap.x.requires_grad + len(cap.params))
        gx = cap.handed[0] if cap.x.requires_grad else None
        return (None, gx) + cap.handed[int(cap.x.requires_grad):]


class _GraphedForward:
    """The forward :func:`graphed` puts on a model: replays a capture per input signature."""

    def __init__(self, model: torch.nn.Module, original: Any, warmup: int, max_graphs: int, eval_graphs: bool = True) -> None:
        self.model, self.original, self.warmup, self.max_graphs, self.eval_graphs = model, original, warmup, max_graphs, eval_graphs
        self.graphs: dict[tuple, _Captured] = {}
        self.calls: dict[tuple, int] = {}
        self.refused: dict[tuple, str] = {}
        self.attempts: dict[tuple, int] = {}
        self.tensors: tuple | None = None  # read on the first call: a copy being made has none yet
        self.state: tuple | None = None
        self.capturing = False

    def __reduce__(self) -> tuple:
        """Copies (``copy.deepcopy``, an EMA of the model) and pickles carry no graphs: a copy captures its own."""
        return (_regraphed, (self.model, self.warmup, self.max_graphs, self.eval_graphs))

    def _state(self) -> tuple:
        """Where the model's tensors live and which parameters want gradients: a change drops the graphs."""
        if self.tensors is None:
            self.tensors = tuple(itertools.chain(self.model.parameters(), self.model.buffers()))
        return tuple([(t.data_ptr(), t.requires_grad) for t in self.tensors])

    def signature(self, x: torch.Tensor) -> tuple:
        """What a capture is made for: shape, strides, dtype, device, requires_grad, the autocast dtype
        and whether it is a training step (forward and backward) or an eval forward."""
        return (tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad, _amp_dtype(), self.model.training)

    def capture_now(self, sample: torch.Tensor, amp: Any) -> None:
        """Capture ``sample``'s signature under ``amp`` after ``warmup`` forward + backward passes on a
        copy (on a side stream, as torch.cuda.make_graphed_callables warms up)."""
        self.state = self._state()
        x = sample.detach().clone(memory_format=torch.preserve_format).requires_grad_(sample.requires_grad)
        wrt = ((x,) if x.requires_grad else ()) + tuple(p for p in self.model.parameters() if p.requires_grad)
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream(sample.device)), _autocast_as(amp):
            for _ in range(self.warmup):
                outs = [o for o in _flat_outputs(self.original(x)) if o.requires_grad]
                if outs and wrt:
                    torch.autograd.grad(outs, wrt, [torch.randn_like(o) for o in outs], allow_unused=True)
                del outs  # nothing of the warm-up's autograd graph outlives it
            key = self.signature(x)
        self.graphs[key] = _Captured(self, x, amp)

    def _refuse(self, key: tuple, why: str) -> None:
        self.refused[key] = why
        warnings.warn(f"fusekit.torch.graphed: {'' if key[6] else 'eval '}input {key[2]} {key[0]} (autocast {key[5]}) runs uncaptured: {why}",
                      UserWarning, stacklevel=3)

    def eligible(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The input of a call graphs are made for (one CUDA tensor; training mode with grad enabled, or
        with ``eval_graphs`` eval mode without it), else None."""
        x = args[0] if len(args) == 1 and not kwargs else None
        return x if self.wants_graph() and isinstance(x, torch.Tensor) and x.is_cuda else None

    def wants_graph(self) -> bool:
        """Whether the model's mode and autograd make this call one that graphs are made for."""
        return torch.is_grad_enabled() if self.model.training else self.eval_graphs and not torch.is_grad_enabled()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        x = None if self.capturing else self.eligible(args, kwargs)
        if x is None:
            return self.original(*args, **kwargs)
        state = self._state()
        if state != self.state:  # moved (.to / .half) or requires_grad changed: the graphs read the old tensors
            self.graphs.clear()
            self.calls.clear()
            self.refused.clear()
            self.attempts.clear()
            self.state = state
        key = self.signature(x)
        cap = self.graphs.get(key)
        if cap is None:
            if key in self.refused:
                return self.original(x)
            n = self.calls[key] = self.calls.get(key, 0) + 1
            if n <= self.warmup:
                return self.original(x)
            if len(self.graphs) >= self.max_graphs:
                self._refuse(key, f"max_graphs={self.max_graphs} signatures are captured already")
                return self.original(x)
            try:
                cap = self.graphs[key] = _Captured(self, x, key[5], key[6])
            except CaptureError as e:  # raised before anything ran (a plan not built yet: the warm-up calls had no backward)
                self.attempts[key] = self.attempts.get(key, 0) + 1
                if self.attempts[key] >= 3:
                    self._refuse(key, f"capturing failed 3 times ({e})")
                self.calls[key] = 0  # warm up again, then try again
                return self.original(x)
            except Exception as e:
                raise CaptureError(f"fusekit.torch.graphed: capturing the {'training step' if key[6] else 'eval forward'} of input {key[2]} {key[0]} (autocast "
                                   f"{key[5]}) failed ({type(e).__name__}: {e}); the CUDA state may be unusable: run this "
                                   "model uncaptured instead") from e
        if not key[6]:
            return cap.replay_eval(x)
        if cap.pending is not None and cap.pending() is not None:
            # The last replay's backward has not run yet (two forwards, one backward): replaying now would
            # overwrite the activations it reads. This call runs uncaptured instead.
            return self.original(x)
        return cap.result(_Replay.apply(cap, x, *cap.params))


def _regraphed(model: torch.nn.Module, warmup: int, max_graphs: int, eval_graphs: bool = True) -> _GraphedForward:
    """A graphed forward, no graphs yet, over ``model``'s class forward (how copies and pickles come back)."""
    return _GraphedForward(model, type(model).forward.__get__(model), warmup, max_graphs, eval_graphs)
