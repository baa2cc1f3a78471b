"""Why a compiled ResNet-50 (random weights, fp16, batch 8) was 2e-2 off PyTorch float32 in the
pipeline test (device call 5 of 2026-12-03) while PyTorch's own float16 run was 4.5e-4 off and the
batch-32 bench pipeline 4.3e-4: the end-to-end error with choose=True and False, and each build's
stages with the largest error against PyTorch float32 on the same stage inputs (pipeline.check).
Then the choose=False build again with plans carrying some of cuDNN's numerical notes kept out of
every float16 key (the hypothesis: split-K engines with a 16-bit reduction, REDUCED_PRECISION_
REDUCTION, which the heuristics favour for small batches), each on a fresh memory-only cache.

    python benchmarks/probes/probe_pipeline_error.py [--batch 8]
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
from fusekit.engine import lower


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    import torchvision

    m, _ = resnet50_eval(args.batch)
    half = torchvision.models.resnet50(weights=None).cuda()
    half.load_state_dict(m.state_dict())
    half = half.half().to(memory_format=torch.channels_last).eval()
    gen = torch.Generator(device="cuda").manual_seed(args.batch)
    xs = [torch.randn(args.batch, 3, 224, 224, device="cuda", generator=gen) for _ in range(2)]
    with torch.no_grad():
        want = [m(x) for x in xs]
        print("torch fp16 rel:", [f"{rel(half(x.half().contiguous(memory_format=torch.channels_last)), w):.2e}" for x, w in zip(xs, want)])
    real_notes = lower.precision_notes
    variants = [("choose=True", True, ()), ("choose=False", False, ()),
                ("choose=False, no REDUCED_PRECISION_REDUCTION", False, ("REDUCED_PRECISION_REDUCTION",)),
                ("choose=False, no WINOGRAD / FFT", False, ("WINOGRAD", "WINOGRAD_TILE_4x4", "WINOGRAD_TILE_6x6", "WINOGRAD_TILE_13x13", "FFT"))]
    for label, choose, notes in variants:
        fusekit.configure(disk=False)
        lower.precision_notes = (lambda pat, specs, tf32=False, _n=notes: real_notes(pat, specs, tf32)
                                 or (_n if specs[pat.operands[0].name].dtype == "float16" else ()))
        pipe = fp.compile(m, torch.zeros(args.batch, 3, 224, 224), dtype="float16", choose=choose)
        lower.precision_notes = real_notes
        got = [rel(pipe(x), w) for x, w in zip(xs, want)]
        print(f"{label}: pipeline rel {[f'{g:.2e}' for g in got]}; choices {len(pipe.choices)}")
        rows = sorted(pipe.check(xs[0]), key=lambda r: -r["rel_err"])
        for r in rows[:6]:
            print(f"   stage {r['stage']:3d} {r['pattern']:<20} {r['rel_err']:.2e}  {r['engine'][:90]}")
        print(f"   median stage error {rows[len(rows) // 2]['rel_err']:.2e} over {len(rows)} stages")


if __name__ == "__main__":
    main()
