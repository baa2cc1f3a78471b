"""From arrays (or shapes) to a PlanKey: every operand checked against its pattern, output specs
inferred, and the key assembled with the device and library versions. No cuDNN graph is touched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import ArityError, OperandError
from ..tensors import ITEMSIZE, LAYOUT_STRIDES, TensorSpec, logical_shape, make_spec, view_shape
from ..adapters import Adapter, adapter_for
from .cache import PlanKey
from .lower import COMPUTE_DTYPE, tf32_allowed
from .patterns import Pattern
from .runtime import current_runtime, versions


def as_outs(out: Any) -> tuple:
    """``out=`` as a tuple of arrays (one array, or a tuple/list for several outputs)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def check_operands(
    pattern: Pattern, operands: Sequence[Any], outs_given: Sequence[Any] | None, attrs: Mapping[str, Any]
) -> tuple[dict[str, TensorSpec], tuple, list[int], Adapter]:
    """Check every operand (and given output) against the pattern: (specs, attrs, alignments, adapter)."""
    name = pattern.name
    if len(operands) != len(pattern.operands):
        raise ArityError(f"{name} takes {len(pattern.operands)} array operands {pattern.operand_names}, got {len(operands)}")
    specs: dict[str, TensorSpec] = {}
    aligns = []
    first: tuple[str, TensorSpec] | None = None
    adapter0: Adapter | None = None
    extents: list[tuple[str, _Memory]] = []  # the memory each array addresses
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
        sig, ptr = ad.probe(a)
        aligns.append(_aligned(name, o.name, sig[-1], spec.dtype))
        extents.append((o.name, _Memory.of(shape, strides, ptr, spec.dtype)))
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
            sig, ptr = ad.probe(a)
            aligns.append(_aligned(name, oname, sig[-1], got.dtype))
            _check_overlap(pattern, oname, _Memory.of(shape, strides, ptr, got.dtype), extents)
        else:
            aligns.append(32)  # fresh allocations from CuPy's and torch's pools are 256-byte aligned
        specs[oname] = want
    assert adapter0 is not None
    return specs, norm, aligns, adapter0


#: Byte alignment cuDNN's graph tensors are described with: a pointer off it fails at execute
#: (CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER), so it is refused here, before anything reaches cuDNN.
CUDNN_ALIGNMENT = 16


def _aligned(pattern: str, name: str, align: int, dtype: str) -> int:
    """``align`` (the pointer's alignment), or OperandError where it is below :data:`CUDNN_ALIGNMENT`."""
    if align < CUDNN_ALIGNMENT:
        per = CUDNN_ALIGNMENT // ITEMSIZE.get(dtype, 1)
        raise OperandError(pattern, name, f"its data pointer is {align}-byte aligned; cuDNN's graphs need {CUDNN_ALIGNMENT}-byte "
                           f"aligned arrays ({dtype}: a view must start at a multiple of {per} elements): pass a copy")
    return align


@dataclass(frozen=True)
class _Memory:
    """The memory an array addresses: [lo, hi) bytes, and its layout (to tell apart channel slices
    of one channels-last buffer, which interleave without sharing an element)."""

    lo: int
    hi: int
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @staticmethod
    def of(shape: Sequence[int], strides: Sequence[int], ptr: int, dtype: str) -> "_Memory":
        shape, strides, item = tuple(int(d) for d in shape), tuple(int(s) for s in strides), ITEMSIZE.get(dtype, 8)
        if any(d == 0 for d in shape):
            return _Memory(ptr, ptr, ptr, shape, strides, item)
        last = sum((d - 1) * abs(st) for d, st in zip(shape, strides))
        return _Memory(ptr, ptr + (last + 1) * item, ptr, shape, strides, item)

    def shares(self, o: "_Memory") -> bool:
        """Whether the two arrays may address a common byte. Two channel slices of one (N, C, H, W)
        channels-last buffer (the same pitch P = W-stride, channel stride 1, the same N, H, W) are
        disjoint when one's channels end before the other's begin within every pixel."""
        if not (self.lo < o.hi and o.lo < self.hi):
            return False
        a, b = (self, o) if self.ptr <= o.ptr else (o, self)
        pitch = a.pitch()
        if (pitch is None or pitch != b.pitch() or a.itemsize != b.itemsize or (a.shape[0], *a.shape[2:]) != (b.shape[0], *b.shape[2:])
                or (b.ptr - a.ptr) % a.itemsize):
            return True
        d = (b.ptr - a.ptr) // a.itemsize
        return not (a.shape[1] <= d and d + b.shape[1] <= pitch)

    def pitch(self) -> int | None:
        """Elements from one pixel's channels to the next's, for an (N, C, H, W) channels-last layout
        (channel stride 1, pixels ``pitch`` apart, rows and samples dense in pixels); else None."""
        if len(self.shape) != 4:
            return None
        n, c, h, w = self.shape
        sn, sc, sh, sw = self.strides
        p = sw if w > 1 else sh // w if h > 1 else sn // (h * w)
        if (c > 1 and sc != 1) or p < c or (w > 1 and sw != p) or (h > 1 and sh != w * p) or (n > 1 and sn != h * w * p):
            return None
        return p


def _check_overlap(pattern: Pattern, oname: str, mem: _Memory, seen: list[tuple[str, _Memory]]) -> None:
    """An ``out=`` array must not share memory with an operand or another output (the graph would read
    what it has already overwritten), unless the pattern declares the pair safe in place with the
    very same memory (``in_place`` in its file)."""
    for other, omem in seen:
        if mem.shares(omem):
            if pattern.in_place.get(oname) == other and (mem.lo, mem.hi) == (omem.lo, omem.hi):
                continue
            allowed = f" (the pattern allows out '{oname}' to be exactly '{pattern.in_place[oname]}')" if oname in pattern.in_place else ""
            raise OperandError(
                pattern.name, oname, f"out overlaps the memory of '{other}'; the result would be garbage: "
                f"pass a separate output array{allowed}"
            )
    seen.append((oname, mem))


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
    """The PlanKey of a checked call: pattern, specs, alignments, attributes, GPU and library versions,
    and whether the numerics policy lets it use TF32 (PlanKey.tf32)."""
    device = specs[pattern.operand_names[0]].device
    facts = current_runtime().device_facts(adapter, device)
    v = versions()
    return PlanKey(
        pattern=pattern.name,
        digest=pattern.digest,
        specs=tuple((n, specs[n]) for n in pattern.operand_names + tuple(pattern.outputs)),
        alignments=tuple(aligns),
        attrs=norm,
        compute_dtype=COMPUTE_DTYPE,
        gpu=facts.name,
        cc=facts.cc,
        cudnn_backend=v.cudnn_backend,
        frontend=v.frontend,
        tf32=tf32_allowed(pattern, specs),
    )
