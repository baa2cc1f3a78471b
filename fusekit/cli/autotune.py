"""``fusekit autotune``: time every candidate plan of a key (or of each layer of a spec file) and keep the fastest."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import click
import numpy as np

from fusekit import config
from fusekit.engine import autotune as tuner
from fusekit.engine.cache import DiskStore, PlanCache
from fusekit.engine.patterns import get_pattern, list_patterns
from fusekit.errors import FusekitError, OperandError

from .common import (
    DEFAULT_DTYPE,
    DEFAULT_LAYOUT,
    DTYPES,
    LAYOUTS,
    SHAPE_HINT,
    CliError,
    Command,
    InputError,
    Shape,
    attr_option,
    cache_dir_option,
    candidate_table,
    check_names,
    check_tune_input,
    console,
    dtype_layout_options,
    emit,
    fmt_attrs,
    fmt_value,
    friendly,
    is_int,
    one_line,
    pattern_arg,
    plural,
    require_gpu,
    shape_option,
    speedup_line,
    time_of,
    tuning_summary,
    uses_layout,
)


# ----------------------------------------------------------------------------------------------
# Spec files
# ----------------------------------------------------------------------------------------------
class SpecError(FusekitError):
    """A bad autotune spec file: the message names the file, the layer (1-based) and the key."""


SPEC_KEYS = ("pattern", "shapes", "attrs", "dtype", "layout")


@dataclass
class SpecLayer:
    """One key to tune: a ``[[layer]]`` table of a spec file, or PATTERN with --shape on the command line."""

    index: int  # 1-based position among the file's [[layer]] tables (1 on the command line)
    pattern: str
    shapes: dict[str, Shape]
    attrs: dict[str, Any] = field(default_factory=dict)
    dtype: str = DEFAULT_DTYPE
    layout: str = DEFAULT_LAYOUT

    def describe(self) -> str:
        """``conv_bias_relu float16 NHWC x=2,8,16,16 w=16,8,3,3 b=16 padding=1``."""
        pat = get_pattern(self.pattern)
        lay = f" {self.layout}" if uses_layout(pat, self.shapes) else ""
        shapes = " ".join(f"{k}={fmt_value(v)}" for k, v in self.shapes.items())
        attrs = f" {fmt_attrs(sorted(self.attrs.items()))}" if self.attrs else ""
        return f"{self.pattern} {self.dtype}{lay} {shapes}{attrs}"

    def ident(self) -> tuple:
        """What makes two layers the same key (attributes normalized, so padding=1 == padding=[1, 1])."""
        pat = get_pattern(self.pattern)
        return (self.pattern, tuple(sorted(self.shapes.items())), pat.normalize_attrs(self.attrs), self.dtype, self.layout)


def _spec_layer(source: str, index: int, table: Mapping[str, Any], dtype: str, layout: str) -> SpecLayer:
    name = table.get("pattern")
    label = f"spec {source}: layer {index}" + (f" ({name})" if isinstance(name, str) and name else "")

    def err(key: str, msg: str) -> SpecError:
        return SpecError(f"{label}: key '{key}': {msg}")

    for k in table:
        if k not in SPEC_KEYS:
            raise err(k, f"unknown key (a [[layer]] takes {', '.join(SPEC_KEYS)})")
    if "pattern" not in table:
        raise err("pattern", 'missing (e.g. pattern = "conv_bias_relu")')
    if not isinstance(name, str) or not name:
        raise err("pattern", f"expected a pattern name (a string), got {name!r}")
    if name not in list_patterns():
        raise err("pattern", f"no pattern {name!r} (known: {', '.join(list_patterns())})")
    try:
        pat = get_pattern(name)
    except FusekitError as e:
        raise err("pattern", str(e)) from None

    example = ", ".join(f"{o.name} = [{SHAPE_HINT.get(o.kind, 'D1, ...').replace(',', ', ')}]" for o in pat.operands)
    raw_shapes = table.get("shapes")
    if raw_shapes is None:
        raise err("shapes", f"missing (e.g. shapes = {{ {example} }})")
    if not isinstance(raw_shapes, dict):
        raise err("shapes", f"expected a table of operand shapes such as {{ {example} }}, got {raw_shapes!r}")
    shapes: dict[str, Shape] = {}
    for k, v in raw_shapes.items():
        if k not in pat.operand_names:
            raise err(f"shapes.{k}", f"{k!r} is not an operand of {pat.name} (operands: {', '.join(pat.operand_names)})")
        if not isinstance(v, list) or not v or not all(is_int(d) and d >= 1 for d in v):
            raise err(f"shapes.{k}", f"expected a list of positive integers such as [{SHAPE_HINT.get(pat.operand(k).kind, 'D1, ...')}], got {v!r}")
        shapes[k] = tuple(v)
    missing = [n for n in pat.operand_names if n not in shapes]
    if missing:
        raise err("shapes", f"missing operand(s) {', '.join(missing)} of {pat.name} (e.g. shapes = {{ {example} }})")

    raw_attrs = table.get("attrs", {})
    if not isinstance(raw_attrs, dict):
        raise err("attrs", f"expected a table such as {{ padding = 1 }}, got {raw_attrs!r}")
    attrs: dict[str, Any] = {}
    scalar = (int, float, str, bool)
    for k, v in raw_attrs.items():
        if isinstance(v, list) and v and all(isinstance(x, scalar) for x in v):
            v = tuple(v)
        elif not isinstance(v, scalar):
            raise err(f"attrs.{k}", f"expected a number, boolean, string or a list of them, got {v!r}")
        attrs[k] = v

    dt = table.get("dtype", dtype)
    if dt not in DTYPES:
        raise err("dtype", f"expected one of {', '.join(DTYPES)}, got {dt!r}")
    lay = table.get("layout", layout)
    if not isinstance(lay, str) or lay.upper() not in LAYOUTS:
        raise err("layout", f"expected one of {', '.join(LAYOUTS)}, got {lay!r}")
    lay = lay.upper()

    try:
        check_tune_input(pat, shapes, attrs, dt, lay)
    except OperandError as e:
        if e.operand in shapes:
            where = f"shapes.{e.operand}"
        elif e.operand in attrs:
            where = f"attrs.{e.operand}"
        else:  # an intermediate value of the pattern, or an attribute's default
            where = "attrs" if e.operand in {a.name for a in pat.attrs} else "shapes"
        msg = str(e)
        if msg.startswith(f"{pat.name}: "):
            msg = msg[len(pat.name) + 2 :]
        raise err(where, msg) from None
    return SpecLayer(index, pat.name, shapes, attrs, dt, lay)


def parse_spec(text: str, source: str = "<spec>", *, dtype: str = DEFAULT_DTYPE, layout: str = DEFAULT_LAYOUT) -> list[SpecLayer]:
    """The keys an autotune spec file asks for, fully checked (no GPU needed); SpecError otherwise.

    A spec file is TOML with one ``[[layer]]`` table per key::

        [[layer]]
        pattern = "conv_bias_relu"
        shapes = { x = [8, 64, 56, 56], w = [64, 64, 3, 3], b = [64] }
        attrs = { padding = 1 }        # optional
        dtype = "float16"              # optional (default: ``dtype``)
        layout = "NHWC"                # optional (default: ``layout``)

    Errors name the file, the layer (1-based, in file order) and the key, e.g.
    ``spec net.toml: layer 2 (conv_bias): key 'shapes.w': ...``.
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"spec {source}: not valid TOML: {e}") from None
    for k in doc:
        if k != "layer":
            raise SpecError(f"spec {source}: unknown top-level key {k!r} (a spec file holds [[layer]] tables)")
    layers = doc.get("layer")
    if layers is None or layers == []:
        raise SpecError(f"spec {source}: no [[layer]] tables (each names a pattern and its operand shapes)")
    if not isinstance(layers, list) or not all(isinstance(t, dict) for t in layers):
        raise SpecError(f"spec {source}: 'layer' must be [[layer]] tables, got {layers!r}")
    return [_spec_layer(source, i, t, dtype, layout) for i, t in enumerate(layers, 1)]


def load_spec(path: str | os.PathLike[str], *, dtype: str = DEFAULT_DTYPE, layout: str = DEFAULT_LAYOUT) -> list[SpecLayer]:
    """:func:`parse_spec` of a file; SpecError (one line) if it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(f"spec {os.fspath(path)}: cannot read it ({e.strerror or type(e).__name__})") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"spec {os.fspath(path)}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return parse_spec(text, os.fspath(path), dtype=dtype, layout=layout)


# ----------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------
_BYTE_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20, "g": 2**30, "gb": 2**30, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``'268435456'``, ``'256MiB'``, ``'256M'``, ``'1G'`` -> bytes (K, M, G: powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise ValueError("expected a byte count such as 268435456, 256MiB or 1G")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def _bytes_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise InputError(f"Invalid value for '--workspace-limit': {value!r}: {e}") from None


# ----------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------
def plot_tuning(keys: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], path: str | os.PathLike[str]) -> None:
    """Write a PNG strip plot of each key's candidate times (log scale): one column per key, the
    heuristics' first plan and the best plan marked. ``keys``: (label, candidate dicts) pairs."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator

    fig = Figure(figsize=(max(6.5, 1.1 * len(keys) + 2.5), 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    rng = np.random.default_rng(0)
    seen: set[str] = set()

    def once(label: str) -> str | None:
        if label in seen:
            return None
        seen.add(label)
        return label

    for i, (_, cands) in enumerate(keys):
        times = [t for t in (time_of(c) for c in cands) if t is not None]
        best, first = tuning_summary(cands)
        if not times or best is None or first is None:
            continue
        ax.scatter(i + rng.uniform(-0.2, 0.2, len(times)), times, s=16, color="0.55", alpha=0.75, label=once("candidate plan"))
        ax.scatter([i], [time_of(first)], marker="D", s=70, facecolors="none", edgecolors="tab:blue", linewidths=1.5, zorder=3, label=once("heuristics' first plan"))
        bt = time_of(best)
        ax.scatter([i], [bt], marker="*", s=200, color="tab:red", zorder=4, label=once("best (kept)"))
        speedup = (time_of(first) or 0) / bt if bt else float("nan")
        ax.annotate(f"{speedup:.2f}x", (i, bt), textcoords="offset points", xytext=(9, -4), fontsize=8, color="tab:red")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.yaxis.set_minor_formatter(plain)
    ax.set_ylabel("time per call (us, log scale)")
    ax.set_xlim(-0.6, len(keys) - 0.4)
    ax.set_xticks(range(len(keys)), [lbl if len(lbl) <= 40 else lbl[:37] + "..." for lbl, _ in keys], rotation=25, ha="right", fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    if seen:
        ax.legend(fontsize=8, loc="best")
    ax.set_title("fusekit autotune: candidate plan times per key", fontsize=10)
    fig.savefig(os.fspath(path), format="png", dpi=120)


# ----------------------------------------------------------------------------------------------
# autotune
# ----------------------------------------------------------------------------------------------
@click.command("autotune", cls=Command)
@click.argument("name", required=False, metavar="[PATTERN]")
@shape_option
@dtype_layout_options
@attr_option
@click.option("--spec", "spec_file", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE",
              help="TOML file of [[layer]] tables (pattern, shapes, optional attrs, dtype, layout) to tune instead of PATTERN.")
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True, help="Wall-clock seconds per key.")
@click.option("--max-candidates", type=click.IntRange(min=1), default=64, show_default=True, help="Most candidate plans timed per key.")
@click.option("--workspace-limit", metavar="BYTES", callback=_bytes_callback, default=None,
              help="Skip plans needing more workspace (e.g. 268435456, 256MiB, 1G).")
@click.option("--deterministic", is_flag=True, help="Only plans cuDNN does not mark non-deterministic.")
@cache_dir_option
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE.png",
              help="Also write a PNG of every key's candidate times (log scale, best marked).")
@friendly
def autotune_cmd(
    name: str | None, shapes: dict[str, Shape], dtype: str, layout: str, attrs: dict[str, Any], spec_file: Path | None,
    budget: float, max_candidates: int, workspace_limit: int | None, deterministic: bool, cache_dir: Path | None, plot: Path | None,
) -> None:
    """Time every candidate plan of a key on the GPU; keep the fastest in the plan cache.

    Tunes PATTERN for --shape (and --attr), or each [[layer]] of a --spec file, and stores the
    fastest plan in the plan cache (memory and disk), where later runs find it. Shows a progress bar, then per key a table of candidates (time, workspace, verdict; the best
    and the heuristics' first plan marked) and the speed-up over the heuristics' choice. The spec
    file, shapes and attributes are checked before the GPU is looked for.
    """
    if spec_file is not None:
        if name or shapes or attrs:
            raise InputError("give either PATTERN with --shape (and --attr), or --spec FILE, not both")
        jobs = load_spec(spec_file, dtype=dtype, layout=layout)
    elif name:
        pat = pattern_arg(name)
        check_names(pat, shapes, required=True)
        check_tune_input(pat, shapes, attrs, dtype, layout)
        jobs = [SpecLayer(1, pat.name, dict(shapes), dict(attrs), dtype, layout)]
    else:
        raise InputError("give a PATTERN and a --shape NAME=DIMS per operand, or --spec FILE (see 'fusekit autotune --help')")
    if plot is not None:
        if plot.suffix.lower() != ".png":
            raise InputError(f"Invalid value for '--plot': {os.fspath(plot)!r}: expected a .png file name")
        if not plot.resolve().parent.is_dir():
            raise InputError(f"Invalid value for '--plot': directory {os.fspath(plot.resolve().parent)!r} does not exist")
        if importlib.util.find_spec("matplotlib") is None:
            raise CliError("--plot needs matplotlib (pip install matplotlib)")

    lib, _ = require_gpu("autotune")

    store = DiskStore(cache_dir) if cache_dir is not None else (None if config.disk_cache_off() else DiskStore())
    cache = PlanCache(maxsize=len(jobs) + 1, store=store, mode="autotune")  # not from $FUSEKIT_CACHE_SIZE / $FUSEKIT_MODE
    base = tuner.TuneOptions(budget_s=budget, max_candidates=max_candidates, workspace_limit=workspace_limit, deterministic=deterministic)
    con = console()
    results = _run_autotune(con, jobs, lib, base, cache, spec_file is not None)
    done = [(job, r) for job, r in results if r is not None]
    failed = [job for job, r in results if r is None]
    if plot is not None and done:
        plot_tuning([(f"{job.index}: {job.pattern}" if spec_file else job.pattern, [c.to_json() for c in r.candidates]) for job, r in done], plot)
        con.print(f"plot: {os.fspath(plot)}")
    where = f"saved to the plan cache at {store.root}" if store is not None else "kept in memory only (FUSEKIT_CACHE_DIR is off)"
    if done:
        con.print(f"{plural(len(done), 'tuned plan')} {where}; `fusekit cache ls` lists them")
    if failed:
        raise CliError(f"{len(failed)} of {len(jobs)} layers could not be tuned: layer(s) {', '.join(str(j.index) for j in failed)}")


def _run_autotune(
    con: Any, jobs: Sequence[SpecLayer], lib: str, base: Any, cache: Any, from_spec: bool
) -> list[tuple[SpecLayer, Any]]:
    """Tune each job under a rich progress display; prints a candidate table and a summary per key.

    Returns [(job, TuneResult, or None if it failed)] (a repeated key is tuned once and left out).
    With one job a failure raises CliError; with a spec file the other layers still run.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    results: list[tuple[SpecLayer, Any]] = []
    seen: dict[tuple, int] = {}
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=con, transient=True, disable=not con.is_terminal,  # no bars in pipes and logs
    )
    with progress:
        layers = progress.add_task("layers", total=len(jobs)) if len(jobs) > 1 else None
        for job in jobs:
            label = job.describe()
            ident = job.ident()
            if ident in seen:
                progress.console.print(f"layer {job.index}: the same key as layer {seen[ident]}; skipped")
                if layers is not None:
                    progress.advance(layers)
                continue
            seen[ident] = job.index
            prefix = f"layer {job.index}: " if from_spec else ""
            task = progress.add_task(f"{prefix}{job.pattern}: building candidate plans", total=None)

            def on_progress(done: int, total: int, cand: Any, task: Any = task, prefix: str = prefix, job: SpecLayer = job) -> None:
                progress.update(task, total=total, completed=done, description=f"{prefix}{job.pattern}: {cand.name}")

            options = dataclasses.replace(base, progress=on_progress)
            try:
                result = tuner.autotune_shapes(  # looked up per call: tests replace it
                    job.pattern, job.shapes, dtype=job.dtype, layout=job.layout, library=lib, options=options, cache=cache, **job.attrs
                )
            except Exception as e:  # noqa: BLE001 - reported on one line; the other layers still run
                progress.remove_task(task)
                why = one_line(str(e)) if isinstance(e, FusekitError) else f"{type(e).__name__}: {one_line(str(e))}"
                if not from_spec:
                    raise CliError(f"tuning {label} failed: {why}") from None
                progress.console.print(f"layer {job.index}: {label}: FAILED: {why}")
                results.append((job, None))
                if layers is not None:
                    progress.advance(layers)
                continue
            progress.remove_task(task)
            results.append((job, result))
            cands = [c.to_json() for c in result.candidates]
            title = f"{prefix}{label}  (key {result.key.fingerprint()[:12]})"
            emit(progress.console, candidate_table(cands, title, best=result.best))
            progress.console.print(_tune_summary(result))
            progress.console.print()
            if layers is not None:
                progress.advance(layers)
    return results


def _tune_summary(result: Any) -> str:
    cands = result.candidates
    best = next((c for c in cands if c.index == result.best), None)
    timed = sum(1 for c in cands if c.verdict == "ok")
    return (
        f"{speedup_line(best.name if best else result.best, result.best_us, result.heuristic_us, result.speedup)}; "
        f"{timed} of {plural(len(cands), 'candidate')} timed in {result.seconds:.1f} s"
    )
