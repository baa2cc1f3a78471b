"""The CNN zoo (``bench_pipeline.py --zoo``): torchvision classifiers and timm CNNs compiled into
fusekit pipelines against PyTorch eager, eager captured in a CUDA graph and (where asked)
torch.compile(mode="max-autotune"), all in one process, float16 channels-last, eval, random
weights with BN statistics of random images (non-trivial), CUDA events, medians, fresh inputs.

Writes <out>/<GPU>-zoo.json (a list of records), -zoo.md and -zoo.png (each model's speed-up over
the best PyTorch variant measured).
"""

from __future__ import annotations

import collections
import copy
import datetime as _dt
import gc
import json
import math
import os
import time
import traceback
from typing import Any

import torch

import fusekit.pipeline as fp
from fusekit.pipeline.bench import capture, cuda_time_ms

#: The CNN families the issue names (torchvision) and timm CNNs of different families.
TORCHVISION_CNNS = [
    "resnet50", "resnext50_32x4d", "wide_resnet50_2", "regnet_x_800mf", "regnet_y_800mf", "efficientnet_b0", "efficientnet_b2",
    "efficientnet_v2_s", "mobilenet_v2", "mobilenet_v3_large", "mnasnet1_0", "densenet121", "shufflenet_v2_x1_0", "squeezenet1_1",
    "googlenet", "inception_v3", "vgg16_bn", "convnext_tiny",
]
TIMM_CNNS = ["timm:resnet50d", "timm:efficientnet_b0", "timm:mobilenetv3_large_100", "timm:regnety_016", "timm:rexnet_100",
             "timm:ecaresnet50t", "timm:cspresnet50", "timm:densenet121", "timm:convnext_nano", "timm:ghostnet_100",
             "timm:mixnet_s", "timm:dla34", "timm:resnest14d", "timm:skresnet18", "timm:nfnet_l0", "timm:tf_efficientnet_b0",
             "timm:hrnet_w18_small", "timm:inception_v3"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(name: str) -> torch.nn.Module:
    """A model with random weights whose BN statistics are those of random images (float32, cuda, eval)."""
    torch.manual_seed(0)
    if name.startswith("timm:"):
        import timm

        m = timm.create_model(name[5:], pretrained=False)
    else:
        import torchvision

        m = torchvision.models.get_model(name, weights=None, **({"aux_logits": False, "init_weights": False} if name in ("inception_v3", "googlenet") else {}))
    m = m.cuda().float()
    for mod in m.modules():
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
            mod.reset_running_stats()
            mod.momentum = None
    m.train()
    with torch.no_grad():
        m(torch.randn(16, 3, *image_size(name), device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)))
    return m.eval()


def image_size(name: str) -> tuple[int, int]:
    return (299, 299) if "inception" in name else (224, 224)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _best(rec: dict[str, Any]) -> None:
    """The best PyTorch figure over the best fusekit one (the heuristic pipeline's, or the autotuned one's where timed)."""
    best = min(v for v in (rec.get("torch_eager_ms"), rec.get("torch_graph_ms"), rec.get("torch_compile_max_autotune_ms")) if v)
    own = min(v for v in (rec["fusekit_ms"], rec.get("fusekit_autotuned_ms")) if v)
    rec["best_torch_ms"], rec["speedup_vs_best"] = best, best / own


def bench_model(name: str, batch: int, iters: int, trials: int, max_autotune: bool, save: Any = None,
                autotune: bool = False) -> dict[str, Any]:
    """One record: the pipeline and the PyTorch peers on the same model and batch. ``save(rec)`` is
    called before the max-autotune compile (minutes), so a run stopped during it keeps the rest.
    ``autotune``: also the pipeline compiled with every stage's plan autotuned (``fusekit_autotuned_ms``)."""
    rec: dict[str, Any] = {"model": name, "batch": batch, "compiled": False, "error": None}
    shape = (batch, 3, *image_size(name))
    try:
        m = build_model(name)
    except Exception as e:  # noqa: BLE001 - a model this timm / torchvision cannot build here
        rec["error"] = f"model: {type(e).__name__}: {e}"
        return rec
    half = copy.deepcopy(m).half().to(memory_format=torch.channels_last)
    x = torch.randn(shape, device="cuda").half().contiguous(memory_format=torch.channels_last)

    def fresh() -> None:
        x.normal_()

    with torch.no_grad():
        rec["torch_eager_ms"] = cuda_time_ms(lambda: half(x), iters=iters, trials=trials, before_trial=fresh)
        try:
            g = capture(lambda: half(x))
            rec["torch_graph_ms"] = cuda_time_ms(g.replay, iters=iters, trials=trials, before_trial=fresh)
        except Exception as e:  # noqa: BLE001
            rec["torch_graph_error"] = f"{type(e).__name__}: {e}"
    t0 = time.perf_counter()
    try:
        pipe = fp.compile(m, torch.zeros(shape), dtype="float16")
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc(limit=4)
        return rec
    rec.update(compiled=True, fusekit_compile_s=time.perf_counter() - t0, graph_captured=pipe.graph_captured, stages=len(pipe.stages),
               fused_stages=pipe.program.fused_stages, choices=len(pipe.choices), build_fallbacks=pipe.build_fallbacks)
    split = pipe.time_split()
    rec.update(fused_time_fraction=split["fused_time_fraction"], torch_by_op={k: round(v, 4) for k, v in split["torch_by_op"].items()})
    rec["fused_stage_fraction"] = pipe.program.fused_fraction
    rec["engines"] = dict(collections.Counter(f"{s.pattern}: {e.split(' (')[0]}" for s, e in zip(pipe.stages, pipe.engines)))  # what ran each stage
    xin = pipe.input_buffer
    rec["fusekit_ms"] = cuda_time_ms(lambda: pipe.run(xin, clone=False), iters=iters, trials=trials, before_trial=lambda: xin.normal_())
    accuracy(rec, pipe, m, half, shape)
    del pipe
    if autotune:
        t0 = time.perf_counter()
        try:
            tuned = fp.compile(m, torch.zeros(shape), dtype="float16", autotune=True)
            rec["fusekit_autotune_s"] = time.perf_counter() - t0
            xt = tuned.input_buffer
            rec["fusekit_autotuned_ms"] = cuda_time_ms(lambda: tuned.run(xt, clone=False), iters=iters, trials=trials, before_trial=lambda: xt.normal_())
            del tuned
        except Exception as e:  # noqa: BLE001 - recorded; the heuristic figure stands
            rec["fusekit_autotune_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    _best(rec)
    if max_autotune:
        if save is not None:
            save(dict(rec, torch_compile_error="the max-autotune compile did not finish in this run"))
        compiled_peer(rec, half, x, iters, trials, fresh)
        _best(rec)
    del half, m
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def accuracy(rec: dict, pipe: Any, m: torch.nn.Module, half: torch.nn.Module, shape: tuple) -> None:
    """Relative error of the pipeline and of PyTorch float16 against float32 eager; top-1 agreement of each."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    errs, ferrs, agree, fagree, n = [], [], 0, 0, 0
    with torch.no_grad():
        for _ in range(4):
            xi = torch.randn(shape, device="cuda", generator=gen)
            want, y = m(xi).float(), pipe(xi).float()
            h = half(xi.half().contiguous(memory_format=torch.channels_last)).float()
            errs.append(_rel(y, want))
            ferrs.append(_rel(h, want))
            agree += int((y.argmax(1) == want.argmax(1)).sum())
            fagree += int((h.argmax(1) == want.argmax(1)).sum())
            n += shape[0]
    rec.update(rel_err=max(errs), torch_fp16_rel_err=max(ferrs), top1_agreement=agree / n, torch_fp16_top1_agreement=fagree / n)


def compiled_peer(rec: dict, half: torch.nn.Module, x: torch.Tensor, iters: int, trials: int, fresh: Any) -> None:
    """torch.compile(mode="max-autotune") (its CUDA graphs included), timed after its compile."""
    import torch._dynamo

    torch._dynamo.reset()
    t0 = time.perf_counter()
    try:
        c = torch.compile(half, mode="max-autotune", dynamic=False)
        with torch.no_grad():
            for _ in range(3):
                c(x)
            torch.cuda.synchronize()
            rec["torch_compile_max_autotune_s"] = time.perf_counter() - t0
            rec["torch_compile_max_autotune_ms"] = cuda_time_ms(lambda: c(x), iters=iters, trials=trials, before_trial=fresh)
    except Exception as e:  # noqa: BLE001
        rec["torch_compile_error"] = f"{type(e).__name__}: {str(e)[:300]}"


def markdown(recs: list[dict], meta: dict) -> str:
    """The results table; each row names the run (its start time) it was measured in."""
    runs = sorted({r.get("date", meta["date"]) for r in recs})
    head = (f"# The CNN zoo: fusekit pipeline vs PyTorch ({meta['gpu']})\n\nRuns {', '.join(runs)} (each row names its own), torch "
            f"{meta['torch']}, cuDNN {meta['cudnn']}, float16 channels-last, eval, random weights with BN statistics of random images. "
            f"Milliseconds per forward, median of {meta['trials']} trials of {meta['iters']} calls (CUDA events, a fresh input before "
            f"each trial); 'best PyTorch' is the fastest of eager, eager in a CUDA graph and (where run) torch.compile max-autotune, "
            f"in the same process as the row's fusekit figure; 'tuned': the pipeline compiled with every stage's plan autotuned "
            f"(the speed-up takes fusekit's faster figure).\n\n")
    cols = ("| model | batch | fusekit | eager | eager CUDA graph | max-autotune (compile s) | x best PyTorch | fused time | fused stages "
            "| rel err (PyTorch fp16) | top-1 | run |")
    rows = [cols, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def f(v: Any, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    def tuned(r: dict) -> str:
        return "" if r.get("fusekit_autotuned_ms") is None else f" / {f(r['fusekit_autotuned_ms'])} tuned"

    for r in recs:
        if not r.get("compiled"):
            rows.append(f"| {r['model']} | {r['batch']} | **fails**: {str(r.get('error'))[:120]} | {f(r.get('torch_eager_ms'))} | "
                        f"{f(r.get('torch_graph_ms'))} | | | | | | | {r.get('date', '')} |")
            continue
        mat = r.get("torch_compile_max_autotune_ms")
        rows.append(
            f"| {r['model']} | {r['batch']} | {f(r['fusekit_ms'])}{tuned(r)} | {f(r.get('torch_eager_ms'))} | {f(r.get('torch_graph_ms'))} | "
            f"{f(mat)}{'' if mat is None else ' (' + format(r['torch_compile_max_autotune_s'], '.0f') + ')'} | "
            f"{f(r['speedup_vs_best'], '.2f')}x | {r['fused_time_fraction']:.0%} | {r['fused_stages']}/{r['stages']} | "
            f"{r['rel_err']:.1e} ({r['torch_fp16_rel_err']:.1e}) | {r['top1_agreement']:.2f} ({r['torch_fp16_top1_agreement']:.2f}) | "
            f"{r.get('date', '')} |")
    ok = [r for r in recs if r.get("compiled") and r["batch"] >= 32]
    geo = math.exp(sum(math.log(r["speedup_vs_best"]) for r in ok) / len(ok)) if ok else None
    tail = f"\n\nGeometric mean speed-up over the best PyTorch variant at batch >= 32: {f(geo, '.2f')}x over {len(ok)} models.\n"
    return head + "\n".join(rows) + tail


def plot(recs: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in recs if r.get("compiled")]
    if not ok:
        return
    labels = [f"{r['model']} b{r['batch']}" for r in ok]
    vals = [r["speedup_vs_best"] for r in ok]
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(ok) + 1.5))
    ax.barh(labels, vals, color=["tab:green" if v >= 1 else "tab:red" for v in vals])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("speed-up of the fusekit pipeline over the best PyTorch variant (x)")
    ax.set_title(f"CNN zoo, float16 channels-last, {meta['gpu']}", fontsize=10)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(out: str, models: list[str], batches: list[int], iters: int, trials: int, max_autotune: set[str], append: bool,
        autotune: bool = False) -> None:
    from fusekit.engine.runtime import versions

    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "date": _dt.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "cudnn": getattr(versions(), "cudnn_backend", None), "iters": iters, "trials": trials}
    stem = os.path.join(out, gpu.replace(" ", "-") + "-zoo")
    recs: list[dict] = []
    if append and os.path.exists(stem + ".json"):
        with open(stem + ".json") as fh:
            recs = json.load(fh)
    os.makedirs(out, exist_ok=True)
    def save(rec: dict) -> None:  # a record replaces the file's row of its model and batch
        nonlocal recs
        rec.update(gpu=gpu, date=meta["date"], torch=meta["torch"], cudnn=meta["cudnn"])
        recs = [r for r in recs if (r["model"], r["batch"]) != (rec["model"], rec["batch"])] + [rec]
        with open(stem + ".json", "w") as fh:
            json.dump(recs, fh, indent=1, default=str)
        with open(stem + ".md", "w") as fh:
            fh.write(markdown(recs, meta))

    for i, name in enumerate(models):
        for batch in batches:
            log(f"[{i + 1}/{len(models)}] {name} batch {batch} ...")
            rec = bench_model(name, batch, iters, trials, name in max_autotune and batch >= 32, save, autotune)
            save(rec)
            log(f"  fusekit {rec.get('fusekit_ms')} ms, eager graph {rec.get('torch_graph_ms')}, "
                f"max-autotune {rec.get('torch_compile_max_autotune_ms')}, error {rec.get('error')}")
    plot(recs, meta, stem + ".png")
    print(markdown(recs, meta))
