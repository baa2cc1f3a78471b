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
from fusekit.engine.patterns import Pattern, get_pattern, list_patterns, pattern_dirs
from fusekit.errors import FusekitError
from fusekit.tensors import TensorSpec

from .common import (
    Command,
    Group,
    Shape,
    attr_option,
    check_names,
    dtype_layout_options,
    failed,
    fmt_attrs,
    fmt_shape,
    friendly,
    one_line,
    operand_specs,
    pattern_arg,
    pretty_json,
    shape_option,
    uses_layout,
)


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
@friendly
def patterns_ls() -> None:
    """Table of every pattern: operands, attributes with defaults, summary."""
    rows = [("NAME", "OPERANDS", "ATTRS (defaults)", "SUMMARY")]
    for name in list_patterns():
        try:
            pat = get_pattern(name)
        except FusekitError as e:
            rows.append((name, "-", "-", f"INVALID: {one_line(str(e))}"))
            continue
        operands = " ".join(f"{o.name}:{o.kind}" for o in pat.operands)
        rows.append((pat.name, operands, fmt_attrs([(a.name, a.default) for a in pat.attrs]), pat.summary))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
    if len(rows) == 1:
        click.echo("(no patterns found)")
    click.echo(f"\npatterns from: {os.pathsep.join(str(d) for d in pattern_dirs()) or '(no directory)'}")


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
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the standard-normal random inputs.")
@friendly
def oracle_cmd(name: str, shapes: dict[str, Shape], attrs: dict[str, Any], seed: int) -> None:
    """Run pattern NAME's float64 NumPy oracle on random inputs.

    Prints each output's shape, min, max, mean, std and share of zeros. Needs no GPU.
    """
    pat = pattern_arg(name)
    operand_specs(pat, shapes, "float32", "NCHW")  # the same operand checks as the GPU path
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
