"""Autotuner and persistent cache on ResNet-50 conv shapes (fp16 NHWC, batch 32), on a GPU.

    python benchmarks/bench_autotune.py [--out benchmarks/results] [--shapes N]

Per shape: heuristic vs tuned device time (CUDA-graph replays, as bench_conv.py); the tuned
choice against an independent re-timing of every candidate; the wall time of tuning one key.
Then, in fresh processes: first-call latency with an empty cache dir (heuristics + build) vs a
warm one (plans loaded from disk). Writes <gpu>-autotune.json/.md and a plot of candidate spreads.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fusekit  # noqa: E402
from bench_conv import BATCH, RESNET50  # noqa: E402
from bench_conv import graph_time_us as bench_graph_time_us  # noqa: E402
from timing import cl, graph_time_us  # noqa: E402
from fusekit.engine.cache import DiskStore, PlanCache  # noqa: E402

SWEEP_REPEATS = 15


def operands(c, h, w, k, r):
    x = [cl(torch.randn(BATCH, c, h, w, device="cuda", dtype=torch.float16)) for _ in range(4)]
    wt = cl(torch.randn(k, c, r, r, device="cuda", dtype=torch.float16) / math.sqrt(c * r * r))
    b = torch.randn(k, device="cuda", dtype=torch.float16)
    return x, wt, b


def sweep(plan, x, wt, b, out) -> dict[int, float]:
    """Independent re-timing of every candidate the tuner ran ok (more repeats, fresh events)."""
    g, uids = plan.graph, plan.uids
    ok = [c for c in plan.tuning if c["verdict"] == "ok"]
    ws = torch.empty(max(c["workspace"] for c in ok) + 1, dtype=torch.uint8, device="cuda")
    res = {}
    bufs = [[xi, wt, b, out] for xi in x]
    for c in ok:
        res[c["index"]] = graph_time_us(lambda i, idx=c["index"]: g.execute_plan_at_index(bufs[i % len(bufs)], ws, idx, _handle(), tensor_uids=uids),
                                        reps=4 * len(bufs), trials=SWEEP_REPEATS, warm=len(bufs))
    return res


def _handle():
    """The cuDNN handle of the current torch stream (the timer captures on its own stream)."""
    return fusekit.engine.runtime.current_runtime().handle(fusekit.adapters.library("torch"), 0, torch.cuda.current_stream().cuda_stream)


CHILD = textwrap.dedent(
    """
    import json, math, sys, time, torch, fusekit
    shapes = json.loads(sys.argv[1])
    out = []
    for c, h, w, k, r, s in shapes:
        x = torch.randn(32, c, h, w, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        wt = (torch.randn(k, c, r, r, device="cuda") / math.sqrt(c * r * r)).half().contiguous(memory_format=torch.channels_last)
        b = torch.randn(k, device="cuda", dtype=torch.float16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = fusekit.conv_bias_relu(x, wt, b, padding=r // 2, stride=s)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        plan = fusekit.plan_for("conv_bias_relu", x, wt, b, padding=r // 2, stride=s)
        out.append(dict(ms=ms, source=plan.source, engine=plan.engine))
    print(json.dumps(out))
    """
)


def first_calls(shapes, cache_dir: str) -> list[dict]:
    env = dict(os.environ, FUSEKIT_CACHE_DIR=cache_dir)
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(shapes)], env=env, capture_output=True, text=True, timeout=500)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", type=int, default=len(RESNET50))
    ap.add_argument("--budget", type=float, default=2.0, help="tuning budget per key, seconds")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    shapes = RESNET50[: args.shapes]
    tmp = tempfile.mkdtemp(prefix="fusekit-bench-")
    heur = PlanCache(store=None)
    tuned = PlanCache(store=DiskStore(tmp))
    rows = []
    for i, (c, h, w, k, r, s) in enumerate(shapes):
        x, wt, b = operands(c, h, w, k, r)
        attrs = dict(padding=r // 2, stride=s)
        ho, wo = (h + 2 * (r // 2) - r) // s + 1, (w + 2 * (r // 2) - r) // s + 1
        outs = [cl(torch.empty(BATCH, k, ho, wo, device="cuda", dtype=torch.float16)) for _ in range(4)]
        hp = fusekit.plan_for("conv_bias_relu", x[0], wt, b, out=outs[0], cache=heur, **attrs)
        res = fusekit.autotune("conv_bias_relu", x[0], wt, b, out=outs[0], cache=tuned,
                               options=fusekit.TuneOptions(budget_s=args.budget), **attrs)
        tp = fusekit.plan_for("conv_bias_relu", x[0], wt, b, out=outs[0], cache=tuned, **attrs)
        t_heur = bench_graph_time_us(lambda j: fusekit.call("conv_bias_relu", x[j % 4], wt, b, out=outs[j % 4], cache=heur, **attrs))
        t_tuned = bench_graph_time_us(lambda j: fusekit.call("conv_bias_relu", x[j % 4], wt, b, out=outs[j % 4], cache=tuned, **attrs))
        sw = sweep(tp, x, wt, b, outs[0])
        fastest = min(sw.values())
        row = dict(
            shape=dict(C=c, H=h, W=w, K=k, R=r, stride=s),
            heuristic_engine=hp.engine, tuned_engine=tp.engine,
            heuristic_us=t_heur, tuned_us=t_tuned, speedup=t_heur / t_tuned,
            tune_seconds=res.seconds, candidates=len(res.candidates),
            ok=sum(c_.verdict == "ok" for c_ in res.candidates),
            verdicts={v: sum(c_.verdict.split(":")[0] == v for c_ in res.candidates) for v in ("ok", "rejected", "skipped", "failed")},
            sweep_us=sw, sweep_tuned_us=sw.get(res.best, float("nan")), sweep_fastest_us=fastest,
            tuned_vs_fastest=sw.get(res.best, float("nan")) / fastest,
            candidate_us=[c_.time_us for c_ in res.candidates if c_.verdict == "ok"],
        )
        rows.append(row)
        print(f"[{i + 1}/{len(shapes)}] C={c} {h}x{w} K={k} {r}x{r}/s{s}: heuristic {t_heur:.1f} us, tuned {t_tuned:.1f} us "
              f"({row['speedup']:.2f}x), tuned/fastest-in-sweep {row['tuned_vs_fastest']:.3f}, tuning {res.seconds:.2f} s, "
              f"{row['ok']}/{row['candidates']} candidates ok", flush=True)
    cold = first_calls(shapes, tempfile.mkdtemp(prefix="fusekit-cold-"))
    warm = first_calls(shapes, tmp)  # the tuned plans written above
    for row, c_, w_ in zip(rows, cold, warm):
        row.update(cold_first_ms=c_["ms"], warm_first_ms=w_["ms"], warm_source=w_["source"])
    v = fusekit.engine.runtime.versions()
    props = torch.cuda.get_device_properties(0)
    sps = [r_["speedup"] for r_ in rows]
    meta = dict(
        gpu=props.name, cc=f"{props.major}{props.minor}", cudnn_backend=v.cudnn_backend, frontend=v.frontend,
        torch=torch.__version__, date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), budget_s=args.budget,
        summary=dict(
            geomean_tuned_speedup=statistics.geometric_mean(sps),
            max_tuned_vs_fastest=max(r_["tuned_vs_fastest"] for r_ in rows),
            median_tune_seconds=statistics.median(r_["tune_seconds"] for r_ in rows),
            median_cold_first_ms=statistics.median(r_["cold_first_ms"] for r_ in rows),
            median_warm_first_ms=statistics.median(r_["warm_first_ms"] for r_ in rows),
            max_warm_first_ms=max(r_["warm_first_ms"] for r_ in rows),
        ),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = props.name.replace(" ", "-") + "-autotune"
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    sm = meta["summary"]
    lines = [
        f"# Autotuning and the persistent plan cache: conv+bias+relu fp16 NHWC, batch {BATCH}",
        "",
        f"GPU {meta['gpu']} (sm_{meta['cc']}), cuDNN {meta['cudnn_backend']}, frontend {meta['frontend']}, torch {meta['torch']}; "
        f"{meta['date']}; tuning budget {args.budget:g} s per key.",
        "",
        "| C | HxW | K | RxS | s | heuristic us | tuned us | speed-up | tuned / fastest (sweep) | ok / candidates | tune s | cold first call ms | warm first call ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r_ in rows:
        s_ = r_["shape"]
        lines.append(
            f"| {s_['C']} | {s_['H']}x{s_['W']} | {s_['K']} | {s_['R']}x{s_['R']} | {s_['stride']} | {r_['heuristic_us']:.1f} | "
            f"{r_['tuned_us']:.1f} | {r_['speedup']:.2f}x | {r_['tuned_vs_fastest']:.3f} | {r_['ok']} / {r_['candidates']} | "
            f"{r_['tune_seconds']:.2f} | {r_['cold_first_ms']:.1f} | {r_['warm_first_ms']:.1f} |"
        )
    lines += [
        "",
        f"Geometric-mean speed-up of tuned over heuristic plans: **{sm['geomean_tuned_speedup']:.3f}x**; "
        f"worst tuned choice vs the fastest candidate of an independent sweep: **{sm['max_tuned_vs_fastest']:.3f}**; "
        f"median tuning time per key **{sm['median_tune_seconds']:.2f} s**; first call in a fresh process: "
        f"cold (build) median **{sm['median_cold_first_ms']:.1f} ms**, warm (disk) median **{sm['median_warm_first_ms']:.1f} ms** "
        f"(max {sm['max_warm_first_ms']:.1f} ms).",
    ]
    md = "\n".join(lines) + "\n"
    (out / f"{stem}.md").write_text(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.6))
        for y, r_ in enumerate(rows):
            t = sorted(r_["candidate_us"])
            ax.scatter([v_ / t[0] for v_ in t], [y] * len(t), s=10, alpha=0.6, color="tab:blue")
            ax.scatter([r_["heuristic_us"] / r_["tuned_us"]], [y], marker="x", color="tab:red")
        ax.set_xscale("log")
        ax.set_yticks(range(len(rows)), [f"{r_['shape']['C']}>{r_['shape']['K']} {r_['shape']['R']}x{r_['shape']['R']}/s{r_['shape']['stride']} @{r_['shape']['H']}" for r_ in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("candidate plan time / fastest candidate (log); red x: heuristic's first choice")
        ax.set_title(f"Spread of cuDNN candidate plans, conv+bias+relu fp16, {props.name}")
        fig.tight_layout()
        fig.savefig(out / f"{stem}-spread.png", dpi=110)
    except ImportError as e:
        print(f"no plot: {e}", file=sys.stderr)
    print(md)


if __name__ == "__main__":
    main()
