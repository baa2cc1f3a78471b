"""fusekit as a ``torch.compile`` backend: ``torch.compile(model, backend="fusekit")``.

Registered through the ``torch_dynamo_backends`` entry point, so no import of fusekit is needed.
Graphs that take no gradients (inference) run as fusekit pipelines (:mod:`fusekit.pipeline.backend`);
graphs that take gradients (training) keep their convolutions, training batch norms and the ReLUs
after them on fusekit's fused forward and backward graphs (:mod:`fusekit.torch.training`) while
AOTAutograd and Inductor compile the rest. ``mode`` is the mode Inductor compiles with; ``options``
(inference): ``dtype``, ``autotune``, ``min_fused`` (see :mod:`fusekit.pipeline.backend`).
"""

from __future__ import annotations

from typing import Any, Callable

from .errors import OperandError

__all__ = ["backend"]


def _training(example_inputs: list) -> bool:
    import torch

    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def backend(gm: Any, example_inputs: list, options: dict | None = None, mode: str | None = None) -> Callable:
    """The ``torch.compile`` backend: a dynamo graph and its example inputs -> a callable."""
    from .pipeline.backend import MODES, check_options, inductor, inference_backend

    parsed = check_options(options)
    if mode not in MODES:
        raise OperandError("fusekit backend", "mode", f"must be one of {MODES[1:]}, got {mode!r}", what="argument")
    if not _training(example_inputs):
        return inference_backend(gm, example_inputs, parsed, mode)
    from .torch.training import training_graph

    gm, fused = training_graph(gm)
    if not fused:
        return inductor(gm, example_inputs, "a training graph without a convolution or training batch norm to fuse", mode)
    return inductor(gm, example_inputs, None, mode)
