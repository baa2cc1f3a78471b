"""Whole-network inference: fusekit.pipeline (one CUDA graph of fused cuDNN calls) and the drop-in
route (``fusekit.torch.convert`` in eval, uncaptured and captured) vs PyTorch eager, PyTorch eager
captured in a CUDA graph, and torch.compile, on torchvision models in float16 channels-last (random
weights, eval mode).

    python benchmarks/bench_pipeline.py --out benchmarks/results [--quick]
    python benchmarks/bench_pipeline.py --zoo --out benchmarks/results [--models a,timm:b] [--batches 1,32]
                                        [--max-autotune resnet50,efficientnet_b0] [--append]

--zoo: the CNN zoo (benchmarks/zoo.py), written to <GPU>-zoo.{json,md,png}.

Writes <out>/<GPU name, spaces as ->-pipeline.json and -pipeline.md. Timing: warm-up, then CUDA
events around --iters calls per trial, median over --trials, a fresh random input before each trial.
Peak memory: torch.cuda.max_memory_allocated from a clean baseline, weights included for both.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import os
import platform
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fusekit  # noqa: E402
import fusekit.pipeline as fp  # noqa: E402
import fusekit.torch as ft  # noqa: E402
from fusekit.pipeline.bench import capture, cuda_time_ms  # noqa: E402
from report import grouped_bars, write_results  # noqa: E402

CASES = [("resnet50", 1), ("resnet50", 32), ("resnet18", 32), ("mobilenet_v2", 32)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _model(name: str) -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, name)(weights=None).eval()


def _reset_mem() -> int:
    gc.collect()  # a converted model's fx forward holds reference cycles: freed here, not during the next measurement
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def bench_case(
    name: str, batch: int, dtype: str, iters: int, trials: int, compile_limit_s: float, compile_mode: str, agreement_inputs: int = 0,
    autotune: bool = False,
) -> dict:
    tdt = getattr(torch, dtype)
    shape = (batch, 3, 224, 224)
    rec: dict = {"model": name, "batch": batch, "dtype": dtype, "layout": "channels_last"}
    cpu_model = _model(name)
    x = torch.randn(shape, device="cuda", dtype=tdt).contiguous(memory_format=torch.channels_last)

    # fusekit pipeline
    base = _reset_mem()
    t0 = time.perf_counter()
    pipe = fp.compile(cpu_model, shape, dtype=dtype)
    rec["fusekit_build_s"] = round(time.perf_counter() - t0, 2)
    pipe.run(x, clone=False)
    torch.cuda.synchronize()
    rec["peak_mem_mb_fusekit_build"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    torch.cuda.reset_peak_memory_stats()  # from here: what running the compiled pipeline holds

    def fresh() -> None:
        x.normal_()
        pipe.input_buffer.copy_(x)

    rec["fusekit_ms"] = cuda_time_ms(pipe.replay, iters=iters, trials=trials, before_trial=fresh)
    rec["peak_mem_mb_fusekit"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    rec["weights_mb_fusekit"] = round(pipe.weight_bytes / 2**20, 1)
    mp = pipe.memory_plan
    rec["planned_activation_mb"] = round(mp.planned_bytes / 2**20, 1)
    rec["eager_sum_activation_mb"] = round(mp.eager_bytes / 2**20, 1)
    rec["fusekit_graph_captured"] = pipe.graph_captured
    rec["fallbacks"] = len(pipe.fallbacks)
    rec["fused_stages"] = sum(s.pattern.startswith(("conv", "linear")) for s in pipe.stages)
    roof = pipe.roofline()
    rec["stages"] = roof
    rec["stage_sum_ms"] = round(sum(r["ms"] or 0.0 for r in roof), 4)
    rec["floor_ms"] = round(sum(r["floor_ms"] for r in roof), 4)
    rec["floor_compute_ms"] = round(sum(r["floor_ms"] for r in roof if r["bound"] == "compute"), 4)
    rec["floor_memory_ms"] = round(sum(r["floor_ms"] for r in roof if r["bound"] == "memory"), 4)
    rec["peaks"] = pipe.peaks_text()
    log(f"{name} b{batch}: fusekit {rec['fusekit_ms']:.3f} ms (build {rec['fusekit_build_s']} s, {rec['fallbacks']} fallbacks)")
    if agreement_inputs and name.startswith("resnet"):
        rec.update(agreement(pipe, cpu_model, shape, agreement_inputs))
        log(f"{name} b{batch}: top-1 agreement with float32 eager {rec['top1_agreement']:.4f} on {rec['top1_inputs']} inputs, "
            f"median relative error {rec['rel_err_vs_fp32_median']:.2e}")
    rec["choices"] = pipe.choices
    pipe = None  # noqa: F841 - free the pipeline's buffers and graph
    _reset_mem()
    rec["fusekit_tuned_ms"] = None
    if autotune:  # every stage's key tuned (plans kept in the cache), then compiled and timed the same way
        t0 = time.perf_counter()
        tuned = fp.compile(cpu_model, shape, dtype=dtype, autotune=True)
        rec["fusekit_tune_s"] = round(time.perf_counter() - t0, 1)

        def fresh_t() -> None:
            x.normal_()
            tuned.input_buffer.copy_(x)

        rec["fusekit_tuned_ms"] = cuda_time_ms(tuned.replay,
                                               iters=iters, trials=trials, before_trial=fresh_t)
        log(f"{name} b{batch}: fusekit autotuned {rec['fusekit_tuned_ms']:.3f} ms (tuning and build {rec['fusekit_tune_s']} s)")
        tuned = None  # noqa: F841
        _reset_mem()
    rec["fusekit_best_ms"] = min(v for v in (rec["fusekit_ms"], rec["fusekit_tuned_ms"]) if v is not None)

    # PyTorch eager and eager in a CUDA graph
    base = _reset_mem()
    model = cpu_model.to("cuda", tdt).to(memory_format=torch.channels_last)
    with torch.inference_mode():
        rec["torch_eager_ms"] = cuda_time_ms(lambda: model(x), iters=iters, trials=trials, before_trial=lambda: x.normal_())
        rec["peak_mem_mb_eager"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    rec["eager_activation_peak_mb"] = round(rec["peak_mem_mb_eager"] - weights / 2**20, 1)
    log(f"{name} b{batch}: torch eager {rec['torch_eager_ms']:.3f} ms")
    with torch.no_grad():
        g = capture(lambda: model(x))
        rec["torch_graph_ms"] = cuda_time_ms(g.replay, iters=iters, trials=trials, before_trial=lambda: x.normal_())
    g = None  # noqa: F841
    log(f"{name} b{batch}: torch eager in a CUDA graph {rec['torch_graph_ms']:.3f} ms")

    # the drop-in route: the same model converted (folded conv+BN+ReLU, residual ends as one graph),
    # under no_grad (inference_mode runs the same graphs)
    dropin, report = ft.convert(model)
    rec["dropin_fused_groups"] = len(report.fused)
    with torch.no_grad():
        rec["fusekit_torch_ms"] = cuda_time_ms(lambda: dropin(x), iters=iters, trials=trials, before_trial=lambda: x.normal_())
        g = capture(lambda: dropin(x))
        rec["fusekit_torch_graph_ms"] = cuda_time_ms(g.replay, iters=iters, trials=trials, before_trial=lambda: x.normal_())
        g = None  # noqa: F841
        if name.startswith("resnet"):  # random-weight MobileNetV2's outputs (~1e-9) are below float16's range
            rec.update(dropin_error(dropin, model, shape, tdt))
    log(f"{name} b{batch}: fusekit.torch convert {rec['fusekit_torch_ms']:.3f} ms, in a CUDA graph {rec['fusekit_torch_graph_ms']:.3f} ms; "
        f"error against float32 {rec.get('dropin_rel_err_vs_fp32')} (eager float16 {rec.get('eager_rel_err_vs_fp32')})")
    dropin = None  # noqa: F841

    # torch.compile (skipped with null if it fails or takes longer than the limit)
    rec["torch_compile_ms"] = None
    rec["torch_compile_mode"] = compile_mode
    if compile_limit_s > 0:
        box: dict = {}

        def work() -> None:
            try:
                t = time.perf_counter()
                cm = torch.compile(model, mode=compile_mode)
                with torch.no_grad():
                    cm(x)
                    torch.cuda.synchronize()
                box["compile_s"] = time.perf_counter() - t
                box["cm"] = cm
            except Exception as e:  # noqa: BLE001
                box["error"] = f"{type(e).__name__}: {e}"[:300]

        th = threading.Thread(target=work, daemon=True)
        th.start()
        th.join(compile_limit_s)
        if th.is_alive():
            rec["torch_compile_note"] = f"skipped: compile took over {compile_limit_s:.0f} s"
        elif "error" in box:
            rec["torch_compile_note"] = "failed: " + box["error"]
        else:
            cm = box["cm"]
            with torch.no_grad():
                rec["torch_compile_ms"] = cuda_time_ms(lambda: cm(x), iters=iters, trials=trials, before_trial=lambda: x.normal_())
            rec["torch_compile_s"] = round(box["compile_s"], 1)
        log(f"{name} b{batch}: torch.compile {rec['torch_compile_ms']} ms {rec.get('torch_compile_note', '')}")
    for k in ("torch_eager_ms", "torch_graph_ms", "torch_compile_ms"):
        v = rec.get(k)
        rec[k.replace("_ms", "_over_fusekit")] = None if v is None else round(v / rec["fusekit_best_ms"], 3)
    for k in ("torch_eager_ms", "torch_graph_ms"):
        rec[k.replace("_ms", "_over_dropin")] = round(rec[k] / rec["fusekit_torch_ms"], 3)
    rec["torch_graph_over_dropin_graph"] = round(rec["torch_graph_ms"] / rec["fusekit_torch_graph_ms"], 3)
    model = None  # noqa: F841
    _reset_mem()
    return rec


def dropin_error(dropin: torch.nn.Module, model: torch.nn.Module, shape: tuple, tdt: Any) -> dict:
    """Relative error of the converted model and of float16 eager, both against float32 eager with the
    same weights, on one fresh random input."""
    ref = copy.deepcopy(model).float()  # the float16-rounded weights both run with
    x = torch.randn(shape, device="cuda").contiguous(memory_format=torch.channels_last)
    want = ref(x).double()
    err = lambda got: float((got.double() - want).norm() / want.norm())  # noqa: E731
    return {"dropin_rel_err_vs_fp32": err(dropin(x.to(tdt))), "eager_rel_err_vs_fp32": err(model(x.to(tdt)))}


def agreement(pipe: "fp.Pipeline", cpu_model: torch.nn.Module, shape: tuple, inputs: int) -> dict:
    """Top-1 agreement and relative error of the pipeline against the same weights in float32 eager,
    on ``inputs`` fresh random images (batches of the pipeline's size)."""
    ref = copy.deepcopy(cpu_model).to("cuda").to(memory_format=torch.channels_last)
    agree = total = 0
    errs = []
    with torch.no_grad():
        while total < inputs:
            x = torch.randn(shape, device="cuda").contiguous(memory_format=torch.channels_last)
            got, want = pipe(x).float(), ref(x)
            agree += int((got.argmax(1) == want.argmax(1)).sum())
            total += shape[0]
            errs.append(float((got - want).norm() / want.norm()))
    errs.sort()
    return {"top1_agreement": agree / total, "top1_inputs": total, "rel_err_vs_fp32_median": errs[len(errs) // 2],
            "rel_err_vs_fp32_max": errs[-1]}


def _section(title: str, text: str, header: str, rows: list[str]) -> list[str]:
    """A results section: its heading, what it shows, and a table (the first column left-aligned)."""
    return ["", f"## {title}", text, "", header, "|---|" + "---:|" * (header.count("|") - 2), *rows]


def markdown(gpu: str, recs: list[dict], meta: dict) -> str:
    lines = [
        f"# fusekit.pipeline vs PyTorch on {gpu}", "",
        f"- date: {meta['date']}", *([f"- {meta['note']}"] if meta.get("note") else []), f"- torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN backend {meta['cudnn']}, fusekit {meta['fusekit']}",
        f"- float16 channels-last, random weights, eval mode; median of {meta['trials']} trials of {meta['iters']} calls (CUDA events), "
        "fresh random input before each trial; fk = the better of fusekit with heuristic plans and fusekit autotuned; "
        "ratio = PyTorch time / fk time (> 1: fusekit faster)", "",
        "| model | batch | fusekit ms | autotuned ms | eager ms | eager graph ms | torch.compile ms | eager/fk | graph/fk | compile/fk | peak MB fk | peak MB eager | fallbacks | top-1 vs fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(v, fmt="{:.3f}"):
        return "n/a" if v is None else fmt.format(v)

    for r in recs:
        lines.append(
            f"| {r['model']} | {r['batch']} | {f(r['fusekit_ms'])} | {f(r.get('fusekit_tuned_ms'))} | {f(r['torch_eager_ms'])} | {f(r['torch_graph_ms'])} | "
            f"{f(r['torch_compile_ms'])} | {f(r['torch_eager_over_fusekit'], '{:.2f}')} | {f(r['torch_graph_over_fusekit'], '{:.2f}')} | "
            f"{f(r['torch_compile_over_fusekit'], '{:.2f}')} | {r['peak_mem_mb_fusekit']} | {r['peak_mem_mb_eager']} | {r['fallbacks']} | "
            f"{f(r.get('top1_agreement'), '{:.3f}')} |"
        )
    lines += _section(
        "The drop-in route: fusekit.torch.convert, eval",
        "The same model converted with `fusekit.torch.convert` (convolutions with their BN folded and ReLU fused, "
        "residual block ends as one conv+bias+add+ReLU graph), run under no_grad, uncaptured and captured in a CUDA "
        "graph; timed as above. Error: relative L2 against float32 eager with the same weights on one random input, "
        "with float16 eager's beside it (ResNets; random-weight MobileNetV2's outputs, ~1e-9, are below float16's "
        "range in both). ratio = PyTorch time / drop-in time.",
        "| model | batch | drop-in ms | drop-in graph ms | eager ms | eager graph ms | eager/drop-in | graph/drop-in graph | fused groups | error drop-in | error eager fp16 |",
        [f"| {r['model']} | {r['batch']} | {r['fusekit_torch_ms']:.3f} | {r['fusekit_torch_graph_ms']:.3f} | "
         f"{r['torch_eager_ms']:.3f} | {r['torch_graph_ms']:.3f} | {r['torch_eager_over_dropin']:.2f} | "
         f"{r['torch_graph_over_dropin_graph']:.2f} | {r['dropin_fused_groups']} | "
         f"{f(r.get('dropin_rel_err_vs_fp32'), '{:.1e}')} | {f(r.get('eager_rel_err_vs_fp32'), '{:.1e}')} |" for r in recs if "fusekit_torch_ms" in r])
    lines += _section(
        "What bounds each model",
        "Per stage: its GPU time (the stage alone captured in a CUDA graph, median of 10 replays) against its roofline "
        "floor max(flops / peak, bytes / bandwidth), peaks measured in the same process (fp16 8192^3 matmul, 256 MiB "
        "device copy). Sums over stages; graph / floor: the whole forward's replay time over the summed floors.",
        "| model | batch | graph ms | stage sum ms | floor ms | compute-bound floor ms | memory-bound floor ms | graph / floor |",
        [f"| {r['model']} | {r['batch']} | {r['fusekit_best_ms']:.3f} | {r['stage_sum_ms']:.3f} | {r['floor_ms']:.3f} | "
         f"{r['floor_compute_ms']:.3f} | {r['floor_memory_ms']:.3f} | {r['fusekit_best_ms'] / max(r['floor_ms'], 1e-9):.1f} |" for r in recs if "floor_ms" in r])
    lines += _section(
        "Memory",
        "fusekit: while replaying the compiled pipeline (its weights, planned activation buffers, the CUDA graph's pool and "
        "workspaces) and at its peak while compiling (both weight copies, per-stage timing graphs); eager: peak of a forward "
        "under inference_mode, and that peak less the weights (its activations). MB = MiB.",
        "| model | batch | fk running MB | fk compile peak MB | fk weights MB | fk planned activations MB | eager peak MB | eager activations MB | PyTorch kernels chosen |",
        [f"| {r['model']} | {r['batch']} | {r['peak_mem_mb_fusekit']} | {r.get('peak_mem_mb_fusekit_build', 'n/a')} | "
         f"{r.get('weights_mb_fusekit', 'n/a')} | {r['planned_activation_mb']} | {r['peak_mem_mb_eager']} | "
         f"{r.get('eager_activation_peak_mb', 'n/a')} | {len(r.get('choices', []))} |" for r in recs])
    for r in recs:
        if r.get("stages"):
            top = sorted(r["stages"], key=lambda t: -(t["ms"] or 0))[:8]
            lines += ["", f"### {r['model']} batch {r['batch']}: the 8 slowest stages ({r.get('peaks', '')})", "",
                      "| # | pattern | kernel | in -> out | ms | floor ms | bound | x floor |", "|---:|---|---|---|---:|---:|---|---:|"]
            for t in top:
                shp = ", ".join("x".join(map(str, x)) for x in t["in"]) + " -> " + "x".join(map(str, t["out"]))
                xf = "n/a" if t["x_floor"] is None else f"{t['x_floor']:.1f}"
                kern = "PyTorch (measured faster)" if t.get("engine", "").startswith("torch (faster") else "fusekit"
                lines.append(f"| {t['stage']} | {t['pattern']} | {kern} | {shp} | {t['ms'] or 0:.4f} | {t['floor_ms']:.4f} | {t['bound']} | {xf} |")
    notes = [r for r in recs if r.get("torch_compile_note")]
    if notes:
        lines += ["", "torch.compile notes:"] + [f"- {r['model']} b{r['batch']}: {r['torch_compile_note']}" for r in notes]
    return "\n".join(lines) + "\n"


def plot(recs: list[dict], gpu: str, path: str) -> None:
    """Bars of time per forward (log scale) for each model and batch: fusekit and the PyTorch variants."""
    variants = [("fusekit_best_ms", "fusekit pipeline"), ("fusekit_torch_ms", "fusekit.torch convert"),
                ("fusekit_torch_graph_ms", "fusekit.torch convert, CUDA graph"), ("torch_eager_ms", "PyTorch eager"),
                ("torch_graph_ms", "PyTorch eager, CUDA graph"), ("torch_compile_ms", "torch.compile")]
    grouped_bars(path, [f"{r['model']}\nbatch {r['batch']}" for r in recs], [(label, [r.get(k) for r in recs]) for k, label in variants],
                 "ms per forward (median, log scale)", f"Whole-network inference, float16 channels-last, {gpu}", log=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the JSON and markdown results")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--compile-limit", type=float, default=120.0, help="seconds allowed for torch.compile (0: skip it)")
    ap.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    ap.add_argument("--agreement", type=int, default=256, help="random inputs for the top-1 agreement check (ResNets; 0: skip)")
    ap.add_argument("--quick", action="store_true", help="resnet50 batch 1 only, fewer trials, no torch.compile")
    ap.add_argument("--autotune", action="store_true", help="also compile with every stage autotuned and time that")
    ap.add_argument("--cases", default="", help="model:batch list to run instead of all, e.g. resnet50:32,mobilenet_v2:32")
    ap.add_argument("--zoo", action="store_true", help="the CNN zoo: torchvision and timm CNNs against eager, its CUDA graph and max-autotune")
    ap.add_argument("--models", default="", help="--zoo: comma-separated models (timm ones as timm:NAME); default: the zoo's list")
    ap.add_argument("--batches", default="1,32", help="--zoo: batch sizes")
    ap.add_argument("--max-autotune", default="", help="--zoo: models to also time under torch.compile(mode='max-autotune') at batch >= 32")
    ap.add_argument("--append", action="store_true", help="--zoo: keep the records already in the results file (other models' rows)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_pipeline: needs a CUDA GPU")
    if args.zoo:
        import zoo

        models = args.models.split(",") if args.models else zoo.TORCHVISION_CNNS + zoo.TIMM_CNNS
        zoo.run(args.out, models, [int(b) for b in args.batches.split(",")], args.iters, args.trials,
                set(filter(None, args.max_autotune.split(","))), args.append, args.autotune)
        return
    cases = CASES[:1] if args.quick else CASES
    if args.cases:
        cases = [(m, int(b)) for m, b in (c.split(":") for c in args.cases.split(","))]
    if args.quick:
        args.trials, args.compile_limit = 5, 0.0
    gpu = torch.cuda.get_device_name()
    from fusekit.engine.runtime import versions

    v = versions()
    meta = {
        "gpu": gpu, "date": _dt.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": getattr(v, "cudnn_backend", None), "fusekit": fusekit.__version__,
        "python": platform.python_version(), "iters": args.iters, "trials": args.trials,
    }
    recs = []
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, gpu.replace(" ", "-") + "-pipeline")
    for name, batch in cases:
        log(f"{name} batch {batch} ...")
        recs.append(bench_case(name, batch, args.dtype, args.iters, args.trials, args.compile_limit, args.compile_mode,
                               args.agreement if batch > 1 else 0, args.autotune))
        write_results(stem, meta, recs, markdown(gpu, recs, meta))
    plot(recs, gpu, stem + ".png")
    log(f"wrote {stem}.json, {stem}.md and {stem}.png")
    print(markdown(gpu, recs, meta))


if __name__ == "__main__":
    main()
