"""How a plan comes to be for a key: built by heuristics, tuned, or loaded from the disk store.
``planner`` gives the (build, load) pair that ``PlanCache.get_or_build`` calls on a miss."""

from __future__ import annotations

import time
from typing import Any, Callable

from ..errors import UnsupportedError
from ..adapters import Adapter
from . import lower
from .autotune import TuneOptions, tune
from .cache import Entry, Plan, PlanCache, PlanKey
from .patterns import Pattern
from .runtime import forget_stream


def planner(
    pattern: Pattern, key: PlanKey, adapter: Adapter, handle: Any, cache: PlanCache, tune_options: TuneOptions | None = None
) -> tuple[Callable[[], Plan], Callable[[Entry], Plan] | None]:
    """(build, load) for ``key``: heuristics (or autotuning in "autotune" mode / with options), and
    deserialization of a stored entry (None for a ``memory_only`` pattern: built in every process)."""
    specs = dict(key.specs)
    attrs = dict(key.attrs)
    device = specs[pattern.operand_names[0]].device

    def build() -> Plan:
        try:
            with adapter.use_device(device):
                if cache.mode == "autotune" or tune_options is not None:
                    return tune(pattern, specs, attrs, key, adapter, handle, tune_options)[0]
                b = lower.build(pattern, specs, attrs, handle, cache.heuristics, key.describe())
        finally:
            forget_stream(handle)
        return Plan(key, b.graph, b.uids, b.workspace_size, b.engine, b.candidates, b.build_ms, engine_id=b.engine_id, knobs=b.knobs)

    def load(entry: Entry) -> Plan:
        why = lower.untrusted(pattern, specs)
        if why:  # stored before fusekit knew of the defect: never executed
            raise UnsupportedError(f"cuDNN cannot run {key.describe()}: {why}")
        try:
            with adapter.use_device(device):
                t0 = time.perf_counter()
                g = lower.deserialize(entry.blob, handle)
                ms = (time.perf_counter() - t0) * 1e3
        finally:
            forget_stream(handle)
        return Plan.from_entry(key, g, entry.header["plan"], ms)

    return build, (None if pattern.memory_only else load)  # type: ignore[return-value]

