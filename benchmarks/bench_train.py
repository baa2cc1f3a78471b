"""One training step (forward + backward) on fused graphs vs PyTorch eager, both captured in CUDA graphs.

    python benchmarks/bench_train.py [--out benchmarks/results]

Cases: a conv+bias+relu block (ResNet-like shapes, fp16 channels-last) and the seed autoencoder
(examples/autoencoder.py, fp32 and fp16). Each step computes the loss, and the gradients of every parameter
and of the input, with torch.autograd; the fusekit side runs fusekit.torch modules (forward: one
cuDNN graph per layer; backward: the fused dReLU+bias-gradient graph, dgrad and wgrad graphs).
Median of CUDA-graph replays timed with events. The loss is sum(y * g) for a fixed random g, so the
upstream gradient is O(1) (a mean over millions of elements would put fp16 gradients in subnormals);
gradients of both sides are checked against a float64 copy of the model first.

For the autoencoder cases, where fusekit has been slower than eager, every fusekit graph one step
runs is also timed alone (each call captured in a CUDA graph on the step's own arrays, the same
timer): the table names the graphs that take the most time per step.

Eager runs with cudnn.benchmark=True (its algorithms timed on first use) and, as "eager default",
with PyTorch's default cudnn.benchmark=False (heuristics): the counterparts of fusekit's autotuned
and heuristic plans. PyTorch keeps one algorithm per convolution shape for the whole process,
whichever mode chose it first, so the defaults pair (fusekit heuristic, eager default) is timed in a
child process of its own, both sides in that one process. Then every case runs again with fusekit autotuned
(``fusekit.configure(mode="autotune")``: each graph's candidate plans timed on first use).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import geometric_mean

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import autoencoder  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from timing import graph_time_us  # noqa: E402

import fusekit  # noqa: E402
import fusekit.torch as ft  # noqa: E402

TRIALS, REPS = 15, 10


_G: dict[tuple, torch.Tensor] = {}


def upstream(y: torch.Tensor) -> torch.Tensor:
    """The fixed random g of sum(y * g), fp16-representable so every dtype sees the same values."""
    key = (tuple(y.shape), y.dtype)
    if key not in _G:
        gen = torch.Generator(y.device).manual_seed(1)
        _G[key] = torch.randn(y.shape, device=y.device, generator=gen).half().to(y.dtype)
    return _G[key]


def step_fn(model, x):
    def step():
        y = model(x)
        loss = (y * upstream(y)).sum()
        loss.backward()
        return loss

    return step


def graph_step(model, x) -> tuple[Callable[[int], object], Callable[[], None]]:
    """(fn_i, reset) of one forward+backward for the graph timers: reset clears every gradient."""
    params, step = list(model.parameters()), step_fn(model, x)

    def reset() -> None:
        for p in params:
            p.grad = None
        x.grad = None

    return (lambda i: step()), reset


def graphed_time_us(model, x) -> float:
    """Median device time of one forward+backward, captured (with its allocations) in a CUDA graph."""
    fn_i, reset = graph_step(model, x)
    return graph_time_us(fn_i, reps=REPS, trials=TRIALS, warm=3, reset=reset)


def graph_profile(model, x, top: int = 6) -> list[dict]:
    """The fusekit graphs one step of ``model`` runs (seen by the session's observer), each call timed
    alone: (pattern, operand shapes) groups with calls per step and device us per step, the ``top`` largest."""
    from fusekit import session
    from fusekit.dispatch import launch

    calls: list[tuple] = []
    stop = session.current().observe(lambda call, operands, outs: calls.append((call, operands, outs)))
    try:
        step_fn(model, x)()
        torch.cuda.synchronize()
    finally:
        stop()
    groups: dict[tuple, dict] = {}
    for call, operands, outs in calls:
        name = call.plan.key.pattern
        shapes = " ".join("x".join(map(str, a.shape)) for a in operands)
        us = graph_time_us(lambda i, c=(call, operands, outs): launch(c[0], c[1], c[2], False), reps=REPS, trials=TRIALS, warm=3)
        g = groups.setdefault((name, shapes), {"graph": name, "operands": shapes, "calls": 0, "us": 0.0})
        g["calls"] += 1
        g["us"] += us
    return sorted(groups.values(), key=lambda g: -g["us"])[:top]


def grads(model, x):
    for p in model.parameters():
        p.grad = None
    x.grad = None
    step_fn(model, x)()
    return [p.grad.detach().double().clone() for p in model.parameters()] + [x.grad.detach().double().clone()]


def compare(gf, ge) -> float:
    return max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(gf, ge))


def reference(eager, x):
    """Gradients of a float64 copy of the eager model on the same (rounded) input."""
    import copy

    ref = copy.deepcopy(eager).double().to(memory_format=torch.contiguous_format)
    return grads(ref, x.detach().double().contiguous().requires_grad_(True))


def block_case(n, c, h, k, r, stride, dtype=torch.float16):
    pad = r // 2
    eager = torch.nn.Sequential(torch.nn.Conv2d(c, k, r, stride=stride, padding=pad), torch.nn.ReLU())
    fused = torch.nn.Sequential(ft.Conv2d(c, k, r, stride=stride, padding=pad, activation="relu"))
    fused[0].load_state_dict(eager[0].state_dict())
    eager = eager.cuda().to(dtype).to(memory_format=torch.channels_last)
    fused = fused.cuda().to(dtype).to(memory_format=torch.channels_last)
    x = torch.randn(n, c, h, h, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    return f"conv+bias+relu block N={n} C={c} {h}x{h} K={k} {r}x{r}/s{stride} fp16", fused, eager, x


def autoencoder_case(batch=16, dtype=torch.float32):
    torch.manual_seed(0)
    eager = autoencoder.eager_model().cuda().to(dtype).to(memory_format=torch.channels_last)
    fused = autoencoder.fused_model().cuda().to(dtype).to(memory_format=torch.channels_last)
    autoencoder.load_from_eager(fused, eager)
    x = autoencoder.synthetic_images(batch).to(dtype).requires_grad_(True)
    return f"autoencoder 64x64x3 (batch {batch}) {'fp16' if dtype == torch.float16 else 'fp32'}", fused, eager, x


def make_cases() -> list[tuple]:
    return [
        block_case(32, 64, 56, 64, 3, 1),
        block_case(32, 256, 56, 64, 1, 1),
        block_case(32, 128, 28, 128, 3, 1),
        block_case(32, 256, 14, 256, 3, 1),
        autoencoder_case(16),
        autoencoder_case(64),
        autoencoder_case(64, torch.float16),
        autoencoder_case(256, torch.float16),
    ]


def defaults_child() -> None:
    """The defaults pair, alternated twice, the smaller of each side's two timings: a JSON line on stdout."""
    torch.backends.cudnn.benchmark = False
    out = {}
    for name, fused, eager, x in make_cases():
        tf, te = [], []
        for _ in range(2):
            tf.append(graphed_time_us(fused, x))
            te.append(graphed_time_us(eager, x))
        out[name] = dict(fusekit_us=min(tf), eager_default_us=min(te), fusekit_all_us=tf, eager_default_all_us=te)
        print(f"defaults: {name}: fusekit heuristic {tf} us, eager default {te} us", file=sys.stderr, flush=True)
    print("DEFAULTS " + json.dumps(out), flush=True)


def defaults_pass() -> dict[str, dict]:
    """Per case, fusekit's heuristic plans and eager with cudnn.benchmark=False timed in a child process."""
    print("timing the defaults pair (fusekit heuristic, eager cudnn.benchmark=False) in a child process", flush=True)
    r = subprocess.run([sys.executable, __file__, "--defaults-child"], stdout=subprocess.PIPE, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("DEFAULTS ")]
    if r.returncode or not lines:
        raise SystemExit(f"the defaults child process failed (exit {r.returncode})")
    return json.loads(lines[-1][len("DEFAULTS "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--no-autotune", action="store_true", help="skip the autotuned pass")
    ap.add_argument("--defaults-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.defaults_child:
        return defaults_child()
    defaults = defaults_pass()
    torch.backends.cudnn.benchmark = True
    cases = make_cases()
    rows, refs = [], []
    for name, fused, eager, x in cases:
        gf, ge = grads(fused, x), grads(eager, x)
        gr = reference(eager, x)
        refs.append(gr)
        err, err_eager = compare(gf, gr), compare(ge, gr)
        tf, te = graphed_time_us(fused, x), graphed_time_us(eager, x)
        tf2, te2 = graphed_time_us(fused, x), graphed_time_us(eager, x)
        d = defaults[name]
        rows.append(dict(case=name, fusekit_us=tf, eager_us=te, fusekit_repeat_us=tf2, eager_repeat_us=te2, speedup=te / tf, grad_rel_err=err,
                         eager_grad_rel_err=err_eager, eager_default_us=d["eager_default_us"], fusekit_us_defaults_process=d["fusekit_us"],
                         default_speedup=d["eager_default_us"] / d["fusekit_us"]))
        if name.startswith("autoencoder"):
            try:
                rows[-1]["top_graphs"] = graph_profile(fused, x)
            except Exception as e:  # noqa: BLE001 - the timing table is written regardless
                rows[-1]["top_graphs_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            for g in rows[-1].get("top_graphs", []):
                print(f"  {g['graph']} ({g['operands']}): {g['calls']} call(s), {g['us']:.1f} us per step", flush=True)
        print(f"{name}: fusekit {tf:.1f} us (again {tf2:.1f}), eager {te:.1f} us (again {te2:.1f}) -> {te / tf:.2f}x; "
              f"defaults process: fusekit {d['fusekit_us']:.1f} us, eager default {d['eager_default_us']:.1f} us -> {rows[-1]['default_speedup']:.2f}x; "
              f"grad err vs float64: fusekit {err:.1e}, eager {err_eager:.1e}", flush=True)
    if not args.no_autotune:  # the same cases with every fusekit graph autotuned (a fresh, memory-only cache)
        fusekit.configure(mode="autotune", disk=False)
        for (name, fused, eager, x), r, gr in zip(cases, rows, refs):
            r["autotuned_grad_rel_err"] = compare(grads(fused, x), gr)
            r["fusekit_autotuned_us"] = graphed_time_us(fused, x)
            r["autotuned_speedup"] = r["eager_us"] / r["fusekit_autotuned_us"]
            if name.startswith("autoencoder"):
                try:
                    r["top_graphs_autotuned"] = graph_profile(fused, x)
                except Exception as e:  # noqa: BLE001 - the timing table is written regardless
                    r["top_graphs_autotuned_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"{name}: fusekit autotuned {r['fusekit_autotuned_us']:.1f} us -> {r['autotuned_speedup']:.2f}x over eager; "
                  f"grad err {r['autotuned_grad_rel_err']:.1e}", flush=True)
    props = torch.cuda.get_device_properties(0)
    v = fusekit.engine.runtime.versions()
    meta = dict(gpu=props.name, cudnn_backend=v.cudnn_backend, frontend=v.frontend, torch=torch.__version__,
                date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                geomean_speedup=geometric_mean([r["speedup"] for r in rows]), geomean_default_speedup=geometric_mean([r["default_speedup"] for r in rows]),
                trials=TRIALS, reps=REPS)
    tuned = [r["autotuned_speedup"] for r in rows if "autotuned_speedup" in r]
    if tuned:
        meta["geomean_autotuned_speedup"] = geometric_mean(tuned)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = props.name.replace(" ", "-") + "-train"
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [
        "# One training step (forward + backward), fusekit.torch vs PyTorch eager, both in CUDA graphs",
        "",
        f"GPU {meta['gpu']}, cuDNN {meta['cudnn_backend']}, frontend {meta['frontend']}, torch {meta['torch']}; {meta['date']}. "
        "Median of CUDA-graph replays (events) per step; eager with cudnn.benchmark=True, and \"eager default\" with PyTorch's default "
        "cudnn.benchmark=False (the counterpart of fusekit's heuristic plans), the defaults pair timed in a child process of its own "
        "(PyTorch keeps the first algorithm it picks for a shape for the whole process), the smaller of two timings each; "
        "speed-up (both default) is that process's fusekit heuristic time over its eager default time; loss sum(y * g), g fixed random; "
        "gradient errors (max over parameters and input, relative L2) against a float64 copy of the model.",
        "",
        "| case | defaults process: fusekit heuristic us / eager default us | speed-up (both default) | fusekit us (heuristic) "
        "| eager us (benchmark) | speed-up vs eager benchmark "
        "| repeat (fusekit / eager) | grad err fusekit | grad err eager | fusekit autotuned us | speed-up autotuned (both tuned) | grad err autotuned |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tuned_cells = (f"{r['fusekit_autotuned_us']:.1f} | {r['autotuned_speedup']:.2f}x | {r['autotuned_grad_rel_err']:.1e}"
                       if "fusekit_autotuned_us" in r else "not run | | ")
        lines.append(f"| {r['case']} | {r['fusekit_us_defaults_process']:.1f} / {r['eager_default_us']:.1f} | {r['default_speedup']:.2f}x | "
                     f"{r['fusekit_us']:.1f} | {r['eager_us']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['fusekit_repeat_us']:.1f} / {r['eager_repeat_us']:.1f} | {r['grad_rel_err']:.1e} | {r['eager_grad_rel_err']:.1e} | "
                     f"{tuned_cells} |")
    lines += ["", f"Geometric-mean speed-up: **{meta['geomean_default_speedup']:.2f}x** fusekit heuristic over eager default, "
              f"{meta['geomean_speedup']:.2f}x heuristic over eager benchmark"
              + (f", **{meta['geomean_autotuned_speedup']:.2f}x** autotuned over eager benchmark." if tuned else ".")]
    profiled = [r for r in rows if "top_graphs" in r or "top_graphs_error" in r]
    if profiled:
        lines += ["", "## Where the autoencoder's fusekit step spends its time",
                  "Each fusekit graph of one step timed alone (captured in a CUDA graph on the step's own arrays); "
                  "share = its time over the whole captured step's.", "",
                  "| case | plans | graph | operands | calls | us per step | share of step |", "|---|---|---|---|---:|---:|---:|"]
        for suffix, plans, total in (("", "heuristic", "fusekit_us"), ("_autotuned", "autotuned", "fusekit_autotuned_us")):
            for r in profiled:
                for g in r.get("top_graphs" + suffix, []):
                    lines.append(f"| {r['case']} | {plans} | {g['graph']} | {g['operands']} | {g['calls']} | {g['us']:.1f} | "
                                 f"{g['us'] / r[total]:.0%} |")
                if "top_graphs" + suffix + "_error" in r:
                    lines.append(f"| {r['case']} | {plans} | profiling failed: {r['top_graphs' + suffix + '_error']} | | | | |")
    md = "\n".join(lines) + "\n"
    (out / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
