"""The pipeline's internal representation: a flat list of :class:`Stage` records (plain data), the
shape rules of each stage kind, and PyTorch's implementation of each stage (fallbacks, and the
per-stage check and choice at build).

Importers (``fx_import``, ``onnx_import``, ``nn_import``) emit *primitive* stages in topological order:

    conv, bn, relu, act, add, mul, maxpool, avgpool, gap, flatten, linear, softmax, radix_softmax, shuffle, upsample, identity, torch

and the rules make ``cln`` (layer norm over channels) and ``gconv`` (a 1x1 convolution of an image
times its (N, C, 1, 1) gate) from them.

``rules.lower`` rewrites them into *lowered* stages, each with a ``pattern``: a fused cuDNN graph
(:data:`FUSEKIT_PATTERNS`: BN folded, bias, residual add and activation epilogues; scale-shift,
activation, add and squeeze-excitation gate graphs; a 1x1 convolution of a gated image as a batched
matmul with per-sample weights), a fusekit pooling kernel (:data:`POOL_PATTERNS`;
global average pooling is avg_pool2d over the whole plane), ``reshape`` (a copy) or ``torch`` (run by
PyTorch: a fallback).

Weights are kept as float64 NumPy arrays (master copies; the GPU build casts them once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..engine.folding import bn_scale_shift, fold_into_conv
from ..engine.patterns import conv_out_size
from ..errors import OperandError, UnsupportedError

FUSEKIT_PATTERNS = ("conv_bias_relu", "conv_bias_relu6", "conv_bias", "conv_bias_add_relu", "conv_bias_add", "conv_bias_act", "conv_bias_add_act",
                    "linear_bias", "linear_bias_relu", "linear_bias_act", "channel_scale_shift_act", "act", "add_act", "channel_gate",
                    "conv_bias_hardswish", "layernorm", "batched_matmul_bias", "batched_matmul_bias_add")
POOL_PATTERNS = ("max_pool2d", "avg_pool2d", "softmax", "radix_softmax", "channel_shuffle", "upsample_nearest2d")


class Ref(str):
    """A value name inside a torch fallback's argument template (as opposed to a constant)."""


@dataclass
class Stage:
    """One step of the network: ``output = kind/pattern(*inputs; weights, attrs)``."""

    kind: str
    inputs: list[str]
    output: str
    pattern: str = ""  # set by lower(): a fusekit pattern, a fusekit.pool kernel, "reshape", "concat", "channel_slice" or "torch"
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # float64 host copies
    attrs: dict[str, Any] = field(default_factory=dict)
    in_shapes: list[tuple[int, ...]] = field(default_factory=list)
    out_shape: tuple[int, ...] = ()
    name: str = ""  # source node(s), joined with "+" when fused
    fn: Callable | None = field(default=None, repr=False)  # torch fallbacks: module or function
    reason: str = ""  # torch fallbacks: why

    @property
    def fallback(self) -> bool:
        return self.pattern == "torch"

    def describe(self) -> str:
        ins = ", ".join(str(tuple(s)) for s in self.in_shapes)
        att = {k: v for k, v in self.attrs.items() if k not in ("args", "kwargs")}
        return f"{self.kind:<8} {self.pattern or '-':<20} {ins} -> {tuple(self.out_shape)} {att} [{self.name}]"


@dataclass
class Program:
    """A staged network: ``stages`` in execution order from ``input`` to ``output``."""

    stages: list[Stage]
    input: str
    input_shape: tuple[int, ...]
    output: str
    source: str = ""  # "torch.fx" | "onnx"

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.shapes()[self.output]

    @property
    def fallbacks(self) -> list[str]:
        return [f"{s.name}: {s.reason}" for s in self.stages if s.fallback]

    @property
    def fused_stages(self) -> int:
        """The stages that run as fusekit graphs, kernels or views (not PyTorch fallbacks)."""
        return sum(not s.fallback for s in self.stages)

    @property
    def fused_fraction(self) -> float:
        """The share of the stages that run as fusekit graphs, kernels or views."""
        return self.fused_stages / max(len(self.stages), 1)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        out = {self.input: tuple(self.input_shape)}
        for s in self.stages:
            out[s.output] = tuple(s.out_shape)
        return out

    def __str__(self) -> str:
        lines = [f"input {self.input} {tuple(self.input_shape)}"]
        lines += [f"{i:3d} {s.describe()}" for i, s in enumerate(self.stages)]
        lines.append(f"output {self.output} {self.output_shape}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Cost (for the roofline floor of each stage)
# ----------------------------------------------------------------------------------------------
def stage_cost(s: Stage, itemsize: int) -> tuple[float, float]:
    """(tensor-core flops, DRAM bytes) a stage needs at least: multiply-adds of its convolution or
    matmul (0 for the rest) and one read of every input and weight plus one write of its output."""
    elems = sum(math.prod(sh) for sh in s.in_shapes) + math.prod(s.out_shape)
    weights = sum(int(np.asarray(w).size) for w in s.weights.values())
    flops = 0.0
    if s.kind in ("conv", "gconv") and "w" in s.weights:
        k, cg, r, q = s.weights["w"].shape
        flops = 2.0 * math.prod(s.out_shape) * cg * r * q
    elif s.kind == "linear":
        flops = 2.0 * math.prod(s.out_shape) * s.weights["w"].shape[1]
    return flops, float((elems + weights) * itemsize)


# ----------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------
def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, (list, tuple)):
        return (int(v[0]), int(v[1])) if len(v) == 2 else (int(v[0]), int(v[0]))
    return int(v), int(v)


def conv_out_hw(h: int, w: int, kernel, padding, stride, dilation, extra=(0, 0)) -> tuple[int, int]:
    (r, s), (ph, pw), (sh, sw), (dh, dw), (eh, ew) = _pair(kernel), _pair(padding), _pair(stride), _pair(dilation), _pair(extra)
    return conv_out_size(h, r, ph, sh, dh, eh), conv_out_size(w, s, pw, sw, dw, ew)


def conv_padding(padding: Any, kernel: Any, dilation: Any = 1) -> dict[str, tuple[int, int]]:
    """A conv stage's padding attributes for PyTorch's ``padding``: an int or pair, or the strings
    "valid" (none) and "same" (stride 1: d * (k - 1) rows in all, the odd one after the input, as
    PyTorch pads), the one-sided part as ``extra_padding``."""
    if not isinstance(padding, str):
        return {"padding": _pair(padding)}
    if padding == "valid":
        return {"padding": (0, 0)}
    if padding != "same":
        raise ValueError(f"conv padding {padding!r}: expected 'same', 'valid', an int or a pair")
    total = [d * (k - 1) for d, k in zip(_pair(dilation), _pair(kernel))]
    before = tuple(t // 2 for t in total)
    after = tuple(t - b - b for t, b in zip(total, before))
    return {"padding": before} | ({"extra_padding": after} if any(after) else {})


def extra_padding(s: Stage) -> tuple[int, int]:
    """A conv stage's zero rows / columns after its input (bottom, right) beyond its padding."""
    return _pair(s.attrs.get("extra_padding", 0))


def pool_out_hw(h: int, w: int, kernel, stride, padding, ceil_mode: bool = False, dilation=1) -> tuple[int, int]:
    from ..ops.pool import pool2d_geometry  # the one output-size formula (floor or PyTorch's ceil_mode)

    g = pool2d_geometry((1, 1, h, w), kernel, stride, padding, "pipeline pool", ceil_mode, dilation)
    return g.ho, g.wo


def pool_stage(kind: str, x: str, output: str, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False, *,
               dilation: Any = 1, count_include_pad: bool = True, divisor_override: int | None = None, name: str = "") -> Stage:
    """A ``maxpool`` (with ``dilation``) or ``avgpool`` (with ``count_include_pad``, ``divisor_override``)
    stage as torch.nn's pooling modules define one; no stride (None or empty): the kernel's."""
    k = _pair(kernel_size)
    attrs: dict[str, Any] = dict(kernel_size=k, stride=_pair(stride) if stride else k, padding=_pair(padding), ceil_mode=bool(ceil_mode))
    if kind == "maxpool":
        attrs["dilation"] = _pair(dilation)
    else:
        attrs.update(count_include_pad=bool(count_include_pad), divisor_override=divisor_override)
    return Stage(kind, [x], output, attrs=attrs, name=name or output)


def pool_options(s: Stage) -> dict[str, Any]:
    """A maxpool / avgpool stage's options as fusekit.pool's functions and references take them:
    ceil_mode, and dilation (max) or count_include_pad and divisor_override (average)."""
    a = s.attrs
    if s.kind == "maxpool":
        return {"ceil_mode": bool(a.get("ceil_mode")), "dilation": _pair(a.get("dilation", 1))}
    return {"ceil_mode": bool(a.get("ceil_mode")), "count_include_pad": bool(a.get("count_include_pad", True)),
            "divisor_override": a.get("divisor_override")}


def is_global_pool(s: Stage) -> bool:
    """An average pool whose one window is the whole unpadded plane (global average pooling)."""
    if s.kind == "gap":
        return True
    if s.kind != "avgpool" or not s.in_shapes or len(s.in_shapes[0]) != 4:
        return False
    a, plane = s.attrs, tuple(s.in_shapes[0][2:])
    return (_pair(a["kernel_size"]) == plane and _pair(a.get("padding", 0)) == (0, 0)
            and tuple(s.out_shape[2:]) == (1, 1) and a.get("divisor_override") is None)


def infer_shape(s: Stage, ins: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Output shape of stage ``s`` from its input shapes (fixed shapes only)."""
    x = tuple(ins[0]) if ins else ()
    k = s.kind
    if k == "conv":
        if len(x) != 4:
            raise OperandError("pipeline", s.name, f"expected a 4-D (N, C, H, W) input to the convolution, got shape {x}", what="stage")
        n, c, h, w = x
        kk = s.weights["w"].shape
        if c != kk[1] * int(s.attrs.get("groups", 1)):
            raise OperandError("pipeline", s.name, f"expected {kk[1] * int(s.attrs.get('groups', 1))} input channels "
                               f"(its weights' {tuple(kk)}), got input shape {x}", what="stage")
        return (n, kk[0], *conv_out_hw(h, w, kk[2:], s.attrs["padding"], s.attrs["stride"], s.attrs["dilation"], extra_padding(s)))
    if k == "gconv":  # conv1x1(x * gate)
        return (x[0], s.weights["w"].shape[0], x[2], x[3])
    if k in ("bn", "relu", "act", "identity", "softmax", "radix_softmax", "cln", "shuffle"):
        return x
    if k in ("add", "mul"):
        return tuple(np.broadcast_shapes(*[tuple(i) for i in ins]))
    if k in ("maxpool", "avgpool"):
        n, c, h, w = x
        return (n, c, *pool_out_hw(h, w, s.attrs["kernel_size"], s.attrs["stride"], s.attrs["padding"], bool(s.attrs.get("ceil_mode")),
                                   s.attrs.get("dilation", 1)))
    if k == "gap":
        return (x[0], x[1], 1, 1)
    if k == "upsample":
        sh, sw = s.attrs["scale"]
        return (x[0], x[1], x[2] * sh, x[3] * sw)
    if k == "flatten":
        return (x[0], int(math.prod(x[1:])))
    if k == "linear":
        if not x or x[-1] != s.weights["w"].shape[1]:
            raise OperandError("pipeline", s.name, f"expected {s.weights['w'].shape[1]} input features (its weights' "
                               f"{tuple(s.weights['w'].shape)}), got input shape {x}", what="stage")
        return (*x[:-1], s.weights["w"].shape[0])
    if k == "torch":
        return torch_shape(s, ins)
    raise UnsupportedError(f"pipeline: no shape rule for stage kind {k!r}")


def torch_shape(s: Stage, ins: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Shape of a torch fallback: run it once on zeros on the CPU, in its module's float dtype (the fx
    importer's modules are float64) or float32."""
    import torch

    held = [t for t in s.fn.parameters()] + [t for t in s.fn.buffers()] if isinstance(s.fn, torch.nn.Module) else []
    dt = next((t.dtype for t in held if t.is_floating_point()), torch.float32)
    env = {n: torch.zeros(shp, dtype=dt) for n, shp in zip(s.inputs, ins)}
    with torch.no_grad():
        y = run_torch_stage(s, env, fn=s.fn, weights={k: torch.from_numpy(v).to(dt) for k, v in s.weights.items()},
                            device="cpu", dtype=dt)
    return tuple(int(d) for d in y.shape)


def torch_act(y: Any, act: tuple[str, float] | None, out: Any = None) -> Any:
    """PyTorch's ``act`` = (activation, alpha) of y (None: y itself); with ``out``, written into it
    (its strides kept: a channels-last buffer of the pipeline) and returned."""
    import torch
    import torch.nn.functional as F

    name, alpha = ("identity", 0.0) if act is None else (act[0], float(act[1]))
    if out is None:
        table = {
            "identity": lambda t: t, "relu": F.relu, "clip": lambda t: t.clamp(0.0, alpha), "silu": F.silu, "gelu": F.gelu,
            "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "sigmoid": lambda t: t.sigmoid(), "tanh": lambda t: t.tanh(),
            "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "leaky_relu": lambda t: F.leaky_relu(t, alpha),
            "elu": lambda t: F.elu(t, alpha),
        }
        return table[name](y)
    aten = torch.ops.aten
    into = {
        "identity": lambda: out.copy_(y), "relu": lambda: torch.clamp(y, min=0.0, out=out),
        "clip": lambda: torch.clamp(y, 0.0, alpha, out=out), "silu": lambda: aten.silu.out(y, out=out),
        # aten.gelu.out writes wrong values into an out of another memory format (PyTorch 2.14 CPU): a copy
        "gelu": lambda: out.copy_(F.gelu(y)), "gelu_tanh": lambda: out.copy_(F.gelu(y, approximate="tanh")),
        "sigmoid": lambda: torch.sigmoid(y, out=out), "tanh": lambda: torch.tanh(y, out=out),
        "hardswish": lambda: aten.hardswish.out(y, out=out), "hardsigmoid": lambda: aten.hardsigmoid.out(y, out=out),
        "leaky_relu": lambda: aten.leaky_relu.out(y, alpha, out=out), "elu": lambda: aten.elu.out(y, alpha, 1.0, 1.0, out=out),
    }
    if y is not out or name != "identity":
        into[name]()
    return out


def bind_constants(s: Stage, device: Any = None, dtype: Any = None) -> tuple[Any, Any]:
    """A torch fallback's (args, kwargs) template with its constants (arrays, tensors) moved to
    ``device`` (floating ones in ``dtype``) once; value references (:class:`Ref`) stay."""
    import torch

    def conv(c: Any) -> Any:
        c = c.detach()
        return c.to(device=device, dtype=dtype) if c.is_floating_point() else c.to(device=device)

    def sub(a: Any) -> Any:
        if isinstance(a, Ref):
            return a
        if isinstance(a, np.ndarray):
            return conv(torch.from_numpy(a))
        if isinstance(a, torch.Tensor):
            return conv(a)
        if isinstance(a, (list, tuple)):
            return type(a)(sub(e) for e in a)
        if isinstance(a, dict):
            return {kk: sub(v) for kk, v in a.items()}
        return a

    return sub(s.attrs.get("args", [Ref(n) for n in s.inputs])), sub(s.attrs.get("kwargs", {}))


def _fill(a: Any, env: dict[str, Any]) -> Any:
    if isinstance(a, Ref):
        return env[a]
    if isinstance(a, (list, tuple)):
        return type(a)(_fill(e, env) for e in a)
    if isinstance(a, dict):
        return {k: _fill(v, env) for k, v in a.items()}
    return a


def run_torch_stage(s: Stage, env: dict[str, Any], fn: Any, weights: dict[str, Any], device: Any = None, dtype: Any = None,
                    bound: tuple[Any, Any] | None = None, out: Any = None) -> Any:
    """Evaluate a stage with PyTorch (any device/dtype), without autograd.

    ``env``: value name -> tensor; ``fn``: the callable of a ``torch`` stage (the module's copy on
    the right device); ``weights``: the stage's weights as tensors; ``device`` / ``dtype``: where a
    ``torch`` stage's constants go, unless ``bound`` (:func:`bind_constants`) already holds them.
    ``out``: a tensor of the output's shape to write into (elementwise stages write it directly,
    without a temporary); returned."""
    import torch
    import torch.nn.functional as F

    k, a = s.kind, s.attrs
    act = a.get("act")
    if k == "relu":
        act = ("relu", 0.0) if a.get("upper_clip") is None else ("clip", float(a["upper_clip"]))
    elif k == "act" and act is None:
        act = (a["activation"], float(a["alpha"]))
    x = env[s.inputs[0]] if s.inputs else None

    def into(y: Any) -> Any:
        return y if out is None else out.copy_(y)

    with torch.no_grad():
        if k == "conv":  # grouped convs, or fused convs cuDNN refused
            eh, ew = extra_padding(s)
            y = F.conv2d(F.pad(x, (0, ew, 0, eh)) if eh or ew else x, weights["w"], weights.get("b"), stride=_pair(a["stride"]), padding=_pair(a["padding"]),
                         dilation=_pair(a["dilation"]), groups=int(a.get("groups", 1)))
            return torch_act(y + env[s.inputs[1]] if a.get("add") else y, act, out)
        if k == "gconv":  # split: the gate multiply, then the 1x1 convolution
            y = F.conv2d(x * env[s.inputs[1]], weights["w"], weights.get("b"))
            return torch_act(y + env[s.inputs[2]] if a.get("add") else y, act, out)
        if k == "linear":
            return torch_act(F.linear(x, weights["w"], weights.get("b")), act, out)
        if k == "bn":  # a batch norm with nothing to fold into: x * scale + shift per channel
            shape = (1, -1) + (1,) * (x.dim() - 2)
            scale, shift = weights["scale"].reshape(shape), weights["shift"].reshape(shape)
            if out is None:
                return torch_act(x * scale + shift, act)
            torch.addcmul(shift, x, scale, out=out)
            return torch_act(out, act, out)
        if k in ("relu", "act"):
            return torch_act(x, act, out)
        if k == "cln":
            return into(channel_layer_norm(x, weights["gamma"], weights["beta"], float(a["eps"])))
        if k == "maxpool":
            return into(F.max_pool2d(x, _pair(a["kernel_size"]), _pair(a["stride"]), _pair(a["padding"]), **pool_options(s)))
        if k in ("avgpool", "gap"):
            if is_global_pool(s):  # a reduction kernel: avg_pool2d's one thread per output is slow over a whole plane,
                # and cuDNN has no engine for the reduction alone (benchmarks/probes/probe_plane_reduction.py)
                return torch.mean(x, (2, 3), keepdim=True) if out is None else torch.mean(x, (2, 3), keepdim=True, out=out)
            return into(F.avg_pool2d(x, _pair(a["kernel_size"]), _pair(a["stride"]), _pair(a["padding"]), **pool_options(s)))
        if k == "softmax":
            return into(torch.softmax(x, int(a["axis"])))
        if k == "shuffle":
            return into(F.channel_shuffle(x, int(a["groups"])))
        if k == "radix_softmax":  # (card, radix, C) -> softmax over radix -> (radix, card, C)
            n, r, card = x.shape[0], int(a["radix"]), int(a["cardinality"])
            return into(x.reshape(n, card, r, -1).transpose(1, 2).softmax(1).reshape(x.shape))
        if k == "upsample":
            return into(F.interpolate(x, scale_factor=tuple(float(f) for f in a["scale"]), mode="nearest"))
        if k == "add":
            if act is None and out is not None:
                return torch.add(x, env[s.inputs[1]], out=out)
            return torch_act(x + env[s.inputs[1]], act, out)
        if k == "mul":
            return x * env[s.inputs[1]] if out is None else torch.mul(x, env[s.inputs[1]], out=out)
        if k == "torch":
            args, kwargs = bound if bound is not None else bind_constants(s, device, dtype)
            if out is not None and fn in (torch.cat, torch.concat, torch.add, torch.mul, torch.sub):  # written in place
                return fn(*_fill(args, env), **_fill(kwargs, env), out=out)
            return into(fn(*_fill(args, env), **_fill(kwargs, env)))
    raise UnsupportedError(f"pipeline: stage kind {k!r} has no torch implementation")


def concat_parts(s: Stage) -> list[str] | None:
    """The values a channel concatenation of 4-D images joins, in order (``torch.cat(xs, 1)``); None
    for any other stage."""
    if s.kind != "torch" or len(s.out_shape) != 4:
        return None
    import torch  # a torch stage was made with PyTorch present

    if s.fn not in (torch.cat, torch.concat):
        return None
    args, kw = s.attrs.get("args", []), s.attrs.get("kwargs", {})
    parts = args[0] if args else kw.get("tensors")
    dim = args[1] if len(args) > 1 else kw.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or dim not in (1, -3) or not all(isinstance(p, Ref) for p in parts):
        return None
    return [str(p) for p in parts]


def upsample_stage(name: str, x: str, output: str, in_shape: Any, out_shape: Any) -> Stage | None:
    """Nearest upsampling of an image from ``in_shape`` to ``out_shape`` as one ``upsample`` stage
    where each spatial factor is a whole power of two (there PyTorch's source index, floor(dst * in /
    out), is dst // factor exactly); None otherwise."""
    if len(in_shape) != 4 or len(out_shape) != 4 or tuple(in_shape[:2]) != tuple(out_shape[:2]):
        return None
    scale = []
    for i, o in zip(in_shape[2:], out_shape[2:]):
        f = int(o) // int(i) if int(i) else 0
        if f < 1 or f * int(i) != int(o) or f & (f - 1):
            return None
        scale.append(f)
    return Stage("upsample", [x], output, attrs={"scale": tuple(scale)}, name=name)


def adaptive_avg_stage(name: str, x: str, output: str, in_hw: Any, out_hw: Any) -> Stage | None:
    """An adaptive average pool of an image from ``in_hw`` to ``out_hw`` as what it is for those sizes:
    a global mean, nothing (the same size), an average pool of whole in/out windows, or (each window
    one pixel) a nearest upsampling by out/in; None for other sizes."""
    (h, w), (oh, ow) = (tuple(int(d) for d in in_hw), tuple(int(d) for d in out_hw))
    if (oh, ow) == (1, 1):
        return Stage("gap", [x], output, name=name)
    if (oh, ow) == (h, w):
        return Stage("identity", [x], output, name=name)
    if h % oh == 0 and w % ow == 0:
        return pool_stage("avgpool", x, output, (h // oh, w // ow), name=name)
    if oh % h == 0 and ow % w == 0:
        return Stage("upsample", [x], output, attrs={"scale": (oh // h, ow // w)}, name=name)
    return None


def channel_shuffle_stage(name: str, x: str, output: str, groups: int) -> Stage:
    """ShuffleNet's channel shuffle as one ``shuffle`` stage (the fx, export and ONNX routes' view /
    reshape, transpose and view back, which would be three copies): one pass of fusekit's kernel."""
    return Stage("shuffle", [x], output, attrs={"groups": int(groups)}, name=name)


def torch_fallback(name: str, inputs: list[str], output: str, fn: Callable, args: list | None = None,
                   kwargs: dict | None = None, reason: str = "no fusekit pattern") -> Stage:
    """A primitive stage PyTorch runs: ``fn(*args, **kwargs)`` with Ref(value) placeholders in args."""
    attrs: dict[str, Any] = {"op": getattr(fn, "__name__", type(fn).__name__)}
    if args is not None:
        attrs["args"] = args
    if kwargs:
        attrs["kwargs"] = kwargs
    return Stage("torch", list(inputs), output, attrs=attrs, name=name, fn=fn, reason=reason)


def fill_shapes(stages: list[Stage], input_name: str, input_shape: tuple[int, ...]) -> None:
    """Set every stage's in_shapes and out_shape, in order."""
    shapes: dict[str, tuple[int, ...]] = {input_name: tuple(int(d) for d in input_shape)}
    for s in stages:
        missing = [n for n in s.inputs if n not in shapes]
        if missing:
            raise UnsupportedError(f"pipeline: stage {s.name} reads {missing[0]!r} before it is computed")
        s.in_shapes = [shapes[n] for n in s.inputs]
        try:
            s.out_shape = tuple(int(d) for d in infer_shape(s, s.in_shapes))
        except (UnsupportedError, OperandError):
            raise
        except Exception as e:  # noqa: BLE001 - a stage run on stand-in values it cannot take (a bool mask as float): name it
            raise UnsupportedError(f"pipeline: cannot work out the output shape of stage {s.name} ({s.attrs.get('op', s.kind)}) "
                                   f"from inputs {s.in_shapes}: {type(e).__name__}: {e}") from e
        shapes[s.output] = s.out_shape


# ----------------------------------------------------------------------------------------------
# Rewrites
# ----------------------------------------------------------------------------------------------
def fold_bn_weights(w: np.ndarray, b: np.ndarray | None, mean, var, gamma, beta, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(w', b') with conv(x, w') + b' == BN(conv(x, w) + b), in float64."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    scale, shift = bn_scale_shift(f64(mean), f64(var), float(eps), f64(gamma), f64(beta))
    return fold_into_conv(f64(w), None if b is None else f64(b), scale, shift)


def rename(stages: list[Stage], old: str, new: str) -> None:
    for s in stages:
        s.inputs = [new if i == old else i for i in s.inputs]
        if "args" in s.attrs:
            s.attrs["args"] = rename_args(s.attrs["args"], old, new)
        if "kwargs" in s.attrs:
            s.attrs["kwargs"] = rename_args(s.attrs["kwargs"], old, new)


def rename_args(a: Any, old: str, new: str) -> Any:
    if isinstance(a, Ref):
        return Ref(new) if a == old else a
    if isinstance(a, (list, tuple)):
        return type(a)(rename_args(e, old, new) for e in a)
    if isinstance(a, dict):
        return {k: rename_args(v, old, new) for k, v in a.items()}
    return a


#: Weights a pattern takes in float32 whatever the pipeline's dtype (per-channel scale and shift).
FLOAT32_WEIGHTS = {"channel_scale_shift_act": ("scale", "shift"), "conv_bias_hardswish": ("gs", "gb"), "layernorm": ("gamma", "beta")}


def channel_layer_norm(x: Any, weight: Any, bias: Any, eps: float) -> Any:
    """PyTorch's LayerNorm over the channels of an (N, C, H, W) image at each position (on a
    channels-last image the permutes are views)."""
    import torch.nn.functional as F

    c = x.shape[1]
    w = None if weight is None else weight.to(x.dtype)
    b = None if bias is None else bias.to(x.dtype)
    return F.layer_norm(x.permute(0, 2, 3, 1), (c,), w, b, eps).permute(0, 3, 1, 2)


def channel_rows(a: Any) -> Any:
    """An (N, C, H, W) image as (N*H*W, C, 1, 1): one row of C channels per position, what cuDNN's layer
    norm normalizes over. A view for a dense channels-last torch tensor (a copy for NumPy arrays);
    :func:`from_pixel_rows` is its inverse too."""
    n, c, h, w = a.shape
    return pixel_rows(a).reshape(n * h * w, c, 1, 1)


def is_view_of(rows: Any, a: Any) -> bool:
    """Whether ``rows`` (:func:`channel_rows` or :func:`pixel_rows` of torch tensor ``a``) is a dense
    view of ``a``'s memory, not a copy."""
    return rows.data_ptr() == a.data_ptr() and rows.is_contiguous()


def pixel_rows(a: Any) -> Any:
    """An (N, C, H, W) image as (N, H*W, C): each sample's pixels as rows of channels, what a 1x1
    convolution multiplies by its weights. A view for a dense channels-last torch tensor (a copy for
    NumPy arrays)."""
    n, c, h, w = a.shape
    t = a.permute(0, 2, 3, 1) if hasattr(a, "permute") else np.transpose(a, (0, 2, 3, 1))
    return t.reshape(n, h * w, c)


def from_pixel_rows(rows: Any, shape: tuple[int, ...]) -> Any:
    """The inverse of :func:`pixel_rows` (and of :func:`channel_rows`) for an image of ``shape`` (N, C, H, W)."""
    n, c, h, w = shape
    t = rows.reshape(n, h, w, c)
    return t.permute(0, 3, 1, 2) if hasattr(t, "permute") else np.transpose(t, (0, 3, 1, 2))


def gate_scaled_weights(gate: Any, wt: Any, out: Any = None) -> Any:
    """Per-sample weights of a gated 1x1 convolution: (N, C, K) = gate (N, C, 1, 1) times the
    transposed weights ``wt`` (C, K), so that conv1x1(x * gate)[n] = pixel_rows(x)[n] @ result[n]."""
    g = gate.reshape(gate.shape[0], gate.shape[1], 1)
    if out is None:
        return g * wt
    import torch

    return torch.mul(g, wt, out=out)


def fused_operands(s: Stage, values: dict[str, Any], weights: dict[str, Any], scaled: Any = None) -> tuple[tuple, dict[str, Any]]:
    """(operands, attributes) of a stage with a fusekit pattern, as ``fusekit.ops.<pattern>`` and the
    oracle take them: ``values`` maps value names to arrays, ``weights`` the stage's weights (any array
    type); ``scaled``: a gconv stage's buffer of gate-scaled weights (default: computed here). The one
    place that says which operand and attribute each pattern reads."""
    x = values[s.inputs[0]]
    p, a = s.pattern, s.attrs
    act = a.get("act") or ("identity", 0.0)
    act_attrs = {"activation": act[0], "alpha": float(act[1])} if p.endswith("_act") or p == "act" else {}
    if p == "conv_bias_hardswish":
        conv = {k: tuple(int(e) for e in a[k]) for k in ("padding", "stride", "dilation")}
        return (x, weights["w"], weights["b"], weights["gs"], weights["gb"]), {**conv, "groups": int(a.get("groups", 1))}
    if p.startswith("conv"):
        ops = (x, weights["w"], weights["b"]) + ((values[s.inputs[1]],) if p.startswith("conv_bias_add") else ())
        conv = {k: tuple(int(e) for e in a[k]) for k in ("padding", "stride", "dilation")}
        extra = {"extra_padding": extra_padding(s)} if any(extra_padding(s)) else {}
        return ops, {**conv, "groups": int(a.get("groups", 1)), **act_attrs, **extra}
    if p.startswith("linear"):
        return (x, weights["w"], weights["b"]), act_attrs
    if p.startswith("batched_matmul_bias"):  # a gconv stage: x's pixel rows times the gate-scaled weights, per sample
        sw = gate_scaled_weights(values[s.inputs[1]], weights["wt"]) if scaled is None else scaled
        z = (pixel_rows(values[s.inputs[2]]),) if p.endswith("_add") else ()
        return (pixel_rows(x), sw, weights["b"]) + z, {}
    if p == "channel_scale_shift_act":
        return (x, weights["scale"], weights["shift"]), act_attrs
    if p in ("add_act", "channel_gate"):
        return (x, values[s.inputs[1]]), act_attrs
    if p == "act":
        return (x,), act_attrs
    if p == "layernorm":  # a cln stage: the image as rows of channels
        c = x.shape[1]
        return (channel_rows(x), weights["gamma"].reshape(1, c, 1, 1), weights["beta"].reshape(1, c, 1, 1)), {"epsilon": float(a["eps"])}
    raise UnsupportedError(f"pipeline: stage {s.name} has no fusekit pattern ({p!r})")
