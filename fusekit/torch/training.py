"""fusekit's fused training graphs inside ``torch.compile``: custom ops for convolution (+ ReLU) and
training batch norm (+ ReLU) whose forward and backward run fusekit's fused graphs (dgrad + dReLU,
wgrad, bias gradient, batch-norm backward with the dReLU in front), and the rewrite that puts them in
a dynamo graph before AOTAutograd and Inductor compile the rest.

The ops (``torch.ops.fusekit.conv_act``, ``conv_act_backward``, ``batch_norm_act``,
``batch_norm_act_backward``) have fake implementations (shapes, dtypes and the memory format of
their outputs: the input's), PyTorch's own kernels on the CPU (what the CPU tests run) and fusekit's
graphs on CUDA tensors. Autocast is applied where the rewrite calls them (:func:`fused_conv`), as
PyTorch's autocast casts a convolution's operands; batch norm takes its input as it comes and gamma,
beta in float32.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch

from ..engine.patterns import conv_out_size
from ..errors import TorchFallbackWarning, UnsupportedError, warn_once
from . import common
from .common import _GRAPH_DTYPES, _clip, _like, memory_format_of
from .functions import bn_backward, bn_forward, conv_backward, conv_forward

__all__ = ["fused_conv", "fused_batch_norm", "training_graph"]

F = torch.nn.functional


def _kw(padding: list[int], stride: list[int], dilation: list[int], groups: int) -> dict:
    return {"padding": tuple(padding), "stride": tuple(stride), "dilation": tuple(dilation), "groups": groups}


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    """Batch norm's statistics and affine dtype for input ``x``: float32, float64 for float64 x."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _relu_mask(dy: torch.Tensor, y: torch.Tensor, act: str) -> torch.Tensor:
    keep = (y > 0) if act == "relu" else (y > 0) & (y < 6)
    return dy * keep


def _act(y: torch.Tensor, act: str) -> torch.Tensor:
    return F.relu6(y) if act == "relu6" else F.relu(y) if act == "relu" else y


def _on_fusekit(x: torch.Tensor, who: str, run: Callable[[], Any]) -> Any:
    """``run()`` (fusekit's graphs) for a CUDA ``x`` of a dtype they take; None for any other ``x``, or
    where cuDNN has no plan (said once per op and reason): the caller then runs PyTorch's kernels."""
    if not (x.is_cuda and x.dtype in _GRAPH_DTYPES and x.numel() > 0):
        return None
    try:
        return run()
    except UnsupportedError as e:
        warn_once(("training op", who, str(e)[:200]), f"fusekit {who}: {e}; running PyTorch's kernels for it", TorchFallbackWarning, stacklevel=3)
        return None


@torch.library.custom_op("fusekit::conv_act", mutates_args=())
def conv_act(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, padding: list[int], stride: list[int], dilation: list[int],
             groups: int, act: str) -> torch.Tensor:
    """act(conv2d(x, w) + b) in x's memory format; act "", "relu" or "relu6"."""
    x = _like(x, x)
    y = _on_fusekit(x, "conv2d", lambda: conv_forward(x, _like(w, x), b, _kw(padding, stride, dilation, groups), act or None))
    if y is None:
        y = _act(F.conv2d(x, w, b, stride, padding, dilation, groups), act)
    return _like(y, x)


@conv_act.register_fake
def _(x, w, b, padding, stride, dilation, groups, act):
    hw = [conv_out_size(x.shape[2 + i], w.shape[2 + i], padding[i], stride[i], dilation[i]) for i in range(2)]
    return x.new_empty((x.shape[0], w.shape[0], *hw)).contiguous(memory_format=memory_format_of(x))


@torch.library.custom_op("fusekit::conv_act_backward", mutates_args=())
def conv_act_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, padding: list[int], stride: list[int],
                      dilation: list[int], groups: int, act: str, has_bias: bool, needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) of :func:`conv_act`; an empty tensor where ``needs`` (or ``has_bias``) says none."""
    x = _like(x, x)
    dy = _like(dy, x)
    want = (needs[0], needs[1], needs[2] and has_bias)
    clip = _clip(act or None)
    got = _on_fusekit(x, "conv2d backward", lambda: conv_backward(dy, x, _like(w, x), _like(y, x) if clip is not None else None,
                                                                  _kw(padding, stride, dilation, groups), clip, has_bias, want))
    if got is not None:
        dx, dw, db = got
    else:
        g = _relu_mask(dy, y, act) if act else dy
        dx, dw, db = torch.ops.aten.convolution_backward(g, x, w, [w.shape[0]] if has_bias else None, stride, padding, dilation,
                                                         False, [0, 0], groups, list(want))
    return (_like(dx, x) if want[0] else x.new_empty(0), _like(dw, w) if want[1] else w.new_empty(0),
            db.to(w.dtype) if want[2] else w.new_empty(0))  # (separate empties: a custom op's outputs may not alias)


@conv_act_backward.register_fake
def _(dy, x, w, y, padding, stride, dilation, groups, act, has_bias, needs):
    return (x.new_empty(x.shape).contiguous(memory_format=memory_format_of(x)) if needs[0] else x.new_empty(0),
            w.new_empty(w.shape).contiguous(memory_format=memory_format_of(w)) if needs[1] else w.new_empty(0),
            w.new_empty(w.shape[0]) if needs[2] and has_bias else w.new_empty(0))


def _conv_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, w, b, padding, stride, dilation, groups, act = inputs
    ctx.save_for_backward(x, w, output)
    ctx.attrs = (padding, stride, dilation, groups, act, b is not None)


def _conv_grad(ctx: Any, dy: torch.Tensor) -> tuple:
    x, w, y = ctx.saved_tensors
    padding, stride, dilation, groups, act, has_bias = ctx.attrs
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    dx, dw, db = conv_act_backward(dy, x, w, y, padding, stride, dilation, groups, act, has_bias, needs)
    return (dx if needs[0] else None, dw if needs[1] else None, db if needs[2] and has_bias else None, None, None, None, None, None)


conv_act.register_autograd(_conv_grad, setup_context=_conv_setup)


@torch.library.custom_op("fusekit::batch_norm_act", mutates_args=())
def batch_norm_act(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                   z: torch.Tensor | None, momentum: float, eps: float, act: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training batch norm of x (gamma, beta float32; float64 for float64 x) [+ z, a residual, act then
    "relu"] then act: (y in x's memory format, batch mean, inverse standard deviation (gamma's dtype),
    the new running mean and variance, as PyTorch's)."""
    x = _like(x, x)
    z = None if z is None else _like(z, x)
    got = _on_fusekit(x, "batch_norm", lambda: bn_forward(x, gamma, beta, running_mean.float(), running_var.float(), eps, momentum,
                                                          _clip(act or None), z))
    if got is not None:
        y, mean, inv, rm, rv = got
    else:
        rm, rv = running_mean.clone(), running_var.clone()  # (native_batch_norm updates them in place)
        y, mean, inv = torch.ops.aten.native_batch_norm(x, gamma.to(x.dtype), beta.to(x.dtype), rm, rv, True, momentum, eps)
        y = _act(y if z is None else y + z, act)
    st = _stat_dtype(x)
    return (_like(y, x), mean.reshape(-1).to(st), inv.reshape(-1).to(st), rm.reshape(-1).to(running_mean.dtype),
            rv.reshape(-1).to(running_var.dtype))


@batch_norm_act.register_fake
def _(x, gamma, beta, running_mean, running_var, z, momentum, eps, act):
    c = x.shape[1]
    st = _stat_dtype(x)
    return (x.new_empty(x.shape).contiguous(memory_format=memory_format_of(x)), x.new_empty(c, dtype=st), x.new_empty(c, dtype=st),
            running_mean.new_empty(c), running_var.new_empty(c))


@torch.library.custom_op("fusekit::batch_norm_act_backward", mutates_args=())
def batch_norm_act_backward(dy: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, mean: torch.Tensor, inv: torch.Tensor, y: torch.Tensor,
                            eps: float, act: str, residual: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dgamma, dbeta, dz) of :func:`batch_norm_act` (dgamma, dbeta in gamma's dtype; dz, the
    residual's gradient, empty without one)."""
    x = _like(x, x)
    dy = _like(dy, x)
    dz = x.new_empty(0)
    clip = _clip(act or None)
    if residual:  # the dReLU, the residual's gradient and the BN backward in one graph
        got = _on_fusekit(x, "batch_norm backward", lambda: common.ops.batchnorm_backward(dy, x, gamma, mean, inv, y=_like(y, x), residual=True))
    else:
        got = _on_fusekit(x, "batch_norm backward", lambda: bn_backward(dy, x, gamma, mean, inv, _like(y, x) if act else None, (True, True, True),
                                                                        math.inf if clip is None else clip))
    if got is not None:
        dx, dg, db, dz = got if residual else (*got, dz)
    else:
        g = _relu_mask(dy, y, act) if act else dy
        dz = g if residual else dz
        dx, dg, db = torch.ops.aten.native_batch_norm_backward(g, x, gamma.to(x.dtype), None, None, mean.to(x.dtype), inv.to(x.dtype), True,
                                                               eps, [True, True, True])
    return _like(dx, x), dg.reshape(-1).to(gamma.dtype), db.reshape(-1).to(gamma.dtype), _like(dz, x) if residual else dz


@batch_norm_act_backward.register_fake
def _(dy, x, gamma, mean, inv, y, eps, act, residual):
    c, fmt = x.shape[1], memory_format_of(x)
    return (x.new_empty(x.shape).contiguous(memory_format=fmt), gamma.new_empty(c), gamma.new_empty(c),
            x.new_empty(x.shape).contiguous(memory_format=fmt) if residual else x.new_empty(0))


def _bn_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, gamma, _, _, _, z, _, eps, act = inputs
    y, mean, inv, rm, rv = output
    ctx.mark_non_differentiable(mean, inv, rm, rv)
    ctx.save_for_backward(x, gamma, mean, inv, y)
    ctx.attrs = (eps, act, z is not None)


def _bn_grad(ctx: Any, dy: torch.Tensor, *_: Any) -> tuple:
    x, gamma, mean, inv, y = ctx.saved_tensors
    dx, dg, db, dz = batch_norm_act_backward(dy, x, gamma, mean, inv, y, *ctx.attrs)
    return dx, dg, db, None, None, dz if ctx.attrs[2] else None, None, None, None


batch_norm_act.register_autograd(_bn_grad, setup_context=_bn_setup)


def _autocast(*ts: torch.Tensor | None) -> tuple:
    """``ts`` cast as autocast casts a convolution's operands (unchanged outside autocast)."""
    dev = ts[0].device.type
    if not torch.is_autocast_enabled(dev):
        return ts
    dt = torch.get_autocast_dtype(dev)
    return tuple(t if t is None or not t.is_floating_point() or t.dtype == torch.float64 else t.to(dt) for t in ts)


def fused_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: list[int], padding: list[int], dilation: list[int],
               groups: int, act: str) -> torch.Tensor:
    """What the rewrite calls for ``act(F.conv2d(x, w, b, stride, padding, dilation, groups))``."""
    x, w, b = _autocast(x, w, b)
    return torch.ops.fusekit.conv_act(x, w, b, padding, stride, dilation, groups, act)


def fused_batch_norm(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     momentum: float, eps: float, act: str, residual: torch.Tensor | None = None) -> torch.Tensor:
    """What the rewrite calls for ``act(F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    [+ residual])``: the running stats updated in place, as F.batch_norm does."""
    st = _stat_dtype(x)
    if residual is not None:
        residual = residual.to(x.dtype)
    y, _, _, rm, rv = torch.ops.fusekit.batch_norm_act(x, weight.to(st), bias.to(st), running_mean, running_var, residual, momentum, eps, act)
    with torch.no_grad():
        running_mean.copy_(rm)
        running_var.copy_(rv)
    return y


# -- the rewrite ------------------------------------------------------------------------------------

_CONVS = frozenset({torch.conv2d, F.conv2d})
_BNS = frozenset({F.batch_norm})
_RELUS = {torch.relu: "relu", F.relu: "relu", torch.relu_: "relu", F.relu6: "relu6"}
_ADDS = frozenset({operator.add, operator.iadd, torch.add})
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_BN_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}


def _named(node: Any, names: tuple, defaults: dict) -> dict | None:
    got = dict(defaults)
    if len(node.args) > len(names) or any(k not in names for k in node.kwargs):
        return None
    got.update(zip(names, node.args))
    got.update(node.kwargs)
    return got if all(n in got for n in names) else None


def _pair(v: Any) -> list[int] | None:
    v = [v, v] if isinstance(v, int) and not isinstance(v, bool) else list(v) if isinstance(v, (tuple, list)) else None
    return v if v is not None and len(v) == 2 and all(isinstance(i, int) and not isinstance(i, bool) for i in v) else None


def _meta(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if hasattr(node, "meta") else None


def _relu_of(node: Any) -> str | None:
    """"relu" / "relu6" where fx node ``node`` is a ReLU / ReLU6 of its first argument alone."""
    if node.op == "call_function" and node.target in _RELUS and set(node.kwargs) <= {"inplace"} and len(node.args) == 1:
        return _RELUS[node.target]
    if node.op == "call_function" and node.target is F.hardtanh:  # nn.ReLU6: hardtanh(x, 0, 6[, inplace])
        a = _named(node, ("input", "min_val", "max_val", "inplace"), {"min_val": -1.0, "max_val": 1.0, "inplace": False})
        return "relu6" if a is not None and a["min_val"] == 0 and a["max_val"] == 6 else None
    if node.op == "call_method" and node.target in ("relu", "relu_") and len(node.args) == 1 and not node.kwargs:
        return "relu"
    return None


def _sole_relu(node: Any) -> Any:
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].args and users[0].args[0] is node and _relu_of(users[0]) else None


def _is_add(node: Any) -> bool:
    """Whether fx node ``node`` adds its two tensor arguments (no alpha)."""
    if len(node.args) != 2 or node.kwargs:
        return False
    return (node.op == "call_function" and node.target in _ADDS) or (node.op == "call_method" and node.target in ("add", "add_"))


def _residual_end(node: Any) -> tuple[Any, Any, Any] | None:
    """(add, z, relu) where batch norm ``node``'s only user adds z of the same shape and dtype, and
    that sum's only user is a plain ReLU (a residual block's end)."""
    users = list(node.users)
    if len(users) != 1 or not _is_add(users[0]):
        return None
    add = users[0]
    z = add.args[1] if add.args[0] is node else add.args[0]
    relu = _sole_relu(add)
    y, zv = _meta(node), _meta(z) if isinstance(z, torch.fx.Node) else None
    if z is node or relu is None or _relu_of(relu) != "relu" or not isinstance(zv, torch.Tensor) or not isinstance(y, torch.Tensor):
        return None
    return (add, z, relu) if zv.shape == y.shape and zv.dtype == y.dtype else None


def _conv_call(node: Any) -> dict | None:
    if node.op != "call_function" or node.target not in _CONVS:
        return None
    a = _named(node, _CONV_ARGS, _CONV_DEFAULTS)
    if a is None or not all(isinstance(a[k], torch.fx.Node) for k in ("input", "weight")) or not isinstance(a["groups"], int):
        return None
    x, w = _meta(a["input"]), _meta(a["weight"])
    pads = [_pair(a[k]) for k in ("stride", "padding", "dilation")]
    if None in pads or not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point() or getattr(w, "dim", lambda: 0)() != 4:
        return None
    a["stride"], a["padding"], a["dilation"] = pads
    return a


def _bn_call(node: Any) -> dict | None:
    if node.op != "call_function" or node.target not in _BNS:
        return None
    a = _named(node, _BN_ARGS, _BN_DEFAULTS)
    if a is None or a["training"] is not True or not isinstance(a["momentum"], float) or not isinstance(a["eps"], float):
        return None
    if not all(isinstance(a[k], torch.fx.Node) for k in ("input", "running_mean", "running_var", "weight", "bias")):
        return None
    x = _meta(a["input"])
    return a if isinstance(x, torch.Tensor) and x.dim() == 4 else None


def training_graph(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str]]:
    """``gm`` (a dynamo graph) with its 2-D convolutions, training batch norms (with running stats and
    affine parameters), the ReLU / ReLU6 right after either (their only user) and residual block ends
    (batch norm, + z, ReLU) replaced by calls of fusekit's fused ops, and what was replaced (one line
    per fused op)."""
    graph, done = gm.graph, []
    for node in list(graph.nodes):
        conv, bn = _conv_call(node), _bn_call(node)
        if conv is None and bn is None:
            continue
        relu, residual = _sole_relu(node), _residual_end(node) if bn is not None else None
        act = _relu_of(relu) if relu is not None else "relu" if residual is not None else ""
        gone = [relu] if relu is not None else [residual[2], residual[0]] if residual is not None else []
        end = gone[0] if gone else node
        with graph.inserting_before(end):
            if conv is not None:
                new = graph.call_function(fused_conv, tuple(conv[k] for k in _CONV_ARGS) + (act,))
                done.append(f"{node.name}: conv2d{' + ' + act if act else ''}")
            else:
                args = tuple(bn[k] for k in ("input", "running_mean", "running_var", "weight", "bias", "momentum", "eps")) + (act,)
                new = graph.call_function(fused_batch_norm, args + ((residual[1],) if residual is not None else ()))
                done.append(f"{node.name}: batch_norm{' + residual' if residual is not None else ''}{' + ' + act if act else ''}")
        new.meta.update(end.meta)  # (the example value later matches read)
        end.replace_all_uses_with(new)
        for n in gone + [node]:
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return gm, done
