"""The plan cache: an in-memory LRU in front of an on-disk store of built plans (keys and plans in
:mod:`.plans`, the store in :mod:`.store`; both importable from here).

A miss goes memory -> disk -> build. The disk store keeps one file per key: a JSON header line
(the full key, the chosen plan, candidate timings, versions, the blob's length and SHA-256)
followed by the serialized cuDNN graph. Files are written to a temporary name and renamed, so a
reader never sees half an entry; a per-key file lock makes concurrent processes build a key once.
Beside the plans it keeps fused-or-split decisions (``<root>/fusion``, one small JSON file each):
the two timings of a fused graph and its split, per call configuration, plan mode, GPU and versions.
An entry that fails its checks is moved aside with a warning and rebuilt, never trusted; so is one
that another user could have written (a cuDNN plan can carry engine code). A store that cannot be
used (not writable, full, unlockable) costs one warning and the cache goes on in memory.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from .. import config, session
from ..errors import CacheWarning, SettingError
from .plans import ENTRY_FORMAT, FUSION_FORMAT, Plan, PlanKey  # noqa: F401 - the cache's data, imported from here too
from .store import DiskStore, Entry, EntryError, default_cache_dir, fusion_digest  # noqa: F401

DEFAULT_HEURISTICS: tuple[str, ...] = ("A", "FALLBACK")
MODES = config.MODES


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    builds: int = 0
    evictions: int = 0
    disk_hits: int = 0
    disk_writes: int = 0
    rejected: int = 0  # disk entries moved aside (failed checks, or cuDNN refused the blob)
    disk_errors: int = 0  # store operations that failed (unwritable, full, unlockable, untrusted)




class PlanCache:
    """LRU of plans keyed by :class:`PlanKey`, optionally backed by a :class:`DiskStore`.

    ``maxsize``: $FUSEKIT_CACHE_SIZE or 512. ``mode``: "heuristic" (first plan the heuristics
    offer) or "autotune" (time every candidate on first use of a key); $FUSEKIT_MODE.
    """

    def __init__(
        self,
        maxsize: int | None = None,
        heuristics: tuple[str, ...] = DEFAULT_HEURISTICS,
        store: DiskStore | None = None,
        mode: str | None = None,
    ) -> None:
        self.maxsize = int(maxsize if maxsize is not None else config.cache_size())
        if self.maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {self.maxsize}")
        self.mode = mode or config.mode()
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        self.heuristics = tuple(heuristics)
        self.store = store
        self.stats = CacheStats()
        self._plans: OrderedDict[PlanKey, Plan] = OrderedDict()
        self._lock = threading.RLock()
        self._on_evict: list[Callable[[Plan], None]] = []

    def __len__(self) -> int:
        return len(self._plans)

    def __bool__(self) -> bool:  # an empty cache is still a cache (``cache or default`` must not skip it)
        return True

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

    def get_or_build(self, key: PlanKey, build: Callable[[], Plan], load: Callable[[Entry], Plan] | None = None) -> Plan:
        """The plan for ``key``: from memory, else from the disk store (through ``load``), else
        ``build()`` (then written to the store). A store that fails is skipped (see DiskStore.fail)."""
        with self._lock:
            plan = self.get(key)
            if plan is not None:
                self.stats.hits += 1
                return plan
            self.stats.misses += 1
            if self.store is None or load is None:
                plan = build()
                self.stats.builds += 1
            else:
                with self._store_lock(key):
                    plan = self._from_store(key, load)
                    if plan is None:
                        plan = build()
                        self.stats.builds += 1
                        self.save(plan)
            self.put(plan)
            return plan

    @contextlib.contextmanager
    def _store_lock(self, key: PlanKey) -> Iterator[None]:
        """Hold the store's lock for ``key``, or no lock if it cannot be taken."""
        assert self.store is not None
        lock = None
        try:
            lock = self.store.lock(key)
            lock.acquire()
        except OSError as e:
            lock = None
            self._store_failed("cannot lock", e)
        try:
            yield
        finally:
            if lock is not None:
                lock.release()

    def _store_failed(self, what: str, e: OSError) -> None:
        assert self.store is not None
        self.stats.disk_errors += 1
        self.store.fail(f"{what} ({e})")

    def _from_store(self, key: PlanKey, load: Callable[[Entry], Plan]) -> Plan | None:
        assert self.store is not None
        before = self.store.quarantined
        try:
            entry = self.store.read(key)
        except OSError as e:
            self._store_failed("cannot read", e)
            return None
        self.stats.rejected += self.store.quarantined - before
        if entry is None:
            return None
        try:
            plan = load(entry)
        except Exception as e:  # noqa: BLE001 - a blob the library will not load is rebuilt, not trusted
            self.stats.rejected += 1
            self.store.quarantined -= 1  # counted just above
            self.store.quarantine(entry.path, f"cuDNN could not load it: {type(e).__name__}: {e}")
            return None
        self.stats.disk_hits += 1
        return plan

    def save(self, plan: Plan) -> None:
        """Write ``plan`` to the disk store (if any); a plan cuDNN cannot serialize, or the store cannot
        take, stays in memory."""
        if self.store is None:
            return
        try:
            blob = plan.graph.serialize(as_bytes=True)
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"fusekit: plan for {plan.key.describe()} cannot be serialized ({e}); kept in memory only", CacheWarning, stacklevel=2)
            return
        try:
            self.store.write(plan.key, plan.meta(), bytes(blob))
        except OSError as e:
            self._store_failed("cannot write", e)
            return
        self.stats.disk_writes += 1

    def stored_fusion(self, key: Mapping[str, Any]) -> tuple[float, float] | None:
        """The disk store's (fused ms, split ms) for a fused-or-split decision ``key``, if it has one."""
        if self.store is None:
            return None
        try:
            return self.store.read_fusion(key)
        except OSError as e:
            self._store_failed("cannot read", e)
            return None

    def store_fusion(self, key: Mapping[str, Any], fused_ms: float, split_ms: float, choice: str) -> None:
        """Keep a fused-or-split decision in the disk store (if any), for later processes."""
        if self.store is None:
            return
        try:
            self.store.write_fusion(key, fused_ms, split_ms, choice)
        except OSError as e:
            self._store_failed("cannot write", e)

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


def default_cache() -> PlanCache:
    """The session's cache (:mod:`fusekit.session`), made on first use: on-disk store unless
    $FUSEKIT_CACHE_DIR is "off"/"none", or the store's directory cannot be used by this user (then
    plans stay in memory, with one CacheWarning)."""
    s = session.current()
    if s.cache is None:
        store = None if config.disk_cache_off() else DiskStore()
        why = store.access_problem() if store is not None else None
        if why:
            warnings.warn(f"fusekit plan cache at {store.root}: {why}; going on with plans in memory", CacheWarning, stacklevel=2)
            store = None
        s.cache = PlanCache(store=store)
    return s.cache


def configure(
    *, cache_dir: str | os.PathLike[str] | None = None, disk: bool = True, mode: str | None = None, maxsize: int | None = None,
    allow_tf32: config.Tf32Setting = None,
) -> PlanCache:
    """Replace the process-wide cache and numerics policy (e.g. ``configure(mode="autotune", cache_dir=...)``);
    what is not given comes from the environment ($FUSEKIT_*), as at start-up.

    ``allow_tf32``: which op families' float32 graphs may run on TF32 tensor cores (config.Tf32Policy):
    True / False for all, ``{"conv": True, "matmul": False}`` (PyTorch's defaults, used when None and
    $FUSEKIT_ALLOW_TF32 is unset), or a string as that variable takes ("conv", "matmul", "all", "none").
    A bad value raises SettingError and leaves everything as it was."""
    s = session.current()
    old = s.cache
    config.tf32_policy(allow_tf32)  # checked before anything changes
    if maxsize is not None:
        maxsize = config.checked_cache_size(maxsize)
    if mode is not None and mode not in MODES:
        raise SettingError("mode", mode, f"one of {', '.join(MODES)}")
    if cache_dir is not None and disk:
        cache_dir = config.checked_cache_dir(cache_dir)
    new = PlanCache(maxsize=maxsize, store=DiskStore(cache_dir) if disk else None, mode=mode)
    config.set_allow_tf32(allow_tf32)
    s.cache = new
    if old is not None:
        old.clear()  # dispatch tables drop its plans
    return new
