"""Fully connected layers: x @ w.T + b (+ ReLU) forward and backward, each a thin layer over dispatch."""

from __future__ import annotations

from typing import Any, Sequence

from ..dispatch import call, run
from ..errors import OperandError
from .common import bias_grad, cast_like, relu_bias_grad


def linear_bias_relu(x: Any, w: Any, b: Any, *, out: Any = None) -> Any:
    """``relu(x @ w.T + b)``: x (B, in), w (out, in) as in torch.nn.Linear, b (out,)."""
    return run("linear_bias_relu", (), (), (x, w, b), out)


def linear_bias(x: Any, w: Any, b: Any, *, out: Any = None) -> Any:
    """``x @ w.T + b`` as one cuDNN graph."""
    return run("linear_bias", (), (), (x, w, b), out)


def _as_image(m: Any, op: str, name: str) -> Any:
    """A (rows, features) matrix as a (rows, features, 1, 1) image view (channels-last: no copy). cuDNN
    reduces only 4-D channels-last tensors, so a Linear layer's bias gradient runs as a conv's does."""
    if len(getattr(m, "shape", ())) != 2:
        raise OperandError(op, name, f"expected a (rows, features) matrix, got shape {tuple(getattr(m, 'shape', ()))}")
    return m.reshape(int(m.shape[0]), int(m.shape[1]), 1, 1)


def linear_bias_relu_backward(dy: Any, x: Any, w: Any, y: Any, *, needs: Sequence[bool] = (True, True, True)) -> tuple[Any, Any, Any]:
    """(dx, dw, db) of ``y = relu(x @ w.T + b)``; saved: x, w, y."""
    need_dx, need_dw, need_db = needs
    op = "linear_bias_relu_backward"
    dz, db = relu_bias_grad(_as_image(dy, op, "dy"), _as_image(y, op, "y"), need_db)
    return _linear_grads(dz.reshape(dy.shape), x, w, need_dx, need_dw) + (cast_like(db, dy),)


def linear_bias_backward(dy: Any, x: Any, w: Any, *, needs: Sequence[bool] = (True, True, True)) -> tuple[Any, Any, Any]:
    """(dx, dw, db) of ``y = x @ w.T + b``; saved: x, w."""
    db = bias_grad(_as_image(dy, "linear_bias_backward", "dy")) if needs[2] else None
    return _linear_grads(dy, x, w, needs[0], needs[1]) + (cast_like(db, dy),)


def _linear_grads(dz: Any, x: Any, w: Any, need_dx: bool, need_dw: bool) -> tuple[Any, Any]:
    dx = call("matmul", dz, w) if need_dx else None
    dw = call("linear_wgrad", dz, x) if need_dw else None
    return dx, dw
