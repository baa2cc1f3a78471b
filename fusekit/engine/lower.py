"""The one lowering of patterns: Pattern + operand specs + attributes -> ``cudnn.pygraph``.

Building a graph (validate, heuristics, plan) needs the GPU; lowering does not, so graph structure
is testable on any machine through ``graph.inspect()``.
"""

from __future__ import annotations

import ctypes
import importlib
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .. import config, session
from ..errors import NoGPUError, UnsupportedError
from .patterns import OPS, Pattern
from ..tensors import LAYOUT_STRIDES, TensorSpec


def load_cudnn() -> Any:
    """The cuDNN frontend module (``import cudnn``), or NoGPUError saying how to install it."""
    try:
        import cudnn
    except Exception as e:  # ImportError, or a broken install failing at import
        raise NoGPUError(f"the cuDNN frontend (nvidia-cudnn-frontend) cannot be imported: {e}") from None
    return cudnn


#: Frontend modules imported lazily while planning whose first import races between threads: the
#: GEMM engine's facades replace themselves in sys.modules, and eight threads planning at once got
#: "cannot import name '_graph_dynamic_shapes' from 'cudnn.gemm.frost.compiler'" on the H200.
LAZY_FRONTEND_MODULES = ("cudnn.gemm.frost.compiler", "cudnn.gemm.frost.epilogue_codegen", "cudnn.gemm.frost.heuristics",
                         "cudnn.gemm.frost.graph_analyzer")
_PRELOAD_LOCK = threading.Lock()
_preloaded = False


def preload_frontend() -> None:
    """Import LAZY_FRONTEND_MODULES once, in one thread (before the first cuDNN handle is made, so
    with the GPU current). A module this frontend lacks or cannot load here is skipped."""
    global _preloaded
    if _preloaded:
        return
    with _PRELOAD_LOCK:
        if not _preloaded:
            for name in LAZY_FRONTEND_MODULES:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - absent in this version or not for this GPU: nothing to race on
                    pass
            _preloaded = True


def cudnn_dtype(name: str) -> Any:
    dt = load_cudnn().data_type
    return {"float16": dt.HALF, "bfloat16": dt.BFLOAT16, "float32": dt.FLOAT}[name]


COMPUTE_DTYPE = "float32"

def _conv_kw(a: Mapping[str, Any]) -> dict:
    kw = dict(stride=list(a["stride"]), dilation=list(a["dilation"]))
    extra = a.get("extra_padding", (0, 0))
    if any(extra):  # cuDNN's separate padding before and after each spatial dim
        return kw | dict(pre_padding=list(a["padding"]), post_padding=[p + e for p, e in zip(a["padding"], extra)])
    return kw | dict(padding=list(a["padding"]))


def _relu(g: Any, x: Any, upper_clip: float, name: str) -> Any:
    """max(x, 0), clipped above at ``upper_clip`` when finite (ReLU6: 6)."""
    return g.relu(x, upper_clip=float(upper_clip), name=name) if math.isfinite(upper_clip) else g.relu(x, name=name)


def _relu_backward(g: Any, dy: Any, y: Any, upper_clip: float, name: str) -> Any:
    """dy where 0 < y < ``upper_clip`` (PyTorch's ReLU6 backward, strict at both ends), else 0."""
    if math.isfinite(upper_clip):
        return g.relu_backward(dy, y, upper_clip=float(upper_clip), name=name)
    return g.relu_backward(dy, y, name=name)


def _act(g: Any, x: Any, act: str, alpha: float, rank: int, n: str) -> Any:
    """``act`` (patterns.ACTIVATIONS) of x: one cuDNN pointwise mode where cuDNN has one, else a
    short chain of pointwise ops with scalar constants (hardswish, hardsigmoid, ELU with alpha != 1)."""
    def c(v: float, tag: str) -> Any:
        t = g.tensor_scalar(float(v), load_cudnn().scalar_type.RUNTIME_PARAM, name=f"{n}_{tag}")
        return t.set_dim([1] * rank).set_stride([1] * rank)

    if act == "identity":
        return g.identity(x, name=n)
    if act == "relu":
        return g.relu(x, name=n)
    if act == "clip":
        return g.relu(x, upper_clip=float(alpha), name=n)
    if act == "silu":
        return g.swish(x, name=n)
    if act == "gelu":
        return g.gelu(x, name=n)
    if act == "gelu_tanh":
        return g.gelu_approx_tanh(x, name=n)
    if act in ("sigmoid", "tanh"):
        return getattr(g, act)(x, name=n)
    if act == "leaky_relu":
        return g.leaky_relu(x, float(alpha), name=n)
    if act == "elu" and float(alpha) == 1.0:
        return g.elu(x, name=n)
    if act == "elu":  # relu(x) + alpha * (exp(min(x, 0)) - 1)
        e = g.exp(g.min(x, c(0.0, "zero"), name=f"{n}_neg"), name=f"{n}_exp")
        tail = g.mul(g.sub(e, c(1.0, "one"), name=f"{n}_em1"), c(alpha, "alpha"), name=f"{n}_scaled")
        return g.add(g.relu(x, name=f"{n}_pos"), tail, name=n)
    if act == "hardsigmoid":  # min(max(x / 6 + 1/2, 0), 1)
        t = g.add(g.mul(x, c(1.0 / 6.0, "sixth"), name=f"{n}_scaled"), c(0.5, "half"), name=f"{n}_shifted")
        return g.relu(t, upper_clip=1.0, name=n)
    if act == "hardswish":  # x * min(max(x + 3, 0), 6) / 6
        t = g.relu(g.add(x, c(3.0, "three"), name=f"{n}_shifted"), upper_clip=6.0, name=f"{n}_gate")
        return g.mul(x, g.mul(t, c(1.0 / 6.0, "sixth"), name=f"{n}_gate6"), name=n)
    raise UnsupportedError(f"activation {act!r} has no cuDNN lowering")


def _first(res: Any, k: int) -> tuple:
    """The first k real outputs of a node (optional outputs it did not make are dropped)."""
    return tuple(t for t in res if t is not None)[:k]


def _training() -> Any:
    return load_cudnn().norm_forward_phase.TRAINING


def _reduce_add(g: Any, x: Any, name: str) -> Any:
    return g.reduction(x, mode=load_cudnn().reduction_mode.ADD, name=name)


# op name -> (graph, {port: tensor}, {attr: value}, node name) -> tensor
LOWER: dict[str, Callable[[Any, Mapping[str, Any], Mapping[str, Any], str], Any]] = {
    "conv_fprop": lambda g, i, a, n: g.conv_fprop(i["image"], i["weight"], **_conv_kw(a), name=n),
    "conv_dgrad": lambda g, i, a, n: g.conv_dgrad(i["loss"], i["filter"], **_conv_kw(a), name=n),
    "conv_wgrad": lambda g, i, a, n: g.conv_wgrad(i["image"], i["loss"], **_conv_kw(a), name=n),
    "matmul": lambda g, i, a, n: g.matmul(i["a"], i["b"], name=n),
    "bias": lambda g, i, a, n: g.bias(i["input"], i["bias"], name=n),
    "relu": lambda g, i, a, n: _relu(g, i["input"], a["upper_clip"], n),
    "act": lambda g, i, a, n: _act(g, i["input"], a["activation"], a["alpha"], a["_rank"], n),
    "relu_backward": lambda g, i, a, n: _relu_backward(g, i["loss"], i["input"], a["upper_clip"], n),
    "channel_sum": lambda g, i, a, n: _reduce_add(g, i["input"], n),
    "batchnorm": lambda g, i, a, n: g.batchnorm(
        i["input"], i["scale"], i["bias"], in_running_mean=i["in_running_mean"], in_running_var=i["in_running_var"],
        epsilon=a["epsilon"], momentum=a["momentum"], name=n,
    ),
    "batchnorm_backward": lambda g, i, a, n: g.batchnorm_backward(i["loss"], i["input"], i["scale"], i["mean"], i["inv_variance"], name=n),
    "genstats": lambda g, i, a, n: g.genstats(i["input"], name=n),
    "layernorm": lambda g, i, a, n: _first(g.layernorm(i["input"], i["scale"], i["bias"], a["epsilon"], norm_forward_phase=_training(), name=n), 3),
    "layernorm_backward": lambda g, i, a, n: g.layernorm_backward(i["loss"], i["input"], i["scale"], i["mean"], i["inv_variance"], name=n),
    "instancenorm": lambda g, i, a, n: _first(g.instancenorm(i["input"], i["scale"], i["bias"], a["epsilon"], norm_forward_phase=_training(), name=n), 3),
    "instancenorm_backward": lambda g, i, a, n: g.instancenorm_backward(i["loss"], i["input"], i["scale"], i["mean"], i["inv_variance"], name=n),
    "add": lambda g, i, a, n: g.add(i["a"], i["b"], name=n),
    "mul": lambda g, i, a, n: g.mul(i["a"], i["b"], name=n),
    "sub": lambda g, i, a, n: g.sub(i["a"], i["b"], name=n),
}
assert set(LOWER) == set(OPS), "every op needs a lowering"


@dataclass
class Lowered:
    """A lowered pattern: the graph and the uid of each operand and output, in call order."""

    graph: Any
    names: tuple[str, ...]  # operands then outputs
    uids: tuple[int, ...]


def lower(
    pattern: Pattern,
    specs: Mapping[str, TensorSpec],
    attrs: Mapping[str, Any],
    handle: Any = None,
) -> Lowered:
    """Lower ``pattern`` for operand and output ``specs`` (output specs included) into a pygraph."""
    cudnn = load_cudnn()
    io = specs[pattern.operands[0].name].dtype
    kw = {"handle": handle} if handle is not None else {}
    g = cudnn.pygraph(
        io_data_type=cudnn_dtype(io),
        intermediate_data_type=cudnn_dtype(COMPUTE_DTYPE),
        compute_data_type=cudnn_dtype(COMPUTE_DTYPE),
        name=pattern.name,
        **kw,
    )
    env: dict[str, Any] = {}
    for o in pattern.operands:
        s = specs[o.name]
        env[o.name] = g.tensor(name=o.name, dim=list(s.shape), stride=list(s.strides), data_type=cudnn_dtype(s.dtype))
    shapes = None  # inferred only for virtual tensors cuDNN cannot size
    nhwc = any(specs[o.name].layout == "NHWC" for o in pattern.operands)
    for op in pattern.ops:
        sig = OPS[op.op]
        op_attrs = pattern.op_attrs(op, attrs)
        op_attrs["_rank"] = len(specs[pattern.operands[0].name].shape)  # cuDNN's rank of the pattern's I/O
        for sc in sig.scalars:  # pass-by-value float32 scalars; the graph holds their values and binds them
            # (RUNTIME_PARAM: COMPILE_TIME_CONST needs cuDNN >= 9.22)
            op_attrs[sc] = g.tensor_scalar(float(op_attrs[sc]), cudnn.scalar_type.RUNTIME_PARAM, name=f"{op.out}_{sc}")
        res = LOWER[op.op](g, {p: env[v] for p, v in op.inputs.items()}, op_attrs, op.out)
        results = tuple(res) if len(op.produces) > 1 else (res,)
        for name, t in zip(op.produces, results):
            if sig.explicit_dims and name not in pattern.outputs:  # a virtual tensor cuDNN cannot size
                if shapes is None:
                    shapes = pattern.infer_shapes({o.name: specs[o.name].shape for o in pattern.operands}, attrs)
                shape = shapes[name]
                layout = ("NHWC" if nhwc else "NCHW") if len(shape) == 4 else "ROW"
                t.set_dim(list(shape)).set_stride(list(LAYOUT_STRIDES[layout](shape)))
            env[name] = t
    for name in pattern.outputs:
        s = specs[name]
        t = env[name]
        t.set_output(True).set_name(name).set_data_type(cudnn_dtype(s.dtype)).set_dim(list(s.shape)).set_stride(list(s.strides))
    names = pattern.operand_names + tuple(pattern.outputs)
    return Lowered(g, names, tuple(env[n].uid for n in names))


@dataclass
class Built:
    graph: Any
    uids: tuple[int, ...]
    workspace_size: int
    engine: str  # the selected plan's name
    candidates: int  # plans the heuristics offered
    build_ms: float
    engine_id: int | None = None
    knobs: dict | None = None


#: Numerical notes of TF32 plans: TF32 tensor cores round float32 inputs to 10 mantissa bits. Plans
#: with them are kept out of a float32 key whose numerics policy forbids TF32 (as PyTorch filters
#: its cuDNN engine configs when TF32 is off).
FP32_EXCLUDED_NOTES = ("TENSOR_CORE", "DOWN_CONVERT_INPUTS")
#: Plans that convert float32 inputs to a 16-bit type (about 1e-2 relative error in a gradient, seen
#: on the H200 for a 3-channel wgrad) are kept out of every float32 key, TF32 allowed or not, as
#: PyTorch and MLX filter them.
FP32_NEVER_NOTES = ("DOWN_CONVERT_INPUTS",)
#: The ops with TF32 engines for float32 graphs, and the numerics policy's family of each.
TF32_FAMILY = {"conv_fprop": "conv", "conv_dgrad": "conv", "conv_wgrad": "conv", "matmul": "matmul"}
#: Appended to the name of a plan taken with TF32 because its float32 key, whose policy forbids TF32,
#: had no IEEE plan. The name is recorded with the plan (disk store, ``fusekit cache``), so a plan
#: loaded in another process says so too; dispatch warns once per key (NumericsWarning).
TF32_FALLBACK = " [TF32: no IEEE float32 plan]"


def tf32_families(pattern: Pattern, specs: Mapping[str, TensorSpec]) -> frozenset[str]:
    """The op families (config.TF32_FAMILIES) of this call that have TF32 engines: those of its
    convolutions and matmuls when its I/O (the first operand) is float32; empty otherwise."""
    if specs[pattern.operands[0].name].dtype != "float32":
        return frozenset()
    return frozenset(TF32_FAMILY[op.op] for op in pattern.ops if op.op in TF32_FAMILY)


def tf32_allowed(pattern: Pattern, specs: Mapping[str, TensorSpec], policy: config.Tf32Policy | None = None) -> bool:
    """Whether this call's plans may use TF32: it has TF32 families and ``policy`` (default: the one in
    force, config.allow_tf32()) allows every one of them. The plan key records the answer (PlanKey.tf32)."""
    fams = tf32_families(pattern, specs)
    if not fams:
        return False
    policy = policy or config.allow_tf32()
    return all(policy.allows(f) for f in fams)


def precision_notes(pattern: Pattern, specs: Mapping[str, TensorSpec], tf32: bool = False) -> tuple[str, ...]:
    """The numerical notes build_plans excludes for this call: for float32 convolutions and matmuls
    (tf32_families), FP32_EXCLUDED_NOTES, or FP32_NEVER_NOTES when ``tf32``; none otherwise."""
    if not tf32_families(pattern, specs):
        return ()
    return FP32_NEVER_NOTES if tf32 else FP32_EXCLUDED_NOTES


def untrusted(pattern: Pattern, specs: Mapping[str, TensorSpec]) -> str:
    """Why cuDNN's plans for this call must not be used although it builds them ("" when none is
    known): defects seen on the GPU, each kept as a test. The call then runs as cuDNN refused it
    (channels-last copies, dispatch.alternatives).

    - A convolution whose epilogue adds a second image (conv_bias_add, conv_bias_add_relu) on NCHW x:
      cuDNN 9.19 on the H200 builds it when the output is 1x1 (x 2x2x1x2, stride (1, 2)) and its engine
      returns garbage (relative error 0.5-2.5, negative values after the ReLU; float16 and float32;
      every candidate the autotuner tried wrote non-finite values). The larger NCHW outputs seen it
      refused; channels-last x is right. Applied to every cuDNN version: fusekit cannot tell when it is fixed,
      and copies only cost time (tests/regressions.py, conv_forward)."""
    convs = [op for op in pattern.ops if op.op == "conv_fprop"]
    if convs and pattern.epilogue_operands and specs[convs[0].inputs["image"]].layout == "NCHW":
        return (
            "cuDNN's fused convolution + residual-add engines compute wrongly on NCHW input (seen with cuDNN 9.19 "
            "on the H200): not trusted"
        )
    return ""


def is_tf32_fallback(graph: Any) -> bool:
    """Whether ``graph`` was built by build_plans with TF32 plans because its key had no IEEE plan."""
    try:
        return graph in session.current().tf32_fallback_graphs
    except TypeError:  # not weakly referenceable: not one of ours
        return False


def build_plans(
    pattern: Pattern,
    specs: Mapping[str, TensorSpec],
    attrs: Mapping[str, Any],
    handle: Any,
    heuristics: Sequence[str],
    *,
    where: str = "",
    deterministic: bool = False,
    workspace_limit: int | None = None,
    every_plan: bool = False,
    tf32: bool | None = None,
) -> Lowered:
    """The one build sequence: lower, validate, query ``heuristics`` in order, filter (TF32 plans of
    a float32 convolution/matmul unless ``tf32``, its 16-bit-input plans always; NONDETERMINISTIC with ``deterministic``;
    workspaces over ``workspace_limit``), check support, and build the first plan that builds
    (``every_plan``: all of them, for the autotuner). Raises UnsupportedError when cuDNN offers
    nothing for the key.

    ``tf32``: whether the key allows TF32 (PlanKey.tf32; default: :func:`tf32_allowed` under the
    policy in force). Float32 keys never take plans that down-convert inputs (FP32_NEVER_NOTES) while
    others exist. A key that forbids TF32 and has no IEEE plan takes the TF32 plans rather than
    fail; its graph is then marked (:func:`is_tf32_fallback`, TF32_FALLBACK in the plan's name)."""
    why = untrusted(pattern, specs)
    if why:
        raise UnsupportedError(f"cuDNN cannot run {where or pattern.name}: {why}")
    cudnn = load_cudnn()
    if tf32 is None:
        tf32 = tf32_allowed(pattern, specs)
    precision = precision_notes(pattern, specs, tf32)
    for notes in (precision, ()) if precision else ((),):
        lowered = lower(pattern, specs, attrs, handle=handle)
        g = lowered.graph
        try:
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([getattr(cudnn.heur_mode, h) for h in heuristics])
            excluded = [getattr(cudnn.numerical_note, n) for n in notes]
            if deterministic:
                excluded.append(cudnn.numerical_note.NONDETERMINISTIC)
            if excluded:
                g.deselect_numeric_notes(excluded)
            if workspace_limit is not None:
                g.deselect_workspace_greater_than(int(workspace_limit))
            g.check_support()
            if every_plan:
                g.build_plans(cudnn.build_plan_policy.ALL)
            else:
                g.build_plans()
            if precision and not notes and not tf32:  # the IEEE attempt failed: this graph runs TF32 plans
                session.current().tf32_fallback_graphs.add(g)
            return lowered
        except Exception as e:
            if notes:
                continue  # no IEEE float32 plan for this key: take TF32 rather than fail (marked, warned by dispatch)
            if isinstance(e, (NoGPUError, UnsupportedError)):
                raise
            raise UnsupportedError(f"cuDNN cannot run {where or pattern.name}: {type(e).__name__}: {e}") from e
    raise AssertionError("unreachable")


def engine_and_knobs(g: Any, index: int) -> tuple[int | None, dict[str, int]]:
    """(engine id, knobs by name) of plan ``index``: what replays a tuned choice (None, {} if unknown)."""
    try:
        eid, kn = g.get_engine_and_knobs_at_index(index)
        return int(eid), {getattr(k, "name", str(k)): int(v) for k, v in (kn or {}).items()}
    except Exception:  # noqa: BLE001 - replay information is optional
        return None, {}


def plan_name(g: Any, index: int) -> str:
    """Plan ``index``'s name, with TF32_FALLBACK appended for a graph that took TF32 plans against its policy."""
    try:
        name = str(g.get_plan_name_at_index(index))
    except Exception:  # noqa: BLE001 - the name is informative only
        name = f"plan {index}"
    return name + TF32_FALLBACK if is_tf32_fallback(g) else name


def build(
    pattern: Pattern, specs: Mapping[str, TensorSpec], attrs: Mapping[str, Any], handle: Any,
    heuristics: Sequence[str] = ("A", "FALLBACK"), where: str = "", workspace_limit: int | None = None,
    tf32: bool | None = None,
) -> Built:
    """The heuristics' choice for a key (:func:`build_plans`; ``workspace_limit``: the first plan
    within that many workspace bytes; ``tf32``: the key's PlanKey.tf32), with what the plan cache
    records of it."""
    t0 = time.perf_counter()
    lowered = build_plans(pattern, specs, attrs, handle, heuristics, where=where, workspace_limit=workspace_limit, tf32=tf32)
    g = lowered.graph
    index = int(getattr(g, "_plan_index", 0))  # the walk's selection; the frontend has no public getter
    engine_id, knobs = engine_and_knobs(g, index)
    return Built(
        g, lowered.uids, int(g.get_workspace_size()), plan_name(g, index), g.get_execution_plan_count(),
        (time.perf_counter() - t0) * 1e3, engine_id, knobs,
    )


#: Whether dispatch may execute through the frontend's native pointer-array entry (native_execute).


def native_execute(graph: Any, uids: Sequence[int]) -> tuple | None:
    """The frontend's native execute of a built backend plan: ``(function, pointer array, its address,
    position in ``uids`` of each variant-pack slot, plan index)``; called as ``function(address, n,
    workspace, backend handle, index)`` once the array holds the buffers' pointers. One crossing into
    C++ instead of ``graph.execute``'s ordered path, which re-inspects every buffer; fusekit's dispatch
    key has already checked them (probe_execute_raw_ptrs on the H200: the entry 7.5 us per call against
    10.3 for graph.execute; fusekit's whole call 12.6 us against 15.8).

    frontend 1.32 only (the entry is private): None for other versions, a python engine, a graph that
    binds data of its own, or slots other than ``uids``; the caller then uses ``graph.execute``."""
    if not config.TUNABLES.native_execute:
        return None
    try:
        if not str(load_cudnn().__version__).startswith("1.32."):
            return None
        lowered = graph._lowered_graph
        if lowered is None or graph.selected_engine is not None or graph._data_bindings or not graph._is_built:
            return None
        lowered._prepare_variant_pack_template()
        order = [int(u) for u in lowered._get_variant_pack_uids_sorted()]
        ours = [int(u) for u in uids]
        if not order or sorted(order) != sorted(ours) or len(set(ours)) != len(ours):
            return None
        # the plan graph.execute runs: the walk's selection, placed in the backend's list (as _execute does)
        cfg = graph._materialize_backend_plan(graph._plan_index) if graph._plans else None
        index = -1 if cfg is None or cfg.cpp_index is None else int(cfg.cpp_index)
        ptrs = (ctypes.c_void_p * len(order))()
        return lowered._execute_with_raw_ptrs, ptrs, ctypes.addressof(ptrs), tuple(ours.index(u) for u in order), index
    except Exception:  # noqa: BLE001 - the entry is an optimization: graph.execute stays correct
        return None


def deserialize(blob: bytes, handle: Any) -> Any:
    """A graph from ``serialize(as_bytes=True)`` bytes, ready to execute (no heuristics, no build)."""
    cudnn = load_cudnn()
    g = cudnn.pygraph(handle=handle)
    g.deserialize(handle, blob)
    return g
