"""Batch norm pieces on cuDNN graphs vs PyTorch eager, both captured in CUDA graphs (fp16, NHWC).

    python benchmarks/bench_norm.py [--out benchmarks/results]

Cases, each on ResNet-like activations (batch 32): normalize alone (training statistics), fused
BN + ReLU forward (training, running stats updated), conv -> BN -> ReLU inference (fusekit: BN
folded into the conv, one graph; eager: conv2d, batch_norm, relu_), and a conv -> BN -> ReLU
training step (forward + backward through torch.autograd). Memory floor: bytes moved / 4.2 TB/s
(BN forward reads x twice, for the statistics and the normalization, and writes y once).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fusekit  # noqa: E402
import fusekit.torch as ft  # noqa: E402
from bench_train import graphed_time_us as step_time_us  # noqa: E402
from fusekit import ops  # noqa: E402
from timing import cl, graph_time_us  # noqa: E402

PEAK_BYTES = 4.2e12
TRIALS, REPS = 15, 20
SHAPES = [(32, 64, 56), (32, 128, 28), (32, 256, 14), (32, 512, 7), (32, 256, 56)]


def time_us(fn) -> float:
    return graph_time_us(lambda i: fn(), reps=REPS, trials=TRIALS, warm=3)


def rel(a, ref) -> float:
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    rows = []
    for n, c, h in SHAPES:
        x = cl(torch.randn(n, c, h, h, device="cuda", dtype=torch.float16))
        gamma, beta = torch.rand(c, device="cuda") + 0.5, torch.randn(c, device="cuda")
        rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
        nbytes = x.numel() * 2 * 3  # read twice, write once
        floor = nbytes / PEAK_BYTES * 1e6
        # normalize alone
        y, _, _ = ops.bn_normalize(x)
        err_n = rel(y, F.batch_norm(x.double(), None, None, None, None, True, 0.0, 1e-5))
        t_norm = time_us(lambda: ops.bn_normalize(x))
        t_norm_eager = time_us(lambda: F.batch_norm(x, None, None, None, None, True, 0.0, 1e-5))
        # fused BN + ReLU, training, running stats
        y, *_ = ops.batchnorm(x, gamma, beta, rm, rv, relu=True)
        err_br = rel(y, torch.relu(F.batch_norm(x.double(), rm.double().clone(), rv.double().clone(), gamma.double(), beta.double(), True, 0.1, 1e-5)))
        t_bnrelu = time_us(lambda: ops.batchnorm(x, gamma, beta, rm, rv, relu=True))
        rm2, rv2 = rm.clone(), rv.clone()
        t_bnrelu_eager = time_us(lambda: torch.relu_(F.batch_norm(x, rm2, rv2, gamma.half(), beta.half(), True, 0.1, 1e-5)))
        rows.append(dict(case="normalize", N=n, C=c, H=h, fusekit_us=t_norm, eager_us=t_norm_eager, floor_us=floor, rel_err=err_n))
        rows.append(dict(case="bn+relu fwd (train)", N=n, C=c, H=h, fusekit_us=t_bnrelu, eager_us=t_bnrelu_eager, floor_us=floor, rel_err=err_br))
        print(f"N={n} C={c} {h}x{h}: normalize {t_norm:.1f} us (eager {t_norm_eager:.1f}); bn+relu {t_bnrelu:.1f} us "
              f"(eager {t_bnrelu_eager:.1f}); floor {floor:.1f} us -> {t_bnrelu / floor:.2f}x of floor", flush=True)
    # conv -> BN -> ReLU, inference (folded) and a training step
    for n, c, h, k in [(32, 64, 56, 64), (32, 128, 28, 128), (32, 256, 14, 256)]:
        x = cl(torch.randn(n, c, h, h, device="cuda", dtype=torch.float16))
        conv = torch.nn.Conv2d(c, k, 3, padding=1).cuda().half().to(memory_format=torch.channels_last)
        bn = torch.nn.BatchNorm2d(k).cuda().eval()
        with torch.no_grad():
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2)
        w2, b2 = ops.fold_batchnorm(conv.weight.detach(), conv.bias.detach().float(), bn.running_mean, bn.running_var, bn.weight.detach(), bn.bias.detach(), bn.eps)
        out = cl(torch.empty(n, k, h, h, device="cuda", dtype=torch.float16))
        y = ops.conv_bias_relu(x, w2, b2, padding=1)
        with torch.no_grad():
            ref = torch.relu(F.batch_norm(F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1),
                                          bn.running_mean.double(), bn.running_var.double(), bn.weight.double(), bn.bias.double(), False, 0.1, bn.eps))
        err = rel(y, ref)
        bn_h = bn.half()
        t_inf = time_us(lambda: ops.conv_bias_relu(x, w2, b2, padding=1, out=out))
        with torch.no_grad():
            t_inf_eager = time_us(lambda: torch.relu_(bn_h(conv(x))))
        rows.append(dict(case="conv-bn-relu inference (folded)", N=n, C=c, H=h, K=k, fusekit_us=t_inf, eager_us=t_inf_eager, rel_err=err))
        # training step: conv (fusekit.torch) -> BatchNorm2d(relu fused) vs eager conv -> bn -> relu
        eager = torch.nn.Sequential(torch.nn.Conv2d(c, k, 3, padding=1), torch.nn.BatchNorm2d(k), torch.nn.ReLU()).cuda().half().to(memory_format=torch.channels_last)
        fused = torch.nn.Sequential(ft.Conv2d(c, k, 3, padding=1), ft.BatchNorm2d(k, activation="relu")).cuda().half().to(memory_format=torch.channels_last)
        fused[0].load_state_dict(eager[0].state_dict())
        fused[1].load_state_dict(eager[1].state_dict())
        fused[1].float()  # gamma, beta and running stats in float32 (what cuDNN's BN node reads)
        xg = x.clone().requires_grad_(True)
        t_tr = step_time_us(fused, xg)
        t_tr_eager = step_time_us(eager, xg)
        rows.append(dict(case="conv-bn-relu train step", N=n, C=c, H=h, K=k, fusekit_us=t_tr, eager_us=t_tr_eager))
        print(f"conv-bn-relu N={n} C={c}->{k} {h}x{h}: inference {t_inf:.1f} us (eager {t_inf_eager:.1f}, err {err:.1e}); "
              f"train step {t_tr:.1f} us (eager {t_tr_eager:.1f}) -> {t_tr_eager / t_tr:.2f}x", flush=True)
    for r in rows:
        r["speedup"] = r["eager_us"] / r["fusekit_us"]
    props = torch.cuda.get_device_properties(0)
    v = fusekit.engine.runtime.versions()
    by_case: dict[str, list[float]] = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r["speedup"])
    meta = dict(gpu=props.name, cudnn_backend=v.cudnn_backend, frontend=v.frontend, torch=torch.__version__,
                date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                geomean_by_case={k: statistics.geometric_mean(s) for k, s in by_case.items()},
                worst_bn_relu_vs_floor=max(r["fusekit_us"] / r["floor_us"] for r in rows if r["case"].startswith("bn+relu")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = props.name.replace(" ", "-") + "-norm"
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [
        "# Batch norm pieces and conv-BN-ReLU: fusekit vs PyTorch eager (fp16, channels-last), both in CUDA graphs",
        "",
        f"GPU {meta['gpu']}, cuDNN {meta['cudnn_backend']}, frontend {meta['frontend']}, torch {meta['torch']}; {meta['date']}. "
        "Median per call of CUDA-graph replays; floor = bytes (x read twice, y written) / 4.2 TB/s.",
        "",
        "| case | N | C | HxW | fusekit us | eager us | speed-up | floor us | fusekit / floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fl = r.get("floor_us")
        lines.append(f"| {r['case']} | {r['N']} | {r['C']}{'->' + str(r['K']) if 'K' in r else ''} | {r['H']}x{r['H']} | {r['fusekit_us']:.1f} | "
                     f"{r['eager_us']:.1f} | {r['speedup']:.2f}x | {fl:.1f} | {r['fusekit_us'] / fl:.2f} |" if fl else
                     f"| {r['case']} | {r['N']} | {r['C']}->{r['K']} | {r['H']}x{r['H']} | {r['fusekit_us']:.1f} | {r['eager_us']:.1f} | {r['speedup']:.2f}x | | |")
    lines += ["", "Geometric-mean speed-up by case: " + ", ".join(f"{k} **{s:.2f}x**" for k, s in meta["geomean_by_case"].items()) + ".",
              f"Worst fused BN+ReLU forward vs the bandwidth floor: **{meta['worst_bn_relu_vs_floor']:.2f}x**."]
    md = "\n".join(lines) + "\n"
    (out / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
