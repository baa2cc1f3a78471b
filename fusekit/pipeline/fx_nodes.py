"""What the fx importer reads off a traced graph: node and module predicates, attribute and
argument forms, each node's value on the example input, and the wrappers that make one item of a
multi-output node a stage of its own; and the stages both torch importers (fx, export) make alike:
batch norms and layer scales, channel LayerNorms, channels-last values made real."""

from __future__ import annotations

import operator
import warnings
from typing import Any

import numpy as np

from .ir import Program, Ref, Stage, _pair, rename, torch_fallback



def _slicing(node: Any) -> bool:
    """Whether fx ``node`` takes part of a tensor without computing (indexing, ``narrow``, an item of
    ``chunk`` / ``split``): only such a node's output may be planned as a view of its input."""
    import torch

    return node.target in (operator.getitem, torch.narrow, "narrow", torch.Tensor.narrow)


def _np(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t.astype(np.float64)
    return t.detach().cpu().to(dtype=__import__("torch").float64).numpy().copy()


def _permutation(node: Any, template: Any) -> tuple[int, ...] | None:
    """The dims of ``x.permute(...)`` / ``torch.permute(x, dims)`` on a 4-D value, normalized; None if not 4-D."""
    dims = node.args[1:] if len(node.args) > 2 else (node.args[1] if len(node.args) == 2 else node.kwargs.get("dims", ()))
    dims = template(dims)
    dims = tuple(int(d) for d in (dims if isinstance(dims, (list, tuple)) else (dims,)))
    return tuple(d % 4 for d in dims) if len(dims) == 4 else None


def _is_fusekit_layer(mod: Any) -> bool:
    """Whether ``mod`` is (or derives from) a fusekit.torch module, told by its classes' module (this
    layer does not import fusekit.torch)."""
    return any(c.__module__ == "fusekit.torch" for c in type(mod).__mro__)


def _own_forward(mod: Any) -> bool:
    """Whether ``mod``'s class replaces the forward of the torch.nn layer it derives from (so the rules
    for that layer would not describe it); fusekit.torch's own layers are described by them."""
    import torch.nn as nn

    if _is_fusekit_layer(mod):
        return False
    for cls in type(mod).__mro__:
        if cls.__module__.startswith("torch.nn.modules") and cls not in (nn.Module, nn.Identity, nn.Sequential):
            return type(mod).forward is not cls.forward
    return False


def _p(v: Any) -> tuple[int, int]:
    """ir's pair of a module argument; (0, 0) for None."""
    return (0, 0) if v is None else _pair(v)


def _dims(v: Any) -> tuple[int, ...]:
    """A ``dim`` argument (an int or a sequence) as a tuple of ints."""
    return tuple(int(d) for d in v) if isinstance(v, (list, tuple)) else (int(v),)


def _record_values(gm: Any, example: Any) -> dict[str, Any]:
    import torch
    import torch.fx

    from ..errors import TorchFallbackWarning

    values: dict[str, Any] = {}

    class Rec(torch.fx.Interpreter):
        def run_node(self, n):  # type: ignore[override]
            v = super().run_node(n)
            values[n.name] = v
            return v

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", TorchFallbackWarning)  # fusekit.torch modules on these CPU values run PyTorch's code
        Rec(gm).run(example)
    return values


def _method(name: str) -> Any:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, name)(*args, **kwargs)

    call.__name__ = f"Tensor.{name}"
    return call


def _item(fn: Any, index: Any) -> Any:
    """``fn(...)[index]``: one tensor of a node that returns several (a module if ``fn`` is one, so
    that it moves to a device and dtype as modules do)."""
    import torch

    if isinstance(fn, torch.nn.Module):
        return _ModuleItem(fn, index)

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)[index]

    call.__name__ = f"{getattr(fn, '__name__', type(fn).__name__)}[{index}]"
    return call


class _ModuleItem(__import__("torch").nn.Module):
    def __init__(self, module: Any, index: Any) -> None:
        super().__init__()
        self.module, self.index = module, index
        self.__name__ = f"{type(module).__name__}[{index}]"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)[self.index]


def bn_stage(x: str, output: str, mean: Any, var: Any, gamma: Any, beta: Any, eps: float, name: str | None = None) -> Stage:
    """An eval batch norm stage (gamma / beta None: 1 / 0); with mean 0, var 1 and eps 0 it is a
    per-channel scale (a layer scale), which folds into the convolution before it. ``name``: the
    source node (default: ``output``)."""
    k = int(np.shape(mean)[0])
    return Stage("bn", [x], output, weights={
        "mean": _np(mean), "var": _np(var), "gamma": _np(gamma).reshape(k) if gamma is not None else np.ones(k),
        "beta": _np(beta).reshape(k) if beta is not None else np.zeros(k)}, attrs={"epsilon": float(eps)}, name=name or output)


def scalar_affine(op: str, image_first: bool, k: Any) -> tuple[float, float] | None:
    """(factor, offset) of an image and a Python number ``k`` under ``op`` ("add", "sub", "mul" or
    "div"; the image the first operand or not): y = factor * x + offset; None where that is no such
    map (k / x, a product with or a division by 0, k not a finite number)."""
    if not isinstance(k, (int, float)) or isinstance(k, bool) or not np.isfinite(k):
        return None
    k = float(k)
    if op == "add":
        return 1.0, k
    if op == "sub":
        return (1.0, -k) if image_first else (-1.0, k)
    if op == "mul":  # (x * 0 is not 0 for an infinite or NaN x)
        return (k, 0.0) if k != 0 else None
    return (1.0 / k, 0.0) if op == "div" and image_first and k != 0 else None


def affine_stage(x: str, output: str, c: int, factor: float, offset: float, name: str | None = None) -> Stage:
    """y = factor * x + offset on every channel: an identity for x + 0 (MobileOne's empty branches),
    else a per-channel scale-shift (a BN stage; the convolution before folds it)."""
    if factor == 1.0 and offset == 0.0:
        return Stage("identity", [x], output, name=name or output)
    return bn_stage(x, output, np.zeros(c), np.ones(c), np.full(c, factor), np.full(c, offset), 0.0, name=name)


def channel_layer_norm_stage(src: str, out: str, name: str, c: int, weight: Any, bias: Any, eps: float) -> Stage:
    """LayerNorm over the channels of each position: a ``cln`` stage (cuDNN's layer norm over the
    image read as rows of C channels, see ir.channel_rows)."""
    gamma = np.ones(c) if weight is None else _np(weight).reshape(c)
    beta = np.zeros(c) if bias is None else _np(bias).reshape(c)
    return Stage("cln", [src], out, weights={"gamma": gamma, "beta": beta}, attrs={"eps": float(eps)}, name=name)


def materialize_nhwc(made: list[Stage], nhwc: dict[str, str], materialized: set[str]) -> list[Stage]:
    """``made`` with, before it, the permutes that make real the channels-last region values (``nhwc``:
    (N, H, W, C) value -> the (N, C, H, W) image holding it) its stages read as the tensors PyTorch
    has, each once (``materialized`` records them)."""
    import torch

    pre = []
    for st in made:
        for n in st.inputs:
            if n in nhwc and n not in materialized:
                materialized.add(n)
                pre.append(torch_fallback(f"{n}.permute", [nhwc[n]], n, torch.permute, [Ref(nhwc[n]), (0, 2, 3, 1)],
                                          reason="an (N, H, W, C) view read by an op without a channel rule"))
    return pre + made


def spliced(sub: Program, x: str, output: str) -> list[Stage]:
    """The stages of ``sub`` (a submodule's program) reading value ``x`` for its input and giving
    ``output``; its other values and its stages named under ``output``."""
    if sub.output == sub.input:
        return [Stage("identity", [x], output, name=output)]
    final = {sub.input: x} | {s.output: output if s.output == sub.output else f"{output}.{s.output}" for s in sub.stages}
    temp = {old: f"\0{i}" for i, old in enumerate(final)}  # through unique names: no new name is renamed again
    for step in (temp, {temp[old]: new for old, new in final.items()}):
        for old, new in step.items():
            rename(sub.stages, old, new)
        for s in sub.stages:
            s.output = step.get(s.output, s.output)
    for s in sub.stages:
        s.name = f"{output}.{s.name}"
    return sub.stages
