"""fusekit.pipeline: a whole network as fused fusekit calls, planned buffers and one CUDA graph.

    import fusekit.pipeline as fp
    pipe = fp.compile(torchvision.models.resnet50().eval(), torch.randn(8, 3, 224, 224), dtype="float16")
    y = pipe(x)            # copies x into the static input, replays the graph, returns a copy of the output
                           # in x's array type (torch, CuPy or NumPy)
    print(pipe.report())

On the CPU (no GPU needed): ``fp.lower_model(model_or_onnx, example_input)`` gives the lowered
:class:`Program` (``.stages``: a list of :class:`Stage` records), and ``fp.Pipeline(program)``
offers ``reference(x)`` (float64 NumPy evaluation of the stages) and ``memory_plan``.
"""

from __future__ import annotations

import operator
from typing import Any

from ..errors import OperandError
from .ir import Program, Ref, Stage
from .memory import MemoryPlan, plan_memory
from .rules import RULES, Rule, lower
from .runtime import Pipeline
from .serving import BatchedPipelines, compile


def _is_onnx(model: Any) -> bool:
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        return True
    try:
        import onnx

        return isinstance(model, onnx.ModelProto)
    except ImportError:
        return False


IMPORTERS = ("fx", "export")


def trace(model: Any, example_input: Any = None, *, importer: str = "fx") -> Program:
    """Primitive (not yet rewritten) stages of a torch ``nn.Module``, a ``fusekit.nn.Sequential`` or an ONNX model.

    ``example_input``: a tensor/array or a shape; for ONNX it may be None (the graph's input shape,
    batch 1, 224 where dynamic). ``importer`` (torch models): "fx" (``torch.fx`` symbolic tracing) or
    "export" (``torch.export``'s ATen graph: control flow on shapes specialized for the example)."""
    if importer not in IMPORTERS:
        raise OperandError("pipeline", "importer", f"expected one of {IMPORTERS}, got {importer!r}", what="argument")
    from .nn_import import import_sequential, is_sequential

    if is_sequential(model):
        if example_input is None:
            raise TypeError("pipeline.trace: a fusekit.nn.Sequential needs an example input (array or shape)")
        return import_sequential(model, example_input)
    if _is_onnx(model):
        from .onnx_import import import_onnx

        shape = None if example_input is None else tuple(getattr(example_input, "shape", example_input))
        return import_onnx(model, shape)
    from .fx_import import import_module

    if not callable(getattr(model, "named_modules", None)):
        raise OperandError("pipeline", "model", f"expected a torch nn.Module, a fusekit.nn.Sequential, an ONNX file or an "
                           f"onnx.ModelProto, got {type(model).__name__}")
    if example_input is None:
        raise TypeError("pipeline.trace: a torch model needs an example input (tensor or shape)")
    if importer == "export":
        from .export_import import import_exported

        return import_exported(model, example_input_shape(example_input))
    return import_module(model, example_input_shape(example_input))


def example_input_shape(example_input: Any) -> tuple[int, ...]:
    """The shape of an example input (an array, or a sequence of positive ints); OperandError otherwise."""
    dims = getattr(example_input, "shape", example_input)
    if isinstance(dims, (str, bytes)) or not hasattr(dims, "__len__"):
        raise OperandError("pipeline", "example_input", f"expected an array or a shape (a sequence of ints), got {example_input!r}")
    try:
        shape = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise OperandError("pipeline", "example_input", f"expected a shape of ints, got {tuple(dims)!r}") from None
    if not shape or min(shape) < 1:
        raise OperandError("pipeline", "example_input", f"expected a shape of positive ints, got {shape}")
    return shape


def lower_model(model: Any, example_input: Any = None, *, importer: str = "fx") -> Program:
    """``lower(trace(model, example_input, importer=importer))``: the stage list the pipeline runs (CPU only)."""
    return lower(trace(model, example_input, importer=importer))


__all__ = ["BatchedPipelines", "MemoryPlan", "Pipeline", "Program", "RULES", "Ref", "Rule", "Stage", "compile", "lower", "lower_model", "plan_memory", "trace"]
