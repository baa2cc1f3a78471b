"""Recorded dispatch (dispatch.taped) in a converted model's uncaptured AMP training step: host ms
with tapes on and off alternated in one process, against PyTorch eager; which ops replay; and
whether the step computes the same with and without them.

    python benchmarks/probes/probe_tapes.py [--model resnet50] [--batch 64] [--rounds 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import converted, fwd_bwd, host_ms, rel

from bench_train_models import make_step
from fusekit import dispatch
from fusekit.pipeline.bench import cuda_time_ms


def grads(model, data) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(data.x)
        loss = F.cross_entropy(out, data.y)
    loss.backward()
    g = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach().clone(), g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    base, fk, data = converted(args.model, args.batch)
    base_state = {k: v.clone() for k, v in fk.state_dict().items()}
    for on in (False, True, True, True):
        dispatch.TAPES = on
        fwd_bwd(fk, data)
        fwd_bwd(base, data)
    kinds = {"replay": 0, "never": 0, "recording": 0}
    for v in dispatch._TAPES.values():
        kinds["replay" if type(v) is dispatch._Tape else "never" if v is dispatch._NEVER else "recording"] += 1
    print(f"tapes after warm-up: {kinds}; steps per replaying tape: "
          f"{sorted(len(v.steps) for v in dispatch._TAPES.values() if type(v) is dispatch._Tape)}", flush=True)
    never = [k[0] for k, v in dispatch._TAPES.items() if v is dispatch._NEVER]
    if never:
        print("not recordable:", sorted({str(k[0] if isinstance(k, tuple) else k)[:60] for k in never}))
    # Same math: forward output bit for bit, gradients (some wgrad kernels reduce in a nondeterministic order)
    fk.load_state_dict(base_state)
    dispatch.TAPES = False
    out_off, g_off = grads(fk, data)
    fk.load_state_dict(base_state)
    dispatch.TAPES = True
    out_on, g_on = grads(fk, data)
    fk.load_state_dict(base_state)
    worst = max(rel(a, b) for a, b in zip(g_on, g_off) if b.norm() > 0)
    print(f"forward output tapes on == off: {torch.equal(out_on, out_off)}; largest gradient difference {worst:.2e}", flush=True)
    res: dict[str, list[float]] = {"eager": [], "tapes off": [], "tapes on": []}
    for r in range(args.rounds):
        res["eager"] += [host_ms(lambda: fwd_bwd(base, data)) for _ in range(3)]
        for name, on in (("tapes off", False), ("tapes on", True)):
            dispatch.TAPES = on
            res[name] += [host_ms(lambda: fwd_bwd(fk, data)) for _ in range(3)]
        print(f"round {r}: " + ", ".join(f"{k} {statistics.median(v[-3:]):.2f}" for k, v in res.items()), flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"\n{args.model} b{args.batch} amp-fp16 forward + backward host ms (median of {3 * args.rounds}): "
          + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
          + f"; tapes on / off {med['tapes off'] / med['tapes on']:.2f}x; eager / tapes on {med['eager'] / med['tapes on']:.2f}x")
    steps = {}
    for name, model in (("eager", base), ("fusekit", fk)):
        steps[name] = make_step(model, data, "amp-fp16", captured=False)[0]
    out = {"eager": [], "tapes off": [], "tapes on": []}
    for _ in range(3):
        out["eager"].append(cuda_time_ms(steps["eager"], iters=10, trials=3, warmup=2))
        for name, on in (("tapes off", False), ("tapes on", True)):
            dispatch.TAPES = on
            out[name].append(cuda_time_ms(steps["fusekit"], iters=10, trials=3, warmup=2))
    print("whole AMP step (GradScaler, SGD momentum), ms (CUDA events, median of 3 x 3 trials of 10): "
          + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
