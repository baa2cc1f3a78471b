"""``fusekit run`` and ``fusekit bench``: run a pattern on the GPU, check it against the oracle, time it (against PyTorch)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import click
import numpy as np

import fusekit
from fusekit.engine import oracle
from fusekit.adapters import library
from fusekit.errors import FusekitError
from fusekit.timing import events_ms

from .common import (
    LAYOUT_KINDS,
    CliError,
    Command,
    Shape,
    attr_option,
    check_names,
    check_tune_input,
    console,
    device_props,
    dtype_layout_options,
    emit,
    failed,
    fmt_attrs,
    fmt_bytes,
    fmt_shape,
    fmt_value,
    friendly,
    one_line,
    pattern_arg,
    plural,
    require_gpu,
    shape_option,
    table,
    text,
    uses_layout,
)

#: Normwise relative error allowed against the float64 oracle (as the GPU tests): fp16 / bf16 round
#: the output once; fp32 may run on TF32 tensor cores.
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 2e-3}
_SOURCE = {"built": "built (heuristics)", "tuned": "autotuned", "disk": "loaded from the disk cache"}


# ----------------------------------------------------------------------------------------------
# Arrays and timing on the GPU
# ----------------------------------------------------------------------------------------------
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


def _gpu_name(lib: str, mod: Any) -> str:
    try:
        i = mod.cuda.current_device() if lib == "torch" else mod.cuda.Device().id
        name, (major, minor), _ = device_props(lib, mod, i)
        return f"cuda:{i} {name} (sm_{major}{minor})"
    except Exception:  # noqa: BLE001 - informative only
        return "the GPU"


def _graphed(torch: Any, fn: Callable[[], Any], warmup: int) -> tuple[Callable[[], Any], str]:
    """(callable, mode): ``fn`` captured in a CUDA graph after a warm-up on the capture stream (its
    replay), else ``fn`` itself."""
    from fusekit.pipeline.bench import capture

    try:
        g = capture(fn, max(3, warmup))
        g.replay()
        torch.cuda.synchronize()
        return g.replay, "CUDA graph"
    except Exception as e:  # noqa: BLE001 - not capturable: time it plainly
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return fn, f"plain (graph capture failed: {type(e).__name__})"


def time_calls(lib: str, mod: Any, fn: Callable[[], Any], warmup: int, repeat: int, graph: bool = False) -> tuple[list[float], str]:
    """(per-call times in ms from CUDA events on the current stream after ``warmup`` calls
    (:func:`fusekit.timing.events_ms`), how ``fn`` ran): with ``graph`` (PyTorch only) inside a CUDA
    graph when it can be captured, else plainly."""
    mode = "plain"
    if graph and lib == "torch":
        fn, mode = _graphed(mod, fn, warmup)
    return events_ms(library(lib), fn, trials=repeat, warmup=warmup), mode


def _first_call(pat: Any, operands: list, attrs: dict[str, Any]) -> tuple[tuple, Any]:
    """(outputs, plan) of the first ``fusekit.call``; a cuDNN failure as one line."""
    try:
        result = fusekit.call(pat, *operands, **attrs)
        plan = fusekit.plan_for(pat, *operands, **attrs)
    except FusekitError:
        raise
    except Exception as e:  # noqa: BLE001 - a cuDNN execute failure, on one line
        raise failed(f"running {pat.name}", e) from None
    return (result if isinstance(result, tuple) else (result,)), plan


# ----------------------------------------------------------------------------------------------
# run
# ----------------------------------------------------------------------------------------------
@click.command("run", cls=Command)
@click.argument("name")
@shape_option
@dtype_layout_options
@attr_option
@click.option("--repeat", type=click.IntRange(min=1), default=100, show_default=True, help="Timed calls.")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True, help="Untimed calls first.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the standard-normal random inputs.")
@friendly
def run_cmd(
    name: str, shapes: dict[str, Shape], dtype: str, layout: str, attrs: dict[str, Any], repeat: int, warmup: int, seed: int
) -> None:
    """Run pattern NAME on the GPU, check it, and time it.

    Random inputs go through fusekit.call (PyTorch if it sees a GPU, else CuPy); the result is
    compared with the float64 oracle, then the plan's engine and workspace and the median time
    per call (CUDA events, after warm-up) are printed. Without a GPU it stops with one line.
    """
    pat = pattern_arg(name)
    check_names(pat, shapes, required=True)
    check_tune_input(pat, shapes, attrs, dtype, layout)  # bad input fails the same way with or without a GPU
    norm = pat.normalize_attrs(attrs)
    lib, mod = require_gpu("run")

    rng = np.random.default_rng(seed)
    operands, host = [], []
    for o in pat.operands:
        a, h = _to_device(lib, mod, rng.standard_normal(shapes[o.name]), o.dtype or dtype, layout, o.kind)
        operands.append(a)
        host.append(h)
    refs = oracle.evaluate(pat, *host, **attrs)
    outs, plan = _first_call(pat, operands, attrs)

    ins = " ".join(f"{k}={fmt_shape(shapes[k])}" for k in pat.operand_names)
    lay = f" {layout}" if uses_layout(pat, shapes) else ""
    click.echo(f"{pat.name} on {_gpu_name(lib, mod)} via {lib}: {dtype}{lay}, {ins}, {fmt_attrs(norm, 'no attributes')}, seed {seed}")
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
            f"check {out_name}: shape {fmt_shape(yh.shape)}, relative error {err:.2e} vs float64 oracle "
            f"(tolerance {tol:.0e}){'' if finite else ', NON-FINITE values'}: {'ok' if ok else 'FAIL'}"
        )
        if not ok:
            bad.append(f"{out_name}: relative error {err:.2e} > {tol:.0e}" if finite else f"{out_name}: non-finite values")
    if bad:
        raise CliError(f"{pat.name} does not match the oracle ({'; '.join(bad)})")

    times, _ = time_calls(lib, mod, lambda: fusekit.call(pat, *operands, out=outs, **attrs), warmup, repeat)
    med = statistics.median(times)
    click.echo(
        f"time: median {med * 1e3:.1f} us per call (min {min(times) * 1e3:.1f} us) over {repeat} calls, "
        f"CUDA events, after {warmup} warm-up calls"
    )


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

    def act_(y: Any, upper_clip: float) -> Any:
        """ReLU in place, clipped above at ``upper_clip`` (the patterns' attribute; ReLU6: 6)."""
        return y.relu_() if math.isinf(upper_clip) else y.clamp_(0.0, upper_clip)

    def conv(relu: bool, clip: float = math.inf) -> Callable[..., Any]:
        def f(x, w, b=None, *, padding=(0, 0), stride=(1, 1), dilation=(1, 1), groups=1):
            y = F.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)
            return act_(y, clip) if relu else y

        return f

    def conv_add_relu(x, w, b, z, *, padding=(0, 0), stride=(1, 1), dilation=(1, 1), groups=1):
        return F.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups).add_(z).relu_()

    def conv_t(relu: bool) -> Callable[..., Any]:
        def f(x, w, b, *, padding=(0, 0), stride=(1, 1), dilation=(1, 1), output_padding=(0, 0), groups=1):
            y = F.conv_transpose2d(x, w, b, stride=stride, padding=padding, output_padding=output_padding, dilation=dilation, groups=groups)
            return y.relu_() if relu else y

        return f

    def linear(relu: bool) -> Callable[..., Any]:
        def f(x, w, b):
            y = F.linear(x, w, b)
            return y.relu_() if relu else y

        return f

    def bn(relu: bool) -> Callable[..., Any]:
        def f(x, mean, var, gamma, beta, *, upper_clip=math.inf):
            y = F.batch_norm(x, mean, var, gamma, beta, training=False, momentum=0.0, eps=BN_EPS)
            return act_(y, upper_clip) if relu else y

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
        "conv_bias_relu6": TorchRef(conv(True, 6.0), "F.conv2d with bias, clamp_(0, 6)"),
        "conv_bias_add_relu": TorchRef(conv_add_relu, "F.conv2d with bias, add_, relu_"),
        "conv_transpose_bias": TorchRef(conv_t(False), "F.conv_transpose2d with bias"),
        "conv_transpose_bias_relu": TorchRef(conv_t(True), "F.conv_transpose2d with bias, relu_"),
        "linear_bias": TorchRef(linear(False), "F.linear"),
        "linear_bias_relu": TorchRef(linear(True), "F.linear, relu_"),
        "matmul": TorchRef(torch.matmul, "torch.matmul"),
        "relu": TorchRef(lambda x, *, upper_clip=math.inf: torch.relu(x) if math.isinf(upper_clip) else torch.clamp(x, 0.0, upper_clip),
                         "torch.relu (torch.clamp with an upper_clip)"),
        "batchnorm_inference": TorchRef(bn(False), "F.batch_norm (eval)", **bn_kw),  # type: ignore[arg-type]
        "batchnorm_inference_relu": TorchRef(bn(True), "F.batch_norm (eval), relu_", **bn_kw),  # type: ignore[arg-type]
    }


@click.command("bench", cls=Command)
@click.argument("name")
@shape_option
@dtype_layout_options
@attr_option
@click.option("--repeat", type=click.IntRange(min=1), default=100, show_default=True, help="Timed calls per implementation.")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True, help="Untimed calls first.")
@friendly
def bench_cmd(name: str, shapes: dict[str, Shape], dtype: str, layout: str, attrs: dict[str, Any], repeat: int, warmup: int) -> None:
    """Time pattern NAME's fusekit.call against its PyTorch equivalent on the GPU.

    Both run inside a CUDA graph when they can be captured (else plainly), timed with CUDA events
    after warm-up; prints the median and minimum per call and the ratio. Patterns without a PyTorch
    equivalent (or with CuPy only) are timed alone. Without a GPU it stops with one line.
    """
    pat = pattern_arg(name)
    check_names(pat, shapes, required=True)
    check_tune_input(pat, shapes, attrs, dtype, layout)  # bad input fails the same way with or without a GPU
    lib, mod = require_gpu("bench")
    ref = torch_references().get(pat.name) if lib == "torch" else None
    norm = dict(pat.normalize_attrs(attrs))

    rng = np.random.default_rng(0)
    operands = []
    for o in pat.operands:
        data = rng.standard_normal(shapes[o.name])
        if ref is not None and o.name in ref.positive:
            data = np.abs(data) + 0.5
        operands.append(_to_device(lib, mod, data, o.dtype or dtype, layout, o.kind)[0])
    outs, plan = _first_call(pat, operands, attrs)

    def run_fusekit() -> None:
        fusekit.call(pat, *operands, out=outs, **attrs)

    ins = " ".join(f"{k}={fmt_value(v)}" for k, v in shapes.items())
    lay = f" {layout}" if uses_layout(pat, shapes) else ""
    con = console()
    con.print(f"{pat.name} on {_gpu_name(lib, mod)} via {lib}: {dtype}{lay} {ins} {fmt_attrs(list(norm.items()), '')}".rstrip())
    con.print(f"fusekit plan: engine {plan.engine}, workspace {fmt_bytes(plan.workspace_size)}, {plural(plan.candidates, 'candidate')} ({plan.source})")

    rows: list[tuple[str, str, str, list[float]]] = []
    times, mode = time_calls(lib, mod, run_fusekit, warmup, repeat, graph=True)
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
            times, mode = time_calls(lib, mod, run_torch, warmup, repeat, graph=True)
            rows.append(("PyTorch", ref.what, mode, times))
            note = f"relative difference fusekit vs PyTorch: {diff:.1e}"
        except Exception as e:  # noqa: BLE001 - the reference is optional
            note = f"PyTorch reference failed ({type(e).__name__}: {one_line(str(e))[:200]}): fusekit timed alone"
    else:
        note = f"no PyTorch equivalent for {pat.name}: fusekit timed alone" if lib == "torch" else "CuPy only: fusekit timed alone"

    ref_med = statistics.median(rows[1][3]) if len(rows) > 1 else None
    t = table(None, ["implementation", "what", "mode", "median (us)", "min (us)", "PyTorch / this"], right=("median (us)", "min (us)", "PyTorch / this"), wrap=("what", "mode"))
    for impl, what, mode, ts in rows:
        med = statistics.median(ts)
        t.add_row(*[text(c) for c in (impl, what, mode, f"{med * 1e3:.1f}", f"{min(ts) * 1e3:.1f}", f"{ref_med / med:.2f}x" if ref_med else "-")])
    emit(con, t)
    con.print(f"{repeat} timed calls each after {warmup} warm-up calls, CUDA events; {note}")
    if ref_med is not None:
        ratio = ref_med / statistics.median(rows[0][3])
        verdict = f"{ratio:.2f}x faster than" if ratio >= 1 else f"{1 / ratio:.2f}x slower than"
        con.print(f"fusekit is {verdict} PyTorch (medians)")
