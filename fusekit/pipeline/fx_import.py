"""PyTorch ``nn.Module`` -> primitive stages, through ``torch.fx`` symbolic tracing.

The model is traced on a CPU float32 copy in eval mode and run once with the example input's shape
(a ``torch.fx.Interpreter``) to learn every node's value: tensor shapes, and constants such as
``x.size(0)`` that only feed reshapes. Module and functional forms of a layer become the same stage
(``nn.BatchNorm2d`` and ``F.batch_norm``, ``nn.SiLU`` and ``F.silu``). Nodes without a rule become
torch fallback stages (the module, deep-copied without gradients, or the function with its argument
template); a node returning several tensors (``chunk``, ``split``, ``unbind``) becomes one fallback
per item read from it.
"""

from __future__ import annotations

import copy
import math
import operator
from typing import Any

import numpy as np

from ..errors import UnsupportedError
from ..ops.common import module_activation
from .fx_nodes import (_dims, _is_fusekit_layer, _item, _method, _np, _own_forward, _p, _permutation,
                       _record_values, _slicing, bn_stage, channel_layer_norm_stage, materialize_nhwc, scalar_affine, affine_stage, spliced)
from .ir import Program, Ref, Stage, adaptive_avg_stage, channel_shuffle_stage, conv_padding, fill_shapes, pool_stage, torch_fallback, upsample_stage


class _Importer:
    """One traced model's nodes -> stages (see the module docstring)."""

    def __init__(self, gm: Any, values: dict[str, Any]) -> None:
        self.gm, self.values = gm, values
        self.tensors: set[str] = set()  # nodes whose value is a tensor
        self.multi: dict[str, tuple] = {}  # nodes whose value holds several tensors: name -> (callable, args, kwargs)
        self.consts: set[str] = set()  # parameters and what is computed from them alone (constants of the templates)
        # channels-last regions: a node whose value is permute(0, 2, 3, 1) of an image -> the stage value holding
        # the same numbers as an (N, C, H, W) image (per-position ops on it become channel ops on that image)
        self.nhwc: dict[str, str] = {}
        self.materialized: set[str] = set()
        self.opaque: set[str] = set()  # submodules torch.fx could not trace (left whole in the graph)
        self.shuffles: dict[str, tuple[str, int]] = {}  # a channel shuffle's last node -> (its input, groups)
        self.shuffle_inner: set[str] = set()  # the view / transpose / contiguous nodes before it
        self.stages: list[Stage] = []

    # -- arguments ---------------------------------------------------------------------------
    def is_t(self, a: Any) -> bool:
        import torch.fx

        return isinstance(a, torch.fx.Node) and a.name in self.tensors

    def template(self, a: Any) -> Any:
        """Argument template: tensor nodes -> Ref, other nodes -> their recorded constant value."""
        import torch.fx

        if isinstance(a, torch.fx.Node):
            if a.name in self.multi:
                raise UnsupportedError(f"pipeline: node {a.name} returns several tensors and one node reads them all at once")
            return Ref(a.name) if a.name in self.tensors else self.values[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(self.template(e) for e in a)
        if isinstance(a, dict):
            return {k: self.template(v) for k, v in a.items()}
        if isinstance(a, slice):  # x[:, :c // 2] with c a traced size
            return slice(self.template(a.start), self.template(a.stop), self.template(a.step))
        return a

    def refs(self, a: Any) -> list[str]:
        if self.is_t(a):
            return [a.name]
        if isinstance(a, (list, tuple)):
            return [r for e in a for r in self.refs(e)]
        if isinstance(a, dict):
            return [r for e in a.values() for r in self.refs(e)]
        return []

    @staticmethod
    def arg(node: Any, i: int, key: str, default: Any = None) -> Any:
        return node.args[i] if len(node.args) > i else node.kwargs.get(key, default)

    def fallback(self, node: Any, fn: Any, reason: str, args: Any = None, kwargs: Any = None) -> Stage:
        args = node.args if args is None else args
        kwargs = node.kwargs if kwargs is None else kwargs
        ins = list(dict.fromkeys(self.refs(args) + self.refs(kwargs)))
        st = torch_fallback(node.name, ins, node.name, fn, list(self.template(args)), self.template(kwargs), reason)
        first = self.channel_slice_of(node.name, ins) if _slicing(node) else None
        if first is not None:
            st.attrs["channel_slice"] = first
        return st

    def channel_slice_of(self, name: str, ins: list[str]) -> int | None:
        """The first channel if the value ``name`` is a view of channels of its one image input
        (``chunk`` / ``split`` items, ``x[:, a:b]``, ``narrow``), else None."""
        import torch

        y, x = self.values.get(name), self.values.get(ins[0]) if len(ins) == 1 else None
        if not (isinstance(y, torch.Tensor) and isinstance(x, torch.Tensor) and y.dim() == x.dim() == 4):
            return None
        if (y.shape[0], *y.shape[2:]) != (x.shape[0], *x.shape[2:]) or y.shape[1] > x.shape[1] or y.stride() != x.stride() or x.stride(1) < 1:
            return None
        if y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            return None
        first, rest = divmod(y.storage_offset() - x.storage_offset(), x.stride(1))
        return first if rest == 0 and 0 <= first and first + y.shape[1] <= x.shape[1] else None

    def callable_of(self, node: Any) -> Any:
        import torch

        if node.op == "call_module":
            mod = copy.deepcopy(self.gm.get_submodule(node.target))
            return mod.requires_grad_(False) if isinstance(mod, torch.nn.Module) else mod
        return node.target if node.op == "call_function" else _method(node.target)

    def flatten_ok(self, node: Any) -> bool:
        import torch

        x, y = self.values[node.args[0].name], self.values[node.name]
        return isinstance(y, torch.Tensor) and y.dim() == 2 and y.shape[0] == x.shape[0] and y.shape[1] == math.prod(x.shape[1:])

    # -- nodes -------------------------------------------------------------------------------
    def node(self, node: Any) -> list[Stage]:
        """The stages of one node whose value is a tensor."""
        for rule in (self.shuffle_node, self.nhwc_node):
            made = rule(node)
            if made is not None:
                return made
        return materialize_nhwc(self.plain_node(node), self.nhwc, self.materialized)

    def plain_node(self, node: Any) -> list[Stage]:
        if node.op == "call_module":
            mod = self.gm.get_submodule(node.target)
            same = self.same_padding_conv(node, mod)
            if same is not None:
                return same
            if node.target in self.opaque:
                spliced = self.exported_submodule(node, mod)
                if spliced is not None:
                    return spliced
            tail = self.module_tail(node, mod)
            st = self.module_stage(node, mod)
            if st is None:
                why = f"module {type(mod).__name__}" + (f" (groups={mod.groups})" if hasattr(mod, "groups") else "") + " has no fusekit rule"
                st = self.fallback(node, self.callable_of(node), why)
                st.attrs["op"] = type(mod).__name__
                return [st]
            return self.with_tail(st, tail)
        if node.op in ("call_function", "call_method"):
            st = self.function_stage(node)
            if st is None:
                t = node.target
                st = self.fallback(node, self.callable_of(node), f"{getattr(t, '__name__', t)} has no fusekit rule")
            return [st]
        raise UnsupportedError(f"pipeline: unexpected fx node {node.op} {node.target}")

    def exported_submodule(self, node: Any, mod: Any) -> list[Stage] | None:
        """A submodule torch.fx could not trace (Python control flow on its input's shape, say) of one
        image, read through torch.export for this input's fixed shape and spliced in: its stages, their
        values named under the node's; None where export cannot read it (it stays one fallback)."""
        from .export_import import import_exported

        x = node.args[0] if len(node.args) == 1 and not node.kwargs else None
        if not self.is_t(x):
            return None
        try:
            sub = import_exported(mod, tuple(int(d) for d in self.values[x.name].shape))
        except UnsupportedError:
            return None
        return spliced(sub, x.name, node.name)

    def same_padding_conv(self, node: Any, mod: Any) -> list[Stage] | None:
        """timm's Conv2dSame (TensorFlow's "same" padding, computed in its forward) for this fixed
        input size: a convolution with that padding where it is symmetric, else a PyTorch pad of the
        input (the one-sided extra row and column) and a convolution without padding."""
        import torch.nn as nn
        import torch.nn.functional as F

        x = node.args[0] if len(node.args) == 1 and not node.kwargs else None
        if type(mod).__name__ != "Conv2dSame" or not isinstance(mod, nn.Conv2d) or not self.is_t(x) or self.values[x.name].dim() != 4:
            return None
        pads = []
        for size, k, s, d in zip(self.values[x.name].shape[2:], mod.kernel_size, mod.stride, mod.dilation):
            total = max((math.ceil(int(size) / s) - 1) * s + (k - 1) * d + 1 - int(size), 0)
            pads.append((total // 2, total - total // 2))
        (top, bottom), (left, right) = pads
        name, src, stages = node.name, x.name, []
        if (top, left) != (bottom, right):
            src = f"{name}.pad"
            stages.append(torch_fallback(src, [x.name], src, F.pad, [Ref(x.name), [left, right, top, bottom]],
                                         reason="asymmetric \"same\" padding: one PyTorch pad"))
            stages[-1].attrs["op"] = "pad"
            top = left = 0
        w = {"w": _np(mod.weight)} | ({"b": _np(mod.bias)} if mod.bias is not None else {})
        stages.append(Stage("conv", [src], name, weights=w, attrs=dict(padding=(top, left), stride=tuple(mod.stride),
                                                                        dilation=tuple(mod.dilation), groups=mod.groups), name=name))
        return stages

    # -- channel shuffle (ShuffleNet): view to (n, g, c / g, h, w), transpose(1, 2), view back ------
    def shuffle_node(self, node: Any) -> list[Stage] | None:
        """A channel shuffle as one PyTorch ``channel_shuffle`` stage at its last node; its view,
        transpose and contiguous make no stage. None for other nodes."""
        import torch

        if node.name in self.shuffle_inner:
            return []
        if node.name in self.shuffles:
            x, g = self.shuffles[node.name]
            return [channel_shuffle_stage(node.name, x, node.name, g)]
        chain = self.shuffle_chain(node, torch)
        if chain is None:
            return None
        x, g, inner, last = chain
        self.shuffles[last] = (x, g)
        self.shuffle_inner.update(inner)
        return []

    def shuffle_chain(self, node: Any, torch: Any) -> tuple[str, int, list[str], str] | None:
        """(input, groups, inner node names, last node name) if ``node`` starts a channel shuffle."""
        x = node.args[0] if node.args else None
        if node.target not in ("view", "reshape") or not self.is_t(x) or len(node.users) != 1:
            return None
        xs, ys = tuple(self.values[x.name].shape), tuple(self.values[node.name].shape)
        if len(xs) != 4 or len(ys) != 5 or ys[0] != xs[0] or ys[1] * ys[2] != xs[1] or ys[3:] != xs[2:] or ys[1] in (1, xs[1]):
            return None
        t = next(iter(node.users))
        swap = t.target in (torch.transpose, "transpose") and sorted(int(self.template(d)) % 5 for d in t.args[1:3]) == [1, 2]
        if not swap or len(t.users) != 1:
            return None
        inner, last = [node.name, t.name], next(iter(t.users))
        if last.target == "contiguous" and len(last.users) == 1:
            inner.append(last.name)
            last = next(iter(last.users))
        back = last.target in ("view", "reshape", torch.flatten, "flatten") and tuple(self.values[last.name].shape) == xs
        return (x.name, int(ys[1]), inner, last.name) if back else None

    # -- channels-last regions (ConvNeXt's permute -> LayerNorm -> Linear -> GELU -> Linear -> permute) --
    def nhwc_node(self, node: Any) -> list[Stage] | None:
        """The node as a channel op on an (N, C, H, W) image where it reads a channels-last region; None otherwise."""
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        x = node.args[0] if node.args else None
        t, name = node.target, node.name
        perm = _permutation(node, self.template) if t in (torch.permute, "permute") else None
        if perm == (0, 2, 3, 1) and self.is_t(x) and self.values[x.name].dim() == 4 and x.name not in self.nhwc:
            self.nhwc[name] = x.name
            return []
        if not (self.is_t(x) and x.name in self.nhwc):
            return None
        src, c = self.nhwc[x.name], int(self.values[x.name].shape[-1])
        out = f"{name}.nchw"
        mod = self.gm.get_submodule(t) if node.op == "call_module" else None
        single = len(node.args) == 1 and not node.kwargs
        st: Stage | None = None
        if perm == (0, 3, 1, 2):
            return [Stage("identity", [src], name, name=name)]
        if isinstance(mod, nn.LayerNorm) and single and tuple(mod.normalized_shape) == (c,):
            st = channel_layer_norm_stage(src, out, name, c, mod.weight, mod.bias, mod.eps)
        elif t is F.layer_norm and tuple(self.template(self.arg(node, 1, "normalized_shape"))) == (c,):
            st = channel_layer_norm_stage(src, out, name, c, self.template(self.arg(node, 2, "weight")),
                                         self.template(self.arg(node, 3, "bias")), float(self.template(self.arg(node, 4, "eps", 1e-5))))
        elif isinstance(mod, nn.Linear) and single and mod.in_features == c:
            w = {"w": _np(mod.weight)[:, :, None, None]} | ({"b": _np(mod.bias)} if mod.bias is not None else {})
            st = Stage("conv", [src], out, weights=w, attrs=dict(padding=(0, 0), stride=(1, 1), dilation=(1, 1), groups=1), name=name)
        elif (mod is not None and single and module_activation(mod) is not None) or (mod is None and self.function_activation(node)):
            act = module_activation(mod) if mod is not None else self.function_activation(node)
            st = Stage("act", [src], out, attrs={"activation": act[0], "alpha": act[1]}, name=name)
        elif (isinstance(mod, (nn.Identity, nn.modules.dropout._DropoutNd)) or type(mod).__name__ in ("StochasticDepth", "DropPath")
              or t in (F.dropout, "contiguous", "clone")):
            self.nhwc[name] = src
            return []
        else:
            scale = self.channel_constant(node, c, last=True)
            if scale is not None:
                st = bn_stage(src, out, np.zeros(c), np.ones(c), scale, None, 0.0, name=name)
        if st is None:
            return None
        self.nhwc[name] = out
        return [st]

    def channel_constant(self, node: Any, c: int, last: bool) -> Any:
        """The per-channel factor of ``x * k`` / ``k * x`` / ``x.mul(k)`` with a constant k of C elements
        (shape (C,) on an (N, H, W, C) value when ``last``, else (C, 1, 1) or (1, C, 1, 1)), else None."""
        import torch

        if node.target not in (operator.mul, torch.mul, "mul") or len(node.args) != 2 or node.kwargs:
            return None
        a, b = node.args
        k = b if self.is_t(a) else a
        if self.is_t(k) or not self.is_t(a if k is b else b):
            return None
        v = self.template(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):  # a scalar: the same factor for every channel
            return torch.full((c,), float(v), dtype=torch.float64)
        if not isinstance(v, torch.Tensor) or v.numel() != c:
            return None
        ok = (tuple(v.shape) in ((c,), (1, 1, 1, c))) if last else (tuple(v.shape) in ((c, 1, 1), (1, c, 1, 1)))
        return v.reshape(c) if ok else None

    def module_tail(self, node: Any, mod: Any) -> list[Stage]:
        """What a fusekit.torch layer does after itself: its own ReLU / ReLU6, a residual add + ReLU."""
        import torch.nn as nn

        name, tail = node.name, []
        act = getattr(mod, "activation", None)
        if isinstance(mod, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear, nn.BatchNorm2d)) and act in ("relu", "relu6"):
            tail.append(Stage("relu", [], name, attrs={"upper_clip": 6.0} if act == "relu6" else {}, name=f"{name}.{act}"))
        if len(node.args) == 2 and not node.kwargs and isinstance(mod, nn.BatchNorm2d) and all(self.is_t(a) for a in node.args):
            tail += [Stage("add", [node.args[1].name], name, name=f"{name}.add"), Stage("relu", [], name, name=f"{name}.relu")]
        return tail

    def with_tail(self, st: Stage, tail: list[Stage]) -> list[Stage]:
        if not tail:
            return [st]
        name = st.output
        prev = st.output = f"{name}.pre"
        out = [st]
        for i, t in enumerate(tail):
            t.inputs = [prev] + t.inputs
            t.output = prev = name if i == len(tail) - 1 else f"{name}.t{i}"
            out.append(t)
        return out

    def module_stage(self, node: Any, mod: Any) -> Stage | None:
        import torch.nn as nn

        if _own_forward(mod):  # a layer subclass with a forward of its own: the layer's rules would not describe it
            return None

        x, name = (node.args[0] if node.args else None), node.name
        residual = len(node.args) == 2 and not node.kwargs and self.is_t(x) and self.is_t(node.args[1])
        single = (len(node.args) == 1 and not node.kwargs and self.is_t(x)) or (residual and isinstance(mod, (nn.Conv2d, nn.BatchNorm2d)))
        if not single:
            return None
        act = module_activation(mod)
        if act is not None:
            return Stage("act", [x.name], name, attrs={"activation": act[0], "alpha": act[1]}, name=name)
        if isinstance(mod, nn.Conv2d) and mod.padding_mode == "zeros":
            w = {"w": _np(mod.weight)} | ({"b": _np(mod.bias)} if mod.bias is not None else {})
            return Stage("conv", [x.name], name, weights=w, attrs=dict(conv_padding(mod.padding, mod.kernel_size, mod.dilation),
                                                                         stride=tuple(mod.stride), dilation=tuple(mod.dilation), groups=mod.groups), name=name)
        if isinstance(mod, nn.BatchNorm2d) and mod.track_running_stats and mod.running_mean is not None:
            return bn_stage(x.name, name, mod.running_mean, mod.running_var, mod.weight if mod.affine else None,
                           mod.bias if mod.affine else None, mod.eps)
        if isinstance(mod, nn.MaxPool2d) and not mod.return_indices:
            return pool_stage("maxpool", x.name, name, mod.kernel_size, mod.stride, mod.padding, mod.ceil_mode, dilation=mod.dilation)
        if isinstance(mod, nn.AvgPool2d):
            return pool_stage("avgpool", x.name, name, mod.kernel_size, mod.stride, mod.padding, mod.ceil_mode,
                              count_include_pad=mod.count_include_pad, divisor_override=mod.divisor_override)
        if isinstance(mod, nn.AdaptiveAvgPool2d):
            return self.adaptive_avg(x, name)
        if isinstance(mod, nn.Upsample) and mod.mode == "nearest":
            return upsample_stage(name, x.name, name, tuple(self.values[x.name].shape), tuple(self.values[name].shape))
        if isinstance(mod, nn.Flatten) and self.flatten_ok(node):
            return Stage("flatten", [x.name], name, name=name)
        if isinstance(mod, nn.Linear) and self.values[x.name].dim() == 2:
            w = {"w": _np(mod.weight)} | ({"b": _np(mod.bias)} if mod.bias is not None else {})
            return Stage("linear", [x.name], name, weights=w, name=name)
        if isinstance(mod, nn.Softmax) and mod.dim is not None:
            return Stage("softmax", [x.name], name, attrs={"axis": int(mod.dim) % self.values[name].dim()}, name=name)
        if isinstance(mod, (nn.Identity, nn.modules.dropout._DropoutNd)) or type(mod).__name__ in ("StochasticDepth", "DropPath", "DropBlock2d"):
            return Stage("identity", [x.name], name, name=name)  # eval mode: these return their input
        return None

    def adaptive_avg(self, x: Any, name: str) -> Stage | None:
        """An image's adaptive average pool as ``ir.adaptive_avg_stage`` lowers it; other sizes: fallback."""
        if self.values[x.name].dim() != 4:
            return None
        return adaptive_avg_stage(name, x.name, name, self.values[x.name].shape[2:], self.values[name].shape[2:])

    def function_activation(self, node: Any) -> tuple[str, float] | None:
        import torch
        import torch.nn.functional as F

        t, a = node.target, self.arg
        named = {F.relu: "relu", torch.relu: "relu", torch.relu_: "relu", "relu": "relu", "relu_": "relu", F.silu: "silu", "silu": "silu",
                 torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid", "sigmoid": "sigmoid", "sigmoid_": "sigmoid", torch.tanh: "tanh",
                 F.tanh: "tanh", "tanh": "tanh", "tanh_": "tanh", F.hardswish: "hardswish", F.hardsigmoid: "hardsigmoid"}
        try:
            if t in named:
                return named[t], 0.0
        except TypeError:  # an unhashable target
            return None
        if t is F.relu6:
            return "clip", 6.0
        if t is F.gelu:
            return ("gelu_tanh" if self.template(a(node, 1, "approximate", "none")) == "tanh" else "gelu"), 0.0
        if t is F.leaky_relu:
            return "leaky_relu", float(self.template(a(node, 1, "negative_slope", 0.01)))
        if t is F.elu:
            return "elu", float(self.template(a(node, 1, "alpha", 1.0)))
        if t is F.hardtanh and float(self.template(a(node, 1, "min_val", -1.0))) == 0.0:
            return "clip", float(self.template(a(node, 2, "max_val", 1.0)))
        return None

    def function_stage(self, node: Any) -> Stage | None:
        import torch
        import torch.nn.functional as F

        t, name, a = node.target, node.name, self.arg
        x = node.args[0] if node.args else None
        if t is operator.getitem and isinstance(x, torch.fx.Node) and x.name in self.multi:
            fn, args, kwargs = self.multi[x.name]
            item = _item(fn, self.template(node.args[1]))
            return self.fallback(node, item, f"{item.__name__}: one tensor of several", args, kwargs)
        adds, subs = (operator.add, operator.iadd, torch.add, "add", "add_"), (operator.sub, operator.isub, torch.sub, "sub", "sub_")
        img = x if self.is_t(x) else (node.args[1] if len(node.args) == 2 and self.is_t(node.args[1]) else None)
        if img is not None and self.values[img.name].dim() == 4:  # a layer scale: a BN stage that folds into the conv before
            c = int(self.values[img.name].shape[1])
            scale = self.channel_constant(node, c, last=False)
            if scale is not None:
                return bn_stage(img.name, name, np.zeros(c), np.ones(c), scale, None, 0.0)
            op = "add" if t in adds else "sub" if t in subs else ""
            shift = scalar_affine(op, img is x, self.template(node.args[1] if img is x else x)) if op and len(node.args) == 2 and not node.kwargs else None
            if shift is not None:
                return affine_stage(img.name, name, c, *shift)
        if not self.is_t(x):
            return None
        act = self.function_activation(node)
        if act is not None:
            return Stage("act", [x.name], name, attrs={"activation": act[0], "alpha": act[1]}, name=name)
        two = len(node.args) == 2 and not node.kwargs and self.is_t(node.args[1])
        if t in adds and two:
            return Stage("add", [x.name, node.args[1].name], name, name=name)
        if t in (operator.mul, operator.imul, torch.mul, "mul", "mul_") and two:
            return Stage("mul", [x.name, node.args[1].name], name, name=name)
        if t is F.batch_norm:
            return self.functional_bn(node)
        if t in (F.conv2d, torch.conv2d):
            return self.functional_conv(node)
        if t is F.linear:
            return self.functional_linear(node)
        if t in (F.max_pool2d, F.avg_pool2d):
            return self.functional_pool(node)
        if t is F.interpolate and self.template(self.arg(node, 3, "mode", "nearest")) == "nearest":
            return upsample_stage(name, x.name, name, tuple(self.values[x.name].shape), tuple(self.values[name].shape))
        if t in (torch.flatten, "flatten", "view", "reshape") and self.flatten_ok(node) and (
                t not in (torch.flatten, "flatten") or (a(node, 1, "start_dim", 0) == 1 and a(node, 2, "end_dim", -1) == -1)):
            return Stage("flatten", [x.name], name, name=name)
        if t is F.adaptive_avg_pool2d:
            return self.adaptive_avg(x, name)
        if t in ("mean", torch.mean) and sorted(d % 4 for d in _dims(self.template(a(node, 1, "dim", ())))) == [2, 3] \
                and self.values[x.name].dim() == 4 and a(node, 3, "dtype") is None:
            return Stage("gap", [x.name], name, name=name)  # keepdim=False: the importer adds the flatten (see run)
        if t in (F.softmax, torch.softmax, "softmax") and a(node, 1, "dim") is not None and node.kwargs.get("dtype") is None and len(node.args) <= 2:
            return Stage("softmax", [x.name], name, attrs={"axis": int(self.template(a(node, 1, "dim"))) % self.values[name].dim()}, name=name)
        if t in (F.dropout, "contiguous", "clone") or getattr(t, "__name__", "") in ("stochastic_depth", "drop_path"):
            return Stage("identity", [x.name], name, name=name)  # eval mode: their value is their input's
        return None

    def functional_conv(self, node: Any) -> Stage | None:
        """``F.conv2d`` of an image with constant weights (a weight-standardized conv computes them from
        its parameters, a constant in eval) as nn.Conv2d's stage."""
        import torch

        a = self.arg
        w, b = self.template(a(node, 1, "weight")), self.template(a(node, 2, "bias"))
        stride, padding, dilation, groups = (self.template(a(node, i, k, d)) for i, k, d in
                                             ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1), (6, "groups", 1)))
        if not isinstance(w, torch.Tensor) or w.dim() != 4 or not (b is None or isinstance(b, torch.Tensor)):
            return None
        if self.values[node.args[0].name].dim() != 4:
            return None
        weights = {"w": _np(w)} | ({"b": _np(b)} if b is not None else {})
        return Stage("conv", [node.args[0].name], node.name, weights=weights, attrs=dict(
            conv_padding(padding, tuple(w.shape[2:]), dilation), stride=_p(stride), dilation=_p(dilation), groups=int(groups)), name=node.name)

    def functional_linear(self, node: Any) -> Stage | None:
        """``F.linear`` of a (N, features) value with constant weights (timm's Linear) as nn.Linear's stage."""
        import torch

        w, b = self.template(self.arg(node, 1, "weight")), self.template(self.arg(node, 2, "bias"))
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not (b is None or isinstance(b, torch.Tensor)):
            return None
        if self.values[node.args[0].name].dim() != 2:
            return None
        return Stage("linear", [node.args[0].name], node.name, weights={"w": _np(w)} | ({"b": _np(b)} if b is not None else {}), name=node.name)

    def functional_pool(self, node: Any) -> Stage | None:
        """``F.max_pool2d`` / ``F.avg_pool2d`` of an image with constant arguments as their modules' stages."""
        import torch.nn.functional as F

        avg = node.target is F.avg_pool2d
        keys = ("kernel_size", "stride", "padding") + (("ceil_mode", "count_include_pad", "divisor_override") if avg else
                                                       ("dilation", "ceil_mode", "return_indices"))
        dflt = {"stride": None, "padding": 0, "ceil_mode": False, "count_include_pad": True, "divisor_override": None, "dilation": 1,
                "return_indices": False}
        v = {k: self.template(self.arg(node, i + 1, k, dflt.get(k))) for i, k in enumerate(keys)}
        if self.values[node.args[0].name].dim() != 4 or v.get("return_indices") or any(isinstance(e, Ref) for e in v.values()):
            return None
        return pool_stage("avgpool" if avg else "maxpool", node.args[0].name, node.name, v["kernel_size"], v["stride"], v["padding"], v["ceil_mode"],
                          dilation=v.get("dilation", 1), count_include_pad=v.get("count_include_pad", True),
                          divisor_override=v.get("divisor_override"))

    def functional_bn(self, node: Any) -> Stage | None:
        """``F.batch_norm`` in eval (running statistics given, training False) as nn.BatchNorm2d's stage."""
        import torch

        a = self.arg
        mean, var = (self.template(a(node, i, k)) for i, k in ((1, "running_mean"), (2, "running_var")))
        gamma, beta = (self.template(a(node, i, k)) for i, k in ((3, "weight"), (4, "bias")))
        training, eps = self.template(a(node, 5, "training", False)), self.template(a(node, 7, "eps", 1e-5))
        consts = [v for v in (mean, var, gamma, beta) if v is not None]
        if training or not all(isinstance(v, torch.Tensor) for v in consts) or mean is None or var is None:
            return None
        return bn_stage(node.args[0].name, node.name, mean, var, gamma, beta, float(eps))

    def run(self) -> tuple[str, str]:
        """Walk the graph; returns (input name, output name)."""
        import torch

        input_name = output = None
        for node in self.gm.graph.nodes:
            v = self.values.get(node.name)
            if node.op == "placeholder":
                if input_name is not None:
                    raise UnsupportedError("pipeline: models with more than one input are not supported")
                input_name = node.name
                self.tensors.add(node.name)
            elif node.op == "output":
                res = node.args[0]
                if not self.is_t(res):
                    raise UnsupportedError("pipeline: the model must return one tensor")
                output = res.name
            elif isinstance(v, (list, tuple)) and any(isinstance(e, torch.Tensor) for e in v):  # items become stages where read
                src = node.args[0] if node.target is operator.getitem and node.args else None
                if src is not None and getattr(src, "name", None) in self.multi:  # a slice of several: still several
                    fn, args, kwargs = self.multi[src.name]
                    self.multi[node.name] = (_item(fn, self.template(node.args[1])), args, kwargs)
                else:
                    self.multi[node.name] = (self.callable_of(node), node.args, node.kwargs)
            elif node.op == "get_attr" or (node.all_input_nodes and all(n.name in self.consts for n in node.all_input_nodes)):
                self.consts.add(node.name)  # a constant of the templates that read it
            elif isinstance(v, torch.Tensor):
                self.tensors.add(node.name)
                try:
                    made = self.node(node)
                except UnsupportedError:
                    raise
                except Exception as e:  # noqa: BLE001 - a rule that does not fit this node: say which node
                    raise UnsupportedError(f"pipeline: cannot import node {node.name} ({node.target}): {type(e).__name__}: {e}") from e
                if made and made[-1].kind == "gap" and v.dim() == 2:  # mean over H, W without keepdim
                    made[-1].output = f"{node.name}.gap"
                    made.append(Stage("flatten", [made[-1].output], node.name, name=node.name))
                self.stages += made
        if input_name is None or output is None:
            raise UnsupportedError("pipeline: traced graph has no input or no output")
        return input_name, output


def import_module(model: Any, example_input: Any) -> Program:
    """Primitive stages of ``model`` for inputs shaped like ``example_input`` (a tensor or a shape)."""
    import torch
    import torch.fx

    shape = tuple(int(d) for d in (example_input.shape if hasattr(example_input, "shape") else example_input))
    m = copy.deepcopy(model).cpu().double().eval()  # float64: constants the forward computes come out exact
    opaque: set[str] = set()

    class Tracer(torch.fx.Tracer):
        """fusekit.torch modules (a converted model) stay whole, as torch.nn's do; a submodule that
        cannot be traced (Python control flow on its input, say) stays whole too: one fallback stage."""

        def is_leaf_module(self, m: Any, module_qualified_name: str) -> bool:  # type: ignore[override]
            # timm's Conv2dSame computes its padding from the input's size: a leaf, lowered for the fixed size
            return _is_fusekit_layer(m) or type(m).__name__ == "Conv2dSame" or super().is_leaf_module(m, module_qualified_name)

        def call_module(self, mod: Any, forward: Any, args: Any, kwargs: Any) -> Any:  # type: ignore[override]
            path = self.path_of_module(mod)
            try:
                return super().call_module(mod, forward, args, kwargs)
            except Exception:  # noqa: BLE001 - what it recorded before failing has no users: removed below
                if not path:
                    raise
                opaque.add(path)
                return self.create_proxy("call_module", path, args, kwargs)

    try:
        gm = torch.fx.GraphModule(m, Tracer().trace(m))
        gm.graph.eliminate_dead_code()
        gm.recompile()
    except Exception as e:  # noqa: BLE001
        raise UnsupportedError(f"pipeline: torch.fx cannot trace {type(model).__name__}: {type(e).__name__}: {e} (importer=\"export\" "
                               "reads the model through torch.export, which specializes control flow on shapes)") from None
    gen = torch.Generator().manual_seed(0)
    try:
        values = _record_values(gm, torch.randn(shape, generator=gen, dtype=torch.float64))
    except Exception as e:  # noqa: BLE001
        raise UnsupportedError(f"pipeline: {type(model).__name__} fails on an input of shape {shape}: {type(e).__name__}: {e}") from None
    imp = _Importer(gm, values)
    imp.opaque = opaque
    input_name, output = imp.run()
    prog = Program(imp.stages, input_name, shape, output, "torch.fx")
    fill_shapes(prog.stages, prog.input, prog.input_shape)
    for s in prog.stages:  # sanity: the shape rules agree with what the model computed
        got = values.get(s.output)
        if isinstance(got, torch.Tensor) and tuple(got.shape) != tuple(s.out_shape):
            raise UnsupportedError(f"pipeline: shape rule of {s.name} gave {s.out_shape}, the model computed {tuple(got.shape)}")
    return prog
