"""Pattern files: one TOML file per fused layer, read into a :class:`Pattern`.

A pattern names its operands (kind and role), its attributes with defaults, an op list in cuDNN
frontend terms, its outputs and what backward needs. Two interpreters read the same object:
``fusekit.lower`` (a cuDNN graph) and ``fusekit.oracle`` (NumPy float64). Shape inference and the
shape checks that name a bad operand live here, once, for both.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..config import pattern_dirs_from_env
from .. import session
from ..errors import OperandError, PatternError, PatternWarning, warn_once
from .signatures import ACTIVATIONS, OPS, OpSig, ShapeContext, conv_out_size  # noqa: F401 - OPS, ACTIVATIONS, conv_out_size: importable from here too

Shape = tuple[int, ...]

#: Operand kinds: the logical rank every array of that kind is seen with (cuDNN's NCHW dim order).
KINDS = {
    "image": "4-D activation, logical dims (N, C, H, W); NCHW or NHWC (channels-last) memory",
    "filter": "4-D convolution filter, logical dims (K, C, R, S); KCRS or KRSC memory",
    "channel": "per-channel vector of length C, given as (C,) or (1, C, 1, 1)",
    "matrix": "2-D row-major matrix (M, N), seen by cuDNN as (1, M, N)",
    "matrix_t": "2-D row-major matrix (M, N) used transposed, seen by cuDNN as (1, N, M)",
    "batch_matrix": "3-D row-major batch of matrices (B, M, N), seen by cuDNN as is",
    "row": "vector of length N broadcast over the rows of a matrix, seen by cuDNN as (1, 1, N)",
    "tensor": "any operand of an elementwise op: 4-D as an image, 2-D as a matrix, 1-D as a row",
}
ROLES = ("input", "weight", "bias", "param", "state")

#: The largest dim (of an operand, output or intermediate) and the largest integer attribute value
#: (padding, stride, ...) fusekit accepts: 2^31 - 1, the int32 range of cuDNN's tensor and convolution
#: descriptors. Anything larger is a typo, not a layer.
MAX_DIM = 2**31 - 1
#: A tensor must have fewer elements than this: cuDNN's sizes and strides are int64.
MAX_ELEMENTS = 2**63


def check_size(pattern: str, name: str, shape: Sequence[int], what: str = "operand") -> None:
    """OperandError naming ``name`` unless every dim of ``shape`` is at most :data:`MAX_DIM` and the
    element count is below :data:`MAX_ELEMENTS`."""
    big = [int(d) for d in shape if int(d) > MAX_DIM]
    if big:
        raise OperandError(
            pattern, name, f"dim {big[0]} is larger than {MAX_DIM} (2^31 - 1), the largest dim fusekit passes to cuDNN",
            what=what,
        )
    count = 1
    for d in shape:
        count *= int(d)
    if count >= MAX_ELEMENTS:
        raise OperandError(
            pattern, name, f"{count} elements (2^{count.bit_length() - 1} or more) are too many: "
            "a cuDNN tensor has fewer than 2^63 (its sizes and strides are int64)", what=what,
        )


# ----------------------------------------------------------------------------------------------
# The pattern object
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Operand:
    name: str
    kind: str
    role: str
    dtype: str | None = None  # fixed dtype (e.g. float32 statistics); None: the pattern's I/O dtype


def _index(v: Any) -> int:
    """An integer attribute value (ints and NumPy integers; not bools, not floats)."""
    if isinstance(v, bool):
        raise TypeError
    return operator.index(v)


@dataclass(frozen=True)
class AttrSpec:
    name: str
    default: Any
    min: float | None = None

    def normalize(self, pattern: str, value: Any) -> Any:
        """Coerce a user value to the default's form (an int broadcasts to a tuple); check bounds."""
        d = self.default
        try:
            if isinstance(d, tuple):
                if isinstance(value, (str, bytes)):
                    raise TypeError
                out = (_index(value),) * len(d) if not hasattr(value, "__iter__") else tuple(_index(v) for v in value)
                if len(out) != len(d):
                    raise ValueError
            elif isinstance(d, bool):
                out = bool(value)
            elif isinstance(d, int):
                out = _index(value)
            elif isinstance(d, float):
                out = float(value)
            elif isinstance(d, str):
                if not isinstance(value, str):
                    raise TypeError
                out = value
            else:
                out = value
        except (TypeError, ValueError):
            form = f"an int or a sequence of {len(d)} ints" if isinstance(d, tuple) else type(d).__name__
            raise OperandError(pattern, self.name, f"expected {form}, got {value!r}", what="attribute") from None
        if isinstance(out, float) and (math.isnan(out) or (math.isinf(out) and out != d)):
            raise OperandError(pattern, self.name, f"expected a finite number{' (or inf)' if d == math.inf else ''}, got {value!r}",
                               what="attribute")
        if self.min is not None:
            vals = out if isinstance(out, tuple) else (out,)
            if any(v < self.min for v in vals):
                raise OperandError(pattern, self.name, f"expected values >= {self.min}, got {value!r}", what="attribute")
        ints = [v for v in (out if isinstance(out, tuple) else (out,)) if isinstance(v, int) and not isinstance(v, bool)]
        if any(abs(v) > MAX_DIM for v in ints):
            raise OperandError(
                pattern, self.name, f"expected values of at most {MAX_DIM} (2^31 - 1, the int32 range of cuDNN's "
                f"convolution parameters), got {value!r}", what="attribute",
            )
        return out


@dataclass(frozen=True)
class Op:
    op: str
    inputs: Mapping[str, str]
    attrs: Mapping[str, Any]  # op attribute -> pattern attribute name (str) or literal value
    out: str  # the (first) value it produces
    outs: tuple[str, ...] = ()  # every value it produces, in the op's output order

    @property
    def produces(self) -> tuple[str, ...]:
        return self.outs or (self.out,)


@dataclass(frozen=True)
class Pattern:
    name: str
    summary: str
    operands: tuple[Operand, ...]
    attrs: tuple[AttrSpec, ...]
    ops: tuple[Op, ...]
    outputs: Mapping[str, str]  # output name -> operand whose dtype, layout and array type it takes
    output_kinds: Mapping[str, str] = field(default_factory=dict)  # output name -> kind (shape users see)
    output_dtypes: Mapping[str, str] = field(default_factory=dict)  # output name -> fixed dtype, if any
    saved: tuple[str, ...] = ()
    backward: tuple[str, ...] = ()
    not_capturable: str = ""  # why calls must not be captured in a CUDA graph ("" when they may)
    memory_only: str = ""  # why plans must not be stored on disk and loaded back ("" when they may)
    in_place: Mapping[str, str] = field(default_factory=dict)  # output -> operand it may be exactly (out=)
    source: str = "<memory>"
    digest: str = ""
    text: str = field(default="", repr=False, compare=False)

    @property
    def operand_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.operands)

    @property
    def epilogue_operands(self) -> tuple[str, ...]:
        """Input operands only the pointwise epilogue of a convolution or matmul reads (a residual,
        a ReLU mask): cuDNN's Hopper kernels may read these before waiting for the kernel queued
        just before them (dispatch fences that case)."""
        main = {"conv_fprop", "conv_dgrad", "conv_wgrad", "matmul"}
        if not any(op.op in main for op in self.ops):
            return ()
        fed_main = {v for op in self.ops if op.op in main for v in op.inputs.values()}
        fed_other = {v for op in self.ops if op.op not in main for v in op.inputs.values()}
        return tuple(o.name for o in self.operands if o.role == "input" and o.name in fed_other and o.name not in fed_main)

    def operand(self, name: str) -> Operand:
        for o in self.operands:
            if o.name == name:
                return o
        raise KeyError(name)

    def normalize_attrs(self, given: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
        """Pattern attributes with defaults filled in, in file order, as a hashable tuple."""
        known = {a.name for a in self.attrs}
        for k in given:
            if k not in known:
                raise OperandError(self.name, k, f"unknown attribute; this pattern takes {sorted(known) or 'none'}", what="attribute")
        return tuple((a.name, a.normalize(self.name, given.get(a.name, a.default))) for a in self.attrs)

    def infer_shapes(self, shapes: Mapping[str, Shape], attrs: Mapping[str, Any]) -> dict[str, Shape]:
        """Shapes of every value (operands, intermediates, outputs); raises OperandError naming the culprit."""
        env: dict[str, Shape] = dict(shapes)
        for name, shape in shapes.items():
            check_size(self.name, name, shape)
        for op in self.ops:
            sig = OPS[op.op]
            op_attrs = self.op_attrs(op, attrs)
            ctx = ShapeContext(self.name, {p: env[n] for p, n in op.inputs.items()}, dict(op.inputs), op_attrs)
            res = sig.infer(ctx) if sig.infer else ctx.shapes[sig.ports[0]]
            made = dict(zip(op.produces, res)) if len(op.produces) > 1 else {op.out: res}
            for name, shape in made.items():
                check_size(self.name, name, shape, "output" if name in self.outputs else "intermediate value")
            env.update(made)
        return env

    @staticmethod
    def op_attrs(op: Op, attrs: Mapping[str, Any]) -> dict[str, Any]:
        return {k: (attrs[v] if isinstance(v, str) else v) for k, v in op.attrs.items()}


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------
_TOP_KEYS = {"name", "summary", "operands", "attrs", "ops", "outputs", "saved", "backward", "not_capturable", "memory_only", "in_place"}


def _freeze(v: Any) -> Any:
    return tuple(_freeze(x) for x in v) if isinstance(v, list) else v


def _need(source: str) -> Callable[[bool, str], None]:
    """A check that raises PatternError(source, message) when its condition is false."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise PatternError(source, msg)

    return need


def _parse_operands(raw_ops: Any, need: Callable[[bool, str], None]) -> list[Operand]:
    need(isinstance(raw_ops, dict) and raw_ops, "'operands' must be a non-empty table")
    operands = []
    for oname, spec in raw_ops.items():
        need(isinstance(spec, dict), f"operand '{oname}' must be a table with 'kind' and 'role'")
        kind, role = spec.get("kind"), spec.get("role", "input")
        need(isinstance(kind, str) and isinstance(role, str), f"operand '{oname}': 'kind' and 'role' must be strings")
        need(kind in KINDS, f"operand '{oname}' has unknown kind {kind!r}; known: {sorted(KINDS)}")
        need(role in ROLES, f"operand '{oname}' has unknown role {role!r}; known: {list(ROLES)}")
        dtype = spec.get("dtype")
        need(dtype in (None, "float32"), f"operand '{oname}': dtype may only be fixed to \"float32\"")
        operands.append(Operand(oname, kind, role, dtype))
    return operands


def _parse_attrs(raw: Any, need: Callable[[bool, str], None], source: str) -> list[AttrSpec]:
    need(isinstance(raw, dict), "'attrs' must be a table name = default or name = { default = ..., min = ... }")
    attrs = []
    for aname, spec in raw.items():
        spec = spec if isinstance(spec, dict) else {"default": spec}
        need("default" in spec, f"attribute '{aname}' needs a default")
        need(not set(spec) - {"default", "min"}, f"attribute '{aname}': unknown key(s) {sorted(set(spec) - {'default', 'min'})}; "
             "allowed: default, min")
        d, lo = spec["default"], spec.get("min")
        scalar = (bool, int, float, str)
        need(isinstance(d, scalar) or (isinstance(d, list) and d and all(isinstance(v, int) and not isinstance(v, bool) for v in d)),
             f"attribute '{aname}': default {d!r} must be a bool, int, float, string or a non-empty list of ints")
        need(not (isinstance(d, float) and math.isnan(d)), f"attribute '{aname}': default is NaN")
        need(lo is None or (isinstance(lo, (int, float)) and not isinstance(lo, bool) and math.isfinite(lo)),
             f"attribute '{aname}': min {lo!r} must be a finite number")
        need(lo is None or not isinstance(d, (str, bool)), f"attribute '{aname}': a {type(d).__name__} default ({d!r}) takes no min")
        spec_ = AttrSpec(aname, _freeze(d), lo)
        try:
            spec_.normalize(source, spec_.default)
        except OperandError as e:
            raise PatternError(source, f"attribute '{aname}': its default does not pass its own checks ({e})") from None
        attrs.append(spec_)
    return attrs


def _parse_op(i: int, spec: Any, need: Callable[[bool, str], None], defined: set[str], attr_names: set[str]) -> Op:
    """ops[i]; the names it produces join ``defined``."""
    need(isinstance(spec, dict), f"ops[{i}] must be a table with 'op', 'in' and 'out'")
    opname = spec.get("op")
    need(isinstance(opname, str) and opname in OPS, f"ops[{i}]: unknown op {opname!r}; known: {sorted(OPS)}")
    sig = OPS[opname]
    inputs = spec.get("in") or {}
    need(isinstance(inputs, dict), f"ops[{i}] ({opname}): 'in' must be a table port = value")
    need(set(inputs) == set(sig.ports), f"ops[{i}] ({opname}): ports must be {list(sig.ports)}, got {sorted(inputs)}")
    for port, value in inputs.items():
        need(isinstance(value, str) and value in defined, f"ops[{i}] ({opname}): port '{port}' reads undefined operand {value!r}")
    op_attrs = spec.get("attrs") or {}
    if isinstance(op_attrs, list) and all(isinstance(a, str) for a in op_attrs):
        op_attrs = {a: a for a in op_attrs}
    need(isinstance(op_attrs, dict), f"ops[{i}] ({opname}): 'attrs' must be a list of names or a table op_attr = pattern_attr")
    for k, v in op_attrs.items():
        need(k in sig.attrs, f"ops[{i}] ({opname}): unknown op attribute {k!r}; known: {list(sig.attrs)}")
        need(not isinstance(v, str) or v in attr_names, f"ops[{i}] ({opname}): attribute {k!r} refers to undeclared pattern attribute {v!r}")
    op_attrs = {**dict(sig.defaults), **op_attrs}
    missing = set(sig.attrs) - set(op_attrs)
    need(not missing, f"ops[{i}] ({opname}): attribute(s) {sorted(missing)} not given")
    out = spec.get("out")
    outs = out if isinstance(out, list) else [out]
    need(
        len(outs) == len(sig.outputs) and all(isinstance(o, str) and o.isidentifier() for o in outs),
        f"ops[{i}] ({opname}): 'out' must name the {len(sig.outputs)} value(s) it produces {list(sig.outputs)}",
    )
    for o in outs:
        need(o not in defined, f"ops[{i}] ({opname}): 'out' {o!r} is already defined")
        defined.add(o)
    return Op(opname, dict(inputs), {k: _freeze(v) for k, v in op_attrs.items()}, outs[0], tuple(outs) if len(outs) > 1 else ())


def _parse_outputs(outputs: Any, need: Callable[[bool, str], None], ops: list[Op], raw_ops: dict) -> tuple[dict, dict, dict]:
    """(output -> the operand it is like, output -> kind, output -> fixed dtype)."""
    need(isinstance(outputs, dict) and bool(outputs), "'outputs' must be a non-empty table: name = { like = OPERAND }")
    produced = {o for op in ops for o in op.produces}
    out_map, out_kinds, out_dtypes = {}, {}, {}
    for oname, spec in outputs.items():
        need(oname in produced, f"output '{oname}' is not produced by any op")
        like = spec.get("like") if isinstance(spec, dict) else None
        need(isinstance(like, str) and like in raw_ops, f"output '{oname}' needs like = one of the operands {list(raw_ops)}, got {like!r}")
        out_map[oname] = like
        kind = spec.get("kind", {"matrix_t": "matrix"}.get(raw_ops[like]["kind"], raw_ops[like]["kind"]))
        need(kind in KINDS and kind != "matrix_t", f"output '{oname}' has unknown kind {kind!r}")
        out_kinds[oname] = kind
        odt = spec.get("dtype")
        need(odt in (None, "float32"), f"output '{oname}': dtype may only be fixed to \"float32\"")
        if odt:
            out_dtypes[oname] = odt
    return out_map, out_kinds, out_dtypes


def parse_pattern(text: str, source: str = "<memory>") -> Pattern:
    """Parse and check one pattern file's text."""
    if not isinstance(text, str):
        raise PatternError(source, f"expected the file's text (str), got {type(text).__name__}; decode bytes as UTF-8 first")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PatternError(source, f"not valid TOML: {e}") from None
    need = _need(source)
    unknown = set(doc) - _TOP_KEYS
    need(not unknown, f"unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    name = doc.get("name")
    need(isinstance(name, str) and name.isidentifier(), f"'name' must be an identifier string, got {name!r}")
    source = source if source != "<memory>" else name
    need = _need(source)
    raw_ops = doc.get("operands")
    operands = _parse_operands(raw_ops, need)
    attrs = _parse_attrs(doc.get("attrs", {}) if doc.get("attrs") is not None else {}, need, source)
    defined, attr_names = {o.name for o in operands}, {a.name for a in attrs}
    raw_list = doc.get("ops")
    need(isinstance(raw_list, list) and raw_list, "'ops' must be a non-empty array of tables ([[ops]])")
    ops = [_parse_op(i, spec, need, defined, attr_names) for i, spec in enumerate(raw_list)]
    out_map, out_kinds, out_dtypes = _parse_outputs(doc.get("outputs"), need, ops, raw_ops)
    saved = doc.get("saved", [])
    need(isinstance(saved, list) and all(isinstance(x, str) for x in saved), "'saved' must be a list of value names")
    saved = tuple(saved)
    for s in saved:
        need(s in defined, f"saved value {s!r} is not an operand or op output")
    backward = doc.get("backward", [])
    need(isinstance(backward, list) and all(isinstance(x, str) and x.isidentifier() for x in backward),
         f"'backward' must be a list of pattern names (identifiers), got {backward!r}")
    in_place = doc.get("in_place", {})
    need(
        isinstance(in_place, dict) and all(k in out_map and v in {o.name for o in operands} for k, v in in_place.items()),
        "'in_place' must map outputs to the operands they may overwrite exactly, e.g. in_place = { y = \"x\" }",
    )
    not_capturable = doc.get("not_capturable", "")
    need(isinstance(not_capturable, str), "'not_capturable' must be a string saying why the pattern cannot be captured")
    memory_only = doc.get("memory_only", "")
    need(isinstance(memory_only, str), "'memory_only' must be a string saying why the pattern's plans are not stored on disk")
    # Order matters (operands and attributes are positional), so the digest keeps file order.
    canon = json.dumps(doc, separators=(",", ":"))
    return Pattern(
        name=name, summary=str(doc.get("summary", "")), operands=tuple(operands), attrs=tuple(attrs), ops=tuple(ops), outputs=out_map,
        output_kinds=out_kinds, output_dtypes=out_dtypes, saved=saved, backward=tuple(backward), not_capturable=not_capturable,
        memory_only=memory_only, in_place=dict(in_place), source=source, digest=hashlib.sha256(canon.encode()).hexdigest()[:16], text=text,
    )


def load_pattern(path: str | os.PathLike[str]) -> Pattern:
    """Read and check one pattern file (UTF-8 TOML named after its pattern); PatternError naming the file."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise PatternError(str(p), f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); pattern files must be UTF-8 TOML") from None
    except OSError as e:
        raise PatternError(str(p), f"cannot be read: {e.strerror or e}") from None
    pat = parse_pattern(text, str(p))
    if pat.name != p.stem:
        raise PatternError(str(p), f"name {pat.name!r} must match the file name {p.stem!r}")
    return pat


def pattern_dirs() -> list[Path]:
    """Where patterns are looked up: $FUSEKIT_PATTERNS (os.pathsep-separated), then the shipped set."""
    dirs = pattern_dirs_from_env()
    for d in dirs:
        if not d.is_dir():
            why = "is not a directory" if d.exists() else "does not exist"
            warn_once((str(d),), f"FUSEKIT_PATTERNS: pattern directory {d} {why}; no patterns are read from it", PatternWarning)
    root = Path(__file__).resolve().parents[2]  # the repository (editable install)
    for cand in (root / "patterns", Path(sys.prefix) / "share" / "fusekit" / "patterns"):
        if cand.is_dir():
            dirs.append(cand)
            break
    return dirs


def _registry() -> dict[str, Pattern]:
    """The session's patterns by name: loaded from their files on first use, or registered."""
    return session.current().table("patterns")


def get_pattern(name: str) -> Pattern:
    """The pattern called ``name`` (loaded once per session)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise PatternError(str(name), "a pattern is named by an identifier (its file's name without .toml, in a pattern directory)")
    registry = _registry()
    pat = registry.get(name)
    if pat is None:
        for d in pattern_dirs():
            f = d / f"{name}.toml"
            if f.is_file():
                pat = registry[name] = load_pattern(f)
                break
        else:
            raise PatternError(name, f"no file {name}.toml in {[str(d) for d in pattern_dirs()]}; known: {list_patterns()}")
    return pat


def _pattern_names() -> list[str]:
    """Names of every pattern file found (identifiers only), loadable or not."""
    names: set[str] = set()
    for d in pattern_dirs():
        names.update(f.stem for f in d.glob("*.toml") if f.stem.isidentifier())
    return sorted(names)


def list_patterns() -> list[str]:
    """Names of the patterns that load (a broken file is left out; :func:`scan_patterns` says why)."""
    return [p.name for p in scan_patterns()[0]]


def scan_patterns() -> tuple[list[Pattern], list[PatternError]]:
    """(every pattern that loads, by name; the PatternError of each one that does not), for listings
    that go on past a broken file."""
    good, bad = [], []
    for name in _pattern_names():
        try:
            good.append(get_pattern(name))
        except PatternError as e:
            bad.append(e)
    return good, bad


def register(pattern: Pattern) -> Pattern:
    """Make an in-memory pattern (from :func:`parse_pattern`) callable by name (in this session)."""
    _registry()[pattern.name] = pattern
    return pattern


__all__: Sequence[str] = [
    "KINDS", "OPS", "OpSig", "Operand", "AttrSpec", "Op", "Pattern",
    "parse_pattern", "load_pattern", "get_pattern", "list_patterns", "pattern_dirs", "register",
    "scan_patterns", "check_size", "MAX_DIM", "MAX_ELEMENTS", "PatternWarning", "conv_out_size",
]
