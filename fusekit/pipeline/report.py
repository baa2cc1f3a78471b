"""The pipeline's report: a table of its stages (pattern, shapes, engine, plan source, time and
roofline floor), where the GPU time goes, the fallbacks and the memory plan."""

from __future__ import annotations

import io
from typing import Any

from .ir import FUSEKIT_PATTERNS


def report(pipe: Any) -> str:
    """:meth:`fusekit.pipeline.Pipeline.report` of ``pipe``."""
    from rich.console import Console
    from rich.table import Table

    roof = pipe.roofline() if pipe.built else None
    t = Table(title=f"fusekit pipeline ({pipe.program.source}, {pipe.dtype}, channels-last)")
    cols = ("#", "kind", "pattern", "shapes (in -> out)", "engine", "plan", "ms", "floor ms", "bound", "x floor", "source nodes")
    for col in cols:
        wrap = col in ("engine", "source nodes")
        t.add_column(col, justify="right" if col in ("#", "ms", "floor ms", "x floor") else "left",
                     overflow="fold" if wrap else "ellipsis", no_wrap=not wrap)
    for i, s in enumerate(pipe.stages):
        ins = ", ".join("x".join(map(str, sh)) for sh in s.in_shapes)
        ms = pipe.times_ms[i]
        r = roof[i] if roof else None
        floor = ("-", "-", "-") if r is None else (
            f"{r['floor_ms']:.4f}", r["bound"], "-" if r["x_floor"] is None else f"{r['x_floor']:.1f}")
        t.add_row(str(i), s.kind, s.pattern, f"{ins} -> {'x'.join(map(str, s.out_shape))}", pipe.engines[i], pipe.sources[i],
                  "-" if ms is None else f"{ms:.3f}", *floor, s.name)
    buf = io.StringIO()
    con = Console(file=buf, width=220, force_terminal=False, force_jupyter=False, color_system=None)
    con.print(t)
    mp = pipe.memory_plan
    total = [m for m in pipe.times_ms if m is not None]
    split = pipe.time_split() if pipe.built else None
    lines = [
        f"stages: {len(pipe.stages)} ({sum(s.pattern in FUSEKIT_PATTERNS for s in pipe.stages)} fused cuDNN graphs, "
        f"{sum(s.fallback for s in pipe.stages) + len(pipe.build_fallbacks)} PyTorch fallbacks)",
        f"sum of stage times: {sum(total):.3f} ms (each stage replayed alone)" if total else "stage times: not measured (no GPU build)",
    ] + ([
        "GPU time: {cudnn_ms:.3f} ms fused cuDNN graphs, {kernel_ms:.3f} ms fusekit kernels, {torch_ms:.3f} ms PyTorch "
        "({fused_time_fraction:.0%} fused)".format(**split),
    ] + [f"  PyTorch {op}: {ms:.3f} ms" for op, ms in list(split["torch_by_op"].items())[:8]] if split else []) + ([
        f"roofline floor (peaks measured here: {pipe.peaks_text()}): {sum(r['floor_ms'] for r in roof):.3f} ms, "
        f"{sum(r['bound'] == 'compute' for r in roof)} stages compute-bound, {sum(r['bound'] == 'memory' for r in roof)} memory-bound",
    ] if roof else []) + [
        f"CUDA graph: {'captured' if pipe.graph_captured else ('failed: ' + pipe.capture_error if pipe.capture_error else 'not captured')}",
        f"memory: planned activations {mp.planned_bytes / 2**20:.2f} MiB in {len(mp.sizes)} buffers "
        f"vs eager sum {mp.eager_bytes / 2**20:.2f} MiB (live peak lower bound {mp.live_peak_bytes / 2**20:.2f} MiB)"
        + (f"; {len(mp.alias)} values written in place as channel slices of concatenations" if mp.alias else ""),
        "fallbacks (run by PyTorch):" if pipe.fallbacks else "fallbacks: none",
    ] + [f"  - {f}" for f in pipe.fallbacks] + (
        ["run by another kernel because it measured faster:"] + [f"  - {c}" for c in pipe.choices] if pipe.choices else [])
    return buf.getvalue() + "\n".join(lines) + "\n"


def time_split(pipe: Any) -> dict[str, Any]:
    """Where a built pipeline's profiled GPU time goes: ``cudnn_ms`` (fused cuDNN graphs), ``kernel_ms``
    (fusekit's CuPy kernels and copies), ``torch_ms`` (stages PyTorch runs: fallbacks, refusals, and
    stages whose PyTorch kernel measured faster), ``fused_time_fraction`` (the first two over the
    total) and ``torch_by_op``: PyTorch's time by op, largest first."""
    from ..errors import FusekitError

    if not pipe.built:
        raise FusekitError("pipeline: time_split needs a built pipeline (fusekit.pipeline.compile)")
    cudnn = kernel = 0.0
    by_op: dict[str, float] = {}
    for s, ms, engine in zip(pipe.stages, pipe.times_ms, pipe.engines):
        ms = ms or 0.0
        if s.pattern == "torch" or engine.startswith("torch"):
            op = s.attrs.get("op", s.kind) if s.pattern == "torch" else f"{s.pattern} (PyTorch's kernel)"
            by_op[op] = by_op.get(op, 0.0) + ms
        elif s.pattern in FUSEKIT_PATTERNS and not engine.startswith("cupy"):
            cudnn += ms
        else:
            kernel += ms
    torch_ms = sum(by_op.values())
    total = cudnn + kernel + torch_ms
    return {"cudnn_ms": cudnn, "kernel_ms": kernel, "torch_ms": torch_ms,
            "fused_time_fraction": (cudnn + kernel) / total if total else 0.0,
            "torch_by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1]))}
