"""Dispatch: operands -> key -> plan -> execute, the path every fused call takes.

    run(pattern, attr names, attr values, operands, out)
      1. fast path: the call's signature (each array's shape, strides, dtype, device, pointer % 32,
         the attributes and the current stream) in the dispatch table -> bind pointers, execute.
      2. resolve (first call of a signature): check operands (engine.keys), make the PlanKey, get
         the plan from the plan cache (memory -> disk -> build or tune), then the named fallbacks:
         - ``alternatives``: other descriptions of the same call when cuDNN refuses one (one-channel
           views, channels-last copies: LayoutWarning once per pattern);
         - ``fused_or_split``: an op family's fused graph, else its split graphs (FusionWarning once);
           in "autotune" mode side-effect-free ones time both once and keep the faster.
         A key run on TF32 against the numerics policy (no IEEE plan) is said once (NumericsWarning);
         a workspace the device has no room for falls back to a plan of the key with a smaller one
         (WorkspaceWarning once).
      3. execute: the frontend's native pointer-array entry (lower.native_execute), else
         ``graph.execute`` with the ordered buffers (or either through channels-last copies).

Every execution goes through :func:`launch`, and ``_execute`` under it is the one place that binds
the arrays' pointers to a plan.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from threading import get_ident
from typing import Any, Callable, Mapping, Sequence

from . import config
from .engine import lower
from .engine.cache import Plan, PlanCache, PlanKey, default_cache
from .engine.keys import as_outs, check_operands, make_key
from .engine.patterns import Pattern, get_pattern
from .engine.planner import planner
from .engine.lower import load_cudnn
from .engine.runtime import RUNTIME, Workspace, forget_stream, is_out_of_memory, versions
from .errors import ArityError, CaptureError, warn_once, FusionWarning, LayoutWarning, NumericsWarning, OperandError, UnsupportedError, WorkspaceWarning
from .tensors import ITEMSIZE, TensorSpec
from .adapters import SIGNATURES, STREAMS, Adapter, adapter_for, as_device_array

__all__ = ["run", "call", "plan_for", "alternatives", "fused_or_split", "clear_dispatch", "taped", "resolved_calls", "resolved_call"]


class _Call:
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
        self.out_nbytes = tuple(_nbytes(s) for s in outs)
        self.native = lower.native_execute(plan.graph, plan.uids)  # None: graph.execute


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * ITEMSIZE[spec.dtype]


#: stream -> ((pointer, bytes), ...) of the outputs of the last graph fusekit executed on it.
_LAST_OUT: dict[int, tuple[tuple[int, int], ...]] = {}


def _fence_if_racing(c: _Call, arrays: Sequence[Any]) -> None:
    """Queue a fence kernel when an epilogue operand overlaps an output of the graph executed just
    before on this stream. On the H200 with cuDNN 9.19 a
    conv+bias+add+ReLU kernel started before the conv that wrote its residual had finished, when
    the two ran back to back in a CUDA graph (the output off by 1e-2); an ordinary kernel between
    them removed it. Fusekit cannot see other libraries' kernels in between: it fences anyway."""
    last = _LAST_OUT.get(c.stream)
    if not last:
        return
    ad = c.out_adapter
    for i, n in c.epilogue:
        p = ad.ptr(arrays[i])
        if any(p < q + m and q < p + n for q, m in last):
            ad.fence(c.device)
            return


_FAST: dict[tuple, _Call] = {}
_FAST_LOCK = threading.Lock()
_WATCHED: weakref.WeakSet[PlanCache] = weakref.WeakSet()  # caches whose evictions drop dispatch entries


#: Bumped when resolved calls may no longer run as they are (dispatch cleared, a workspace lost its
#: buffer): fusekit.torch.replayed's tapes, which hold calls, are recorded again. A plan leaving the
#: cache does not bump it: a call holding the plan still runs it.
GENERATION = 0


def _forget_tapes(calls_invalid: bool = True) -> None:
    global GENERATION
    _TAPES.clear()  # they hold resolved calls
    GENERATION += calls_invalid


def _drop_plan(plan: Plan) -> None:
    with _FAST_LOCK:
        for k in [k for k, c in _FAST.items() if c.origin is plan]:
            del _FAST[k]
        _forget_tapes(calls_invalid=False)


def _drop_workspace(ws: Workspace) -> None:
    """Forget the calls bound to ``ws`` (it lost its buffer): they resolve again and regrow it."""
    with _FAST_LOCK:
        for k in [k for k, c in _FAST.items() if c.workspace is ws]:
            del _FAST[k]
        _forget_tapes()


def _watch(cache: PlanCache) -> None:
    """Drop dispatch entries when their plans leave ``cache`` (the caches themselves, not their ids:
    a new cache may reuse the id of one that is gone)."""
    if cache not in _WATCHED:
        cache.on_evict(_drop_plan)
        _WATCHED.add(cache)


def resolved_calls() -> int:
    """How many call signatures the dispatch table holds (each bound to a resolved call)."""
    return len(_FAST)


def resolved_call(plan: Plan) -> Any:
    """A resolved call that runs ``plan`` (its ``handle``, ``stream``, ``workspace``), or None."""
    with _FAST_LOCK:
        return next((c for c in _FAST.values() if c.plan is plan), None)


def clear_dispatch() -> None:
    """Forget every resolved call and tape (plans stay in their cache)."""
    with _FAST_LOCK:
        _FAST.clear()
        _forget_tapes()


def release() -> None:
    """Let go of fusekit's GPU-side state in this process: resolved calls, the default cache's plans
    in memory (its disk store stays), cuDNN workspaces and this thread's cuDNN handles. Waits for
    torch's devices (and CuPy's current one) first. Later calls rebuild or reload what they need.
    Runs at interpreter exit too, so that the frontend's objects are gone before its extension
    module is torn down."""
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
    clear_dispatch()
    _LAST_OUT.clear()
    from .engine import cache as cache_mod

    if cache_mod._default is not None:
        cache_mod._default.clear()
    RUNTIME.release()


@atexit.register
def _release_at_exit() -> None:
    """release() at interpreter exit, where a failure (a device left in an error state) is not the user's concern."""
    try:
        release()
    except Exception:
        pass


def _resolve(
    pattern: Pattern, operands: Sequence[Any], outs_given: Sequence[Any] | None, attrs: Mapping[str, Any], cache: PlanCache
) -> _Call:
    """Everything a first call does: check every operand, make the key, find or build the plan
    (or one for another description of the call), and the handle and workspace it runs with."""
    specs, norm, aligns, adapter = check_operands(pattern, operands, outs_given, attrs)
    device = specs[pattern.operand_names[0]].device
    stream = adapter.stream(device)
    capturing = adapter.capturing(device)
    if capturing and pattern.not_capturable:
        raise CaptureError(f"fusekit: {pattern.name} cannot run inside a CUDA-graph capture: {pattern.not_capturable}")
    handle = RUNTIME.handle(adapter, device, stream, create=not capturing)
    if handle is None:
        raise CaptureError(
            f"fusekit: {pattern.name} is first called on this thread inside a CUDA-graph capture; "
            "a cuDNN handle cannot be created there: call it once before capturing (warm-up)"
        )

    def attempt(specs_: Mapping[str, TensorSpec], aligns_: Sequence[int]) -> Plan | UnsupportedError:
        key = make_key(pattern, specs_, norm, aligns_, adapter)
        refusal = _NO_ENGINE.get(key)
        if refusal is None:
            if capturing and cache.get(key) is None:
                raise CaptureError(
                    f"fusekit: no plan yet for {key.describe()} and a CUDA-graph capture is under way (building one "
                    "would break it): run the same call once before capturing (warm-up), or autotune it ahead of time"
                )
            try:
                return cache.get_or_build(key, *planner(pattern, key, adapter, handle, cache))
            except UnsupportedError as e:
                refusal = _refused(key, e, cache.maxsize)
        return refusal

    plan = attempt(specs, aligns)
    relayout: frozenset = frozenset()
    outs = tuple(specs[n] for n in pattern.outputs)
    if isinstance(plan, UnsupportedError):
        refusal = plan
        plan, relayout, alt = _alternative(pattern, specs, aligns, attempt)
        if plan is None:
            raise UnsupportedError(str(refusal)) from None
        if relayout:
            outs = tuple(alt[n] for n in pattern.outputs)  # channels-last temporaries
            warn_once((pattern.name,), f"fusekit: cuDNN has no NCHW engine for {pattern.name} ({refusal}); running it on "
                      "channels-last copies (pass channels-last arrays to avoid the copies)", LayoutWarning, stacklevel=4)
    if plan.engine.endswith(lower.TF32_FALLBACK):
        fams = " and ".join(sorted(lower.tf32_families(pattern, dict(plan.key.specs))))
        warn_once(
            (plan.key,),
            f"fusekit: cuDNN has no IEEE float32 plan for {plan.key.describe()}, and the numerics policy forbids TF32 for "
            f"float32 {fams}: running its TF32 tensor-core plan (inputs rounded to 10 mantissa bits, about 1e-3 relative "
            f"error). fusekit.configure(allow_tf32=...) or FUSEKIT_ALLOW_TF32 allows TF32 for {fams} and silences this",
            NumericsWarning, stacklevel=_user_level(),
        )
    ws = RUNTIME.workspace(adapter, device, stream)
    if capturing and ws.size < plan.workspace_size and not adapter.allocates_in_capture:
        raise CaptureError(
            f"fusekit: {pattern.name} needs a {plan.workspace_size}-byte cuDNN workspace on the capturing stream and "
            f"{adapter.name} cannot allocate during a capture: call it once on that stream before capturing (warm-up)"
        )
    runs = _with_workspace(pattern, plan, ws, adapter, handle, cache, capturing)
    names = pattern.operand_names
    epilogue = tuple((names.index(n), _nbytes(specs[n])) for n in pattern.epilogue_operands)
    if epilogue:
        adapter.fence(device)  # the fence's buffer is made here, outside any capture where possible
    return _Call(runs, handle, stream, ws, outs, adapter, relayout, origin=plan, device=device, epilogue=epilogue)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_level() -> int:
    """The ``stacklevel`` that makes a warning issued by the caller point at the user's line: the
    first frame outside fusekit and PyTorch (whose autograd and module calls run fusekit.torch's
    layers), however deep in the op layers it was issued."""
    torch = sys.modules.get("torch")
    inside = (_PACKAGE,) + ((os.path.dirname(torch.__file__) + os.sep,) if getattr(torch, "__file__", None) else ())
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _ensure(ws: Workspace, nbytes: int) -> BaseException | None:
    """Grow ``ws`` to ``nbytes`` (Workspace.ensure): None, or the out-of-memory error it raised (other
    errors propagate). Calls bound to ``ws`` are dropped if it came out smaller than it was."""
    before = ws.size
    try:
        ws.ensure(nbytes)
        return None
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        if ws.size < before:
            _drop_workspace(ws)
        return e


def _with_workspace(
    pattern: Pattern, plan: Plan, ws: Workspace, adapter: Adapter, handle: Any, cache: PlanCache, capturing: bool
) -> Plan:
    """``plan`` once ``ws`` holds its workspace (Workspace.ensure frees cached memory and retries).
    If the device has no room even then, the plan of the same key that cuDNN offers next within a
    smaller workspace (as PyTorch's cuDNN convolutions fall back), down to none; said once per key
    (WorkspaceWarning). The stand-in serves this call signature only (it is neither cached nor
    stored): later calls of the key get the cache's plan. Raises the out-of-memory error when no
    plan fits, or inside a capture (a build would break it)."""
    oom = _ensure(ws, plan.workspace_size)
    if oom is None:
        return plan
    if capturing:
        raise oom
    key, need = plan.key, plan.workspace_size
    specs = dict(key.specs)
    device = specs[pattern.operand_names[0]].device
    while need > 0:
        try:
            with adapter.use_device(device):
                b = lower.build(
                    pattern, specs, dict(key.attrs), handle, cache.heuristics, key.describe(), workspace_limit=need - 1, tf32=key.tf32
                )
        except UnsupportedError:
            break  # nothing within a smaller workspace
        finally:
            forget_stream(handle)
        if b.workspace_size >= need or _ensure(ws, b.workspace_size) is not None:
            need = min(need - 1, b.workspace_size)
            continue
        smaller = Plan(key, b.graph, b.uids, b.workspace_size, b.engine, b.candidates, b.build_ms, engine_id=b.engine_id, knobs=b.knobs)
        warn_once(
            (key,),
            f"fusekit: no room for the {plan.workspace_size}-byte cuDNN workspace of {key.describe()}, even after freeing "
            f"cached memory ({oom}); running plan {smaller.engine} with a {smaller.workspace_size}-byte workspace instead",
            WorkspaceWarning, stacklevel=_user_level(),
        )
        return smaller
    raise oom


def _alternative(
    pattern: Pattern, specs: Mapping[str, TensorSpec], aligns: Sequence[int],
    attempt: Callable[[Mapping[str, TensorSpec], Sequence[int]], Plan | UnsupportedError],
) -> tuple[Plan | None, frozenset, Mapping[str, TensorSpec]]:
    """Fallback step "alternatives": the first other description of the call that cuDNN accepts:
    (plan or None, positions run through channels-last copies, its specs)."""
    for alt, relayout in alternatives(pattern, specs):
        plan = attempt(alt, [32 if i in relayout else a for i, a in enumerate(aligns)])
        if not isinstance(plan, UnsupportedError):
            return plan, relayout, alt
    return None, frozenset(), specs


_NO_ENGINE: OrderedDict[PlanKey, UnsupportedError] = OrderedDict()  # keys cuDNN refused: not rebuilt while remembered
_NO_ENGINE_LOCK = threading.Lock()
_ELEMENTWISE = frozenset({"add", "mul", "sub", "bias", "relu", "relu_backward", "channel_sum"})


def _refused(key: PlanKey, e: UnsupportedError, limit: int) -> UnsupportedError:
    """Remember that cuDNN refused ``key``: the latest ``limit`` refusals (as many as the plan cache
    keeps plans), each as its message alone (the error's traceback holds the graphs that failed)."""
    refusal = UnsupportedError(str(e))
    with _NO_ENGINE_LOCK:
        _NO_ENGINE[key] = refusal
        while len(_NO_ENGINE) > limit:
            _NO_ENGINE.popitem(last=False)
    return refusal


def alternatives(pattern: Pattern, specs: Mapping[str, TensorSpec]) -> list[tuple[dict[str, TensorSpec], frozenset]]:
    """Other descriptions of the same call to offer cuDNN when it refuses one: (specs, positions to copy).

    - One channel: cuDNN's pointwise and reduction engines refuse C = 1. For elementwise patterns
      whose channel vectors are single values, a dense (N, 1, H, W) tensor is the same memory as a
      channels-last (N, W, H, 1) one, or (N, H, 1, 1) when W = 1, or (1, N, 1, 1) when H = W = 1:
      same pointers, no copies, and a channel count above 1 (none when the tensor is one value).
    - NCHW: most pointwise, reduction and fused engines take channels-last only: run on NHWC copies.
    """
    names = pattern.operand_names + tuple(pattern.outputs)
    kinds = [o.kind for o in pattern.operands] + [pattern.output_kinds[n] for n in pattern.outputs]
    images = [n for n, k in zip(names, kinds) if k in ("image", "filter", "tensor") and len(specs[n].shape) == 4]
    alts: list[tuple[dict[str, TensorSpec], frozenset]] = []
    if (
        images and all(specs[n].shape[1] == 1 and math.prod(specs[n].shape) > 1 for n in images)
        and all(op.op in _ELEMENTWISE for op in pattern.ops)
        and all(k not in ("channel",) or max(specs[n].shape) == 1 for n, k in zip(names, kinds))
    ):
        alt = dict(specs)
        for n in images:
            s = specs[n]
            alt[n] = TensorSpec.build(_one_channel_as_channels_last(s.shape), s.dtype, s.device, "NHWC")
        alts.append((alt, frozenset()))
    relayout = frozenset(i for i, n in enumerate(names) if n in images and specs[n].layout == "NCHW")
    if relayout:
        alt = dict(specs)
        for i in relayout:
            s = specs[names[i]]
            alt[names[i]] = TensorSpec.build(s.shape, s.dtype, s.device, "NHWC")
        alts.append((alt, relayout))
    return alts


def _one_channel_as_channels_last(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """A channels-last (N', C', H', 1) shape, C' > 1 unless all is one value, whose dense memory order is
    that of a dense NCHW (N, 1, H, W) tensor."""
    n, _, h, w = shape
    if w > 1:
        return (n, w, h, 1)
    if h > 1:
        return (n, h, 1, 1)
    return (1, n, 1, 1)


def _bind(c: _Call) -> Any:
    """The call's cudnn.Handle (one per device and thread), set to the call's stream."""
    load_cudnn().set_stream(c.handle, c.stream)
    return c.handle


def _execute(c: _Call, arrays: Sequence[Any], handle: Any) -> None:
    """Queue the call's plan on ``arrays`` (operands then outputs, in ``c.uids`` order): the one place that
    binds arrays' pointers to a plan."""
    native = c.native
    if native is None:
        c.graph.execute(arrays, c.workspace.ptr, handle=handle, tensor_uids=c.uids)
        return
    fn, ptrs, address, pos, index = native
    ptr = c.out_adapter.ptr
    for i, p in enumerate(pos):
        ptrs[i] = ptr(arrays[p])
    try:
        fn(address, len(pos), c.workspace.ptr, handle.backend_handle, index)
    except TypeError:  # the private entry's signature changed (another 1.32.x): nothing ran; use graph.execute
        c.native = None
        c.graph.execute(arrays, c.workspace.ptr, handle=handle, tensor_uids=c.uids)


def _execute_relayout(c: _Call, operands: tuple, outs: tuple, alloc: bool) -> tuple:
    """Execute ``c`` on channels-last copies of its NCHW arrays; results go back in the caller's layout."""
    ad, n_in = c.out_adapter, len(operands)
    ins = tuple(ad.relayout(a, "NHWC") if i in c.relayout else a for i, a in enumerate(operands))
    tmp = tuple(ad.empty(s) if (alloc or n_in + j in c.relayout) else outs[j] for j, s in enumerate(c.outs))
    _execute(c, ins + tmp, _bind(c))
    res = []
    for j, t in enumerate(tmp):
        if n_in + j in c.relayout:
            if alloc:
                t = ad.relayout(t, "NCHW")
            else:
                ad.copy_into(outs[j], t)
                t = outs[j]
        res.append(t)
    return tuple(res)


def _arrays_key(k: list, arrays: Sequence[Any]) -> tuple:
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


def _fast_key(pattern: str, names: tuple, values: tuple, operands: Sequence[Any], arrays: Sequence[Any], alloc: bool) -> tuple:
    """Dispatch key of a call: attributes and :func:`_arrays_key` of its arrays (operands first)."""
    return _arrays_key([pattern, names, values, alloc], arrays)


def run(pattern: str | Pattern, names: tuple, values: tuple, operands: tuple, out: Any, cache: PlanCache | None = None) -> Any:
    """Run ``pattern`` with attributes ``names``=``values`` (the op modules' entry): look the call
    up, else resolve it; then :func:`launch` it."""
    name = pattern if isinstance(pattern, str) else pattern.name
    alloc = out is None
    outs = () if alloc else as_outs(out)
    arrays = operands + outs
    c = None
    if cache is None:
        try:
            c = _FAST.get(_fast_key(name, names, values, operands, arrays, alloc))
        except Exception:  # an array type not seen yet, or not an array: the checked path below
            c = None
    if c is None:
        pat = get_pattern(pattern) if isinstance(pattern, str) else pattern
        if len(operands) != len(pat.operands):
            raise ArityError(f"{name} takes {len(pat.operands)} array operands {pat.operand_names}, got {len(operands)}")
        operands = tuple(as_device_array(a, name, o.name) for a, o in zip(operands, pat.operands))
        outs = tuple(as_device_array(a, name, f"out[{i}]") for i, a in enumerate(outs))
        if not alloc and len(outs) != len(pat.outputs):
            raise OperandError(name, "out", f"expected {len(pat.outputs)} output array(s) {tuple(pat.outputs)}, got {len(outs)}")
        arrays = operands + outs
        fkey = None
        if cache is None:  # __dlpack__ producers dispatch on their zero-copy views
            try:
                fkey = _fast_key(name, names, values, operands, arrays, alloc)
                c = _FAST.get(fkey)
            except Exception:
                fkey = None
        if c is None:
            cache_ = (cache if cache is not None else default_cache())
            _watch(cache_)
            c = _resolve(pat, operands, outs if not alloc else None, dict(zip(names, values)), cache_)
            if fkey is not None and not pat.not_capturable:  # those resolve every call: each asks if a capture runs
                with _FAST_LOCK:
                    _FAST[fkey] = c
    res = _run_call(c, operands, outs, alloc)
    return res[0] if len(res) == 1 else res


def _run_call(c: _Call, operands: tuple, outs: tuple, alloc: bool) -> tuple:
    """:func:`launch`, noted in the recordings under way on this thread (:func:`taped`, and
    :func:`set_call_recorder`'s)."""
    block = _REC.block
    if block is None or block.inside:
        res = launch(c, operands, outs, alloc)
    else:
        block.inside += 1  # the call's own allocations and copies are not the block's ops
        try:
            res = launch(c, operands, outs, alloc)
        finally:
            block.inside -= 1
        block.fk(c, operands, None if alloc else outs, res)
    rec = _REC.steps
    if rec is not None:
        rec.append((c, operands, None if alloc else outs, res))
    return res


def launch(c: _Call, operands: tuple, outs: tuple, alloc: bool) -> tuple:
    """Execute resolved call ``c`` on ``operands`` into ``outs`` (new arrays with ``alloc``); its outputs."""
    arrays = operands + outs
    if c.epilogue:
        _fence_if_racing(c, arrays)
    if c.relayout:
        outs = _execute_relayout(c, operands, outs, alloc)
        _LAST_OUT.pop(c.stream, None)  # copies back to the caller's layout ran after it
        return outs
    if alloc:
        outs = tuple([c.out_adapter.empty(s) for s in c.outs])
        arrays = operands + outs
    h = c.handle
    if h.stream != c.stream:
        _bind(c)
    _execute(c, arrays, h)
    ptr = c.out_adapter.ptr
    _LAST_OUT[c.stream] = tuple([(ptr(o), n) for o, n in zip(outs, c.out_nbytes)])
    return outs


def call(pattern: str | Pattern, *operands: Any, out: Any = None, cache: PlanCache | None = None, **attrs: Any) -> Any:
    """Run ``pattern`` on ``operands`` with ``attrs``; returns its output (a tuple if several).

    ``out`` (an array, or a tuple for several outputs) receives the result instead of a new array.
    New outputs take the array type, dtype, device and layout (NCHW / channels-last) of the operand
    the pattern names for them. Work is queued on the current CuPy / torch stream. ``cache``: a
    private PlanCache (calls with one skip the dispatch table).
    """
    values = tuple(tuple(v) if type(v) is list else v for v in attrs.values())
    return run(pattern, tuple(attrs), values, operands, out, cache)


def plan_for(pattern: str | Pattern, *operands: Any, out: Any = None, cache: PlanCache | None = None, **attrs: Any) -> Plan:
    """The plan :func:`call` would run for these operands (built if needed), without executing it."""
    pat = get_pattern(pattern) if isinstance(pattern, str) else pattern
    outs = None if out is None else as_outs(out)
    operands = tuple(as_device_array(a, pat.name, o.name) for a, o in zip(operands, pat.operands))
    cache_ = (cache if cache is not None else default_cache())
    _watch(cache_)
    return _resolve(pat, operands, outs, attrs, cache_).plan


_SPLIT: set[tuple] = set()
#: (tag, mode) -> (fused ms, split ms): each fused-or-split tag with ``like``, timed on its first call
#: outside a capture, once per plan mode ("heuristic" plans and autotuned ones can rank differently),
#: and kept in the plan cache's disk store, where a later process finds it instead of timing again.
FUSION_TIMES: dict[tuple, tuple[float, float]] = {}


# Recorded dispatch ("tapes")
# ----------------------------------------------------------------------------------------------
#: Recordings that must agree before a tape replays (the first calls of a key resolve plans and time
#: fused against split graphs, and run other graphs than later ones).
_AGREE = 2
_TRIES = 6  # recordings of a key that never agree: it runs unrecorded from then on
_NEVER = object()
_TAPES: dict[tuple, Any] = {}  # key -> _Tape (replays) | (_Tape | None, recordings so far) | _NEVER


class _Rec(threading.local):
    steps: list | None = None  # (call, operands, outs given or None, outputs) of each run() while recording
    block: Any = None  # a fusekit.torch.replay tape recording on this thread (its .fk notes each call)


_REC = _Rec()


def call_recorder() -> Any:
    """The recorder noting this thread's fusekit calls (:func:`set_call_recorder`), or None."""
    return _REC.block


def recorded_whole(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for an op that launches its own kernels (not resolved calls: pooling, softmax): the
    call recorder notes each call of it whole (``recorder.whole(fn, args, kwargs, result)``), to be
    replayed by calling ``fn`` again."""

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        rec = _REC.block
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
    _REC.block = recorder


class _Tape:
    """The resolved calls an op made on its arrays, and where each call's arrays come from: ``(0, i)``
    the op's i-th array argument, ``(1, i)`` the i-th constant (an array the op reads that is neither:
    a cached vector; it must be the same object in every recording), ``(2, i)`` the i-th output a
    call allocated. Replaying one runs the calls through :func:`launch` with new outputs."""

    __slots__ = ("steps", "consts", "result", "single")

    def __init__(self, steps: tuple, consts: tuple, result: tuple, single: bool) -> None:
        self.steps, self.consts, self.result, self.single = steps, consts, result, single

    @staticmethod
    def of(steps: list, args: tuple, result: Any) -> "_Tape | None":
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
        return _Tape(tuple(out), tuple(consts), tuple(refs), single)

    def same(self, other: "_Tape") -> bool:
        return (len(self.steps) == len(other.steps) and self.result == other.result and self.single == other.single
                and all(a[0] is b[0] and a[1:] == b[1:] for a, b in zip(self.steps, other.steps))
                and len(self.consts) == len(other.consts) and all(a is b for a, b in zip(self.consts, other.consts)))

    def replay(self, args: tuple) -> Any:
        src: tuple = (args, self.consts, [])
        made = src[2]
        for c, refs, given in self.steps:
            operands = tuple([src[k][i] for k, i in refs])
            if given is None:
                made.extend(_run_call(c, operands, (), True))
            else:
                _run_call(c, operands, tuple([src[k][i] for k, i in given]), False)
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
        k = _arrays_key([key, tuple([ids.index(i) for i in ids])], args)  # (which arguments are the same array)
    except Exception:  # an array type dispatch does not know (yet), or None first
        return op()
    t = _TAPES.get(k)
    if type(t) is _Tape:
        return t.replay(args)
    if t is _NEVER or _REC.steps is not None or adapter_for(args[0]).capturing(k[5]):  # k[5]: the first array's device
        return op()  # not recordable; inside another recording; or inside a CUDA-graph capture
    _REC.steps = steps = []
    try:
        result = op()
    finally:
        _REC.steps = None
    tape = _Tape.of(steps, args, result)
    last, n = t if t is not None else (None, 0)
    if tape is None or n + 1 >= _TRIES:
        _TAPES[k] = _NEVER
    elif last is not None and last.same(tape) and n + 1 >= _AGREE:
        _TAPES[k] = tape
    else:
        if len(_TAPES) >= config.TUNABLES.tape_limit:  # keys that keep changing (a momentum of 1 / steps): start over
            _TAPES.clear()
        _TAPES[k] = (tape, n + 1)
    return result


def _split_wins(t: tuple[float, float]) -> bool:
    """Whether timings ``t`` = (fused ms, split ms) keep the split (``config.TUNABLES.split_margin``)."""
    return t[1] < config.TUNABLES.split_margin * t[0]


def fused_or_split(
    tag: tuple, fused: Callable[[], Any], split: Callable[[], Any], like: Any = None, instead: str = "as separate graphs"
) -> Any:
    """Run ``fused``; if cuDNN refuses it, run ``split`` for this tag from then on (a warning the first
    time cuDNN refuses a tag of this kind, ``tag[0]``).
    With ``like`` (an operand; only for side-effect-free ops) the first call of a tag outside a
    capture, in each plan mode, times both on the GPU (or reads an earlier process's timings from the
    disk store) and keeps the faster (:data:`FUSION_TIMES`). ``instead``: how the warning says
    ``split`` runs the same math (route tags pick between two layouts, not fused and separate graphs)."""
    if tag in _SPLIT:
        return split()
    timed = None
    if like is not None:
        timed = (tag, default_cache().mode)
        t = FUSION_TIMES.get(timed)
        if t is not None and _split_wins(t):
            return split()
    try:
        if timed is not None and timed not in FUSION_TIMES:
            return _time_both(timed, fused, split, like)
        return fused()
    except UnsupportedError as e:
        said = any(t[0] == tag[0] for t in _SPLIT)  # once per graph kind: a model refused it at every shape says so once
        _SPLIT.add(tag)
        if not said:
            warnings.warn(
                f"fusekit: cuDNN has no engine for {tag[0]} with {_describe_tag(tag)}; running it {instead} ({_first_line(e)}); "
                f"other shapes of {tag[0]} that cuDNN refuses run so too, unsaid",
                FusionWarning,
                stacklevel=3,
            )
        return split()


def fusion_choice(tag: tuple, mode: str | None = None) -> str | None:
    """"split" or "fused": what :func:`fused_or_split` runs for ``tag`` in ``mode`` (default: the
    cache's); None before its first timed call."""
    if tag in _SPLIT:
        return "split"
    t = FUSION_TIMES.get((tag, mode or default_cache().mode))
    return None if t is None else "split" if _split_wins(t) else "fused"


def _time_both(timed: tuple, fused: Callable[[], Any], split: Callable[[], Any], like: Any) -> Any:
    """First call of a (tag, mode): run fused and split once each (their plans built in that mode),
    then time both (Adapter.device_ms, alternating, median of 3) and remember the faster. cuDNN's fused
    engines are at times far slower than the split graphs (a float32 transposed conv + bias + ReLU:
    149 us fused against 44 us for its dgrad alone, H200)."""
    y = fused()  # first: it checks the operands (an OperandError before any timing)
    ad = adapter_for(like)
    device = ad.describe(like)[3]
    if ad.capturing(device):
        return y
    cache = default_cache()
    key = _decision_key(timed, ad, device, cache) if cache.store is not None else None
    t = cache.stored_fusion(key) if key is not None else None
    if t is not None:  # timed by an earlier process on this GPU with these versions
        FUSION_TIMES[timed] = t
        return split() if _split_wins(t) else y
    try:
        split()
    except UnsupportedError:  # no split either: the fused graph it is
        FUSION_TIMES[timed] = (math.nan, math.inf)
        return y
    tf, ts = [], []
    for _ in range(3):
        tf.append(ad.device_ms(fused))
        ts.append(ad.device_ms(split))
    t = FUSION_TIMES[timed] = (sorted(tf)[1], sorted(ts)[1])
    if key is not None:
        cache.store_fusion(key, t[0], t[1], "split" if _split_wins(t) else "fused")
    return split() if _split_wins(t) else fused()  # run again: with ``out`` given, the timed runs left the split's values in it


def _decision_key(timed: tuple, ad: Adapter, device: int, cache: PlanCache) -> dict:
    """What a stored fused-or-split decision is valid for, as JSON values: the tag (pattern, attributes,
    each array's shape, dtype and strides in elements), the plan mode and heuristics, the numerics
    policy, the GPU, and the cuDNN, frontend and fusekit versions."""
    tag, mode = timed
    facts, v, tf32 = RUNTIME.device_facts(ad, device), versions(), config.allow_tf32()
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


def _first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of ``e``'s message, at most ``limit`` characters (cuDNN's refusals carry its
    whole multi-line engine log; the warning keeps the sentence that says what was refused)."""
    line = str(e).strip().split("\n", 1)[0].strip()
    return line if len(line) <= limit else line[: limit - 1] + "…"


