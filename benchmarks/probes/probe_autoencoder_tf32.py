"""Which gradient of the fp32 autoencoder (batch 64) is 1e-2 off a float64 reference in fusekit,
and is it TF32? Per-parameter relative errors of fusekit (default numerics policy: TF32 convs, as
PyTorch), fusekit with TF32 off, and eager, each against a float64 copy of the model.

    python benchmarks/probes/probe_autoencoder_tf32.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fusekit
from bench_train import autoencoder_case, grads, reference


def errs(g, r) -> list[str]:
    return [f"{float((a - b).norm() / b.norm().clamp_min(1e-30)):.1e}" for a, b in zip(g, r)]


def main() -> None:
    torch.backends.cudnn.benchmark = True
    for batch in (16, 64):
        name, fused, eager, x = autoencoder_case(batch)
        names = [n for n, _ in fused.named_parameters()] + ["input"]
        ref = reference(eager, x)
        fusekit.configure(disk=False)
        tf32 = errs(grads(fused, x), ref)
        fusekit.configure(disk=False, allow_tf32=False)
        ieee = errs(grads(fused, x), ref)
        eag = errs(grads(eager, x), ref)
        print(name)
        for row in zip(names, tf32, ieee, eag):
            print("  {:<28} fusekit {:>8}  fusekit no-TF32 {:>8}  eager {:>8}".format(*row))
        fusekit.configure(disk=False)


if __name__ == "__main__":
    main()
