"""ONNX model (file path or ``onnx.ModelProto``) -> primitive stages.

Supported nodes: Conv, BatchNormalization, Relu, Clip, the activations (Sigmoid, Tanh, HardSigmoid,
HardSwish, LeakyRelu, Elu, Gelu; ``x * Sigmoid(x)`` as SiLU), Add, Mul, MaxPool, AveragePool,
GlobalAveragePool, ReduceMean over H and W, Flatten (axis 1), Squeeze of H and W, Gemm, MatMul (+ Add
of a constant bias), Softmax, Reshape to (N, -1), Identity, Dropout. A few others run through PyTorch
as fallbacks (Sub, Div, Pow, Sqrt, Erf, Concat, Transpose, other Clips and reductions); any other node
raises UnsupportedError.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import OperandError, UnsupportedError
from .ir import Program, Ref, Stage, channel_shuffle_stage, fill_shapes, pool_stage, torch_fallback


def load(model: Any) -> Any:
    """An ``onnx.ModelProto`` as is, or the model in a file; a missing or unparsable file is an OperandError."""
    import os

    if not isinstance(model, (str, bytes)) and not hasattr(model, "__fspath__"):
        return model  # an onnx.ModelProto (only onnx makes one)
    path = os.fspath(model) if not isinstance(model, bytes) else model.decode(errors="replace")
    if not os.path.isfile(path):
        raise OperandError("pipeline", "model", f"an ONNX file or onnx.ModelProto; {path!r} is not a file")
    try:
        import onnx
    except ImportError:
        raise UnsupportedError(f"pipeline: reading the ONNX file {path!r} needs the onnx package "
                               "(pip install -e \".[onnx]\")") from None
    try:
        m = onnx.load(path)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends: say what the file is not
        raise OperandError("pipeline", "model", f"an ONNX model; {path!r} could not be parsed as one "
                           f"({type(e).__name__}: {e})") from None
    if not m.graph.node:
        raise OperandError("pipeline", "model", f"an ONNX model with a graph; {path!r} has no nodes (truncated or not ONNX?)")
    return m


def input_shape(model: Any, batch: int | None = None, default_hw: int = 224) -> tuple[int, ...]:
    """The graph input's shape, dynamic dims filled: batch with ``batch`` (default 1), others with ``default_hw``."""
    m = load(model)
    init = {i.name for i in m.graph.initializer}
    inputs = [i for i in m.graph.input if i.name not in init]
    if len(inputs) != 1:
        raise UnsupportedError(f"pipeline: ONNX graph has {len(inputs)} inputs; exactly one is supported")
    dims = []
    for k, d in enumerate(inputs[0].type.tensor_type.shape.dim):
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(int(d.dim_value) if not (k == 0 and batch is not None) else int(batch))
        else:
            dims.append((batch or 1) if k == 0 else (3 if k == 1 else default_hw))
    return tuple(dims)


def _attrs(node: Any) -> dict[str, Any]:
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _sym_pads(pads: list[int] | None, name: str) -> tuple[int, int]:
    if not pads:
        return (0, 0)
    t, l_, b, r = (int(p) for p in pads)
    if (t, l_) != (b, r):
        raise UnsupportedError(f"pipeline: ONNX node {name} has asymmetric pads {list(pads)}")
    return (t, l_)


def _torch_ops() -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    def clip(x, lo=None, hi=None):
        return torch.clamp(x, None if lo is None else float(lo), None if hi is None else float(hi))

    def hard_sigmoid(x, alpha=0.2, beta=0.5):
        return torch.clamp(x * alpha + beta, 0.0, 1.0)

    def reduce_mean(x, axes, keepdims=1):
        return torch.mean(x, dim=tuple(int(d) for d in axes), keepdim=bool(keepdims))

    def reshape(x, shape):  # ONNX: 0 keeps the input's dimension
        return torch.reshape(x, tuple(x.shape[i] if d == 0 else d for i, d in enumerate(shape)))

    def layer_norm(x, axis, eps, scale, bias=None):
        return F.layer_norm(x, tuple(x.shape[axis:]), scale.to(x.dtype), None if bias is None else bias.to(x.dtype), eps)

    def split_item(x, sizes, axis, k):  # sizes: a list, or the number of equal parts
        return (torch.chunk(x, sizes, dim=axis) if isinstance(sizes, int) else torch.split(x, sizes, dim=axis))[k]

    def slice_(x, starts, ends, axes, steps):
        idx = [slice(None)] * x.dim()
        for s0, e, ax, st in zip(starts, ends, axes, steps):
            idx[ax] = slice(s0, min(e, x.shape[ax]), st)
        return x[tuple(idx)]

    def gather(x, idx, axis):  # numpy.take along one axis
        idx = torch.as_tensor(idx, device=x.device).long()
        return x.index_select(axis, idx.reshape(-1)).reshape(x.shape[:axis] + idx.shape + x.shape[axis + 1:])

    def unsqueeze(x, axes):
        for ax in sorted(d % (x.dim() + len(axes)) for d in axes):
            x = x.unsqueeze(ax)
        return x

    return {
        "Add": torch.add, "MatMul": torch.matmul, "Reshape": reshape, "LayerNormalization": layer_norm, "Split": split_item, "Slice": slice_,
        "Unsqueeze": unsqueeze, "Squeeze": torch.squeeze, "Softplus": F.softplus, "Neg": torch.neg, "Exp": torch.exp, "Gather": gather,
        "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Clip": clip, "Mul": torch.mul, "Sub": torch.sub, "Div": torch.div,
        "LeakyRelu": F.leaky_relu, "HardSigmoid": hard_sigmoid, "HardSwish": F.hardswish, "Concat": torch.cat,
        "Pow": torch.pow, "Sqrt": torch.sqrt, "Erf": torch.erf, "Transpose": torch.permute, "ReduceMean": reduce_mean,
    }


#: ONNX nodes that run as PyTorch fallbacks (see _torch_ops).
FALLBACK_OPS = frozenset({
    "Add", "MatMul", "Reshape", "LayerNormalization", "Split", "Slice", "Unsqueeze", "Squeeze", "Softplus", "Neg", "Exp", "Gather",
    "Sigmoid", "Tanh", "Clip", "Mul", "Sub", "Div", "LeakyRelu", "HardSigmoid", "HardSwish", "Concat", "Pow", "Sqrt", "Erf", "Transpose",
    "ReduceMean",
})


class _LazyTorchOps:
    """The fallbacks' PyTorch functions, imported when the first fallback is made: a model that lowers
    entirely to fusekit stages imports without PyTorch."""

    def __init__(self) -> None:
        self._fns: dict[str, Any] | None = None

    def __contains__(self, op: str) -> bool:
        return op in FALLBACK_OPS

    def __getitem__(self, op: str) -> Any:
        if self._fns is None:
            try:
                self._fns = _torch_ops()
            except ImportError:
                raise UnsupportedError(f"pipeline: ONNX node {op} runs on PyTorch, which is not installed "
                                       "(pip install -e \".[torch]\")") from None
        return self._fns[op]


def _activation(op: str, a: dict[str, Any]) -> tuple[str, float] | None:
    """fusekit's (activation, alpha) for an ONNX activation node, None where its attributes differ from one."""
    if op in ("Sigmoid", "Tanh", "HardSwish"):
        return {"Sigmoid": "sigmoid", "Tanh": "tanh", "HardSwish": "hardswish"}[op], 0.0
    if op == "HardSigmoid" and abs(float(a.get("alpha", 0.2)) - 1 / 6) < 1e-6 and abs(float(a.get("beta", 0.5)) - 0.5) < 1e-6:
        return "hardsigmoid", 0.0  # PyTorch's x / 6 + 1 / 2, clipped
    if op == "LeakyRelu":
        return "leaky_relu", float(a.get("alpha", 0.01))
    if op == "Elu":
        return "elu", float(a.get("alpha", 1.0))
    if op == "Gelu":
        return ("gelu_tanh" if a.get("approximate", b"none") in (b"tanh", "tanh") else "gelu"), 0.0
    return None


def _reduce_axes(a: dict[str, Any], ins: list[str], consts: dict[str, Any]) -> list[int] | None:
    """A ReduceMean / Squeeze node's axes: attribute (older opsets) or constant input (opset 13 / 18 on)."""
    axes = a.get("axes", consts.get(ins[1]) if len(ins) > 1 and ins[1] else None)
    return None if axes is None else [int(d) for d in np.asarray(axes).reshape(-1)]


def import_onnx(model: Any, shape: tuple[int, ...] | None = None) -> Program:
    """Primitive stages of an ONNX model, for an input of ``shape`` (default: from the graph, batch 1)."""
    return _OnnxImporter(load(model), shape).run()


def _channel_shuffles(stages: list[Stage]) -> list[Stage]:
    """ShuffleNet's channel shuffle as exported (Reshape to (N, g, C/g, H, W), Transpose 0 2 1 3 4,
    Reshape back) as one PyTorch ``channel_shuffle`` stage instead of three copies."""
    out = list(stages)
    producer = {s.output: s for s in out}
    uses = collections.Counter(i for s in out for i in s.inputs)
    for c in list(out):
        b = producer.get(c.inputs[0]) if c.attrs.get("op") == "Reshape" and len(c.out_shape) == 4 and c.inputs else None
        a = producer.get(b.inputs[0]) if b is not None and b.attrs.get("op") == "Transpose" and uses[b.output] == 1 else None
        if a is None or a.attrs.get("op") != "Reshape" or len(a.out_shape) != 5 or uses[a.output] != 1:
            continue
        if [int(p) for p in b.attrs["args"][1]] != [0, 2, 1, 3, 4]:
            continue
        n, g, cg, h, w = a.out_shape
        if tuple(a.in_shapes[0]) != (n, g * cg, h, w) or tuple(c.out_shape) != (n, g * cg, h, w):
            continue
        st = channel_shuffle_stage(c.name, a.inputs[0], c.output, g)
        st.in_shapes, st.out_shape = [tuple(a.in_shapes[0])], tuple(c.out_shape)
        out[out.index(c)] = st
        out.remove(a)
        out.remove(b)
    return out


@dataclass
class _Node:
    """One ONNX node as the rules read it."""

    node: Any
    op: str
    name: str
    a: dict[str, Any]
    ins: list[str]
    out: str


_SKIP = object()  # a rule's answer for a node that adds no stage (it aliases or merges into one)


class _OnnxImporter:
    """One ONNX graph's nodes -> primitive stages: constants folded, each node by its rule, the rest
    as PyTorch fallbacks (see the module docstring)."""

    def __init__(self, m: Any, shape: tuple[int, ...] | None) -> None:
        from onnx import numpy_helper

        self.m, g = m, m.graph
        arrays = {i.name: numpy_helper.to_array(i) for i in g.initializer}
        self.consts: dict[str, np.ndarray] = {k: a.astype(np.float64) if a.dtype.kind == "f" else a for k, a in arrays.items()}
        self.shape = tuple(shape) if shape is not None else input_shape(m)
        inputs = [i.name for i in g.input if i.name not in self.consts]
        if len(inputs) != 1 or len(g.output) != 1:
            raise UnsupportedError("pipeline: ONNX graphs with one input and one output only")
        self.input = inputs[0]
        self.alias: dict[str, str] = {}
        self.stages: list[Stage] = []
        self.tensors = {self.input}
        self.ops = _LazyTorchOps()
        self.sigmoid_of = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Sigmoid"}  # for x * Sigmoid(x) = SiLU
        self.static = _static_shapes(m, self.input, self.shape)
        self.ndim = {n: len(d) for n, d in self.static.items()}  # ranks: from ONNX's shape inference, else from the rules

    def v(self, name: str) -> str:
        return self.alias.get(name, name)

    def run(self) -> Program:
        for k, node in enumerate(self.m.graph.node):
            n = _Node(node, node.op_type, node.name or f"{node.op_type}_{k}", _attrs(node), list(node.input), node.output[0])
            if self.constant(n):
                continue
            st = self.stage(n)
            if st is _SKIP:
                continue
            self.stages.append(st)
            self.tensors.add(st.output)
            self.ndim.setdefault(st.output, _rank(st, self.ndim))
        return self.finish()

    # -- constants and aliases ---------------------------------------------------------------
    def constant(self, n: _Node) -> bool:
        """Nodes that only make constants or aliases: Shape of a fixed size, nodes on constants
        (evaluated once), Constant, Identity and Dropout."""
        c, ins = self.consts, n.ins
        if n.op == "Shape" and self.v(ins[0]) in self.static:
            c[n.out] = np.asarray(self.static[self.v(ins[0])], dtype=np.int64)[int(n.a.get("start", 0)): n.a.get("end", None)]
        elif n.op == "Constant":
            from onnx import numpy_helper

            c[n.out] = numpy_helper.to_array(n.a["value"]) if "value" in n.a else np.asarray(n.a.get("value_float", n.a.get("value_int")))
        elif ins and all(not i or i in c for i in ins):
            c.update(_fold(n.node, c))
        elif n.op in ("Identity", "Dropout"):
            self.alias[n.out] = self.v(ins[0])
        else:
            return False
        return True

    # -- the rules ---------------------------------------------------------------------------
    def stage(self, n: _Node) -> Any:
        """The node's stage (or _SKIP); nodes without a rule become PyTorch fallbacks, if PyTorch has them."""
        rule = self.RULES.get(n.op)
        st = rule(self, n) if rule is not None else None
        if st is None and _activation(n.op, n.a) is not None:
            act, alpha = _activation(n.op, n.a)
            st = Stage("act", [self.v(n.ins[0])], n.out, attrs={"activation": act, "alpha": alpha}, name=n.name)
        if st is None and n.op in self.ops:
            st = self.fallback(n)
        if st is None:
            raise UnsupportedError(f"pipeline: ONNX node {n.name} ({n.op}) is not supported")
        return st

    def conv(self, n: _Node) -> Stage:
        a, ins = n.a, n.ins
        if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            raise UnsupportedError(f"pipeline: ONNX Conv {n.name}: auto_pad={a['auto_pad']!r} not supported (export with explicit pads)")
        weights = {"w": self.consts[ins[1]]} | ({"b": self.consts[ins[2]]} if len(ins) > 2 and ins[2] else {})
        t, l_, b, r = (int(p) for p in a.get("pads") or (0, 0, 0, 0))
        if b < t or r < l_:
            raise UnsupportedError(f"pipeline: ONNX Conv {n.name} pads {[t, l_, b, r]}: more padding before the input than after")
        extra = {"extra_padding": (b - t, r - l_)} if (b, r) != (t, l_) else {}  # TensorFlow's "same" with an odd total
        return Stage("conv", [self.v(ins[0])], n.out, weights=weights, name=n.name, attrs=dict(
            padding=(t, l_), stride=tuple(a.get("strides", (1, 1))), dilation=tuple(a.get("dilations", (1, 1))),
            groups=int(a.get("group", 1)), **extra))

    def batch_norm(self, n: _Node) -> Stage:
        if len(n.node.output) > 1 and any(n.node.output[1:]):
            raise UnsupportedError(f"pipeline: ONNX BatchNormalization {n.name} in training mode")
        c = self.consts
        return Stage("bn", [self.v(n.ins[0])], n.out, name=n.name, attrs={"epsilon": float(n.a.get("epsilon", 1e-5))}, weights={
            "gamma": c[n.ins[1]], "beta": c[n.ins[2]], "mean": c[n.ins[3]], "var": c[n.ins[4]]})

    def relu(self, n: _Node) -> Stage | None:
        if n.op == "Relu":
            return Stage("relu", [self.v(n.ins[0])], n.out, name=n.name)
        lo, hi = _clip_bounds(n.a, n.ins, self.consts)
        return Stage("relu", [self.v(n.ins[0])], n.out, attrs={"upper_clip": hi}, name=n.name) if lo == 0.0 and hi is not None else None

    def mul(self, n: _Node) -> Stage | None:
        ins, v = n.ins, self.v
        if len(ins) == 2 and any(self.sigmoid_of.get(ins[k]) == ins[1 - k] for k in (0, 1)):
            x = ins[1] if self.sigmoid_of.get(ins[0]) == ins[1] else ins[0]
            return Stage("act", [v(x)], n.out, attrs={"activation": "silu", "alpha": 0.0}, name=n.name)
        if len(ins) == 2 and all(v(i) in self.tensors for i in ins):
            return Stage("mul", [v(ins[0]), v(ins[1])], n.out, name=n.name)
        return None

    def over_hw(self, n: _Node) -> bool:
        return self.ndim.get(self.v(n.ins[0])) == 4 and sorted(d % 4 for d in (_reduce_axes(n.a, n.ins, self.consts) or [])) == [2, 3]

    def reduce_mean(self, n: _Node) -> Stage | None:
        if not self.over_hw(n):
            return None
        if int(n.a.get("keepdims", 1)):
            return Stage("gap", [self.v(n.ins[0])], n.out, name=n.name)
        self.stages.append(Stage("gap", [self.v(n.ins[0])], f"{n.out}.gap", name=n.name))  # to (N, C): the pool, then the flatten
        return Stage("flatten", [f"{n.out}.gap"], n.out, name=n.name)

    def squeeze(self, n: _Node) -> Stage | None:
        return Stage("flatten", [self.v(n.ins[0])], n.out, name=n.name) if self.over_hw(n) else None

    def add(self, n: _Node) -> Any:
        ins, v, last = n.ins, self.v, self.stages[-1] if self.stages else None
        if len(ins) == 2 and all(v(i) in self.tensors for i in ins):
            return Stage("add", [v(ins[0]), v(ins[1])], n.out, name=n.name)
        if last is not None and last.kind == "linear" and last.output == v(ins[0]) and ins[1] in self.consts \
                and "b" not in last.weights and self.consts[ins[1]].size == last.weights["w"].shape[0]:
            last.weights["b"] = self.consts[ins[1]].reshape(-1)  # MatMul + Add(bias): one linear stage
            last.name += "+" + n.name
            self.alias[n.out] = last.output
            return _SKIP
        return None

    def pool(self, n: _Node) -> Stage:
        a = n.a
        if (any(d != 1 for d in a.get("dilations", (1, 1))) and n.op == "AveragePool") or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            raise UnsupportedError(f"pipeline: ONNX {n.op} {n.name}: auto_pad and AveragePool's dilations are not supported")
        # (PyTorch's output size is checked against ONNX's in finish())
        return pool_stage("maxpool" if n.op == "MaxPool" else "avgpool", self.v(n.ins[0]), n.out, tuple(a["kernel_shape"]),
                          tuple(a.get("strides", (1, 1))), _sym_pads(a.get("pads"), n.name), bool(a.get("ceil_mode", 0)),
                          dilation=tuple(int(d) for d in a.get("dilations", (1, 1))), count_include_pad=bool(a.get("count_include_pad", 0)),
                          name=n.name)

    def resize(self, n: _Node) -> Stage:
        """Nearest Resize of an image by constant power-of-two scales over H and W (PyTorch's exporter's
        Upsample / interpolate): an ``upsample`` stage, where ONNX's source index is dst // scale."""
        a, ins = n.a, n.ins
        scales = self.consts.get(ins[2]) if len(ins) > 2 and ins[2] else None
        text = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in a.items()}
        mode, ctm, near = text.get("mode", "nearest"), text.get("coordinate_transformation_mode", "half_pixel"), \
            text.get("nearest_mode", "round_prefer_floor")
        index_ok = (ctm, near) == ("asymmetric", "floor") or (ctm in ("half_pixel", "pytorch_half_pixel") and near.startswith("round"))
        f = [float(s) for s in np.asarray(scales).reshape(-1)] if scales is not None else []
        if mode != "nearest" or not index_ok or len(f) != 4 or f[:2] != [1.0, 1.0] or any(s < 1 or s != int(s) or int(s) & (int(s) - 1)
                                                                                         for s in f[2:]):
            raise UnsupportedError(f"pipeline: ONNX Resize {n.name}: only mode=nearest by constant power-of-two scales of H and W is "
                                   f"supported (mode={mode}, coordinate_transformation_mode={ctm}, nearest_mode={near}, scales={f or None})")
        return Stage("upsample", [self.v(ins[0])], n.out, attrs={"scale": (int(f[2]), int(f[3]))}, name=n.name)

    def global_pool(self, n: _Node) -> Stage:
        return Stage("gap", [self.v(n.ins[0])], n.out, name=n.name)

    def flatten(self, n: _Node) -> Stage | None:
        if n.op == "Flatten":
            if int(n.a.get("axis", 1)) != 1:
                raise UnsupportedError(f"pipeline: ONNX Flatten {n.name} with axis {n.a.get('axis')} (only 1)")
        elif not (n.ins[1] in self.consts and _is_flatten([int(d) for d in self.consts[n.ins[1]]], self.static.get(self.v(n.ins[0])))):
            return None  # another Reshape: a fallback
        return Stage("flatten", [self.v(n.ins[0])], n.out, name=n.name)

    def gemm(self, n: _Node) -> Stage:
        a, ins = n.a, n.ins
        if a.get("transA", 0):
            raise UnsupportedError(f"pipeline: ONNX Gemm {n.name} with transA")
        w = self.consts[ins[1]] * float(a.get("alpha", 1.0))
        w = w if a.get("transB", 0) else w.T
        weights = {"w": np.ascontiguousarray(w)}
        if len(ins) > 2 and ins[2]:
            c = self.consts[ins[2]] * float(a.get("beta", 1.0))
            weights["b"] = np.broadcast_to(c.reshape(-1), (w.shape[0],)).copy()
        return Stage("linear", [self.v(ins[0])], n.out, weights=weights, name=n.name)

    def matmul(self, n: _Node) -> Stage | None:
        w = self.consts.get(n.ins[1])
        if w is None or w.ndim != 2 or len(self.static.get(self.v(n.ins[0]), (0, 0, 0))) != 2:
            return None  # not a fully connected layer on rows: a fallback
        return Stage("linear", [self.v(n.ins[0])], n.out, weights={"w": np.ascontiguousarray(w.T)}, name=n.name)

    def softmax(self, n: _Node) -> Stage:
        axis = int(n.a.get("axis", -1 if _opset(self.m) >= 13 else 1))
        return Stage("softmax", [self.v(n.ins[0])], n.out, attrs={"axis": axis}, name=n.name)

    def split(self, n: _Node) -> Stage:
        """One PyTorch stage per output of the Split (all but the last added here)."""
        x, outs = self.v(n.ins[0]), list(n.node.output)
        sizes = self.consts[n.ins[1]].tolist() if len(n.ins) > 1 and n.ins[1] else n.a.get("split")
        made = []
        axis = int(n.a.get("axis", 0))
        for k, o in enumerate(outs):
            args = [Ref(x), [int(d) for d in sizes] if sizes is not None else len(outs), axis, k]
            st = torch_fallback(f"{n.name}[{k}]", [x], o, self.ops["Split"], args, {}, reason="ONNX Split has no fusekit pattern")
            st.attrs["op"] = "Split"
            if sizes is not None and axis in (1, -3) and self.ndim.get(x) == 4:
                st.attrs["channel_slice"] = int(sum(sizes[:k]))  # checked against the shapes in finish()
            made.append(st)
        for st in made[:-1]:
            self.stages.append(st)
            self.tensors.add(st.output)
            self.ndim[st.output] = self.ndim.get(x)
        return made[-1]

    RULES: dict[str, Callable[["_OnnxImporter", _Node], Any]] = {
        "Conv": conv, "BatchNormalization": batch_norm, "Relu": relu, "Clip": relu, "Mul": mul, "ReduceMean": reduce_mean,
        "Squeeze": squeeze, "Add": add, "MaxPool": pool, "AveragePool": pool, "GlobalAveragePool": global_pool, "Flatten": flatten,
        "Reshape": flatten, "Gemm": gemm, "MatMul": matmul, "Softmax": softmax, "Split": split, "Resize": resize,
    }

    # -- PyTorch fallbacks -------------------------------------------------------------------
    def fallback(self, n: _Node) -> Stage:
        args, kwargs, ins = self.fallback_call(n)
        refs = [self.v(i) for i in ins if i and i not in self.consts]
        st = torch_fallback(n.name, refs, n.out, self.ops[n.op], args, kwargs, reason=f"ONNX {n.op} has no fusekit pattern")
        st.attrs["op"] = n.op
        if n.op == "Slice" and self.ndim.get(refs[0]) == 4 and [int(a) for a in args[3]] in ([1], [-3]) and list(args[4]) == [1]:
            st.attrs["channel_slice"] = int(args[1][0])  # a start counted from the end is settled in finish()
        return st

    def fallback_call(self, n: _Node) -> tuple[list, dict, list[str]]:
        """(args, kwargs, the inputs that are values) of the PyTorch function of a fallback node."""
        op, a, ins, c = n.op, n.a, n.ins, self.consts
        x = Ref(self.v(ins[0]))

        def val(i: str) -> Any:
            return Ref(self.v(i)) if i not in c else c[i]

        if op == "Concat":
            return [[val(i) for i in ins]], {"dim": int(a.get("axis", 1))}, ins
        if op == "Clip":
            return [x, *_clip_bounds(a, ins, c)], {}, ins
        if op == "LeakyRelu":
            return [x, float(a.get("alpha", 0.01))], {}, ins
        if op == "HardSigmoid":
            return [x, float(a.get("alpha", 0.2)), float(a.get("beta", 0.5))], {}, ins
        if op == "Transpose":
            return [x, [int(d) for d in a["perm"]]], {}, ins
        if op == "ReduceMean":
            return [x, _reduce_axes(a, ins, c), int(a.get("keepdims", 1))], {}, ins[:1]
        if op in ("Reshape", "Unsqueeze", "Squeeze") and (len(ins) > 1 or op == "Squeeze"):
            dims = _reduce_axes(a, ins, c) if op != "Reshape" else [int(d) for d in c[ins[1]]]
            return ([x, tuple(dims)] if dims is not None else [x]), {}, ins[:1]
        if op == "Unsqueeze":
            return [x, [int(d) for d in a["axes"]]], {}, ins
        if op == "LayerNormalization":
            return [x, int(a.get("axis", -1)), float(a.get("epsilon", 1e-5))] + [val(i) for i in ins[1:] if i], {}, ins
        if op == "Gather" and ins[1] in c:
            return [x, c[ins[1]].astype(np.int64), int(a.get("axis", 0))], {}, ins[:1]
        if op == "Slice":
            starts, ends = (c[ins[k]].tolist() for k in (1, 2))
            axes = c[ins[3]].tolist() if len(ins) > 3 and ins[3] else list(range(len(starts)))
            steps = c[ins[4]].tolist() if len(ins) > 4 and ins[4] else [1] * len(starts)
            return [x, starts, ends, axes, steps], {}, ins[:1]
        return [val(i) for i in ins], {}, ins

    # -- the program -------------------------------------------------------------------------
    def finish(self) -> Program:
        out = self.v(self.m.graph.output[0].name)
        prog = Program(_live(self.stages, out), self.input, self.shape, out, "onnx")
        fill_shapes(prog.stages, prog.input, prog.input_shape)
        prog.stages = _channel_shuffles(prog.stages)
        for s in prog.stages:  # a channel view only where the shapes say it is one
            if "channel_slice" in s.attrs:
                first, (xs, ys) = int(s.attrs["channel_slice"]), (tuple(s.in_shapes[0]), tuple(s.out_shape))
                first = first + xs[1] if first < 0 else first
                if len(ys) == 4 and (ys[0], *ys[2:]) == (xs[0], *xs[2:]) and 0 <= first and first + ys[1] <= xs[1] and ys[1] < xs[1]:
                    s.attrs["channel_slice"] = first
                else:
                    del s.attrs["channel_slice"]
        for s in prog.stages:
            if s.output in self.static and tuple(s.out_shape) != self.static[s.output]:
                raise UnsupportedError(f"pipeline: ONNX node {s.name} ({s.kind}): its PyTorch form gives shape {tuple(s.out_shape)}, "
                                       f"ONNX's {self.static[s.output]} (ceil_mode pooling with pads differs between them)")
            if s.kind == "softmax":
                nd = len(s.in_shapes[0])
                if _opset(self.m) < 13 and s.attrs["axis"] % nd != nd - 1 and nd > 2:
                    raise UnsupportedError(f"pipeline: ONNX Softmax {s.name} (opset < 13 flattens to 2-D): only the last axis")
                s.attrs["axis"] = s.attrs["axis"] % nd
        return prog


def _static_shapes(m: Any, input_name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Every value's static shape that ONNX shape inference finds for an input of ``shape``."""
    import onnx

    m2 = onnx.ModelProto()
    m2.CopyFrom(m)
    for i in m2.graph.input:
        if i.name == input_name:
            dims = i.type.tensor_type.shape.dim
            for d, n in zip(dims, shape):
                d.Clear()
                d.dim_value = int(n)
    try:
        inferred = onnx.shape_inference.infer_shapes(m2)
    except Exception:  # noqa: BLE001 - no shapes: Shape nodes then stay unsupported
        return {input_name: tuple(shape)}
    out = {input_name: tuple(shape)}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            out[vi.name] = tuple(int(d.dim_value) for d in dims)
    return out


def _fold(node: Any, consts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A node whose inputs are all constants, evaluated once by ONNX's reference evaluator."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    ins = [i for i in node.input if i]
    graph = onnx.helper.make_graph([node], "fold", [onnx.helper.make_tensor_value_info(i, onnx.helper.np_dtype_to_tensor_dtype(
        consts[i].dtype), consts[i].shape) for i in ins], [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None)
                                                          for o in node.output if o])
    try:
        res = ReferenceEvaluator(onnx.helper.make_model(graph)).run(None, {i: consts[i] for i in ins})
    except Exception as e:  # noqa: BLE001 - say which node
        raise UnsupportedError(f"pipeline: ONNX node {node.name or node.op_type} ({node.op_type}) on constants could not be "
                               f"evaluated: {type(e).__name__}: {e}") from e
    return {o: np.asarray(r) for o, r in zip([o for o in node.output if o], res)}


def _is_flatten(target: list[int], src: tuple[int, ...] | None) -> bool:
    """Whether Reshape to ``target`` flattens an (N, ...) value of shape ``src`` to (N, -1): as the
    TorchScript exporter writes it ([0 or N, -1]) or the dynamo exporter ([N, C*H*W], sizes spelled out)."""
    if len(target) != 2 or src is None or len(src) < 2:
        return False
    n, f = target
    return n in (0, src[0]) and f in (-1, int(np.prod(src[1:])))


def _live(stages: list[Stage], output: str) -> list[Stage]:
    """The stages the output depends on (a Sigmoid whose only reader became a SiLU is dropped)."""
    need, keep = {output}, []
    for st in reversed(stages):
        if st.output in need:
            keep.append(st)
            need.update(st.inputs)
    return keep[::-1]


def _rank(st: Stage, ndim: dict[str, int]) -> int | None:
    """The rank of a stage's output where the import rules need it (4-D images through the CNN ops)."""
    if st.kind in ("flatten", "linear"):
        return 2
    if st.kind == "gap":
        return 4
    if st.kind == "torch":
        return None
    return ndim.get(st.inputs[0]) if st.inputs else None


def _opset(m: Any) -> int:
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return 13


def _clip_bounds(a: dict, ins: list, consts: dict) -> tuple[float | None, float | None]:
    """(min, max) of an ONNX Clip: attributes (opset < 11) or constant inputs; None where absent."""
    lo = a.get("min", consts.get(ins[1]) if len(ins) > 1 and ins[1] else None)
    hi = a.get("max", consts.get(ins[2]) if len(ins) > 2 and ins[2] else None)
    return (None if lo is None else float(np.asarray(lo)), None if hi is None else float(np.asarray(hi)))
