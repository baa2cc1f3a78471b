"""Functional API: run a pattern on CuPy arrays, torch tensors or ``__dlpack__`` producers.

The first call of a signature checks every operand, builds (or finds) the plan and records a
``_Call``; later calls with the same shapes, strides, dtypes, devices, alignments, attributes and
stream do one dict look-up, bind the arrays and execute (``_dispatch``, the one place that binds).
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Callable, Mapping, Sequence

from . import lower as _lower
from .cache import Plan, PlanCache, PlanKey, default_cache
from .errors import OperandError, UnsupportedError
from .patterns import Pattern, get_pattern
from .runtime import RUNTIME, versions
from .tensors import _SIG, _STREAM, LAYOUT_STRIDES, Adapter, TensorSpec, adapter_for, as_device_array, logical_shape, make_spec, view_shape


class _Call:
    """Everything a cache hit needs, resolved once."""

    __slots__ = ("plan", "graph", "uids", "handle", "workspace", "outs", "out_adapter", "relayout")

    def __init__(
        self, plan: Plan, handle: Any, workspace: Any, outs: tuple[TensorSpec, ...], out_adapter: Adapter, relayout: frozenset = frozenset()
    ):
        self.plan, self.graph, self.uids = plan, plan.graph, plan.uids
        self.handle, self.workspace, self.outs, self.out_adapter = handle, workspace, outs, out_adapter
        self.relayout = relayout  # positions (operands, then outputs) run through channels-last copies


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


def _check(
    pattern: Pattern, operands: Sequence[Any], outs_given: Sequence[Any] | None, attrs: Mapping[str, Any]
) -> tuple[dict[str, TensorSpec], tuple, list[int], Adapter]:
    """Check every operand (and given output) against the pattern: (specs, attrs, alignments, adapter)."""
    name = pattern.name
    if len(operands) != len(pattern.operands):
        raise TypeError(f"{name} takes {len(pattern.operands)} array operands {pattern.operand_names}, got {len(operands)}")
    specs: dict[str, TensorSpec] = {}
    aligns = []
    first: tuple[str, TensorSpec] | None = None
    adapter0: Adapter | None = None
    for o, a in zip(pattern.operands, operands):
        ad = adapter_for(a, name, o.name)
        adapter0 = adapter0 or ad
        shape, strides, dtype, device = ad.describe(a)
        spec = make_spec(name, o.name, o.kind, shape, strides, dtype, device)
        if o.dtype is not None and spec.dtype != o.dtype:
            raise OperandError(name, o.name, f"expected dtype {o.dtype}, got {spec.dtype}")
        if first is not None:
            fname, fspec = first
            if spec.device != fspec.device:
                raise OperandError(name, o.name, f"is on cuda:{spec.device} but '{fname}' is on cuda:{fspec.device}; put all operands on one device")
            if o.dtype is None and spec.dtype != fspec.dtype:
                raise OperandError(name, o.name, f"expected dtype {fspec.dtype} like '{fname}', got {spec.dtype}")
        else:
            first = (o.name, spec)
        specs[o.name] = spec
        aligns.append(ad.probe(a)[0][-1])
    norm = pattern.normalize_attrs(attrs)
    wanted = output_specs(pattern, specs, norm)
    for i, (oname, want) in enumerate(wanted.items()):
        if outs_given is not None:
            a = outs_given[i]
            ad = adapter_for(a, name, oname)
            shape, strides, dtype, device = ad.describe(a)
            got = make_spec(name, oname, pattern.output_kinds[oname], shape, strides, dtype, device)
            if (got.shape, got.dtype, got.device) != (want.shape, want.dtype, want.device):
                raise OperandError(
                    name, oname, f"expected out of shape {want.shape}, dtype {want.dtype} on cuda:{want.device}, "
                    f"got shape {got.shape}, dtype {got.dtype} on cuda:{got.device}"
                )
            want = got
            aligns.append(ad.probe(a)[0][-1])
        else:
            aligns.append(32)  # fresh allocations from CuPy's and torch's pools are 256-byte aligned
        specs[oname] = want
    assert adapter0 is not None
    return specs, norm, aligns, adapter0


def output_specs(pattern: Pattern, specs: Mapping[str, TensorSpec], norm: tuple) -> dict[str, TensorSpec]:
    """Specs of the outputs fusekit allocates: shape inferred; dtype, device and layout of their 'like' operand."""
    shapes = pattern.infer_shapes({k: specs[k].shape for k in pattern.operand_names}, dict(norm))
    out = {}
    for oname, like in pattern.outputs.items():
        ls, kind = specs[like], pattern.output_kinds[oname]
        ls = TensorSpec.build(ls.shape, pattern.output_dtypes.get(oname, ls.dtype), ls.device, ls.layout, view=ls.view)
        shape = shapes[oname]
        if kind == "tensor":  # elementwise: same layout and view as the operand it is like
            out[oname] = TensorSpec.build(shape, ls.dtype, ls.device, ls.layout, view=ls.view if shape == ls.shape else shape)
            continue
        if kind in ("image", "filter"):
            layout = ls.layout if ls.layout in ("NCHW", "NHWC") and pattern.operand(like).kind in ("image", "filter") else "NCHW"
        else:
            layout = "NCHW" if kind == "channel" else "ROW"
        out[oname] = TensorSpec.build(shape, ls.dtype, ls.device, layout, view=view_shape(kind, shape))
    return out


def shape_specs(pattern: Pattern, shapes: Mapping[str, Sequence[int]], dtype: str, layout: str, device: int = 0) -> dict[str, TensorSpec]:
    """Checked operand specs from shapes alone (no arrays): each operand dense in ``layout`` if it is
    4-D, row-major otherwise, in its fixed dtype or ``dtype``. What tuning ahead of time and the CLI use."""
    specs = {}
    for o in pattern.operands:
        view = tuple(int(d) for d in shapes[o.name])
        shp = logical_shape(pattern.name, o.name, o.kind, view)
        four_d = len(shp) == 4 and o.kind in ("image", "filter", "tensor")
        strides = LAYOUT_STRIDES[layout](shp) if four_d else LAYOUT_STRIDES["ROW"](view)
        specs[o.name] = make_spec(pattern.name, o.name, o.kind, view, strides, o.dtype or dtype, device)
    return specs


def make_key(pattern: Pattern, specs: Mapping[str, TensorSpec], norm: tuple, aligns: Sequence[int], adapter: Adapter) -> PlanKey:
    device = specs[pattern.operand_names[0]].device
    facts = RUNTIME.device_facts(adapter, device)
    v = versions()
    return PlanKey(
        pattern=pattern.name,
        digest=pattern.digest,
        specs=tuple((n, specs[n]) for n in pattern.operand_names + tuple(pattern.outputs)),
        alignments=tuple(aligns),
        attrs=norm,
        compute_dtype=_lower.COMPUTE_DTYPE,
        gpu=facts.name,
        cc=facts.cc,
        cudnn_backend=v.cudnn_backend,
        frontend=v.frontend,
    )


def _planner(pattern: Pattern, key: PlanKey, adapter: Adapter, handle: Any, cache: PlanCache, tune_options: Any = None):
    """(build, load) callables for ``cache.get_or_build``: heuristics or autotuning, and deserialization."""
    specs = dict(key.specs)
    attrs = dict(key.attrs)
    device = specs[pattern.operand_names[0]].device

    def build() -> Plan:
        with adapter.use_device(device):
            if cache.mode == "autotune" or tune_options is not None:
                from .autotune import tune

                plan, _ = tune(pattern, specs, attrs, key, adapter, handle, tune_options)
                return plan
            notes = _lower.precision_notes(pattern, specs)
            try:
                b = _lower.build(_lower.lower(pattern, specs, attrs, handle=handle), cache.heuristics, key.describe(), notes)
            except UnsupportedError:
                if not notes:
                    raise
                # no IEEE float32 plan for this key: let cuDNN use TF32 tensor cores rather than fail
                b = _lower.build(_lower.lower(pattern, specs, attrs, handle=handle), cache.heuristics, key.describe())
        return Plan(key, b.graph, b.uids, b.workspace_size, b.engine, b.candidates, b.build_ms, engine_id=b.engine_id, knobs=b.knobs)

    def load(entry: Any) -> Plan:
        meta = entry.header["plan"]
        with adapter.use_device(device):
            t0 = time.perf_counter()
            g = _lower.deserialize(entry.blob, handle)
            ms = (time.perf_counter() - t0) * 1e3
        return Plan(
            key, g, tuple(meta["uids"]), int(meta["workspace_size"]), meta["engine"], int(meta.get("candidates", 0)), ms,
            source="disk", engine_id=meta.get("engine_id"), knobs=meta.get("knobs") or {}, tuning=meta.get("tuning"),
        )

    return build, load


def _resolve(
    pattern: Pattern, operands: Sequence[Any], outs_given: Sequence[Any] | None, attrs: Mapping[str, Any], cache: PlanCache
) -> _Call:
    """Check every operand, then find or build the plan (everything a cache miss does)."""
    specs, norm, aligns, adapter = _check(pattern, operands, outs_given, attrs)
    key = make_key(pattern, specs, norm, aligns, adapter)
    device = specs[pattern.operand_names[0]].device
    stream = adapter.stream(device)
    handle = RUNTIME.handle(adapter, device, stream)
    relayout: frozenset = frozenset()
    outs = tuple(specs[n] for n in pattern.outputs)
    try:
        if key in _NO_ENGINE:
            raise UnsupportedError(str(_NO_ENGINE[key]))
        plan = cache.get_or_build(key, *_planner(pattern, key, adapter, handle, cache))
    except UnsupportedError as e:
        _NO_ENGINE[key] = e
        for specs2, relayout in _alternatives(pattern, specs):
            key2 = make_key(pattern, specs2, norm, [32 if i in relayout else a for i, a in enumerate(aligns)], adapter)
            try:
                if key2 in _NO_ENGINE:
                    continue
                plan = cache.get_or_build(key2, *_planner(pattern, key2, adapter, handle, cache))
                break
            except UnsupportedError as e2:
                _NO_ENGINE[key2] = e2
        else:
            raise UnsupportedError(str(e)) from None
        if relayout:
            outs = tuple(specs2[n] for n in pattern.outputs)  # channels-last temporaries
            if pattern.name not in _RELAYOUT_WARNED:
                _RELAYOUT_WARNED.add(pattern.name)
                warnings.warn(
                    f"fusekit: cuDNN has no NCHW engine for {pattern.name} ({e}); running it on channels-last copies "
                    "(pass channels-last arrays to avoid the copies)", LayoutWarning, stacklevel=4,
                )
    ws = RUNTIME.workspace(adapter, device, stream)
    ws.ensure(plan.workspace_size)
    return _Call(plan, handle, ws, outs, adapter, relayout)


class LayoutWarning(UserWarning):
    """A pattern has no cuDNN engine for NCHW operands; fusekit runs it on channels-last copies."""


_NO_ENGINE: dict[PlanKey, UnsupportedError] = {}  # keys cuDNN refused (not retried in this process)
_RELAYOUT_WARNED: set[str] = set()
_ELEMENTWISE = frozenset({"add", "mul", "sub", "bias", "relu", "relu_backward", "channel_sum"})


def _alternatives(pattern: Pattern, specs: Mapping[str, TensorSpec]) -> list[tuple[dict[str, TensorSpec], frozenset]]:
    """Other descriptions of the same call to offer cuDNN when it refuses one: (specs, positions to copy).

    - One channel: cuDNN's pointwise and reduction engines refuse C = 1. For elementwise patterns
      whose channel vectors are single values, an (N, 1, H, W) tensor is the same memory as a
      channels-last (N, W, H, 1) one: same pointers, no copies.
    - NCHW: most pointwise, reduction and fused engines take channels-last only: run on NHWC copies.
    """
    names = pattern.operand_names + tuple(pattern.outputs)
    kinds = [o.kind for o in pattern.operands] + [pattern.output_kinds[n] for n in pattern.outputs]
    images = [n for n, k in zip(names, kinds) if k in ("image", "filter", "tensor") and len(specs[n].shape) == 4]
    alts: list[tuple[dict[str, TensorSpec], frozenset]] = []
    if (
        images and all(specs[n].shape[1] == 1 for n in images)
        and all(op.op in _ELEMENTWISE for op in pattern.ops)
        and all(k not in ("channel",) or max(specs[n].shape) == 1 for n, k in zip(names, kinds))
    ):
        alt = dict(specs)
        for n in images:
            s = specs[n]
            alt[n] = TensorSpec.build((s.shape[0], s.shape[3], s.shape[2], 1), s.dtype, s.device, "NHWC")
        alts.append((alt, frozenset()))
    relayout = frozenset(i for i, n in enumerate(names) if n in images and specs[n].layout == "NCHW")
    if relayout:
        alt = dict(specs)
        for i in relayout:
            s = specs[names[i]]
            alt[names[i]] = TensorSpec.build(s.shape, s.dtype, s.device, "NHWC")
        alts.append((alt, relayout))
    return alts


def _execute_relayout(c: _Call, operands: tuple, outs: tuple, alloc: bool) -> tuple:
    """Execute ``c`` on channels-last copies of its NCHW arrays; results go back in the caller's layout."""
    ad, n_in = c.out_adapter, len(operands)
    ins = tuple(ad.relayout(a, "NHWC") if i in c.relayout else a for i, a in enumerate(operands))
    tmp = tuple(ad.empty(s) if (alloc or n_in + j in c.relayout) else outs[j] for j, s in enumerate(c.outs))
    c.graph.execute(ins + tmp, c.workspace.ptr, handle=c.handle, tensor_uids=c.uids)
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


def as_outs(out: Any) -> tuple:
    """``out=`` as a tuple of arrays (one array, or a tuple/list for several outputs)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _fast_key(pattern: str, names: tuple, values: tuple, operands: Sequence[Any], arrays: Sequence[Any], alloc: bool) -> tuple:
    """Dispatch key of a call: attributes, each array's (shape, strides, dtype, device, ptr % 32)
    and the current stream. Raises (KeyError, TypeError, ...) when an array type is not known yet."""
    k = [pattern, names, values, alloc]
    for a in arrays:
        k += _SIG[type(a)](a)
    k.append(_STREAM[type(operands[0])](k[7]))  # k[7]: the first operand's device
    return tuple(k)


def _dispatch(pattern: str | Pattern, names: tuple, values: tuple, operands: tuple, out: Any, cache: PlanCache | None) -> Any:
    """The one place pointers are bound: look the call up, else resolve it; then execute."""
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
            raise TypeError(f"{name} takes {len(pat.operands)} array operands {pat.operand_names}, got {len(operands)}")
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
            if fkey is not None:
                with _FAST_LOCK:
                    _FAST[fkey] = c
    if c.relayout:
        outs = _execute_relayout(c, operands, outs, alloc)
        return outs[0] if len(outs) == 1 else outs
    if alloc:
        outs = tuple([c.out_adapter.empty(s) for s in c.outs])
        arrays = operands + outs
    c.graph.execute(arrays, c.workspace.ptr, handle=c.handle, tensor_uids=c.uids)
    return outs[0] if len(outs) == 1 else outs


def call(pattern: str | Pattern, *operands: Any, out: Any = None, cache: PlanCache | None = None, **attrs: Any) -> Any:
    """Run ``pattern`` on ``operands`` with ``attrs``; returns its output (a tuple if several).

    ``out`` (an array, or a tuple for several outputs) receives the result instead of a new array.
    New outputs take the array type, dtype, device and layout (NCHW / channels-last) of the operand
    the pattern names for them. Work is queued on the current CuPy / torch stream. ``cache``: a
    private PlanCache (calls with one skip the dispatch table).
    """
    values = tuple(tuple(v) if type(v) is list else v for v in attrs.values())
    return _dispatch(pattern, tuple(attrs), values, operands, out, cache)


def plan_for(pattern: str | Pattern, *operands: Any, out: Any = None, cache: PlanCache | None = None, **attrs: Any) -> Plan:
    """The plan :func:`call` would run for these operands (built if needed), without executing it."""
    pat = get_pattern(pattern) if isinstance(pattern, str) else pattern
    outs = None if out is None else as_outs(out)
    operands = tuple(as_device_array(a, pat.name, o.name) for a, o in zip(operands, pat.operands))
    cache_ = (cache if cache is not None else default_cache())
    _watch(cache_)
    return _resolve(pat, operands, outs, attrs, cache_).plan


_CONV_ATTRS = ("padding", "stride", "dilation")


def conv_bias_relu(x: Any, w: Any, b: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, out: Any = None) -> Any:
    """``relu(conv2d(x, w) + b)`` as one cuDNN graph. x: (N, C, H, W), w: (K, C, R, S), b: (K,)."""
    return _dispatch("conv_bias_relu", _CONV_ATTRS, (padding, stride, dilation), (x, w, b), out, None)


def conv_bias(x: Any, w: Any, b: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, out: Any = None) -> Any:
    """``conv2d(x, w) + b`` as one cuDNN graph."""
    return _dispatch("conv_bias", _CONV_ATTRS, (padding, stride, dilation), (x, w, b), out, None)


def conv2d(x: Any, w: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, out: Any = None) -> Any:
    """``conv2d(x, w)`` (cross-correlation, as in PyTorch) as a cuDNN graph."""
    return _dispatch("conv", _CONV_ATTRS, (padding, stride, dilation), (x, w), out, None)


# ----------------------------------------------------------------------------------------------
# Transposed convolution and fully connected forwards
# ----------------------------------------------------------------------------------------------
_CONVT_ATTRS = ("padding", "stride", "dilation", "output_padding")


def conv_transpose_bias_relu(
    x: Any, w: Any, b: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, output_padding: Any = 0, out: Any = None
) -> Any:
    """``relu(conv_transpose2d(x, w) + b)``: cuDNN dgrad as the forward op. w: (C_in, C_out, R, S)."""
    return _conv_transpose(True, x, w, b, (padding, stride, dilation, output_padding), out)


def conv_transpose_bias(
    x: Any, w: Any, b: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, output_padding: Any = 0, out: Any = None
) -> Any:
    """``conv_transpose2d(x, w) + b`` as one cuDNN graph. w: (C_in, C_out, R, S)."""
    return _conv_transpose(False, x, w, b, (padding, stride, dilation, output_padding), out)


def _conv_transpose(relu: bool, x: Any, w: Any, b: Any, values: tuple, out: Any) -> Any:
    name = "conv_transpose_bias_relu" if relu else "conv_transpose_bias"

    def split() -> Any:  # dgrad alone, then bias (and ReLU) as a pointwise graph
        y = call("conv_dgrad", x, w, **dict(zip(_CONVT_ATTRS, values)))
        b32 = adapter_for(b).astype(b, "float32")
        if relu:
            return call("channel_scale_shift_relu", y, _affine_identity(y)[0], b32, out=out)
        return call("channel_shift", y, b32, out=out)

    return _fused_or_split(_tag(name, x, w), lambda: _dispatch(name, _CONVT_ATTRS, values, (x, w, b), out, None), split)


def linear_bias_relu(x: Any, w: Any, b: Any, *, out: Any = None) -> Any:
    """``relu(x @ w.T + b)``: x (B, in), w (out, in) as in torch.nn.Linear, b (out,)."""
    return _dispatch("linear_bias_relu", (), (), (x, w, b), out, None)


def linear_bias(x: Any, w: Any, b: Any, *, out: Any = None) -> Any:
    """``x @ w.T + b`` as one cuDNN graph."""
    return _dispatch("linear_bias", (), (), (x, w, b), out, None)


# ----------------------------------------------------------------------------------------------
# Backward passes: each takes the upstream gradient and the saved tensors positionally and returns
# the gradients of the forward's operands, None for those not requested (and nothing computed).
# ----------------------------------------------------------------------------------------------
class FusionWarning(UserWarning):
    """A fused graph has no cuDNN engine for a key; fusekit runs it as separate graphs."""


_SPLIT: set[tuple] = set()


def _fused_or_split(tag: tuple, fused: Callable[[], Any], split: Callable[[], Any]) -> Any:
    """Run ``fused``; if cuDNN refuses it, warn once for this tag and run ``split`` from then on."""
    if tag in _SPLIT:
        return split()
    try:
        return fused()
    except UnsupportedError as e:
        _SPLIT.add(tag)
        warnings.warn(
            f"fusekit: cuDNN has no engine for the fused pattern {tag[0]} with {tag[1:]}; running it as separate graphs ({e})",
            FusionWarning,
            stacklevel=3,
        )
        return split()


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if not hasattr(v, "__len__") else (int(v[0]), int(v[1]))


def _output_padding(x_hw: Sequence[int], dy_hw: Sequence[int], k_hw: Sequence[int], padding, stride, dilation) -> tuple[int, int]:
    """Rows/columns of x that a strided convolution never read (what dgrad must add back)."""
    p, s, d = _pair(padding), _pair(stride), _pair(dilation)
    return tuple(int(x_hw[i]) - ((int(dy_hw[i]) - 1) * s[i] - 2 * p[i] + d[i] * (int(k_hw[i]) - 1) + 1) for i in range(2))  # type: ignore[return-value]


def _cast(a: Any, like: Any) -> Any:
    """``a`` in ``like``'s dtype (bias gradients come out of cuDNN reductions in float32)."""
    if a is None or a.dtype == like.dtype:
        return a
    ad = adapter_for(a)
    return ad.astype(a, ad.describe(like)[2])


def _tag(name: str, *arrays: Any) -> tuple:
    return (name,) + tuple((tuple(a.shape), str(a.dtype)) for a in arrays)


def _conv_grads(dz, x, w, padding, stride, dilation, need_dx, need_dw, input_relu):
    conv = dict(padding=padding, stride=stride, dilation=dilation)
    dx = dw = None
    if need_dx:
        op = _output_padding(x.shape[2:], dz.shape[2:], w.shape[2:], padding, stride, dilation)
        if input_relu:
            dx = _fused_or_split(
                _tag("conv_dgrad_drelu", dz, w, x),
                lambda: call("conv_dgrad_drelu", dz, w, x, output_padding=op, **conv),
                lambda: call("relu_backward", call("conv_dgrad", dz, w, output_padding=op, **conv), x),
            )
        else:
            dx = call("conv_dgrad", dz, w, output_padding=op, **conv)
    if need_dw:
        dw = call("conv_wgrad", x, dz, kernel=tuple(w.shape[2:]), **conv)
    return dx, dw


def relu_backward(dy: Any, y: Any) -> Any:
    """``dy * (y > 0)``, y the ReLU's output (or input)."""
    return call("relu_backward", dy, y)


def conv_bias_relu_backward(
    dy: Any, x: Any, w: Any, y: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1,
    needs: Sequence[bool] = (True, True, True), input_relu: bool = False,
) -> tuple[Any, Any, Any]:
    """(dx, dw, db) of ``y = relu(conv2d(x, w) + b)``; saved: x, w, y.

    ``input_relu``: x is the output of a ReLU; dx then also carries that ReLU's backward (the
    fused dgrad + dReLU graph), so the caller skips it."""
    need_dx, need_dw, need_db = needs
    dz, db = _relu_bias_grad(dy, y, need_db)
    dx, dw = _conv_grads(dz, x, w, padding, stride, dilation, need_dx, need_dw, input_relu)
    return dx, dw, _cast(db, dy)


def conv_bias_backward(
    dy: Any, x: Any, w: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1,
    needs: Sequence[bool] = (True, True, True), input_relu: bool = False,
) -> tuple[Any, Any, Any]:
    """(dx, dw, db) of ``y = conv2d(x, w) + b``; saved: x, w."""
    need_dx, need_dw, need_db = needs
    db = call("bias_grad", dy) if need_db else None
    dx, dw = _conv_grads(dy, x, w, padding, stride, dilation, need_dx, need_dw, input_relu)
    return dx, dw, _cast(db, dy)


def conv2d_backward(
    dy: Any, x: Any, w: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1,
    needs: Sequence[bool] = (True, True), input_relu: bool = False,
) -> tuple[Any, Any]:
    """(dx, dw) of ``y = conv2d(x, w)``; saved: x, w."""
    return _conv_grads(dy, x, w, padding, stride, dilation, needs[0], needs[1], input_relu)


def conv_transpose_bias_relu_backward(
    dy: Any, x: Any, w: Any, y: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1,
    needs: Sequence[bool] = (True, True, True), relu: bool = True,
) -> tuple[Any, Any, Any]:
    """(dx, dw, db) of ``y = [relu](conv_transpose2d(x, w) + b)``: dx is a forward convolution of
    dz with w, dw is wgrad with the roles of image and gradient swapped; saved: x, w, y."""
    need_dx, need_dw, need_db = needs
    conv = dict(padding=padding, stride=stride, dilation=dilation)
    if relu:
        dz, db = _relu_bias_grad(dy, y, need_db)
    else:
        dz, db = dy, (call("bias_grad", dy) if need_db else None)
    dx = call("conv", dz, w, **conv) if need_dx else None
    dw = call("conv_wgrad", dz, x, kernel=tuple(w.shape[2:]), **conv) if need_dw else None
    return dx, dw, _cast(db, dy)


def _relu_bias_grad(dy: Any, y: Any, need_db: bool) -> tuple[Any, Any]:
    if not need_db:
        return call("relu_backward", dy, y), None
    return _fused_or_split(
        _tag("relu_bias_grad", dy, y),
        lambda: call("relu_bias_grad", dy, y),
        lambda: (lambda d: (d, call("bias_grad", d)))(call("relu_backward", dy, y)),
    )


def _as_image(m: Any, op: str, name: str) -> Any:
    """A (rows, features) matrix as a (rows, features, 1, 1) image view (channels-last: no copy). cuDNN
    reduces only 4-D channels-last tensors, so a Linear layer's bias gradient runs as a conv's does."""
    if len(getattr(m, "shape", ())) != 2:
        raise OperandError(op, name, f"expected a (rows, features) matrix, got shape {tuple(getattr(m, 'shape', ()))}")
    return m.reshape(int(m.shape[0]), int(m.shape[1]), 1, 1)


def linear_bias_relu_backward(dy: Any, x: Any, w: Any, y: Any, *, needs: Sequence[bool] = (True, True, True)) -> tuple[Any, Any, Any]:
    """(dx, dw, db) of ``y = relu(x @ w.T + b)``; saved: x, w, y."""
    need_dx, need_dw, need_db = needs
    op = "linear_bias_relu_backward"
    dz, db = _relu_bias_grad(_as_image(dy, op, "dy"), _as_image(y, op, "y"), need_db)
    return _linear_grads(dz.reshape(dy.shape), x, w, need_dx, need_dw) + (_cast(db, dy),)


def linear_bias_backward(dy: Any, x: Any, w: Any, *, needs: Sequence[bool] = (True, True, True)) -> tuple[Any, Any, Any]:
    """(dx, dw, db) of ``y = x @ w.T + b``; saved: x, w."""
    db = call("bias_grad", _as_image(dy, "linear_bias_backward", "dy")) if needs[2] else None
    return _linear_grads(dy, x, w, needs[0], needs[1]) + (_cast(db, dy),)


def _linear_grads(dz: Any, x: Any, w: Any, need_dx: bool, need_dw: bool) -> tuple[Any, Any]:
    dx = call("matmul", dz, w) if need_dx else None
    dw = call("linear_wgrad", dz, x) if need_dw else None
    return dx, dw


# ----------------------------------------------------------------------------------------------
# Batch norm, split into normalize / scale / shift, and fused back together
# ----------------------------------------------------------------------------------------------
_IDENTITY: dict[tuple, tuple[Any, Any, Any]] = {}


def _affine_identity(x: Any) -> tuple[Any, Any, Any]:
    """(ones, zeros, (scratch, scratch)) float32 channel vectors for x's channels, cached per library/device/C.
    cuDNN's batch-norm node always applies gamma and beta; normalize-only runs it with these, and
    its backward writes the unused dgamma/dbeta into ``scratch`` (never returned, never allocated per call)."""
    c = int(x.shape[1])
    key = (type(x), _device_index(x), c)
    v = _IDENTITY.get(key)
    if v is None:
        ad = adapter_for(x)
        spec = TensorSpec.build((1, c, 1, 1), "float32", _device_index(x), "NCHW", view=(c,))
        ones, zeros, scratch = ad.empty(spec), ad.empty(spec), (ad.empty(spec), ad.empty(spec))
        ones[...] = 1.0
        zeros[...] = 0.0
        v = _IDENTITY[key] = (ones, zeros, scratch)
    return v


def _device_index(x: Any) -> int:
    return int(adapter_for(x).describe(x)[3])


def bn_normalize(
    x: Any, running_mean: Any = None, running_var: Any = None, *, epsilon: float = 1e-5, momentum: float = 0.1
) -> tuple[Any, ...]:
    """Batch normalization without scale or shift: (x - mean) * inv_std over N, H, W.

    Returns (y, mean, inv_var), plus (new_running_mean, new_running_var) when running stats are
    given (updated with ``momentum``, unbiased variance, as PyTorch). Statistics are float32 (C,)."""
    ones, zeros, _ = _affine_identity(x)
    return batchnorm(x, ones, zeros, running_mean, running_var, epsilon=epsilon, momentum=momentum)


def bn_normalize_backward(dy: Any, x: Any, mean: Any, inv_var: Any) -> Any:
    """dx of :func:`bn_normalize` (no gamma/beta gradients are produced for the caller)."""
    ones, _, (dg, db) = _affine_identity(x)

    def node() -> Any:
        dx = _empty_like(x)
        call("batchnorm_backward", dy, x, ones, mean, inv_var, out=(dx, dg, db))
        return dx

    return _fused_or_split(_tag("batchnorm_backward_node", dy, x), node, lambda: _bn_split_backward(dy, x, ones, mean, inv_var)[0])


def _empty_like(x: Any) -> Any:
    """An uninitialised 4-D array like ``x``: same library, dtype, device and layout (NCHW / NHWC)."""
    ad = adapter_for(x)
    return ad.empty(make_spec("fusekit", "x", "image", *ad.describe(x)))


def batchnorm(
    x: Any, gamma: Any, beta: Any, running_mean: Any = None, running_var: Any = None, *,
    epsilon: float = 1e-5, momentum: float = 0.1, relu: bool = False,
) -> tuple[Any, ...]:
    """Training batch norm (normalize, scale, shift fused; + ReLU with ``relu``): (y, mean, inv_var
    [, new_running_mean, new_running_var])."""
    stats_only = running_mean is None
    if stats_only:  # the frontend's batchnorm node cannot drop its running-stat ports: feed it (0, 1), momentum 0
        ones, zeros, _ = _affine_identity(x)
        running_mean, running_var, momentum = zeros, ones, 0.0
    kw = dict(epsilon=epsilon, momentum=momentum)
    res = _fused_or_split(
        _tag("batchnorm_node", x),
        lambda: _bn_node_forward(x, gamma, beta, running_mean, running_var, relu, kw),
        lambda: _bn_split_forward(x, gamma, beta, running_mean, running_var, relu, epsilon, momentum),
    )
    return tuple(res[:3]) if stats_only else tuple(res)


def _bn_node_forward(x: Any, gamma: Any, beta: Any, rm: Any, rv: Any, relu: bool, kw: dict) -> tuple:
    if not relu:
        return call("batchnorm", x, gamma, beta, rm, rv, **kw)
    return _fused_or_split(
        _tag("batchnorm_relu", x),
        lambda: call("batchnorm_relu", x, gamma, beta, rm, rv, **kw),
        lambda: (lambda r: (call("relu", r[0]),) + tuple(r[1:]))(call("batchnorm", x, gamma, beta, rm, rv, **kw)),
    )


def _count(x: Any) -> int:
    n, c, h, w = (int(d) for d in x.shape)
    return n * h * w


def _bn_split_forward(x: Any, gamma: Any, beta: Any, rm: Any, rv: Any, relu: bool, epsilon: float, momentum: float) -> tuple:
    """Training batch norm from reductions and one pointwise graph, for keys cuDNN's batch-norm node
    refuses (its engines want C a multiple of their vector width): mean = sum(x) / M, then the
    two-pass variance sum((x - mean)^2) / M, the C-length statistics in array math, and
    (x - mean) * inv_std * gamma + beta [+ ReLU] as one graph."""
    m = _count(x)
    gamma, beta, rm, rv = (v.reshape(-1) for v in (gamma, beta, rm, rv))
    mean = call("bias_grad", x) / m
    var = call("centered_sq_sum", x, mean) / m
    inv = (var + epsilon) ** -0.5
    y = batchnorm_inference(x, mean, inv, gamma, beta, relu=relu)
    new_rm = rm * (1 - momentum) + mean * momentum
    new_rv = rv * (1 - momentum) + var * (momentum * m / max(m - 1, 1))
    return y, mean, inv, new_rm, new_rv


def _bn_split_backward(dy: Any, x: Any, gamma: Any, mean: Any, inv: Any) -> tuple[Any, Any, Any]:
    """Batch-norm backward from two reductions (sum dy, sum dy * x) and one pointwise graph for dx."""
    m = _count(x)
    gamma, mean, inv = (v.reshape(-1) for v in (gamma, mean, inv))
    dbeta = call("bias_grad", dy)
    dgamma = (call("scale_grad", dy, x) - mean * dbeta) * inv
    a = gamma * inv
    b = -a * inv * dgamma / m
    c = -a * dbeta / m - b * mean
    return call("bn_dx", dy, x, a, b, c), dgamma, dbeta


def batchnorm_backward(
    dy: Any, x: Any, gamma: Any, mean: Any, inv_var: Any, *, y: Any = None, needs: Sequence[bool] = (True, True, True)
) -> tuple[Any, Any, Any]:
    """(dx, dgamma, dbeta) of training batch norm; with ``y`` (the ReLU output of batchnorm(relu=True))
    the ReLU backward is fused in front (the dReLU + BN backward graph)."""
    def node() -> tuple:
        if y is None:
            return call("batchnorm_backward", dy, x, gamma, mean, inv_var)
        return _fused_or_split(
            _tag("batchnorm_relu_backward", dy, x),
            lambda: call("batchnorm_relu_backward", dy, y, x, gamma, mean, inv_var),
            lambda: call("batchnorm_backward", call("relu_backward", dy, y), x, gamma, mean, inv_var),
        )

    res = _fused_or_split(
        _tag("batchnorm_backward_node", dy, x), node,
        lambda: _bn_split_backward(dy if y is None else call("relu_backward", dy, y), x, gamma, mean, inv_var),
    )
    return tuple(r if n else None for r, n in zip(res, needs))  # type: ignore[return-value]


def inv_std(running_var: Any, epsilon: float = 1e-5) -> Any:
    """1 / sqrt(running_var + epsilon), what inference batch norm reads."""
    return (running_var + epsilon) ** -0.5


def batchnorm_inference(x: Any, mean: Any, inv_stdev: Any, gamma: Any, beta: Any, *, relu: bool = False) -> Any:
    """Inference batch norm from running statistics (``inv_stdev`` = :func:`inv_std` of the running variance)."""
    if not relu:
        return call("batchnorm_inference", x, mean, inv_stdev, gamma, beta)
    return _fused_or_split(
        _tag("batchnorm_inference_relu", x),
        lambda: call("batchnorm_inference_relu", x, mean, inv_stdev, gamma, beta),
        lambda: call("relu", call("batchnorm_inference", x, mean, inv_stdev, gamma, beta)),
    )


def channel_scale_shift(x: Any, gamma: Any = None, beta: Any = None, *, relu: bool = False) -> Any:
    """y = x * gamma + beta per channel (either may be None), + ReLU with ``relu``; pointwise cuDNN graphs."""
    if gamma is not None and beta is not None:
        return call("channel_scale_shift_relu" if relu else "channel_scale_shift", x, gamma, beta)
    if relu:
        raise OperandError("channel_scale_shift", "beta", "relu=True needs both gamma and beta (fuse the ReLU behind a full scale and shift)")
    if gamma is not None:
        return call("channel_scale", x, gamma)
    if beta is not None:
        return call("channel_shift", x, beta)
    raise OperandError("channel_scale_shift", "gamma", "give gamma, beta or both")


def channel_scale_shift_backward(
    dy: Any, x: Any, gamma: Any = None, *, y: Any = None, needs: Sequence[bool] = (True, True, True)
) -> tuple[Any, Any, Any]:
    """(dx, dgamma, dbeta) of :func:`channel_scale_shift`; ``y``: its output when relu=True (the mask).
    dgamma needs x; dx needs gamma (dx = dy when there is no gamma)."""
    need_dx, need_dg, need_db = needs
    if y is not None:
        dy = call("relu_backward", dy, y)
    dx = (call("channel_scale", dy, gamma) if gamma is not None else dy) if need_dx else None
    dg = call("scale_grad", dy, x) if need_dg else None
    db = call("shift_grad", dy) if need_db else None
    return dx, dg, db


def fold_batchnorm(w: Any, b: Any, mean: Any, var: Any, gamma: Any, beta: Any, epsilon: float = 1e-5) -> tuple[Any, Any]:
    """Fold inference batch norm into the convolution before it: conv(x, w') + b' = BN(conv(x, w) + b).
    Returns (w', b') in w's dtype (w' in w's memory layout); run them with :func:`conv_bias_relu`."""
    scale = gamma * (var + epsilon) ** -0.5  # float32, one per output channel
    w2 = _empty_like(w)
    w2[...] = w * scale.reshape(-1, 1, 1, 1)  # computed in float32, stored in w's dtype and layout
    ad, k = adapter_for(w), int(w.shape[0])
    _, _, dtype, device = ad.describe(w)
    b2 = ad.empty(TensorSpec.build((1, k, 1, 1), dtype, device, "NCHW", view=(k,)))
    b2[...] = beta - mean * scale if b is None else (b - mean) * scale + beta
    return w2, b2


def conv_bias_add_relu(x: Any, w: Any, b: Any, z: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1, out: Any = None) -> Any:
    """``relu(conv2d(x, w) + b + z)``: a residual block's tail in one cuDNN graph."""
    return _dispatch("conv_bias_add_relu", _CONV_ATTRS, (padding, stride, dilation), (x, w, b, z), out, None)


def conv_genstats(x: Any, w: Any, *, padding: Any = 0, stride: Any = 1, dilation: Any = 1) -> tuple[Any, Any, Any]:
    """(y, sum, sq_sum): a training convolution that also emits the per-channel sums of its output
    the next batch norm needs (cuDNN genstats), in one graph."""
    return _dispatch("conv_genstats", _CONV_ATTRS, (padding, stride, dilation), (x, w), None, None)


def _channels_last(x: Any, op: str, name: str) -> bool:
    ad = adapter_for(x, op, name)
    return make_spec(op, name, "image", *ad.describe(x)).layout == "NHWC"


def layernorm(x: Any, gamma: Any, beta: Any, *, epsilon: float = 1e-5) -> tuple[Any, Any, Any]:
    """Layer norm over (C, H, W) per sample (training): (y, mean, inv_var); gamma, beta (1, C, H, W) float32.

    cuDNN 9.19's layer norm gave wrong values for channels-last x on the device (its (1, C, H, W)
    affine is not read in x's order), so channels-last x runs on an NCHW copy; y comes back channels-last."""
    if _channels_last(x, "layernorm", "x"):
        ad = adapter_for(x)
        y, mean, inv = call("layernorm", ad.relayout(x, "NCHW"), gamma, beta, epsilon=epsilon)
        return ad.relayout(y, "NHWC"), mean, inv
    return call("layernorm", x, gamma, beta, epsilon=epsilon)


def layernorm_backward(dy: Any, x: Any, gamma: Any, mean: Any, inv_var: Any) -> tuple[Any, Any, Any]:
    """(dx, dgamma, dbeta) of :func:`layernorm` (channels-last arrays run on NCHW copies, as the forward)."""
    if _channels_last(x, "layernorm_backward", "x") or _channels_last(dy, "layernorm_backward", "dy"):
        ad = adapter_for(x)
        dx, dg, db = call("layernorm_backward", ad.relayout(dy, "NCHW"), ad.relayout(x, "NCHW"), gamma, mean, inv_var)
        return ad.relayout(dx, "NHWC"), dg, db
    return call("layernorm_backward", dy, x, gamma, mean, inv_var)


def instancenorm(x: Any, gamma: Any, beta: Any, *, epsilon: float = 1e-5) -> tuple[Any, Any, Any]:
    """Instance norm over (H, W) per sample and channel (training): (y, mean, inv_var); gamma, beta (C,) float32."""
    return call("instancenorm", x, gamma, beta, epsilon=epsilon)


def instancenorm_backward(dy: Any, x: Any, gamma: Any, mean: Any, inv_var: Any) -> tuple[Any, Any, Any]:
    """(dx, dgamma, dbeta) of :func:`instancenorm`."""
    return call("instancenorm_backward", dy, x, gamma, mean, inv_var)
