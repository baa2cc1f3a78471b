"""Serving: :func:`compile` (import, lower, build) and :class:`BatchedPipelines`, one built pipeline
per batch size of a model sharing its device weights."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import OperandError
from .runtime import Pipeline


class BatchedPipelines:
    """One built :class:`Pipeline` (one CUDA graph) per batch size of one model, sharing the device
    weights (and the process's plan cache). ``pipes(x)`` runs the smallest pipeline whose batch is
    at least ``len(x)``, the input zero-padded and the output cut back to ``len(x)`` rows."""

    def __init__(self, pipelines: dict[int, Pipeline]) -> None:
        self.pipelines = dict(sorted(pipelines.items()))

    @property
    def batch_sizes(self) -> list[int]:
        return list(self.pipelines)

    @property
    def weight_bytes(self) -> int:
        """Bytes the shared weights take on the device (each tensor once)."""
        seen = {id(t): t for p in self.pipelines.values() for w in getattr(p, "_stage_weights", []) for t in w.values()}
        return sum(t.numel() * t.element_size() for t in seen.values())

    def pipeline_for(self, batch: int) -> Pipeline:
        """The pipeline that serves ``batch`` rows: the smallest compiled batch size >= ``batch``."""
        for b, p in self.pipelines.items():
            if batch <= b:
                return p
        raise OperandError("pipeline", "x", f"a batch of at most {max(self.pipelines)} rows (compiled batch sizes "
                           f"{self.batch_sizes}), got {batch}")

    def run(self, x: Any, *, clone: bool = True) -> Any:
        """``pipeline_for(len(x)).run(x, pad=True)``: see :meth:`Pipeline.run`."""
        shape = tuple(getattr(x, "shape", ()))
        if not shape:
            raise OperandError("pipeline", "x", f"an array of shape (batch, {', '.join(map(str, self._sample_shape))}), got {type(x).__name__}")
        return self.pipeline_for(int(shape[0])).run(x, clone=clone, pad=True)

    __call__ = run

    @property
    def _sample_shape(self) -> tuple[int, ...]:
        return tuple(next(iter(self.pipelines.values())).program.input_shape[1:])

    def report(self) -> str:
        """Each batch size's :meth:`Pipeline.report`, one after another."""
        return "\n".join(f"== batch {b} ==\n{p.report()}" for b, p in self.pipelines.items())


def _batch_sizes(batch_sizes: Any) -> list[int]:
    try:
        sizes = sorted({int(b) for b in batch_sizes})
        ok = sizes and all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in batch_sizes)
    except (TypeError, ValueError):
        ok = False
    if not ok or sizes[0] < 1:
        raise OperandError("pipeline.compile", "batch_sizes", f"a non-empty list of positive ints, got {batch_sizes!r}")
    return sizes


def compile(model: Any, example_input: Any = None, *, dtype: str = "float16", autotune: bool = False,
            capture: bool = True, choose: bool = True, verify: bool = True, device: Any = None,
            progress: Callable[[int, int, str], None] | None = None,
            batch_sizes: list[int] | None = None, importer: str = "fx") -> Any:
    """Trace/import ``model`` (torch ``nn.Module``, ``fusekit.nn.Sequential``, ONNX path/ModelProto),
    lower it to fusekit stages, plan its buffers and build it on the GPU (warm-up, per-stage timing,
    CUDA graph capture); see :meth:`Pipeline.build` for ``choose``, ``verify`` and ``progress``.

    ``batch_sizes=[1, 8, 32]``: a :class:`BatchedPipelines` with one pipeline per size (``example_input``
    then gives the per-sample shape; its own batch is ignored) sharing weights; otherwise a :class:`Pipeline`.
    ``importer``: how a torch model is read, "fx" or "export" (see :func:`fusekit.pipeline.trace`)."""
    from . import lower_model

    kw = dict(device=device, autotune=autotune, capture=capture, choose=choose, verify=verify, progress=progress)
    if batch_sizes is None:
        return Pipeline(lower_model(model, example_input, importer=importer), dtype=dtype).build(**kw)
    sizes = _batch_sizes(batch_sizes)
    if example_input is None:
        raise TypeError("pipeline.compile: batch_sizes needs an example input (tensor, array or shape) for the per-sample shape")
    sample = tuple(int(d) for d in getattr(example_input, "shape", example_input))[1:]
    programs = {b: lower_model(model, (b,) + sample, importer=importer) for b in sizes}
    for b, prog in programs.items():
        if prog.output_shape[:1] != (b,):
            raise OperandError("pipeline.compile", "model", f"an output whose first dimension is the batch ({b}) to serve "
                               f"several batch sizes, got output shape {prog.output_shape}")
    pool: dict[tuple, Any] = {}
    return BatchedPipelines({b: Pipeline(prog, dtype=dtype, weight_pool=pool).build(**kw) for b, prog in programs.items()})
