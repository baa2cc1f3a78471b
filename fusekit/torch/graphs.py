"""``graphed`` (training forward and backward replayed as CUDA graphs) and ``replayed`` (training
steps replayed from a recorded tape)."""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Any

import torch

from ..errors import CaptureError, OperandError
from .replay import ReplayedForward, autocast_as as _autocast_as
from . import common

_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)


def graphed(model: torch.nn.Module, sample: torch.Tensor | None = None, *, autocast: Any = None, warmup: int = 3,
            max_graphs: int = 4, eval_graphs: bool = True) -> torch.nn.Module:
    """``model`` with its training forward and backward replayed as CUDA graphs: the fast way to
    train a converted model (each graph replays every layer's work in one launch; fusekit's host
    work per layer is paid at capture only). The loop around it stays as it is: loss, GradScaler,
    optimizer, gradient accumulation. Returns ``model`` itself (same parameters and state-dict keys).

    A training-mode call with grad enabled and one CUDA tensor ``x`` is captured per input
    signature (shape, strides, dtype, device, requires_grad, the autocast dtype in force): the
    first ``warmup`` calls of a signature run uncaptured (ordinary training steps, which build
    fusekit's plans), the next one captures the forward and backward and every later one replays
    them. Eval-mode calls without autograd (``torch.no_grad()`` / ``inference_mode()``: validation,
    inference) are captured the same way per signature, forward only (``eval_graphs=False``: they
    run uncaptured); each replay reads the weights and running statistics as they are then (BN
    folds are inside the graph). At most ``max_graphs`` signatures are captured, training and eval
    together; further ones, eval calls with autograd and train-mode calls without it run
    uncaptured. Moving the model (``.to``, ``.half``) drops its graphs; copies (``copy.deepcopy``)
    and pickles of it carry none and capture their own.

    ``sample`` (optional): capture ``sample``'s signature now, under ``autocast`` (float16 /
    bfloat16, or None for the model's own dtypes), after ``warmup`` forward + backward passes on a
    copy of it (these move batch-norm running statistics as training steps would).

    Outputs are the caller's own tensors (copied out of the graphs' buffers); gradients accumulate
    into ``.grad`` as uncaptured ones do. A call made while an earlier replay's backward is still to
    come (two forwards, then one backward) runs uncaptured. Submodules must not have hooks, and the forward must be
    capturable (no host synchronisation, no data-dependent control flow)."""
    who = "fusekit.torch.graphed"
    _check_wrappable(model, who)
    if autocast is not None and autocast not in _AUTOCAST_DTYPES:
        raise OperandError(who, "autocast", f"expected None, torch.float16 or torch.bfloat16, got {autocast!r}", what="argument")
    _check_count(who, "warmup", warmup, " (fusekit builds its plans in those passes)")
    _check_count(who, "max_graphs", max_graphs)
    if sample is not None:
        if not isinstance(sample, torch.Tensor):
            raise OperandError(who, "sample", f"expected a CUDA tensor, got {type(sample).__name__}")
        if not sample.is_cuda:
            raise OperandError(who, "sample", f"expected a CUDA tensor, got one on {sample.device} (CUDA graphs run on the GPU)")
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            if t.device != sample.device:
                raise OperandError(who, f"model.{name}", f"expected on {sample.device} (the sample's device), got {t.device}")
    if not isinstance(eval_graphs, bool):
        raise OperandError(who, "eval_graphs", f"expected True or False, got {eval_graphs!r}", what="argument")
    fwd = GraphedForward(model, model.forward, warmup, max_graphs, eval_graphs)
    if sample is not None:
        model.train()
        fwd.capture_now(sample, autocast)
    model.forward = fwd
    return model


def replayed(model: torch.nn.Module, *, warmup: int = 2, max_tapes: int = 4) -> torch.nn.Module:
    """``model`` with its training steps replayed from tapes: the fast way to train a converted model
    uncaptured (no CUDA graph; any input shape). Returns ``model`` itself (same parameters and
    state-dict keys); the loop around it stays as it is.

    For a training-mode call with grad enabled on one tensor ``x``, per input signature (shape,
    strides, dtype, device, requires_grad, the CUDA autocast dtype, the current stream, the thread):
    the first ``warmup`` calls run as modules (fusekit builds its plans), the next ones are recorded
    (the aten ops and fusekit graphs the forward and its backward ran), and once two recordings
    agree every later call replays them under one autograd node: the same kernels, new outputs,
    none of the modules' Python. Batch-norm running statistics move as they would. Autocast casts
    and buffer updates replay merged into foreach launches, and fusekit's intermediate outputs go
    into buffers kept from step to step (one input signature's at a time, about the memory one step
    peaks at); the results are the same.

    Calls in eval mode or without grad, inside a CUDA-graph capture, and signatures the forward
    cannot be replayed for (a host read such as ``.item()``, an in-place write to the input or a
    parameter, an output that is not one tensor, recordings that differ) run as modules; the last
    warn once. At most ``max_tapes`` signatures get tapes. Moving the model (``.to``, ``.half``),
    replacing a parameter or clearing fusekit's dispatch re-records. A replay's backward runs once
    (no ``retain_graph``); ``model.forward.enabled = False`` turns replays off. Submodules must not
    have hooks (a replay would skip them)."""
    who = "fusekit.torch.replayed"
    _check_wrappable(model, who)
    _check_count(who, "warmup", warmup)
    _check_count(who, "max_tapes", max_tapes)
    model.forward = ReplayedForward(model, model.forward, warmup, max_tapes)
    return model


def _check_count(who: str, name: str, v: Any, why: str = "") -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise OperandError(who, name, f"expected an int >= 1{why}, got {v!r}", what="argument")


def _check_wrappable(model: Any, who: str) -> None:
    """A module whose forward graphed / replayed may take over: no hooks, not graphed already (a
    replayed forward, as convert returns by default, is unwrapped: the new wrapper takes over)."""
    if not isinstance(model, torch.nn.Module):
        raise OperandError(who, "model", f"expected a torch.nn.Module, got {type(model).__name__}", what="argument")
    hooked = [n or "model" for n, m in model.named_modules()
              if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or getattr(m, "_backward_pre_hooks", None)]
    if hooked:
        raise OperandError(who, "model", f"has hooks registered on it ({', '.join(hooked[:3])}): a replay would skip them; "
                           "remove them first", what="argument")
    wrapped = model.__dict__.get("forward")
    if isinstance(wrapped, GraphedForward):
        raise OperandError(who, "model", "is graphed already", what="argument")
    if isinstance(wrapped, ReplayedForward):  # (convert's default route): graphed or replayed anew takes over
        original = wrapped.original
        if getattr(original, "__self__", None) is model and getattr(original, "__func__", None) is type(model).forward:
            del model.forward
        else:
            model.forward = original


def _flat_outputs(out: Any) -> tuple:
    """A forward's result as a tuple of tensors (a tensor, or a tuple / list of them), else TypeError."""
    outs = (out,) if isinstance(out, torch.Tensor) else tuple(out) if isinstance(out, (tuple, list)) else None
    if outs is None or not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        raise TypeError(f"the forward returned {type(out).__name__}; graphs are made for a tensor or a tuple / list of tensors")
    return outs


class Captured:
    """One input signature's forward and backward CUDA graphs and their static buffers.

    The forward is captured with the parameters swapped for fresh leaves sharing their memory
    (``torch.func.functional_call``): gradients are taken for those, so autograd nodes kept alive
    from earlier steps (on another stream) take no part in the capture. ``train`` False: an eval
    forward without autograd, no backward graph (:meth:`replay_eval`)."""

    def __init__(self, graphed: "GraphedForward", x: torch.Tensor, amp: Any, train: bool = True) -> None:
        self.handed: tuple = ()
        self.pending: Any = None  # weak reference to the autograd node of a replay whose backward is still to come
        if not train:
            self._capture_eval(graphed, x, amp)
            return
        named = [(n, p) for n, p in graphed.model.named_parameters() if p.requires_grad]
        self.params = tuple(p for _, p in named)
        leaves = {n: p.detach().requires_grad_() for n, p in named}
        self.x = x.detach().clone(memory_format=torch.preserve_format).requires_grad_(x.requires_grad)
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        wrt = ((self.x,) if self.x.requires_grad else ()) + tuple(leaves.values())
        torch.cuda.synchronize()
        graphed.capturing = True
        try:
            with _autocast_as(amp):
                with torch.cuda.graph(self.fwd):
                    out = torch.func.functional_call(graphed.model, leaves, (self.x,))
                self.outs = _flat_outputs(out)
                self.kind = None if isinstance(out, torch.Tensor) else type(out)
                self.diff = tuple(o.requires_grad for o in self.outs)
                self.grad_outs = tuple(torch.empty_like(o) for o, d in zip(self.outs, self.diff) if d)
                with torch.cuda.graph(self.bwd, pool=self.fwd.pool()):
                    self.grads = torch.autograd.grad([o for o, d in zip(self.outs, self.diff) if d], wrt, self.grad_outs,
                                                     allow_unused=True) if any(self.diff) and wrt else ()
        finally:
            graphed.capturing = False
        torch.cuda.synchronize()

    def _capture_eval(self, graphed: "GraphedForward", x: torch.Tensor, amp: Any) -> None:
        """The forward alone, without autograd; buffers that are ordinary tensors (not inference
        tensors), so a capture made under ``inference_mode`` replays under ``no_grad`` too."""
        self.params, self.bwd, self.grad_outs, self.grads = (), None, (), ()
        with torch.inference_mode(False), torch.no_grad():
            self.x = x.detach().clone(memory_format=torch.preserve_format)
            self.fwd = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            graphed.capturing = True
            try:
                with _autocast_as(amp), torch.cuda.graph(self.fwd):
                    out = graphed.original(self.x)
            finally:
                graphed.capturing = False
            torch.cuda.synchronize()
        self.outs = _flat_outputs(out)
        self.kind = None if isinstance(out, torch.Tensor) else type(out)
        self.diff = (False,) * len(self.outs)

    def replay_eval(self, x: torch.Tensor) -> Any:
        """An eval capture replayed on ``x``: the outputs are the caller's own copies."""
        self.x.copy_(x)
        self.fwd.replay()
        return self.result(tuple(o.clone(memory_format=torch.preserve_format) for o in self.outs))

    def result(self, outs: tuple) -> Any:
        return outs[0] if self.kind is None else self.kind(outs)


class Replay(torch.autograd.Function):
    """A captured forward replayed (input copied in, outputs copied out), its backward replayed."""

    @staticmethod
    def forward(ctx: Any, cap: Captured, x: torch.Tensor, *params: torch.Tensor) -> tuple:
        ctx.cap = cap
        cap.x.copy_(x)
        cap.fwd.replay()
        outs = tuple(o.detach().clone(memory_format=torch.preserve_format) for o in cap.outs)  # the next replay overwrites cap.outs
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, cap.diff) if not d])
        cap.pending = weakref.ref(ctx) if any(cap.diff) else None  # alive while this replay's backward can still run
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Any) -> tuple:
        cap = ctx.cap
        cap.pending = None
        for buf, g in zip(cap.grad_outs, [g for g, d in zip(grads, cap.diff) if d]):
            buf.zero_() if g is None else buf.copy_(g)
        cap.bwd.replay()
        # Kept referenced: autograd then copies them into (or adds them to) .grad instead of adopting
        # the graph's buffers as .grad, which the next replay would overwrite.
        cap.handed = tuple(None if g is None else g.detach() for g in cap.grads) or (None,) * (cap.x.requires_grad + len(cap.params))
        gx = cap.handed[0] if cap.x.requires_grad else None
        return (None, gx) + cap.handed[int(cap.x.requires_grad):]


class GraphedForward:
    """The forward :func:`graphed` puts on a model: replays a capture per input signature."""

    def __init__(self, model: torch.nn.Module, original: Any, warmup: int, max_graphs: int, eval_graphs: bool = True) -> None:
        self.model, self.original, self.warmup, self.max_graphs, self.eval_graphs = model, original, warmup, max_graphs, eval_graphs
        self.graphs: dict[tuple, Captured] = {}
        self.calls: dict[tuple, int] = {}
        self.refused: dict[tuple, str] = {}
        self.attempts: dict[tuple, int] = {}
        self.tensors: tuple | None = None  # read on the first call: a copy being made has none yet
        self.state: tuple | None = None
        self.capturing = False

    def __reduce__(self) -> tuple:
        """Copies (``copy.deepcopy``, an EMA of the model) and pickles carry no graphs: a copy captures its own."""
        return (_regraphed, (self.model, self.warmup, self.max_graphs, self.eval_graphs))

    def _state(self) -> tuple:
        """Where the model's tensors live and which parameters want gradients: a change drops the graphs."""
        if self.tensors is None:
            self.tensors = tuple(itertools.chain(self.model.parameters(), self.model.buffers()))
        return tuple([(t.data_ptr(), t.requires_grad) for t in self.tensors])

    def signature(self, x: torch.Tensor) -> tuple:
        """What a capture is made for: shape, strides, dtype, device, requires_grad, the autocast dtype
        and whether it is a training step (forward and backward) or an eval forward."""
        return (tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad, common.amp_dtype(), self.model.training)

    def capture_now(self, sample: torch.Tensor, amp: Any) -> None:
        """Capture ``sample``'s signature under ``amp`` after ``warmup`` forward + backward passes on a
        copy (on a side stream, as torch.cuda.make_graphed_callables warms up)."""
        self.state = self._state()
        x = sample.detach().clone(memory_format=torch.preserve_format).requires_grad_(sample.requires_grad)
        wrt = ((x,) if x.requires_grad else ()) + tuple(p for p in self.model.parameters() if p.requires_grad)
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream(sample.device)), _autocast_as(amp):
            for _ in range(self.warmup):
                outs = [o for o in _flat_outputs(self.original(x)) if o.requires_grad]
                if outs and wrt:
                    torch.autograd.grad(outs, wrt, [torch.randn_like(o) for o in outs], allow_unused=True)
                del outs  # nothing of the warm-up's autograd graph outlives it
            key = self.signature(x)
        self.graphs[key] = Captured(self, x, amp)

    def _refuse(self, key: tuple, why: str) -> None:
        self.refused[key] = why
        warnings.warn(f"fusekit.torch.graphed: {'' if key[6] else 'eval '}input {key[2]} {key[0]} (autocast {key[5]}) runs uncaptured: {why}",
                      UserWarning, stacklevel=3)

    def eligible(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The input of a call graphs are made for (one CUDA tensor; training mode with grad enabled, or
        with ``eval_graphs`` eval mode without it), else None."""
        x = args[0] if len(args) == 1 and not kwargs else None
        return x if self.wants_graph() and isinstance(x, torch.Tensor) and x.is_cuda else None

    def wants_graph(self) -> bool:
        """Whether the model's mode and autograd make this call one that graphs are made for."""
        return torch.is_grad_enabled() if self.model.training else self.eval_graphs and not torch.is_grad_enabled()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        x = None if self.capturing else self.eligible(args, kwargs)
        if x is None:
            return self.original(*args, **kwargs)
        state = self._state()
        if state != self.state:  # moved (.to / .half) or requires_grad changed: the graphs read the old tensors
            self.graphs.clear()
            self.calls.clear()
            self.refused.clear()
            self.attempts.clear()
            self.state = state
        key = self.signature(x)
        cap = self.graphs.get(key)
        if cap is None:
            if key in self.refused:
                return self.original(x)
            n = self.calls[key] = self.calls.get(key, 0) + 1
            if n <= self.warmup:
                return self.original(x)
            if len(self.graphs) >= self.max_graphs:
                self._refuse(key, f"max_graphs={self.max_graphs} signatures are captured already")
                return self.original(x)
            try:
                cap = self.graphs[key] = Captured(self, x, key[5], key[6])
            except CaptureError as e:  # raised before anything ran (a plan not built yet: the warm-up calls had no backward)
                self.attempts[key] = self.attempts.get(key, 0) + 1
                if self.attempts[key] >= 3:
                    self._refuse(key, f"capturing failed 3 times ({e})")
                self.calls[key] = 0  # warm up again, then try again
                return self.original(x)
            except Exception as e:
                raise CaptureError(f"fusekit.torch.graphed: capturing the {'training step' if key[6] else 'eval forward'} of input {key[2]} {key[0]} (autocast "
                                   f"{key[5]}) failed ({type(e).__name__}: {e}); the CUDA state may be unusable: run this "
                                   "model uncaptured instead") from e
        if not key[6]:
            return cap.replay_eval(x)
        if cap.pending is not None and cap.pending() is not None:
            # The last replay's backward has not run yet (two forwards, one backward): replaying now would
            # overwrite the activations it reads. This call runs uncaptured instead.
            return self.original(x)
        return cap.result(Replay.apply(cap, x, *cap.params))


def _regraphed(model: torch.nn.Module, warmup: int, max_graphs: int, eval_graphs: bool = True) -> GraphedForward:
    """A graphed forward, no graphs yet, over ``model``'s class forward (how copies and pickles come back)."""
    return GraphedForward(model, type(model).forward.__get__(model), warmup, max_graphs, eval_graphs)
