"""What the training probes share: a torchvision model and its fusekit.torch conversion on one
batch, an uncaptured AMP step timed stage by stage on the host, and bench_train's autoencoder with
both sides autotuned."""
from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_train import autoencoder_case, graphed_time_us
from bench_train_models import Data

import fusekit
import fusekit.torch as ft


def converted(model: str = "resnet50", batch: int = 64, size: int = 224) -> tuple[torch.nn.Module, torch.nn.Module, Data]:
    """(torchvision ``model`` with random weights, its fusekit.torch conversion, a random batch): both
    models channels-last on the GPU in training mode, cudnn.benchmark on for PyTorch's side."""
    import torchvision

    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    base = getattr(torchvision.models, model)(weights=None).to(memory_format=torch.channels_last)
    fk, _ = ft.convert(base)
    data = Data(batch, size)
    data.reset()
    return base.cuda().train(), fk.cuda().train(), data


def staged_step(model: torch.nn.Module, data: Data) -> Callable[[], tuple[float, float, float]]:
    """One uncaptured AMP fp16 training step (autocast, GradScaler, SGD momentum) returning the host
    ms of forward + loss, backward and optimizer step; the GPU is synchronized before each stage, so
    none waits on an earlier one's work."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gs = torch.amp.GradScaler("cuda", init_scale=2.0**10)

    def step() -> tuple[float, float, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(data.x), data.y)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        gs.scale(loss).backward()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        gs.step(opt)
        gs.update()
        return (t1 - t0) * 1e3, (t3 - t2) * 1e3, (time.perf_counter() - t4) * 1e3

    return step


def resnet50_eval(batch: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """The pipeline-accuracy probes' setup: torchvision ResNet-50 (random weights, seed 0) float32 in
    eval mode on the GPU, and a random input batch from a generator seeded with ``batch``."""
    import torchvision

    torch.manual_seed(0)
    m = torchvision.models.resnet50(weights=None).cuda().float().eval()
    x = torch.randn(batch, 3, 224, 224, device="cuda", generator=torch.Generator(device="cuda").manual_seed(batch))
    return m, x


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of ``a`` against ``b`` (Frobenius norms, in float32)."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def fwd_bwd(model: torch.nn.Module, data: Data) -> None:
    """One uncaptured forward (fp16 autocast) + cross-entropy + backward; gradients dropped after."""
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.cross_entropy(model(data.x), data.y)
    loss.backward()
    model.zero_grad(set_to_none=True)


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Microseconds per call of ``fn`` over a tight loop of ``calls``, the GPU synchronized before and
    after (the queue drains inside the window: a host-bound loop reads the host, a GPU-bound one the GPU)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / calls


def profile_kernels(run: Callable[[], object], calls: int, skip: tuple[str, ...] = ("Memcpy HtoD", "Memset")
                    ) -> tuple[dict[str, list[float]], float]:
    """``calls`` calls of ``run`` under torch.profiler's CUDA activity: (kernel name -> [launches, device
    us], both summed over the calls; wall ms of the calls, CUDA events around them). Kernels named in
    ``skip`` are left out."""
    from torch.profiler import ProfilerActivity, profile

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(calls):
            run()
        end.record()
        torch.cuda.synchronize()
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.name not in skip:
            out[ev.name][0] += 1
            out[ev.name][1] += ev.device_time
    return dict(out), start.elapsed_time(end)


def host_ms(fn: Callable[[], object]) -> float:
    """Host milliseconds of one call of ``fn``, the GPU synchronized before and after (not counted)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    dt = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return dt


def autotuned_autoencoder(batch: int, fp16: bool, input_grad: bool = True) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """bench_train's autoencoder case (fused, eager, x) with fusekit in "autotune" mode and eager's
    cudnn.benchmark on; prints both sides' captured step times."""
    torch.backends.cudnn.benchmark = True
    fusekit.configure(mode="autotune", disk=False)
    name, fused, eager, x = autoencoder_case(batch, torch.float16 if fp16 else torch.float32)
    if not input_grad:
        x.requires_grad_(False)
        name += ", no input gradient"
    tf, te = graphed_time_us(fused, x), graphed_time_us(eager, x)
    print(f"{name}: captured step fusekit {tf:.1f} us, eager {te:.1f} us ({te / tf:.2f}x)")
    return fused, eager, x
