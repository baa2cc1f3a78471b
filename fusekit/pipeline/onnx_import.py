"""ONNX model (file path or ``onnx.ModelProto``) -> primitive stages.

Supported nodes: Conv, BatchNormalization, Relu, Clip, the activations (Sigmoid, Tanh, HardSigmoid,
HardSwish, LeakyRelu, Elu, Gelu; ``x * Sigmoid(x)`` as SiLU), Add, Mul, MaxPool, AveragePool,
GlobalAveragePool, ReduceMean over H and W, Flatten (axis 1), Squeeze of H and W, Gemm, MatMul (+ Add
of a constant bias), Softmax, Reshape to (N, -1), Identity, Dropout. A few others run through PyTorch
as fallbacks (Sub, Div, Pow, Sqrt, Erf, Concat, Transpose, other Clips and reductions); any other node
raises UnsupportedError.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import OperandError, UnsupportedError
from .ir import Program, Ref, Stage, fill_shapes, torch_fallback


def load(model: Any) -> Any:
    """An ``onnx.ModelProto`` as is, or the model in a file; a missing or unparsable file is an OperandError."""
    import os

    import onnx

    if isinstance(model, onnx.ModelProto):
        return model
    path = os.fspath(model) if not isinstance(model, bytes) else model.decode(errors="replace")
    if not os.path.isfile(path):
        raise OperandError("pipeline", "model", f"an ONNX file or onnx.ModelProto; {path!r} is not a file")
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
    from onnx import numpy_helper

    m = load(model)
    g = m.graph
    consts: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i).astype(np.float64) if numpy_helper.to_array(i).dtype.kind == "f"
                                     else numpy_helper.to_array(i) for i in g.initializer}
    shape = tuple(shape) if shape is not None else input_shape(m)
    inputs = [i.name for i in g.input if i.name not in consts]
    if len(inputs) != 1 or len(g.output) != 1:
        raise UnsupportedError("pipeline: ONNX graphs with one input and one output only")
    alias: dict[str, str] = {}
    stages: list[Stage] = []
    tensors = {inputs[0]}
    ops = _LazyTorchOps()
    sigmoid_of = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Sigmoid"}  # for x * Sigmoid(x) = SiLU
    static = _static_shapes(m, inputs[0], shape)
    ndim = {n: len(d) for n, d in static.items()}  # ranks: from ONNX's shape inference, else from the rules below

    def v(name: str) -> str:
        return alias.get(name, name)

    for k, node in enumerate(g.node):
        a = _attrs(node)
        name = node.name or f"{node.op_type}_{k}"
        ins = list(node.input)
        out = node.output[0]
        op = node.op_type
        st: Stage | None = None
        if op == "Shape" and v(ins[0]) in static:  # shape arithmetic on a fixed input size folds to constants
            dims = np.asarray(static[v(ins[0])], dtype=np.int64)
            consts[out] = dims[int(a.get("start", 0)): a.get("end", None)]
            continue
        if op != "Constant" and ins and all(not i or i in consts for i in ins):
            consts.update(_fold(node, consts))
            continue
        if op == "Constant":
            from onnx import numpy_helper as nh

            consts[out] = nh.to_array(a["value"]) if "value" in a else np.asarray(a.get("value_float", a.get("value_int")))
            continue
        if op in ("Identity", "Dropout"):
            if ins[0] in consts:
                consts[out] = consts[ins[0]]
            else:
                alias[out] = v(ins[0])
            continue
        if op == "Conv":
            if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
                raise UnsupportedError(f"pipeline: ONNX Conv {name}: auto_pad={a['auto_pad']!r} not supported (export with explicit pads)")
            w = consts[ins[1]]
            weights = {"w": w} | ({"b": consts[ins[2]]} if len(ins) > 2 and ins[2] else {})
            st = Stage("conv", [v(ins[0])], out, weights=weights, name=name, attrs=dict(
                padding=_sym_pads(a.get("pads"), name), stride=tuple(a.get("strides", (1, 1))),
                dilation=tuple(a.get("dilations", (1, 1))), groups=int(a.get("group", 1))))
        elif op == "BatchNormalization":
            if len(node.output) > 1 and any(node.output[1:]):
                raise UnsupportedError(f"pipeline: ONNX BatchNormalization {name} in training mode")
            st = Stage("bn", [v(ins[0])], out, name=name, attrs={"epsilon": float(a.get("epsilon", 1e-5))}, weights={
                "gamma": consts[ins[1]], "beta": consts[ins[2]], "mean": consts[ins[3]], "var": consts[ins[4]]})
        elif op == "Relu":
            st = Stage("relu", [v(ins[0])], out, name=name)
        elif op == "Clip" and _clip_bounds(a, ins, consts)[0] == 0.0 and _clip_bounds(a, ins, consts)[1] is not None:
            st = Stage("relu", [v(ins[0])], out, attrs={"upper_clip": _clip_bounds(a, ins, consts)[1]}, name=name)
        elif _activation(op, a) is not None:
            act, alpha = _activation(op, a)
            st = Stage("act", [v(ins[0])], out, attrs={"activation": act, "alpha": alpha}, name=name)
        elif op == "Mul" and len(ins) == 2 and any(sigmoid_of.get(ins[k]) == ins[1 - k] for k in (0, 1)):
            x = ins[1] if sigmoid_of.get(ins[0]) == ins[1] else ins[0]
            st = Stage("act", [v(x)], out, attrs={"activation": "silu", "alpha": 0.0}, name=name)
        elif op == "Mul" and len(ins) == 2 and all(v(i) in tensors for i in ins):
            st = Stage("mul", [v(ins[0]), v(ins[1])], out, name=name)
        elif op == "ReduceMean" and ndim.get(v(ins[0])) == 4 and sorted(d % 4 for d in (_reduce_axes(a, ins, consts) or [])) == [2, 3]:
            if int(a.get("keepdims", 1)):
                st = Stage("gap", [v(ins[0])], out, name=name)
            else:  # mean over H, W to (N, C): the pool, then the flatten
                stages.append(Stage("gap", [v(ins[0])], f"{out}.gap", name=name))
                st = Stage("flatten", [f"{out}.gap"], out, name=name)
        elif op == "Squeeze" and ndim.get(v(ins[0])) == 4 and sorted(d % 4 for d in (_reduce_axes(a, ins, consts) or [])) == [2, 3]:
            st = Stage("flatten", [v(ins[0])], out, name=name)
        elif op == "Add" and len(ins) == 2 and all(v(i) in tensors for i in ins):
            st = Stage("add", [v(ins[0]), v(ins[1])], out, name=name)
        elif op == "Add" and len(stages) and stages[-1].kind == "linear" and stages[-1].output == v(ins[0]) \
                and ins[1] in consts and "b" not in stages[-1].weights and consts[ins[1]].size == stages[-1].weights["w"].shape[0]:
            lin = stages[-1]  # MatMul + Add(bias): one linear stage
            lin.weights["b"] = consts[ins[1]].reshape(-1)
            lin.name += "+" + name
            alias[out] = lin.output
            continue
        elif op in ("MaxPool", "AveragePool"):
            dilated = any(d != 1 for d in a.get("dilations", (1, 1)))
            ceil = bool(a.get("ceil_mode", 0))  # PyTorch's output size is checked against ONNX's below
            if (dilated and op == "AveragePool") or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
                raise UnsupportedError(f"pipeline: ONNX {op} {name}: auto_pad and AveragePool's dilations are not supported")
            kind = "maxpool" if op == "MaxPool" else "avgpool"
            at = dict(kernel_size=tuple(a["kernel_shape"]), stride=tuple(a.get("strides", (1, 1))), padding=_sym_pads(a.get("pads"), name),
                      ceil_mode=ceil)
            if kind == "avgpool":
                at["count_include_pad"] = bool(a.get("count_include_pad", 0))
            else:
                at["dilation"] = tuple(int(d) for d in a.get("dilations", (1, 1)))
            st = Stage(kind, [v(ins[0])], out, attrs=at, name=name)
        elif op == "GlobalAveragePool":
            st = Stage("gap", [v(ins[0])], out, name=name)
        elif op == "Flatten":
            if int(a.get("axis", 1)) != 1:
                raise UnsupportedError(f"pipeline: ONNX Flatten {name} with axis {a.get('axis')} (only 1)")
            st = Stage("flatten", [v(ins[0])], out, name=name)
        elif op == "Reshape" and ins[1] in consts and _is_flatten([int(d) for d in consts[ins[1]]], static.get(v(ins[0]))):
            st = Stage("flatten", [v(ins[0])], out, name=name)
        elif op == "Gemm":
            if a.get("transA", 0):
                raise UnsupportedError(f"pipeline: ONNX Gemm {name} with transA")
            w = consts[ins[1]] * float(a.get("alpha", 1.0))
            w = w if a.get("transB", 0) else w.T
            weights = {"w": np.ascontiguousarray(w)}
            if len(ins) > 2 and ins[2]:
                c = consts[ins[2]] * float(a.get("beta", 1.0))
                weights["b"] = np.broadcast_to(c.reshape(-1), (w.shape[0],)).copy()
            st = Stage("linear", [v(ins[0])], out, weights=weights, name=name)
        elif op == "MatMul" and ins[1] in consts and consts[ins[1]].ndim == 2 and len(static.get(v(ins[0]), (0, 0, 0))) == 2:
            st = Stage("linear", [v(ins[0])], out, weights={"w": np.ascontiguousarray(consts[ins[1]].T)}, name=name)
        elif op == "Softmax":
            axis = int(a.get("axis", -1 if _opset(m) >= 13 else 1))
            st = Stage("softmax", [v(ins[0])], out, attrs={"axis": axis}, name=name)
        elif op == "Split":  # one PyTorch stage per output read
            axis = int(a.get("axis", 0))
            sizes = consts[ins[1]].tolist() if len(ins) > 1 and ins[1] else a.get("split")
            n_out = len(node.output)
            for k, o in enumerate(node.output):
                args = [Ref(v(ins[0])), [int(d) for d in sizes] if sizes is not None else n_out, axis, k]
                st = torch_fallback(f"{name}[{k}]", [v(ins[0])], o, ops["Split"], args, {}, reason="ONNX Split has no fusekit pattern")
                st.attrs["op"] = "Split"
                if k < n_out - 1:
                    stages.append(st)
                    tensors.add(o)
                    ndim[o] = ndim.get(v(ins[0]))
            out = node.output[-1]
        elif op in ops:
            if op == "Concat":
                args: list = [[Ref(v(i)) if i not in consts else consts[i] for i in ins]]
                kwargs = {"dim": int(a.get("axis", 1))}
            elif op == "Clip":
                args, kwargs = [Ref(v(ins[0])), *_clip_bounds(a, ins, consts)], {}
            elif op == "LeakyRelu":
                args, kwargs = [Ref(v(ins[0])), float(a.get("alpha", 0.01))], {}
            elif op == "HardSigmoid":
                args, kwargs = [Ref(v(ins[0])), float(a.get("alpha", 0.2)), float(a.get("beta", 0.5))], {}
            elif op == "Transpose":
                args, kwargs = [Ref(v(ins[0])), [int(d) for d in a["perm"]]], {}
            elif op == "ReduceMean":
                args, kwargs = [Ref(v(ins[0])), _reduce_axes(a, ins, consts), int(a.get("keepdims", 1))], {}
                ins = ins[:1]
            elif op in ("Reshape", "Unsqueeze", "Squeeze") and (len(ins) > 1 or op == "Squeeze"):
                shape_arg = _reduce_axes(a, ins, consts) if op != "Reshape" else [int(d) for d in consts[ins[1]]]
                args, kwargs, ins = [Ref(v(ins[0])), tuple(shape_arg) if shape_arg is not None else None], {}, ins[:1]
                if op == "Squeeze" and shape_arg is None:
                    args = args[:1]
            elif op == "Unsqueeze":
                args, kwargs = [Ref(v(ins[0])), [int(d) for d in a["axes"]]], {}
            elif op == "LayerNormalization":
                args = [Ref(v(ins[0])), int(a.get("axis", -1)), float(a.get("epsilon", 1e-5))] + [
                    Ref(v(i)) if i not in consts else consts[i] for i in ins[1:] if i]
                kwargs = {}
            elif op == "Gather" and ins[1] in consts:
                args, kwargs, ins = [Ref(v(ins[0])), consts[ins[1]].astype(np.int64), int(a.get("axis", 0))], {}, ins[:1]
            elif op == "Slice":
                starts, ends = (consts[ins[k]].tolist() for k in (1, 2))
                axes = consts[ins[3]].tolist() if len(ins) > 3 and ins[3] else list(range(len(starts)))
                steps = consts[ins[4]].tolist() if len(ins) > 4 and ins[4] else [1] * len(starts)
                args, kwargs, ins = [Ref(v(ins[0])), starts, ends, axes, steps], {}, ins[:1]
            else:
                args, kwargs = [Ref(v(i)) if i not in consts else consts[i] for i in ins], {}
            refs = [v(i) for i in ins if i and i not in consts]
            st = torch_fallback(name, refs, out, ops[op], args, kwargs, reason=f"ONNX {op} has no fusekit pattern")
            st.attrs["op"] = op
        else:
            raise UnsupportedError(f"pipeline: ONNX node {name} ({op}) is not supported")
        stages.append(st)
        tensors.add(out)
        ndim.setdefault(out, _rank(st, ndim))
    prog = Program(_live(stages, v(g.output[0].name)), inputs[0], shape, v(g.output[0].name), "onnx")
    fill_shapes(prog.stages, prog.input, prog.input_shape)
    for s in prog.stages:
        if s.output in static and tuple(s.out_shape) != static[s.output]:
            raise UnsupportedError(f"pipeline: ONNX node {s.name} ({s.kind}): its PyTorch form gives shape {tuple(s.out_shape)}, "
                                   f"ONNX's {static[s.output]} (ceil_mode pooling with pads differs between them)")
    for s in prog.stages:
        if s.kind == "softmax":
            nd = len(s.in_shapes[0])
            if _opset(m) < 13 and s.attrs["axis"] % nd != nd - 1 and nd > 2:
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
