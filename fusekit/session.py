"""The one owner of fusekit's runtime state in a process.

A :class:`Session` holds what fusekit learns and makes while it runs: the table of resolved calls,
the keys cuDNN refused, the fused-or-split decisions and their timings, the recorded tapes, the
outputs last written on each stream, the warnings already given, the default plan cache, the cuDNN
handles and workspaces (``runtime``), and memo tables (compiled kernels, device constants, side
streams, measured peaks). Everything else in fusekit is stateless or a registry (adapters, patterns).

``current()`` is the session every call uses; ``scoped()`` runs a block on another one (a fresh one
by default) and puts the previous one back after it, which is how tests start from nothing.
``release()`` lets go of a session's GPU-side state (resolved calls, plans in memory).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

__all__ = ["Recording", "Session", "current", "scoped"]


class Recording(threading.local):
    """This thread's recordings under way: ``steps`` (dispatch.taped's: each call run while it records)
    and ``block`` (fusekit.torch's replay recorder, noting each call)."""

    steps: list | None = None
    block: Any = None


class Session:
    """fusekit's runtime state; see the module's docstring. Its attributes are dispatch's to change."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards calls (and, through it, tapes and generation)
        self.calls: dict[tuple, Any] = {}  # call signature -> resolved call
        self.last_out: dict[int, tuple[tuple[int, int], ...]] = {}  # stream -> (pointer, bytes) of the last graph's outputs
        self.watched: weakref.WeakSet[Any] = weakref.WeakSet()  # plan caches whose evictions drop calls
        self.refused_lock = threading.Lock()
        self.refused: OrderedDict[Any, Exception] = OrderedDict()  # plan keys cuDNN refused: not rebuilt while remembered
        self.split: set[tuple] = set()  # fused-or-split tags that run split
        self.fusion_times: dict[tuple, tuple[float, float]] = {}  # (tag, mode) -> (fused ms, split ms)
        self.tapes: dict[tuple, Any] = {}  # key -> tape | (tape, recordings so far) | never
        #: bumped when resolved calls may no longer run as they are (calls cleared, a workspace lost its
        #: buffer): fusekit.torch's replayed tapes, which hold calls, are recorded again
        self.generation = 0
        self.warned: set[tuple] = set()  # (category name, key) of every warning given once
        self.cache: Any = None  # the default PlanCache, made on first use (engine.cache.default_cache)
        self.tf32_policy: Any = None  # config.Tf32Policy that fusekit.configure(allow_tf32=...) set, if any
        self.observers: list[Callable[[Any, tuple, tuple], None]] = []  # called after each execute
        self.recording = Recording()
        self.runtime: Any = None  # engine.runtime.Runtime: handles and workspaces, made on first use
        self.tf32_fallback_graphs: weakref.WeakSet[Any] = weakref.WeakSet()  # graphs built on TF32 against the policy
        self._tables: dict[str, dict] = {}

    def table(self, name: str) -> dict:
        """The memo table ``name`` (a dict made on first use): what a module keeps between calls."""
        t = self._tables.get(name)
        if t is None:
            t = self._tables.setdefault(name, {})
        return t

    def observe(self, fn: Callable[[Any, tuple, tuple], None]) -> Callable[[], None]:
        """Call ``fn(call, operands, outputs)`` after every graph this session executes (tests and
        tools watching dispatch); returns a function that stops it."""
        self.observers.append(fn)
        return lambda: self.observers.remove(fn) if fn in self.observers else None

    def forget_calls(self, invalid: bool = True) -> None:
        """Drop the tapes (they hold resolved calls); ``invalid``: the calls themselves may no longer run."""
        self.tapes.clear()
        self.generation += invalid

    def clear(self) -> None:
        """Forget every resolved call and tape (plans stay in their cache)."""
        with self.lock:
            self.calls.clear()
            self.forget_calls()

    def release(self) -> None:
        """Let go of the session's GPU-side state: resolved calls, tapes, the last outputs, the default
        cache's plans in memory (its disk store stays), workspaces and this thread's cuDNN handles.
        Waits for torch's devices (and CuPy's current one) first. Later calls rebuild or reload what
        they need. The memo tables stay: CUDA graphs captured earlier may read their device constants."""
        _synchronize()
        self.clear()
        self.last_out.clear()
        if self.cache is not None:
            self.cache.clear()
        if self.runtime is not None:
            self.runtime.release()


def _synchronize() -> None:
    """Wait for the work queued on every device torch knows and on CuPy's current device (where those
    libraries are imported and have touched a device)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            cupy.cuda.runtime.deviceSynchronize()
        except Exception:  # no device, or CuPy never touched one
            pass


_current = Session()


def current() -> Session:
    """The session fusekit's calls use now."""
    return _current


@contextmanager
def scoped(session: Session | None = None) -> Iterator[Session]:
    """Run a block on ``session`` (default: a fresh one), releasing it and putting the previous one
    back afterwards. Process-wide: other threads see it too while the block runs."""
    global _current
    prev, s = _current, session if session is not None else Session()
    _current = s
    try:
        yield s
    finally:
        _current = prev
        if session is None:
            s.release()
