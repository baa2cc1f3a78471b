"""The ``fusekit`` command line: list and inspect patterns, run the NumPy oracle, check the machine,
run, autotune and benchmark a fused pattern on the GPU, and manage the on-disk plan cache.

Every command either works or stops with one ``Error: ...`` line (exit code 1, or 2 for bad
options); ``patterns``, ``oracle``, ``doctor`` and ``cache`` need no GPU, and ``run``, ``autotune``
and ``bench`` check their input (shapes, attributes, spec files) before they look for one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import os
import platform
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import click
import numpy as np

import fusekit
from fusekit.engine import oracle
from fusekit.errors import FusekitError, NoGPUError, OperandError
from fusekit.engine.keys import output_specs, shape_specs
from fusekit.engine.patterns import Pattern, get_pattern, list_patterns, pattern_dirs
from fusekit.engine.runtime import versions
from fusekit.tensors import TensorSpec

F = TypeVar("F", bound=Callable[..., Any])
Shape = tuple[int, ...]

DTYPES = ("float16", "bfloat16", "float32")
LAYOUTS = ("NHWC", "NCHW")
#: Normwise relative error allowed against the float64 oracle (as the GPU tests): fp16 / bf16 round
#: the output once; fp32 may run on TF32 tensor cores.
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 2e-3}
#: How --shape gives each operand kind (the user's view; see fusekit.engine.patterns.KINDS).
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


def operand_specs(pat: Pattern, shapes: Mapping[str, Shape], dtype: str, layout: str) -> dict[str, TensorSpec]:
    """Checked specs (device 0) for every operand, as cuDNN sees it: a channel (C,) is (1, C, 1, 1)."""
    _check_names(pat, shapes, required=True)
    return shape_specs(pat, shapes, dtype, layout)


def lower_graph(pat: Pattern, specs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> tuple[dict[str, TensorSpec], Any]:
    """(output specs, the cuDNN graph's ``inspect()`` as JSON data); needs the cuDNN frontend, not a GPU."""
    from fusekit.engine.lower import lower

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
    from fusekit.engine.cache import default_cache_dir

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


def _find_gpu() -> tuple[tuple[str, Any] | None, list[str]]:
    """((library, module) of the first library that sees a CUDA GPU, or None; why each did not)."""
    why = []
    try:
        import torch

        n = torch.cuda.device_count()
        if n > 0:
            return ("torch", torch), why
        why.append(f"torch {torch.__version__} sees no CUDA GPU")
    except ImportError:
        why.append("torch is not installed")
    except Exception as e:  # noqa: BLE001
        why.append(f"torch cannot query GPUs ({type(e).__name__}: {e})")
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        if n > 0:
            return ("cupy", cupy), why
        why.append("cupy sees no CUDA GPU")
    except ImportError:
        why.append("cupy is not installed")
    except Exception as e:  # noqa: BLE001
        why.append(f"cupy sees no CUDA GPU ({type(e).__name__}: {e})")
    return None, why


def _gpu_library() -> tuple[str, Any]:
    """('torch' | 'cupy', module) of the first library that sees a CUDA GPU; CliError saying why none."""
    found, why = _find_gpu()
    if found is None:
        raise CliError(f"no GPU: `fusekit run` needs a CUDA GPU ({'; '.join(why)}); `fusekit doctor` says more")
    return found


def _require_gpu(command: str) -> tuple[str, Any]:
    """Like :func:`_gpu_library` for ``fusekit COMMAND``, and the cuDNN backend library loadable.

    Fails with one line: ``fusekit COMMAND needs a CUDA GPU: <why>``.
    """
    found, why = _find_gpu()
    if found is None:
        raise CliError(f"fusekit {command} needs a CUDA GPU: {'; '.join(why)} (`fusekit doctor` says more)")
    try:
        versions()
    except Exception as e:  # noqa: BLE001 - libcudnn missing or broken (NoGPUError or the frontend's own)
        raise CliError(f"fusekit {command} needs the cuDNN backend library: {e}") from None
    return found


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
        a, h = _to_device(lib, mod, rng.standard_normal(shapes[o.name]), o.dtype or dtype, layout, o.kind)
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


# ----------------------------------------------------------------------------------------------
# rich output
# ----------------------------------------------------------------------------------------------
def _console() -> Any:
    """A rich console on stdout: no markup (user data may hold brackets), long lines left unwrapped."""
    from rich.console import Console

    return Console(markup=False, highlight=False, emoji=False, soft_wrap=True)


#: Tables are printed at their natural width (wider than the terminal if need be, so no column is
#: squeezed away), up to this many columns.
MAX_TABLE_WIDTH = 250


def _emit(console: Any, renderable: Any = "") -> None:
    """Print through rich: tables at their natural width; off a terminal without trailing blanks."""
    from rich.measure import Measurement
    from rich.table import Table

    prev = console.width
    if isinstance(renderable, Table):
        natural = Measurement.get(console, console.options.update_width(MAX_TABLE_WIDTH), renderable).maximum
        console.width = max(prev, natural)
    try:
        if console.is_terminal:
            console.print(renderable)
        else:
            with console.capture() as cap:
                console.print(renderable)
            console.file.write("".join(line.rstrip() + "\n" for line in cap.get().splitlines()))
            console.file.flush()
    finally:
        console.width = prev


def pretty_json(obj: Any, indent: int = 0, width: int = 120, lead: int = 0) -> str:
    """JSON one key a line, but any object or list that fits on its line (``width`` columns) inline.

    ``lead``: columns taken on the first line before ``obj`` (its key) beyond the indentation.
    """
    flat = json.dumps(list(obj) if isinstance(obj, tuple) else obj, default=str)
    if not isinstance(obj, (dict, list, tuple)) or not obj or 2 * indent + lead + len(flat) <= width:
        return flat
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            head = f"{json.dumps(str(k))}: "
            items.append(f"{inner}{head}{pretty_json(v, indent + 1, width, len(head))}")
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    return "[\n" + ",\n".join(inner + pretty_json(v, indent + 1, width) for v in obj) + "\n" + pad + "]"


def _table(title: str | None, columns: Sequence[str], right: Sequence[str] = (), wrap: Sequence[str] = ()) -> Any:
    """A plain rich table; past MAX_TABLE_WIDTH the ``wrap`` columns wrap, the others fold."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left", overflow="fold", no_wrap=c not in wrap)
    return t


def _text(value: Any, style: str = "") -> Any:
    from rich.text import Text

    return Text(str(value), style=style)


def _fmt_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)) or isinstance(n, bool) or n < 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # unreachable


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"


# ----------------------------------------------------------------------------------------------
# Candidate tables and plots (autotune results and stored tuning data)
# ----------------------------------------------------------------------------------------------
def _time_of(c: Mapping[str, Any]) -> float | None:
    t = c.get("time_us")
    if c.get("verdict") != "ok" or not isinstance(t, (int, float)) or isinstance(t, bool) or not np.isfinite(t):
        return None
    return float(t)


def tuning_summary(cands: Sequence[Mapping[str, Any]], best: int | None = None) -> tuple[dict | None, dict | None]:
    """(best candidate, the heuristics' first plan) of a list of candidate dicts (``index``, ``name``,
    ``time_us``, ``workspace``, ``error``, ``verdict``); the first plan is the first that ran ("ok")."""
    ok = [c for c in sorted(cands, key=lambda c: c.get("index", 0)) if _time_of(c) is not None]
    if not ok:
        return None, None
    chosen = next((c for c in ok if best is not None and c.get("index") == best), None)
    return chosen or min(ok, key=lambda c: _time_of(c)), ok[0]  # type: ignore[arg-type, return-value]


def candidate_table(cands: Sequence[Mapping[str, Any]], title: str | None = None, best: int | None = None) -> Any:
    """A rich table of tuning candidates: timed ones fastest first, then the others in plan order."""
    best_c, first = tuning_summary(cands, best)
    best_t = _time_of(best_c) if best_c else None
    timed = sorted((c for c in cands if _time_of(c) is not None), key=lambda c: _time_of(c))  # type: ignore[arg-type, return-value]
    rest = sorted((c for c in cands if _time_of(c) is None), key=lambda c: c.get("index", 0))
    t = _table(title, ["#", "candidate", "time (us)", "vs best", "workspace", "rel. diff", "verdict", "mark"], right=("#", "time (us)", "vs best", "workspace", "rel. diff"), wrap=("verdict",))
    for c in timed + rest:
        tm = _time_of(c)
        marks = [m for m, hit in (("best", c is best_c), ("heuristic", c is first)) if hit]
        err = c.get("error")
        style = "bold green" if c is best_c else ("" if tm is not None else "dim")
        t.add_row(
            _text(c.get("index", "-"), style),
            _text(c.get("name", c.get("engine", "?")), style),
            _text(f"{tm:.2f}" if tm is not None else "-", style),
            _text(f"{tm / best_t:.2f}x" if tm is not None and best_t else "-", style),
            _text(_fmt_bytes(c.get("workspace")), style),
            _text(f"{err:.1e}" if isinstance(err, (int, float)) and not isinstance(err, bool) else "-", style),
            _text(c.get("verdict", "-"), style),
            _text(" + ".join(marks) or "", style),
        )
    return t


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
        times = [t for t in (_time_of(c) for c in cands) if t is not None]
        best, first = tuning_summary(cands)
        if not times or best is None or first is None:
            continue
        ax.scatter(i + rng.uniform(-0.2, 0.2, len(times)), times, s=16, color="0.55", alpha=0.75, label=once("candidate plan"))
        ax.scatter([i], [_time_of(first)], marker="D", s=70, facecolors="none", edgecolors="tab:blue", linewidths=1.5, zorder=3, label=once("heuristics' first plan"))
        bt = _time_of(best)
        ax.scatter([i], [bt], marker="*", s=200, color="tab:red", zorder=4, label=once("best (kept)"))
        speedup = (_time_of(first) or 0) / bt if bt else float("nan")
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
    dtype: str = "float16"
    layout: str = "NHWC"

    def describe(self) -> str:
        pat = get_pattern(self.pattern)
        lay = f" {self.layout}" if _uses_layout(pat, self.shapes) else ""
        shapes = " ".join(f"{k}={','.join(map(str, v))}" for k, v in self.shapes.items())
        attrs = f" {_fmt_attrs(sorted(self.attrs.items()))}" if self.attrs else ""
        return f"{self.pattern} {self.dtype}{lay} {shapes}{attrs}"

    def ident(self) -> tuple:
        """What makes two layers the same key (attributes normalized, so padding=1 == padding=[1, 1])."""
        pat = get_pattern(self.pattern)
        return (self.pattern, tuple(sorted(self.shapes.items())), pat.normalize_attrs(self.attrs), self.dtype, self.layout)


def check_tune_input(pat: Pattern, shapes: Mapping[str, Shape], attrs: Mapping[str, Any], dtype: str, layout: str) -> dict[str, TensorSpec]:
    """Every check :func:`fusekit.autotune_shapes` makes before it needs a GPU: the operand and
    output specs (device 0), or OperandError naming the operand or attribute."""
    specs = shape_specs(pat, shapes, dtype, layout)
    norm = pat.normalize_attrs(attrs)
    specs.update(output_specs(pat, specs, norm))
    return specs


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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
        if not isinstance(v, list) or not v or not all(_is_int(d) and d >= 1 for d in v):
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


def parse_spec(text: str, source: str = "<spec>", *, dtype: str = "float16", layout: str = "NHWC") -> list[SpecLayer]:
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


def load_spec(path: str | os.PathLike[str], *, dtype: str = "float16", layout: str = "NHWC") -> list[SpecLayer]:
    """:func:`parse_spec` of a file; SpecError (one line) if it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(f"spec {os.fspath(path)}: cannot read it ({e.strerror or type(e).__name__})") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"spec {os.fspath(path)}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return parse_spec(text, os.fspath(path), dtype=dtype, layout=layout)


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


def _cache_disabled() -> bool:
    return os.environ.get("FUSEKIT_CACHE_DIR", "").lower() in ("off", "none", "0")


def _cache_dir_option(f: F) -> F:
    return click.option(
        "--cache-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Plan cache directory (default: $FUSEKIT_CACHE_DIR, else the user cache directory).",
    )(f)


@main.command("autotune")
@click.argument("name", required=False, metavar="[PATTERN]")
@_shape_option
@_dtype_layout_options
@_attr_option
@click.option("--spec", "spec_file", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE",
              help="TOML file of [[layer]] tables (pattern, shapes, optional attrs, dtype, layout) to tune instead of PATTERN.")
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True, help="Wall-clock seconds per key.")
@click.option("--max-candidates", type=click.IntRange(min=1), default=64, show_default=True, help="Most candidate plans timed per key.")
@click.option("--workspace-limit", metavar="BYTES", callback=_bytes_callback, default=None,
              help="Skip plans needing more workspace (e.g. 268435456, 256MiB, 1G).")
@click.option("--deterministic", is_flag=True, help="Only plans cuDNN does not mark non-deterministic.")
@_cache_dir_option
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE.png",
              help="Also write a PNG of every key's candidate times (log scale, best marked).")
@_friendly
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
        pat = _pattern(name)
        _check_names(pat, shapes, required=True)
        check_tune_input(pat, shapes, attrs, dtype, layout)
        jobs = [SpecLayer(1, pat.name, dict(shapes), dict(attrs), dtype, layout)]
    else:
        raise InputError("give a PATTERN and a --shape NAME=DIMS per operand, or --spec FILE (see 'fusekit autotune --help')")
    if plot is not None:
        if plot.suffix.lower() != ".png":
            raise InputError(f"Invalid value for '--plot': {os.fspath(plot)!r}: expected a .png file name")
        if not plot.resolve().parent.is_dir():
            raise InputError(f"Invalid value for '--plot': directory {os.fspath(plot.resolve().parent)!r} does not exist")
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise CliError("--plot needs matplotlib (pip install matplotlib)")

    lib, _ = _require_gpu("autotune")

    from fusekit.engine.autotune import TuneOptions
    from fusekit.engine.cache import DiskStore, PlanCache

    store = DiskStore(cache_dir) if cache_dir is not None else (None if _cache_disabled() else DiskStore())
    cache = PlanCache(maxsize=len(jobs) + 1, store=store, mode="autotune")  # not from $FUSEKIT_CACHE_SIZE / $FUSEKIT_MODE
    base = TuneOptions(budget_s=budget, max_candidates=max_candidates, workspace_limit=workspace_limit, deterministic=deterministic)
    console = _console()
    results = _run_autotune(console, jobs, lib, base, cache, spec_file is not None)
    done = [(job, r) for job, r in results if r is not None]
    failed = [job for job, r in results if r is None]
    if plot is not None and done:
        plot_tuning([(f"{job.index}: {job.pattern}" if spec_file else job.pattern, [c.to_json() for c in r.candidates]) for job, r in done], plot)
        console.print(f"plot: {os.fspath(plot)}")
    where = f"saved to the plan cache at {store.root}" if store is not None else "kept in memory only (FUSEKIT_CACHE_DIR is off)"
    if done:
        console.print(f"{_plural(len(done), 'tuned plan')} {where}; `fusekit cache ls` lists them")
    if failed:
        raise CliError(f"{len(failed)} of {len(jobs)} layers could not be tuned: layer(s) {', '.join(str(j.index) for j in failed)}")


def _run_autotune(
    console: Any, jobs: Sequence[SpecLayer], lib: str, base: Any, cache: Any, from_spec: bool
) -> list[tuple[SpecLayer, Any]]:
    """Tune each job under a rich progress display; prints a candidate table and a summary per key.

    Returns [(job, TuneResult, or None if it failed)] (a repeated key is tuned once and left out).
    With one job a failure raises CliError; with a spec file the other layers still run.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from fusekit.engine.autotune import autotune_shapes  # looked up per call: tests replace it

    results: list[tuple[SpecLayer, Any]] = []
    seen: dict[tuple, int] = {}
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True, disable=not console.is_terminal,  # no bars in pipes and logs
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
                result = autotune_shapes(
                    job.pattern, job.shapes, dtype=job.dtype, layout=job.layout, library=lib, options=options, cache=cache, **job.attrs
                )
            except Exception as e:  # noqa: BLE001 - reported on one line; the other layers still run
                progress.remove_task(task)
                why = _one_line(str(e)) if isinstance(e, FusekitError) else f"{type(e).__name__}: {_one_line(str(e))}"
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
            _emit(progress.console, candidate_table(cands, title, best=result.best))
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
        f"best {best.name if best else result.best}: {result.best_us:.2f} us vs {result.heuristic_us:.2f} us for the heuristics' "
        f"first plan: {result.speedup:.2f}x speed-up; {timed} of {_plural(len(cands), 'candidate')} timed in {result.seconds:.1f} s"
    )


# ----------------------------------------------------------------------------------------------
# cache
# ----------------------------------------------------------------------------------------------
def _store(cache_dir: Path | None) -> Any:
    from fusekit.engine.cache import DiskStore

    if cache_dir is not None:
        return DiskStore(cache_dir)
    if _cache_disabled():
        raise CliError(f"the disk plan cache is off (FUSEKIT_CACHE_DIR={os.environ['FUSEKIT_CACHE_DIR']}); give --cache-dir DIR")
    return DiskStore()


def _cudnn_version(v: Any) -> str:
    """cudnnGetVersion's number as text: 91000 -> 9.10.0 (cuDNN 9), 8906 -> 8.9.6 (cuDNN 8)."""
    if not _is_int(v) or v <= 0:
        return str(v)
    if v >= 90000:
        return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    return f"{v // 1000}.{v % 1000 // 100}.{v % 100}"


def _entry_shapes(key: Any) -> tuple[str, str]:
    """(operand shapes as --shape takes them '-> outputs', non-default attributes) of a PlanKey."""
    from fusekit.tensors import view_shape

    try:
        pat = get_pattern(key.pattern)
    except FusekitError:
        pat = None
    ins, outs = [], []
    for n, spec in key.specs:
        shape = tuple(spec.shape)
        if pat is not None:
            if n in pat.operand_names:
                shape, side = view_shape(pat.operand(n).kind, shape), ins
            else:
                shape, side = view_shape(pat.output_kinds.get(n, "tensor"), shape), outs
        else:
            side = ins
        side.append(f"{n}={','.join(map(str, shape))}")
    text = " ".join(ins) + (f" -> {' '.join(outs)}" if outs else "")
    attrs = list(key.attrs)
    if pat is not None:
        defaults = {}
        for a in pat.attrs:
            try:
                defaults[a.name] = a.normalize(pat.name, a.default)
            except FusekitError:
                pass
        attrs = [(k, v) for k, v in attrs if defaults.get(k, object()) != v]
    return text, _fmt_attrs(attrs)


def _scan(store: Any) -> tuple[list[Any], list[tuple[Path, str]]]:
    """(valid entries, [(path, problem)]) of a store."""
    from fusekit.engine.cache import EntryError

    good, bad = [], []
    for p in store.entries():
        try:
            good.append(store.load(p))
        except EntryError as e:
            bad.append((p, str(e)))
        except OSError as e:
            bad.append((p, f"{p.name}: cannot read ({e.strerror or e})"))
    return good, bad


@main.group("cache")
def cache_group() -> None:
    """Inspect and manage the on-disk plan cache (no GPU needed).

    The directory is --cache-dir, else $FUSEKIT_CACHE_DIR, else the user cache directory.
    """


@cache_group.command("ls")
@_cache_dir_option
@_friendly
def cache_ls(cache_dir: Path | None) -> None:
    """Table of the stored plans: key, pattern, operand shapes, dtype, layout, GPU, cuDNN, source, engine, created."""
    store = _store(cache_dir)
    good, bad = _scan(store)
    console = _console()
    if good:
        t = _table(None, ["KEY", "PATTERN", "SHAPES", "ATTRS", "DTYPE", "LAYOUT", "GPU", "CUDNN", "SOURCE", "ENGINE", "CREATED"], wrap=("SHAPES", "ATTRS", "GPU", "ENGINE"))
        rows = []
        for e in good:
            k, plan = e.key, e.header.get("plan") or {}
            shapes, attrs = _entry_shapes(k)
            first = k.specs[0][1] if k.specs else None
            created = str(e.header.get("created", "-")).replace("T", " ").rstrip("Z")
            rows.append((
                k.pattern, created,
                [e.path.stem[:12], k.pattern, shapes, attrs, first.dtype if first else "-", first.layout if first else "-",
                 f"{k.gpu} sm_{k.cc[0]}{k.cc[1]}", _cudnn_version(k.cudnn_backend), str(plan.get("source", "-")),
                 str(plan.get("engine", "-")), created[:16]],
            ))
        for _, _, cells in sorted(rows, key=lambda r: (r[0], r[1])):
            t.add_row(*[_text(c) for c in cells])
        _emit(console, t)
    console.print(f"{_plural(len(good), 'plan')} in {store.plans_dir}" + ("" if good else " (empty)"))
    if bad:
        console.print(f"{_plural(len(bad), 'bad entry', 'bad entries')} (not listed): `fusekit cache verify` shows them, `--fix` moves them aside")


def _find_entry(store: Any, prefix: str) -> Path:
    p = prefix.strip().lower()
    if not re.fullmatch(r"[0-9a-f]+", p):
        raise CliError(f"{prefix!r} is not a key: give the first hex digits of a KEY that `fusekit cache ls` shows")
    matches = [e for e in store.entries() if e.stem.startswith(p)]
    if not matches:
        raise CliError(f"no stored plan has a key starting with {p!r} in {store.plans_dir} (`fusekit cache ls` lists them)")
    if len(matches) > 1:
        some = ", ".join(m.stem[: max(len(p) + 4, 12)] for m in matches[:5]) + (", ..." if len(matches) > 5 else "")
        raise CliError(f"key prefix {p!r} is ambiguous: it matches {len(matches)} stored plans ({some}); give more digits")
    return matches[0]


@cache_group.command("show")
@click.argument("key")
@_cache_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the entry's whole header as JSON only.")
@_friendly
def cache_show(key: str, cache_dir: Path | None, as_json: bool) -> None:
    """Print the stored plan whose key starts with KEY: its header, and its candidate table if it was tuned."""
    from fusekit.engine.cache import EntryError

    store = _store(cache_dir)
    path = _find_entry(store, key)
    try:
        entry = store.load(path)
    except EntryError as e:
        raise CliError(f"stored plan {path.stem[:12]} is bad ({e}); `fusekit cache verify --fix` moves it aside") from None
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror or e}") from None
    header = entry.header
    if as_json:
        click.echo(pretty_json(header))
        return
    plan = dict(header.get("plan") or {})
    tuning = plan.get("tuning")
    cands = [c for c in tuning if isinstance(c, dict)] if isinstance(tuning, list) else []
    if cands:
        plan["tuning"] = f"{_plural(len(cands), 'candidate')}: the table below (--json prints them)"
    console = _console()
    console.print(f"plan {path.stem}  ({path})")
    console.print(f"  {entry.key.describe()}")
    click.echo(pretty_json({**header, "plan": plan}))
    if cands:
        console.print()
        _emit(console, candidate_table(cands, "tuning candidates"))
        best, first = tuning_summary(cands)
        if best is not None and first is not None:
            bt, ft = _time_of(best), _time_of(first)
            console.print(f"best {best.get('name', '?')}: {bt:.2f} us vs {ft:.2f} us for the heuristics' first plan: {ft / bt:.2f}x speed-up")


@cache_group.command("clear")
@_cache_dir_option
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@_friendly
def cache_clear(cache_dir: Path | None, yes: bool) -> None:
    """Delete every stored plan (and entries moved aside); asks first unless --yes."""
    store = _store(cache_dir)
    n = sum(1 for _ in store.entries())
    others = sum(1 for p in store.plans_dir.glob("*/*") if p.suffix != ".plan") if store.plans_dir.is_dir() else 0
    if n == 0 and others == 0:
        click.echo(f"nothing to clear: no plans in {store.plans_dir}")
        return
    if not yes:
        click.confirm(f"delete {_plural(n, 'stored plan')} from {store.plans_dir}?", abort=True)
    removed = store.clear()
    click.echo(f"removed {_plural(removed, 'plan')} from {store.plans_dir}" + (f" (and {_plural(others, 'other file')})" if others else ""))


@cache_group.command("export")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@_cache_dir_option
@_friendly
def cache_export(file: Path, cache_dir: Path | None) -> None:
    """Write every valid stored plan into FILE (a .tar.gz) for `fusekit cache import` elsewhere."""
    store = _store(cache_dir)
    total = sum(1 for _ in store.entries())
    try:
        n = store.export(file)
    except OSError as e:
        raise CliError(f"cannot write {os.fspath(file)}: {e.strerror or e}") from None
    skipped = total - n
    click.echo(
        f"exported {_plural(n, 'plan')} from {store.plans_dir} to {os.fspath(file)}"
        + (f"; skipped {_plural(skipped, 'bad entry', 'bad entries')} (`fusekit cache verify` shows them)" if skipped else "")
    )


@cache_group.command("import")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@_cache_dir_option
@_friendly
def cache_import(file: Path, cache_dir: Path | None) -> None:
    """Add the plans of FILE (from `fusekit cache export`); entries that fail their checks are skipped and reported."""
    import tarfile
    import zlib

    store = _store(cache_dir)
    before = {p.stem for p in store.entries()}
    try:
        n, problems = store.import_(file)
    except FileNotFoundError:
        raise CliError(f"cannot read {os.fspath(file)}: no such file") from None
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise CliError(f"{os.fspath(file)} is not a fusekit cache export (.tar.gz): {type(e).__name__}: {e}") from None
    except OSError as e:
        raise CliError(f"cannot import {os.fspath(file)}: {e.strerror or e}") from None
    new = len({p.stem for p in store.entries()} - before)
    click.echo(f"imported {_plural(n, 'plan')} into {store.plans_dir} ({new} new, {n - new} replaced)")
    for pr in problems:
        click.echo(f"  skipped: {_one_line(pr)}")
    if problems:
        raise CliError(f"{_plural(len(problems), 'entry', 'entries')} of {os.fspath(file)} failed their checks and were skipped")


@cache_group.command("verify")
@_cache_dir_option
@click.option("--fix", is_flag=True, help="Move bad entries aside (*.bad); they are rebuilt when next needed.")
@_friendly
def cache_verify(cache_dir: Path | None, fix: bool) -> None:
    """Check every stored plan (format, checksum, key); lists the bad ones and exits 1 unless --fix."""
    store = _store(cache_dir)
    total = sum(1 for _ in store.entries())
    bad = store.verify(fix=fix)
    if not bad:
        click.echo(f"checked {_plural(total, 'stored plan')} in {store.plans_dir}: none is bad")
        return
    for p, why in bad:
        click.echo(f"bad {p.stem[:12]}: {_one_line(why)}")
    if fix:
        click.echo(f"moved {_plural(len(bad), 'bad entry', 'bad entries')} aside (*.bad); kept {_plural(total - len(bad), 'good plan')}")
        return
    raise CliError(f"{len(bad)} of {_plural(total, 'stored plan')} failed their checks; `fusekit cache verify --fix` moves them aside")


# ----------------------------------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------------------------------
#: epsilon of the batch-norm reference (running_var = inv_std ** -2 - BN_EPS)
BN_EPS = 1e-5


@dataclass(frozen=True)
class TorchRef:
    """A PyTorch implementation of a pattern: ``fn(*prepare(operands), **attrs)`` -> its output."""

    fn: Callable[..., Any]
    what: str
    prepare: Callable[[list], list] | None = None  # once, outside the timing (e.g. inv_std -> running_var)
    positive: tuple[str, ...] = ()  # operands drawn positive (|N(0,1)| + 0.5)


def torch_references() -> dict[str, TorchRef]:
    """PyTorch equivalents of the shipped patterns, on the operands as the patterns take them
    (x NCHW logical, filters KCRS, channel vectors (C,), linear weights (out, in)); attributes normalized."""
    import torch
    import torch.nn.functional as F

    def conv(relu: bool) -> Callable[..., Any]:
        def f(x, w, b=None, *, padding=(0, 0), stride=(1, 1), dilation=(1, 1)):
            y = F.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation)
            return y.relu_() if relu else y

        return f

    def conv_add_relu(x, w, b, z, *, padding=(0, 0), stride=(1, 1), dilation=(1, 1)):
        return F.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation).add_(z).relu_()

    def conv_t(relu: bool) -> Callable[..., Any]:
        def f(x, w, b, *, padding=(0, 0), stride=(1, 1), dilation=(1, 1), output_padding=(0, 0)):
            y = F.conv_transpose2d(x, w, b, stride=stride, padding=padding, output_padding=output_padding, dilation=dilation)
            return y.relu_() if relu else y

        return f

    def linear(relu: bool) -> Callable[..., Any]:
        def f(x, w, b):
            y = F.linear(x, w, b)
            return y.relu_() if relu else y

        return f

    def bn(relu: bool) -> Callable[..., Any]:
        def f(x, mean, var, gamma, beta):
            y = F.batch_norm(x, mean, var, gamma, beta, training=False, momentum=0.0, eps=BN_EPS)
            return y.relu_() if relu else y

        return f

    def bn_prepare(args: list) -> list:
        x, mean, inv_std, gamma, beta = args
        var = (inv_std.double().pow(-2) - BN_EPS).to(inv_std.dtype)
        return [x, mean, var, gamma, beta]

    bn_kw = dict(prepare=bn_prepare, positive=("inv_std",))
    return {
        "conv": TorchRef(conv(False), "F.conv2d"),
        "conv_bias": TorchRef(conv(False), "F.conv2d with bias"),
        "conv_bias_relu": TorchRef(conv(True), "F.conv2d with bias, relu_"),
        "conv_bias_add_relu": TorchRef(conv_add_relu, "F.conv2d with bias, add_, relu_"),
        "conv_transpose_bias": TorchRef(conv_t(False), "F.conv_transpose2d with bias"),
        "conv_transpose_bias_relu": TorchRef(conv_t(True), "F.conv_transpose2d with bias, relu_"),
        "linear_bias": TorchRef(linear(False), "F.linear"),
        "linear_bias_relu": TorchRef(linear(True), "F.linear, relu_"),
        "matmul": TorchRef(torch.matmul, "torch.matmul"),
        "relu": TorchRef(torch.relu, "torch.relu"),
        "batchnorm_inference": TorchRef(bn(False), "F.batch_norm (eval)", **bn_kw),  # type: ignore[arg-type]
        "batchnorm_inference_relu": TorchRef(bn(True), "F.batch_norm (eval), relu_", **bn_kw),  # type: ignore[arg-type]
    }


def _graphed(torch: Any, fn: Callable[[], Any], warmup: int) -> tuple[Callable[[], Any], str]:
    """(callable, mode): ``fn`` captured in a CUDA graph (its replay), else ``fn`` itself.

    Warm-up runs on the capture stream first, so fusekit's per-stream handle, workspace and
    dispatch entry (and PyTorch's lazy state) exist before capture begins.
    """
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(max(3, warmup)):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            fn()
        g.replay()
        torch.cuda.synchronize()
        return g.replay, "CUDA graph"
    except Exception as e:  # noqa: BLE001 - not capturable: time it plainly
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return fn, f"plain (graph capture failed: {type(e).__name__})"


def _bench_times(lib: str, mod: Any, fn: Callable[[], Any], warmup: int, repeat: int) -> tuple[list[float], str]:
    run, mode = (_graphed(mod, fn, warmup) if lib == "torch" else (fn, "plain"))
    return _timed_ms(lib, mod, run, warmup, repeat), mode


@main.command("bench")
@click.argument("name")
@_shape_option
@_dtype_layout_options
@_attr_option
@click.option("--repeat", type=click.IntRange(min=1), default=100, show_default=True, help="Timed calls per implementation.")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True, help="Untimed calls first.")
@_friendly
def bench_cmd(name: str, shapes: dict[str, Shape], dtype: str, layout: str, attrs: dict[str, Any], repeat: int, warmup: int) -> None:
    """Time pattern NAME's fusekit.call against its PyTorch equivalent on the GPU.

    Both run inside a CUDA graph when they can be captured (else plainly), timed with CUDA events
    after warm-up; prints the median and minimum per call and the ratio. Patterns without a PyTorch
    equivalent (or with CuPy only) are timed alone. Without a GPU it stops with one line.
    """
    pat = _pattern(name)
    _check_names(pat, shapes, required=True)
    check_tune_input(pat, shapes, attrs, dtype, layout)  # bad input fails the same way with or without a GPU
    lib, mod = _require_gpu("bench")
    ref = torch_references().get(pat.name) if lib == "torch" else None
    norm = dict(pat.normalize_attrs(attrs))

    rng = np.random.default_rng(0)
    operands = []
    for o in pat.operands:
        data = rng.standard_normal(shapes[o.name])
        if ref is not None and o.name in ref.positive:
            data = np.abs(data) + 0.5
        operands.append(_to_device(lib, mod, data, o.dtype or dtype, layout, o.kind)[0])
    try:
        first = fusekit.call(pat, *operands, **attrs)
        plan = fusekit.plan_for(pat, *operands, **attrs)
    except FusekitError:
        raise
    except Exception as e:  # noqa: BLE001 - a cuDNN failure, on one line
        raise CliError(f"running {pat.name} failed: {type(e).__name__}: {e}") from None
    outs = first if isinstance(first, tuple) else (first,)

    def run_fusekit() -> None:
        fusekit.call(pat, *operands, out=outs, **attrs)

    device = _gpu_name(lib, mod)
    ins = " ".join(f"{k}={','.join(map(str, v))}" for k, v in shapes.items())
    lay = f" {layout}" if _uses_layout(pat, shapes) else ""
    console = _console()
    console.print(f"{pat.name} on {device} via {lib}: {dtype}{lay} {ins} {_fmt_attrs(list(norm.items()), '')}".rstrip())
    console.print(f"fusekit plan: engine {plan.engine}, workspace {_fmt_bytes(plan.workspace_size)}, {_plural(plan.candidates, 'candidate')} ({plan.source})")

    rows: list[tuple[str, str, str, list[float]]] = []
    times, mode = _bench_times(lib, mod, run_fusekit, warmup, repeat)
    rows.append(("fusekit", f"fusekit.call ({plan.engine})", mode, times))
    note = ""
    if ref is not None:
        args = ref.prepare(list(operands)) if ref.prepare else list(operands)

        def run_torch() -> Any:
            return ref.fn(*args, **norm)

        try:
            y_ref = run_torch()
            a, b = outs[0].double(), y_ref.double()
            diff = float((a - b).norm() / max(float(b.norm()), 1e-30))
            times, mode = _bench_times(lib, mod, run_torch, warmup, repeat)
            rows.append(("PyTorch", ref.what, mode, times))
            note = f"relative difference fusekit vs PyTorch: {diff:.1e}"
        except Exception as e:  # noqa: BLE001 - the reference is optional
            note = f"PyTorch reference failed ({type(e).__name__}: {_one_line(str(e))[:200]}): fusekit timed alone"
    else:
        note = f"no PyTorch equivalent for {pat.name}: fusekit timed alone" if lib == "torch" else "CuPy only: fusekit timed alone"

    ref_med = statistics.median(rows[1][3]) if len(rows) > 1 else None
    t = _table(None, ["implementation", "what", "mode", "median (us)", "min (us)", "PyTorch / this"], right=("median (us)", "min (us)", "PyTorch / this"), wrap=("what", "mode"))
    for impl, what, mode, ts in rows:
        med = statistics.median(ts)
        t.add_row(*[_text(c) for c in (impl, what, mode, f"{med * 1e3:.1f}", f"{min(ts) * 1e3:.1f}", f"{ref_med / med:.2f}x" if ref_med else "-")])
    _emit(console, t)
    console.print(f"{repeat} timed calls each after {warmup} warm-up calls, CUDA events; {note}")
    if ref_med is not None:
        ratio = ref_med / statistics.median(rows[0][3])
        verdict = f"{ratio:.2f}x faster than" if ratio >= 1 else f"{1 / ratio:.2f}x slower than"
        console.print(f"fusekit is {verdict} PyTorch (medians)")


if __name__ == "__main__":
    main(prog_name="fusekit")
