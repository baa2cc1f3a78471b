"""Timing helpers the pipeline CLI and benchmarks/bench_pipeline.py share, and a plain PyTorch
execution of a Program (the "PyTorch eager" side for ONNX models, which have no torch module)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import session
from ..timing import median_ms
from .ir import Program, run_torch_stage


def cuda_time_ms(fn: Callable[[], Any], *, iters: int = 20, trials: int = 10, warmup: int = 3,
                 before_trial: Callable[[], Any] | None = None) -> float:
    """Median over ``trials`` of (CUDA-event time of ``iters`` calls of ``fn``) / iters, in ms, on
    PyTorch's current stream (:func:`fusekit.timing.median_ms`). ``before_trial`` (e.g. copying a fresh
    random input in) runs outside the timed region."""
    from ..adapters import library

    return median_ms(library("torch"), fn, iters=iters, trials=trials, warmup=warmup, before_trial=before_trial)


def measured_peaks(device: Any = None, dtype: str = "float16") -> tuple[float, float]:
    """(tensor-core FLOP/s, DRAM bytes/s) this GPU reaches here: a large ``dtype`` matmul and a large
    device-to-device copy (medians of CUDA-event timings); measured once per process and device."""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device() if device is None else torch.device(device).index or 0)
    key, peaks = (dev.index, dtype), session.current().table("measured_peaks")
    if key not in peaks:
        with torch.cuda.device(dev):
            n = 8192
            a = torch.randn(n, n, device=dev, dtype=getattr(torch, dtype))
            b = torch.randn(n, n, device=dev, dtype=getattr(torch, dtype))
            mm = cuda_time_ms(lambda: torch.mm(a, b), iters=5, trials=5)
            del a, b
            src = torch.empty(2**28, device=dev, dtype=torch.uint8).random_()  # 256 MiB
            dst = torch.empty_like(src)
            cp = cuda_time_ms(lambda: dst.copy_(src), iters=10, trials=5)
            peaks[key] = (2.0 * n**3 / (mm * 1e-3), 2.0 * src.numel() / (cp * 1e-3))
            del src, dst
    return peaks[key]


def capture(fn: Callable[[], Any], warmup: int = 3) -> Any:
    """``fn`` captured in a CUDA graph after ``warmup`` calls on the capture stream (PyTorch's recipe)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()
    return g


class TorchProgram:
    """A Program run stage by stage with PyTorch ops (allocating each output), BN already folded:
    ``TorchProgram(prog, "float16")(x)``. Inputs and images are channels-last in ``dtype``."""

    def __init__(self, prog: Program, dtype: str = "float16", device: Any = "cuda") -> None:
        import copy

        import torch

        self.prog, self.dev, self.dt = prog, torch.device(device), getattr(torch, dtype)
        self.weights, self.fns = [], []
        for s in prog.stages:
            w = {}
            for k, v in s.weights.items():
                t = torch.from_numpy(np.asarray(v, np.float64)).to(self.dev, self.dt)
                w[k] = t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t
            self.weights.append(w)
            fn = s.fn
            if isinstance(fn, torch.nn.Module):
                fn = copy.deepcopy(fn).to(self.dev, self.dt).to(memory_format=torch.channels_last)
            self.fns.append(fn)

    def __call__(self, x: Any) -> Any:
        env = {self.prog.input: x}
        for s, w, fn in zip(self.prog.stages, self.weights, self.fns):
            if s.pattern == "reshape":
                env[s.output] = env[s.inputs[0]].reshape(s.out_shape)
            else:
                env[s.output] = run_torch_stage(s, env, fn, w, self.dev, self.dt)
        return env[self.prog.output]
