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

The package, by job: ``calls`` (the call table and its keys), ``resolve`` (step 2 and its fallbacks
but fused-or-split), ``choice`` (fused or split), ``execute`` (step 3: :func:`execute.execute` is the
one place that binds arrays' pointers to a plan), ``record`` (tapes and the call recorder). The
state they keep lives in the current :class:`fusekit.session.Session`.
"""

from __future__ import annotations

import atexit
from typing import Any

from .. import session
from ..adapters import as_device_array
from ..engine.cache import Plan, PlanCache, default_cache
from ..engine.keys import as_outs
from ..engine.patterns import Pattern, get_pattern
from ..errors import ArityError, OperandError
from .calls import call_key, clear_dispatch, release, resolved_call, resolved_calls, watch
from .choice import fused_or_split, fusion_choice
from .execute import launch
from .record import call_recorder, recorded_whole, run_call, set_call_recorder, taped
from .resolve import alternatives, resolve_call

__all__ = ["run", "call", "plan_for", "alternatives", "fused_or_split", "fusion_choice", "clear_dispatch", "release", "taped",
           "resolved_calls", "resolved_call", "launch", "recorded_whole", "set_call_recorder", "call_recorder"]


def run(pattern: str | Pattern, names: tuple, values: tuple, operands: tuple, out: Any, cache: PlanCache | None = None) -> Any:
    """Run ``pattern`` with attributes ``names``=``values`` (the op modules' entry): look the call
    up, else resolve it; then :func:`launch` it."""
    name = pattern if isinstance(pattern, str) else pattern.name
    alloc = out is None
    outs = () if alloc else as_outs(out)
    arrays = operands + outs
    c = None
    s = session.current()
    table = s.calls
    if cache is None:
        try:
            c = table.get(call_key(name, names, values, arrays, alloc))
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
                fkey = call_key(name, names, values, arrays, alloc)
                c = table.get(fkey)
            except Exception:
                fkey = None
        if c is None:
            cache_ = (cache if cache is not None else default_cache())
            watch(cache_)
            c = resolve_call(pat, operands, outs if not alloc else None, dict(zip(names, values)), cache_)
            if fkey is not None and not pat.not_capturable:  # those resolve every call: each asks if a capture runs
                with s.lock:
                    table[fkey] = c
    res = run_call(c, operands, outs, alloc)
    return res[0] if len(res) == 1 else res



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
    watch(cache_)
    return resolve_call(pat, operands, outs, attrs, cache_).plan


@atexit.register
def _release_at_exit() -> None:
    """release() at interpreter exit, where a failure (a device left in an error state) is not the user's concern."""
    try:
        release()
    except Exception:
        pass
