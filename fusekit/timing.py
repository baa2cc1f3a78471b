"""The one timer: device time by CUDA events (eager calls, or replays of a captured CUDA graph) and
host time by the wall clock. The autotuner, fused-or-split, the pipeline's stages, the CLI and the
benchmarks all time through it; an array library's adapter supplies the events, the stream and the
capture (:class:`fusekit.adapters.Adapter`)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["events_ms", "device_ms", "median_ms", "graph_times_ms", "host_us"]


def events_ms(ad: Any, fn: Callable[[], Any], *, iters: int = 1, trials: int = 1, warmup: int = 0,
              before_trial: Callable[[], Any] | None = None, spin: bool = False, stream: Any = None) -> list[float]:
    """Per trial, the device milliseconds per call of ``iters`` calls of ``fn`` between two events on
    ``stream`` (default: the library's current one), after ``warmup`` calls. The trials are queued
    back to back and read at the end. ``before_trial`` (a fresh input, say) runs outside the timed
    region; ``spin`` queues a ~2 ms spinning kernel before the first trial, so that the trials queue
    behind it and the host's launch time does not count."""
    with ad.use_stream(stream):
        for _ in range(warmup):
            fn()
        ad.synchronize()
        pairs = []
        if spin:
            ad.spin()
        for _ in range(trials):
            if before_trial is not None:
                before_trial()
            a, b = ad.event(), ad.event()
            ad.record(a)
            for _ in range(iters):
                fn()
            ad.record(b)
            pairs.append((a, b))
        return [ad.elapsed_ms(a, b) / iters for a, b in pairs]


def device_ms(ad: Any, fn: Callable[[], Any], reps: int = 5) -> float:
    """GPU milliseconds per ``fn()`` (launching on the current stream): ``reps`` calls back to back
    between two events, queued behind a spinning kernel."""
    return events_ms(ad, fn, iters=reps, spin=True)[0]


def median_ms(ad: Any, fn: Callable[[], Any], *, iters: int = 20, trials: int = 10, warmup: int = 3,
              before_trial: Callable[[], Any] | None = None) -> float:
    """Median over ``trials`` of the per-call milliseconds of ``iters`` calls (:func:`events_ms`)."""
    return statistics.median(events_ms(ad, fn, iters=iters, trials=trials, warmup=warmup, before_trial=before_trial))


def graph_times_ms(ad: Any, stream: Any, fn: Callable[[], Any], trials: int, spin: bool = False) -> list[float]:
    """``fn()`` (launching on the current stream) captured on ``stream`` in a CUDA graph after one eager
    call there; the device time of each of ``trials`` replays on ``stream``. Small kernels are timed
    without the host's launch gaps this way (``spin``: :func:`events_ms`)."""
    replay = ad.capture(stream, fn)
    return events_ms(ad, replay, trials=trials, warmup=1, stream=stream, spin=spin)


def host_us(fn: Callable[[], Any], *, calls: int = 200, trials: int = 9, warmup: int = 20,
            synchronize: Callable[[], Any] | None = None) -> float:
    """Median over ``trials`` of the wall-clock microseconds per call of ``calls`` back-to-back calls
    (the host's cost); ``synchronize`` runs after the warm-up and after each trial, outside the timing."""
    for _ in range(warmup):
        fn()
    if synchronize is not None:
        synchronize()
    out = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        if synchronize is not None:
            synchronize()
    return statistics.median(out)
