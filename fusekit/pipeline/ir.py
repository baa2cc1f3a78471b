"""The pipeline's internal representation: a flat list of :class:`Stage` records (plain data), the
shape rules of each stage kind, and the rewrites from the importers' primitive ops to fusekit calls.

Importers (``fx_import``, ``onnx_import``) emit *primitive* stages in topological order:

    conv, bn, relu, add, maxpool, avgpool, gap, flatten, linear, softmax, identity, torch

:func:`lower` rewrites them into *lowered* stages, each with a ``pattern``:

    conv_bias_relu / conv_bias_relu6 / conv_bias / conv_bias_add_relu / conv_bias_add
                                                      (BN folded, bias (+ residual add) (+ ReLU / ReLU6) epilogues)
    linear_bias / linear_bias_relu
    max_pool2d / avg_pool2d / softmax                 (fusekit.ops.pool kernels; GAP is avg_pool2d
                                                       with the whole plane as its window)
    reshape                                           (flatten: a copy into the output buffer)
    torch                                             (everything else: run by PyTorch, a fallback)

Weights are kept as float64 NumPy arrays (master copies; the GPU build casts them once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import UnsupportedError

FUSEKIT_PATTERNS = ("conv_bias_relu", "conv_bias_relu6", "conv_bias", "conv_bias_add_relu", "conv_bias_add", "linear_bias", "linear_bias_relu")
POOL_PATTERNS = ("max_pool2d", "avg_pool2d", "softmax")


class Ref(str):
    """A value name inside a torch fallback's argument template (as opposed to a constant)."""


@dataclass
class Stage:
    """One step of the network: ``output = kind/pattern(*inputs; weights, attrs)``."""

    kind: str
    inputs: list[str]
    output: str
    pattern: str = ""  # set by lower(): a fusekit pattern, a fusekit.pool kernel, "reshape" or "torch"
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
    if s.kind == "conv" and "w" in s.weights:
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


def conv_out_hw(h: int, w: int, kernel, padding, stride, dilation) -> tuple[int, int]:
    (r, s), (ph, pw), (sh, sw), (dh, dw) = _pair(kernel), _pair(padding), _pair(stride), _pair(dilation)
    return (h + 2 * ph - dh * (r - 1) - 1) // sh + 1, (w + 2 * pw - dw * (s - 1) - 1) // sw + 1


def pool_out_hw(h: int, w: int, kernel, stride, padding, ceil_mode: bool = False, dilation=1) -> tuple[int, int]:
    from ..ops.pool import pool2d_geometry  # the one output-size formula (floor or PyTorch's ceil_mode)

    g = pool2d_geometry((1, 1, h, w), kernel, stride, padding, "pipeline pool", ceil_mode, dilation)
    return g.ho, g.wo


def pool_options(s: Stage) -> dict[str, Any]:
    """A maxpool / avgpool stage's options as fusekit.pool's functions and references take them:
    ceil_mode, and dilation (max) or count_include_pad and divisor_override (average)."""
    a = s.attrs
    if s.kind == "maxpool":
        return {"ceil_mode": bool(a.get("ceil_mode")), "dilation": _pair(a.get("dilation", 1))}
    return {"ceil_mode": bool(a.get("ceil_mode")), "count_include_pad": bool(a.get("count_include_pad", True)),
            "divisor_override": a.get("divisor_override")}


def infer_shape(s: Stage, ins: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Output shape of stage ``s`` from its input shapes (fixed shapes only)."""
    x = tuple(ins[0]) if ins else ()
    k = s.kind
    if k == "conv":
        n, _, h, w = x
        kk = s.weights["w"].shape
        return (n, kk[0], *conv_out_hw(h, w, kk[2:], s.attrs["padding"], s.attrs["stride"], s.attrs["dilation"]))
    if k in ("bn", "relu", "identity", "softmax"):
        return x
    if k == "add":
        return tuple(np.broadcast_shapes(*[tuple(i) for i in ins]))
    if k in ("maxpool", "avgpool"):
        n, c, h, w = x
        return (n, c, *pool_out_hw(h, w, s.attrs["kernel_size"], s.attrs["stride"], s.attrs["padding"], bool(s.attrs.get("ceil_mode")),
                                   s.attrs.get("dilation", 1)))
    if k == "gap":
        return (x[0], x[1], 1, 1)
    if k == "flatten":
        return (x[0], int(math.prod(x[1:])))
    if k == "linear":
        return (*x[:-1], s.weights["w"].shape[0])
    if k == "torch":
        return torch_shape(s, ins)
    raise UnsupportedError(f"pipeline: no shape rule for stage kind {k!r}")


def torch_shape(s: Stage, ins: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Shape of a torch fallback: run it once on zeros in float32 on the CPU."""
    import torch

    env = {n: torch.zeros(shp, dtype=torch.float32) for n, shp in zip(s.inputs, ins)}
    with torch.no_grad():
        y = run_torch_stage(s, env, fn=s.fn, weights={k: torch.from_numpy(v).float() for k, v in s.weights.items()})
    return tuple(int(d) for d in y.shape)


def run_torch_stage(s: Stage, env: dict[str, Any], fn: Any, weights: dict[str, Any], device: Any = None, dtype: Any = None) -> Any:
    """Evaluate a ``kind == "torch"`` or torch-lowered stage with torch tensors (any device/dtype).

    ``env``: value name -> tensor; ``fn``: the callable to use (the module's copy on the right device);
    ``device`` / ``dtype``: where the argument template's constant tensors go (floating ones in ``dtype``)."""
    import torch
    import torch.nn.functional as F

    k = s.kind
    if k == "conv":  # grouped convs, or fused convs cuDNN refused
        a = s.attrs
        y = F.conv2d(env[s.inputs[0]], weights["w"], weights.get("b"), stride=_pair(a["stride"]), padding=_pair(a["padding"]),
                     dilation=_pair(a["dilation"]), groups=int(a.get("groups", 1)))
        if a.get("add"):
            y = y + env[s.inputs[1]]
        return _relu(y, a) if a.get("relu") else y
    if k == "linear":
        y = F.linear(env[s.inputs[0]], weights["w"], weights.get("b"))
        return torch.relu(y) if s.attrs.get("relu") else y
    if k == "bn":  # a batch norm with nothing to fold into: x * scale + shift per channel
        x = env[s.inputs[0]]
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * weights["scale"].reshape(shape) + weights["shift"].reshape(shape)
    if k == "relu":
        return _relu(env[s.inputs[0]], s.attrs)
    if k == "maxpool":
        a = s.attrs
        return F.max_pool2d(env[s.inputs[0]], _pair(a["kernel_size"]), _pair(a["stride"]), _pair(a["padding"]), **pool_options(s))
    if k in ("avgpool", "gap"):
        a = s.attrs
        return F.avg_pool2d(env[s.inputs[0]], _pair(a["kernel_size"]), _pair(a["stride"]), _pair(a["padding"]), **pool_options(s))
    if k == "softmax":
        return torch.softmax(env[s.inputs[0]], int(s.attrs["axis"]))
    if k == "add":
        return env[s.inputs[0]] + env[s.inputs[1]]
    if k == "torch":
        def conv(c: Any) -> Any:
            return c.to(device=device, dtype=dtype) if c.is_floating_point() else c.to(device=device)

        def sub(a: Any) -> Any:
            if isinstance(a, Ref):
                return env[a]
            if isinstance(a, np.ndarray):
                return conv(torch.from_numpy(a))
            if isinstance(a, torch.Tensor):
                return conv(a)
            if isinstance(a, (list, tuple)):
                return type(a)(sub(e) for e in a)
            if isinstance(a, dict):
                return {kk: sub(v) for kk, v in a.items()}
            return a

        args = sub(s.attrs.get("args", [Ref(n) for n in s.inputs]))
        kwargs = sub(s.attrs.get("kwargs", {}))
        return fn(*args, **kwargs)
    raise UnsupportedError(f"pipeline: stage kind {k!r} has no torch implementation")


def _relu(y: Any, attrs: dict[str, Any]) -> Any:
    """torch ReLU, clipped above at ``attrs["upper_clip"]`` when set (ReLU6)."""
    import torch

    clip = attrs.get("upper_clip")
    return torch.relu(y) if clip is None else torch.clamp(y, 0.0, float(clip))


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
        s.out_shape = tuple(int(d) for d in infer_shape(s, s.in_shapes))
        shapes[s.output] = s.out_shape


# ----------------------------------------------------------------------------------------------
# Rewrites
# ----------------------------------------------------------------------------------------------
def fold_bn_weights(w: np.ndarray, b: np.ndarray | None, mean, var, gamma, beta, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(w', b') with conv(x, w') + b' == BN(conv(x, w) + b), in float64."""
    scale = np.asarray(gamma, np.float64) / np.sqrt(np.asarray(var, np.float64) + float(eps))
    w2 = np.asarray(w, np.float64) * scale.reshape(-1, *([1] * (w.ndim - 1)))
    b0 = np.zeros(w.shape[0]) if b is None else np.asarray(b, np.float64)
    return w2, (b0 - np.asarray(mean, np.float64)) * scale + np.asarray(beta, np.float64)


def _uses(stages: list[Stage], output: str) -> dict[str, int]:
    n: dict[str, int] = {output: 1}  # the program's output counts as a use
    for s in stages:
        for i in s.inputs:
            n[i] = n.get(i, 0) + 1
    return n


def _rename(stages: list[Stage], old: str, new: str) -> None:
    for s in stages:
        s.inputs = [new if i == old else i for i in s.inputs]
        if "args" in s.attrs:
            s.attrs["args"] = _rename_args(s.attrs["args"], old, new)
        if "kwargs" in s.attrs:
            s.attrs["kwargs"] = _rename_args(s.attrs["kwargs"], old, new)


def _rename_args(a: Any, old: str, new: str) -> Any:
    if isinstance(a, Ref):
        return Ref(new) if a == old else a
    if isinstance(a, (list, tuple)):
        return type(a)(_rename_args(e, old, new) for e in a)
    if isinstance(a, dict):
        return {k: _rename_args(v, old, new) for k, v in a.items()}
    return a


def lower(prog: Program) -> Program:
    """Rewrite primitive stages into fusekit calls (see the module docstring); returns a new Program."""
    stages = [Stage(s.kind, list(s.inputs), s.output, s.pattern, dict(s.weights), dict(s.attrs), list(s.in_shapes),
                    tuple(s.out_shape), s.name, s.fn, s.reason) for s in prog.stages]
    output = prog.output

    # identities: drop, renaming their outputs to their inputs
    for s in [s for s in stages if s.kind == "identity"]:
        stages.remove(s)
        if s.output == output:
            output = s.inputs[0]
        _rename(stages, s.output, s.inputs[0])

    producer = {s.output: s for s in stages}

    def single_use_conv(v: str, uses: dict[str, int]) -> Stage | None:
        p = producer.get(v)
        return p if p is not None and p.kind == "conv" and uses.get(v, 0) == 1 and not p.attrs.get("relu") and not p.attrs.get("add") else None

    def residual_conv(a: Stage, uses: dict[str, int]) -> tuple[Stage, int] | None:
        """(conv, index of the other operand) when the same-shape add ``a`` has a single-use conv
        operand; broadcasting adds stay in PyTorch."""
        if not a.in_shapes or tuple(a.in_shapes[0]) != tuple(a.in_shapes[1]):
            return None
        for ci, zi in ((0, 1), (1, 0)):
            c = single_use_conv(a.inputs[ci], uses)
            if c is not None:
                return c, zi
        return None

    # 1. fold eval-mode batch norms into the conv before them
    uses = _uses(stages, output)
    for s in [s for s in stages if s.kind == "bn"]:
        c = single_use_conv(s.inputs[0], uses)
        if c is not None:
            w = s.weights
            c.weights["w"], c.weights["b"] = fold_bn_weights(c.weights["w"], c.weights.get("b"), w["mean"], w["var"], w["gamma"], w["beta"], s.attrs["epsilon"])
            c.name += "+" + s.name
            stages.remove(s)
            _rename(stages, s.output, c.output)
            if output == s.output:
                output = c.output
        else:  # nothing to fold into: a per-channel scale and shift, run by PyTorch
            w = s.weights
            scale = np.asarray(w["gamma"], np.float64) / np.sqrt(np.asarray(w["var"], np.float64) + s.attrs["epsilon"])
            s.weights = {"scale": scale, "shift": np.asarray(w["beta"], np.float64) - np.asarray(w["mean"], np.float64) * scale}
            s.pattern, s.reason = "torch", "batch norm not after a single-use convolution (cannot fold)"
    producer = {s.output: s for s in stages}

    # 2. residual tails: relu(conv(x) + b + z) when the add has a single-use conv operand
    uses = _uses(stages, output)
    for s in [s for s in stages if s.kind == "relu" and s.attrs.get("upper_clip") is None]:
        a = producer.get(s.inputs[0])
        if a is None or a.kind != "add" or uses.get(a.output, 0) != 1 or len(a.inputs) != 2:
            continue
        found = residual_conv(a, uses)
        if found is None:
            continue
        c, zi = found
        # the fused stage runs where the ReLU ran: x and z are both computed by then
        c.inputs = [c.inputs[0], a.inputs[zi]]
        c.attrs["add"], c.attrs["relu"] = True, True
        c.name += f"+{a.name}+{s.name}"
        stages.remove(a)
        stages.remove(c)
        stages[stages.index(s)] = c
        old = c.output
        c.output = s.output
        del producer[old]
        producer[c.output] = c

    # 2b. linear residual tails: conv(x) + b + z (no activation after the add, as MobileNetV2)
    uses = _uses(stages, output)
    for a in [s for s in stages if s.kind == "add" and len(s.inputs) == 2]:
        found = residual_conv(a, uses)
        if found is None:
            continue
        c, zi = found
        c.inputs = [c.inputs[0], a.inputs[zi]]
        c.attrs["add"] = True
        c.name += f"+{a.name}"
        stages.remove(c)
        stages[stages.index(a)] = c
        del producer[c.output]
        c.output = a.output
        producer[c.output] = c
        uses = _uses(stages, output)

    # 3. ReLU (ReLU6 for convs) epilogues of convs and linears
    uses = _uses(stages, output)
    for s in [s for s in stages if s.kind == "relu"]:
        p = producer.get(s.inputs[0])
        clip = s.attrs.get("upper_clip")
        if clip is not None and (p is None or p.kind != "conv" or p.attrs.get("add") or float(clip) != 6.0):
            continue  # clipped ReLUs fuse as ReLU6 into plain conv tails only
        if p is not None and p.kind in ("conv", "linear") and uses.get(p.output, 0) == 1 and not p.attrs.get("relu"):
            p.attrs["relu"] = True
            if clip is not None:
                p.attrs["upper_clip"] = float(clip)
            p.name += "+" + s.name
            stages.remove(s)
            _rename(stages, s.output, p.output)
            if output == s.output:
                output = p.output
            uses = _uses(stages, output)

    # 4. patterns
    for s in stages:
        if s.pattern:
            continue
        if s.kind == "conv":
            relu, add = bool(s.attrs.get("relu")), bool(s.attrs.get("add"))
            if add:
                s.pattern = "conv_bias_add_relu" if relu else "conv_bias_add"
            elif relu:
                s.pattern = "conv_bias_relu6" if s.attrs.get("upper_clip") is not None else "conv_bias_relu"
            else:
                s.pattern = "conv_bias"
            if "b" not in s.weights:
                s.weights["b"] = np.zeros(s.weights["w"].shape[0])
        elif s.kind == "linear":
            s.pattern = "linear_bias_relu" if s.attrs.get("relu") else "linear_bias"
            if "b" not in s.weights:
                s.weights["b"] = np.zeros(s.weights["w"].shape[0])
        elif s.kind == "maxpool":
            s.pattern = "max_pool2d"
        elif s.kind in ("avgpool", "gap"):
            s.pattern = "avg_pool2d"
        elif s.kind == "softmax":
            s.pattern = "softmax"
        elif s.kind == "flatten":
            s.pattern = "reshape"
        elif s.kind == "relu":
            s.pattern, s.reason = "torch", ("ReLU not after a single-use convolution or linear layer" if s.attrs.get("upper_clip") is None
                                            else f"clipped ReLU (max {s.attrs['upper_clip']}) not after a single-use convolution")
        elif s.kind == "add":
            s.pattern, s.reason = "torch", "add without a single-use convolution operand"
        elif s.kind == "torch":
            s.pattern = "torch"
            s.reason = s.reason or "no fusekit pattern"
        else:
            raise UnsupportedError(f"pipeline: cannot lower stage kind {s.kind!r}")
        if s.kind == "gap":
            h, w = s.in_shapes[0][2:] if s.in_shapes else (None, None)
            s.attrs.update(kernel_size=(h, w), stride=(h, w), padding=(0, 0), count_include_pad=True)

    out = Program(stages, prog.input, prog.input_shape, output, prog.source)
    fill_shapes(out.stages, out.input, out.input_shape)
    for s in out.stages:
        if s.kind == "gap":
            h, w = s.in_shapes[0][2:]
            s.attrs.update(kernel_size=(h, w), stride=(h, w))
    return out
