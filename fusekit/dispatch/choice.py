"""Fused or split: an op family's fused graph, else (cuDNN refuses it, or it measured slower) its
split graphs, decided once per tag and plan mode and kept in the session (and the disk store)."""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from .. import config, session
from ..adapters import Adapter, adapter_for
from ..engine.cache import PlanCache, default_cache
from ..engine.runtime import current_runtime, versions
from ..errors import FusionWarning, UnsupportedError, warn_once
from ..timing import device_ms


def split_wins(t: tuple[float, float]) -> bool:
    """Whether timings ``t`` = (fused ms, split ms) keep the split (``config.TUNABLES.split_margin``)."""
    return t[1] < config.TUNABLES.split_margin * t[0]


def fused_or_split(
    tag: tuple, fused: Callable[[], Any], split: Callable[[], Any], like: Any = None, instead: str = "as separate graphs"
) -> Any:
    """Run ``fused``; if cuDNN refuses it, run ``split`` for this tag from then on (a warning the first
    time cuDNN refuses a tag of this kind, ``tag[0]``).
    With ``like`` (an operand; only for side-effect-free ops) the first call of a tag outside a
    capture, in each plan mode, times both on the GPU (or reads an earlier process's timings from the
    disk store) and keeps the faster (the session's ``fusion_times``). ``instead``: how the warning says
    ``split`` runs the same math (route tags pick between two layouts, not fused and separate graphs)."""
    s = session.current()
    if tag in s.split:
        return split()
    timed = None
    if like is not None:
        timed = (tag, default_cache().mode)
        t = s.fusion_times.get(timed)
        if t is not None and split_wins(t):
            return split()
    try:
        if timed is not None and timed not in s.fusion_times:
            return _time_both(timed, fused, split, like)
        return fused()
    except UnsupportedError as e:
        s.split.add(tag)
        warn_once((tag[0],), f"fusekit: cuDNN has no engine for {tag[0]} with {_describe_tag(tag)}; running it {instead} ({first_line(e)}); "
                  f"other shapes of {tag[0]} that cuDNN refuses run so too, unsaid",
                  FusionWarning, stacklevel=3)  # once per graph kind: a model refused it at every shape says so once
        return split()


def fusion_choice(tag: tuple, mode: str | None = None) -> str | None:
    """"split" or "fused": what :func:`fused_or_split` runs for ``tag`` in ``mode`` (default: the
    cache's); None before its first timed call."""
    s = session.current()
    if tag in s.split:
        return "split"
    t = s.fusion_times.get((tag, mode or default_cache().mode))
    return None if t is None else "split" if split_wins(t) else "fused"


def _time_both(timed: tuple, fused: Callable[[], Any], split: Callable[[], Any], like: Any) -> Any:
    """First call of a (tag, mode): run fused and split once each (their plans built in that mode),
    then time both (fusekit.timing.device_ms, alternating, median of 3) and remember the faster. cuDNN's fused
    engines are at times far slower than the split graphs (a float32 transposed conv + bias + ReLU:
    149 us fused against 44 us for its dgrad alone, H200)."""
    y = fused()  # first: it checks the operands (an OperandError before any timing)
    times = session.current().fusion_times
    ad = adapter_for(like)
    device = ad.describe(like)[3]
    if ad.capturing(device):
        return y
    cache = default_cache()
    key = _decision_key(timed, ad, device, cache) if cache.store is not None else None
    t = cache.stored_fusion(key) if key is not None else None
    if t is not None:  # timed by an earlier process on this GPU with these versions
        times[timed] = t
        return split() if split_wins(t) else y
    try:
        split()
    except UnsupportedError:  # no split either: the fused graph it is
        times[timed] = (math.nan, math.inf)
        return y
    tf, ts = [], []
    for _ in range(3):
        tf.append(device_ms(ad, fused))
        ts.append(device_ms(ad, split))
    t = times[timed] = (sorted(tf)[1], sorted(ts)[1])
    if key is not None:
        cache.store_fusion(key, t[0], t[1], "split" if split_wins(t) else "fused")
    return split() if split_wins(t) else fused()  # run again: with ``out`` given, the timed runs left the split's values in it


def _decision_key(timed: tuple, ad: Adapter, device: int, cache: PlanCache) -> dict:
    """What a stored fused-or-split decision is valid for, as JSON values: the tag (pattern, attributes,
    each array's shape, dtype and strides in elements), the plan mode and heuristics, the numerics
    policy, the GPU, and the cuDNN, frontend and fusekit versions."""
    tag, mode = timed
    facts, v, tf32 = current_runtime().device_facts(ad, device), versions(), config.allow_tf32()
    arrays = []
    for shape, dt, strides in tag[2:]:
        per = getattr(dt, "itemsize", 1) if not str(dt).startswith("torch.") else 1  # CuPy strides are in bytes
        arrays.append([list(shape), str(dt).replace("torch.", ""), [int(st) // per for st in strides]])
    key = {
        "tag": tag[0], "attrs": tag[1], "arrays": arrays, "mode": mode, "heuristics": list(cache.heuristics),
        "tf32": {"conv": tf32.conv, "matmul": tf32.matmul}, "gpu": facts.name, "cc": list(facts.cc),
        "cudnn_backend": v.cudnn_backend, "frontend": v.frontend, "fusekit": config.__version__,
    }
    return json.loads(json.dumps(key, default=str))  # tuples as lists: as it reads back from the file


def _describe_tag(tag: tuple) -> str:
    """A tag's arrays as dtype[shape] (e.g. float16[8, 256, 7, 7]), comma-separated."""
    return ", ".join(f"{str(a[1]).replace('torch.', '')}{list(a[0])}" for a in tag[2:])


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of ``e``'s message, at most ``limit`` characters (cuDNN's refusals carry its
    whole multi-line engine log; the warning keeps the sentence that says what was refused)."""
    line = str(e).strip().split("\n", 1)[0].strip()
    return line if len(line) <= limit else line[: limit - 1] + "…"
