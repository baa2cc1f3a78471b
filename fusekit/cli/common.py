"""Shared by the commands (holds none): errors and exit codes, --shape/--attr options, specs, GPU lookup, tables, JSON."""

from __future__ import annotations

import functools
import json
import math
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import click
import numpy as np

from fusekit import config
from fusekit.engine.keys import output_specs, shape_specs
from fusekit.engine.patterns import Pattern, PatternWarning, get_pattern
from fusekit.engine.runtime import versions
from fusekit.errors import FusekitError, NoGPUError
from fusekit.tensors import SUPPORTED_DTYPES, TensorSpec

F = TypeVar("F", bound=Callable[..., Any])
Shape = tuple[int, ...]

DTYPES = SUPPORTED_DTYPES
LAYOUTS = ("NHWC", "NCHW")
DEFAULT_DTYPE = "float16"
DEFAULT_LAYOUT = "NHWC"
#: How --shape gives each operand kind (the user's view; see fusekit.engine.patterns.KINDS).
SHAPE_HINT = {
    "image": "N,C,H,W",
    "filter": "K,C,R,S",
    "channel": "C",
    "matrix": "M,N",
    "matrix_t": "M,N",
    "batch_matrix": "B,M,N",
    "row": "N",
    "tensor": "D1[,D2[,D3,D4]]",
}
#: Kinds whose 4-D arrays take --layout (NCHW or NHWC memory); every other array is row-major.
LAYOUT_KINDS = ("image", "filter", "tensor")


def setting(var: str) -> str:
    """The value of FUSEKIT_* setting ``var`` as :func:`fusekit.config.describe` shows it."""
    return dict(config.describe())[var]


# ----------------------------------------------------------------------------------------------
# Errors: one line, no traceback; exit code 1, or 2 for bad options
# ----------------------------------------------------------------------------------------------
def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines too) made one space."""
    return " ".join(str(text).split())


class CliError(click.ClickException):
    """A one-line ``Error: ...`` message and exit code 1."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


class InputError(CliError):
    """A bad option value: one line (no usage text) and exit code 2, like click's own usage errors."""

    exit_code = 2


_NO_ARGS_IS_HELP: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2: shows help


class _OneLineUsage:
    """Mixin: option and argument errors fail on one line (no usage text), exit code 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)  # type: ignore[misc]
        except _NO_ARGS_IS_HELP:
            raise
        except click.UsageError as e:
            raise InputError(f"{e.format_message()} (see '{ctx.command_path} --help')") from None


class Command(_OneLineUsage, click.Command):
    """A command whose bad options fail on one line."""


class Group(_OneLineUsage, click.Group):
    """A group whose bad options, unknown subcommands and subcommands' bad options fail on one line."""

    command_class = Command
    group_class = type  # subgroups are of this class too

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:
            raise InputError(f"{e.format_message()} (see '{ctx.command_path} --help')") from None


def warn(message: str) -> None:
    """One ``Warning: ...`` line on stderr (the command goes on)."""
    click.echo(f"Warning: {one_line(message)}", err=True)


def _show_warning(show: Callable[..., Any]) -> Callable[..., Any]:
    """A ``warnings.showwarning`` that prints PatternWarnings as one ``Warning: ...`` line, others as ``show``."""

    def showwarning(message: Any, category: type, *args: Any, **kwargs: Any) -> None:
        if issubclass(category, PatternWarning):
            warn(str(message))
        else:
            show(message, category, *args, **kwargs)

    return showwarning


def friendly(f: F) -> F:
    """Turn fusekit's own errors raised inside a command into one-line click errors (exit code 1),
    and its pattern warnings (a missing $FUSEKIT_PATTERNS directory) into one-line warnings."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with warnings.catch_warnings():  # restores showwarning (and the filters, left as they are)
                warnings.showwarning = _show_warning(warnings.showwarning)
                return f(*args, **kwargs)
        except click.ClickException:
            raise
        except NoGPUError as e:
            raise CliError(f"no GPU: {e}") from None
        except FusekitError as e:
            raise CliError(str(e)) from None
        except PermissionError as e:  # an unprivileged user and a directory they cannot enter or write
            where = f" {e.filename}" if e.filename else ""
            raise CliError(f"permission denied:{where} ({e.strerror or e}); choose another --cache-dir or $FUSEKIT_CACHE_DIR") from None

    return wrapper  # type: ignore[return-value]


def failed(what: str, e: Exception) -> CliError:
    """A foreign exception (cuDNN's, a library's) as one line: ``WHAT failed: Type: message``."""
    return CliError(f"{what} failed: {type(e).__name__}: {e}")


# ----------------------------------------------------------------------------------------------
# Parsing and printing --shape and --attr values
# ----------------------------------------------------------------------------------------------
def _split_assignment(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    name, value = name.strip(), value.strip()
    if not sep or not name.isidentifier() or not value:
        raise ValueError("expected NAME=VALUE")
    return name, value


def parse_shape(text: str) -> tuple[str, Shape]:
    """``'x=2,8,16,16'`` -> ``('x', (2, 8, 16, 16))``; ValueError saying what is wrong."""
    name, value = _split_assignment(text)
    dims = []
    for part in value.replace("x", ",").split(","):
        part = part.strip()
        if not re.fullmatch(r"[0-9]+", part) or int(part) < 1:
            raise ValueError(f"dimension {part!r} is not a positive integer")
        dims.append(int(part))
    return name, tuple(dims)


def _scalar(text: str) -> Any:
    """true / false, an int, a float (ASCII digits only: Python's int() also reads other scripts' digits), else the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if re.fullmatch(r"[+-]?[0-9]+", text):
        return int(text)
    if re.fullmatch(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf|nan)", low):
        return float(text)
    return text


def parse_attr(text: str) -> tuple[str, Any]:
    """``'padding=1'`` -> ``('padding', 1)``; ``'padding=1,2'`` -> ``('padding', (1, 2))``."""
    name, value = _split_assignment(text)
    parts = [p.strip() for p in value.split(",")]
    if any(not p for p in parts):
        raise ValueError(f"empty value in {value!r}")
    values = [_scalar(p) for p in parts]
    return name, values[0] if len(values) == 1 else tuple(values)


def _assignments(parse: Callable[[str], tuple[str, Any]], example: str) -> Callable[[click.Context, click.Parameter, Sequence[str]], dict[str, Any]]:
    """A click callback that parses repeated NAME=VALUE options into a dict."""

    def callback(ctx: click.Context, param: click.Parameter, values: Sequence[str]) -> dict[str, Any]:
        opt = param.opts[0] if param.opts else str(param.name)
        out: dict[str, Any] = {}
        for text in values:
            try:
                name, value = parse(text)
            except ValueError as e:
                raise InputError(f"Invalid value for '{opt}': {text!r}: {e} (example: {opt} {example})") from None
            if name in out:
                raise InputError(f"Invalid value for '{opt}': {name!r} given twice")
            out[name] = value
        return out

    return callback


def fmt_value(value: Any) -> str:
    """A value the way ``--attr`` and ``--shape`` take it: ``(1, 1)`` -> ``1,1``, ``True`` -> ``true``."""
    if isinstance(value, (tuple, list)):
        return ",".join(fmt_value(v) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def fmt_attrs(attrs: Sequence[tuple[str, Any]], none: str = "-") -> str:
    """``padding=1,1 stride=2,2``; ``none`` when there are none."""
    return " ".join(f"{k}={fmt_value(v)}" for k, v in attrs) or none


def fmt_shape(shape: Sequence[int]) -> str:
    """``(2, 8, 16, 16)``."""
    return str(tuple(int(d) for d in shape))


def is_int(v: Any) -> bool:
    """An int, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


# ----------------------------------------------------------------------------------------------
# From options to patterns and specs
# ----------------------------------------------------------------------------------------------
def pattern_arg(name: str) -> Pattern:
    """Pattern ``name``, or CliError (one line) naming the known ones."""
    try:
        return get_pattern(name)
    except FusekitError as e:
        raise CliError(str(e)) from None


def shape_usage(pat: Pattern) -> str:
    """``--shape x=N,C,H,W --shape w=K,C,R,S ...`` for ``pat``'s operands."""
    return " ".join(f"--shape {o.name}={SHAPE_HINT.get(o.kind, 'D1,D2,...')}" for o in pat.operands)


def uses_layout(pat: Pattern, shapes: Mapping[str, Shape]) -> bool:
    """Whether --layout matters: some operand is a 4-D image, filter or tensor."""
    return any(len(shapes[o.name]) == 4 and o.kind in LAYOUT_KINDS for o in pat.operands)


def check_names(pat: Pattern, shapes: Mapping[str, Shape], required: bool) -> None:
    """InputError unless every --shape names an operand of ``pat`` (and, if ``required``, each has one)."""
    unknown = [n for n in shapes if n not in pat.operand_names]
    if unknown:
        raise InputError(
            f"Invalid value for '--shape': {', '.join(unknown)} is not an operand of {pat.name} "
            f"(operands: {', '.join(pat.operand_names)})"
        )
    missing = [n for n in pat.operand_names if n not in shapes]
    if required and missing:
        raise InputError(f"missing --shape for operand(s) {', '.join(missing)} of {pat.name}; give {shape_usage(pat)}")


def operand_specs(pat: Pattern, shapes: Mapping[str, Shape], dtype: str, layout: str) -> dict[str, TensorSpec]:
    """Checked specs (device 0) for every operand, as cuDNN sees it: a channel (C,) is (1, C, 1, 1)."""
    check_names(pat, shapes, required=True)
    return shape_specs(pat, shapes, dtype, layout)


def check_tune_input(pat: Pattern, shapes: Mapping[str, Shape], attrs: Mapping[str, Any], dtype: str, layout: str) -> dict[str, TensorSpec]:
    """Every check :func:`fusekit.autotune_shapes` (and ``fusekit.call``) makes before it needs a GPU:
    the operand and output specs (device 0), or OperandError naming the operand or attribute."""
    specs = shape_specs(pat, shapes, dtype, layout)
    specs.update(output_specs(pat, specs, pat.normalize_attrs(attrs)))
    return specs


# ----------------------------------------------------------------------------------------------
# Options several commands take
# ----------------------------------------------------------------------------------------------
def shape_option(f: F) -> F:
    """--shape NAME=D1,D2,... (repeatable) -> ``shapes: dict[str, Shape]``."""
    return click.option(
        "--shape",
        "shapes",
        multiple=True,
        metavar="NAME=D1,D2,...",
        callback=_assignments(parse_shape, "x=2,8,16,16"),
        help="Shape of one operand as its array is given (image N,C,H,W; filter K,C,R,S; channel C; "
        "matrix M,N; row N). Repeat per operand.",
    )(f)


def attr_option(f: F) -> F:
    """--attr NAME=VALUE (repeatable) -> ``attrs: dict[str, Any]``."""
    return click.option(
        "--attr",
        "attrs",
        multiple=True,
        metavar="NAME=VALUE",
        callback=_assignments(parse_attr, "padding=1"),
        help="Pattern attribute, e.g. padding=1 or stride=2,2. Repeatable.",
    )(f)


def dtype_layout_options(f: F) -> F:
    """--dtype and --layout -> ``dtype: str``, ``layout: str`` (upper case)."""
    f = click.option(
        "--layout",
        type=click.Choice(LAYOUTS, case_sensitive=False),
        default=DEFAULT_LAYOUT,
        show_default=True,
        callback=lambda ctx, param, v: v.upper(),
        help="Memory layout of 4-D operands (NHWC = channels-last); other arrays are row-major.",
    )(f)
    return click.option("--dtype", type=click.Choice(DTYPES), default=DEFAULT_DTYPE, show_default=True, help="Data type of every operand.")(f)


def cache_dir_option(f: F) -> F:
    """--cache-dir DIR -> ``cache_dir: Path | None``."""
    return click.option(
        "--cache-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Plan cache directory (default: $FUSEKIT_CACHE_DIR, else the user cache directory).",
    )(f)


# ----------------------------------------------------------------------------------------------
# The GPU
# ----------------------------------------------------------------------------------------------
def find_gpu() -> tuple[tuple[str, Any] | None, list[str]]:
    """((library, module) of the first library that sees a CUDA GPU, or None; why each did not)."""
    why = []
    try:
        import torch

        if torch.cuda.device_count() > 0:
            return ("torch", torch), why
        why.append(f"torch {torch.__version__} sees no CUDA GPU")
    except ImportError:
        why.append("torch is not installed")
    except Exception as e:  # noqa: BLE001
        why.append(f"torch cannot query GPUs ({type(e).__name__}: {e})")
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return ("cupy", cupy), why
        why.append("cupy sees no CUDA GPU")
    except ImportError:
        why.append("cupy is not installed")
    except Exception as e:  # noqa: BLE001
        why.append(f"cupy sees no CUDA GPU ({type(e).__name__}: {e})")
    return None, why


def require_gpu(command: str) -> tuple[str, Any]:
    """('torch' | 'cupy', module) of the first library that sees a CUDA GPU, with the cuDNN backend
    library loadable; else CliError ``fusekit COMMAND needs a CUDA GPU: <why>``."""
    found, why = find_gpu()
    if found is None:
        raise CliError(f"fusekit {command} needs a CUDA GPU: {'; '.join(why)} (`fusekit doctor` says more)")
    try:
        versions()
    except Exception as e:  # noqa: BLE001 - libcudnn missing or broken (NoGPUError or the frontend's own)
        raise CliError(f"fusekit {command} needs the cuDNN backend library: {e}; install fusekit[cu12] or fusekit[cu13]") from None
    return found


def device_props(lib: str, mod: Any, index: int) -> tuple[str, tuple[int, int], int]:
    """(name, compute capability, memory in bytes) of GPU ``index`` as PyTorch or CuPy reports it."""
    if lib == "torch":
        p = mod.cuda.get_device_properties(index)
        return str(p.name), (p.major, p.minor), int(p.total_memory)
    p = mod.cuda.runtime.getDeviceProperties(index)
    name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    return name, (p["major"], p["minor"]), int(p["totalGlobalMem"])


# ----------------------------------------------------------------------------------------------
# Output: rich tables, JSON, numbers
# ----------------------------------------------------------------------------------------------
#: Tables are printed at their natural width (wider than the terminal if need be, so no column is
#: squeezed away), up to this many columns.
MAX_TABLE_WIDTH = 250


def console() -> Any:
    """A rich console on stdout: no markup (user data may hold brackets), long lines left unwrapped."""
    from rich.console import Console

    return Console(markup=False, highlight=False, emoji=False, soft_wrap=True)


def emit(con: Any, renderable: Any = "", fit: bool = False) -> None:
    """Print through rich: tables at their natural width (``fit``: at most the console's width, its
    columns truncated or folded as they say); off a terminal without trailing blanks."""
    from rich.measure import Measurement
    from rich.table import Table

    prev = con.width
    if isinstance(renderable, Table) and not fit:
        natural = Measurement.get(con, con.options.update_width(MAX_TABLE_WIDTH), renderable).maximum
        con.width = max(prev, natural)
    try:
        kw = {"soft_wrap": False} if fit else {}  # soft wrapping would let the table overflow
        if con.is_terminal:
            con.print(renderable, **kw)
        else:
            with con.capture() as cap:
                con.print(renderable, **kw)
            con.file.write("".join(line.rstrip() + "\n" for line in cap.get().splitlines()))
            con.file.flush()
    finally:
        con.width = prev


def table(title: str | None, columns: Sequence[str], right: Sequence[str] = (), wrap: Sequence[str] = ()) -> Any:
    """A plain rich table; past MAX_TABLE_WIDTH the ``wrap`` columns wrap, the others fold."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left", overflow="fold", no_wrap=c not in wrap)
    return t


def text(value: Any, style: str = "") -> Any:
    """A rich Text cell (never parsed as markup)."""
    from rich.text import Text

    return Text(str(value), style=style)


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float as the string "inf", "-inf" or "nan" (strict JSON has no
    Infinity / NaN, which jq and other parsers refuse) and tuples as lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def pretty_json(obj: Any, width: int = 120) -> str:
    """Strict JSON (json_safe), one key a line, but any object or list that fits on its line
    (``width`` columns) inline."""
    return _pretty(json_safe(obj), 0, width, 0)


def _pretty(obj: Any, indent: int, width: int, lead: int) -> str:
    """pretty_json of a json_safe ``obj`` at ``indent``; ``lead``: columns taken on the first line
    before ``obj`` (its key) beyond the indentation."""
    flat = json.dumps(obj, default=str, allow_nan=False)
    if not isinstance(obj, (dict, list)) or not obj or 2 * indent + lead + len(flat) <= width:
        return flat
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            head = f"{json.dumps(str(k))}: "
            items.append(f"{inner}{head}{_pretty(v, indent + 1, width, len(head))}")
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    return "[\n" + ",\n".join(inner + _pretty(v, indent + 1, width, 0) for v in obj) + "\n" + pad + "]"


def fmt_bytes(n: Any) -> str:
    """``123456`` -> ``120.6 KiB``; ``-`` for anything but a count."""
    if not isinstance(n, (int, float)) or isinstance(n, bool) or n < 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # unreachable


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 plan``, ``2 plans``, ``2 entries`` (``many``)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


# ----------------------------------------------------------------------------------------------
# Tuning candidates (autotune results and tuned entries of the plan cache)
# ----------------------------------------------------------------------------------------------
def time_of(c: Mapping[str, Any]) -> float | None:
    """A candidate dict's time in us if it ran ("ok") and has a finite one, else None."""
    t = c.get("time_us")
    if c.get("verdict") != "ok" or not isinstance(t, (int, float)) or isinstance(t, bool) or not np.isfinite(t):
        return None
    return float(t)


def tuning_summary(cands: Sequence[Mapping[str, Any]], best: int | None = None) -> tuple[dict | None, dict | None]:
    """(best candidate, the heuristics' first plan) of a list of candidate dicts (``index``, ``name``,
    ``time_us``, ``workspace``, ``error``, ``verdict``); the first plan is the first that ran ("ok")."""
    ok = [c for c in sorted(cands, key=lambda c: c.get("index", 0)) if time_of(c) is not None]
    if not ok:
        return None, None
    chosen = next((c for c in ok if best is not None and c.get("index") == best), None)
    return chosen or min(ok, key=lambda c: time_of(c)), ok[0]  # type: ignore[arg-type, return-value]


def candidate_table(cands: Sequence[Mapping[str, Any]], title: str | None = None, best: int | None = None) -> Any:
    """A rich table of tuning candidates: timed ones fastest first, then the others in plan order."""
    best_c, first = tuning_summary(cands, best)
    best_t = time_of(best_c) if best_c else None
    timed = sorted((c for c in cands if time_of(c) is not None), key=lambda c: time_of(c))  # type: ignore[arg-type, return-value]
    rest = sorted((c for c in cands if time_of(c) is None), key=lambda c: c.get("index", 0))
    t = table(title, ["#", "candidate", "time (us)", "vs best", "workspace", "rel. diff", "verdict", "mark"], right=("#", "time (us)", "vs best", "workspace", "rel. diff"), wrap=("verdict",))
    for c in timed + rest:
        tm = time_of(c)
        marks = [m for m, hit in (("best", c is best_c), ("heuristic", c is first)) if hit]
        err = c.get("error")
        style = "bold green" if c is best_c else ("" if tm is not None else "dim")
        t.add_row(
            text(c.get("index", "-"), style),
            text(c.get("name", c.get("engine", "?")), style),
            text(f"{tm:.2f}" if tm is not None else "-", style),
            text(f"{tm / best_t:.2f}x" if tm is not None and best_t else "-", style),
            text(fmt_bytes(c.get("workspace")), style),
            text(f"{err:.1e}" if isinstance(err, (int, float)) and not isinstance(err, bool) else "-", style),
            text(c.get("verdict", "-"), style),
            text(" + ".join(marks) or "", style),
        )
    return t


def speedup_line(best_name: Any, best_us: float, first_us: float, speedup: float) -> str:
    """``best NAME: 8.00 us vs 20.00 us for the heuristics' first plan: 2.50x speed-up``."""
    return f"best {best_name}: {best_us:.2f} us vs {first_us:.2f} us for the heuristics' first plan: {speedup:.2f}x speed-up"
