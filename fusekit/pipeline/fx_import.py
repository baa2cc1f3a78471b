"""PyTorch ``nn.Module`` -> primitive stages, through ``torch.fx`` symbolic tracing.

The model is traced on a CPU float32 copy in eval mode and run once with the example input's shape
(a ``torch.fx.Interpreter``) to learn every node's value: tensor shapes, and constants such as
``x.size(0)`` that only feed reshapes. Nodes without a rule become torch fallback stages (the
module, deep-copied, or the function with its argument template).
"""

from __future__ import annotations

import copy
import math
import operator
import warnings
from typing import Any

import numpy as np

from ..errors import UnsupportedError
from .ir import Program, Ref, Stage, fill_shapes, torch_fallback


def _np(t: Any) -> np.ndarray:
    return t.detach().cpu().to(dtype=__import__("torch").float64).numpy().copy()


def _record_values(gm: Any, example: Any) -> dict[str, Any]:
    import torch
    import torch.fx

    values: dict[str, Any] = {}

    class Rec(torch.fx.Interpreter):
        def run_node(self, n):  # type: ignore[override]
            v = super().run_node(n)
            values[n.name] = v
            return v

    from ..errors import TorchFallbackWarning

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", TorchFallbackWarning)  # fusekit.torch modules on these CPU values run PyTorch's code
        Rec(gm).run(example)
    return values


def import_module(model: Any, example_input: Any) -> Program:
    """Primitive stages of ``model`` for inputs shaped like ``example_input`` (a tensor or a shape)."""
    import torch
    import torch.fx
    import torch.nn as nn
    import torch.nn.functional as F

    shape = tuple(int(d) for d in (example_input.shape if hasattr(example_input, "shape") else example_input))
    from ..torch import FxTracer

    m = copy.deepcopy(model).cpu().float().eval()
    try:  # fusekit.torch modules (a converted model) stay whole, as torch.nn's do
        gm = torch.fx.GraphModule(m, FxTracer().trace(m))
    except Exception as e:  # noqa: BLE001
        raise UnsupportedError(f"pipeline: torch.fx cannot trace {type(model).__name__}: {type(e).__name__}: {e}") from None
    gen = torch.Generator().manual_seed(0)
    values = _record_values(gm, torch.randn(shape, generator=gen))

    stages: list[Stage] = []
    input_name = output = None
    tensor_nodes: set[str] = set()

    def is_t(a: Any) -> bool:
        return isinstance(a, torch.fx.Node) and a.name in tensor_nodes

    def template(a: Any) -> Any:
        """Argument template: tensor nodes -> Ref, other nodes -> their recorded constant value."""
        if isinstance(a, torch.fx.Node):
            return Ref(a.name) if a.name in tensor_nodes else values[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(template(e) for e in a)
        if isinstance(a, dict):
            return {k: template(v) for k, v in a.items()}
        return a

    def refs(a: Any) -> list[str]:
        out: list[str] = []
        if isinstance(a, torch.fx.Node):
            if a.name in tensor_nodes:
                out.append(a.name)
        elif isinstance(a, (list, tuple)):
            for e in a:
                out += refs(e)
        elif isinstance(a, dict):
            for e in a.values():
                out += refs(e)
        return out

    def fallback(node: Any, fn: Any, args: Any, kwargs: Any, reason: str) -> Stage:
        ins = list(dict.fromkeys(refs(args) + refs(kwargs)))
        return torch_fallback(node.name, ins, node.name, fn, list(template(args)), template(kwargs), reason)

    def arg(node: Any, i: int, key: str, default: Any = None) -> Any:
        if len(node.args) > i:
            return node.args[i]
        return node.kwargs.get(key, default)

    def flatten_ok(node: Any) -> bool:
        x = values[node.args[0].name]
        y = values[node.name]
        return isinstance(y, torch.Tensor) and y.dim() == 2 and y.shape[0] == x.shape[0] and y.shape[1] == math.prod(x.shape[1:])

    for node in gm.graph.nodes:
        v = values.get(node.name)
        if node.op == "placeholder":
            if input_name is not None:
                raise UnsupportedError("pipeline: models with more than one input are not supported")
            input_name = node.name
            tensor_nodes.add(node.name)
            continue
        if node.op == "output":
            res = node.args[0]
            if not isinstance(res, torch.fx.Node) or res.name not in tensor_nodes:
                raise UnsupportedError("pipeline: the model must return one tensor")
            output = res.name
            continue
        if isinstance(v, (list, tuple, dict)) and any(isinstance(e, torch.Tensor) for e in (v.values() if isinstance(v, dict) else v)):
            raise UnsupportedError(f"pipeline: node {node.name} ({node.target}) returns several tensors; not supported")
        if not isinstance(v, torch.Tensor):
            continue  # a constant (x.size(0), shapes): substituted into the templates that read it
        if node.op == "get_attr":
            continue  # a parameter read directly: a constant of the templates that read it
        tensor_nodes.add(node.name)
        name = node.name
        st: Stage | None = None
        tail: list[Stage] = []  # what a fusekit.torch module does after its layer: its own ReLU / ReLU6, a residual add + ReLU
        if node.op == "call_module":
            mod = gm.get_submodule(node.target)
            x = node.args[0] if node.args else None
            single = len(node.args) == 1 and not node.kwargs and is_t(x)
            act = getattr(mod, "activation", None)  # a fusekit.torch layer's own ReLU / ReLU6
            if isinstance(mod, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear, nn.BatchNorm2d)) and act in ("relu", "relu6"):
                tail.append(Stage("relu", [], name, attrs={"upper_clip": 6.0} if act == "relu6" else {}, name=f"{name}.{act}"))
            residual = len(node.args) == 2 and not node.kwargs and is_t(x) and is_t(node.args[1])
            if residual and isinstance(mod, nn.Conv2d):
                single = True  # fusekit.torch's conv(x, residual) (convert's fuse_residual): the BN after it adds the residual
            if residual and isinstance(mod, nn.BatchNorm2d):
                single = True  # fusekit.torch's bn(x, residual) (convert's fuse_residual): relu(bn(x) + residual)
                tail += [Stage("add", [node.args[1].name], name, name=f"{name}.add"), Stage("relu", [], name, name=f"{name}.relu")]
            if single and isinstance(mod, nn.Conv2d) and mod.padding_mode == "zeros" and not isinstance(mod.padding, str):
                st = Stage("conv", [x.name], name, weights={"w": _np(mod.weight)} | ({"b": _np(mod.bias)} if mod.bias is not None else {}),
                           attrs=dict(padding=tuple(mod.padding), stride=tuple(mod.stride), dilation=tuple(mod.dilation), groups=mod.groups), name=name)
            elif single and isinstance(mod, nn.BatchNorm2d) and mod.track_running_stats and mod.running_mean is not None:
                k = mod.num_features
                st = Stage("bn", [x.name], name, weights={
                    "mean": _np(mod.running_mean), "var": _np(mod.running_var),
                    "gamma": _np(mod.weight) if mod.affine else np.ones(k), "beta": _np(mod.bias) if mod.affine else np.zeros(k),
                }, attrs={"epsilon": float(mod.eps)}, name=name)
            elif single and isinstance(mod, nn.ReLU):
                st = Stage("relu", [x.name], name, name=name)
            elif single and isinstance(mod, nn.Hardtanh) and float(mod.min_val) == 0.0:  # ReLU6 is a Hardtanh(0, 6)
                st = Stage("relu", [x.name], name, attrs={"upper_clip": float(mod.max_val)}, name=name)
            elif single and isinstance(mod, nn.MaxPool2d) and not mod.return_indices:
                st = Stage("maxpool", [x.name], name, attrs=dict(kernel_size=_p(mod.kernel_size), stride=_p(mod.stride or mod.kernel_size), padding=_p(mod.padding),
                                                                ceil_mode=bool(mod.ceil_mode), dilation=_p(mod.dilation)), name=name)
            elif single and isinstance(mod, nn.AvgPool2d):
                st = Stage("avgpool", [x.name], name, attrs=dict(kernel_size=_p(mod.kernel_size), stride=_p(mod.stride or mod.kernel_size),
                                                                padding=_p(mod.padding), count_include_pad=bool(mod.count_include_pad),
                                                                ceil_mode=bool(mod.ceil_mode), divisor_override=mod.divisor_override), name=name)
            elif single and isinstance(mod, nn.AdaptiveAvgPool2d) and _p(mod.output_size) == (1, 1):
                st = Stage("gap", [x.name], name, name=name)
            elif single and isinstance(mod, nn.Flatten) and flatten_ok(node):
                st = Stage("flatten", [x.name], name, name=name)
            elif single and isinstance(mod, nn.Linear) and values[x.name].dim() == 2:
                st = Stage("linear", [x.name], name, weights={"w": _np(mod.weight)} | ({"b": _np(mod.bias)} if mod.bias is not None else {}), name=name)
            elif single and isinstance(mod, nn.Softmax) and mod.dim is not None:
                st = Stage("softmax", [x.name], name, attrs={"axis": int(mod.dim) % v.dim()}, name=name)
            elif single and isinstance(mod, (nn.Dropout, nn.Identity)):
                st = Stage("identity", [x.name], name, name=name)
            else:
                why = f"module {type(mod).__name__}" + (f" (groups={mod.groups})" if isinstance(mod, nn.Conv2d) else "") + " has no fusekit rule"
                st = fallback(node, copy.deepcopy(mod), node.args, node.kwargs, why)
                st.attrs["op"] = type(mod).__name__
        elif node.op in ("call_function", "call_method"):
            t = node.target
            x = node.args[0] if node.args else None
            if t in (operator.add, operator.iadd, torch.add, "add", "add_") and len(node.args) == 2 and not node.kwargs \
                    and is_t(node.args[0]) and is_t(node.args[1]):
                st = Stage("add", [node.args[0].name, node.args[1].name], name, name=name)
            elif t in (F.relu, torch.relu, torch.relu_, "relu", "relu_") and is_t(x):  # inplace or not: same value
                st = Stage("relu", [x.name], name, name=name)
            elif t in (F.relu6,) and is_t(x):
                st = Stage("relu", [x.name], name, attrs={"upper_clip": 6.0}, name=name)
            elif t in (torch.flatten, "flatten", "view", "reshape") and is_t(x) and flatten_ok(node) and (
                    t not in (torch.flatten, "flatten") or (arg(node, 1, "start_dim", 0) == 1 and arg(node, 2, "end_dim", -1) == -1)):
                st = Stage("flatten", [x.name], name, name=name)
            elif t in (F.adaptive_avg_pool2d,) and is_t(x) and _p(template(arg(node, 1, "output_size"))) == (1, 1):
                st = Stage("gap", [x.name], name, name=name)
            elif t in ("mean",) and is_t(x) and tuple(template(arg(node, 1, "dim", ()))) in ((2, 3), (-2, -1)) and template(arg(node, 2, "keepdim", False)):
                st = Stage("gap", [x.name], name, name=name)
            elif t in (F.softmax, torch.softmax, "softmax") and is_t(x) and arg(node, 1, "dim") is not None \
                    and node.kwargs.get("dtype") is None and len(node.args) <= 2:
                st = Stage("softmax", [x.name], name, attrs={"axis": int(template(arg(node, 1, "dim"))) % v.dim()}, name=name)
            elif t in (F.dropout,) or t in ("contiguous",):
                st = Stage("identity", [x.name], name, name=name)
            else:
                fn = t if node.op == "call_function" else _method(t)
                st = fallback(node, fn, node.args, node.kwargs, f"{getattr(t, '__name__', t)} has no fusekit rule")
        else:
            raise UnsupportedError(f"pipeline: unexpected fx node {node.op} {node.target}")
        if tail and st.kind != "torch":  # a fallback runs the whole module, tail included
            prev = st.output = f"{name}.pre"
            stages.append(st)
            for i, t in enumerate(tail):
                t.inputs = [prev] + t.inputs
                t.output = prev = name if i == len(tail) - 1 else f"{name}.t{i}"
                stages.append(t)
            continue
        stages.append(st)
    if input_name is None or output is None:
        raise UnsupportedError("pipeline: traced graph has no input or no output")
    prog = Program(stages, input_name, shape, output, "torch.fx")
    fill_shapes(prog.stages, prog.input, prog.input_shape)
    for s in prog.stages:  # sanity: the shape rules agree with what the model computed
        got = values.get(s.output)
        if isinstance(got, torch.Tensor) and tuple(got.shape) != tuple(s.out_shape):
            raise UnsupportedError(f"pipeline: shape rule of {s.name} gave {s.out_shape}, the model computed {tuple(got.shape)}")
    return prog


def _method(name: str) -> Any:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, name)(*args, **kwargs)

    call.__name__ = f"Tensor.{name}"
    return call


def _p(v: Any) -> tuple[int, int]:
    if isinstance(v, (list, tuple)):
        return (int(v[0]), int(v[1])) if len(v) == 2 else (int(v[0]), int(v[0]))
    return (int(v), int(v)) if v is not None else (0, 0)
