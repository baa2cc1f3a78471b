"""The one set of lowering rules: primitive stages -> fusekit calls, as a table of small rules.

Each :class:`Rule` looks at stages of some kinds; its ``match`` returns what it found (or None) and
its ``rewrite`` changes the program. :data:`RULES` run in order, each over every stage; then each
stage left gets its pattern from :func:`pattern_for` (a fused cuDNN graph, a fusekit pooling kernel,
a reshape copy, or ``torch``: a PyTorch fallback, with the reason).

Epilogues are attributes of the producing stage: ``attrs["act"] = (activation, alpha)`` (see
``fusekit.patterns.ACTIVATIONS``) and ``attrs["add"] = True`` (a residual operand as its second
input), so a convolution, a fully connected layer, an unfolded batch norm (a per-channel scale and
shift) or an add carries its activation into one graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import UnsupportedError
from ..engine.folding import bn_scale_shift
from .ir import Program, Stage, concat_parts, extra_padding, fill_shapes, fold_bn_weights, rename
from .radix import radix_softmax_chain, radix_sum, rewrite_radix_softmax, rewrite_radix_sum

RELU = ("relu", 0.0)


class _Ctx:
    """The program being lowered: its stages, its output name, and look-ups over them."""

    def __init__(self, prog: Program) -> None:
        self.stages = [Stage(s.kind, list(s.inputs), s.output, s.pattern, dict(s.weights), dict(s.attrs), list(s.in_shapes),
                             tuple(s.out_shape), s.name, s.fn, s.reason) for s in prog.stages]
        self.output = prog.output
        self.shapes = {prog.input: tuple(prog.input_shape)} | {s.output: tuple(s.out_shape) for s in self.stages}

    def producer(self, value: str) -> Stage | None:
        for s in self.stages:
            if s.output == value:
                return s
        return None

    def readers(self, value: str) -> list[Stage]:
        """The stages that read ``value``."""
        return [s for s in self.stages if value in s.inputs]

    def uses(self, value: str) -> int:
        return sum(s.inputs.count(value) for s in self.stages) + (value == self.output)

    def single_use(self, value: str, *kinds: str) -> Stage | None:
        """The producer of ``value`` if it is of one of ``kinds`` and ``value`` has no other reader."""
        p = self.producer(value)
        return p if p is not None and p.kind in kinds and self.uses(value) == 1 else None

    def drop(self, s: Stage, keep: str) -> None:
        """Remove ``s``; its readers (and the program's output) read ``keep`` instead."""
        self.stages.remove(s)
        rename(self.stages, s.output, keep)
        if self.output == s.output:
            self.output = keep

    def drop_unread(self) -> None:
        """Remove stages whose output nothing reads (what a rewrite left behind), until none is left."""
        while True:
            dead = [t for t in self.stages if t.output != self.output and self.uses(t.output) == 0]
            if not dead:
                return
            for t in dead:
                self.stages.remove(t)

    def absorb(self, into: Stage, s: Stage) -> None:
        """``into`` (an earlier stage) now computes ``s``'s value too: it moves to ``s``'s place and
        takes its output name (its inputs are all computed by then)."""
        self.stages.remove(into)
        self.stages[self.stages.index(s)] = into
        into.output, into.out_shape = s.output, s.out_shape
        into.name += "+" + s.name

    def refresh_shapes(self) -> None:
        """Every stage's in_shapes from the value shapes (a rewrite keeps each value's shape)."""
        for s in self.stages:
            s.in_shapes = [self.shapes[n] for n in s.inputs]


@dataclass(frozen=True)
class Rule:
    name: str
    kinds: tuple[str, ...]
    match: Callable[[_Ctx, Stage], Any]
    rewrite: Callable[[_Ctx, Stage, Any], None]


def _plain(p: Stage | None) -> Stage | None:
    """``p`` if it has no epilogue yet."""
    return p if p is not None and not p.attrs.get("act") and not p.attrs.get("add") else None


# -- the rules -------------------------------------------------------------------------------------
def _always(c: _Ctx, s: Stage) -> Any:
    return True


def _drop_identity(c: _Ctx, s: Stage, _: Any) -> None:
    c.drop(s, s.inputs[0])


def _relu_as_act(c: _Ctx, s: Stage, _: Any) -> None:
    clip = s.attrs.pop("upper_clip", None)
    s.kind = "act"
    s.attrs.update(activation="relu" if clip is None else "clip", alpha=0.0 if clip is None else float(clip))


def _zero_pad_before(c: _Ctx, s: Stage) -> Any:
    """(pad stage, (top, left), (extra bottom, extra right)) where a conv reads, alone, a constant zero
    pad of H and W (F.pad / aten.pad / constant_pad_nd) that pads after at least as much as before."""
    p = c.single_use(s.inputs[0], "torch")
    if p is None or p.attrs.get("op") not in ("pad", "constant_pad_nd") or len(p.inputs) != 1:
        return None
    names = ("input", "pad", "value") if p.attrs["op"] == "constant_pad_nd" else ("input", "pad", "mode", "value")
    args, kw = list(p.attrs.get("args", ())), dict(p.attrs.get("kwargs") or {})
    a = dict(zip(names, args)) | kw
    pads = a.get("pad")
    if len(args) > len(names) or set(a) - set(names) or a.get("mode", "constant") != "constant" or a.get("value", 0.0) not in (0, None) \
            or not isinstance(pads, (list, tuple)) or len(pads) != 4:
        return None
    left, right, top, bottom = (int(v) for v in pads)
    if min(left, top) < 0 or right < left or bottom < top:
        return None
    return p, (top, left), (bottom - top, right - left)


def _pad_into_conv(c: _Ctx, s: Stage, found: tuple) -> None:
    p, before, extra = found
    (ph, pw), (eh, ew) = (tuple(int(e) for e in s.attrs["padding"]), tuple(int(e) for e in s.attrs.get("extra_padding", (0, 0))))
    s.attrs["padding"] = (ph + before[0], pw + before[1])
    if any(extra) or eh or ew:
        s.attrs["extra_padding"] = (eh + extra[0], ew + extra[1])
    s.inputs[0] = p.inputs[0]
    s.name = p.name + "+" + s.name
    c.stages.remove(p)


def _bn_conv(c: _Ctx, s: Stage) -> Any:
    return _plain(c.single_use(s.inputs[0], "conv"))


def _fold_bn(c: _Ctx, s: Stage, conv: Stage) -> None:
    w = s.weights
    conv.weights["w"], conv.weights["b"] = fold_bn_weights(conv.weights["w"], conv.weights.get("b"), w["mean"], w["var"], w["gamma"],
                                                           w["beta"], s.attrs["epsilon"])
    conv.name += "+" + s.name
    c.drop(s, conv.output)


def _bn_unfolded(c: _Ctx, s: Stage) -> Any:
    return "mean" in s.weights or None


def _bn_scale_shift(c: _Ctx, s: Stage, _: Any) -> None:
    w = {k: np.asarray(v, np.float64) for k, v in s.weights.items()}
    scale, shift = bn_scale_shift(w["mean"], w["var"], s.attrs["epsilon"], w["gamma"], w["beta"])
    s.weights = {"scale": scale, "shift": shift}


def _scale_shift_before(c: _Ctx, s: Stage) -> Any:
    """The per-channel scale-shift stage a scale-shift stage alone reads (a chain like ``1.5 - x``, then ``- 0.25``)."""
    p = _plain(c.single_use(s.inputs[0], "bn"))
    return p if p is not None and "scale" in p.weights and "scale" in s.weights and not s.attrs.get("act") else None


def _merge_scale_shifts(c: _Ctx, s: Stage, first: Stage) -> None:
    a1, b1, a2, b2 = (np.asarray(v, np.float64) for v in (first.weights["scale"], first.weights["shift"], s.weights["scale"], s.weights["shift"]))
    first.weights = {"scale": a2 * a1, "shift": a2 * b1 + b2}
    first.name += "+" + s.name
    c.drop(s, first.output)


def _residual_operands(c: _Ctx, a: Stage) -> tuple[Stage, int] | None:
    """(conv, index of the other operand) of a same-shape add with a single-use plain conv operand."""
    if len(a.inputs) != 2 or not a.in_shapes or tuple(a.in_shapes[0]) != tuple(a.in_shapes[1]) or a.attrs.get("act"):
        return None
    for ci, zi in ((0, 1), (1, 0)):
        conv = _plain(c.single_use(a.inputs[ci], "conv"))
        if conv is not None:
            return conv, zi
    return None


def _act_after_residual(c: _Ctx, s: Stage) -> Any:
    a = c.single_use(s.inputs[0], "add")
    found = _residual_operands(c, a) if a is not None else None
    return (a, *found) if found else None


def _fuse_residual_act(c: _Ctx, s: Stage, m: tuple) -> None:
    a, conv, zi = m
    conv.inputs = [conv.inputs[0], a.inputs[zi]]
    conv.attrs.update(add=True, act=(s.attrs["activation"], s.attrs["alpha"]))
    conv.name += "+" + a.name
    c.stages.remove(a)
    c.absorb(conv, s)


def _residual(c: _Ctx, s: Stage) -> Any:
    return _residual_operands(c, s)


def _fuse_residual(c: _Ctx, s: Stage, m: tuple) -> None:
    conv, zi = m
    conv.inputs = [conv.inputs[0], s.inputs[zi]]
    conv.attrs["add"] = True
    c.absorb(conv, s)


def _act_producer(c: _Ctx, s: Stage) -> Any:
    p = c.single_use(s.inputs[0], "conv", "linear", "bn", "add")
    if p is None or p.attrs.get("act") or (p.kind == "bn" and "mean" in p.weights):
        return None
    return p


def _fuse_act(c: _Ctx, s: Stage, p: Stage) -> None:
    p.attrs["act"] = (s.attrs["activation"], float(s.attrs["alpha"]))
    p.name += "+" + s.name
    c.drop(s, p.output)


def _hardsigmoid_epilogue(c: _Ctx, s: Stage) -> Any:
    return (s.attrs.get("act") or ("",))[0] == "hardsigmoid" and not s.attrs.get("add") or None


def _hardsigmoid_as_clip(c: _Ctx, s: Stage, _: Any) -> None:
    """hardsigmoid(z) = clip(z / 6 + 1/2, 0, 1): the 1/6 and 1/2 folded into the weights and bias before it."""
    w = s.weights
    if s.kind == "bn":
        w["scale"], w["shift"] = np.asarray(w["scale"], np.float64) / 6.0, np.asarray(w["shift"], np.float64) / 6.0 + 0.5
    else:
        k = np.asarray(w["w"]).shape[0]
        b = np.asarray(w["b"], np.float64) if "b" in w else np.zeros(k)
        w["w"], w["b"] = np.asarray(w["w"], np.float64) / 6.0, b / 6.0 + 0.5
    s.attrs["act"] = ("clip", 1.0)


def _hardswish_conv(c: _Ctx, s: Stage) -> Any:
    return (s.attrs.get("act") or ("",))[0] == "hardswish" and not s.attrs.get("add") or None


def _hardswish_constants(c: _Ctx, s: Stage, _: Any) -> None:
    k = np.asarray(s.weights["w"]).shape[0]
    s.weights.setdefault("b", np.zeros(k))
    s.weights["gs"], s.weights["gb"] = np.full(k, 1.0 / 6.0), np.full(k, 0.5)


_VIEWS = ("Tensor.view", "Tensor.reshape", "reshape", "view", "_unsafe_view", "Tensor.flatten", "flatten")


def _conv1d(s: Stage) -> tuple[np.ndarray, float, int, int] | None:
    """(taps, bias, padding, dilation) of a stage running a Conv1d(1, 1, k) with stride 1 and zero
    padding: an ``nn.Conv1d`` module (fx) or ``aten.conv1d`` with constant weights (torch.export)."""
    import torch

    m = s.fn
    if isinstance(m, torch.nn.Conv1d):
        if not (m.in_channels == m.out_channels == m.groups == 1 and m.stride == (1,) and m.padding_mode == "zeros" and not isinstance(m.padding, str)):
            return None
        bias = float(m.bias.detach()) if m.bias is not None else 0.0
        return m.weight.detach().double().reshape(-1).numpy(), bias, int(m.padding[0]), int(m.dilation[0])
    args = list(s.attrs.get("args", [])) + [None] * 7
    w, b, stride, pad, dil, groups = args[1:7]
    if s.attrs.get("op") != "conv1d" or s.attrs.get("kwargs") or not isinstance(w, torch.Tensor) or tuple(w.shape[:2]) != (1, 1):
        return None
    one = lambda v, d: int(v[0]) if isinstance(v, (list, tuple)) and len(v) == 1 else (d if v is None else v if isinstance(v, int) else None)  # noqa: E731
    stride, pad, dil, groups = one(stride, 1), one(pad, 0), one(dil, 1), 1 if groups is None else groups
    if stride != 1 or groups != 1 or pad is None or dil is None or (b is not None and not isinstance(b, torch.Tensor)):
        return None
    return w.detach().double().reshape(-1).numpy(), float(b.detach()) if b is not None else 0.0, pad, dil


def _pooled_channels(c: _Ctx, value: str) -> str | None:
    """The (N, C, 1, 1) value that ``value`` ((N, C, 1, 1) itself, or its flatten to (N, C)) holds."""
    shape = c.shapes[value]
    if len(shape) == 4 and shape[2:] == (1, 1):
        return value
    p = c.producer(value)
    if len(shape) == 2 and p is not None and p.kind == "flatten" and c.shapes[p.inputs[0]] == (*shape, 1, 1):
        return p.inputs[0]
    return None


def _channel_conv1d(c: _Ctx, s: Stage) -> Any:
    """ECA's gate (timm's EcaModule): view (N, C) -> (N, 1, C), Conv1d(1, 1, k) with "same" padding,
    an optional activation, view back to (N, C, 1, 1). Found: (the pooled (N, C, 1, 1) value, the
    stages to remove, the activation stage or None, the final view)."""
    conv = _conv1d(s)
    if conv is None or 2 * conv[2] != conv[3] * (len(conv[0]) - 1):
        return None
    view = c.single_use(s.inputs[0], "torch")
    if view is None or view.attrs.get("op") not in _VIEWS or len(s.in_shapes[0]) != 3 or s.in_shapes[0][1] != 1:
        return None
    src = _pooled_channels(c, view.inputs[0])
    n, _, ch = s.in_shapes[0]
    if src is None or c.shapes[src] != (n, ch, 1, 1):
        return None
    chain, act, v = [view], None, s.output
    for _ in range(2):  # an activation, then the view back
        readers = c.readers(v)
        if len(readers) != 1 or c.uses(v) != 1:
            return None
        t = readers[0]
        if t.kind == "act" and act is None and tuple(t.out_shape) == tuple(s.out_shape):
            act, v = t, t.output
            continue
        if t.kind == "torch" and t.attrs.get("op") in _VIEWS and tuple(t.out_shape) == (n, ch, 1, 1):
            return src, chain, act, t
        return None
    return None


def _channel_conv1d_as_conv(c: _Ctx, s: Stage, found: Any) -> None:
    src, chain, act, back = found
    taps, bias_value, pad, dil = _conv1d(s)
    k, ch = len(taps), c.shapes[src][1]
    w = np.zeros((ch, ch, 1, 1))
    for o in range(ch):  # out[o] = sum_j taps[j] * in[o + j * dil - pad]
        for j in range(k):
            i = o + j * dil - pad
            if 0 <= i < ch:
                w[o, i, 0, 0] = taps[j]
    bias = np.full(ch, bias_value)
    s.kind, s.fn, s.inputs, s.weights = "conv", None, [src], {"w": w, "b": bias}
    s.attrs = dict(padding=(0, 0), stride=(1, 1), dilation=(1, 1), groups=1)
    if act is not None:
        s.attrs["act"] = (act.attrs["activation"], float(act.attrs["alpha"]))
    s.output, s.out_shape = back.output, tuple(back.out_shape)
    for t in chain + ([act] if act is not None else []) + [back]:
        c.stages.remove(t)
    p = c.producer(chain[0].inputs[0])
    if p is not None and p.kind == "flatten" and c.uses(p.output) == 0 and p.output != c.output:
        c.stages.remove(p)  # the flatten only the view read


def _broadcast_expand(c: _Ctx, s: Stage) -> Any:
    """``g.expand_as(x)`` / ``g.expand(...)`` of an (N, C, 1, 1) value read only by multiplies and
    adds: they broadcast it themselves (and a multiply by it is the channel gate)."""
    if s.attrs.get("op") not in ("Tensor.expand_as", "Tensor.expand", "expand_as", "expand") or not s.in_shapes:
        return None
    g, out = tuple(s.in_shapes[0]), tuple(s.out_shape)
    if len(g) != 4 or len(out) != 4 or g[2:] != (1, 1) or g[:2] != out[:2]:
        return None
    readers = c.readers(s.output)
    return True if readers and all(t.kind in ("mul", "add") for t in readers) and s.output != c.output else None


def _gated_projection(c: _Ctx, s: Stage) -> Any:
    """A plain 1x1 convolution (stride 1, no padding, one group; a residual allowed) of an image times
    its (N, C, 1, 1) gate, the squeeze-excitation block's output projection, where the gate-scaled
    weights (N*C*K) are no larger than the gated image (N*H*W*C). Found: the multiply."""
    a, w = s.attrs, np.asarray(s.weights["w"])
    if (w.shape[2:] != (1, 1) or int(a.get("groups", 1)) != 1 or a.get("act")
            or any(tuple(int(e) for e in a[key]) != want for key, want in (("stride", (1, 1)), ("padding", (0, 0)), ("dilation", (1, 1))))):
        return None
    m = c.single_use(s.inputs[0], "mul")
    if m is None or _gate_order(m) is None:
        return None
    _, k, h, wd = s.out_shape
    return m if h * wd >= k else None  # where it pays: benchmarks/probes/probe_se_fold.py (slower at K > H*W)


def _gated_projection_as_gconv(c: _Ctx, s: Stage, m: Stage) -> None:
    """conv1x1(x * gate) + b (+ z) as one stage: per sample, x's pixel rows times the weights scaled
    by the gate (a batched matmul), so the gated image is never written."""
    image, gate = (m.inputs[i] for i in _gate_order(m))
    k, ch = np.asarray(s.weights["w"]).shape[:2]
    s.kind, s.inputs = "gconv", [image, gate, *s.inputs[1:]]
    s.weights["wt"] = np.asarray(s.weights["w"], np.float64).reshape(k, ch).T.copy()
    s.name = m.name + "+" + s.name
    c.stages.remove(m)


RULES: tuple[Rule, ...] = (
    Rule("drop identities (dropout, stochastic depth in eval)", ("identity",), _always, _drop_identity),
    Rule("split-attention's rSoftMax (view, transpose, softmax, flatten, view) as one radix softmax", ("torch",),
         radix_softmax_chain, rewrite_radix_softmax),
    Rule("split-attention / selective-kernel sums over paths as per-path channel slices, gates and adds", ("torch",),
         radix_sum, rewrite_radix_sum),
    Rule("ECA: a Conv1d across a pooled vector's channels as a 1x1 convolution", ("torch",), _channel_conv1d, _channel_conv1d_as_conv),
    Rule("an expand read only by broadcasting multiplies and adds is dropped", ("torch",), _broadcast_expand, _drop_identity),
    Rule("a zero pad of H and W (TensorFlow's \"same\", asymmetric) as the padding of the conv after it", ("conv",), _zero_pad_before,
         _pad_into_conv),
    Rule("ReLU and ReLU6 as activations", ("relu",), _always, _relu_as_act),
    Rule("fold an eval batch norm into the convolution before it", ("bn",), _bn_conv, _fold_bn),
    Rule("a batch norm with nothing to fold into: a per-channel scale and shift", ("bn",), _bn_unfolded, _bn_scale_shift),
    Rule("consecutive per-channel scale-shifts as one", ("bn",), _scale_shift_before, _merge_scale_shifts),
    Rule("residual tail: act(conv(x) + b + z)", ("act",), _act_after_residual, _fuse_residual_act),
    Rule("linear residual tail: conv(x) + b + z", ("add",), _residual, _fuse_residual),
    Rule("activation epilogue of a conv, linear, scale-shift or add", ("act",), _act_producer, _fuse_act),
    Rule("hardsigmoid epilogue as a clip, its constants folded into the weights", ("conv", "linear", "bn"), _hardsigmoid_epilogue,
         _hardsigmoid_as_clip),
    Rule("hardswish epilogue of a conv with its constants as channel operands", ("conv",), _hardswish_conv, _hardswish_constants),
    Rule("squeeze-excitation gate folded into the 1x1 projection after it", ("conv",), _gated_projection, _gated_projection_as_gconv),
)


# -- patterns --------------------------------------------------------------------------------------
def _conv_pattern(s: Stage) -> str:
    act, add = s.attrs.get("act"), bool(s.attrs.get("add"))
    if any(extra_padding(s)):  # the patterns with padding after the input
        s.attrs["act"] = act or ("identity", 0.0)
        return "conv_bias_add_act" if add else "conv_bias_act"
    if act is None:
        return "conv_bias_add" if add else "conv_bias"
    if tuple(act) == RELU:
        return "conv_bias_add_relu" if add else "conv_bias_relu"
    if tuple(act) == ("clip", 6.0) and not add:
        return "conv_bias_relu6"
    if act[0] == "hardswish" and not add:
        return "conv_bias_hardswish"
    return "conv_bias_add_act" if add else "conv_bias_act"


def _gate_order(s: Stage) -> list[int] | None:
    """Input order (image, gate) of a mul of a 4-D image by an (N, C, 1, 1) gate, else None."""
    if len(s.in_shapes) != 2 or any(len(sh) != 4 for sh in s.in_shapes):
        return None
    for i, j in ((0, 1), (1, 0)):
        x, g = s.in_shapes[i], s.in_shapes[j]
        if tuple(g) == (x[0], x[1], 1, 1) and tuple(s.out_shape) == tuple(x):
            return [i, j]
    return None


def pattern_for(s: Stage) -> tuple[str, str]:
    """(pattern, reason) of a stage the rules are done with; reason only for ``torch``."""
    k, rank = s.kind, len(s.in_shapes[0]) if s.in_shapes else 0
    if k == "conv":
        return _conv_pattern(s), ""
    if k == "gconv":
        return ("batched_matmul_bias_add" if s.attrs.get("add") else "batched_matmul_bias"), ""
    if k == "linear":
        act = s.attrs.get("act")
        return ("linear_bias" if act is None else "linear_bias_relu" if tuple(act) == RELU else "linear_bias_act"), ""
    if k == "bn":
        return ("channel_scale_shift_act", "") if rank == 4 else ("torch", f"batch norm of a rank-{rank} tensor")
    if k == "act":
        return ("act", "") if rank in (2, 4) else ("torch", f"activation of a rank-{rank} tensor")
    if k == "cln":
        return ("layernorm", "") if rank == 4 else ("torch", f"layer norm over channels of a rank-{rank} tensor")
    if k == "add":
        same = len(s.in_shapes) == 2 and tuple(s.in_shapes[0]) == tuple(s.out_shape) and len(s.in_shapes[1]) == rank
        return ("add_act", "") if same and rank in (2, 4) else ("torch", "add that broadcasts its first operand or a lower-rank one, or not 2-D / 4-D")
    if k == "mul":
        return ("channel_gate", "") if _gate_order(s) else ("torch", "multiply other than an (N, C, 1, 1) gate over an image")
    simple = {"maxpool": "max_pool2d", "avgpool": "avg_pool2d", "gap": "avg_pool2d", "softmax": "softmax", "flatten": "reshape",
              "shuffle": "channel_shuffle", "upsample": "upsample_nearest2d", "radix_softmax": "radix_softmax"}
    if k in simple:
        return simple[k], ""
    if k == "torch" and concat_parts(s) is not None:
        return "concat", ""  # planned in place (memory.channel_aliases): PyTorch copies only parts placed elsewhere
    if k == "torch" and "channel_slice" in s.attrs:
        return "channel_slice", ""  # a view of its input's buffer where the plan allows, else a copy
    if k == "torch":
        return "torch", s.reason or "no fusekit pattern"
    raise UnsupportedError(f"pipeline: cannot lower stage kind {k!r} ({s.name})")


def lower(prog: Program) -> Program:
    """Rewrite primitive stages into fusekit calls with :data:`RULES`; returns a new Program."""
    if any(not s.out_shape for s in prog.stages):
        fill_shapes(prog.stages, prog.input, prog.input_shape)
    c = _Ctx(prog)
    for rule in RULES:
        for s in list(c.stages):
            if s in c.stages and s.kind in rule.kinds:
                found = rule.match(c, s)
                if found is not None:
                    rule.rewrite(c, s, found)
                    c.refresh_shapes()
    for s in c.stages:
        if s.kind == "mul" and _gate_order(s):
            s.inputs = [s.inputs[i] for i in _gate_order(s)]
        s.pattern, s.reason = pattern_for(s)
        if s.kind in ("conv", "gconv", "linear") and "b" not in s.weights:
            s.weights["b"] = np.zeros(s.weights["w"].shape[0])
        if s.kind == "act":
            s.attrs["act"] = (s.attrs["activation"], float(s.attrs["alpha"]))
        if s.kind in ("bn", "add") and s.pattern != "torch":
            s.attrs.setdefault("act", ("identity", 0.0))
    out = Program(c.stages, prog.input, prog.input_shape, c.output, prog.source)
    for s in out.stages:
        if s.kind == "gap":
            h, w = s.in_shapes[0][2:]
            s.attrs.update(kernel_size=(h, w), stride=(h, w), padding=(0, 0), count_include_pad=True)
    return out
