"""ONNX model (file path or ``onnx.ModelProto``) -> primitive stages.

Supported nodes: Conv, BatchNormalization, Relu, Add, MaxPool, AveragePool, GlobalAveragePool,
Flatten (axis 1), Gemm, MatMul (+ Add of a constant bias), Softmax, Reshape to (N, -1), Identity,
Dropout. A few others run through PyTorch as fallbacks (Sigmoid, Tanh, Clip, Mul, Sub, Div,
LeakyRelu, HardSigmoid, HardSwish, Concat, grouped Conv); any other node raises UnsupportedError.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UnsupportedError
from .ir import Program, Ref, Stage, fill_shapes, torch_fallback


def load(model: Any) -> Any:
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model
    return onnx.load(str(model))


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

    return {
        "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Clip": clip, "Mul": torch.mul, "Sub": torch.sub, "Div": torch.div,
        "LeakyRelu": F.leaky_relu, "HardSigmoid": F.hardsigmoid, "HardSwish": F.hardswish, "Concat": torch.cat,
    }


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
    ops = _torch_ops()

    def v(name: str) -> str:
        return alias.get(name, name)

    for k, node in enumerate(g.node):
        a = _attrs(node)
        name = node.name or f"{node.op_type}_{k}"
        ins = list(node.input)
        out = node.output[0]
        op = node.op_type
        st: Stage | None = None
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
            if a.get("ceil_mode", 0) or (dilated and op == "AveragePool") or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
                raise UnsupportedError(f"pipeline: ONNX {op} {name}: ceil_mode, auto_pad and AveragePool's dilations are not supported")
            kind = "maxpool" if op == "MaxPool" else "avgpool"
            at = dict(kernel_size=tuple(a["kernel_shape"]), stride=tuple(a.get("strides", (1, 1))), padding=_sym_pads(a.get("pads"), name))
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
        elif op == "Reshape" and ins[1] in consts:
            tgt = [int(d) for d in consts[ins[1]]]
            if len(tgt) == 2 and tgt[1] == -1 and tgt[0] in (0, shape[0]):
                st = Stage("flatten", [v(ins[0])], out, name=name)
            else:
                raise UnsupportedError(f"pipeline: ONNX Reshape {name} to {tgt} (only flatten to (N, -1))")
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
        elif op == "MatMul" and ins[1] in consts and consts[ins[1]].ndim == 2:
            st = Stage("linear", [v(ins[0])], out, weights={"w": np.ascontiguousarray(consts[ins[1]].T)}, name=name)
        elif op == "Softmax":
            axis = int(a.get("axis", -1 if _opset(m) >= 13 else 1))
            st = Stage("softmax", [v(ins[0])], out, attrs={"axis": axis}, name=name)
        elif op in ops:
            if op == "Concat":
                args: list = [[Ref(v(i)) if i not in consts else consts[i] for i in ins]]
                kwargs = {"dim": int(a.get("axis", 1))}
            elif op == "Clip":
                args, kwargs = [Ref(v(ins[0])), *_clip_bounds(a, ins, consts)], {}
            elif op == "LeakyRelu":
                args, kwargs = [Ref(v(ins[0])), float(a.get("alpha", 0.01))], {}
            else:
                args, kwargs = [Ref(v(i)) if i not in consts else consts[i] for i in ins], {}
            refs = [v(i) for i in ins if i and i not in consts]
            st = torch_fallback(name, refs, out, ops[op], args, kwargs, reason=f"ONNX {op} has no fusekit pattern")
            st.attrs["op"] = op
        else:
            raise UnsupportedError(f"pipeline: ONNX node {name} ({op}) is not supported")
        stages.append(st)
        tensors.add(out)
    prog = Program(stages, inputs[0], shape, v(g.output[0].name), "onnx")
    fill_shapes(prog.stages, prog.input, prog.input_shape)
    for s in prog.stages:
        if s.kind == "softmax":
            nd = len(s.in_shapes[0])
            if _opset(m) < 13 and s.attrs["axis"] % nd != nd - 1 and nd > 2:
                raise UnsupportedError(f"pipeline: ONNX Softmax {s.name} (opset < 13 flattens to 2-D): only the last axis")
            s.attrs["axis"] = s.attrs["axis"] % nd
    return prog


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
