"""conv+bias+relu on ResNet-50's conv shapes: fusekit vs PyTorch eager, device and host time.

Run on a GPU machine:  python benchmarks/bench_conv.py [--out benchmarks/results] [--quick]
Writes <out>/<gpu>.json, <out>/<gpu>.md and <out>/<gpu>-speedup.png.

Device time: each side is captured in a CUDA graph of REPS calls cycling over ROT input sets
(fresh random data, never zeros), replayed after warm-up; the median over TRIALS replays, timed
with CUDA events, divided by REPS. PyTorch eager is ``relu_(conv2d(x, w, b))`` on channels-last
tensors with ``torch.backends.cudnn.benchmark = True``.
Host time: per-call wall time of back-to-back calls on a cache hit (enqueue cost; the queue never
fills), median of trials, for the raw cuDNN frontend ``graph.execute`` (every public binding form,
fastest reported as "raw") and for fusekit's functional call.
Floor: max(FLOPs / 790 TFLOP/s, bytes / 4.2 TB/s), the ceilings measured on the H200.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fusekit  # noqa: E402
import fusekit.timing  # noqa: E402
from timing import cl  # noqa: E402
from timing import graph_time_us as _graph_time_us  # noqa: E402
from fusekit import dispatch  # noqa: E402
from fusekit import ops as fops  # noqa: E402

PEAK_FLOPS = 790e12
PEAK_BYTES = 4.2e12

# ResNet-50 (torchvision v1.5: stride on the 3x3) conv shapes at batch 32: (C, H, W, K, R, stride)
RESNET50 = [
    (64, 56, 56, 64, 1, 1),
    (64, 56, 56, 64, 3, 1),
    (64, 56, 56, 256, 1, 1),
    (256, 56, 56, 64, 1, 1),
    (256, 56, 56, 128, 1, 1),
    (128, 56, 56, 128, 3, 2),
    (128, 28, 28, 512, 1, 1),
    (256, 56, 56, 512, 1, 2),
    (512, 28, 28, 128, 1, 1),
    (128, 28, 28, 128, 3, 1),
    (512, 28, 28, 256, 1, 1),
    (256, 28, 28, 256, 3, 2),
    (256, 14, 14, 1024, 1, 1),
    (512, 28, 28, 1024, 1, 2),
    (1024, 14, 14, 256, 1, 1),
    (256, 14, 14, 256, 3, 1),
    (1024, 14, 14, 512, 1, 1),
    (512, 14, 14, 512, 3, 2),
    (512, 7, 7, 2048, 1, 1),
    (1024, 14, 14, 2048, 1, 2),
    (2048, 7, 7, 512, 1, 1),
    (512, 7, 7, 512, 3, 1),
]
BATCH = 32
ROT = 4  # input sets cycled inside one captured graph (defeats the 60 MB L2 on the small layers)
REPS = 20  # calls per graph replay
TRIALS = 15


def graph_time_us(fn_i) -> float:
    """Median per-call device time of fn_i(i), REPS calls cycling over the ROT input sets, in one CUDA graph."""
    return _graph_time_us(fn_i, reps=REPS, trials=TRIALS, warm=ROT * 2)


def host_time_us(fn, n: int = 200, trials: int = 9) -> float:
    """Median wall time per call of n back-to-back calls (host-side cost), synchronizing between trials."""
    return fusekit.timing.host_us(fn, calls=n, trials=trials, warmup=20, synchronize=torch.cuda.synchronize)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def bench_shape(c, h, w, k, r, stride, quick: bool) -> dict:
    n = BATCH
    pad = r // 2
    xs = [cl(torch.randn(n, c, h, w, device="cuda", dtype=torch.float16)) for _ in range(ROT)]
    wt = cl(torch.randn(k, c, r, r, device="cuda", dtype=torch.float16) / math.sqrt(c * r * r))
    b = torch.randn(k, device="cuda", dtype=torch.float16)
    ho, wo = (h + 2 * pad - r) // stride + 1, (w + 2 * pad - r) // stride + 1
    outs = [cl(torch.empty(n, k, ho, wo, device="cuda", dtype=torch.float16)) for _ in range(ROT)]
    attrs = dict(padding=pad, stride=stride)

    # correctness first: fusekit vs float64 PyTorch reference (on the same rounded inputs)
    y = fusekit.conv_bias_relu(xs[0], wt, b, **attrs)
    ref = torch.relu(F.conv2d(xs[0].double(), wt.double(), b.double(), stride=stride, padding=pad))
    err = rel_err(y, ref)
    y_t = torch.relu_(F.conv2d(xs[0], wt, b, stride=stride, padding=pad))
    err_t = rel_err(y_t, ref)

    plan = fusekit.plan_for("conv_bias_relu", xs[0], wt, b, out=outs[0], **attrs)
    t_fk = graph_time_us(lambda i: fusekit.conv_bias_relu(xs[i % ROT], wt, b, out=outs[i % ROT], **attrs))
    t_pt = graph_time_us(lambda i: torch.relu_(F.conv2d(xs[i % ROT], wt, b, stride=stride, padding=pad)))
    if not quick:  # time both again: the spread between repeats is the noise level
        t_fk2 = graph_time_us(lambda i: fusekit.conv_bias_relu(xs[i % ROT], wt, b, out=outs[i % ROT], **attrs))
        t_pt2 = graph_time_us(lambda i: torch.relu_(F.conv2d(xs[i % ROT], wt, b, stride=stride, padding=pad)))
    else:
        t_fk2, t_pt2 = t_fk, t_pt

    # host cost per call on a cache hit
    g, uids = plan.graph, plan.uids
    x0, o0 = xs[0], outs[0]
    call = dispatch.resolved_call(plan)
    ws = call.workspace
    handle = call.handle
    ptrs = [x0.data_ptr(), wt.data_ptr(), b.data_ptr(), o0.data_ptr()]
    objs = [x0, wt, b, o0]
    by_uid = dict(zip(uids, objs))
    wsp = ws.ptr
    raw_forms = {
        "ordered_ptrs": lambda: g.execute(ptrs, wsp, handle=handle, tensor_uids=uids),
        "ordered_tensors": lambda: g.execute(objs, wsp, handle=handle, tensor_uids=uids),
        "dict_tensors": lambda: g.execute(by_uid, wsp, handle=handle),
    }
    host = {name: host_time_us(fn) for name, fn in raw_forms.items()}
    raw_best = min(host, key=host.get)
    host["fusekit_out"] = host_time_us(lambda: fusekit.conv_bias_relu(x0, wt, b, out=o0, **attrs))
    fops.BIND_OBJECTS = False
    host["fusekit_out_ptrs"] = host_time_us(lambda: fusekit.conv_bias_relu(x0, wt, b, out=o0, **attrs))
    fops.BIND_OBJECTS = True
    host["fusekit_alloc"] = host_time_us(lambda: fusekit.conv_bias_relu(x0, wt, b, **attrs))
    host["torch_eager"] = host_time_us(lambda: torch.relu_(F.conv2d(x0, wt, b, stride=stride, padding=pad)))

    flops = 2.0 * n * k * ho * wo * c * r * r
    nbytes = 2.0 * (n * c * h * w + k * c * r * r + k + n * k * ho * wo)
    floor = max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES) * 1e6
    return {
        "shape": {"N": n, "C": c, "H": h, "W": w, "K": k, "R": r, "S": r, "stride": stride, "padding": pad},
        "dtype": "float16",
        "layout": "NHWC",
        "rel_err_fusekit": err,
        "rel_err_torch": err_t,
        "engine": plan.engine,
        "candidates": plan.candidates,
        "workspace": plan.workspace_size,
        "build_ms": plan.build_ms,
        "device_us": {"fusekit": t_fk, "fusekit_repeat": t_fk2, "torch_eager": t_pt, "torch_eager_repeat": t_pt2},
        "speedup": t_pt / t_fk,
        "floor_us": floor,
        "flops": flops,
        "bytes": nbytes,
        "host_us": host,
        "host_raw_best": raw_best,
        "host_overhead_us": host["fusekit_out"] - host[raw_best],
    }


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# conv+bias+relu, fp16 NHWC, batch {BATCH}: fusekit vs PyTorch eager",
        "",
        f"GPU {meta['gpu']} (sm_{meta['cc']}), driver {meta['driver']}, cuDNN {meta['cudnn_backend']}, "
        f"frontend {meta['frontend']}, torch {meta['torch']}, CUDA {meta['cuda']}; {meta['date']}.",
        "Device time: median of CUDA-graph replays (events), per call; floor = max(FLOPs/790 TFLOP/s, bytes/4.2 TB/s).",
        "Host time: per call on a cache hit; raw = fastest public `graph.execute` binding form.",
        "",
        "| C | HxW | K | RxS | s | fusekit us | torch us | speedup | floor us | fusekit/floor | raw host us | fusekit host us | overhead us | rel err |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r["shape"]
        d = r["device_us"]
        h = r["host_us"]
        lines.append(
            f"| {s['C']} | {s['H']}x{s['W']} | {s['K']} | {s['R']}x{s['S']} | {s['stride']} | {d['fusekit']:.1f} | "
            f"{d['torch_eager']:.1f} | {r['speedup']:.2f}x | {r['floor_us']:.1f} | {d['fusekit'] / r['floor_us']:.2f} | "
            f"{h[r['host_raw_best']]:.1f} | {h['fusekit_out']:.1f} | {r['host_overhead_us']:+.1f} | {r['rel_err_fusekit']:.1e} |"
        )
    sm = meta["summary"]
    lines += [
        "",
        f"Geometric-mean device speed-up over PyTorch eager: **{sm['geomean_speedup']:.2f}x** "
        f"(min {sm['min_speedup']:.2f}x, max {sm['max_speedup']:.2f}x).",
        f"Host overhead of fusekit above the raw frontend call (median over shapes): **{sm['median_host_overhead_us']:+.1f} us** "
        f"(raw {sm['median_raw_host_us']:.1f} us, fusekit with out= {sm['median_fusekit_host_us']:.1f} us, "
        f"fusekit allocating its output {sm['median_fusekit_alloc_host_us']:.1f} us, torch eager {sm['median_torch_host_us']:.1f} us).",
        f"Raw binding forms (median us): {sm['raw_forms']}.",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['shape']['C']}>{r['shape']['K']} {r['shape']['R']}x{r['shape']['R']}/s{r['shape']['stride']} @{r['shape']['H']}" for r in rows]
    sp = [r["speedup"] for r in rows]
    eff = [r["floor_us"] / r["device_us"]["fusekit"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(13, 0.32 * len(rows) + 1.5), sharey=True)
    y = range(len(rows))
    ax[0].barh(y, sp, color=["tab:green" if s >= 1 else "tab:red" for s in sp])
    ax[0].axvline(1.0, color="k", lw=0.8)
    ax[0].set_xlabel("speed-up over PyTorch eager (device time)")
    ax[0].set_yticks(list(y), labels, fontsize=7)
    ax[0].invert_yaxis()
    ax[1].barh(y, eff, color="tab:blue")
    ax[1].set_xlabel("fraction of the roofline floor reached by fusekit")
    ax[1].set_xlim(0, 1)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="first 4 shapes, one timing each")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    from fusekit.engine.runtime import versions

    shapes = RESNET50[:4] if args.quick else RESNET50
    rows = []
    for i, (c, h, w, k, r, s) in enumerate(shapes):
        t0 = time.perf_counter()
        row = bench_shape(c, h, w, k, r, s, args.quick)
        rows.append(row)
        print(
            f"[{i + 1}/{len(shapes)}] C={c} {h}x{w} K={k} {r}x{r}/s{s}: fusekit {row['device_us']['fusekit']:.1f} us "
            f"torch {row['device_us']['torch_eager']:.1f} us ({row['speedup']:.2f}x) floor {row['floor_us']:.1f} us; "
            f"host raw {row['host_us'][row['host_raw_best']]:.1f} fusekit {row['host_us']['fusekit_out']:.1f} us; "
            f"err {row['rel_err_fusekit']:.1e} ({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    v = versions()
    props = torch.cuda.get_device_properties(0)
    sps = [r["speedup"] for r in rows]
    forms = {k: round(statistics.median(r["host_us"][k] for r in rows), 2) for k in rows[0]["host_us"]}
    meta = {
        "gpu": props.name,
        "cc": f"{props.major}{props.minor}",
        "driver": torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else "",
        "cudnn_backend": v.cudnn_backend,
        "frontend": v.frontend,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "fusekit": fusekit.__version__,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "method": {"rot": ROT, "reps": REPS, "trials": TRIALS, "peak_flops": PEAK_FLOPS, "peak_bytes": PEAK_BYTES},
        "summary": {
            "geomean_speedup": statistics.geometric_mean(sps),
            "min_speedup": min(sps),
            "max_speedup": max(sps),
            "median_host_overhead_us": statistics.median(r["host_overhead_us"] for r in rows),
            "median_raw_host_us": statistics.median(r["host_us"][r["host_raw_best"]] for r in rows),
            "median_fusekit_host_us": forms["fusekit_out"],
            "median_fusekit_alloc_host_us": forms["fusekit_alloc"],
            "median_torch_host_us": forms["torch_eager"],
            "raw_forms": {k: forms[k] for k in ("ordered_ptrs", "ordered_tensors", "dict_tensors")},
        },
    }
    try:
        import subprocess

        meta["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        pass
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = props.name.replace(" ", "-")
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = markdown(meta, rows)
    (out / f"{stem}.md").write_text(md)
    try:
        plot(rows, out / f"{stem}-speedup.png", f"conv+bias+relu fp16 NHWC b{BATCH}, {props.name}")
    except ImportError as e:
        print(f"no plot: {e}", file=sys.stderr)
    print(md)


if __name__ == "__main__":
    main()
