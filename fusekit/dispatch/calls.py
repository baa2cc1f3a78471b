"""The call table: resolved calls by call signature, in the current session."""

from __future__ import annotations

import math
from threading import get_ident
from typing import Any, Sequence

from .. import config, session
from ..adapters import SIGNATURES, STREAMS, Adapter
from ..engine import lower
from ..engine.cache import Plan, PlanCache
from ..engine.runtime import Workspace
from ..tensors import ITEMSIZE, TensorSpec


class Call:
    """Everything a cache hit needs, resolved once."""

    __slots__ = ("plan", "graph", "uids", "handle", "stream", "workspace", "outs", "out_adapter", "relayout", "origin",
                 "device", "epilogue", "out_nbytes", "native")

    def __init__(
        self, plan: Plan, handle: Any, stream: int, workspace: Any, outs: tuple[TensorSpec, ...], out_adapter: Adapter,
        relayout: frozenset = frozenset(), origin: Plan | None = None, device: int = 0,
        epilogue: tuple[tuple[int, int], ...] = (),
    ):
        self.plan, self.graph, self.uids = plan, plan.graph, plan.uids
        self.handle, self.stream = handle, stream  # the thread's handle, set to this call's stream before execute
        self.workspace, self.outs, self.out_adapter = workspace, outs, out_adapter
        self.relayout = relayout  # positions (operands, then outputs) run through channels-last copies
        self.origin = origin or plan  # the cached plan it runs (or stands in for): its eviction drops the call
        self.device = device
        self.epilogue = epilogue  # (operand position, bytes) of each epilogue operand (Pattern.epilogue_operands)
        self.out_nbytes = tuple(nbytes(s) for s in outs)
        self.native = lower.native_execute(plan.graph, plan.uids)  # None: graph.execute


def nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * ITEMSIZE[spec.dtype]


def arrays_key(k: list, arrays: Sequence[Any]) -> tuple:
    """``k`` + each array's (shape, strides, dtype, device, ptr % 32) (None for None; the first is an
    array), the current stream of the first array's device and the thread (handles are per thread).
    Raises (KeyError, TypeError, ...) when an array type is not known yet."""
    device = len(k) + 3  # where the first array's device lands
    for a in arrays:
        if a is None:
            k.append(None)
        else:
            k += SIGNATURES[type(a)](a)
    k.append(STREAMS[type(arrays[0])](k[device]))
    k.append(get_ident())
    k.append(config.torch_tf32_flags())  # the numerics policy follows PyTorch's switches (config.allow_tf32)
    return tuple(k)


def call_key(pattern: str, names: tuple, values: tuple, arrays: Sequence[Any], alloc: bool) -> tuple:
    """The call table's key of a call: attributes and :func:`arrays_key` of its arrays (operands first)."""
    return arrays_key([pattern, names, values, alloc], arrays)


def drop_plan(s: session.Session, plan: Plan) -> None:
    with s.lock:
        for k in [k for k, c in s.calls.items() if c.origin is plan]:
            del s.calls[k]
        s.forget_calls(invalid=False)


def drop_workspace(ws: Workspace) -> None:
    """Forget the calls bound to ``ws`` (it lost its buffer): they resolve again and regrow it."""
    s = session.current()
    with s.lock:
        for k in [k for k, c in s.calls.items() if c.workspace is ws]:
            del s.calls[k]
        s.forget_calls()


def watch(cache: PlanCache) -> None:
    """Drop the session's calls when their plans leave ``cache`` (the caches themselves, not their ids:
    a new cache may reuse the id of one that is gone)."""
    s = session.current()
    if cache not in s.watched:
        cache.on_evict(lambda plan: drop_plan(s, plan))
        s.watched.add(cache)


def resolved_calls() -> int:
    """How many call signatures the call table holds (each bound to a resolved call)."""
    return len(session.current().calls)


def resolved_call(plan: Plan) -> Any:
    """A resolved call that runs ``plan`` (its ``handle``, ``stream``, ``workspace``), or None."""
    s = session.current()
    with s.lock:
        return next((c for c in s.calls.values() if c.plan is plan), None)


def clear_dispatch() -> None:
    """Forget every resolved call and tape (plans stay in their cache)."""
    session.current().clear()


def release() -> None:
    """Let go of fusekit's GPU-side state in this process (the current session's, :meth:`Session.release`):
    resolved calls, the default cache's plans in memory (its disk store stays), cuDNN workspaces and
    this thread's cuDNN handles, after waiting for the devices. Later calls rebuild or reload what
    they need. Runs at interpreter exit too, so that the frontend's objects are gone before its
    extension module is torn down."""
    session.current().release()
