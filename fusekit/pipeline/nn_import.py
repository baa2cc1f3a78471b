"""A ``fusekit.nn.Sequential`` as primitive pipeline stages (the CuPy layers' weights copied to the
host as float64; batch norms read with their running statistics, as in eval mode)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UnsupportedError
from .ir import Program, Ref, Stage, fill_shapes, torch_fallback


def is_sequential(model: Any) -> bool:
    """True for a ``fusekit.nn.Sequential`` (checked without importing CuPy)."""
    return type(model).__name__ == "Sequential" and type(model).__module__ == "fusekit.nn"


def _host(a: Any) -> np.ndarray:
    return np.asarray(a.get() if hasattr(a, "get") else a, dtype=np.float64)


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (list, tuple)) else (int(v), int(v))


def import_sequential(seq: Any, example_input: Any) -> Program:
    """Primitive stages of ``seq`` (layers in order; nested Sequentials flattened)."""
    shape = tuple(int(d) for d in getattr(example_input, "shape", example_input))
    stages: list[Stage] = []
    cur = "x"

    def add(kind: str, layer: str, **kw: Any) -> None:
        nonlocal cur
        name = f"{layer}{len(stages)}"
        stages.append(Stage(kind, [cur], name, name=name, **kw))
        cur = name

    def walk(layers: list[Any]) -> None:
        for layer in layers:
            kind = type(layer).__name__
            if kind == "Sequential":
                walk(list(layer.layers))
            elif kind == "Conv2d":
                c = layer.conv
                add("conv", "conv", weights={"w": _host(layer.weight.data), "b": _host(layer.bias.data)},
                    attrs=dict(padding=_pair(c["padding"]), stride=_pair(c["stride"]), dilation=_pair(c["dilation"]), groups=1))
                if layer.activation == "relu":
                    add("relu", "relu")
                elif layer.activation == "relu6":
                    add("relu", "relu", attrs={"upper_clip": 6.0})
            elif kind == "Linear":
                add("linear", "linear", weights={"w": _host(layer.weight.data), "b": _host(layer.bias.data)})
                if layer.activation == "relu":
                    add("relu", "relu")
            elif kind in ("BatchNorm2d", "ChannelScaleShift"):
                add("bn", "bn", weights=_norm_weights(layer), attrs={"epsilon": float(getattr(layer, "eps", 0.0))})
                if layer.relu:
                    add("relu", "relu")
            elif kind == "ReLU":
                add("relu", "relu")
            elif kind == "ReLU6":
                add("relu", "relu", attrs={"upper_clip": 6.0})
            elif kind == "Flatten":
                add("flatten", "flatten")
            elif kind in ("MaxPool2d", "AvgPool2d"):
                stage = "maxpool" if kind == "MaxPool2d" else "avgpool"
                add(stage, stage, attrs=_pool_attrs(layer))
            elif kind == "Softmax" and not layer.log:
                add("softmax", "softmax", attrs={"axis": int(layer.axis)})
            elif kind == "ConvTranspose2d":
                _conv_transpose(layer)
            else:
                raise UnsupportedError(
                    f"pipeline: fusekit.nn.{kind} has no pipeline rule (supported: Conv2d, ConvTranspose2d, Linear, "
                    "BatchNorm2d, ChannelScaleShift, ReLU, ReLU6, Flatten, MaxPool2d, AvgPool2d, Softmax, Sequential)"
                )

    def _conv_transpose(layer: Any) -> None:
        nonlocal cur
        import torch.nn.functional as F

        c = layer.conv
        name = f"convT{len(stages)}"
        kw = dict(stride=_pair(c["stride"]), padding=_pair(c["padding"]), output_padding=_pair(layer.output_padding),
                  dilation=_pair(c["dilation"]))
        st = torch_fallback(name, [cur], name, F.conv_transpose2d, [Ref(cur), _host(layer.weight.data), _host(layer.bias.data)], kw,
                            "transposed convolution: no pipeline rule")
        stages.append(st)
        cur = name
        if layer.activation == "relu":
            add("relu", "relu")

    walk(list(seq.layers))
    if not stages:
        raise UnsupportedError("pipeline: the Sequential has no layers")
    prog = Program(stages, "x", shape, cur, "fusekit.nn")
    fill_shapes(prog.stages, prog.input, prog.input_shape)
    return prog


def _pool_attrs(layer: Any) -> dict[str, Any]:
    """A fusekit.nn MaxPool2d's or AvgPool2d's attributes as the maxpool / avgpool stage takes them."""
    ceil = bool(getattr(layer, "ceil_mode", False))
    if type(layer).__name__ == "MaxPool2d":
        k = _pair(layer.kernel_size)
        return dict(kernel_size=k, stride=_pair(layer.stride or k), padding=_pair(layer.padding), ceil_mode=ceil,
                    dilation=_pair(getattr(layer, "dilation", 1)))
    ks, st, pad = layer.args
    k = _pair(ks)
    return dict(kernel_size=k, stride=_pair(st or k), padding=_pair(pad), count_include_pad=bool(layer.count_include_pad), ceil_mode=ceil,
                divisor_override=getattr(layer, "divisor_override", None))


def _norm_weights(layer: Any) -> dict[str, np.ndarray]:
    """Batch norm (running statistics) or a channel scale/shift as the bn stage's four vectors."""
    k = int(layer.num_features)
    gamma = _host(layer.weight.data) if getattr(layer, "weight", None) is not None else np.ones(k)
    beta = _host(layer.bias.data) if getattr(layer, "bias", None) is not None else np.zeros(k)
    if type(layer).__name__ == "ChannelScaleShift":  # y = x * scale + shift: mean 0, var 1, eps 0
        return {"mean": np.zeros(k), "var": np.ones(k), "gamma": gamma, "beta": beta}
    if layer.running_mean is None:
        raise UnsupportedError("pipeline: a fusekit.nn.BatchNorm2d without running statistics cannot run in inference")
    return {"mean": _host(layer.running_mean), "var": _host(layer.running_var), "gamma": gamma, "beta": beta}
