"""What fusekit.torch's functions and modules share: the backend they run on (``ops``, ``pool``,
``on_graphs``, ``amp_dtype``: looked up here at each call, so a test can put a CPU stand-in in their
place), input handling, the tags that hand work from one module to the next, activation arguments."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..adapters import adapter_for
from ..errors import LayoutWarning, OperandError, TorchFallbackWarning, warn_once
from ..ops.common import ACTIVATIONS
# the backend, looked up as common.<name> at each call
from .. import ops, session  # noqa: F401
from ..ops import pool  # noqa: F401
from .replay import amp_dtype  # noqa: F401

F = torch.nn.functional

_GRAPH_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def on_graphs(x: Any, who: str, ranks: tuple[int, ...] | None = (4,)) -> bool:
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


def is_dense(x: torch.Tensor) -> bool:
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


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    """``t``'s memory format: channels-last where a 4-D ``t`` is that and not also plain contiguous."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` dense in ``ref``'s memory format (autograd may hand over strided gradients)."""
    return t.contiguous(memory_format=memory_format_of(ref))


def _cast(t: Any, dtype: Any) -> Any:
    """``t`` in ``dtype`` as autocast casts (differentiably; None, float64 and matching tensors stay)."""
    if t is None or dtype is None or t.dtype == dtype or t.dtype == torch.float64:
        return t
    return t.to(dtype)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _zero_bias(n: int, like: torch.Tensor) -> torch.Tensor:
    """A cached zero bias of ``n`` channels in ``like``'s dtype and device (bias=False with a fused epilogue)."""
    key = (like.device, like.dtype, n)
    table = session.current().table("zero_bias")
    z = table.get(key)
    if z is None:
        make = lambda: torch.zeros(n, device=like.device, dtype=like.dtype)  # noqa: E731
        z = table[key] = adapter_for(like).kept(make, like.device.index) if like.is_cuda else make()
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


def tagged(t: Any, name: str) -> Any:
    """The value :func:`_tag` attached to ``t`` under ``name``, or None (no tag, or ``t`` modified since)."""
    tag = getattr(t, name, None) if isinstance(t, torch.Tensor) else None
    return tag[0] if tag is not None and tag[1] == _version(t) else None


# Fusion across modules (set up by convert): a producer computes its followers' work too and tags
# its output with them; each follower, given exactly that tensor (same object, unmodified), passes
# it on instead of computing again. Any other input is computed as usual.
DONE = "_fusekit_done"
ADDED = "_fusekit_added"  # a conv's output that already holds relu(. + residual): id(residual)


def hand_on(y: torch.Tensor, followers: tuple) -> torch.Tensor:
    return _tag(y, DONE, tuple(id(m) for m in followers)) if followers else y


def already_done(x: Any, m: torch.nn.Module) -> bool:
    """Whether ``x`` is a producer's output that already holds ``m``'s work (then ``m`` passes it on)."""
    ids = tagged(x, DONE)
    if ids is None or ids[0] != id(m):
        return False
    if len(ids) > 1:
        _tag(x, DONE, ids[1:])
    else:
        delattr(x, DONE)
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


def relu_output_clip(x: Any) -> float | None:
    """The upper clip (inf: ReLU, 6: ReLU6) of the fusekit ReLU whose unmodified output ``x`` is (its
    gradient may carry the dReLU), or None."""
    return tagged(x, _RELU_OUT)


def _mark_relu_done(dx: torch.Tensor, relu_out: torch.Tensor) -> torch.Tensor:
    return _tag(dx, _RELU_DONE, relu_out.data_ptr())


def _relu_done(dy: Any, y: torch.Tensor | None) -> bool:
    """Whether ``dy`` already has the mask of the ReLU whose output is ``y`` applied (by the consumer's dgrad)."""
    return y is not None and tagged(dy, _RELU_DONE) == y.data_ptr()


def _check_act(act: str | None, who: str = "fusekit.torch", allowed: tuple[str, ...] = ("relu", "relu6")) -> str | None:
    if act is not None and act not in allowed:
        raise OperandError(who, "activation", f"expected None or {' or '.join(map(repr, allowed))}, got {act!r}", what="argument")
    return act


#: Activations a Conv2d fuses into its forward graph beside ReLU / ReLU6 (cuDNN pointwise modes or
#: compositions, as the pipeline's graphs): name -> PyTorch's default alpha where the name takes one.
EPILOGUES = {"silu": 0.0, "gelu": 0.0, "gelu_tanh": 0.0, "sigmoid": 0.0, "tanh": 0.0, "hardswish": 0.0, "hardsigmoid": 0.0,
             "leaky_relu": 0.01, "elu": 1.0}


def _epilogue(activation: Any, who: str, graphs: tuple[str, ...] = ("relu", "relu6")) -> tuple[str, float] | None:
    """(name, alpha) of a module's ``activation`` that its own ReLU graphs (``graphs``) do not compute:
    one of :data:`EPILOGUES` (a name, or (name, alpha) for leaky_relu's slope and elu's alpha), or
    "relu6" as ("clip", 6.0) where ``graphs`` lacks it; None for None and the names in ``graphs``."""
    if activation is None or activation in graphs:
        return None
    if activation == "relu6":
        return "clip", 6.0
    name, alpha = (activation, None) if isinstance(activation, str) else tuple(activation) if isinstance(activation, (tuple, list)) and len(activation) == 2 else (None, None)
    if name not in EPILOGUES or (alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)))):
        raise OperandError(who, "activation", f"expected None, 'relu', 'relu6', one of {sorted(EPILOGUES)} or (name, alpha) for "
                           f"'leaky_relu' / 'elu', got {activation!r}", what="argument")
    return name, float(EPILOGUES[name] if alpha is None else alpha)


def _apply_epilogue(y: torch.Tensor, act: tuple[str, float]) -> torch.Tensor:
    """PyTorch's activation ``act`` of ``y`` (autograd records it)."""
    name, alpha = act
    return {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "sigmoid": torch.sigmoid,
            "tanh": torch.tanh, "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "clip": lambda t: F.hardtanh(t, 0.0, alpha),
            "leaky_relu": lambda t: F.leaky_relu(t, alpha), "elu": lambda t: F.elu(t, alpha)}[name](y)


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


def padded_for_conv(x: torch.Tensor, pad: tuple[int, int, int, int], mode: str) -> torch.Tensor:
    """``F.pad(x, pad, mode)`` in x's memory format (the non-constant modes write NCHW)."""
    return _like(F.pad(x, pad, mode=mode), x)


