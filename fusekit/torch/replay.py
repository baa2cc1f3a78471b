"""Replayed training steps (:func:`fusekit.torch.replayed`): a module's training forward and backward
recorded once as the aten ops and fusekit calls they ran, then replayed under one autograd node.

No CUDA graph: every kernel still launches from the host, on the current stream, with new outputs.
What a replay skips is the Python between them (modules, autograd Functions, casts, fusekit's ops
layer and dispatch keys), which is most of an uncaptured step's host time. An accepted tape is
compacted (:meth:`fusekit.torch.tape._Tape.compact`): casts and buffer updates merged into foreach launches.

A recording is made inside a real training step: the forward runs the module under a
``TorchDispatchMode`` (every aten op below autograd and autocast) and fusekit's call recorder
(:func:`fusekit.dispatch.set_call_recorder`), the backward runs the recorded forward's autograd graph inside
this module's backward node under the same recorders. Tensors are told apart by (data pointer,
shape, strides, dtype): autograd hands saved tensors back as new Python objects over the same memory.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import dispatch, session
from .tape import NotReplayable, _tkey, _Tape

class _Mode(TorchDispatchMode):
    def __init__(self, tape: _Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tape = self.tape
        read = None if tape.inside else tape.reading(func, args, kwargs)
        out = func(*args, **kwargs)
        if read is not None:
            tape.made(0, func, read, out, args)
        return out


class _Recording:
    """Record into ``tape`` on this thread while active: aten ops and fusekit calls."""

    def __init__(self, tape: _Tape) -> None:
        self.tape, self.mode = tape, _Mode(tape)

    def __enter__(self) -> "_Recording":
        if dispatch.call_recorder() is not None:
            raise NotReplayable("a recording is under way already on this thread (a replayed module inside another)")
        dispatch.set_call_recorder(self.tape)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.mode.__exit__(*exc)
        finally:
            dispatch.set_call_recorder(None)


def amp_dtype() -> Any:
    """The CUDA autocast dtype when autocast is on, else None."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def autocast_as(dtype: Any) -> Any:
    """CUDA autocast in ``dtype`` without its weight cache (off for None). Captures require the cache
    off; a recording too (a cast served from the cache would be recorded as a constant and read
    stale after the optimizer's step)."""
    return torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None, cache_enabled=False)


class _Record(torch.autograd.Function):
    """A real training step of the module, recorded: its forward here, its backward in this node's."""

    @staticmethod
    def forward(ctx: Any, fw: "ReplayedForward", key: tuple, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        xin = x.detach().requires_grad_(x.requires_grad)
        tape = _Tape([xin, *params], 1 + len(params))
        with torch.enable_grad(), autocast_as(amp_dtype()), _Recording(tape):
            out = fw.original(xin)
        tape.fwd_end = len(tape.entries)
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            raise NotReplayable(f"its forward returned {type(out).__name__} (a tape replays one differentiable tensor)")
        tape.out = tape.where.get(_tkey(out), -1)
        ctx.fw, ctx.key, ctx.tape, ctx.out, ctx.xin, ctx.params = fw, key, tape, out, xin, params
        return out.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        tape, xin = ctx.tape, ctx.xin
        g = g.detach()  # a new tensor object: no fusekit tags (a consumer's dReLU done) ride into the recording
        tape.g = tape._new(g)
        tape.g_layout = (g.stride(), g.data_ptr() % 32)
        wrt = ((xin,) if xin.requires_grad else ()) + ctx.params
        with _Recording(tape):
            grads = torch.autograd.grad(ctx.out, wrt, g, allow_unused=True)
        tape.grads = [None if t is None else tape.where.get(_tkey(t), -1) for t in grads]
        tape.finish()
        ctx.fw.recorded(ctx.key, tape)
        ctx.out = ctx.xin = None
        return (None, None) + ((None,) if not xin.requires_grad else ()) + grads


class Replay(torch.autograd.Function):
    """A tape's forward and backward replayed."""

    @staticmethod
    def forward(ctx: Any, tape: _Tape, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        vals: list = [None] * tape.n
        vals[0] = x
        vals[1:1 + len(params)] = params
        for s, t in tape.consts.items():
            vals[s] = t
        pool = tape.lease()
        ctx.lease = _Lease(tape) if pool is not None else None
        with autocast_as(None):  # the recorded ops are autocast's already
            tape.run(vals, 0, tape.fwd_end, pool)
        out = vals[tape.out]
        for s in tape.drop:
            vals[s] = None
        vals[tape.out] = None  # not held by ctx (a cycle through the result's grad_fn)
        if tape.out_read:
            ctx.save_for_backward(out)
        ctx.tape, ctx.vals, ctx.gx, ctx.pool = tape, vals, x.requires_grad, pool
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        tape, vals = ctx.tape, ctx.vals
        if vals is None:
            raise RuntimeError("fusekit.torch.replayed: a replayed step's backward ran twice (retain_graph=True); "
                               "set model.forward.enabled = False for such steps")
        ctx.vals = None
        if tape.generation != session.current().generation:
            raise RuntimeError("fusekit.torch.replayed: fusekit's dispatch was cleared (fusekit.release, clear_dispatch or a "
                               "workspace lost) between a replayed forward and its backward; run the step again")
        stride, align = tape.g_layout
        if g.stride() != stride or g.data_ptr() % 32 != align:  # the recorded ops read it with the recording's layout
            g = torch.empty_strided(g.shape, stride, dtype=g.dtype, device=g.device).copy_(g)
        vals[tape.g] = g
        if tape.out_read:
            vals[tape.out] = ctx.saved_tensors[0]
        tape.run(vals, tape.fwd_end, len(tape.entries), ctx.pool)
        grads = [None if s is None else vals[s] for s in tape.grads]
        vals.clear()  # the gradients' only references are the caller's: AccumulateGrad adopts them, no copy
        if ctx.lease is not None:
            ctx.lease.end()
        return (None,) + ((None,) if not ctx.gx else ()) + tuple(grads)


class _Lease:
    """A replay's hold on its tape's buffers: ends after its backward, or when its autograd graph is
    freed without one (the next replay may then take them; its kernels queue after this one's)."""

    __slots__ = ("tape",)

    def __init__(self, tape: _Tape) -> None:
        self.tape: _Tape | None = tape

    def end(self) -> None:
        if self.tape is not None:
            self.tape.lent, self.tape = False, None

    def __del__(self) -> None:
        self.end()


class ReplayedForward:
    """The forward :func:`fusekit.torch.replayed` puts on a module: replays a tape per input signature."""

    def __init__(self, model: torch.nn.Module, original: Any, warmup: int, max_tapes: int) -> None:
        self.model, self.original, self.warmup, self.max_tapes = model, original, warmup, max_tapes
        self.enabled = True
        self.tapes: dict[tuple, _Tape] = {}
        self.recordings: dict[tuple, tuple[_Tape | None, int]] = {}  # key -> (last recording, recordings so far)
        self.calls: dict[tuple, int] = {}
        self.refused: dict[tuple, str] = {}
        self.replays = 0  # calls replayed so far (for tests and reports)
        self.pooled: _Tape | None = None  # the tape whose replay buffers were used last
        self.state: tuple | None = None
        self.params: tuple = ()
        self.tensors: tuple | None = None

    def __reduce__(self) -> tuple:
        """Copies (``copy.deepcopy``) and pickles carry no tapes: a copy records its own."""
        return (_rereplayed, (self.model, self.warmup, self.max_tapes))

    def _state(self) -> tuple:
        """Where the module's tensors live, which parameters want gradients, fusekit's dispatch
        generation: a change drops the tapes (they hold those tensors and resolved calls)."""
        if self.tensors is None:
            self.tensors = tuple(itertools.chain(self.model.parameters(), self.model.buffers()))
        return (session.current().generation, *[(t.data_ptr(), t.requires_grad) for t in self.tensors])

    def signature(self, x: torch.Tensor) -> tuple:
        """What a tape is recorded for: the input's shape, strides, dtype, device, alignment and
        requires_grad, the autocast dtype, the current stream and the thread."""
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None
        return (tuple(x.shape), x.stride(), x.dtype, x.device, x.data_ptr() % 32, x.requires_grad, amp_dtype(), stream,
                threading.get_ident())

    def _refuse(self, key: tuple, why: str) -> None:
        self.refused[key] = why
        self.recordings.pop(key, None)
        warnings.warn(f"fusekit.torch.replayed: input {key[2]} {list(key[0])} (autocast {key[6]}) runs as modules: {why}",
                      UserWarning, stacklevel=4)

    def recorded(self, key: tuple, tape: _Tape) -> None:
        """A recording finished (in its backward): replay it once two recordings agree."""
        if tape.refused is not None:
            return self._refuse(key, tape.refused)
        last, n = self.recordings.get(key, (None, 0))
        why = None if last is None else last.difference(tape)
        if last is not None and why is None:
            tape.compact()
            tape.plan_buffers()
            self.tapes[key] = tape
            self.recordings.pop(key, None)
        elif n + 1 >= 4:
            self._refuse(key, f"4 recordings differ (data-dependent control flow?): the last two where {why}")
        else:
            self.recordings[key] = (tape, n + 1)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if len(args) == 1 and not kwargs else None
        if (not self.enabled or not isinstance(x, torch.Tensor) or not self.model.training or not torch.is_grad_enabled()
                or dispatch.call_recorder() is not None or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
            return self.original(*args, **kwargs)
        state = self._state()
        if state != self.state:
            self.tapes.clear()
            self.pooled = None
            self.recordings.clear()
            self.calls.clear()
            self.refused.clear()
            self.state = state
            self.params = tuple(p for p in self.model.parameters() if p.requires_grad)
        key = self.signature(x)
        tape = self.tapes.get(key)
        if tape is not None:
            self.replays += 1
            if self.pooled is not tape:  # one tape's buffers kept at a time (another input shape: the other's go)
                if self.pooled is not None and not self.pooled.lent:
                    self.pooled.pool = None
                self.pooled = tape
            return Replay.apply(tape, x, *self.params)
        if key in self.refused:
            return self.original(x)
        n = self.calls[key] = self.calls.get(key, 0) + 1
        if n <= self.warmup:
            out = self.original(x)
            if not isinstance(out, torch.Tensor) or not out.requires_grad:
                self._refuse(key, f"its forward returned {'a tensor without autograd' if isinstance(out, torch.Tensor) else type(out).__name__} "
                                  "(a tape replays one differentiable tensor)")
            return out
        if len(self.tapes) >= self.max_tapes:
            self._refuse(key, f"max_tapes={self.max_tapes} signatures have tapes already")
            return self.original(x)
        return _Record.apply(self, key, x, *self.params)


def _rereplayed(model: torch.nn.Module, warmup: int, max_tapes: int) -> ReplayedForward:
    """A replayed forward, no tapes yet, over ``model``'s class forward (how copies and pickles come back)."""
    return ReplayedForward(model, type(model).forward.__get__(model), warmup, max_tapes)
