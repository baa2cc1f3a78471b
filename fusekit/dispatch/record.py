"""Recording calls: :func:`taped` replays an op's resolved calls once two recordings agree, and
a call recorder (fusekit.torch's replay) notes every resolved call a thread runs."""

from __future__ import annotations

import functools
from typing import Any, Callable

from .. import config, session
from ..adapters import adapter_for
from .calls import Call, arrays_key
from . import execute

#: Recordings that must agree before a tape replays (the first calls of a key resolve plans and time
#: fused against split graphs, and run other graphs than later ones).
_AGREE = 2
_TRIES = 6  # recordings of a key that never agree: it runs unrecorded from then on
NEVER = object()  # a session's tape for a key that is never recorded


def run_call(c: Call, operands: tuple, outs: tuple, alloc: bool) -> tuple:
    """:func:`execute.launch`, noted in the recordings under way on this thread (:func:`taped`, and
    :func:`set_call_recorder`'s)."""
    rec = session.current().recording
    block = rec.block
    if block is None or block.inside:
        res = execute.launch(c, operands, outs, alloc)
    else:
        block.inside += 1  # the call's own allocations and copies are not the block's ops
        try:
            res = execute.launch(c, operands, outs, alloc)
        finally:
            block.inside -= 1
        block.fk(c, operands, None if alloc else outs, res)
    steps = rec.steps
    if steps is not None:
        steps.append((c, operands, None if alloc else outs, res))
    return res


def call_recorder() -> Any:
    """The recorder noting this thread's fusekit calls (:func:`set_call_recorder`), or None."""
    return session.current().recording.block


def recorded_whole(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for an op that launches its own kernels (not resolved calls: pooling, softmax): the
    call recorder notes each call of it whole (``recorder.whole(fn, args, kwargs, result)``), to be
    replayed by calling ``fn`` again."""

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        rec = session.current().recording.block
        if rec is None or rec.inside:  # not recording, or inside a call being noted
            return fn(*args, **kwargs)
        rec.inside += 1  # its own allocations, views and copies are not the recorder's to note
        try:
            res = fn(*args, **kwargs)
        finally:
            rec.inside -= 1
        rec.whole(fn, args, kwargs, res)
        return res

    return op


def set_call_recorder(recorder: Any) -> None:
    """Have ``recorder.fk(call, operands, outputs given or None, outputs)`` note every resolved call
    this thread runs (fusekit.torch.replayed's recordings; None: stop). ``recorder.inside`` is above
    0 while a call runs (its own allocations and copies are not the recorder's to note)."""
    session.current().recording.block = recorder


class Tape:
    """The resolved calls an op made on its arrays, and where each call's arrays come from: ``(0, i)``
    the op's i-th array argument, ``(1, i)`` the i-th constant (an array the op reads that is neither:
    a cached vector; it must be the same object in every recording), ``(2, i)`` the i-th output a
    call allocated. Replaying one runs the calls through :func:`run_call` with new outputs."""

    __slots__ = ("steps", "consts", "result", "single")

    def __init__(self, steps: tuple, consts: tuple, result: tuple, single: bool) -> None:
        self.steps, self.consts, self.result, self.single = steps, consts, result, single

    @staticmethod
    def of(steps: list, args: tuple, result: Any) -> "Tape | None":
        """The tape of one recording (None: the op made or changed arrays outside run(), or returned
        something that is not one of the arrays run() saw)."""
        where = {id(a): (0, i) for i, a in reversed(list(enumerate(args))) if a is not None}
        consts: list = []
        made = 0
        out: list = []
        for c, operands, given, res in steps:
            refs = []
            for a in operands + (given or ()):
                r = where.get(id(a))
                if r is None:
                    r = where[id(a)] = (1, len(consts))
                    consts.append(a)
                refs.append(r)
            if given is None:
                for o in res:
                    where[id(o)] = (2, made)
                    made += 1
            out.append((c, tuple(refs[:len(operands)]), None if given is None else tuple(refs[len(operands):])))
        single = not isinstance(result, tuple)
        refs = []
        for r in ((result,) if single else result):
            if r is None:
                refs.append(None)
            elif id(r) in where and where[id(r)][0] != 1:
                refs.append(where[id(r)])
            else:
                return None
        return Tape(tuple(out), tuple(consts), tuple(refs), single)

    def same(self, other: "Tape") -> bool:
        return (len(self.steps) == len(other.steps) and self.result == other.result and self.single == other.single
                and all(a[0] is b[0] and a[1:] == b[1:] for a, b in zip(self.steps, other.steps))
                and len(self.consts) == len(other.consts) and all(a is b for a, b in zip(self.consts, other.consts)))

    def replay(self, args: tuple) -> Any:
        src: tuple = (args, self.consts, [])
        made = src[2]
        for c, refs, given in self.steps:
            operands = tuple([src[k][i] for k, i in refs])
            if given is None:
                made.extend(run_call(c, operands, (), True))
            else:
                run_call(c, operands, tuple([src[k][i] for k, i in given]), False)
        res = tuple([None if r is None else src[r[0]][r[1]] for r in self.result])
        return res[0] if self.single else res


def taped(key: tuple, op: Callable[[], Any], args: tuple) -> Any:
    """``op()``: an op that runs fusekit graphs on the arrays ``args`` (the first one an array, later
    ones may be None) and returns arrays those graphs read or wrote (one, or a tuple; None allowed);
    ``key`` holds everything else that selects its graphs. Once two calls of a key, with arrays of
    one signature (shapes, strides, dtypes, devices, alignment, which arguments are the same array,
    the current stream and thread), ran the same resolved calls, later ones replay those calls
    without running ``op``'s Python: the same graphs in the same order, new outputs.

    ``op`` must write arrays only through fusekit calls (another write would not be replayed). An
    array it makes otherwise and passes to a call, or a result it makes itself, keeps it unrecorded.
    Tapes are dropped with the resolved calls (clear_dispatch, plan evictions)."""
    if not config.TUNABLES.tapes:
        return op()
    ids = [id(a) for a in args]
    try:
        k = arrays_key([key, tuple([ids.index(i) for i in ids])], args)  # (which arguments are the same array)
    except Exception:  # an array type dispatch does not know (yet), or None first
        return op()
    s = session.current()
    tapes, rec = s.tapes, s.recording
    t = tapes.get(k)
    if type(t) is Tape:
        return t.replay(args)
    if t is NEVER or rec.steps is not None or adapter_for(args[0]).capturing(k[5]):  # k[5]: the first array's device
        return op()  # not recordable; inside another recording; or inside a CUDA-graph capture
    rec.steps = steps = []
    try:
        result = op()
    finally:
        rec.steps = None
    tape = Tape.of(steps, args, result)
    last, n = t if t is not None else (None, 0)
    if tape is None or n + 1 >= _TRIES:
        tapes[k] = NEVER
    elif last is not None and last.same(tape) and n + 1 >= _AGREE:
        tapes[k] = tape
    else:
        if len(tapes) >= config.TUNABLES.tape_limit:  # keys that keep changing (a momentum of 1 / steps): start over
            tapes.clear()
        tapes[k] = (tape, n + 1)
    return result
