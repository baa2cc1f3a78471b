"""pytest plugin (``-p capture_watch``, this folder on PYTHONPATH): while a CUDA-graph capture is
under way, checks the capturing stream's status around fusekit's executes, handle bindings, pool
kernel launches, workspace growth, cache releases and Python's garbage collections, and reports the
first event after which a capture went from active to invalidated (to stderr, and appended to
$CAPTURE_WATCH_LOG). Question: what invalidates test_graphed_captures_each_signature_and_runs_eval_
uncaptured's backward capture when the rest of its file ran first (2026-12-05)?"""

from __future__ import annotations

import collections
import gc
import os
import sys
import threading
import traceback

import cupy
import torch

import fusekit.dispatch.execute as D
import fusekit.engine.runtime as R
import fusekit.ops.pool as P

_EVENTS: collections.deque = collections.deque(maxlen=40)
_REPORTED: set = set()
_LOG = os.environ.get("CAPTURE_WATCH_LOG")


def _status() -> int:
    """0 none, 1 active, 2 invalidated: the current torch stream's capture status."""
    try:
        return int(cupy.cuda.runtime.streamIsCapturing(torch.cuda.current_stream().cuda_stream))
    except Exception:
        return -1


def _report(event: str) -> None:
    key = (threading.get_ident(), len(_REPORTED))
    if key in _REPORTED:
        return
    _REPORTED.add(key)
    lines = ["capture_watch: capture INVALIDATED after " + event, "  last events (thread, event, before -> after):"]
    lines += [f"    {t} {e} {b} -> {a}" for t, e, b, a in list(_EVENTS)[-25:]]
    lines += ["  stack:"] + ["    " + ln.rstrip() for ln in traceback.format_stack(limit=18)[:-2]]
    text = "\n".join(lines)
    print(text, file=sys.stderr, flush=True)
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(text + "\n\n")


def _note(event: str, before: int, after: int) -> None:
    _EVENTS.append((threading.get_ident() % 10000, event, before, after))
    if before == 1 and after == 2:
        _report(event)


def _wrap(owner: object, name: str, label) -> None:
    f = getattr(owner, name)

    def watched(*a, **k):
        before = _status()
        if before == 0:
            return f(*a, **k)
        try:
            return f(*a, **k)
        finally:
            try:
                what = label(a)
            except Exception as e:
                what = f"{name} ({e})"
            _note(what, before, _status())

    setattr(owner, name, watched)


def _describe_call(a) -> str:
    c = a[0]
    return f"execute {c.origin.key.describe()[:160]} ws={c.workspace.size}"


_wrap(D, "execute", _describe_call)
_wrap(D, "bind", lambda a: "bind handle")
_wrap(P.Launch, "run", lambda a: f"pool kernel {a[2]} {a[1]}")
_wrap(R.Workspace, "ensure", lambda a: f"workspace.ensure {a[1]} (was {a[0].size})")
_wrap(R, "release_cached_memory", lambda a: "release_cached_memory")

_GC: dict = {}


def _gc(phase: str, info: dict) -> None:
    tid = threading.get_ident()
    if phase == "start":
        _GC[tid] = _status()
    else:
        before = _GC.pop(tid, 0)
        if before:
            _note(f"gc gen{info.get('generation')} collected {info.get('collected')}", before, _status())


gc.callbacks.append(_gc)
