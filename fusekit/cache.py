"""Plan keys and the plan cache (an in-memory LRU of built plans)."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .tensors import TensorSpec

DEFAULT_HEURISTICS: tuple[str, ...] = ("A", "FALLBACK")


@dataclass(frozen=True)
class PlanKey:
    """Everything that makes a built plan valid."""

    pattern: str
    digest: str  # content hash of the pattern file
    specs: tuple[tuple[str, TensorSpec], ...]  # operands then outputs
    alignments: tuple[int, ...]  # per entry of ``specs``: largest power of two <= 32 dividing the pointer
    attrs: tuple[tuple[str, Any], ...]
    compute_dtype: str
    gpu: str
    cc: tuple[int, int]
    cudnn_backend: int
    frontend: str
    heuristics: tuple[str, ...] = DEFAULT_HEURISTICS

    def describe(self) -> str:
        shapes = ", ".join(f"{n}={s.dtype}{list(s.shape)}:{s.layout}" for n, s in self.specs)
        attrs = ", ".join(f"{k}={v}" for k, v in self.attrs)
        return f"{self.pattern}({shapes}; {attrs}) on {self.gpu} sm_{self.cc[0]}{self.cc[1]}"


@dataclass(eq=False)
class Plan:
    """A built cuDNN plan for one key: execute ``graph`` with buffers in ``uids`` order."""

    key: PlanKey
    graph: Any
    uids: tuple[int, ...]
    workspace_size: int
    engine: str
    candidates: int
    build_ms: float
    evicted: bool = field(default=False, repr=False)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    builds: int = 0
    evictions: int = 0


class PlanCache:
    """LRU of plans keyed by :class:`PlanKey`. ``maxsize`` defaults to $FUSEKIT_CACHE_SIZE or 512."""

    def __init__(self, maxsize: int | None = None, heuristics: tuple[str, ...] = DEFAULT_HEURISTICS) -> None:
        self.maxsize = int(maxsize if maxsize is not None else os.environ.get("FUSEKIT_CACHE_SIZE", 512))
        if self.maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {self.maxsize}")
        self.heuristics = tuple(heuristics)
        self.stats = CacheStats()
        self._plans: OrderedDict[PlanKey, Plan] = OrderedDict()
        self._lock = threading.RLock()
        self._on_evict: list[Callable[[Plan], None]] = []

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, key: PlanKey) -> bool:
        return key in self._plans

    def __iter__(self) -> Iterator[PlanKey]:
        return iter(list(self._plans))

    def get(self, key: PlanKey) -> Plan | None:
        """The cached plan (marked most recently used), or None."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
            return plan

    def get_or_build(self, key: PlanKey, build: Callable[[], Plan]) -> Plan:
        with self._lock:
            plan = self.get(key)
            if plan is not None:
                self.stats.hits += 1
                return plan
            self.stats.misses += 1
            plan = build()
            self.stats.builds += 1
            self.put(plan)
            return plan

    def put(self, plan: Plan) -> None:
        with self._lock:
            old = self._plans.get(plan.key)
            if old is not None and old is not plan:
                self._evicted(old)
            self._plans[plan.key] = plan
            self._plans.move_to_end(plan.key)
            while len(self._plans) > self.maxsize:
                _, old = self._plans.popitem(last=False)
                self._evicted(old)

    def clear(self) -> None:
        with self._lock:
            plans = list(self._plans.values())
            self._plans.clear()
            for p in plans:
                self._evicted(p)

    def on_evict(self, callback: Callable[[Plan], None]) -> None:
        """Call ``callback(plan)`` whenever a plan leaves the cache (dispatch tables drop it)."""
        self._on_evict.append(callback)

    def _evicted(self, plan: Plan) -> None:
        plan.evicted = True
        self.stats.evictions += 1
        for cb in self._on_evict:
            cb(plan)


_default: PlanCache | None = None


def default_cache() -> PlanCache:
    global _default
    if _default is None:
        _default = PlanCache()
    return _default
