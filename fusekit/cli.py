"""The ``fusekit`` command line: list and inspect patterns, run the NumPy oracle, check the machine,
and run a fused pattern on the GPU.

Every command either works or stops with one ``Error: ...`` line (exit code 1, or 2 for bad
options); ``patterns``, ``oracle`` and ``doctor`` need no GPU.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import platform
import re
import statistics
import sys
from typing import Any, Callable, Mapping, Sequence, TypeVar

import click
import numpy as np

import fusekit
from fusekit import oracle
from fusekit.errors import FusekitError, NoGPUError
from fusekit.ops import output_specs
from fusekit.patterns import Pattern, get_pattern, list_patterns, pattern_dirs
from fusekit.runtime import versions
from fusekit.tensors import TensorSpec, make_spec, nchw_strides, nhwc_strides, row_strides

F = TypeVar("F", bound=Callable[..., Any])
Shape = tuple[int, ...]

DTYPES = ("float16", "bfloat16", "float32")
LAYOUTS = ("NHWC", "NCHW")
#: Normwise relative error allowed against the float64 oracle (as the GPU tests): fp16 / bf16 round
#: the output once; fp32 may run on TF32 tensor cores.
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 2e-3}
#: How --shape gives each operand kind (the user's view; see fusekit.patterns.KINDS).
SHAPE_HINT = {
    "image": "N,C,H,W",
    "filter": "K,C,R,S",
    "channel": "C",
    "matrix": "M,N",
    "matrix_t": "M,N",
    "row": "N",
    "tensor": "D1[,D2[,D3,D4]]",
}
#: Kinds whose 4-D arrays take --layout (NCHW or NHWC memory); every other array is row-major.
LAYOUT_KINDS = ("image", "filter", "tensor")


# ----------------------------------------------------------------------------------------------
# Errors: one line, no traceback
# ----------------------------------------------------------------------------------------------
def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class CliError(click.ClickException):
    """A one-line ``Error: ...`` message and exit code 1."""

    def __init__(self, message: str) -> None:
        super().__init__(_one_line(message))


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


def _friendly(f: F) -> F:
    """Turn fusekit's own errors raised inside a command into one-line click errors."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except click.ClickException:
            raise
        except NoGPUError as e:
            raise CliError(f"no GPU: {e}") from None
        except FusekitError as e:
            raise CliError(str(e)) from None

    return wrapper  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
# Parsing --shape and --attr
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
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
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


def _fmt(value: Any) -> str:
    """An attribute value the way ``--attr`` takes it: ``(1, 1)`` -> ``1,1``."""
    if isinstance(value, (tuple, list)):
        return ",".join(_fmt(v) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _fmt_attrs(attrs: Sequence[tuple[str, Any]], none: str = "-") -> str:
    return " ".join(f"{k}={_fmt(v)}" for k, v in attrs) or none


def to_json(obj: Any, indent: int = 0) -> str:
    """JSON with objects one key a line and lists of scalars kept on one line."""
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(str(k))}: {to_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in obj):
        return "[\n" + ",\n".join(inner + to_json(v, indent + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(list(obj) if isinstance(obj, tuple) else obj, default=str)


def _fmt_shape(shape: Sequence[int]) -> str:
    return str(tuple(int(d) for d in shape))


# ----------------------------------------------------------------------------------------------
# From options to specs
# ----------------------------------------------------------------------------------------------
def _pattern(name: str) -> Pattern:
    try:
        return get_pattern(name)
    except FusekitError as e:
        raise CliError(str(e)) from None


def _shape_usage(pat: Pattern) -> str:
    return " ".join(f"--shape {o.name}={SHAPE_HINT.get(o.kind, 'D1,D2,...')}" for o in pat.operands)


def _uses_layout(pat: Pattern, shapes: Mapping[str, Shape]) -> bool:
    """Whether --layout matters: some operand is a 4-D image, filter or tensor."""
    return any(len(shapes[o.name]) == 4 and o.kind in LAYOUT_KINDS for o in pat.operands)


def _check_names(pat: Pattern, shapes: Mapping[str, Shape], required: bool) -> None:
    unknown = [n for n in shapes if n not in pat.operand_names]
    if unknown:
        raise InputError(
            f"Invalid value for '--shape': {', '.join(unknown)} is not an operand of {pat.name} "
            f"(operands: {', '.join(pat.operand_names)})"
        )
    missing = [n for n in pat.operand_names if n not in shapes]
    if required and missing:
        raise InputError(f"missing --shape for operand(s) {', '.join(missing)} of {pat.name}; give {_shape_usage(pat)}")


def _strides(shape: Shape, kind: str, layout: str) -> Shape:
    """Strides (in elements) of a dense array of ``shape`` as ``fusekit run`` makes it."""
    if len(shape) == 4 and kind in LAYOUT_KINDS:
        return nhwc_strides(shape) if layout == "NHWC" else nchw_strides(shape)
    return row_strides(shape)


def operand_specs(pat: Pattern, shapes: Mapping[str, Shape], dtype: str, layout: str) -> dict[str, TensorSpec]:
    """Checked specs (device 0) for every operand, as cuDNN sees it: a channel (C,) is (1, C, 1, 1)."""
    _check_names(pat, shapes, required=True)
    return {
        o.name: make_spec(pat.name, o.name, o.kind, shapes[o.name], _strides(shapes[o.name], o.kind, layout), dtype, 0)
        for o in pat.operands
    }


def lower_graph(pat: Pattern, specs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> tuple[dict[str, TensorSpec], Any]:
    """(output specs, the cuDNN graph's ``inspect()`` as JSON data); needs the cuDNN frontend, not a GPU."""
    from fusekit.lower import lower

    norm = pat.normalize_attrs(attrs)
    outs = output_specs(pat, specs, norm)
    try:
        lowered = lower(pat, {**specs, **outs}, dict(norm))
        graph = lowered.graph.inspect()
    except FusekitError:
        raise
    except Exception as e:  # noqa: BLE001 - the frontend's own errors, reported on one line
        raise CliError(f"lowering {pat.name} failed: {type(e).__name__}: {e}") from None
    if isinstance(graph, (str, bytes)):
        graph = json.loads(graph)
    return outs, graph


# ----------------------------------------------------------------------------------------------
# Shared options
# ----------------------------------------------------------------------------------------------
def _shape_option(f: F) -> F:
    return click.option(
        "--shape",
        "shapes",
        multiple=True,
        metavar="NAME=D1,D2,...",
        callback=_assignments(parse_shape, "x=2,8,16,16"),
        help="Shape of one operand as its array is given (image N,C,H,W; filter K,C,R,S; channel C; "
        "matrix M,N; row N). Repeat per operand.",
    )(f)


def _attr_option(f: F) -> F:
    return click.option(
        "--attr",
        "attrs",
        multiple=True,
        metavar="NAME=VALUE",
        callback=_assignments(parse_attr, "padding=1"),
        help="Pattern attribute, e.g. padding=1 or stride=2,2. Repeatable.",
    )(f)


def _dtype_layout_options(f: F) -> F:
    f = click.option(
        "--layout",
        type=click.Choice(LAYOUTS, case_sensitive=False),
        default="NHWC",
        show_default=True,
        callback=lambda ctx, param, v: v.upper(),
        help="Memory layout of 4-D operands (NHWC = channels-last); other arrays are row-major.",
    )(f)
    return click.option("--dtype", type=click.Choice(DTYPES), default="float16", show_default=True, help="Data type of every operand.")(f)


# ----------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------
@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(fusekit.__version__, prog_name="fusekit")
def main() -> None:
    """fusekit: fused NN layers as cuDNN frontend graphs, described by pattern files."""


@main.group()
def patterns() -> None:
    """List and inspect pattern files."""


@patterns.command("ls")
@_friendly
def patterns_ls() -> None:
    """Table of every pattern: operands, attributes with defaults, summary."""
    rows = [("NAME", "OPERANDS", "ATTRS (defaults)", "SUMMARY")]
    for name in list_patterns():
        try:
            pat = get_pattern(name)
        except FusekitError as e:
            rows.append((name, "-", "-", f"INVALID: {_one_line(str(e))}"))
            continue
        operands = " ".join(f"{o.name}:{o.kind}" for o in pat.operands)
        rows.append((pat.name, operands, _fmt_attrs([(a.name, a.default) for a in pat.attrs]), pat.summary))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
    if len(rows) == 1:
        click.echo("(no patterns found)")
    click.echo(f"\npatterns from: {os.pathsep.join(str(d) for d in pattern_dirs()) or '(no directory)'}")


@patterns.command("show")
@click.argument("name")
@_shape_option
@_dtype_layout_options
@_attr_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of the TOML text.")
@_friendly
def patterns_show(name: str, shapes: dict[str, Shape], dtype: str, layout: str, attrs: dict[str, Any], as_json: bool) -> None:
    """Print pattern NAME's file (and its cuDNN graph, given shapes).

    With a --shape for every operand the pattern is also lowered to a cuDNN frontend graph (no GPU
    needed) and the graph's inspect() is printed as JSON.
    """
    pat = _pattern(name)
    _check_names(pat, shapes, required=bool(shapes))
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
        click.echo(to_json(doc))
        return
    click.echo(f"# {pat.source}")
    click.echo(pat.text.rstrip("\n"))
    if graph is not None and outs is not None:
        norm = pat.normalize_attrs(attrs)
        ins = ", ".join(f"{k}={_fmt_shape(v.view or v.shape)}" for k, v in specs.items())
        res = ", ".join(f"{k}={_fmt_shape(v.view or v.shape)}" for k, v in outs.items())
        lay = f" {layout}" if _uses_layout(pat, shapes) else ""
        click.echo(f"\n# cuDNN graph: {ins} -> {res}; {dtype}{lay}; {_fmt_attrs(norm, 'no attributes')}")
        click.echo(to_json(graph))


@main.command("oracle")
@click.argument("name")
@_shape_option
@_attr_option
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the standard-normal random inputs.")
@_friendly
def oracle_cmd(name: str, shapes: dict[str, Shape], attrs: dict[str, Any], seed: int) -> None:
    """Run pattern NAME's float64 NumPy oracle on random inputs.

    Prints each output's shape, min, max, mean, std and share of zeros. Needs no GPU.
    """
    pat = _pattern(name)
    operand_specs(pat, shapes, "float32", "NCHW")  # the same operand checks as the GPU path
    norm = pat.normalize_attrs(attrs)
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(shapes[o.name]) for o in pat.operands]
    results = oracle.evaluate(pat, *inputs, **attrs)
    click.echo(f"{pat.name} (NumPy float64 oracle), seed {seed}, {_fmt_attrs(norm, 'no attributes')}")
    for o in pat.operands:
        click.echo(f"  in  {o.name}: {_fmt_shape(shapes[o.name])} standard normal")
    for out_name, y in zip(pat.outputs, results):
        zeros = float(np.mean(y == 0.0)) * 100
        click.echo(
            f"  out {out_name}: {_fmt_shape(y.shape)} min {y.min():.4g} max {y.max():.4g} "
            f"mean {y.mean():.4g} std {y.std():.4g} zeros {zeros:.1f}%"
        )


# ----------------------------------------------------------------------------------------------
# doctor
# ----------------------------------------------------------------------------------------------
def _probe(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - doctor reports, never crashes
        return f"unavailable ({type(e).__name__}: {_one_line(str(e)) or 'no message'})"


def _driver() -> str:
    parts = []
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", fh.read())
        if m:
            parts.append(f"NVIDIA {m.group(1)}")
    except OSError:
        pass
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value:
            parts.append(f"CUDA {v.value // 1000}.{v.value % 1000 // 10} (libcuda)")
    except OSError:
        pass
    return ", ".join(parts) if parts else "none found (no /proc/driver/nvidia/version, libcuda.so.1 not loadable)"


def _cache_info() -> str:
    """Where the default plan cache keeps plans on disk and how it picks them (creates nothing)."""
    from fusekit.cache import default_cache_dir

    mode = os.environ.get("FUSEKIT_MODE", "heuristic")
    if os.environ.get("FUSEKIT_CACHE_DIR", "").lower() in ("off", "none", "0"):
        return f"in memory only (FUSEKIT_CACHE_DIR={os.environ['FUSEKIT_CACHE_DIR']}), mode {mode}"
    d = default_cache_dir()
    plans = d / "plans"
    n = sum(1 for _ in plans.glob("*/*.plan")) if plans.is_dir() else 0
    return f"memory + disk at {d} ({n} stored plan(s)), mode {mode}"


def _torch_info() -> tuple[str, list[str]]:
    import torch

    count = torch.cuda.device_count()
    cuda = torch.version.cuda or "none (CPU-only build)"
    devices = []
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        devices.append(f"{p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB")
    return f"{torch.__version__} (CUDA {cuda}), sees {count} GPU(s)", devices


def _cupy_info() -> tuple[str, list[str]]:
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError without a driver
        return f"{cupy.__version__}, sees no GPU ({_one_line(str(e))})", []
    devices = []
    for i in range(count):
        p = cupy.cuda.runtime.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        devices.append(f"{name}, compute capability {p['major']}.{p['minor']}, {p['totalGlobalMem'] / 2**30:.1f} GiB")
    return f"{cupy.__version__}, sees {count} GPU(s)", devices


@main.command()
def doctor() -> None:
    """Report versions, GPUs and driver; exits 0 with or without a GPU.

    Lists Python, fusekit, the cuDNN frontend and backend, PyTorch and CuPy (and whether they see a
    GPU), each GPU's name and compute capability, and the NVIDIA driver.
    """
    rows: list[tuple[str, str]] = []
    rows.append(("python", f"{platform.python_version()} ({sys.executable})"))
    rows.append(("platform", platform.platform()))
    rows.append(("fusekit", f"{fusekit.__version__} ({os.path.dirname(os.path.abspath(fusekit.__file__))})"))
    rows.append(("patterns", _probe(lambda: f"{', '.join(list_patterns()) or 'none'} from {os.pathsep.join(map(str, pattern_dirs()))}")))
    rows.append(("numpy", np.__version__))

    frontend_ok = backend_ok = False
    cudnn: Any = None
    try:
        import cudnn as cudnn_mod

        cudnn = cudnn_mod
        frontend_ok = True
        rows.append(("cuDNN frontend", str(getattr(cudnn, "__version__", "?"))))
    except Exception as e:  # noqa: BLE001
        rows.append(("cuDNN frontend", f"not importable ({type(e).__name__}: {_one_line(str(e))})"))
    backend = "not checked (no frontend)"
    if frontend_ok:
        try:
            ver = cudnn.backend_version()
            try:
                ver = f"{cudnn.backend_version_string()} ({ver})"
            except Exception:  # noqa: BLE001
                pass
            backend, backend_ok = str(ver), True
        except Exception as e:  # noqa: BLE001
            backend = f"not loadable ({_one_line(str(e))}); install fusekit[cu12] or fusekit[cu13] on a GPU machine"
    rows.append(("cuDNN backend", backend))

    gpus: list[str] = []
    libs_with_gpu: list[str] = []
    for lib, info in (("torch", _torch_info), ("cupy", _cupy_info)):
        try:
            text, devs = info()
        except ImportError as e:
            text, devs = f"not installed ({_one_line(str(e))})", []
        except Exception as e:  # noqa: BLE001
            text, devs = f"unavailable ({type(e).__name__}: {_one_line(str(e))})", []
        rows.append((lib, text))
        if devs:
            libs_with_gpu.append(lib)
            gpus = gpus or devs
    for i, d in enumerate(gpus):
        rows.append((f"gpu {i}", d))
    if not gpus:
        rows.append(("gpu", "none seen by torch or cupy"))
    rows.append(("driver", _probe(_driver)))
    rows.append(("plan cache", _probe(_cache_info)))
    for var, unset in (
        ("FUSEKIT_PATTERNS", "(unset)"),
        ("FUSEKIT_CACHE_DIR", "(unset)"),
        ("FUSEKIT_CACHE_SIZE", "(unset: 512)"),
        ("FUSEKIT_MODE", "(unset: heuristic)"),
    ):
        rows.append((var, os.environ.get(var, unset)))

    if frontend_ok and backend_ok and libs_with_gpu:
        verdict = f"ready: `fusekit run` and the GPU tests can run (through {libs_with_gpu[0]})"
    else:
        why = []
        if not libs_with_gpu:
            why.append("no GPU seen by torch or cupy")
        if not frontend_ok:
            why.append("cuDNN frontend not importable")
        elif not backend_ok:
            why.append("cuDNN backend library not loadable")
        verdict = f"no GPU path ({'; '.join(why)}); patterns, oracle and graph lowering still work"
    rows.append(("status", verdict))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k.ljust(width)}  {v}")


# ----------------------------------------------------------------------------------------------
# run
# ----------------------------------------------------------------------------------------------
_SOURCE = {"built": "built (heuristics)", "tuned": "autotuned", "disk": "loaded from the disk cache"}


def _gpu_library() -> tuple[str, Any]:
    """('torch' | 'cupy', module) of the first library that sees a CUDA GPU; CliError saying why none."""
    why = []
    try:
        import torch

        n = torch.cuda.device_count()
        if n > 0:
            return "torch", torch
        why.append(f"torch {torch.__version__} sees no CUDA GPU")
    except ImportError:
        why.append("torch is not installed")
    except Exception as e:  # noqa: BLE001
        why.append(f"torch cannot query GPUs ({type(e).__name__}: {e})")
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        if n > 0:
            return "cupy", cupy
        why.append("cupy sees no CUDA GPU")
    except ImportError:
        why.append("cupy is not installed")
    except Exception as e:  # noqa: BLE001
        why.append(f"cupy sees no CUDA GPU ({type(e).__name__}: {e})")
    raise CliError(f"no GPU: `fusekit run` needs a CUDA GPU ({'; '.join(why)}); `fusekit doctor` says more")


def _to_device(lib: str, mod: Any, data: np.ndarray, dtype: str, layout: str, kind: str) -> tuple[Any, np.ndarray]:
    """(device array in ``dtype`` and ``layout``, its exact values as float64 on the host)."""
    nhwc = layout == "NHWC" and data.ndim == 4 and kind in LAYOUT_KINDS
    if lib == "torch":
        t = mod.from_numpy(data.astype(np.float32)).to("cuda").to(getattr(mod, dtype))
        if nhwc:
            t = t.contiguous(memory_format=mod.channels_last)
        return t, t.double().cpu().numpy()
    if dtype == "bfloat16":
        raise CliError("bfloat16 needs PyTorch (CuPy has no bfloat16 arrays); install fusekit[torch] or use --dtype float16")
    a = mod.asarray(data.astype(dtype))
    if nhwc:
        a = fusekit.nhwc(mod.ascontiguousarray(a.transpose(0, 2, 3, 1)))
    return a, mod.asnumpy(a).astype(np.float64)


def _to_host(lib: str, mod: Any, a: Any) -> np.ndarray:
    if lib == "torch":
        return a.detach().double().cpu().numpy()
    return mod.asnumpy(a).astype(np.float64)


def _timed_ms(lib: str, mod: Any, fn: Callable[[], Any], warmup: int, repeat: int) -> list[float]:
    """Per-call times in ms from CUDA events on the current stream, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    if lib == "torch":
        pairs = [(mod.cuda.Event(enable_timing=True), mod.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    else:
        pairs = [(mod.cuda.Event(), mod.cuda.Event()) for _ in range(repeat)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    if lib == "torch":
        mod.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in pairs]
    pairs[-1][1].synchronize()
    return [mod.cuda.get_elapsed_time(s, e) for s, e in pairs]


@main.command("run")
@click.argument("name")
@_shape_option
@_dtype_layout_options
@_attr_option
@click.option("--repeat", type=click.IntRange(min=1), default=100, show_default=True, help="Timed calls.")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True, help="Untimed calls first.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the standard-normal random inputs.")
@_friendly
def run_cmd(
    name: str, shapes: dict[str, Shape], dtype: str, layout: str, attrs: dict[str, Any], repeat: int, warmup: int, seed: int
) -> None:
    """Run pattern NAME on the GPU, check it, and time it.

    Random inputs go through fusekit.call (PyTorch if it sees a GPU, else CuPy); the result is
    compared with the float64 oracle, then the plan's engine and workspace and the median time
    per call (CUDA events, after warm-up) are printed. Without a GPU it stops with one line.
    """
    pat = _pattern(name)
    specs = operand_specs(pat, shapes, dtype, layout)  # bad input fails the same way with or without a GPU
    norm = pat.normalize_attrs(attrs)
    output_specs(pat, specs, norm)  # shape checks (channels, spatial size) before any GPU work
    lib, mod = _gpu_library()
    try:
        versions()
    except FusekitError:
        raise
    except Exception as e:  # noqa: BLE001 - libcudnn missing or broken
        raise CliError(f"the cuDNN backend library cannot be loaded ({e}); install fusekit[cu12] or fusekit[cu13]") from None

    rng = np.random.default_rng(seed)
    operands, host = [], []
    for o in pat.operands:
        a, h = _to_device(lib, mod, rng.standard_normal(shapes[o.name]), dtype, layout, o.kind)
        operands.append(a)
        host.append(h)
    refs = oracle.evaluate(pat, *host, **attrs)

    try:
        result = fusekit.call(pat, *operands, **attrs)
        plan = fusekit.plan_for(pat, *operands, **attrs)
    except FusekitError:
        raise
    except Exception as e:  # noqa: BLE001 - a cuDNN execute failure, on one line
        raise CliError(f"running {pat.name} failed: {type(e).__name__}: {e}") from None
    outs = result if isinstance(result, tuple) else (result,)
    device = _gpu_name(lib, mod)

    ins = " ".join(f"{k}={_fmt_shape(shapes[k])}" for k in specs)
    lay = f" {layout}" if _uses_layout(pat, shapes) else ""
    click.echo(f"{pat.name} on {device} via {lib}: {dtype}{lay}, {ins}, {_fmt_attrs(norm, 'no attributes')}, seed {seed}")
    click.echo(
        f"plan: engine {plan.engine}, workspace {plan.workspace_size} bytes, "
        f"{plan.candidates} candidate plan(s), {_SOURCE.get(plan.source, plan.source)} in {plan.build_ms:.1f} ms"
    )
    tol = TOLERANCE[dtype]
    bad = []
    for out_name, y, ref in zip(pat.outputs, outs, refs):
        yh = _to_host(lib, mod, y)
        err = float(np.linalg.norm(yh - ref) / max(float(np.linalg.norm(ref)), 1e-30))
        finite = bool(np.isfinite(yh).all())
        ok = finite and err <= tol
        click.echo(
            f"check {out_name}: shape {_fmt_shape(yh.shape)}, relative error {err:.2e} vs float64 oracle "
            f"(tolerance {tol:.0e}){'' if finite else ', NON-FINITE values'}: {'ok' if ok else 'FAIL'}"
        )
        if not ok:
            bad.append(f"{out_name}: relative error {err:.2e} > {tol:.0e}" if finite else f"{out_name}: non-finite values")
    if bad:
        raise CliError(f"{pat.name} does not match the oracle ({'; '.join(bad)})")

    times = _timed_ms(lib, mod, lambda: fusekit.call(pat, *operands, out=outs, **attrs), warmup, repeat)
    med = statistics.median(times)
    click.echo(
        f"time: median {med * 1e3:.1f} us per call (min {min(times) * 1e3:.1f} us) over {repeat} calls, "
        f"CUDA events, after {warmup} warm-up calls"
    )


def _gpu_name(lib: str, mod: Any) -> str:
    try:
        if lib == "torch":
            i = mod.cuda.current_device()
            p = mod.cuda.get_device_properties(i)
            return f"cuda:{i} {p.name} (sm_{p.major}{p.minor})"
        i = mod.cuda.Device().id
        p = mod.cuda.runtime.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        return f"cuda:{i} {name} (sm_{p['major']}{p['minor']})"
    except Exception:  # noqa: BLE001 - informative only
        return "the GPU"


if __name__ == "__main__":
    main(prog_name="fusekit")
