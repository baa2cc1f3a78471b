"""The inference half of fusekit's ``torch.compile`` backend (:mod:`fusekit.backend`).

Each graph dynamo hands over is read as the pipeline reads a model (its parameters and buffers bound
as constants, ``torch.export``'s ATen graph, the same lowering rules) and cut into segments
(:mod:`fusekit.pipeline.partition`): runs of stages fusekit runs, each one call of the custom op
``torch.ops.fusekit.run_segment`` replaying its own CUDA graph, and the fallback stages between
them, which Inductor compiles. A graph with no fallback is one segment, called directly. Per input
shape a :class:`Variant` is lowered, and its pipeline built on the GPU at its first call (a new batch
size builds another, sharing the weights). A graph dynamo makes dynamic after a second shape (its
sizes as int inputs) is taken too: each size is read from the input's dims.
Options (``torch.compile(..., options={...})``):

- ``dtype``: "auto" (the input's), "float16", "bfloat16" or "float32": what the pipeline computes in;
- ``autotune``: autotune each stage's plan at build (default False: cuDNN's heuristics);
- ``min_fused``: the fraction of stages that must lower to fusekit graphs or kernels for the graph to
  run on fusekit (default 0.5); below it, graphs go to Inductor.

``mode`` (``torch.compile(..., mode=...)``) is what Inductor compiles the fallbacks between segments
and the graphs fusekit does not run with ("reduce-overhead": in CUDA graphs, which then hold the
segments' graphs too; "max-autotune"); the segments replay as CUDA graphs of their own in every mode.

Inference is a graph compiled under ``torch.no_grad()`` / ``inference_mode()`` (graphs that take
gradients: :mod:`fusekit.torch.training`). Calls a pipeline does not take (inputs not on a CUDA
device, or wanting gradients) run the graph as dynamo captured it.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from ..errors import FusekitError, OperandError
from . import partition
from .partition import compiled_graphs, run_segment
from .ir import Program

__all__ = ["inference_backend", "FusekitGraph", "Variant", "bind_constants_of", "check_options", "inductor", "run_segment", "MODES"]

DTYPES = ("auto", "float16", "bfloat16", "float32")
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def bind_constants_of(gm: Any, example_inputs: list) -> tuple[Any, list[int]]:
    """(a GraphModule of ``gm``'s graph with its parameter and buffer placeholders turned into
    constants of its own and its size placeholders into sizes of the tensor inputs, the positions of
    the placeholders left: the activation inputs). Dynamo passes a module's parameters and buffers as
    graph inputs (``l_self_modules_..._parameters_...``) and, for dynamic shapes, each symbolic size as
    an int input (``s0``: a dim of an input tensor). A size no input dim gives stays an input."""
    import torch

    graph = copy.deepcopy(gm.graph)
    root = torch.nn.Module()
    inputs = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(value, torch.nn.Parameter) or "_parameters_" in node.name or "_buffers_" in node.name:
            name = f"const{i}"
            root.register_buffer(name, value.detach())
            with graph.inserting_before(node):
                got = graph.get_attr(name)
            node.replace_all_uses_with(got)
            graph.erase_node(node)
        elif (found := None if isinstance(value, torch.Tensor) else _size_of(node, placeholders)) is not None:
            src, dim = found
            with graph.inserting_after(src):
                got = graph.call_method("size", (src, dim))
            node.replace_all_uses_with(got)
            graph.erase_node(node)
        else:
            inputs.append(i)
    return torch.fx.GraphModule(root, graph), inputs


def _size_of(node: Any, placeholders: list) -> tuple[Any, int] | None:
    """(tensor placeholder, dim) whose symbolic size is size placeholder ``node``'s, from dynamo's
    example values; None if none is."""
    sym = node.meta.get("example_value")
    expr = getattr(getattr(sym, "node", None), "expr", None)
    if expr is None:
        return None
    for p in placeholders:
        fake = p.meta.get("example_value")
        for d, size in enumerate(getattr(fake, "shape", ()) if p is not node else ()):
            if getattr(getattr(size, "node", None), "expr", None) == expr:
                return p, d
    return None


class Variant:
    """One input shape of a compiled graph: its lowered program, the program's segments
    (:func:`fusekit.pipeline.partition.split`), the pipeline (built on the GPU at first use) and the
    callable that runs it: the one fused segment's op, or, where stages fall back, the partitioned
    graph compiled by Inductor."""

    def __init__(self, program: Program, dtype: str) -> None:
        self.program, self.dtype = program, dtype
        self.segments = partition.split(program)
        self.pipeline: Any = None
        self.graphs: list[Any] = []  # per segment: its CUDA graph (None: run eagerly, or a fallback segment)
        self.call: Callable | None = None


class FusekitGraph:
    """The callable a dynamo graph compiles to: a :class:`Variant` per input shape and dtype, made at
    its first call (``variants``; their ``pipelines`` by key), run through the custom op
    ``torch.ops.fusekit.run_segment``; the graph itself for inputs it does not take (not CUDA,
    gradients wanted). ``program``: the lowered stages for the example shape."""

    def __init__(self, gm: Any, bound: Any, inputs: list[int], program: Program, dtype: str, autotune: bool,
                 mode: str | None = None) -> None:
        self.gm, self.bound, self.inputs, self.program = gm, bound, inputs, program
        self.dtype, self.autotune, self.mode = dtype, autotune, mode
        self.variants: list[Variant] = []
        self._by_key: dict[tuple, int] = {}  # (shape, dtype, device) -> index of its variant
        self._weights: dict[tuple, Any] = {}  # shared by the pipelines of every shape
        graphs = compiled_graphs()
        self.key = len(graphs)
        graphs[self.key] = self

    @property
    def pipelines(self) -> dict[tuple, Any]:
        """The built pipelines by (shape, dtype, device)."""
        return {k: self.variants[i].pipeline for k, i in self._by_key.items() if self.variants[i].pipeline is not None}

    def out_shape(self, x: Any) -> tuple[int, ...]:
        """The output's shape for input ``x`` (the batch is the input's)."""
        return (int(x.shape[0]), *self.program.output_shape[1:])

    def variant(self, x: Any) -> int:
        """The index of the variant for ``x``'s shape, dtype and device (lowered, not yet built, on first use)."""
        from . import lower_model

        key = (tuple(x.shape), x.dtype, x.device)
        got = self._by_key.get(key)
        if got is None:
            dtype = str(x.dtype).replace("torch.", "") if self.dtype == "auto" else self.dtype
            prog = self.program if tuple(x.shape) == tuple(self.program.input_shape) else lower_model(self.bound, tuple(x.shape), importer="export")
            got = self._by_key[key] = len(self.variants)
            self.variants.append(Variant(prog, dtype))
        return got

    def pipeline(self, v: int, device: Any) -> Any:
        """Variant ``v``'s pipeline, built (and each fused segment captured) at the first call."""
        from .runtime import Pipeline

        var = self.variants[v]
        if var.pipeline is None:
            pipe = Pipeline(var.program, dtype=var.dtype, weight_pool=self._weights)
            pipe.build(device=device, autotune=self.autotune, capture=False)
            var.graphs = [pipe.capture_stages(s.lo, s.hi) if s.fused else None for s in var.segments]
            pipe.graph_captured = all(g is not None for g, s in zip(var.graphs, var.segments) if s.fused)
            var.pipeline = pipe
        return var.pipeline

    def run_segment(self, xs: list[Any], v: int, k: int) -> list[Any]:
        """Segment ``k`` of variant ``v`` on the GPU: its inputs copied into the pipeline's buffers,
        its stages replayed, its outputs copied out (fresh tensors)."""
        import torch

        var = self.variants[v]
        seg = var.segments[k]
        pipe = self.pipeline(v, xs[0].device)
        for name, t in zip(seg.inputs, xs):
            view = pipe.views[name]
            if t.data_ptr() != view.data_ptr() or t.stride() != view.stride():
                view.copy_(t)
        g = var.graphs[k]
        if g is not None and not torch.cuda.is_current_stream_capturing():
            g.replay()
        else:  # (inside a capture, such as Inductor's CUDA graphs under mode="reduce-overhead": its launches are captured)
            pipe.run_stages(seg.lo, seg.hi)
        return [partition.dense(pipe.views[o]) for o in seg.outputs]

    def _caller(self, x: Any) -> Callable:
        import torch

        v = self.variant(x)
        var = self.variants[v]
        if var.call is None and len(var.segments) > 1:
            if x.is_cuda:  # built and captured now, not inside the CUDA-graph pool of Inductor's warm-up
                self.pipeline(v, x.device)
            mod = partition.partitioned_module(var.program, var.segments, self.key, v, x.device, getattr(torch, var.dtype), x.dtype)
            try:
                compiled = inductor(mod, [x], None, self.mode)
                var.call = lambda t: compiled(t)[0]
            except Exception as e:  # noqa: BLE001 - the pipeline runs its fallback stages itself instead
                from ..errors import warn_once

                warn_once(("backend-partition", type(e).__name__), f"fusekit backend: Inductor could not compile the stages between "
                          f"fusekit's segments ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); the "
                          "pipeline runs them on PyTorch's kernels", UserWarning, stacklevel=3)
                var.segments = [partition.Segment(True, 0, len(var.program.stages), [var.program.input], [var.program.output])]
        if var.call is None:
            key = self.key
            var.call = lambda t: run_segment([t.to(getattr(torch, var.dtype))], key, v, 0)[0].to(t.dtype)
        return var.call

    def run(self, x: Any) -> Any:
        """The output for ``x`` (a CUDA tensor), in x's dtype."""
        return self._caller(x)(x)

    def __call__(self, *args: Any) -> Any:
        import torch

        x = args[self.inputs[0]]
        takes = (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
                 and not (torch.is_grad_enabled() and x.requires_grad))
        if not takes:
            return self.gm(*args)
        return (self.run(x),)


def check_options(options: dict | None) -> tuple[str, bool, float]:
    o = dict(options or {})
    dtype, autotune, min_fused = o.pop("dtype", "auto"), o.pop("autotune", False), o.pop("min_fused", 0.5)
    if o:
        raise OperandError("fusekit backend", "options", f"unknown option(s) {sorted(o)}; expected dtype, autotune, min_fused", what="argument")
    if dtype not in DTYPES:
        raise OperandError("fusekit backend", "options", f"dtype must be one of {DTYPES}, got {dtype!r}", what="argument")
    if not isinstance(autotune, bool):
        raise OperandError("fusekit backend", "options", f"autotune must be True or False, got {autotune!r}", what="argument")
    if not isinstance(min_fused, (int, float)) or isinstance(min_fused, bool) or not 0 <= min_fused <= 1:
        raise OperandError("fusekit backend", "options", f"min_fused must be a number in [0, 1], got {min_fused!r}", what="argument")
    return dtype, autotune, float(min_fused)


def inductor(gm: Any, example_inputs: list, why: str | None, mode: str | None = None) -> Callable:
    """The graph compiled by Inductor (AOTAutograd first where it takes gradients) in torch.compile's
    ``mode``; ``why``: the reason fusekit does not run it, said once per reason (None: a graph whose
    fusekit ops are already in it)."""
    import torch
    from torch._inductor.compile_fx import compile_fx

    from ..errors import warn_once

    if why is not None:
        warn_once(("backend", why), f"fusekit backend: {why}; Inductor compiles this graph", UserWarning, stacklevel=3)
    patches = torch._inductor.list_mode_options(mode) if mode not in (None, "default") else {}
    return compile_fx(gm, example_inputs, config_patches=patches)


def _lowered(gm: Any, example_inputs: list) -> tuple[Any, list[int], Program] | str:
    """(bound module, its activation inputs, the lowered program) or why the graph cannot run on fusekit."""
    import torch

    from . import lower_model

    outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    if not isinstance(outs, (tuple, list)) or len(outs) != 1:
        return "a graph with several outputs"
    bound, inputs = bind_constants_of(gm, example_inputs)
    if any(not isinstance(example_inputs[i], torch.Tensor) for i in inputs):
        return "dynamic shapes with a size no input dim gives; torch.compile(..., dynamic=False) gives a fusekit pipeline per shape"
    if len(inputs) != 1:
        return f"a graph of {len(inputs)} activation inputs (fusekit pipelines take one tensor)"
    x = example_inputs[inputs[0]]
    try:
        prog = lower_model(bound, tuple(x.shape), importer="export")
    except (FusekitError, NotImplementedError, RuntimeError, TypeError, ValueError) as e:
        return f"its lowering failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return bound, inputs, prog


def inference_backend(gm: Any, example_inputs: list, options: tuple[str, bool, float], mode: str | None = None) -> Callable:
    """A dynamo graph that takes no gradients -> fusekit pipelines (:class:`FusekitGraph`), or Inductor's
    compile where the graph does not lower well enough; ``options``: (dtype, autotune, min_fused) as
    :func:`check_options` gives them."""
    dtype, autotune, min_fused = options
    got = _lowered(gm, example_inputs)
    if isinstance(got, str):
        return inductor(gm, example_inputs, got, mode)
    bound, inputs, prog = got
    if prog.fused_fraction < min_fused:
        return inductor(gm, example_inputs, f"{prog.fused_fraction:.0%} of its stages lower to fusekit (min_fused {min_fused:.0%})", mode)
    return FusekitGraph(gm, bound, inputs, prog, dtype, autotune, mode)
