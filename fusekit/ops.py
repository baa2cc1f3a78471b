"""Functional API: run a pattern on CuPy arrays, torch tensors or ``__dlpack__`` producers.

The first call of a signature checks every operand, builds (or finds) the plan and records a
``_Call``; later calls with the same shapes, strides, dtypes, devices, alignments, attributes and
stream do one dict look-up, bind pointers and execute. This is the one place pointers are bound.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from . import lower as _lower
from .cache import Plan, PlanCache, PlanKey, default_cache
from .errors import OperandError
from .patterns import Pattern, get_pattern
from .runtime import RUNTIME, versions
from .tensors import _BY_TYPE, Adapter, TensorSpec, adapter_for, as_device_array, make_spec


class _Call:
    """Everything a cache hit needs, resolved once."""

    __slots__ = ("plan", "graph", "uids", "handle", "workspace", "outs", "out_adapter")

    def __init__(self, plan: Plan, handle: Any, workspace: Any, outs: tuple[TensorSpec, ...], out_adapter: Adapter):
        self.plan, self.graph, self.uids = plan, plan.graph, plan.uids
        self.handle, self.workspace, self.outs, self.out_adapter = handle, workspace, outs, out_adapter


_FAST: dict[tuple, _Call] = {}
_FAST_LOCK = threading.Lock()
_WATCHED: set[int] = set()


def _drop_plan(plan: Plan) -> None:
    with _FAST_LOCK:
        for k in [k for k, c in _FAST.items() if c.plan is plan]:
            del _FAST[k]


def _watch(cache: PlanCache) -> None:
    if id(cache) not in _WATCHED:
        cache.on_evict(_drop_plan)
        _WATCHED.add(id(cache))


def clear_dispatch() -> None:
    """Forget every resolved call (plans stay in their cache)."""
    with _FAST_LOCK:
        _FAST.clear()


def _resolve(
    pattern: Pattern, operands: Sequence[Any], outs_given: Sequence[Any] | None, attrs: dict[str, Any], cache: PlanCache
) -> tuple[_Call, list[int]]:
    """Check every operand, find or build the plan, and return the call plus this call's pointers."""
    name = pattern.name
    if len(operands) != len(pattern.operands):
        raise TypeError(f"{name} takes {len(pattern.operands)} array operands {pattern.operand_names}, got {len(operands)}")
    specs: dict[str, TensorSpec] = {}
    ptrs, aligns = [], []
    first: tuple[str, TensorSpec] | None = None
    adapter0: Adapter | None = None
    for o, a in zip(pattern.operands, operands):
        ad = adapter_for(a, name, o.name)
        adapter0 = adapter0 or ad
        shape, strides, dtype, device = ad.describe(a)
        spec = make_spec(name, o.name, o.kind, shape, strides, dtype, device)
        if first is not None:
            fname, fspec = first
            if spec.device != fspec.device:
                raise OperandError(name, o.name, f"is on cuda:{spec.device} but '{fname}' is on cuda:{fspec.device}; put all operands on one device")
            if spec.dtype != fspec.dtype:
                raise OperandError(name, o.name, f"expected dtype {fspec.dtype} like '{fname}', got {spec.dtype}")
        else:
            first = (o.name, spec)
        specs[o.name] = spec
        sig, ptr = ad.probe(a)
        ptrs.append(ptr)
        aligns.append(sig[-1])
    norm = pattern.normalize_attrs(attrs)
    shapes = pattern.infer_shapes({k: s.shape for k, s in specs.items()}, dict(norm))
    out_specs = []
    for i, (oname, like) in enumerate(pattern.outputs.items()):
        ls = specs[like]
        want = TensorSpec.build(shapes[oname], ls.dtype, ls.device, ls.layout if pattern.operand(like).kind == "image" else "NCHW")
        if outs_given is not None:
            a = outs_given[i]
            ad = adapter_for(a, name, oname)
            shape, strides, dtype, device = ad.describe(a)
            got = make_spec(name, oname, "image", shape, strides, dtype, device)
            if (got.shape, got.dtype, got.device) != (want.shape, want.dtype, want.device):
                raise OperandError(
                    name, oname, f"expected out of shape {want.shape}, dtype {want.dtype} on cuda:{want.device}, "
                    f"got shape {got.shape}, dtype {got.dtype} on cuda:{got.device}"
                )
            want = got
            sig, ptr = ad.probe(a)
            ptrs.append(ptr)
            aligns.append(sig[-1])
        else:
            aligns.append(32)  # fresh allocations from CuPy's and torch's pools are 256-byte aligned
        specs[oname] = want
        out_specs.append(want)
    assert adapter0 is not None and first is not None
    device = first[1].device
    facts = RUNTIME.device_facts(adapter0, device)
    v = versions()
    key = PlanKey(
        pattern=name,
        digest=pattern.digest,
        specs=tuple((n, specs[n]) for n in pattern.operand_names + tuple(pattern.outputs)),
        alignments=tuple(aligns),
        attrs=norm,
        compute_dtype=_lower.COMPUTE_DTYPE,
        gpu=facts.name,
        cc=facts.cc,
        cudnn_backend=v.cudnn_backend,
        frontend=v.frontend,
        heuristics=cache.heuristics,
    )
    stream = adapter0.stream(device)
    handle = RUNTIME.handle(adapter0, device, stream)

    def build() -> Plan:
        with adapter0.use_device(device):
            lowered = _lower.lower(pattern, specs, dict(norm), handle=handle)
            b = _lower.build(lowered, key.heuristics, where=key.describe())
        return Plan(key, b.graph, b.uids, b.workspace_size, b.engine, b.candidates, b.build_ms)

    plan = cache.get_or_build(key, build)
    ws = RUNTIME.workspace(adapter0, device, stream)
    ws.ensure(plan.workspace_size)
    return _Call(plan, handle, ws, tuple(out_specs), adapter0), ptrs


#: Bind arrays (True) or raw pointers (False) to ``graph.execute``; benchmarks/bench_conv.py times both.
BIND_OBJECTS = True


def _fast_key(name: str, operands: Sequence[Any], outs: Sequence[Any] | None, attrs: tuple) -> tuple[tuple, list[int]]:
    """(dispatch key, pointers); KeyError when an operand's type has no adapter yet."""
    sigs, ptrs = [], []
    for a in operands:
        sig, ptr = _BY_TYPE[type(a)].probe(a)
        sigs.append(sig)
        ptrs.append(ptr)
    if outs is not None:
        for a in outs:
            sig, ptr = _BY_TYPE[type(a)].probe(a)
            sigs.append(sig)
            ptrs.append(ptr)
    stream = _BY_TYPE[type(operands[0])].stream(sigs[0][3])
    return (name, attrs, tuple(sigs), outs is None, stream), ptrs


def call(
    pattern: str | Pattern,
    *operands: Any,
    out: Any = None,
    cache: PlanCache | None = None,
    **attrs: Any,
) -> Any:
    """Run ``pattern`` on ``operands`` with ``attrs``; returns its output (a tuple if several).

    ``out`` (an array, or a tuple for several outputs) receives the result instead of a new array.
    New outputs take the array type, dtype, device and layout (NCHW / channels-last) of the operand
    the pattern names for them. Work is queued on the current CuPy / torch stream.
    """
    name = pattern if isinstance(pattern, str) else pattern.name
    outs = None if out is None else (tuple(out) if isinstance(out, (tuple, list)) else (out,))
    akey = tuple(attrs.items())
    try:
        hash(akey)
    except TypeError:  # lists as attribute values
        akey = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs.items())
    try:
        fkey, ptrs = _fast_key(name, operands, outs, akey)
    except Exception:  # an operand no adapter knows yet (or not an array): the checked path below
        fkey = None
    c = _FAST.get(fkey) if fkey is not None and cache is None else None
    if c is None:
        pat = get_pattern(pattern) if isinstance(pattern, str) else pattern
        operands = tuple(as_device_array(a, name, o.name) for a, o in zip(operands, pat.operands)) + tuple(operands[len(pat.operands):])
        if outs is not None:
            outs = tuple(as_device_array(a, name, f"out[{i}]") for i, a in enumerate(outs))
            if len(outs) != len(pat.outputs):
                raise OperandError(name, "out", f"expected {len(pat.outputs)} output array(s) {tuple(pat.outputs)}, got {len(outs)}")
        if fkey is None and cache is None:  # __dlpack__ producers: dispatch on their zero-copy views
            try:
                fkey, ptrs = _fast_key(name, operands, outs, akey)
                c = _FAST.get(fkey)
            except Exception:
                c = None
    if c is None:
        cache_ = cache or default_cache()
        _watch(cache_)
        c, ptrs = _resolve(pat, operands, outs, attrs, cache_)
        if cache is None:
            fkey, _ = _fast_key(name, operands, outs, akey)
            with _FAST_LOCK:
                _FAST[fkey] = c
    if outs is None:
        outs = tuple(c.out_adapter.empty(s) for s in c.outs)
        if not BIND_OBJECTS:
            ptrs.extend(_BY_TYPE[type(a)].probe(a)[1] for a in outs)
    if BIND_OBJECTS:
        c.graph.execute([*operands, *outs], c.workspace.ptr, handle=c.handle, tensor_uids=c.uids)
    else:
        c.graph.execute(ptrs, c.workspace.ptr, handle=c.handle, tensor_uids=c.uids)
    return outs[0] if len(outs) == 1 else outs


def plan_for(pattern: str | Pattern, *operands: Any, out: Any = None, cache: PlanCache | None = None, **attrs: Any) -> Plan:
    """The plan :func:`call` would run for these operands (built if needed), without executing it."""
    pat = get_pattern(pattern) if isinstance(pattern, str) else pattern
    outs = None if out is None else (tuple(out) if isinstance(out, (tuple, list)) else (out,))
    operands = tuple(as_device_array(a, pat.name, o.name) for a, o in zip(operands, pat.operands))
    cache_ = cache or default_cache()
    _watch(cache_)
    return _resolve(pat, operands, outs, attrs, cache_)[0].plan


def conv_bias_relu(x: Any, w: Any, b: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, out: Any = None) -> Any:
    """``relu(conv2d(x, w) + b)`` as one cuDNN graph. x: (N, C, H, W), w: (K, C, R, S), b: (K,)."""
    return call("conv_bias_relu", x, w, b, out=out, padding=padding, stride=stride, dilation=dilation)


def conv_bias(x: Any, w: Any, b: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, out: Any = None) -> Any:
    """``conv2d(x, w) + b`` as one cuDNN graph."""
    return call("conv_bias", x, w, b, out=out, padding=padding, stride=stride, dilation=dilation)


def conv2d(x: Any, w: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, out: Any = None) -> Any:
    """``conv2d(x, w)`` (cross-correlation, as in PyTorch) as a cuDNN graph."""
    return call("conv", x, w, out=out, padding=padding, stride=stride, dilation=dilation)
