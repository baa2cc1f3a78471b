"""A torchvision ResNet-18 moved onto fused cuDNN graphs with ``fusekit.torch.convert`` and trained
beside the unconverted model, from the same initial weights on the same batches.

    python examples/train_resnet.py [--steps 100] [--batch 64] [--size 64] [--graphed | --replayed] [--control] [--plot loss.png]

Training: fp16 AMP (torch.autocast + GradScaler), channels-last, SGD with momentum 0.9 (lr 0.002),
cross-entropy on synthetic 10-class images (each class a fixed random low-frequency colour pattern at
0.3 of unit noise, 30% of the labels random, a fresh batch every step), so the loss falls gradually
(2.48 -> 2.01 in 30 steps and 1.64 after 100, eager in float32 on the CPU) instead of memorizing
noise. The converted model runs its convolutions, batch norms (BN+ReLU fused), pooling and
classifier on fusekit's graphs; the other runs PyTorch eager. Prints both loss curves and the
largest relative gap between them, and the milliseconds per step of each.

``--graphed`` makes the converted model's forward and backward CUDA graphs (``fusekit.torch.graphed``:
its first three steps run uncaptured, the fourth captures them): the loop stays the same (autocast,
GradScaler, optimizer), and the per-layer host work is replayed by the driver instead of redone in
Python at every step, which is where an uncaptured step of small layers spends its time.
``--replayed`` (``fusekit.torch.replayed``) keeps the step uncaptured but replays the forward and
backward from a tape recorded at its third and fourth steps: the same kernels, without the modules'
Python, and no CUDA graph (shapes may change; each new one gets its own tape).

Training a random-init ResNet is chaotic: two runs that differ only by rounding drift apart
exponentially. On the CPU in float32 (batch 64, 64x64), eager against eager with its weights
perturbed by a relative 1e-3 gave a largest per-step gap of 2% over 30 steps and 7% over 100.
``--control`` trains such a perturbed eager copy too and prints its gap beside fusekit's: the
yardstick for how close two equally correct implementations can stay.
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

import torch
import torch.nn.functional as F


def synthetic_batches(count: int, batch: int, size: int, classes: int = 10, seed: int = 0, device: str = "cuda",
                      signal: float = 0.3, label_noise: float = 0.3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (images, labels) batches, channels-last float32: image = signal * pattern[class] + noise,
    each class pattern a random 4x4 colour grid upsampled to ``size`` (smooth, unit variance); with
    probability ``label_noise`` a label is replaced by a random class (the loss then has a floor)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    patterns = F.interpolate(torch.randn(classes, 3, 4, 4, generator=g), size=(size, size), mode="bilinear", align_corners=False)
    patterns = patterns / patterns.std(dim=(1, 2, 3), keepdim=True)
    out = []
    for _ in range(count):
        labels = torch.randint(0, classes, (batch,), generator=g)
        x = signal * patterns[labels] + torch.randn(batch, 3, size, size, generator=g)
        flip = torch.rand(batch, generator=g) < label_noise
        labels = torch.where(flip, torch.randint(0, classes, (batch,), generator=g), labels)
        out.append((x.to(device).contiguous(memory_format=torch.channels_last), labels.to(device)))
    return out


def make_models(classes: int = 10, seed: int = 0, device: str = "cuda") -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """(eager ResNet-18, its fusekit conversion, the conversion report): the same initial weights."""
    import torchvision

    import fusekit.torch as ft

    torch.manual_seed(seed)
    eager = torchvision.models.resnet18(weights=None, num_classes=classes)
    fused, report = ft.convert(eager)  # a converted deep copy: identical weights, buffers and state-dict keys
    return (eager.to(device, memory_format=torch.channels_last), fused.to(device, memory_format=torch.channels_last), report)


def train(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int, lr: float = 0.002,
          momentum: float = 0.9, amp: bool = True, times: list[float] | None = None) -> list[float]:
    """SGD (momentum) steps over ``batches`` in order (cycling), under fp16 autocast with a GradScaler;
    the loss of every step (``times``, if given, receives each step's milliseconds). The scaler starts
    at 2**10 and grows rarely, so both models skip the same (no) steps for overflow and their curves
    stay comparable."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=1000, enabled=amp)
    losses = []
    for i in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x, y = batches[i % len(batches)]
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        end.record()
        losses.append(loss.item())
        if times is not None:
            times.append(start.elapsed_time(end))
    return losses


def max_relative_gap(a: list[float], b: list[float]) -> float:
    """max over steps of |a - b| / b."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def run(steps: int = 100, batch: int = 64, size: int = 64, seed: int = 0, lr: float = 0.002, graph: bool = False,
        times: dict[str, list[float]] | None = None, replay: bool = False) -> tuple[list[float], list[float], Any]:
    """(fusekit losses, eager losses, conversion report) of the two models trained from the same weights
    on the same ``steps`` fresh batches (``graph``: the fusekit model's forward and backward as CUDA
    graphs, ``fusekit.torch.graphed``; ``replay``: replayed from a tape, ``fusekit.torch.replayed``;
    ``times``, if given, receives each side's milliseconds per step under "fusekit" and "eager")."""
    if graph and replay:
        raise ValueError("train_resnet.run: graph and replay exclude each other")
    eager, fused, report = make_models(seed=seed)
    batches = synthetic_batches(steps, batch, size, seed=seed)
    if graph or replay:
        import fusekit.torch as ft

        fused = ft.graphed(fused) if graph else ft.replayed(fused)
    times = {} if times is None else times
    fused_losses = train(fused, batches, steps, lr=lr, times=times.setdefault("fusekit", []))
    eager_losses = train(eager, batches, steps, lr=lr, times=times.setdefault("eager", []))
    return fused_losses, eager_losses, report


def control_losses(steps: int = 100, batch: int = 64, size: int = 64, seed: int = 0, lr: float = 0.002,
                   perturbation: float = 1e-3) -> list[float]:
    """Losses of the eager model trained from its initial weights times (1 + perturbation * N(0, 1))."""
    eager, _, _ = make_models(seed=seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    with torch.no_grad():
        for p in eager.parameters():
            p.mul_(1 + perturbation * torch.randn(p.shape, generator=g).to(p.device))
    return train(eager, synthetic_batches(steps, batch, size, seed=seed), steps, lr=lr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=64, help="image height and width")
    ap.add_argument("--lr", type=float, default=0.002)
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--graphed", action="store_true", help="run the converted model's forward and backward as CUDA graphs")
    how.add_argument("--replayed", action="store_true", help="replay the converted model's forward and backward from a tape (uncaptured)")
    ap.add_argument("--control", action="store_true", help="also train eager from weights perturbed by a relative 1e-3")
    ap.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("train_resnet: needs a CUDA GPU")
    times: dict[str, list[float]] = {}
    fk, ea, report = run(args.steps, args.batch, args.size, lr=args.lr, graph=args.graphed, times=times, replay=args.replayed)
    how = " graphed" if args.graphed else " replayed" if args.replayed else ""
    print(report)
    print()
    print(" step   fusekit     eager   rel gap")
    for i in sorted(set(range(0, args.steps, max(1, args.steps // 20))) | {args.steps - 1}):
        print(f"{i:5d}  {fk[i]:8.4f}  {ea[i]:8.4f}  {abs(fk[i] - ea[i]) / ea[i]:8.4f}")
    print(f"loss {fk[0]:.4f} -> {fk[-1]:.4f} (fusekit), {ea[0]:.4f} -> {ea[-1]:.4f} (eager); "
          f"max relative gap {max_relative_gap(fk, ea):.4f}")
    med = {k: statistics.median(v[len(v) // 4:]) for k, v in times.items()}  # the first steps build plans
    print(f"ms per step (median after the first quarter): fusekit{how} {med['fusekit']:.2f}, "
          f"eager {med['eager']:.2f}")
    ctl = None
    if args.control:
        ctl = control_losses(args.steps, args.batch, args.size, lr=args.lr)
        print(f"control: eager from weights perturbed by 1e-3, max relative gap to eager {max_relative_gap(ctl, ea):.4f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.figure(figsize=(6, 4))
        plt.plot(fk, label="fusekit.torch.convert(resnet18)" + how.replace(" ", ", "))
        plt.plot(ea, "--", label="PyTorch eager")
        if ctl is not None:
            plt.plot(ctl, ":", label="eager, weights perturbed by 1e-3")
        plt.xlabel("step")
        plt.ylabel("cross-entropy")
        plt.legend()
        plt.title(f"ResNet-18, fp16 AMP, batch {args.batch}, {args.size}x{args.size}, same initial weights")
        plt.tight_layout()
        plt.savefig(args.plot, dpi=110)
    assert math.isfinite(fk[-1])


if __name__ == "__main__":
    main()
