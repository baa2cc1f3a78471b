"""Whole-model training steps: a torchvision model moved onto fusekit with ``fusekit.torch.convert``
against the same model in PyTorch eager, under torch.compile, and both captured in CUDA graphs.

    python benchmarks/bench_train_models.py --out benchmarks/results [--quick]

Cases: ResNet-18 and ResNet-50 (random weights, 1000 classes), batch 64, 224x224, channels-last, in
three precisions: ``amp-fp16`` (torch.autocast float16 + GradScaler), ``bf16`` (torch.autocast
bfloat16, no scaler) and ``fp32``; parameters stay float32 in all three. One step = forward,
cross-entropy on random labels, backward, SGD (momentum 0.9) step.

Timing: CUDA events around --iters steps per trial after --warmup steps, median over --trials, a fresh
random batch (the same sequence on every side) before each trial. ``*_graph_ms``: the whole step
captured in one CUDA graph (PyTorch's recipe: warm-up on a side stream, then capture) and replayed;
the captured steps run without GradScaler (its inf check reads the host), the rest is the same.
``*_graphed_ms``: the model's forward and backward made CUDA graphs (fusekit: ``fusekit.torch.graphed(model)``,
captured at its first steps; PyTorch: ``torch.cuda.make_graphed_callables``, autocast without its weight
cache), the loss, GradScaler and optimizer step run as usual around them: the ordinary training loop with the host cost of the layers gone.
``fusekit_replayed_ms``: ``fusekit.torch.replayed(model)``, uncaptured steps whose training forward and
backward replay from a tape recorded in steps before the timing, after which the weights go back to
the initial ones (the kernels launch from the host as usual; the modules' Python is gone). ``torch_compile_ms``: ``torch.compile(model)`` (default mode) for the --compile-precisions, null when
compiling the first step fails or takes longer than --compile-limit seconds. Every side starts from the same initial weights
and sees the same batches, so the losses after the timed steps (``*_loss``) are comparable.

Writes <out>/<GPU name, spaces as ->-train-models.json and .md after every case, and a plot (.png) at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fusekit
import fusekit.torch as ft
from fusekit.pipeline.bench import capture, cuda_time_ms
from report import grouped_bars, write_results

MODELS = ["resnet18", "resnet50"]
PRECISIONS = {"amp-fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Data:
    """A static (x, labels) batch refilled with fresh random values from a generator reset per side."""

    def __init__(self, batch: int, size: int, classes: int = 1000) -> None:
        self.x = torch.empty(batch, 3, size, size, device="cuda").contiguous(memory_format=torch.channels_last)
        self.y = torch.empty(batch, dtype=torch.long, device="cuda")
        self.classes, self.gen = classes, torch.Generator(device="cuda")

    def reset(self, seed: int = 0) -> None:
        self.gen.manual_seed(seed)
        self.refill()

    def refill(self) -> None:
        self.x.normal_(generator=self.gen)
        self.y.random_(0, self.classes, generator=self.gen)


def make_step(model: torch.nn.Module, data: Data, precision: str, captured: bool, lr: float = 0.01) -> tuple[Callable[[], Any], dict]:
    """A training step of ``model`` on ``data`` (its loss kept in the returned dict under "loss"). For a
    CUDA-graph capture (``captured``): no GradScaler and no autocast weight cache."""
    dtype = PRECISIONS[precision]
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gs = torch.amp.GradScaler("cuda", init_scale=2.0**10) if not captured and dtype == torch.float16 else None
    box: dict = {}

    def autocast() -> Any:
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=dtype, cache_enabled=not captured)

    def step() -> Any:
        with autocast():
            loss = F.cross_entropy(model(data.x), data.y)
        opt.zero_grad(set_to_none=True)
        if gs is not None:
            gs.scale(loss).backward()
            gs.step(opt)
            gs.update()
        else:
            loss.backward()
            opt.step()
        box["loss"] = loss
        return loss

    return step, box


def time_eager(model: torch.nn.Module, data: Data, precision: str, args: argparse.Namespace) -> tuple[float, float]:
    """(median ms per step, loss after the timed steps) of uncaptured steps (GradScaler in amp-fp16)."""
    model.train()
    step, box = make_step(model, data, precision, captured=False)
    data.reset()
    ms = cuda_time_ms(step, iters=args.iters, trials=args.trials, warmup=args.warmup, before_trial=data.refill)
    return ms, float(box["loss"])


def time_replayed(model: torch.nn.Module, data: Data, precision: str, args: argparse.Namespace) -> tuple[float | None, float | None, str]:
    """(median ms per step, loss, note) of uncaptured steps of ``fusekit.torch.replayed(model)``: its
    training forward and backward replayed from a tape recorded in steps before the timing, which
    then starts again from the initial weights with a new optimizer and scaler."""
    model = ft.replayed(model.train())
    start = copy.deepcopy(model.state_dict())
    step, box = make_step(model, data, precision, captured=False)
    data.reset()
    for _ in range(model.forward.warmup + 3):  # plans, then the two recordings that must agree
        step()
    if not model.forward.tapes:
        return None, None, f"not replayed: {model.forward.refused or 'no tape after the warm-up'}"
    # back to the initial weights and a new optimizer and scaler (loaded in place: the tape stays), so
    # the timed steps and the loss after them are those of the other sides
    model.load_state_dict(start)
    step, box = make_step(model, data, precision, captured=False)
    data.reset()
    ms = cuda_time_ms(step, iters=args.iters, trials=args.trials, warmup=args.warmup, before_trial=data.refill)
    if model.forward.replays < args.trials * args.iters:
        return None, None, f"not replayed after the reset: {model.forward.refused or 'the tape was dropped'}"
    return ms, float(box["loss"]), ""


def time_graph(model: torch.nn.Module, data: Data, precision: str, args: argparse.Namespace, side: str = "") -> tuple[float | None, float | None, str]:
    """(median ms per replay, loss after the timed replays, note) of the whole step captured in a CUDA graph."""
    model.train()
    step, box = make_step(model, data, precision, captured=True)
    data.reset()
    try:
        g = capture(step, warmup=args.warmup)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        return None, None, f"capture failed: {type(e).__name__}: {str(e)[:300]}"
    ms = cuda_time_ms(g.replay, iters=args.iters, trials=args.trials, warmup=1, before_trial=data.refill)
    torch.cuda.synchronize()
    loss = float(box["loss"])
    del g
    return ms, loss, ""


def time_graphed(model: torch.nn.Module, data: Data, precision: str, args: argparse.Namespace, side: str) -> tuple[float | None, float | None, str]:
    """(median ms per step, loss, note) of the ordinary step (GradScaler in amp-fp16) around the model's
    forward and backward made CUDA graphs: fusekit's side by ``fusekit.torch.graphed(model)`` (captured
    at its first steps, inside the warm-up), PyTorch's by ``torch.cuda.make_graphed_callables``."""
    model.train()
    dtype = PRECISIONS[precision]
    data.reset()
    try:
        if side == "fusekit":
            graphed = ft.graphed(model, warmup=max(args.warmup - 1, 1))
        else:
            with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None, cache_enabled=False):
                graphed = torch.cuda.make_graphed_callables(model, (data.x.clone(),))
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        return None, None, f"graphing failed: {type(e).__name__}: {str(e)[:300]}"
    step, box = make_step(graphed, data, precision, captured=False)
    data.reset()
    ms = cuda_time_ms(step, iters=args.iters, trials=args.trials, warmup=args.warmup, before_trial=data.refill)
    if side == "fusekit" and not graphed.forward.graphs:
        return None, None, f"not captured: {graphed.forward.refused or 'no graph after the warm-up'}"
    return ms, float(box["loss"]), ""


def time_compiled(model: torch.nn.Module, data: Data, precision: str, args: argparse.Namespace) -> tuple[float | None, float | None, str]:
    """(median ms per step, loss, note) of ``torch.compile(model)``: the first step (compile) in a thread
    given --compile-limit seconds, then timed as the eager steps."""
    if args.compile_limit <= 0 or precision not in args.compile_precisions:
        return None, None, "skipped"
    model.train()
    compiled = torch.compile(model)
    step, box = make_step(compiled, data, precision, captured=False)
    data.reset()
    out: dict = {}

    def work() -> None:
        try:
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            out["s"] = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001
            out["error"] = f"{type(e).__name__}: {str(e)[:300]}"

    th = threading.Thread(target=work, daemon=True)
    th.start()
    th.join(args.compile_limit)
    if th.is_alive():
        return None, None, f"skipped: compiling took over {args.compile_limit:.0f} s"
    if "error" in out:
        return None, None, "failed: " + out["error"]
    ms = cuda_time_ms(step, iters=args.iters, trials=args.trials, warmup=max(args.warmup - 1, 0), before_trial=data.refill)
    return ms, float(box["loss"]), f"compiled in {out['s']:.0f} s"


def _free() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def bench_case(name: str, precision: str, args: argparse.Namespace) -> dict:
    import torchvision

    rec: dict = {"model": name, "batch": args.batch, "size": args.size, "precision": precision, "layout": "channels_last"}
    torch.manual_seed(0)
    initial = getattr(torchvision.models, name)(weights=None).to(memory_format=torch.channels_last)  # CPU copy of the start
    fused, report = ft.convert(initial, fuse_residual=args.fuse_residual)
    rec["fuse_residual"], rec["route"] = args.fuse_residual, report.route
    rec["replaced"], rec["fused_groups"] = len(report.replaced), len(report.fused)
    rec["left_alone"] = sorted({t for _, t, _ in report.left_alone})
    data = Data(args.batch, args.size)

    fused = fused.cuda()
    rec["fusekit_ms"], rec["fusekit_loss"] = time_eager(fused, data, precision, args)
    log(f"{name} {precision}: fusekit {rec['fusekit_ms']:.2f} ms/step, loss {rec['fusekit_loss']:.4f}")
    fused = None
    _free()

    ms, loss, note = time_replayed(ft.convert(initial, fuse_residual=args.fuse_residual)[0].cuda(), data, precision, args)
    rec["fusekit_replayed_ms"], rec["fusekit_replayed_loss"] = ms, loss
    if note:
        rec["fusekit_replayed_note"] = note
    log(f"{name} {precision}: fusekit replayed {ms if ms is None else round(ms, 2)} ms/step, loss {loss} {note}")
    _free()

    eager = copy.deepcopy(initial).cuda()
    rec["torch_eager_ms"], rec["torch_eager_loss"] = time_eager(eager, data, precision, args)
    log(f"{name} {precision}: torch eager {rec['torch_eager_ms']:.2f} ms/step, loss {rec['torch_eager_loss']:.4f}")
    eager = None
    _free()

    for timer, kind, what in ((time_graph, "graph", "captured step"), (time_graphed, "graphed", "graphed forward/backward")):
        for side, model in (("fusekit", ft.convert(initial, fuse_residual=args.fuse_residual)[0]), ("torch", copy.deepcopy(initial))):
            ms, loss, note = timer(model.cuda(), data, precision, args, side)
            rec[f"{side}_{kind}_ms"], rec[f"{side}_{kind}_loss"] = ms, loss
            if note:
                rec[f"{side}_{kind}_note"] = note
            log(f"{name} {precision}: {side} {what} {ms if ms is None else round(ms, 2)} ms, loss {loss} {note}")
            model = None
            _free()

    ms, loss, note = time_compiled(copy.deepcopy(initial).cuda(), data, precision, args)
    rec["torch_compile_ms"], rec["torch_compile_loss"], rec["torch_compile_note"] = ms, loss, note
    log(f"{name} {precision}: torch.compile {ms if ms is None else round(ms, 2)} ms/step, loss {loss} ({note})")
    _free()

    def ratio(num: float | None, den: float | None) -> float | None:
        return None if num is None or den is None else round(num / den, 3)

    for k in ("torch_eager_ms", "torch_compile_ms"):
        rec[k.replace("_ms", "_over_fusekit")] = ratio(rec[k], rec["fusekit_ms"])
    rec["torch_graph_over_fusekit_graph"] = ratio(rec["torch_graph_ms"], rec["fusekit_graph_ms"])
    rec["torch_graphed_over_fusekit_graphed"] = ratio(rec["torch_graphed_ms"], rec["fusekit_graphed_ms"])
    rec["torch_eager_over_fusekit_graphed"] = ratio(rec["torch_eager_ms"], rec["fusekit_graphed_ms"])
    rec["torch_eager_over_fusekit_replayed"] = ratio(rec["torch_eager_ms"], rec["fusekit_replayed_ms"])
    return rec


def markdown(gpu: str, recs: list[dict], meta: dict) -> str:
    def f(v: Any, fmt: str = "{:.2f}") -> str:
        return "n/a" if v is None else fmt.format(v)

    lines = [
        f"# Training steps of whole models: fusekit.torch.convert vs PyTorch on {gpu}", "",
        f"- date: {meta['date']}; torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN backend {meta['cudnn']}, fusekit {meta['fusekit']}",
        (f"- batch {meta['batch']}, {meta['size']}x{meta['size']}, channels-last, random weights and labels, SGD momentum 0.9; "
        "amp-fp16 = autocast float16 + GradScaler, bf16 = autocast bfloat16, fp32 = float32 (parameters float32 in all)"),
        ("- fusekit = the model convert(model) returns, trained as it is (its default route: "
         f"{', '.join(sorted({str(r.get('route')) for r in recs}))}); "
         "fk replayed, fk graphed and fk captured wrap a converted model as named below"),
        (f"- median of {meta['trials']} trials of {meta['iters']} steps (CUDA events) after {meta['warmup']} warm-up steps, "
        "a fresh random batch before each trial, the same batches on every side; ratio = PyTorch time / fusekit time (> 1: fusekit faster)"),
        ("- replayed = fusekit.torch.replayed(model): the training forward and backward replayed from a tape (no CUDA graph); "
         "graphed = forward and backward as CUDA graphs (fusekit.torch.graphed; PyTorch's torch.cuda.make_graphed_callables), loss, GradScaler and optimizer "
         "as usual; captured = the whole step (forward, backward, optimizer) in one CUDA graph, without GradScaler"), "",
        ("| model | precision | fusekit ms | eager ms | eager/fk | fk replayed ms | eager/fk replayed | torch.compile ms | compile/fk | fk graphed ms | torch graphed ms | "
         "graphed torch/fk | eager/fk graphed | fk captured ms | torch captured ms | captured torch/fk | loss fk | loss eager | "
         "loss fk replayed | loss fk graphed | loss compile |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in recs:
        lines.append(
            f"| {r['model']} | {r['precision']} | {f(r['fusekit_ms'])} | {f(r['torch_eager_ms'])} | {f(r['torch_eager_over_fusekit'])} | "
            f"{f(r.get('fusekit_replayed_ms'))} | {f(r.get('torch_eager_over_fusekit_replayed'))} | "
            f"{f(r['torch_compile_ms'])} | {f(r['torch_compile_over_fusekit'])} | {f(r.get('fusekit_graphed_ms'))} | "
            f"{f(r.get('torch_graphed_ms'))} | {f(r.get('torch_graphed_over_fusekit_graphed'))} | {f(r.get('torch_eager_over_fusekit_graphed'))} | "
            f"{f(r['fusekit_graph_ms'])} | {f(r['torch_graph_ms'])} | "
            f"{f(r['torch_graph_over_fusekit_graph'])} | {f(r['fusekit_loss'], '{:.4f}')} | {f(r['torch_eager_loss'], '{:.4f}')} | "
            f"{f(r.get('fusekit_replayed_loss'), '{:.4f}')} | {f(r.get('fusekit_graphed_loss'), '{:.4f}')} | {f(r['torch_compile_loss'], '{:.4f}')} |"
        )
    lines += ["", "Conversion: " + "; ".join(sorted({f"{r['model']}: {r['replaced']} modules replaced, {r['fused_groups']} fused groups, "
                                                  f"left alone {', '.join(r['left_alone']) or 'nothing'}" for r in recs}))]
    notes = [(r, k) for r in recs for k in ("fusekit_replayed_note", "fusekit_graph_note", "torch_graph_note", "fusekit_graphed_note", "torch_graphed_note", "torch_compile_note") if r.get(k)]
    if notes:
        lines += ["", "Notes:"] + [f"- {r['model']} {r['precision']} {k.replace('_note', '')}: {r[k]}" for r, k in notes]
    return "\n".join(lines) + "\n"


def plot(recs: list[dict], gpu: str, path: str) -> None:
    """Bars of ms per training step for each model and precision: fusekit and PyTorch, uncaptured and captured."""
    variants = [("fusekit_ms", "fusekit.torch"), ("torch_eager_ms", "PyTorch eager"),
                ("fusekit_replayed_ms", "fusekit.torch, replayed (uncaptured)"), ("torch_compile_ms", "torch.compile"),
                ("fusekit_graphed_ms", "fusekit.torch, graphed forward/backward"), ("torch_graphed_ms", "PyTorch, graphed forward/backward"),
                ("fusekit_graph_ms", "fusekit.torch, step in a CUDA graph"), ("torch_graph_ms", "PyTorch, step in a CUDA graph")]
    grouped_bars(path, [f"{r['model']}\n{r['precision']}" for r in recs],
                 [(label, [r.get(k) for r in recs]) for k, label in variants if any(r.get(k) for r in recs)],
                 "ms per training step (median)", f"Training step, batch {recs[0]['batch']}, channels-last, {gpu}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the JSON and markdown results")
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile-limit", type=float, default=None,
                    help="seconds allowed for torch.compile's first step (0: skip; default 300, 0 with --quick)")
    ap.add_argument("--compile-precisions", nargs="+", default=["amp-fp16"], choices=list(PRECISIONS),
                    help="precisions timed under torch.compile (each compile takes minutes)")
    ap.add_argument("--fuse-residual", action=argparse.BooleanOptionalAction, default=True,
                    help="convert with fuse_residual (residual block ends as BN + add + ReLU graphs; the default)")
    ap.add_argument("--quick", action="store_true", help="ResNet-18, amp-fp16 only, 3 trials of 5 steps, no torch.compile")
    ap.add_argument("--suffix", default="", help="appended to the result files' stem (<GPU>-train-models<suffix>): a run of other "
                    "models beside the committed table")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_train_models: needs a CUDA GPU")
    if args.quick:
        args.models, args.precisions, args.trials, args.iters = ["resnet18"], ["amp-fp16"], 3, 5
    if args.compile_limit is None:
        args.compile_limit = 0.0 if args.quick else 300.0
    torch.backends.cudnn.benchmark = True  # eager's best cuDNN algorithms (fusekit picks its own plans)
    gpu = torch.cuda.get_device_name()
    from fusekit.engine.runtime import versions

    v = versions()
    meta = {
        "gpu": gpu, "date": _dt.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": getattr(v, "cudnn_backend", None), "fusekit": fusekit.__version__,
        "python": platform.python_version(), "batch": args.batch, "size": args.size, "iters": args.iters,
        "trials": args.trials, "warmup": args.warmup, "compile_limit_s": args.compile_limit,
    }
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, gpu.replace(" ", "-") + "-train-models" + args.suffix)
    recs: list[dict] = []
    for name in args.models:
        for precision in args.precisions:
            log(f"{name} batch {args.batch} {precision} ...")
            recs.append(bench_case(name, precision, args))
            write_results(stem, meta, recs, markdown(gpu, recs, meta))
    plot(recs, gpu, stem + ".png")
    log(f"wrote {stem}.json, {stem}.md and {stem}.png")
    print(markdown(gpu, recs, meta))


if __name__ == "__main__":
    main()
