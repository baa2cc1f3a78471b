"""PyTorch ``nn.Module`` -> primitive stages through ``torch.export``: an ATen-level graph.

``torch.export`` traces what ``torch.fx`` symbolic tracing cannot (Python control flow on shapes is
specialized for the example input) and turns module and functional forms into the same ATen call
(``nn.BatchNorm2d`` and ``F.batch_norm`` are both ``aten.batch_norm``), so one table of node rules
covers both. It is also the graph a ``torch.compile`` backend sees. Parameters, buffers and lifted
constants arrive as graph inputs and are read as the stages' weights. A node without a rule becomes a
PyTorch fallback stage calling its ATen op (an in-place op through its out-of-place form, so no
planned buffer is written behind the plan's back); one item of a node with several outputs is a
fallback of its own, and a ``split`` / ``chunk`` / ``slice`` item over channels a channel view.
"""

from __future__ import annotations

import copy
import math
import operator
from typing import Any, Callable

import numpy as np

from ..errors import UnsupportedError
from .fx_nodes import _item, _np, bn_stage, channel_layer_norm_stage, materialize_nhwc, scalar_affine, affine_stage
from .ir import Program, Ref, Stage, adaptive_avg_stage, channel_shuffle_stage, conv_padding, fill_shapes, pool_stage, torch_fallback, upsample_stage
from .ir import _pair as ir_pair

#: ATen activations (in-place forms too) -> (fusekit activation, alpha from the node's arguments).
_ACTS: dict[str, Callable[[dict], tuple[str, float] | None]] = {
    "silu": lambda a: ("silu", 0.0), "sigmoid": lambda a: ("sigmoid", 0.0), "tanh": lambda a: ("tanh", 0.0),
    "hardswish": lambda a: ("hardswish", 0.0), "hardsigmoid": lambda a: ("hardsigmoid", 0.0),
    "gelu": lambda a: ("gelu_tanh" if a.get("approximate", "none") == "tanh" else "gelu", 0.0),
    "leaky_relu": lambda a: ("leaky_relu", float(a.get("negative_slope", 0.01))),
    "elu": lambda a: ("elu", float(a.get("alpha", 1.0))) if a.get("scale", 1) == 1 and a.get("input_scale", 1) == 1 else None,
    "hardtanh": lambda a: ("clip", float(a.get("max_val", 1.0))) if float(a.get("min_val", -1.0)) == 0.0 else None,
}
#: ATen ops that return their input's value in eval (dropout is not training here).
_IDENTITIES = ("dropout", "feature_dropout", "alpha_dropout", "clone", "contiguous", "alias", "detach", "lift_fresh_copy")


#: ATen ops whose tensor argument gives only a shape, dtype and device (Swin's attention mask starts
#: as ``x.new_zeros(...)``): folded to constants, like the ops on weights alone.
SHAPE_ONLY = ("new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like")


def _op_name(target: Any) -> str:
    """``aten.silu_.default`` -> "silu_"."""
    return getattr(getattr(target, "_overloadpacket", None), "__name__", getattr(target, "__name__", str(target)))


def _pair(v: Any, default: tuple[int, int] | None = None) -> tuple[int, int]:
    """ir's pair of an ATen int[2] argument; ``default`` where the schema leaves it empty (a pool's stride)."""
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        assert default is not None
        return default
    return ir_pair(v)


def _out_of_place(target: Any) -> Any:
    """The out-of-place overload of an in-place ATen op (``aten.add_.Tensor`` -> ``aten.add.Tensor``), else ``target``."""
    import torch

    name = _op_name(target)
    if not name.endswith("_") or name.startswith("_"):
        return target
    packet = getattr(torch.ops.aten, name[:-1], None)
    overload = getattr(target, "_overloadname", "default")
    return getattr(packet, overload, target) if packet is not None else target


class ExportReader:
    """One exported program being read into stages."""

    def __init__(self, ep: Any) -> None:
        sig = ep.graph_signature
        state = {**ep.state_dict, **getattr(ep, "constants", {})}
        self.ep, self.graph = ep, ep.graph
        self.consts: dict[str, Any] = {}
        for table in (sig.inputs_to_parameters, sig.inputs_to_buffers, getattr(sig, "inputs_to_lifted_tensor_constants", {})):
            for placeholder, key in table.items():
                t = state[key].detach()  # weights in float64: what is computed from them alone folds as the reference runs
                self.consts[placeholder] = t.double() if t.is_floating_point() else t
        self.user_inputs = list(sig.user_inputs)
        self.multi: dict[str, tuple[Any, Any, Any]] = {}  # several outputs: node -> (op, args template, kwargs template)
        self.first_only: set[str] = set()  # batch norms that return (y, saved statistics...): item 0 is the stage
        self.splits: dict[str, list[int]] = {}  # channel splits: node -> each item's first channel
        self.shuffles: dict[str, tuple[str, int]] = {}  # channel shuffles: last node -> (image, groups)
        self.skip: set[str] = set()  # nodes a shuffle stands for
        self.nhwc: dict[str, str] = {}  # a channels-last region's (N, H, W, C) value -> the (N, C, H, W) image value holding it
        self.materialized: set[str] = set()  # region values made real for a reader without a channel rule
        for node in self.graph.nodes:
            self.find_shuffle(node)

    def find_shuffle(self, node: Any) -> None:
        """ShuffleNet's channel shuffle, view (N, g, C/g, H, W) -> transpose(1, 2) -> view (N, C, H, W) (a
        contiguous in between or not): one channel_shuffle stage instead of three copies."""
        views = ("view", "reshape", "_unsafe_view")
        if node.op != "call_function" or _op_name(node.target) not in views:
            return
        chain, t = [], node.args[0]
        while getattr(t, "op", None) == "call_function" and _op_name(t.target) in ("clone", "contiguous") and len(t.users) == 1:
            chain.append(t)
            t = t.args[0]
        if getattr(t, "op", None) != "call_function" or _op_name(t.target) != "transpose" or len(t.users) != 1 or sorted(int(d) for d in t.args[1:3]) != [1, 2]:
            return
        v = t.args[0]
        if getattr(v, "op", None) != "call_function" or _op_name(v.target) not in views or len(v.users) != 1:
            return
        y = v.args[0]
        five, four = self.shape(v), self.shape(y)
        if not self.value(y) or len(four) != 4 or len(five) != 5 or self.shape(node) != four or five[0] != four[0] or five[1] * five[2] != four[1] \
                or five[3:] != four[2:]:
            return
        self.shuffles[node.name] = (y.name, int(five[1]))
        self.skip |= {v.name, t.name, *(c.name for c in chain)}

    # -- node arguments ------------------------------------------------------------------------
    def value(self, a: Any) -> bool:
        """Whether ``a`` is a node of the graph that carries an activation (not a weight)."""
        import torch

        return isinstance(a, torch.fx.Node) and a.name not in self.consts

    def const(self, a: Any) -> Any:
        """The tensor of a weight node (parameter, buffer, lifted constant), else None."""
        import torch

        return self.consts.get(a.name) if isinstance(a, torch.fx.Node) else None

    def shape(self, a: Any) -> tuple[int, ...]:
        val = a.meta.get("val")
        return tuple(int(d) for d in val.shape) if hasattr(val, "shape") else ()

    def template(self, a: Any) -> Any:
        """A fallback's argument: Ref(value), a weight's tensor, or the constant itself (recursively)."""
        import torch

        if isinstance(a, torch.fx.Node):
            return self.consts[a.name] if a.name in self.consts else Ref(a.name)
        if isinstance(a, (list, tuple)):
            return type(a)(self.template(e) for e in a)
        if isinstance(a, dict):
            return {k: self.template(v) for k, v in a.items()}
        return a

    def refs(self, a: Any) -> list[str]:
        import torch

        out: list[str] = []
        torch.fx.node.map_arg(a, lambda n: out.append(n.name) if n.name not in self.consts and n.name not in out else None)
        return out

    @staticmethod
    def named(node: Any) -> dict[str, Any] | None:
        """The node's arguments by their schema names (None where the schema cannot say)."""
        from torch.fx.operator_schemas import normalize_function

        try:
            r = normalize_function(node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
        except Exception:  # noqa: BLE001 - an op without a schema: a fallback
            return None
        return None if r is None else dict(r.kwargs)

    def fallback(self, node: Any, reason: str) -> Stage:
        op = _out_of_place(node.target)
        args, kwargs = self.template(tuple(node.args)), self.template(dict(node.kwargs))
        st = torch_fallback(node.name, self.refs((node.args, node.kwargs)), node.name, op, list(args), kwargs, reason=reason)
        st.attrs["op"] = _op_name(op)
        return st

    # -- rules ---------------------------------------------------------------------------------
    def stages(self, node: Any) -> list[Stage]:
        """The stages of one call_function node (empty: nothing to do, or an op with several outputs)."""
        op = _op_name(node.target)
        if node.name in self.shuffles:
            y, groups = self.shuffles[node.name]
            return [channel_shuffle_stage(node.name, y, node.name, groups)]
        if op.startswith("_assert"):  # export's checks of a value's metadata: no value, nothing to run
            return []
        if not self.refs((node.args, node.kwargs)) and not isinstance(node.meta.get("val"), (list, tuple)):
            return self.fold(node)
        if op in SHAPE_ONLY:  # its tensor argument gives only a shape and dtype, fixed in this graph: a constant
            return self.fold(node, stand_in=True)
        if node.target is operator.getitem:
            return self.made_real(self.item(node))
        if isinstance(node.meta.get("val"), (list, tuple)):
            return self.several(node, op)
        a = self.named(node)
        if a is not None:
            region = self.nhwc_node(node, op, a)
            if region is not None:
                return region
        made = self.rule(node, op, a) if a is not None else None
        return self.made_real(made if made is not None else [self.fallback(node, f"aten {op} has no fusekit rule")])

    def fold(self, node: Any, stand_in: bool = False) -> list[Stage]:
        """A node of weights and constants alone (``gamma.reshape(1, -1, 1, 1)``): computed here, once,
        and read as a weight by the nodes after it. ``stand_in``: its activation arguments replaced by
        zeros of their shape and dtype (an op of :data:`SHAPE_ONLY` reads nothing else of them)."""
        import torch

        def arg(a: Any) -> Any:  # floating values in float64, as the weights
            if stand_in and self.value(a):
                val = a.meta["val"]
                return torch.zeros(tuple(int(d) for d in val.shape), dtype=torch.float64 if val.dtype.is_floating_point else val.dtype)
            t = self.template(a)
            return t.double() if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float16, torch.bfloat16) else t

        with torch.no_grad():
            args, kwargs = torch.fx.node.map_aggregate(tuple(node.args), arg), torch.fx.node.map_aggregate(dict(node.kwargs), arg)
            self.consts[node.name] = node.target(*args, **kwargs)
        return []

    def made_real(self, made: list[Stage]) -> list[Stage]:
        return materialize_nhwc(made, self.nhwc, self.materialized)

    def nhwc_node(self, node: Any, op: str, a: dict) -> list[Stage] | None:
        """ConvNeXt's channels-last blocks: permute (N, C, H, W) -> (N, H, W, C), then LayerNorm, Linear,
        activations and a layer scale over the last dim, then the permute back. Each op inside runs as a
        channel op on the (N, C, H, W) image (cln, a 1x1 conv, act, a BN-form scale); None for a node
        outside such a region (or one without a channel rule: the region value is then made real)."""
        x, name = a.get("input", a.get("self")), node.name
        dims = tuple(int(d) % 4 for d in a.get("dims", ())) if op == "permute" else None
        if dims == (0, 2, 3, 1) and self.value(x) and len(self.shape(x)) == 4 and x.name not in self.nhwc:
            self.nhwc[name] = x.name
            return []
        if not (self.value(x) and x.name in self.nhwc):
            return None
        src, c, out = self.nhwc[x.name], self.shape(x)[-1], f"{name}.nchw"
        base = op.rstrip("_")
        st: Stage | None = None
        if dims == (0, 3, 1, 2):
            return [Stage("identity", [src], name, name=name)]
        if op == "layer_norm" and tuple(a.get("normalized_shape", ())) == (c,):
            gamma, beta = self.const(a.get("weight")), self.const(a.get("bias"))
            if (a.get("weight") is None or gamma is not None) and (a.get("bias") is None or beta is not None):
                st = channel_layer_norm_stage(src, out, name, c, gamma, beta, float(a.get("eps", 1e-5)))
        elif op == "linear" and self.const(a.get("weight")) is not None and (a.get("bias") is None or self.const(a["bias"]) is not None):
            w = {"w": _np(self.const(a["weight"]))[:, :, None, None]} | ({"b": _np(self.const(a["bias"]))} if a.get("bias") is not None else {})
            st = Stage("conv", [src], out, weights=w, attrs=dict(padding=(0, 0), stride=(1, 1), dilation=(1, 1), groups=1), name=name)
        elif base == "relu" or (base in _ACTS and _ACTS[base](a) is not None):
            act = ("relu", 0.0) if base == "relu" else _ACTS[base](a)
            st = Stage("act", [src], out, attrs={"activation": act[0], "alpha": act[1]}, name=name)
        elif op in _IDENTITIES or base in _IDENTITIES:
            self.nhwc[name] = src
            return []
        elif base == "mul" and self.const(a.get("other")) is not None and tuple(self.const(a["other"]).shape) in ((c,), (1, 1, 1, c)):
            st = bn_stage(src, out, np.zeros(c), np.ones(c), self.const(a["other"]), None, 0.0, name=name)
        if st is None:
            return None
        self.nhwc[name] = out
        return [st]

    def rule(self, node: Any, op: str, a: dict) -> list[Stage] | None:
        name = node.name
        if op == "cat" and int(a.get("dim", 0)) % max(len(self.shape(node)), 1) == 1 and all(self.value(t) for t in a["tensors"]):
            import torch

            parts = [t.name for t in a["tensors"]]
            return [torch_fallback(name, parts, name, torch.cat, [[Ref(p) for p in parts], 1], reason="channel concatenation")]
        x = a.get("input", a.get("self"))
        base = op.rstrip("_")
        if base == "mul" and not self.value(x) and self.value(a.get("other")):  # k * x: the constant first
            a, x = {**a, "self": a["other"], "other": x}, a["other"]
        if not self.value(x):
            return None
        rank = len(self.shape(x))
        if base == "relu":
            return [Stage("relu", [x.name], name, name=name)]
        if base in _ACTS:
            act = _ACTS[base](a)
            if act is None:
                return None
            if act[0] == "clip":
                return [Stage("relu", [x.name], name, attrs={"upper_clip": act[1]}, name=name)]
            return [Stage("act", [x.name], name, attrs={"activation": act[0], "alpha": act[1]}, name=name)]
        if op in _IDENTITIES or base in _IDENTITIES:
            return [Stage("identity", [x.name], name, name=name)] if not a.get("train", False) else None
        if op == "conv2d" and self.const(a.get("weight")) is not None:
            w = {"w": _np(self.const(a["weight"]))}
            if a.get("bias") is not None:
                if self.const(a["bias"]) is None:
                    return None
                w["b"] = _np(self.const(a["bias"]))
            dilation = _pair(a.get("dilation"), (1, 1))
            return [Stage("conv", [x.name], name, weights=w, attrs=dict(
                conv_padding(a.get("padding", 0), tuple(w["w"].shape[2:]), dilation), stride=_pair(a.get("stride"), (1, 1)),
                dilation=dilation, groups=int(a.get("groups", 1))), name=name)]
        if op == "batch_norm" and not a.get("training") and rank == 4:
            return self.bn(x, name, a)
        if base in ("add", "mul") and self.value(a.get("other")) and a.get("alpha", 1) == 1:
            return [Stage(base, [x.name, a["other"].name], name, name=name)]
        if base in ("add", "sub", "rsub", "mul", "div") and rank == 4 and a.get("alpha", 1) == 1:  # x + k, k - x, x * k, x / k ...
            affine = scalar_affine("sub" if base == "rsub" else base, base != "rsub", a.get("other"))
            if affine is not None:  # a number k: the same factor and offset for every channel
                return [affine_stage(x.name, name, self.shape(x)[1], *affine)]
        if base == "mul" and rank == 4:  # a layer scale: a BN stage the conv before folds
            c, g = self.shape(x)[1], self.const(a.get("other"))
            if g is not None and tuple(g.shape) in ((c, 1, 1), (1, c, 1, 1)):
                return [bn_stage(x.name, name, np.zeros(c), np.ones(c), g, None, 0.0)]
        if op == "upsample_nearest2d" and rank == 4:
            st = upsample_stage(name, x.name, name, self.shape(x), self.shape(node))
            return None if st is None else [st]
        if op == "adaptive_avg_pool2d" and rank == 4:
            st = adaptive_avg_stage(name, x.name, name, self.shape(x)[2:], self.shape(node)[2:])
            return None if st is None else [st]
        if op == "mean" and rank == 4 and sorted(int(d) % 4 for d in a.get("dim") or ()) == [2, 3] and a.get("dtype") is None:
            if a.get("keepdim"):
                return [Stage("gap", [x.name], name, name=name)]
            return [Stage("gap", [x.name], name + "__pooled", name=name), Stage("flatten", [name + "__pooled"], name, name=name)]
        if op in ("max_pool2d", "avg_pool2d") and rank == 4:
            return [pool_stage("maxpool" if op == "max_pool2d" else "avgpool", x.name, name, a["kernel_size"], a.get("stride"),
                               _pair(a.get("padding"), (0, 0)), bool(a.get("ceil_mode")), dilation=_pair(a.get("dilation"), (1, 1)),
                               count_include_pad=bool(a.get("count_include_pad", True)), divisor_override=a.get("divisor_override"), name=name)]
        if op in ("flatten", "view", "reshape", "_unsafe_view") and rank == 4 and self.shape(node) == (self.shape(x)[0], math.prod(self.shape(x)[1:])):
            return [Stage("flatten", [x.name], name, name=name)]
        if op == "linear" and rank == 2 and self.const(a.get("weight")) is not None:
            w = {"w": _np(self.const(a["weight"]))} | ({"b": _np(self.const(a["bias"]))} if self.const(a.get("bias")) is not None else {})
            return [Stage("linear", [x.name], name, weights=w, name=name)] if a.get("bias") is None or "b" in w else None
        if op in ("softmax", "_softmax") and a.get("dtype") is None and not a.get("half_to_float"):
            return [Stage("softmax", [x.name], name, attrs={"axis": int(a["dim"]) % rank}, name=name)]
        if op == "slice" and rank == 4:
            return self.slice(node, x, a)
        return None

    def bn(self, x: Any, name: str, a: dict) -> list[Stage] | None:
        mean, var = self.const(a.get("running_mean")), self.const(a.get("running_var"))
        if mean is None or var is None:
            return None
        return [bn_stage(x.name, name, mean, var, self.const(a.get("weight")), self.const(a.get("bias")), float(a.get("eps", 1e-5)))]

    def slice(self, node: Any, x: Any, a: dict) -> list[Stage] | None:
        """x[:, a:b] over channels: a channel view; a slice that keeps the whole dim: nothing to do."""
        dim, size = int(a.get("dim", 0)) % 4, self.shape(x)[int(a.get("dim", 0)) % 4]
        start, end, step = a.get("start") or 0, a.get("end"), a.get("step", 1)
        start, end = (start + size if start < 0 else start), size if end is None else min(end + size if end < 0 else end, size)
        if step != 1:
            return None
        if start == 0 and end >= size:
            return [Stage("identity", [x.name], node.name, name=node.name)]
        if dim != 1:
            return None
        st = self.fallback(node, "channel slice")
        st.attrs["channel_slice"] = int(start)
        return [st]

    def several(self, node: Any, op: str) -> list[Stage]:
        """An op with several outputs: its items become stages where getitem reads them."""
        a = self.named(node) or {}
        if op == "_native_batch_norm_legit_no_training":
            self.first_only.add(node.name)
            return []
        if op in ("split", "split_with_sizes", "chunk", "unsafe_split") and int(a.get("dim", 0)) % 4 == 1 and len(self.shape(node.args[0])) == 4:
            sizes = [int(v.shape[1]) for v in node.meta["val"]]
            self.splits[node.name] = [sum(sizes[:i]) for i in range(len(sizes))]
        self.multi[node.name] = (_out_of_place(node.target), self.template(tuple(node.args)), self.template(dict(node.kwargs)))
        return []

    def item(self, node: Any) -> list[Stage]:
        src, index = node.args
        if src.name in self.first_only:
            if index != 0:
                raise UnsupportedError(f"pipeline: {node.name} reads the batch-norm statistics of {src.name} (only its output has a stage)")
            return self.bn(src.args[0], node.name, {"running_mean": src.args[3], "running_var": src.args[4], "weight": src.args[1],
                                                   "bias": src.args[2], "eps": src.args[6]}) or [self.fallback(node, "batch norm")]
        fn, args, kwargs = self.multi[src.name]
        item = _item(fn, index)
        st = torch_fallback(node.name, self.refs((src.args, src.kwargs)), node.name, item, list(args), kwargs,
                            reason=f"{item.__name__}: one tensor of several")
        if src.name in self.splits:
            st.attrs["channel_slice"] = self.splits[src.name][index]
        return [st]

    def run(self, shape: tuple[int, ...]) -> Program:
        if len(self.user_inputs) != 1:
            raise UnsupportedError(f"pipeline: the exported graph takes {len(self.user_inputs)} inputs; the pipeline runs models of one image")
        stages: list[Stage] = []
        output = None
        for node in self.graph.nodes:
            if node.op == "call_function" and node.name not in self.skip:
                try:
                    stages += self.stages(node)
                except UnsupportedError:
                    raise
                except Exception as e:  # noqa: BLE001 - a node no rule foresaw: name it, not fusekit's internals
                    raise UnsupportedError(f"pipeline: cannot import node {node.name} ({node.target}) of the exported graph: "
                                           f"{type(e).__name__}: {e}") from e
            elif node.op == "output":
                outs = node.args[0]
                outs = outs[0] if isinstance(outs, (list, tuple)) and len(outs) == 1 else outs
                if not self.value(outs):
                    raise UnsupportedError("pipeline: the exported model does not return one tensor")
                output = outs.name
        fill_shapes(stages, self.user_inputs[0], shape)
        return Program(stages, self.user_inputs[0], tuple(shape), output, source="torch.export")


def import_exported(model: Any, shape: tuple[int, ...]) -> Program:
    """Primitive stages of torch ``nn.Module`` ``model`` exported (``torch.export``) for inputs of ``shape``."""
    import torch

    m = copy.deepcopy(model).cpu().float().eval()
    try:
        ep = torch.export.export(m, (torch.zeros(shape),))
    except Exception as e:  # noqa: BLE001 - say which model and why, not torch's internals alone
        raise UnsupportedError(f"pipeline: torch.export could not export {type(model).__name__} ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''})") from e
    return ExportReader(ep).run(shape)
