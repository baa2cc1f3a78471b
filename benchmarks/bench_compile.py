"""torch.compile(backend="fusekit") against Inductor's default mode and max-autotune, in one process.

Inference: ResNet-50, EfficientNet-B0, MobileNetV3-Large and ConvNeXt-Tiny at batch 1 and 32, float16
channels-last, eval under ``torch.no_grad()``, random weights with BN statistics of random images
(benchmarks/zoo.py's models), ``dynamic=False``; ``--reduce-overhead`` adds both backends in that mode.
``--training``: AMP float16 training steps (autocast, GradScaler, SGD) at ``--train-batch`` (the
backend runs the convolutions, batch norms, ReLUs and residual ends on fusekit's fused forward and
backward ops; AOTAutograd and Inductor compile the rest). Each
variant is compiled, called three times (the compile time is until then), then timed: CUDA events,
median of --trials trials of --iters calls, a fresh input before each trial. Relative error of each
inference variant against float32 eager. Each record is written as soon as it is measured.

    python benchmarks/bench_compile.py --models resnet50 efficientnet_b0 --batches 32 [--max-autotune] [--training]

Writes <out>/<GPU>-compile.json (a list of records: model, mode, phase, batch, fusekit_ms,
inductor_ms, inductor_max_autotune_ms, fusekit_compile_s, inductor_compile_s, ...), -compile.md
and -compile.png (speed-up over each Inductor mode).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo import _rel, build_model, image_size, log  # noqa: E402

from fusekit.pipeline.bench import cuda_time_ms  # noqa: E402

MODELS = ["resnet50", "efficientnet_b0", "mobilenet_v3_large", "convnext_tiny"]


def fusekit_backend() -> Any:
    """``"fusekit"`` where the package's entry point registered it, else the backend callable (fusekit
    run from a source tree, as on the device)."""
    import torch._dynamo

    from fusekit.backend import backend

    return "fusekit" if "fusekit" in torch._dynamo.list_backends() else backend


def compiled_ms(model: torch.nn.Module, x: torch.Tensor, iters: int, trials: int, check: Any = None,
                **kw: Any) -> tuple[float | None, float | None, dict[str, Any], str | None]:
    """(median ms per call, compile s, what ``check(compiled)`` returns after the timing ({} without
    one), error) of torch.compile(model, **kw) on x."""
    import torch._dynamo

    torch._dynamo.reset()
    t0 = time.perf_counter()
    try:
        c = torch.compile(model, dynamic=False, **kw)
        with torch.no_grad():
            for _ in range(3):
                c(x)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            ms = cuda_time_ms(lambda: c(x), iters=iters, trials=trials, before_trial=lambda: x.normal_())
            return ms, compile_s, ({} if check is None else check(c)), None
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        return None, None, {}, f"{type(e).__name__}: {str(e)[:300]}"


def variants(max_autotune: bool, reduce_overhead: bool) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = [("fusekit", {"backend": fusekit_backend()}), ("inductor", {})]
    if max_autotune:
        out.append(("inductor_max_autotune", {"mode": "max-autotune"}))
    if reduce_overhead:
        out += [("fusekit_reduce_overhead", {"backend": fusekit_backend(), "mode": "reduce-overhead"}),
                ("inductor_reduce_overhead", {"mode": "reduce-overhead"})]
    return out


def _grads(model: torch.nn.Module, call: Any, x: torch.Tensor, labels: torch.Tensor, amp: bool) -> torch.Tensor:
    """Every parameter's gradient of one cross-entropy step of ``call`` (model or its compiled form), flattened, in float64."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", torch.float16, enabled=amp):
        loss = torch.nn.functional.cross_entropy(call(x), labels)
    loss.backward()
    return torch.cat([p.grad.double().flatten() for p in model.parameters()])


def grad_rel_err(model: torch.nn.Module, call: Any, x: torch.Tensor, labels: torch.Tensor) -> float:
    """Relative error of ``call``'s AMP float16 parameter gradients against a float64 copy of ``model``
    (its weights as they are now, training mode) on the same batch."""
    ref = copy.deepcopy(model).double()
    want = _grads(ref, ref, x.double(), labels, False)
    return _rel(_grads(model, call, x, labels, True), want)


def train_ms(model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor, iters: int, trials: int,
             **kw: Any) -> tuple[float | None, float | None, float | None, str | None]:
    """(median ms per AMP float16 training step, compile s, relative error of its parameter gradients
    against float64, error) of torch.compile(model, **kw)."""
    import torch._dynamo

    torch._dynamo.reset()
    m = copy.deepcopy(model).train()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    t0 = time.perf_counter()
    try:
        c = torch.compile(m, dynamic=False, **kw)

        def step() -> None:
            with torch.autocast("cuda", torch.float16):
                loss = torch.nn.functional.cross_entropy(c(x), labels)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        err = grad_rel_err(m, c, x, labels)
        return cuda_time_ms(step, iters=iters, trials=trials, before_trial=lambda: x.normal_()), compile_s, err, None
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        return None, None, None, f"{type(e).__name__}: {str(e)[:300]}"


def train_record(name: str, batch: int, iters: int, trials: int, max_autotune: bool, save: Any) -> dict[str, Any]:
    """The training record of ``name``, passed to ``save`` after each variant (a timeout keeps what was measured)."""
    rec: dict[str, Any] = {"model": name, "mode": "training", "phase": "training", "batch": batch, "precision": "amp-fp16"}
    m = build_model(name).to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, *image_size(name), device="cuda").contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,), device="cuda")
    eager = copy.deepcopy(m).train()
    rec["torch_amp_grad_rel_err"] = grad_rel_err(eager, eager, x, labels)
    for key, kw in variants(max_autotune, False):
        log(f"{name} b{batch} training: {key}")
        ms, s, err, fail = train_ms(m, x, labels, iters, trials, **kw)
        rec[f"{key}_ms"], rec[f"{key}_compile_s"], rec[f"{key}_grad_rel_err"] = ms, s, err
        if fail:
            rec[f"{key}_error"] = fail
        save(rec)
    return rec


def record(name: str, batch: int, iters: int, trials: int, max_autotune: bool, reduce_overhead: bool, save: Any) -> dict[str, Any]:
    """The inference record of ``name`` at ``batch``, passed to ``save`` after each variant."""
    rec: dict[str, Any] = {"model": name, "mode": "inference", "phase": "inference", "batch": batch}
    m = build_model(name)
    half = copy.deepcopy(m).half().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, *image_size(name), device="cuda").half().contiguous(memory_format=torch.channels_last)
    def errors(c: Any) -> dict[str, float]:  # the compiled fusekit model's and eager float16's, on one input
        want = m(x.float())
        return {"fusekit_rel_err": _rel(c(x), want), "torch_fp16_rel_err": _rel(half(x), want)}

    for key, kw in variants(max_autotune, reduce_overhead):
        log(f"{name} b{batch}: {key}")
        ms, s, checked, err = compiled_ms(half, x, iters, trials, check=errors if key == "fusekit" else None, **kw)
        rec[f"{key}_ms"], rec[f"{key}_compile_s"] = ms, s
        rec.update(checked)
        if err:
            rec[f"{key}_error"] = err
        save(rec)
    return rec


def merge(recs: list[dict], rec: dict) -> list[dict]:
    """``recs`` with ``rec`` in place of any row of the same model, phase and batch (else appended)."""
    key = lambda r: (r["model"], r.get("phase", "inference"), r["batch"])  # noqa: E731
    return [r for r in recs if key(r) != key(rec)] + [rec]


def markdown(recs: list[dict], meta: dict) -> str:
    f = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"# torch.compile backends ({meta['gpu']})\n",
             f"Runs {', '.join(sorted({r.get('date', meta['date']) for r in recs}))} (each row names its own), torch {meta['torch']}, channels-last, dynamic=False; inference in float16, eval under no_grad. Milliseconds per "
             f"forward, median of {meta['trials']} trials of {meta['iters']} calls (CUDA events, a fresh input before each trial); "
             "compile seconds until the third call. Training rows: AMP float16 steps (autocast, GradScaler, SGD), their rel err the "
             "parameter gradients' against float64 (eager AMP's in brackets); inference rows: the output's against float32 eager "
             "(eager float16's in brackets).\n",
             "| model | batch | phase | fusekit | Inductor | max-autotune | x Inductor | x max-autotune | compile s (fusekit / Inductor / max-autotune) | rel err (PyTorch's) | run |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in recs:
        fk = r.get("fusekit_ms")
        ratio = lambda k: None if fk is None or r.get(k) is None else r[k] / fk  # noqa: E731
        train = r.get("phase") == "training"
        err, ref = (r.get("fusekit_grad_rel_err"), r.get("torch_amp_grad_rel_err")) if train else (r.get("fusekit_rel_err"), r.get("torch_fp16_rel_err"))
        lines.append(f"| {r['model']} | {r['batch']} | {r.get('phase', 'inference')} | {f(fk)} | {f(r.get('inductor_ms'))} | {f(r.get('inductor_max_autotune_ms'))} | "
                     f"{f(ratio('inductor_ms'), '.2f')}x | {f(ratio('inductor_max_autotune_ms'), '.2f')}x | "
                     f"{f(r.get('fusekit_compile_s'), '.0f')} / {f(r.get('inductor_compile_s'), '.0f')} / "
                     f"{f(r.get('inductor_max_autotune_compile_s'), '.0f')} | {f(err, '.1e')} ({f(ref, '.1e')}) | {r.get('date', meta['date'])} |")
    ro = [r for r in recs if r.get("fusekit_reduce_overhead_ms") or r.get("inductor_reduce_overhead_ms")]
    if ro:
        lines += ["", "mode=\"reduce-overhead\" (both backends):", "", "| model | batch | fusekit | Inductor | x Inductor |", "|---|---:|---:|---:|---:|"]
        for r in ro:
            a, b = r.get("fusekit_reduce_overhead_ms"), r.get("inductor_reduce_overhead_ms")
            lines.append(f"| {r['model']} | {r['batch']} | {f(a)} | {f(b)} | {f(None if not a or b is None else b / a, '.2f')}x |")
    return "\n".join(lines) + "\n"


def plot(recs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in recs if r.get("fusekit_ms")]
    labels = [f"{r['model']} b{r['batch']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    for i, (key, name) in enumerate((("inductor_ms", "over Inductor"), ("inductor_max_autotune_ms", "over max-autotune"))):
        vals = [(r.get(key) or 0) / r["fusekit_ms"] for r in rows]
        ax.bar([j + 0.4 * i for j in range(len(rows))], vals, width=0.4, label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([j + 0.2 for j in range(len(rows))], labels, rotation=30, ha="right")
    ax.set_ylabel("speed-up of backend='fusekit'")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--max-autotune", action="store_true", help="also Inductor's max-autotune (minutes of compile per model)")
    ap.add_argument("--reduce-overhead", action="store_true", help="also both backends under mode='reduce-overhead' (inference)")
    ap.add_argument("--training", action="store_true", help="also AMP float16 training steps at --train-batch")
    ap.add_argument("--inference", action=argparse.BooleanOptionalAction, default=True, help="the inference records (--no-inference: training only)")
    ap.add_argument("--train-batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--merge", action=argparse.BooleanOptionalAction, default=True,
                    help="keep the rows of earlier runs in <GPU>-compile.json that this run does not measure again")
    args = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "torch": torch.__version__, "date": _dt.datetime.now().isoformat(timespec="seconds"), "iters": args.iters, "trials": args.trials}
    stem = os.path.join(args.out, f"{gpu.replace(' ', '-')}-compile")
    os.makedirs(args.out, exist_ok=True)
    recs: list[dict] = []
    if args.merge and os.path.exists(stem + ".json"):  # rows of earlier runs on this GPU stay unless measured again
        with open(stem + ".json") as fh:
            recs = json.load(fh)

    def save(rec: dict) -> None:
        rec.update(gpu=gpu, date=meta["date"], torch=meta["torch"])
        recs[:] = merge(recs, rec)
        log(json.dumps({k: v for k, v in rec.items() if not k.endswith("_error")}))
        with open(stem + ".json", "w") as fh:
            json.dump(recs, fh, indent=1)
        with open(stem + ".md", "w") as fh:
            fh.write(markdown(recs, meta))

    for name in args.models:
        for b in args.batches if args.inference else []:
            record(name, b, args.iters, args.trials, args.max_autotune, args.reduce_overhead, save)
        if args.training:
            train_record(name, args.train_batch, args.iters, args.trials, args.max_autotune, save)
    plot([r for r in recs if r["phase"] == "inference"], stem + ".png")
    print(markdown(recs, meta))


if __name__ == "__main__":
    main()
