"""The CUDA-graph timing every benchmark here uses (see the device tool's METHOD.md): fn_i captured
in one graph, its replays timed by fusekit.timing."""

from __future__ import annotations

import statistics
from typing import Callable

import torch

import fusekit.adapters
import fusekit.timing


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
    times = fusekit.timing.events_ms(fusekit.adapters.library("torch"), g.replay, trials=trials, warmup=3)
    return statistics.median(times) * 1e3 / reps


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
    """Host microseconds per call of fn (:func:`fusekit.timing.host_us`: the median of ``trials`` runs of
    ``n`` back-to-back calls, after ``warm`` calls). Meaningful where the host bounds: keep each call's
    GPU work below its host time."""
    return fusekit.timing.host_us(fn, calls=n, trials=trials, warmup=warm, synchronize=torch.cuda.synchronize)
