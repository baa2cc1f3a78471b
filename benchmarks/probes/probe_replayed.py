"""fusekit.torch.replayed on a converted torchvision model: the uncaptured training step (the issue's
measure: bench_train_models' make_step, GradScaler in amp-fp16, CUDA events) of PyTorch eager, fusekit
modules and fusekit replayed, in alternating rounds in one process; and whether replayed steps
train as the modules do (losses and weights of the same steps from one state).

    python benchmarks/probes/probe_replayed.py [--model resnet50] [--precision amp-fp16] [--batch 64] [--rounds 3] [--profile]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench_train_models import PRECISIONS, Data, make_step  # noqa: E402

import fusekit.torch as ft  # noqa: E402
from fusekit.pipeline.bench import cuda_time_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--precision", default="amp-fp16", choices=list(PRECISIONS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also cProfile 10 replayed steps (top 40 by own time)")
    args = ap.parse_args()
    import torchvision

    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    initial = getattr(torchvision.models, args.model)(weights=None).to(memory_format=torch.channels_last)
    fk = ft.convert(initial)[0].cuda().train()
    rp = ft.replayed(copy.deepcopy(fk))
    data = Data(args.batch, 224)

    # the same 8 steps from one state, as modules and replayed
    state = copy.deepcopy(fk.state_dict())
    runs = []
    for m in (fk, rp):
        m.load_state_dict(state)
        step, box = make_step(m, data, args.precision, captured=False)
        data.reset(3)
        losses = []
        for _ in range(8):
            step()
            losses.append(float(box["loss"]))
            data.refill()
        runs.append((losses, [t.detach().float().clone() for t in m.state_dict().values()]))
    (lm, wm), (lr, wr) = runs
    worst = max(float((a - b).norm() / b.norm()) for a, b in zip(wr, wm) if b.norm() > 0)
    tape = next(iter(rp.forward.tapes.values()), None)
    print(f"{args.model} b{args.batch} {args.precision}: replays {rp.forward.replays} of 8 steps, refused {rp.forward.refused}; "
          f"tape: {0 if tape is None else sum(e[0] == 0 for e in tape.entries)} aten ops, "
          f"{0 if tape is None else sum(e[0] == 1 for e in tape.entries)} fusekit graphs "
          f"({0 if tape is None else sum(e[0] == 1 and e[1].native is None for e in tape.entries)} through graph.execute, "
          f"{0 if tape is None else sum(e[0] == 1 and bool(e[1].relayout) for e in tape.entries)} with relayouts), "
          f"{0 if tape is None else sum(e[0] == 2 for e in tape.entries)} whole fusekit ops", flush=True)
    print(f"losses modules {[round(v, 5) for v in lm]}\nlosses replayed {[round(v, 5) for v in lr]}\n"
          f"largest loss difference {max(abs(a - b) / abs(b) for a, b in zip(lr, lm)):.1e}, weights and buffers: largest rel {worst:.1e}", flush=True)

    eager = copy.deepcopy(initial).cuda().train()
    sides = {"eager": eager, "fusekit modules": fk, "fusekit replayed": rp}
    steps = {k: make_step(m, data, args.precision, captured=False)[0] for k, m in sides.items()}
    for f in steps.values():
        for _ in range(3):
            f()
    res: dict[str, list[float]] = {k: [] for k in sides}
    host: dict[str, list[float]] = {k: [] for k in sides}
    peak: dict[str, int] = {}
    for r in range(args.rounds):
        for k, f in steps.items():
            torch.cuda.reset_peak_memory_stats()
            res[k].append(cuda_time_ms(f, iters=10, trials=3, warmup=2, before_trial=data.refill))
            peak[k] = max(peak.get(k, 0), torch.cuda.max_memory_allocated())
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5):
                f()
            host[k].append((time.perf_counter() - t) * 200)  # ms per step, host side (queued, not synced)
            torch.cuda.synchronize()
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in res.items()), flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    hmed = {k: statistics.median(v) for k, v in host.items()}
    print(f"{torch.cuda.get_device_name()}: step ms (CUDA events, median of rounds): " + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
          + f"; eager / replayed {med['eager'] / med['fusekit replayed']:.2f}x, eager / modules {med['eager'] / med['fusekit modules']:.2f}x")
    print("host ms per step while queueing (5 steps, median of rounds): " + ", ".join(f"{k} {v:.2f}" for k, v in hmed.items()))
    print("peak memory allocated while timed (all three models resident): " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in peak.items()))
    print(f"replays {rp.forward.replays}, tapes {len(rp.forward.tapes)}")
    if args.profile:
        import cProfile
        import pstats

        f = steps["fusekit replayed"]
        torch.cuda.synchronize()
        with cProfile.Profile() as prof:
            for _ in range(10):
                f()
            torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
