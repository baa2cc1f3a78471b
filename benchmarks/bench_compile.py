"""torch.compile(backend="fusekit") against Inductor's default mode and max-autotune, in one process.

Inference only (the backend sends training graphs to Inductor): ResNet-50, EfficientNet-B0,
MobileNetV3-Large and ConvNeXt-Tiny at batch 1 and 32, float16 channels-last, eval under
``torch.no_grad()``, random weights with BN statistics of random images (benchmarks/zoo.py's
models), ``dynamic=False``. Each variant is compiled, called three times (the compile time is
until then), then timed: CUDA events, median of --trials trials of --iters calls, a fresh input
before each trial. Relative error of each against float32 eager.

    python benchmarks/bench_compile.py --models resnet50 efficientnet_b0 --batches 32 [--max-autotune]

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


def compiled_ms(model: torch.nn.Module, x: torch.Tensor, iters: int, trials: int, **kw: Any) -> tuple[float | None, float | None, str | None]:
    """(median ms per call, compile s, error) of torch.compile(model, **kw) on x."""
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
        return ms, compile_s, None
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        return None, None, f"{type(e).__name__}: {str(e)[:300]}"


def record(name: str, batch: int, iters: int, trials: int, max_autotune: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {"model": name, "mode": "inference", "phase": "inference", "batch": batch}
    m = build_model(name)
    half = copy.deepcopy(m).half().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, *image_size(name), device="cuda").half().contiguous(memory_format=torch.channels_last)
    variants: list[tuple[str, dict[str, Any]]] = [("fusekit", {"backend": "fusekit"}), ("inductor", {})]
    if max_autotune:
        variants.append(("inductor_max_autotune", {"mode": "max-autotune"}))
    for key, kw in variants:
        log(f"{name} b{batch}: {key}")
        ms, s, err = compiled_ms(half, x, iters, trials, **kw)
        rec[f"{key}_ms"], rec[f"{key}_compile_s"] = ms, s
        if err:
            rec[f"{key}_error"] = err
    with torch.no_grad():
        want = m(x.float())
        for key, kw in variants[:1]:
            torch._dynamo.reset()
            rec[f"{key}_rel_err"] = _rel(torch.compile(half, dynamic=False, **kw)(x), want)
        rec["torch_fp16_rel_err"] = _rel(half(x), want)
    return rec


def markdown(recs: list[dict], meta: dict) -> str:
    f = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"# torch.compile backends ({meta['gpu']})\n",
             f"Run {meta['date']}, torch {meta['torch']}, float16 channels-last, eval under no_grad, dynamic=False. Milliseconds per "
             f"forward, median of {meta['trials']} trials of {meta['iters']} calls (CUDA events, a fresh input before each trial); "
             "compile seconds until the third call.\n",
             "| model | batch | fusekit | Inductor | max-autotune | x Inductor | x max-autotune | compile s (fusekit / Inductor / max-autotune) | rel err (fp16 eager) |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in recs:
        fk = r.get("fusekit_ms")
        ratio = lambda k: None if fk is None or r.get(k) is None else r[k] / fk  # noqa: E731
        lines.append(f"| {r['model']} | {r['batch']} | {f(fk)} | {f(r.get('inductor_ms'))} | {f(r.get('inductor_max_autotune_ms'))} | "
                     f"{f(ratio('inductor_ms'), '.2f')}x | {f(ratio('inductor_max_autotune_ms'), '.2f')}x | "
                     f"{f(r.get('fusekit_compile_s'), '.0f')} / {f(r.get('inductor_compile_s'), '.0f')} / "
                     f"{f(r.get('inductor_max_autotune_compile_s'), '.0f')} | {f(r.get('fusekit_rel_err'), '.1e')} ({f(r.get('torch_fp16_rel_err'), '.1e')}) |")
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
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    recs = []
    for name in args.models:
        for b in args.batches:
            recs.append(record(name, b, args.iters, args.trials, args.max_autotune))
            log(json.dumps({k: v for k, v in recs[-1].items() if not k.endswith("_error")}))
    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "torch": torch.__version__, "date": _dt.datetime.now().isoformat(timespec="seconds"), "iters": args.iters, "trials": args.trials}
    for r in recs:
        r.update(gpu=gpu, date=meta["date"], torch=meta["torch"])
    stem = os.path.join(args.out, f"{gpu.replace(' ', '-')}-compile")
    with open(stem + ".json", "w") as fh:
        json.dump(recs, fh, indent=1)
    with open(stem + ".md", "w") as fh:
        fh.write(markdown(recs, meta))
    plot(recs, stem + ".png")
    print(markdown(recs, meta))


if __name__ == "__main__":
    main()
