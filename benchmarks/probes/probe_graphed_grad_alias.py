"""Do gradients of a model made CUDA graphs accumulate over micro-batches as uncaptured ones do?

Prediction (2026-12-04): ``torch.cuda.make_graphed_callables`` hands its static gradient buffers to
autograd, which adopts them as ``.grad`` when ``.grad`` is None; the next backward replay then
overwrites ``.grad`` before adding to it, so two micro-batches give twice the second one's gradient.
``fusekit.torch.graphed`` keeps the buffers referenced, so autograd copies them instead.

Three sides from the same weights (a small torch.nn CNN, float32, TF32 off): uncaptured,
make_graphed_callables, fusekit.torch.graphed (warmup 1); each does ``zero_grad`` then two
micro-batches' forward + backward, for set_to_none True and False. Prints each side's relative
gradient error against the uncaptured side and whether ``.grad`` shares memory with a graph buffer.

    python benchmarks/probes/probe_graphed_grad_alias.py
"""
from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import fusekit.torch as ft  # noqa: E402


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(16, 10)).cuda()


def main() -> None:
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(8, 3, 16, 16, device="cuda", generator=gen), torch.randint(0, 10, (8,), device="cuda", generator=gen))
               for _ in range(8)]
    eager = net()
    sample = batches[0][0].clone()
    sides = {"uncaptured": eager, "make_graphed_callables": torch.cuda.make_graphed_callables(copy.deepcopy(eager), (sample,)),
             "fusekit.torch.graphed": ft.graphed(copy.deepcopy(eager), warmup=1)}
    for set_to_none in (True, False):
        for k in range(0, 8, 2):
            grads = {}
            for name, model in sides.items():
                model.zero_grad(set_to_none=set_to_none)
                for x, t in batches[k:k + 2]:
                    F.cross_entropy(model(x), t).backward()
                grads[name] = [p.grad.detach().clone() for p in model.parameters()]
            for name in list(sides)[1:]:
                err = max(float((g - r).norm() / r.norm()) for g, r in zip(grads[name], grads["uncaptured"]))
                print(f"set_to_none={set_to_none} step {k // 2}: {name:24s} largest relative gradient error {err:.2e}")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
