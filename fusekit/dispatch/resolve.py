"""Resolving a call (its first call of a signature): check the operands, make the key, find or
build the plan, and the named fallbacks when cuDNN refuses it (other descriptions of the call, a
smaller workspace)."""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable, Mapping, Sequence

from .. import session
from ..adapters import Adapter
from ..engine import lower
from ..engine.cache import Plan, PlanCache, PlanKey
from ..engine.keys import check_operands, make_key
from ..engine.patterns import Pattern
from ..engine.planner import planner
from ..engine.runtime import current_runtime, Workspace, forget_stream, is_out_of_memory
from ..errors import CaptureError, LayoutWarning, NumericsWarning, UnsupportedError, WorkspaceWarning, warn_once
from ..tensors import TensorSpec
from .calls import Call, drop_workspace, nbytes


def resolve_call(
    pattern: Pattern, operands: Sequence[Any], outs_given: Sequence[Any] | None, attrs: Mapping[str, Any], cache: PlanCache
) -> Call:
    """Everything a first call does: check every operand, make the key, find or build the plan
    (or one for another description of the call), and the handle and workspace it runs with."""
    specs, norm, aligns, adapter = check_operands(pattern, operands, outs_given, attrs)
    device = specs[pattern.operand_names[0]].device
    stream = adapter.stream(device)
    capturing = adapter.capturing(device)
    if capturing and pattern.not_capturable:
        raise CaptureError(f"fusekit: {pattern.name} cannot run inside a CUDA-graph capture: {pattern.not_capturable}")
    handle = current_runtime().handle(adapter, device, stream, create=not capturing)
    if handle is None:
        raise CaptureError(
            f"fusekit: {pattern.name} is first called on this thread inside a CUDA-graph capture; "
            "a cuDNN handle cannot be created there: call it once before capturing (warm-up)"
        )

    def attempt(specs_: Mapping[str, TensorSpec], aligns_: Sequence[int]) -> Plan | UnsupportedError:
        key = make_key(pattern, specs_, norm, aligns_, adapter)
        refusal = session.current().refused.get(key)
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
            NumericsWarning, stacklevel=user_level(),
        )
    ws = current_runtime().workspace(adapter, device, stream)
    if capturing and ws.size < plan.workspace_size and not adapter.allocates_in_capture:
        raise CaptureError(
            f"fusekit: {pattern.name} needs a {plan.workspace_size}-byte cuDNN workspace on the capturing stream and "
            f"{adapter.name} cannot allocate during a capture: call it once on that stream before capturing (warm-up)"
        )
    runs = _with_workspace(pattern, plan, ws, adapter, handle, cache, capturing)
    names = pattern.operand_names
    epilogue = tuple((names.index(n), nbytes(specs[n])) for n in pattern.epilogue_operands)
    if epilogue:
        adapter.fence(device)  # the fence's buffer is made here, outside any capture where possible
    return Call(runs, handle, stream, ws, outs, adapter, relayout, origin=plan, device=device, epilogue=epilogue)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # fusekit/


def user_level() -> int:
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
            drop_workspace(ws)
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
            WorkspaceWarning, stacklevel=user_level(),
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


_ELEMENTWISE = frozenset({"add", "mul", "sub", "bias", "relu", "relu_backward", "channel_sum"})


def _refused(key: PlanKey, e: UnsupportedError, limit: int) -> UnsupportedError:
    """Remember that cuDNN refused ``key``: the latest ``limit`` refusals (as many as the plan cache
    keeps plans), each as its message alone (the error's traceback holds the graphs that failed)."""
    refusal = UnsupportedError(str(e))
    s = session.current()
    with s.refused_lock:
        s.refused[key] = refusal
        while len(s.refused) > limit:
            s.refused.popitem(last=False)
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
