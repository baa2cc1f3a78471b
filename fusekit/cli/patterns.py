"""``fusekit patterns ls``, ``fusekit patterns show`` and ``fusekit oracle``: pattern files, their cuDNN graphs and NumPy oracles (no GPU)."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import click
import numpy as np

from fusekit.engine import oracle
from fusekit.engine.keys import output_specs
from fusekit.engine.lower import lower
from fusekit.engine.patterns import Pattern, pattern_dirs, scan_patterns
from fusekit.errors import FusekitError
from fusekit.tensors import TensorSpec

from .common import (
    Command,
    Group,
    CliError,
    Shape,
    attr_option,
    check_names,
    check_tune_input,
    console,
    dtype_layout_options,
    emit,
    failed,
    fmt_attrs,
    fmt_bytes,
    fmt_shape,
    friendly,
    operand_specs,
    pattern_arg,
    pretty_json,
    shape_option,
    table,
    text,
    uses_layout,
    warn,
)

#: The most host memory ``fusekit oracle`` allocates for its float64 operands and outputs.
ORACLE_HOST_LIMIT = 2 * 1024**3


def lower_graph(pat: Pattern, specs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> tuple[dict[str, TensorSpec], Any]:
    """(output specs, the cuDNN graph's ``inspect()`` as JSON data); needs the cuDNN frontend, not a GPU."""
    norm = pat.normalize_attrs(attrs)
    outs = output_specs(pat, specs, norm)
    try:
        graph = lower(pat, {**specs, **outs}, dict(norm)).graph.inspect()
    except FusekitError:
        raise
    except Exception as e:  # noqa: BLE001 - the frontend's own errors, reported on one line
        raise failed(f"lowering {pat.name}", e) from None
    if isinstance(graph, (str, bytes)):
        graph = json.loads(graph)
    return outs, graph


@click.group(cls=Group)
def patterns() -> None:
    """List and inspect pattern files."""


@patterns.command("ls")
@click.option("--wide", "-w", is_flag=True, help="Every column in full (operand kinds, attribute defaults), one line a pattern, however wide.")
@friendly
def patterns_ls(wide: bool) -> None:
    """Table of every pattern: name, operands and summary (--wide: operand kinds and attributes with
    defaults too). Pattern files that do not load are skipped with a warning naming them."""
    pats, broken = scan_patterns()
    for e in broken:
        warn(f"skipping {e}")
    if wide:
        rows = [("NAME", "OPERANDS", "ATTRS (defaults)", "SUMMARY")]
        for pat in pats:
            operands = " ".join(f"{o.name}:{o.kind}" for o in pat.operands)
            rows.append((pat.name, operands, fmt_attrs([(a.name, a.default) for a in pat.attrs]), pat.summary))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            click.echo("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
    elif pats:  # fits the terminal: operand names and the summary cut short with an ellipsis
        heads = ("NAME", "OPERANDS", "SUMMARY")
        rows = [(pat.name, " ".join(pat.operand_names), pat.summary) for pat in pats]
        t = table(None, heads)
        con = console()
        widths = fit_widths(con.width, [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)])
        for col, w in zip(t.columns, widths):
            col.width, col.overflow = w, "ellipsis"
        for r in rows:
            t.add_row(*(text(v) for v in r))
        emit(con, t, fit=True)
    if not pats:
        click.echo("(no patterns found)")
    where = f"patterns from: {os.pathsep.join(str(d) for d in pattern_dirs()) or '(no directory)'}"
    if wide:
        click.echo(f"\n{where}")
    else:  # folded at the terminal's width, like the table
        click.echo()
        for line in (where, "(--wide: every column in full; `fusekit patterns show NAME`: one pattern)"):
            emit(console(), text(line), fit=True)


@patterns.command("show")
@click.argument("name")
@shape_option
@dtype_layout_options
@attr_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of the TOML text.")
@friendly
def patterns_show(name: str, shapes: dict[str, Shape], dtype: str, layout: str, attrs: dict[str, Any], as_json: bool) -> None:
    """Print pattern NAME's file (and its cuDNN graph, given shapes).

    With a --shape for every operand the pattern is also lowered to a cuDNN frontend graph (no GPU
    needed) and the graph's inspect() is printed as JSON.
    """
    pat = pattern_arg(name)
    check_names(pat, shapes, required=bool(shapes))
    if attrs and not shapes:
        pat.normalize_attrs(attrs)  # reject unknown or malformed attributes even when not lowering
    outs, graph = None, None
    if shapes:
        specs = operand_specs(pat, shapes, dtype, layout)
        outs, graph = lower_graph(pat, specs, attrs)
    if as_json:
        doc: dict[str, Any] = {
            "name": pat.name,
            "summary": pat.summary,
            "source": pat.source,
            "digest": pat.digest,
            "operands": {o.name: {"kind": o.kind, "role": o.role} for o in pat.operands},
            "attrs": {a.name: a.default for a in pat.attrs},
            "outputs": {n: {"like": like} for n, like in pat.outputs.items()},
            "text": pat.text,
        }
        if graph is not None and outs is not None:
            doc["lowered"] = {
                "dtype": dtype,
                "layout": layout,
                "attrs": dict(pat.normalize_attrs(attrs)),
                "shapes": {k: list(v.view or v.shape) for k, v in {**specs, **outs}.items()},
                "graph": graph,
            }
        click.echo(pretty_json(doc))
        return
    click.echo(f"# {pat.source}")
    click.echo(pat.text.rstrip("\n"))
    if graph is not None and outs is not None:
        norm = pat.normalize_attrs(attrs)
        ins = ", ".join(f"{k}={fmt_shape(v.view or v.shape)}" for k, v in specs.items())
        res = ", ".join(f"{k}={fmt_shape(v.view or v.shape)}" for k, v in outs.items())
        lay = f" {layout}" if uses_layout(pat, shapes) else ""
        click.echo(f"\n# cuDNN graph: {ins} -> {res}; {dtype}{lay}; {fmt_attrs(norm, 'no attributes')}")
        click.echo(pretty_json(graph))


@click.command("oracle", cls=Command)
@click.argument("name")
@shape_option
@attr_option
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the standard-normal random inputs (>= 0).")
@friendly
def oracle_cmd(name: str, shapes: dict[str, Shape], attrs: dict[str, Any], seed: int) -> None:
    """Run pattern NAME's float64 NumPy oracle on random inputs.

    Prints each output's shape, min, max, mean, std and share of zeros. Needs no GPU.
    """
    pat = pattern_arg(name)
    check_names(pat, shapes, required=True)
    specs = check_tune_input(pat, shapes, attrs, "float32", "NCHW")  # the same checks as the GPU path
    check_host_memory(pat, specs)
    norm = pat.normalize_attrs(attrs)
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(shapes[o.name]) for o in pat.operands]
    results = oracle.evaluate(pat, *inputs, **attrs)
    click.echo(f"{pat.name} (NumPy float64 oracle), seed {seed}, {fmt_attrs(norm, 'no attributes')}")
    for o in pat.operands:
        click.echo(f"  in  {o.name}: {fmt_shape(shapes[o.name])} standard normal")
    for out_name, y in zip(pat.outputs, results):
        zeros = float(np.mean(y == 0.0)) * 100
        click.echo(
            f"  out {out_name}: {fmt_shape(y.shape)} min {y.min():.4g} max {y.max():.4g} "
            f"mean {y.mean():.4g} std {y.std():.4g} zeros {zeros:.1f}%"
        )


def fit_widths(width: int, natural: list[int]) -> list[int]:
    """Widths of ls's NAME, OPERANDS and SUMMARY columns in ``width`` terminal columns: the name in
    full, then the operands (at most 2/5 of what is left, unless both fit) and the summary."""
    name, ops, summary = natural
    avail = width - name - 6  # three blanks between columns (padding, rule, padding)
    if ops + summary > avail:
        ops = min(ops, max(8, avail * 2 // 5))
        summary = max(8, avail - ops)
    return [name, ops, summary]


def check_host_memory(pat: Pattern, specs: Mapping[str, TensorSpec], limit: int = ORACLE_HOST_LIMIT) -> None:
    """CliError unless the oracle's float64 operands and outputs (``specs``) fit in ``limit`` bytes;
    names the largest array and what they would need."""
    need = {k: 8 * _count(v.shape) for k, v in specs.items()}
    total = sum(need.values())
    if total <= limit:
        return
    big = max(need, key=need.__getitem__)
    what = "operand" if big in pat.operand_names else "output"
    shape = specs[big].view or specs[big].shape
    raise CliError(
        f"{pat.name}: the NumPy oracle's float64 operands and outputs would need {fmt_bytes(total)} of host memory, "
        f"more than its limit of {fmt_bytes(limit)}; the largest, {what} '{big}' of shape {fmt_shape(shape)}, "
        f"needs {fmt_bytes(need[big])}: give smaller --shape values"
    )


def _count(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
