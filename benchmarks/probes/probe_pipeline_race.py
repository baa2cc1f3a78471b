"""Why replays of a compiled ResNet-50 (fp16, batch 8) differ from each other and from the eager
staged forward (probe_pipeline_replay, sixth session of 2026-12-03: eager deterministic at 4.3e-4 vs
float32; replays 1.2e-2 to 1.6e-2 and not bitwise equal; without buffer reuse only the first replay
was off). Hypothesis: consecutive kernels overlap inside the graph (cuDNN's Hopper kernels may be
launched with programmatic dependent launch) and race on the one cuDNN workspace all stages share, or
on a reused activation buffer. The whole forward is captured again three ways and replayed N times,
each replay compared bitwise with the eager forward: as built; with a distinct workspace per stage;
with a one-element torch kernel between stages (no programmatic overlap across it); then with
separators between all stages but one adjacent pair, for each pair. (After the first run, dispatch
fences an epilogue operand written by the graph just before: "as built" includes those fences, and
"without dispatch's fence" captures with them turned off.)

    python benchmarks/probes/probe_pipeline_race.py [--batch 8] [--replays 20]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import rel, resnet50_eval

import fusekit
import fusekit.pipeline as fp
from fusekit.engine.runtime import RUNTIME


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    m, x = resnet50_eval(args.batch)
    pipe = fp.compile(m, torch.zeros(args.batch, 3, 224, 224), dtype="float16", choose=False)
    s, dev = pipe.stream, pipe.device
    ws = RUNTIME._workspaces[("torch", dev.index, s.cuda_stream)]
    print(f"shared workspace {ws.size} bytes; stages with a workspace:")
    with torch.cuda.stream(s):
        for i, (ops, attrs) in sorted(pipe._fused.items()):
            st = pipe.stages[i]
            p = fusekit.plan_for(st.pattern, *ops, out=pipe.views[st.output], **attrs)
            if p.workspace_size:
                print(f"   stage {i:3d} {st.pattern:<20} {p.workspace_size:>9d} B  {p.engine[:60]}  {tuple(st.out_shape)}")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        pipe.input_buffer.copy_(x)
        pipe.forward_eager()
        eager = pipe.output_buffer.clone()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    bufs = [torch.empty(max(ws.size, 1), dtype=torch.uint8, device=dev) for _ in pipe._runners]
    sep = torch.zeros(1, device=dev)
    keep_ptr = ws.ptr

    def capture(mode: str) -> torch.cuda.CUDAGraph:
        import fusekit.dispatch as fd

        real_fence = fd._fence_if_racing
        if mode == "without dispatch's fence":
            fd._fence_if_racing = lambda c, arrays: None
        g = torch.cuda.CUDAGraph()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=s):
            for i, r in enumerate(pipe._runners):
                if mode == "workspace per stage":
                    ws.ptr = bufs[i].data_ptr()
                r()
                if mode == "separator kernel" or (mode.startswith("all separators but after stage ") and i != int(mode.split()[-1])):
                    sep.add_(1)
        ws.ptr = keep_ptr
        fd._fence_if_racing = real_fence
        torch.cuda.current_stream().wait_stream(s)
        return g

    for mode in ("as built", "without dispatch's fence", "workspace per stage", "separator kernel"):
        g = pipe._graph if mode == "as built" else capture(mode)
        errs = []
        for _ in range(args.replays):
            pipe.input_buffer.copy_(x)
            g.replay()
            errs.append(rel(pipe.output_buffer, eager))
        torch.cuda.synchronize()
        bad = [e for e in errs if e]
        print(f"{mode}: {len(bad)} of {len(errs)} replays differ from eager; largest {max(errs):.2e}")
    print("one adjacent pair of stages at a time without a separator between them:")
    for i in range(len(pipe._runners) - 1):
        g = capture(f"all separators but after stage {i}")
        errs = []
        for _ in range(args.replays):
            pipe.input_buffer.copy_(x)
            g.replay()
            errs.append(rel(pipe.output_buffer, eager))
        bad = [e for e in errs if e]
        if bad:
            a, b = pipe.stages[i], pipe.stages[i + 1]
            print(f"   stages {i} -> {i + 1}: {len(bad)} of {len(errs)} differ (largest {max(errs):.2e}); "
                  f"{a.pattern} [{pipe.engines[i][:40]}] {tuple(a.out_shape)} -> {b.pattern} [{pipe.engines[i + 1][:40]}] {tuple(b.out_shape)}; "
                  f"{i + 1} reads {b.inputs}, {i} writes {a.output}")


if __name__ == "__main__":
    main()
