"""Draw a pattern's lowered cuDNN graph (no GPU needed): tensors as boxes, ops as boxes between them.

    from fusekit.viz import draw_graph
    fig = draw_graph("conv_bias_relu", {"x": (2, 8, 9, 9), "w": (16, 8, 3, 3), "b": (16,)}, {"padding": 1})

Operands (blue), virtual intermediate tensors (grey, dashed: they never reach memory) and outputs
(green) are labelled with their name, the dims cuDNN sees and their dtype; ops are laid out left to
right in the pattern's order and labelled with the pattern op and the cuDNN node it becomes
(``graph.inspect()`` of :func:`fusekit.engine.lower.lower`, when the cuDNN frontend imports).
matplotlib is imported only when a function here is called.
"""

from __future__ import annotations

from typing import Any, Mapping

from .engine import keys
from .engine.lower import COMPUTE_DTYPE, lower
from .engine.patterns import Pattern, get_pattern
from .errors import NoGPUError
from .tensors import TensorSpec

_COLORS = {"operand": ("#dbe9f6", "#3b6ea5"), "virtual": ("#f2f2f2", "#888888"), "output": ("#dcf1dc", "#3f8f3f")}


def graph_layout(
    pattern: Pattern | str, specs_or_shapes: Mapping[str, Any], attrs: Mapping[str, Any] | None = None,
    *, dtype: str = "float16", layout: str = "NHWC", lowered: bool = True,
) -> tuple[dict[str, dict], list[dict]]:
    """(tensors: name -> {kind, shape, dtype, layout, x, y}; ops: [{op, node, inputs, outputs, x, y}]).

    ``specs_or_shapes``: a TensorSpec or a shape (as the array is given) per operand; outputs optional.
    Raises PatternError for an unknown pattern, OperandError for shapes that do not fit it."""
    pat = get_pattern(pattern) if isinstance(pattern, str) else pattern
    norm = pat.normalize_attrs(attrs or {})
    given = {k: v for k, v in specs_or_shapes.items() if k in pat.operand_names}
    if all(isinstance(v, TensorSpec) for v in given.values()) and len(given) == len(pat.operand_names):
        specs = dict(given)
    else:
        specs = keys.shape_specs(pat, {k: getattr(v, "view", v) for k, v in given.items()}, dtype, layout)
    specs.update({k: v for k, v in keys.output_specs(pat, specs, norm).items() if not isinstance(specs_or_shapes.get(k), TensorSpec)})
    specs.update({k: v for k, v in specs_or_shapes.items() if k in pat.outputs and isinstance(v, TensorSpec)})
    shapes = pat.infer_shapes({n: specs[n].shape for n in pat.operand_names}, dict(norm))
    nodes: dict[str, str] = {}  # op output name -> cuDNN node type (and pointwise mode)
    if lowered:
        try:
            info = lower(pat, specs, dict(norm)).graph.inspect()
            for n in info["nodes"]:
                mode = n.get("params", {}).get("mode", "")
                nodes[n["name"]] = n["type"] + (f" ({mode})" if mode else "")
        except NoGPUError:  # no cuDNN frontend: the pattern's own op names only
            pass
    tensors: dict[str, dict] = {}
    ops: list[dict] = []
    columns: dict[int, list[str]] = {}

    def place(name: str, col: int, kind: str) -> None:
        s = specs.get(name)
        tensors[name] = dict(kind=kind, shape=tuple(s.shape if s else shapes[name]), dtype=s.dtype if s else COMPUTE_DTYPE,
                             layout=s.layout if s else "virtual", x=col)
        columns.setdefault(col, []).append(name)

    for i, op in enumerate(pat.ops):
        for v in op.inputs.values():
            if v not in tensors:
                place(v, 2 * i, "operand")
        for v in op.produces:
            place(v, 2 * i + 2, "output" if v in pat.outputs else "virtual")
        ops.append(dict(op=op.op, node=nodes.get(op.out, ""), inputs=dict(op.inputs), outputs=list(op.produces), x=2 * i + 1))
    for col, names in columns.items():  # stack each column around y = 0
        for j, n in enumerate(names):
            tensors[n]["y"] = (len(names) - 1) / 2 - j
    for o in ops:
        ys = [tensors[v]["y"] for v in list(o["inputs"].values()) + o["outputs"]]
        o["y"] = sum(ys) / len(ys)
    return tensors, ops


def draw_graph(
    pattern: Pattern | str, specs_or_shapes: Mapping[str, Any], attrs: Mapping[str, Any] | None = None,
    ax: Any = None, **kw: Any,
) -> Any:
    """A matplotlib Figure of the graph ``pattern`` lowers to for these operands (see :func:`graph_layout`)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    tensors, ops = graph_layout(pattern, specs_or_shapes, attrs, **kw)
    name = pattern if isinstance(pattern, str) else pattern.name
    xs = [t["x"] for t in tensors.values()]
    ys = [t["y"] for t in tensors.values()]
    sx, sy, tw, ow = 2.1, 1.1, 1.3, 1.6  # data units per column and per stacked row; tensor and op box widths
    if ax is None:
        fig, ax = plt.subplots(figsize=(0.7 * (max(xs) * sx + 1.6), 0.8 * ((max(ys) - min(ys)) * sy + 1.4) + 0.5))
    else:
        fig = ax.figure

    def box(x: float, y: float, w: float, h: float, face: str, edge: str, ls: str = "-") -> None:
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                    fc=face, ec=edge, ls=ls, lw=1.2, zorder=2))

    for n, t in tensors.items():
        x, y = t["x"] * sx, t["y"] * sy
        face, edge = _COLORS[t["kind"]]
        box(x, y, tw, 0.8, face, edge, "--" if t["kind"] == "virtual" else "-")
        ax.text(x, y + 0.2, n, ha="center", va="center", fontsize=9, fontweight="bold", zorder=3)
        ax.text(x, y - 0.15, f"{t['shape']}\n{t['dtype']} {t['layout']}", ha="center", va="center", fontsize=6.5, zorder=3)
    for o in ops:
        x, y = o["x"] * sx, o["y"] * sy
        box(x, y, ow, 0.5, "#fde7cf", "#c26a12")
        ax.text(x, y + (0.08 if o["node"] else 0), o["op"], ha="center", va="center", fontsize=8, fontweight="bold", zorder=3)
        if o["node"]:
            ax.text(x, y - 0.13, o["node"], ha="center", va="center", fontsize=5.5, color="#7a4510", zorder=3)
        for port, v in o["inputs"].items():
            t = tensors[v]
            (x0, y0), (x1, y1) = (t["x"] * sx + tw / 2, t["y"] * sy), (x - ow / 2, y)
            ax.annotate("", (x1, y1), (x0, y0), zorder=1, arrowprops=dict(arrowstyle="->", color="#555", lw=0.9, shrinkA=0, shrinkB=0))
            ax.text(x0 + 0.1, y0 + 0.03, port, fontsize=6, color="#555", ha="left", va="bottom", zorder=3)
        for v in o["outputs"]:
            t = tensors[v]
            ax.annotate("", (t["x"] * sx - tw / 2, t["y"] * sy), (x + ow / 2, y), zorder=1,
                        arrowprops=dict(arrowstyle="->", color="#555", lw=0.9, shrinkA=0, shrinkB=0))
    ax.set_xlim(min(xs) * sx - 0.8, max(xs) * sx + 0.8)
    ax.set_ylim(min(ys) * sy - 0.5, max(ys) * sy + 0.5)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"{name}: {len(ops)} op(s), one cuDNN graph\nblue: operands, dashed grey: virtual tensors, green: outputs", fontsize=9)
    return fig


def to_svg(pattern: Pattern | str, specs_or_shapes: Mapping[str, Any], attrs: Mapping[str, Any] | None = None, **kw: Any) -> str:
    """:func:`draw_graph` as SVG text (the figure is closed afterwards)."""
    import io

    import matplotlib.pyplot as plt

    fig = draw_graph(pattern, specs_or_shapes, attrs, **kw)
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


__all__ = ["draw_graph", "graph_layout", "to_svg"]
