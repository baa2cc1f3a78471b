"""Where a compiled ResNet-50's 1e-2 error comes from (device call 1 of the sixth session of
2026-12-03): every stage run eagerly (pipeline.check) is 2e-4 off PyTorch float32 on its own inputs,
yet the replayed graph's output is 1e-2 off at batch 8 (4e-4 at batch 1 and 32), and the figure moves
from build to build. This compares, for one input: the eager staged forward, graph replays (twice,
bitwise), and with activation buffers never reused (plan_memory patched) each stage's replayed output
against that stage rerun eagerly on the replayed inputs; plus the workspace fusekit holds for the
pipeline's stream before and after each build step.

    python benchmarks/probes/probe_pipeline_replay.py [--batch 8]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import rel, resnet50_eval

import fusekit.pipeline as fp
import fusekit.pipeline.runtime as prt
from fusekit.engine.runtime import RUNTIME
from fusekit.pipeline.memory import plan_memory


def workspaces(tag: str) -> None:
    print(f"   [{tag}] workspaces:", {(k[0], k[2] % 100000): (w.size, hex(w.ptr)) for k, w in RUNTIME._workspaces.items()})


def no_reuse(prog, itemsize=2):
    mp = plan_memory(prog, itemsize)
    names = list(mp.assign)
    mp.assign = {v: i for i, v in enumerate(names)}
    mp.sizes = [mp.numel[v] for v in names]
    return mp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    m, x = resnet50_eval(args.batch)
    with torch.no_grad():
        want = m(x)
    for step in ("_warmup", "_choose", "_verify", "_profile", "_capture"):
        real = getattr(prt.Pipeline, step)

        def wrapped(self, *a, _real=real, _step=step, **k):
            out = _real(self, *a, **k)
            workspaces(f"after {_step}, pipeline stream {self.stream.cuda_stream % 100000}")
            return out

        setattr(prt.Pipeline, step, wrapped)
    for label, reuse in (("planned buffers", True), ("no buffer reuse", False)):
        if not reuse:
            prt.plan_memory = no_reuse
        pipe = fp.compile(m, torch.zeros(args.batch, 3, 224, 224), dtype="float16", choose=False)
        prt.plan_memory = plan_memory
        r1 = pipe(x)
        r2 = pipe(x)
        s = pipe.stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            pipe.input_buffer.copy_(x)
            pipe.forward_eager()
            e1 = pipe.output_buffer.clone()
            pipe.forward_eager()
            e2 = pipe.output_buffer.clone()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        print(f"{label} b{args.batch}: replay rel {rel(r1, want):.2e} / {rel(r2, want):.2e} (bitwise equal {torch.equal(r1, r2)}); "
              f"eager rel {rel(e1, want):.2e} / {rel(e2, want):.2e} (bitwise equal {torch.equal(e1, e2)}); replay vs eager {rel(r1, e1):.2e}")
        if reuse:
            continue
        pipe(x)
        torch.cuda.synchronize()
        snap = {v: t.clone() for v, t in pipe.views.items()}
        rows = []
        with torch.cuda.stream(s), torch.no_grad():
            for i, (st, run) in enumerate(zip(pipe.stages, pipe._runners)):
                for v in st.inputs:
                    pipe.views[v].copy_(snap[v])
                run()
                rows.append((rel(snap[st.output], pipe.views[st.output]), i, st.pattern, pipe.engines[i], tuple(st.out_shape)))
        torch.cuda.synchronize()
        rows.sort(reverse=True)
        for r in rows[:8]:
            print(f"   stage {r[1]:3d} {r[2]:<20} replay vs eager {r[0]:.2e}  {r[3][:60]}  {r[4]}")
        print(f"   stages bitwise equal to eager: {sum(r[0] == 0 for r in rows)} of {len(rows)}")


if __name__ == "__main__":
    main()
