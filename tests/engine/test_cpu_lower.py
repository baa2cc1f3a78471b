"""CPU: lowering patterns to cuDNN frontend graphs, checked through ``graph.inspect()`` (no GPU needed)."""

import numpy as np
import pytest

import fusekit
from fusekit.engine import lower as lower_mod
from fusekit.engine import oracle, patterns
from fusekit.engine.lower import lower
from fusekit.engine.patterns import parse_pattern
from fusekit.tensors import TensorSpec
from fusekit.dispatch import calls, execute

cudnn = pytest.importorskip("cudnn")

CUDNN_DTYPE = {"float16": "data_type.HALF", "bfloat16": "data_type.BFLOAT16", "float32": "data_type.FLOAT"}
NP_DTYPE = {"float16": np.float16, "bfloat16": np.float16, "float32": np.float32}  # only for stride arithmetic

# node (type, pointwise mode) per pattern, in graph order
EXPECTED_NODES = {
    "conv": [("CONV_FPROP", None)],
    "conv_bias": [("CONV_FPROP", None), ("POINTWISE", "bias")],
    "conv_bias_relu": [("CONV_FPROP", None), ("POINTWISE", "bias"), ("POINTWISE", "relu")],
}

# (N, C, H, W, K, R, S, padding, stride, dilation)
GEOMS = [
    (2, 3, 8, 8, 4, 3, 3, (1, 1), (1, 1), (1, 1)),
    (1, 5, 11, 9, 7, 3, 3, (2, 1), (2, 2), (2, 1)),
    (3, 16, 7, 7, 32, 1, 1, (0, 0), (1, 1), (1, 1)),
]


def element_strides(shape, layout, dtype):
    """Strides in elements of a dense array of logical NCHW ``shape`` in ``layout``, via NumPy."""
    n, c, h, w = shape
    item = np.dtype(NP_DTYPE[dtype]).itemsize
    if layout == "NHWC":
        a = np.empty((n, h, w, c), dtype=NP_DTYPE[dtype]).transpose(0, 3, 1, 2)
    else:
        a = np.empty((n, c, h, w), dtype=NP_DTYPE[dtype])
    assert a.shape == tuple(shape)
    return [s // item for s in a.strides]


def build_case(name, dtype, layout, geom):
    n, c, h, w, k, r, s, pad, st, dil = geom
    pat = fusekit.get_pattern(name)
    attrs = dict(pat.normalize_attrs(dict(padding=pad, stride=st, dilation=dil)))
    specs = {
        "x": TensorSpec.build((n, c, h, w), dtype, 0, layout),
        "w": TensorSpec.build((k, c, r, s), dtype, 0, layout),
        "b": TensorSpec.build((1, k, 1, 1), dtype, 0, "NCHW"),
    }
    specs = {o: specs[o] for o in pat.operand_names}
    shapes = pat.infer_shapes({o: sp.shape for o, sp in specs.items()}, attrs)
    for out, like in pat.outputs.items():
        specs[out] = TensorSpec.build(shapes[out], dtype, 0, specs[like].layout)
    return pat, specs, attrs, shapes


@pytest.mark.parametrize("geom", GEOMS, ids=["3x3", "strided_dilated", "1x1"])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", sorted(EXPECTED_NODES))
def test_lowered_graph_structure(name, dtype, layout, geom):
    pat, specs, attrs, shapes = build_case(name, dtype, layout, geom)
    lowered = lower(pat, specs, attrs)
    info = lowered.graph.inspect()
    tensors, nodes = info["tensors"], info["nodes"]

    # graph-wide data types
    assert info["context"]["io_data_type"] == CUDNN_DTYPE[dtype]
    assert info["context"]["compute_data_type"] == "data_type.FLOAT"

    # nodes: types and modes in order, named after the values they produce, chained
    got = [(nd["type"], nd.get("params", {}).get("mode") if nd["type"] == "POINTWISE" else None) for nd in nodes]
    assert got == EXPECTED_NODES[name]
    assert [nd["name"] for nd in nodes] == [op.out for op in pat.ops]
    conv = nodes[0]
    assert conv["inputs"] == {"image": "x", "weight": "w"}
    assert conv["params"]["padding"] == list(attrs["padding"])
    assert conv["params"]["stride"] == list(attrs["stride"])
    assert conv["params"]["dilation"] == list(attrs["dilation"])
    for prev, nd in zip(nodes, nodes[1:]):
        assert nd["inputs"]["IN_0"] == next(iter(prev["outputs"].values()))
    if name != "conv":
        assert nodes[1]["inputs"]["IN_1"] == "b"
    assert next(iter(nodes[-1]["outputs"].values())) == "y"

    # names and uids: operands then outputs, distinct, matching the graph's tensors
    assert lowered.names == pat.operand_names + tuple(pat.outputs)
    assert len(set(lowered.uids)) == len(lowered.uids)
    assert list(lowered.uids) == [tensors[nm]["uid"] for nm in lowered.names]
    all_uids = [t["uid"] for t in tensors.values()]
    assert len(set(all_uids)) == len(all_uids)

    # operands: the given dims, strides and dtype, not virtual
    for o in pat.operand_names:
        t, sp = tensors[o], specs[o]
        assert t["dim"] == list(sp.shape)
        assert t["stride"] == list(sp.strides)
        assert t["dtype"] == CUDNN_DTYPE[dtype]
        assert t["is_virtual"] is False
    assert tensors["x"]["stride"] == element_strides(specs["x"].shape, layout, dtype)
    assert tensors["w"]["stride"] == element_strides(specs["w"].shape, layout, dtype)

    # output: inferred dims, the input's layout, io dtype, not virtual
    y = tensors["y"]
    assert tuple(y["dim"]) == shapes["y"]
    assert y["stride"] == element_strides(shapes["y"], layout, dtype)
    assert y["dtype"] == CUDNN_DTYPE[dtype]
    assert y["is_virtual"] is False

    # intermediates: one per op that is not an output, all virtual
    inter = {nm: t for nm, t in tensors.items() if nm not in lowered.names}
    assert len(inter) == len(pat.ops) - len(pat.outputs)
    assert all(t["is_virtual"] is True for t in inter.values())
    # the frontend's own inference of the conv output agrees with Pattern.infer_shapes
    if "conv::Y" in inter:
        assert tuple(inter["conv::Y"]["dim"]) == shapes["conv"]


@pytest.mark.parametrize("pad, stride, dil", [((0, 0), (1, 1), (1, 1)), ((3, 1), (2, 3), (1, 2)), ((1, 1), (1, 1), (3, 3))])
def test_frontend_conv_shape_agrees_with_infer_shapes(pad, stride, dil):
    """cuDNN frontend infers the virtual conv output itself; it must agree with fusekit's rule."""
    pat, specs, attrs, shapes = build_case("conv_bias_relu", "float16", "NHWC", (2, 4, 13, 10, 6, 3, 2, pad, stride, dil))
    info = lower(pat, specs, attrs).graph.inspect()
    assert tuple(info["tensors"]["conv::Y"]["dim"]) == shapes["conv"]
    # and with the oracle's actual output
    rng = np.random.default_rng(0)
    x = rng.standard_normal(specs["x"].shape)
    w = rng.standard_normal(specs["w"].shape)
    (y,) = oracle.evaluate("conv", x, w, padding=pad, stride=stride, dilation=dil)
    assert y.shape == shapes["conv"]


@pytest.mark.parametrize("extra", [(1, 1), (0, 2)])
def test_extra_padding_lowers_to_pre_and_post_padding_and_agrees_with_the_oracle(extra):
    """conv_bias_act's ``extra_padding`` (TensorFlow's "same" padding with an odd total) lowers to
    cuDNN's separate padding before and after; the frontend's output shape, fusekit's and the
    oracle's agree, and the oracle equals the convolution of the explicitly padded input."""
    pat = fusekit.get_pattern("conv_bias_act")
    attrs = dict(pat.normalize_attrs(dict(padding=(1, 0), stride=(2, 2), extra_padding=extra, activation="silu")))
    specs = {"x": TensorSpec.build((2, 4, 9, 8), "float16", 0, "NHWC"), "w": TensorSpec.build((6, 4, 3, 3), "float16", 0, "NHWC"),
             "b": TensorSpec.build((1, 6, 1, 1), "float16", 0, "NCHW")}
    shapes = pat.infer_shapes({o: sp.shape for o, sp in specs.items()}, attrs)
    specs["y"] = TensorSpec.build(shapes["y"], "float16", 0, "NHWC")
    info = lower(pat, specs, attrs).graph.inspect()
    conv = next(n for n in info["nodes"] if n["params"].get("post_padding"))
    assert conv["params"]["pre_padding"] == [1, 0] and conv["params"]["post_padding"] == [1 + extra[0], extra[1]]
    assert tuple(info["tensors"]["conv::Y"]["dim"]) == shapes["conv"]
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((2, 4, 9, 8)), rng.standard_normal((6, 4, 3, 3)), rng.standard_normal(6)
    (y,) = oracle.evaluate("conv_bias_act", x, w, b, **attrs)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1 + extra[0]), (0, extra[1])))  # the padding spelled out
    z = oracle.conv2d_nchw(xp, w, (0, 0), (2, 2)) + b.reshape(1, -1, 1, 1)
    assert y.shape == shapes["y"]
    np.testing.assert_allclose(y, z / (1 + np.exp(-z)), rtol=1e-12, atol=1e-12)


def test_negative_extra_padding_is_named():
    with pytest.raises(fusekit.OperandError, match="extra_padding"):
        fusekit.get_pattern("conv_bias_act").normalize_attrs(dict(extra_padding=(-1, 0)))


def test_default_attrs_lowered():
    pat, specs, attrs, shapes = build_case("conv", "float32", "NCHW", (1, 2, 5, 5, 3, 3, 3, (0, 0), (1, 1), (1, 1)))
    attrs = dict(pat.normalize_attrs({}))
    params = lower(pat, specs, attrs).graph.inspect()["nodes"][0]["params"]
    assert params == {"padding": [0, 0], "stride": [1, 1], "dilation": [1, 1]}
    assert shapes["y"] == (1, 3, 3, 3)


def test_io_dtype_follows_first_operand():
    pat, specs, attrs, _ = build_case("conv_bias_relu", "bfloat16", "NHWC", GEOMS[0])
    info = lower(pat, specs, attrs).graph.inspect()
    assert info["context"]["io_data_type"] == "data_type.BFLOAT16"
    assert info["tensors"]["b"]["dtype"] == "data_type.BFLOAT16"


def test_user_pattern_with_add_and_mul_lowers():
    text = """
name = "scale_shift"
[operands]
x = { kind = "image" }
s = { kind = "channel", role = "param" }
t = { kind = "channel", role = "param" }
[[ops]]
op = "mul"
in = { a = "x", b = "s" }
out = "m"
[[ops]]
op = "add"
in = { a = "m", b = "t" }
out = "y"
[outputs]
y = { like = "x" }
"""
    pat = parse_pattern(text)
    specs = {
        "x": TensorSpec.build((2, 3, 4, 5), "float32", 0, "NHWC"),
        "s": TensorSpec.build((1, 3, 1, 1), "float32", 0, "NCHW"),
        "t": TensorSpec.build((1, 3, 1, 1), "float32", 0, "NCHW"),
        "y": TensorSpec.build((2, 3, 4, 5), "float32", 0, "NHWC"),
    }
    lowered = lower(pat, specs, {})
    info = lowered.graph.inspect()
    assert [(nd["type"], nd["params"]["mode"]) for nd in info["nodes"]] == [("POINTWISE", "mul"), ("POINTWISE", "add")]
    assert info["nodes"][0]["inputs"] == {"IN_0": "x", "IN_1": "s"}
    assert info["nodes"][1]["inputs"]["IN_1"] == "t"
    assert lowered.names == ("x", "s", "t", "y")
    assert list(lowered.uids) == [info["tensors"][n]["uid"] for n in lowered.names]
    assert info["tensors"]["m::OUT_0"]["is_virtual"] is True
    assert info["tensors"]["y"]["is_virtual"] is False
    assert info["tensors"]["y"]["stride"] == element_strides((2, 3, 4, 5), "NHWC", "float32")


def test_every_op_has_a_lowering_and_an_oracle():
    assert set(lower_mod.LOWER) == set(patterns.OPS)
    assert set(oracle.EVAL) == set(patterns.OPS)
    # and every op a shipped pattern uses is among them
    used = {op.op for n in fusekit.list_patterns() for op in fusekit.get_pattern(n).ops}
    assert used <= set(patterns.OPS)


def test_cudnn_dtype_mapping():
    assert lower_mod.cudnn_dtype("float16") == cudnn.data_type.HALF
    assert lower_mod.cudnn_dtype("bfloat16") == cudnn.data_type.BFLOAT16
    assert lower_mod.cudnn_dtype("float32") == cudnn.data_type.FLOAT
    with pytest.raises(KeyError):
        lower_mod.cudnn_dtype("float64")


def test_float32_convolutions_and_matmuls_exclude_tf32_plans_and_nothing_else_does():
    from fusekit.engine import lower as lo
    from fusekit.engine import keys

    def notes(name, shapes, dtype):
        pat = fusekit.get_pattern(name)
        return lo.precision_notes(pat, keys.shape_specs(pat, shapes, dtype, "NHWC"))

    conv = {"x": (2, 8, 6, 6), "w": (4, 8, 3, 3), "b": (4,)}
    assert notes("conv_bias_relu", conv, "float32") == ("TENSOR_CORE", "DOWN_CONVERT_INPUTS")
    # TF32 allowed: plans that down-convert float32 inputs to 16 bits stay out all the same (as PyTorch filters them)
    wgrad = fusekit.get_pattern("conv_wgrad")
    for dtype, want in (("float32", ("DOWN_CONVERT_INPUTS",)), ("float16", ())):
        assert lo.precision_notes(wgrad, keys.shape_specs(wgrad, {"x": (2, 8, 6, 6), "dy": (2, 4, 6, 6)}, dtype, "NHWC"), tf32=True) == want
    assert notes("linear_bias", {"x": (4, 8), "w": (3, 8), "b": (3,)}, "float32") == ("TENSOR_CORE", "DOWN_CONVERT_INPUTS")
    assert notes("conv_bias_relu", conv, "float16") == ()
    assert notes("batchnorm", {"x": (2, 8, 6, 6), **{k: (8,) for k in ("gamma", "beta", "running_mean", "running_var")}}, "float32") == ()


def test_preload_frontend_imports_the_racy_modules_once():
    """The GEMM engine's lazily imported facades are imported once, by one thread, before planning
    (threads planning at once raced on their first import on the H200). Run in a fresh interpreter,
    where nothing is imported yet: eight threads preload at once."""
    import subprocess
    import sys

    pytest.importorskip("cudnn")
    program = (
        "import sys, threading\n"
        "from fusekit.engine import lower\n"
        "assert not any(m in sys.modules for m in lower.LAZY_FRONTEND_MODULES)\n"
        "ts = [threading.Thread(target=lower.preload_frontend) for _ in range(8)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print([m for m in lower.LAZY_FRONTEND_MODULES if m in sys.modules])\n"
    )
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "cudnn.gemm.frost.compiler" in r.stdout, r.stdout


class _FakeLowered:
    """The frontend 1.32 lowered graph's execute entries as native_execute uses them."""

    def __init__(self, order):
        self.order, self.calls = order, []

    def _prepare_variant_pack_template(self):
        pass

    def _get_variant_pack_uids_sorted(self):
        return self.order

    def _execute_with_raw_ptrs(self, address, n, workspace, handle, index):
        import ctypes

        self.calls.append(((ctypes.c_void_p * n).from_address(address)[:], workspace, handle, index))


class _FakeGraph:
    def __init__(self, order=(1, 2, 3), engine=None, bindings=None, plans=(), plan_index=0):
        self._lowered_graph, self.selected_engine, self._data_bindings = _FakeLowered(list(order)), engine, bindings or {}
        self._is_built, self._plans, self._plan_index, self.executed = True, list(plans), plan_index, []

    def _materialize_backend_plan(self, index):
        from types import SimpleNamespace

        return SimpleNamespace(cpp_index=self._plans[index])  # where the walk's plan sits in the backend's list

    def execute(self, arrays, ws, handle=None, tensor_uids=None):
        self.executed.append((tuple(arrays), ws, tensor_uids))


def test_native_execute_binds_pointers_in_the_backend_s_uid_order_and_runs_the_selected_plan(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(lower_mod, "load_cudnn", lambda: SimpleNamespace(__version__="1.32.0"))
    g = _FakeGraph(order=(1, 2, 3), plans=(None, 4), plan_index=1)  # the walk's plan 1 sits at backend index 4
    plan = SimpleNamespace(graph=g, uids=(3, 1, 2))  # fusekit's order: operands then outputs
    ad = SimpleNamespace(ptr=lambda a: a)
    c = calls.Call(plan, SimpleNamespace(backend_handle=77, stream=0), 0, SimpleNamespace(ptr=4096), (), ad)
    assert c.native is not None
    execute.execute(c, (3000, 1000, 2000), c.handle)
    execute.execute(c, (3008, 1008, 2008), c.handle)  # new pointers each call, same array
    assert g._lowered_graph.calls == [([1000, 2000, 3000], 4096, 77, 4), ([1008, 2008, 3008], 4096, 77, 4)]
    assert g.executed == []


@pytest.mark.parametrize("why", ["python engine", "own data", "other slots", "other frontend", "switched off"])
def test_native_execute_falls_back_to_graph_execute(monkeypatch, why):
    from types import SimpleNamespace

    version = "1.33.0" if why == "other frontend" else "1.32.0"
    monkeypatch.setattr(lower_mod, "load_cudnn", lambda: SimpleNamespace(__version__=version))
    monkeypatch.setattr(fusekit.config.TUNABLES, "native_execute", why != "switched off")
    g = _FakeGraph(
        order=(1, 2, 3, 9) if why == "other slots" else (1, 2, 3), engine=object() if why == "python engine" else None,
        bindings={9: 1.0} if why == "own data" else None,
    )
    plan = SimpleNamespace(graph=g, uids=(1, 2, 3))
    c = calls.Call(plan, SimpleNamespace(backend_handle=77, stream=0), 0, SimpleNamespace(ptr=0), (), SimpleNamespace(ptr=lambda a: a))
    assert c.native is None
    execute.execute(c, (10, 20, 30), c.handle)
    assert g.executed == [((10, 20, 30), 0, (1, 2, 3))] and g._lowered_graph.calls == []


def test_native_execute_whose_signature_changed_falls_back_for_good(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(lower_mod, "load_cudnn", lambda: SimpleNamespace(__version__="1.32.9"))
    g = _FakeGraph()
    g._lowered_graph._execute_with_raw_ptrs = lambda *a: (_ for _ in ()).throw(TypeError("incompatible function arguments"))
    c = calls.Call(SimpleNamespace(graph=g, uids=(1, 2, 3)), SimpleNamespace(backend_handle=7, stream=0), 0,
                       SimpleNamespace(ptr=0), (), SimpleNamespace(ptr=lambda a: a))
    assert c.native is not None
    execute.execute(c, (10, 20, 30), c.handle)
    execute.execute(c, (11, 21, 31), c.handle)
    assert c.native is None and [e[0] for e in g.executed] == [(10, 20, 30), (11, 21, 31)]
