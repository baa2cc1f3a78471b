"""A lowered program split into what fusekit runs and what PyTorch's compiler runs.

:func:`split` cuts the stage list into *segments*: maximal runs of stages fusekit runs (fused cuDNN
graphs, fusekit kernels, views and copies) and the runs of ``torch`` fallback stages between them.
:func:`partitioned_module` writes the program back as an FX graph in which each fusekit segment is
one call of the custom op ``torch.ops.fusekit.run_segment`` and each fallback stage a small module
of PyTorch ops, so that Inductor compiles (and fuses) the fallbacks around fusekit's segments.
A segment takes the values it reads that were computed outside it and returns the values read
after it; a value crossing a fallback goes out and comes back in (a copy each way), so the graph's
data flow orders every call.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import session
from .ir import Program, Stage, bind_constants, run_torch_stage

__all__ = ["Segment", "split", "partitioned_module", "evaluate_segment", "dense", "compiled_graphs", "run_segment"]


@dataclass
class Segment:
    """Stages ``lo`` to ``hi - 1`` of a program: run by fusekit (``fused``) or left to PyTorch."""

    fused: bool
    lo: int
    hi: int
    inputs: list[str] = field(default_factory=list)  # values read here, computed before it (in the order first read)
    outputs: list[str] = field(default_factory=list)  # values computed here, read after it (or the program's output)


def split(prog: Program) -> list[Segment]:
    """The program's segments in execution order (one fused segment where nothing falls back)."""
    stages = prog.stages
    segs: list[Segment] = []
    for i, s in enumerate(stages):
        if segs and segs[-1].fused != s.fallback:
            segs[-1].hi = i + 1
        else:
            segs.append(Segment(not s.fallback, i, i + 1))
    for seg in segs:
        run = stages[seg.lo:seg.hi]
        made = {s.output for s in run}
        seg.inputs = list(dict.fromkeys(v for s in run for v in s.inputs if v not in made))
        later = {v for s in stages[seg.hi:] for v in s.inputs} | {prog.output}
        seg.outputs = [s.output for s in run if s.output in later]
    return segs


def evaluate_segment(prog: Program, seg: Segment, xs: list[Any]) -> list[Any]:
    """A fused segment's outputs for inputs ``xs`` (CPU torch tensors) through the float64 reference
    (:mod:`fusekit.pipeline.reference`), returned in xs[0]'s dtype: what ``run_segment`` does off the GPU."""
    import torch

    from .reference import evaluate_stage

    env = {n: t.detach().double().numpy() for n, t in zip(seg.inputs, xs)}
    for s in prog.stages[seg.lo:seg.hi]:
        env[s.output] = np.asarray(evaluate_stage(s, env), dtype=np.float64)
    dtype = xs[0].dtype if xs else torch.float32
    return [dense(torch.from_numpy(np.ascontiguousarray(env[o])).to(dtype)) for o in seg.outputs]


def dense(t: Any) -> Any:
    """A fresh copy of ``t`` as segments return values: channels-last for images, else contiguous."""
    import torch

    return t.clone(memory_format=torch.channels_last if t.dim() == 4 else torch.contiguous_format)


def _stage_module(s: Stage, device: Any, dtype: Any) -> Any:
    """A fallback stage as an ``nn.Module`` of PyTorch ops: its weights and constants are buffers (in
    ``dtype`` on ``device``), so that a compiler sees them as the graph's constants."""
    import copy

    import torch

    class StageModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fn = copy.deepcopy(s.fn).to(device=device, dtype=dtype) if isinstance(s.fn, torch.nn.Module) else s.fn
            self.names = list(s.weights)
            for i, k in enumerate(self.names):
                self.register_buffer(f"w{i}", torch.from_numpy(np.asarray(s.weights[k], np.float64)).to(device=device, dtype=dtype))
            consts: list[Any] = []

            def slot(a: Any) -> Any:  # each tensor constant -> a buffer, named by a slot in the template
                if not isinstance(a, torch.Tensor):
                    return a
                consts.append(a)
                return _Slot(len(consts) - 1)

            self.template = torch.fx.node.map_aggregate(bind_constants(s, device, dtype), slot) if s.kind == "torch" else None
            for i, c in enumerate(consts):
                self.register_buffer(f"c{i}", c)

        def forward(self, *xs: Any) -> Any:
            weights = {k: getattr(self, f"w{i}") for i, k in enumerate(self.names)}
            unslot = lambda a: getattr(self, f"c{int(a)}") if isinstance(a, _Slot) else a  # noqa: E731
            bound = None if self.template is None else torch.fx.node.map_aggregate(self.template, unslot)
            return run_torch_stage(s, dict(zip(s.inputs, xs)), self.fn, weights, bound=bound)

    return StageModule()


class _Slot(int):
    """A tensor constant's place in a fallback stage's argument template (its buffer ``c<n>``)."""


def partitioned_module(prog: Program, segs: list[Segment], key: int, variant: int, device: Any, dtype: Any, out_dtype: Any) -> Any:
    """The program as an FX ``GraphModule`` of one input (the program's, cast to ``dtype``): fused
    segments as ``torch.ops.fusekit.run_segment(inputs, key, variant, segment)``, fallback stages
    as modules (:func:`_stage_module`), the output cast to ``out_dtype`` and returned in a tuple."""
    import torch

    root = torch.nn.Module()
    g = torch.fx.Graph()
    x = g.placeholder("x")
    env = {prog.input: g.call_method("to", (x,), {"dtype": dtype})}
    for k, seg in enumerate(segs):
        if seg.fused:
            got = g.call_function(torch.ops.fusekit.run_segment.default, ([env[v] for v in seg.inputs], key, variant, k))
            for j, o in enumerate(seg.outputs):
                env[o] = g.call_function(operator.getitem, (got, j))
            continue
        for i in range(seg.lo, seg.hi):
            s = prog.stages[i]
            root.add_module(f"stage{i}", _stage_module(s, device, dtype))
            env[s.output] = g.call_module(f"stage{i}", tuple(env[v] for v in s.inputs))
    g.output((g.call_method("to", (env[prog.output],), {"dtype": out_dtype}),))
    return torch.fx.GraphModule(root, g)


def compiled_graphs() -> dict[int, Any]:
    """The session's compiled graphs by key (:class:`fusekit.pipeline.backend.FusekitGraph`: what
    ``torch.ops.fusekit.run_segment`` runs)."""
    return session.current().table("compiled_graphs")


def _define_op() -> Any:
    """``torch.ops.fusekit.run_segment(xs, key, variant, segment)``: fused segment ``segment`` of
    compiled graph ``key``'s variant ``variant`` (:class:`fusekit.pipeline.backend.FusekitGraph`) for its inputs ``xs``: on
    the GPU its pipeline, elsewhere the float64 reference; a fake implementation gives the outputs'
    shapes (channels-last images) and the variant's dtype, for shape propagation and tracing."""
    import torch

    @torch.library.custom_op("fusekit::run_segment", mutates_args=(), schema="(Tensor[] xs, int key, int variant, int segment) -> Tensor[]")
    def op(xs: list[torch.Tensor], key: int, variant: int, segment: int) -> list[torch.Tensor]:
        g = compiled_graphs()[key]
        if xs[0].is_cuda:
            return g.run_segment(list(xs), variant, segment)
        var = g.variants[variant]
        return evaluate_segment(var.program, var.segments[segment], list(xs))

    @op.register_fake
    def _(xs: list[torch.Tensor], key: int, variant: int, segment: int) -> list[torch.Tensor]:
        var = compiled_graphs()[key].variants[variant]
        shapes = var.program.shapes()
        return [dense(xs[0].new_empty(shapes[o], dtype=getattr(torch, var.dtype))) for o in var.segments[segment].outputs]

    return op


run_segment = _define_op()
