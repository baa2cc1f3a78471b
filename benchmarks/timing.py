"""The one CUDA-graph timer every benchmark here uses (see the device tool's METHOD.md)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def graph_time_us(
    fn_i: Callable[[int], object], reps: int = 20, trials: int = 15, warm: int = 8,
    reset: Callable[[], None] | None = None,
) -> float:
    """Median device time per call of fn_i(i), i = 0..reps-1, captured in one CUDA graph.

    ``warm`` eager calls on the capture stream first (plans built, workspaces sized, allocator
    warmed); ``reset()`` runs before each of them and before capture (e.g. clearing gradients).
    Each trial replays the graph between two CUDA events; the median over trials is divided by reps."""
    g = capture(fn_i, reps, warm, reset)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def capture(fn_i: Callable[[int], object], reps: int = 1, warm: int = 3, reset: Callable[[], None] | None = None) -> torch.cuda.CUDAGraph:
    """fn_i(0..reps-1) captured in one CUDA graph, after ``warm`` eager calls on the capture stream
    (``reset()`` before each of them and before the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(warm):
            if reset is not None:
                reset()
            fn_i(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if reset is not None:
        reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for i in range(reps):
            fn_i(i)
    return g


def host_us(fn: Callable[[], object], n: int = 300, warm: int = 20, trials: int = 3) -> float:
    """Host microseconds per call of fn: the best of ``trials`` runs of ``n`` back-to-back calls (no
    synchronize inside a run), after ``warm`` calls. Meaningful where the host bounds: keep each
    call's GPU work below its host time."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) * 1e6 / n)
        torch.cuda.synchronize()
    return best
