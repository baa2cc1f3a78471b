"""Op signatures: the ports, attributes and shape rule of each frontend op a pattern may use
(:data:`OPS`), and the activations the ``act`` op takes. ``lower.py`` (cuDNN) and ``oracle.py``
(NumPy float64) implement each op; the shape rules, run before either, name a bad operand."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import OperandError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class OpSig:
    ports: tuple[str, ...]
    attrs: tuple[str, ...] = ()
    infer: Callable[["ShapeContext"], Any] | None = None  # a Shape, or a tuple of Shapes for several outputs
    explicit_dims: bool = False  # cuDNN cannot infer the output dims: the lowering sets them
    outputs: tuple[str, ...] = ("out",)
    scalars: tuple[str, ...] = ()  # attributes given to cuDNN as pass-by-value float32 tensors
    defaults: tuple[tuple[str, Any], ...] = ()  # op attributes a pattern may leave out, and their values


class ShapeContext:
    """What an op's shape rule sees: its ports' shapes and operand names, and its attributes."""

    def __init__(self, pattern: str, shapes: Mapping[str, Shape], names: Mapping[str, str], attrs: Mapping[str, Any]):
        self.pattern, self.shapes, self.names, self.attrs = pattern, shapes, names, attrs

    def fail(self, port: str, message: str) -> OperandError:
        return OperandError(self.pattern, self.names[port], message)


def conv_out_size(size: int, kernel: int, padding: int, stride: int, dilation: int, extra: int = 0) -> int:
    """A convolution's output length along one spatial dim (PyTorch's and cuDNN's formula); ``extra``:
    padding after the input beyond ``padding``."""
    return (size + 2 * padding + extra - (kernel - 1) * dilation - 1) // stride + 1


def _conv_fprop_shape(c: ShapeContext) -> Shape:
    x, w = c.shapes["image"], c.shapes["weight"]
    pad, stride, dil, extra = c.attrs["padding"], c.attrs["stride"], c.attrs["dilation"], c.attrs["extra_padding"]
    g = c.attrs["groups"]
    _check_groups(c, "image", x[1], "channels")
    if w[1] * g != x[1]:
        per = f" ({x[1]} channels / {g} groups)" if g > 1 else ""
        raise c.fail("weight", f"expected {x[1] // g} input channels{per} to match '{c.names['image']}' (shape {x}), got filter shape {w}")
    _check_groups(c, "weight", w[0], "filters")
    out = [x[0], w[0]]
    for i in range(2):
        size = conv_out_size(x[2 + i], w[2 + i], pad[i], stride[i], dil[i], extra[i])
        if size < 1:
            raise c.fail(
                "image",
                f"spatial size {x[2:]} with padding {tuple(pad)} is smaller than the dilated filter {tuple(w[2:])}",
            )
        out.append(size)
    return tuple(out)


def _conv_dgrad_shape(c: ShapeContext) -> Shape:
    dy, w = c.shapes["loss"], c.shapes["filter"]
    pad, stride, dil, opad = c.attrs["padding"], c.attrs["stride"], c.attrs["dilation"], c.attrs["output_padding"]
    if w[0] != dy[1]:
        raise c.fail("filter", f"expected {dy[1]} filters to match the channels of '{c.names['loss']}' (shape {dy}), got filter shape {w}")
    _check_groups(c, "filter", w[0], "filters")
    out = [dy[0], w[1] * c.attrs["groups"]]
    for i in range(2):
        if opad[i] >= max(stride[i], dil[i]):
            raise c.fail("loss", f"output_padding {tuple(opad)} must be smaller than the stride or the dilation")
        size = (dy[2 + i] - 1) * stride[i] - 2 * pad[i] + dil[i] * (w[2 + i] - 1) + 1 + opad[i]
        if size < 1:
            raise c.fail("loss", f"padding {tuple(pad)} leaves no output for spatial size {dy[2:]} and filter {w[2:]}")
        out.append(size)
    return tuple(out)


def _conv_wgrad_shape(c: ShapeContext) -> Shape:
    x, dy = c.shapes["image"], c.shapes["loss"]
    pad, stride, dil, kernel = c.attrs["padding"], c.attrs["stride"], c.attrs["dilation"], c.attrs["kernel"]
    if x[0] != dy[0]:
        raise c.fail("loss", f"expected batch {x[0]} like '{c.names['image']}', got shape {dy}")
    want = tuple((x[2 + i] + 2 * pad[i] - (kernel[i] - 1) * dil[i] - 1) // stride[i] + 1 for i in range(2))
    if tuple(dy[2:]) != want:
        raise c.fail("loss", f"expected spatial size {want} (the convolution of {x[2:]} with a {tuple(kernel)} filter), got {dy[2:]}")
    _check_groups(c, "image", x[1], "channels")
    _check_groups(c, "loss", dy[1], "channels")
    return (dy[1], x[1] // c.attrs["groups"], kernel[0], kernel[1])


def _check_groups(c: ShapeContext, port: str, count: int, what: str) -> None:
    g = c.attrs["groups"]
    if count % g:
        raise c.fail(port, f"{count} {what} do not split into {g} groups (groups must divide the input and output channels)")


def _same_shape(port: str) -> Callable[[ShapeContext], Shape]:
    return lambda c: c.shapes[port]


def _pair_shape(c: ShapeContext) -> Shape:
    a, b = c.shapes["loss"], c.shapes["input"]
    if a != b:
        raise c.fail("input", f"expected shape {a} like '{c.names['loss']}', got {b}")
    return a


def _channel_axis(shape: Shape) -> int:
    return 1 if len(shape) == 4 else len(shape) - 1


def _bias_shape(c: ShapeContext) -> Shape:
    x, b = c.shapes["input"], c.shapes["bias"]
    ax = _channel_axis(x)
    want = tuple(x[ax] if i == ax else 1 for i in range(len(x)))
    if b != want:
        raise c.fail("bias", f"expected length {x[ax]} (one per output channel), got shape {b[ax] if len(b) == len(x) and max(b) == b[ax] else b}")
    return x


def _channel_sum_shape(c: ShapeContext) -> Shape:
    x = c.shapes["input"]
    ax = _channel_axis(x)
    return tuple(x[ax] if i == ax else 1 for i in range(len(x)))


def _broadcast_shape(c: ShapeContext) -> Shape:
    a, b = c.shapes["a"], c.shapes["b"]
    if any(bd not in (1, ad) for ad, bd in zip(a, b)) or len(a) != len(b):
        raise c.fail("b", f"shape {b} does not broadcast to {a}")
    return a


def _matmul_shape(c: ShapeContext) -> Shape:
    a, b = c.shapes["a"], c.shapes["b"]
    if a[-1] != b[-2]:
        raise c.fail("b", f"expected {a[-1]} rows to match the columns of '{c.names['a']}' (cuDNN shape {a}), got cuDNN shape {b}")
    if b[0] not in (1, a[0]):
        raise c.fail("b", f"expected a batch of {a[0]} matrices (or 1) to match '{c.names['a']}' (cuDNN shape {a}), got cuDNN shape {b}")
    return (a[0], a[1], b[2])


def _stat_check(c: ShapeContext, x: Shape, *ports: str) -> Shape:
    want = (1, x[1], 1, 1)
    for p in ports:
        if c.shapes[p] != want:
            got = c.shapes[p]
            raise c.fail(p, f"expected one value per channel of '{c.names.get('input', c.names.get('loss'))}' ({x[1]}), got shape {got[1] if len(got) == 4 and max(got) == got[1] else got}")
    return want


def _eps_check(c: ShapeContext) -> None:
    if not c.attrs["epsilon"] > 0:
        raise OperandError(c.pattern, "epsilon", f"expected a positive float, got {c.attrs['epsilon']!r}", what="attribute")
    if "momentum" in c.attrs and not 0.0 <= c.attrs["momentum"] <= 1.0:
        raise OperandError(c.pattern, "momentum", f"expected a float in [0, 1], got {c.attrs['momentum']!r}", what="attribute")


def _bn_train_shape(c: ShapeContext) -> tuple:
    x = c.shapes["input"]
    _eps_check(c)
    st = _stat_check(c, x, "scale", "bias", "in_running_mean", "in_running_var")
    return (x, st, st, st, st)


def _bn_backward_shape(c: ShapeContext) -> tuple:
    dy, x = c.shapes["loss"], c.shapes["input"]
    if dy != x:
        raise c.fail("input", f"expected shape {dy} like '{c.names['loss']}', got {x}")
    st = _stat_check(c, x, "scale", "mean", "inv_variance")
    return (x, st, st)


def _norm_shape(stats_axes: tuple[int, ...], affine_axes: tuple[int, ...]) -> Callable[[ShapeContext], tuple]:
    """Layer / instance norm: statistics keep ``stats_axes`` of x; gamma and beta keep ``affine_axes``."""

    def infer(c: ShapeContext) -> tuple:
        x = c.shapes["input"]
        _eps_check(c)
        want = tuple(d if i in affine_axes else 1 for i, d in enumerate(x))
        for p in ("scale", "bias"):
            if c.shapes[p] != want:
                raise c.fail(p, f"expected shape {want} for '{c.names['input']}' of shape {x}, got {c.shapes[p]}")
        st = tuple(d if i in stats_axes else 1 for i, d in enumerate(x))
        return (x, st, st)

    return infer


def _norm_backward_shape(stats_axes: tuple[int, ...], affine_axes: tuple[int, ...]) -> Callable[[ShapeContext], tuple]:
    def infer(c: ShapeContext) -> tuple:
        dy, x = c.shapes["loss"], c.shapes["input"]
        if dy != x:
            raise c.fail("input", f"expected shape {dy} like '{c.names['loss']}', got {x}")
        aff = tuple(d if i in affine_axes else 1 for i, d in enumerate(x))
        st = tuple(d if i in stats_axes else 1 for i, d in enumerate(x))
        for p, want in (("scale", aff), ("mean", st), ("inv_variance", st)):
            if c.shapes[p] != want:
                raise c.fail(p, f"expected shape {want}, got {c.shapes[p]}")
        return (x, aff, aff)

    return infer


#: Activations of the ``act`` op (an attribute of fused graphs): name -> what ``alpha`` means ("" unused).
ACTIVATIONS: dict[str, str] = {
    "identity": "", "relu": "", "clip": "upper bound (relu6: 6)", "silu": "", "gelu": "", "gelu_tanh": "",
    "sigmoid": "", "tanh": "", "hardswish": "", "hardsigmoid": "", "leaky_relu": "negative slope", "elu": "scale of the negative part",
}


def _act_shape(c: ShapeContext) -> Shape:
    act = c.attrs.get("activation")
    if act not in ACTIVATIONS:
        raise OperandError(c.pattern, "activation", f"expected one of {sorted(ACTIVATIONS)}, got {act!r}", what="attribute")
    alpha = c.attrs.get("alpha", 0.0)
    if not math.isfinite(float(alpha)):
        raise OperandError(c.pattern, "alpha", f"expected a finite number, got {alpha!r}", what="attribute")
    if act == "clip" and not float(alpha) > 0:
        raise OperandError(c.pattern, "alpha", f"the clip activation needs an upper bound alpha > 0, got {alpha!r}", what="attribute")
    return c.shapes["input"]


def _genstats_shape(c: ShapeContext) -> tuple:
    x = c.shapes["input"]
    st = (1, x[1], 1, 1)
    return (st, st)


_GROUPS = (("groups", 1),)

OPS: dict[str, OpSig] = {
    "batchnorm": OpSig(
        ("input", "scale", "bias", "in_running_mean", "in_running_var"), ("epsilon", "momentum"), _bn_train_shape,
        outputs=("y", "mean", "inv_var", "next_running_mean", "next_running_var"), scalars=("epsilon", "momentum"),
    ),
    "batchnorm_backward": OpSig(("loss", "input", "scale", "mean", "inv_variance"), (), _bn_backward_shape, outputs=("dx", "dscale", "dbias")),
    "genstats": OpSig(("input",), (), _genstats_shape, outputs=("sum", "sq_sum")),
    "layernorm": OpSig(("input", "scale", "bias"), ("epsilon",), _norm_shape((0,), (1, 2, 3)), outputs=("y", "mean", "inv_var"), scalars=("epsilon",)),
    "layernorm_backward": OpSig(("loss", "input", "scale", "mean", "inv_variance"), (), _norm_backward_shape((0,), (1, 2, 3)), outputs=("dx", "dscale", "dbias")),
    "instancenorm": OpSig(("input", "scale", "bias"), ("epsilon",), _norm_shape((0, 1), (1,)), outputs=("y", "mean", "inv_var"), scalars=("epsilon",)),
    "instancenorm_backward": OpSig(("loss", "input", "scale", "mean", "inv_variance"), (), _norm_backward_shape((0, 1), (1,)), outputs=("dx", "dscale", "dbias")),
    # groups: cuDNN reads the group count from the channel counts (filter C = image C / groups)
    "conv_fprop": OpSig(("image", "weight"), ("padding", "stride", "dilation", "groups", "extra_padding"), _conv_fprop_shape,
                        defaults=_GROUPS + (("extra_padding", (0, 0)),)),
    "conv_dgrad": OpSig(("loss", "filter"), ("padding", "stride", "dilation", "output_padding", "groups"), _conv_dgrad_shape, True, defaults=_GROUPS),
    "conv_wgrad": OpSig(("image", "loss"), ("padding", "stride", "dilation", "kernel", "groups"), _conv_wgrad_shape, True, defaults=_GROUPS),
    "matmul": OpSig(("a", "b"), (), _matmul_shape),
    "bias": OpSig(("input", "bias"), (), _bias_shape),
    "relu": OpSig(("input",), ("upper_clip",), _same_shape("input"), defaults=(("upper_clip", math.inf),)),  # ReLU6: 6.0
    # activation: one of ACTIVATIONS, alpha its parameter (clip bound, leaky slope, ELU scale)
    "act": OpSig(("input",), ("activation", "alpha"), _act_shape, defaults=(("alpha", 0.0),)),
    "relu_backward": OpSig(("loss", "input"), ("upper_clip",), _pair_shape, defaults=(("upper_clip", math.inf),)),  # mask 0 < input < upper_clip
    "channel_sum": OpSig(("input",), (), _channel_sum_shape, True),
    "add": OpSig(("a", "b"), (), _broadcast_shape),
    "mul": OpSig(("a", "b"), (), _broadcast_shape),
    "sub": OpSig(("a", "b"), (), _broadcast_shape),
}
