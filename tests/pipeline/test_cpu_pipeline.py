"""fusekit.pipeline on the CPU: fx tracing and ONNX import, the rewrites (BN folding, fused
epilogues, fallbacks), the float64 reference against the original model, and buffer planning."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import fusekit.pipeline as fp  # noqa: E402
from helpers import rel_max  # noqa: E402
from fusekit.errors import UnsupportedError  # noqa: E402
from fusekit.pipeline.memory import plan_memory  # noqa: E402


def _randomize_bn(model, gen):
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            k = m.num_features
            m.running_mean.copy_(torch.rand(k, generator=gen) * 2 - 1)
            m.running_var.copy_(torch.rand(k, generator=gen) * 1.5 + 0.5)
            m.weight.data.copy_(torch.rand(k, generator=gen) + 0.5)
            m.bias.data.copy_(torch.rand(k, generator=gen) - 0.5)


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class SmallCNN(nn.Module):
    def __init__(self, unsupported="grouped"):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.block = Residual(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=4)
        self.unsupported = unsupported
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        x = self.block(self.pool(self.stem(x)))
        x = self.dw(x)
        x = torch.sigmoid(x)
        x = torch.flatten(self.gap(x), 1)
        x = torch.relu(self.fc1(x))
        return torch.softmax(self.fc2(x), dim=1)


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(1)
    m = SmallCNN().eval()
    _randomize_bn(m, torch.Generator().manual_seed(2))
    return m


def test_fx_stage_kinds_and_fallbacks(small):
    prog = fp.lower_model(small, torch.zeros(2, 3, 20, 20))
    pats = [s.pattern for s in prog.stages]
    assert pats == [
        "conv_bias_relu", "max_pool2d", "conv_bias_relu", "conv_bias_add_relu", "conv_bias_act",
        "avg_pool2d", "reshape", "linear_bias_relu", "linear_bias", "softmax",
    ], str(prog)
    assert not any(s.kind in ("bn", "relu", "add", "identity") for s in prog.stages), "BN/ReLU/add left unfused"
    assert prog.stages[4].attrs["groups"] == 4 and prog.stages[4].weights["w"].shape == (8, 2, 3, 3)  # grouped conv: fused
    assert prog.stages[4].attrs["act"] == ("sigmoid", 0.0) and "sigmoid" in prog.stages[4].name  # the sigmoid is the conv's epilogue
    assert prog.fallbacks == []
    tail = prog.stages[3]
    assert tail.inputs[1] == prog.stages[1].output  # the residual operand: the block's input
    assert "bn2" in tail.name and "add" in tail.name
    gap = prog.stages[5]
    assert gap.attrs["kernel_size"] == (5, 5) and gap.out_shape == (2, 8, 1, 1)
    assert prog.output_shape == (2, 5)
    str(prog)  # printable


def test_fx_reference_matches_torch_float64(small, rng):
    x = rng.standard_normal((2, 3, 20, 20))
    prog = fp.lower_model(small, x.shape)
    pipe = fp.Pipeline(prog)
    got = pipe.reference(x)
    want = small.double()(torch.from_numpy(x)).detach().numpy()
    small.float()
    assert got.shape == want.shape
    assert rel_max(got, want) < 1e-10
    # intermediate check: the folded stem equals conv -> BN -> ReLU of the original
    env = fp.reference.evaluate(prog, x, keep=True)
    stem = small.stem.double()(torch.from_numpy(x)).detach().numpy()
    small.float()
    assert rel_max(env[prog.stages[0].output], stem) < 1e-10


def test_ceil_mode_pools_lower_to_fusekit_kernels(rng):
    """ceil_mode pooling (GoogLeNet, SqueezeNet) lowers to fusekit's pool stages with PyTorch's output
    sizes; the float64 reference gives PyTorch's values, including the windows past the edge."""
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, ceil_mode=True),
                      nn.Conv2d(8, 8, 3, padding=1), nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False),
                      nn.AvgPool2d(3, 2, 1, ceil_mode=True)).eval()
    x = rng.standard_normal((2, 3, 14, 14))
    prog = fp.lower_model(m, x.shape)
    pools = [(s.pattern, s.out_shape[2:]) for s in prog.stages if "pool" in s.pattern]
    assert pools == [("max_pool2d", (7, 7)), ("avg_pool2d", (4, 4)), ("avg_pool2d", (3, 3))], pools  # floor: 6, 3, 2
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    m.float()
    assert rel_max(fp.Pipeline(prog).reference(x), want) < 1e-12


def test_dilated_max_pool_and_divisor_override_lower_to_fusekit_kernels(rng):
    """A dilated max pool and an average pool with divisor_override lower to fusekit's pool stages
    (no torch fallback), with PyTorch's output sizes and values (the float64 reference)."""
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 1, 1, dilation=2),
                      nn.AvgPool2d(3, 2, 1, ceil_mode=True, divisor_override=4)).eval()
    x = rng.standard_normal((2, 3, 13, 13))
    prog = fp.lower_model(m, x.shape)
    pools = [(s.pattern, s.out_shape[2:]) for s in prog.stages if "pool" in s.pattern]
    assert pools == [("max_pool2d", (11, 11)), ("avg_pool2d", (6, 6))], pools
    assert not any(s.pattern == "torch" for s in prog.stages)
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    m.float()
    assert rel_max(fp.Pipeline(prog).reference(x), want) < 1e-12


def test_bn_folding_conv_without_bias_and_with_bias(rng):
    for bias in (False, True):
        m = nn.Sequential(nn.Conv2d(4, 6, 3, padding=2, dilation=2, bias=bias), nn.BatchNorm2d(6)).eval()
        _randomize_bn(m, torch.Generator().manual_seed(3))
        prog = fp.lower_model(m, (1, 4, 9, 9))
        assert [s.pattern for s in prog.stages] == ["conv_bias"]
        x = rng.standard_normal((1, 4, 9, 9))
        want = m.double()(torch.from_numpy(x)).detach().numpy()
        assert rel_max(fp.Pipeline(prog).reference(x), want) < 1e-10


def test_unfoldable_bn_and_its_relu_are_one_scale_shift_graph(rng):
    m = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3 * 4 * 4, 4)).eval()
    _randomize_bn(m, torch.Generator().manual_seed(4))
    prog = fp.lower_model(m, (2, 3, 8, 8))
    assert [s.pattern for s in prog.stages] == ["channel_scale_shift_act", "max_pool2d", "reshape", "linear_bias"]
    assert prog.stages[0].attrs["act"] == ("relu", 0.0) and set(prog.stages[0].weights) == {"scale", "shift"}
    x = rng.standard_normal((2, 3, 8, 8))
    assert rel_max(fp.Pipeline(prog).reference(x), m.double()(torch.from_numpy(x)).detach().numpy()) < 1e-10


def test_view_flatten_and_functional_ops(rng):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 4, 1)
            self.fc = nn.Linear(4 * 3 * 3, 2)

        def forward(self, x):
            y = torch.nn.functional.relu(self.c(x))
            y = y.view(y.size(0), -1)
            return self.fc(y)

    m = M().eval()
    prog = fp.lower_model(m, (3, 3, 3, 3))
    assert [s.pattern for s in prog.stages] == ["conv_bias_relu", "reshape", "linear_bias"]
    x = rng.standard_normal((3, 3, 3, 3))
    assert rel_max(fp.Pipeline(prog).reference(x), m.double()(torch.from_numpy(x)).detach().numpy()) < 1e-10


# ------------------------------------------------------------------------------------------------
# ONNX
# ------------------------------------------------------------------------------------------------
# Only the ONNX tests need onnx (a module-level importorskip skipped this whole file where onnx is
# not installed, CI included).
try:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
except ImportError:
    onnx = None
needs_onnx = pytest.mark.skipif(onnx is None, reason="onnx is not installed (pip install onnx)")


def _onnx_cnn(rng, extra=None):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inits = {
        "w1": f(8, 3, 3, 3) * 0.3, "g1": (rng.random(8) + 0.5).astype(np.float32), "b1": f(8) * 0.1,
        "m1": f(8) * 0.1, "v1": (rng.random(8) + 0.5).astype(np.float32),
        "fw": f(5, 8) * 0.3, "fb": f(5),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], strides=[1, 1], kernel_shape=[3, 3], name="conv1"),
        helper.make_node("BatchNormalization", ["c1", "g1", "b1", "m1", "v1"], ["bn1"], epsilon=1e-3, name="bn1"),
        helper.make_node("Relu", ["bn1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
    ]
    last = "p1"
    if extra:
        nodes.append(helper.make_node(extra, [last], ["s1"], name="extra1"))
        last = "s1"
    nodes += [
        helper.make_node("GlobalAveragePool", [last], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["fl"], axis=1, name="flat"),
        helper.make_node("Gemm", ["fl", "fw", "fb"], ["y"], transB=1, name="fc"),
    ]
    graph = helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model, {k: v.astype(np.float64) for k, v in inits.items()}


def _onnx_numpy(x, p, extra=None):
    F = torch.nn.functional
    t = lambda a: torch.from_numpy(a)  # noqa: E731
    y = F.conv2d(t(x), t(p["w1"]), padding=1)
    y = F.batch_norm(y, t(p["m1"]), t(p["v1"]), t(p["g1"]), t(p["b1"]), eps=1e-3)
    y = F.max_pool2d(torch.relu(y), 2)
    if extra:
        y = {"Sigmoid": torch.sigmoid, "Erf": torch.erf}[extra](y)
    y = y.mean(dim=(2, 3))
    return (y @ t(p["fw"]).T + t(p["fb"])).numpy()


@needs_onnx
def test_onnx_import_and_reference(rng, tmp_path):
    model, p = _onnx_cnn(rng)
    path = tmp_path / "cnn.onnx"
    onnx.save(model, str(path))
    for src in (model, str(path)):
        prog = fp.lower_model(src, (2, 3, 8, 8))
        assert [s.pattern for s in prog.stages] == ["conv_bias_relu", "max_pool2d", "avg_pool2d", "reshape", "linear_bias"]
        assert prog.fallbacks == []
        x = rng.standard_normal((2, 3, 8, 8))
        assert rel_max(fp.Pipeline(prog).reference(x), _onnx_numpy(x, p)) < 1e-10
    from fusekit.pipeline.onnx_import import input_shape

    assert input_shape(model, batch=4) == (4, 3, 8, 8)
    assert fp.lower_model(model).input_shape == (1, 3, 8, 8)


@needs_onnx
def test_onnx_node_without_a_pattern_is_a_fallback_and_activations_fuse(rng):
    model, p = _onnx_cnn(rng, extra="Erf")
    prog = fp.lower_model(model, (2, 3, 8, 8))
    assert [s.pattern for s in prog.stages] == ["conv_bias_relu", "max_pool2d", "torch", "avg_pool2d", "reshape", "linear_bias"]
    assert len(prog.fallbacks) == 1 and "Erf" in prog.fallbacks[0]
    x = rng.standard_normal((2, 3, 8, 8))
    assert rel_max(fp.Pipeline(prog).reference(x), _onnx_numpy(x, p, extra="Erf")) < 1e-10
    model, p = _onnx_cnn(rng, extra="Sigmoid")
    prog = fp.lower_model(model, (2, 3, 8, 8))
    assert [s.pattern for s in prog.stages] == ["conv_bias_relu", "max_pool2d", "act", "avg_pool2d", "reshape", "linear_bias"]
    assert prog.fallbacks == [] and prog.stages[2].attrs["activation"] == "sigmoid"
    assert rel_max(fp.Pipeline(prog).reference(x), _onnx_numpy(x, p, extra="Sigmoid")) < 1e-10


@needs_onnx
@pytest.mark.parametrize(("ctm", "nearest"), [("asymmetric", "floor"), ("half_pixel", "round_prefer_floor"), ("pytorch_half_pixel", "round_prefer_ceil")])
def test_onnx_asymmetric_pads_and_nearest_resize_match_the_onnx_reference_evaluator(rng, ctm, nearest):
    """A Conv with more padding after than before (TensorFlow's "same") lowers with extra_padding; a
    nearest Resize by power-of-two scales to an upsample stage; float64 equals ONNX's own evaluator.
    A Resize that is not nearest, or pads heavier before, is refused by name."""
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    def model(pads, mode="nearest", scales=(1.0, 1.0, 4.0, 2.0)):
        w = numpy_helper.from_array(rng.standard_normal((6, 3, 3, 3)), "w")
        sc = numpy_helper.from_array(np.asarray(scales, np.float32), "scales")
        graph = helper.make_graph([
            helper.make_node("Conv", ["x", "w"], ["c"], pads=pads, strides=[2, 2], kernel_shape=[3, 3], name="conv"),
            helper.make_node("Relu", ["c"], ["r"], name="relu"),
            helper.make_node("Resize", ["r", "", "scales"], ["y"], mode=mode, coordinate_transformation_mode=ctm, nearest_mode=nearest,
                             name="up")], "g",
            [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3, 10, 9])], [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)],
            [w, sc])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

    m = model([0, 1, 1, 2])
    prog = fp.lower_model(m, (2, 3, 10, 9))
    assert [s.pattern for s in prog.stages] == ["conv_bias_act", "upsample_nearest2d"], str(prog)
    assert prog.stages[0].attrs["extra_padding"] == (1, 1) and prog.stages[1].attrs["scale"] == (4, 2)
    x = rng.standard_normal((2, 3, 10, 9))
    (want,) = ReferenceEvaluator(m).run(None, {"x": x})
    got = fp.Pipeline(prog).reference(x)
    assert got.shape == want.shape and rel_max(got, want) < 1e-13
    with pytest.raises(UnsupportedError, match="Resize up: only mode=nearest"):
        fp.lower_model(model([1, 1, 1, 1], mode="linear"), (2, 3, 10, 9))
    with pytest.raises(UnsupportedError, match="Resize up: only mode=nearest"):
        fp.lower_model(model([1, 1, 1, 1], scales=(1.0, 1.0, 3.0, 3.0)), (2, 3, 10, 9))
    with pytest.raises(UnsupportedError, match="Conv conv pads .*more padding before"):
        fp.lower_model(model([1, 1, 0, 0]), (2, 3, 10, 9))


@needs_onnx
def test_onnx_dilated_max_pool_matches_the_onnx_reference_evaluator(rng):
    """An ONNX MaxPool with dilations and pads lowers to fusekit's max_pool2d stage; its float64 output
    equals ONNX's own reference evaluator. AveragePool dilations and ceil_mode stay refused by name."""
    from onnx.reference import ReferenceEvaluator

    def pool_model(op, **attrs):
        graph = helper.make_graph(
            [helper.make_node(op, ["x"], ["y"], **attrs)], "g",
            [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3, 13, 11])],
            [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

    model = pool_model("MaxPool", kernel_shape=[3, 2], strides=[2, 1], pads=[1, 1, 1, 1], dilations=[2, 3])
    prog = fp.lower_model(model, (2, 3, 13, 11))
    assert [s.pattern for s in prog.stages] == ["max_pool2d"] and prog.stages[0].attrs["dilation"] == (2, 3)
    x = rng.standard_normal((2, 3, 13, 11))
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    got = fp.Pipeline(prog).reference(x)
    assert got.shape == want.shape and rel_max(got, want) == 0.0
    model = pool_model("MaxPool", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)  # no pads: ONNX's and PyTorch's sizes agree
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    got = fp.Pipeline(fp.lower_model(model, (2, 3, 13, 11))).reference(x)
    assert got.shape == want.shape and rel_max(got, want) == 0.0
    with pytest.raises(UnsupportedError, match="AveragePool"):
        fp.lower_model(pool_model("AveragePool", kernel_shape=[3, 3], dilations=[2, 2]), (2, 3, 13, 11))
    ceil_padded = helper.make_graph(  # PyTorch drops a last window that starts in the padding, ONNX keeps it
        [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[3, 3], pads=[1, 1, 1, 1], ceil_mode=1, name="mp")], "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3, 14, 14])], [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)])
    with pytest.raises(UnsupportedError, match="mp .*ceil_mode"):
        fp.lower_model(helper.make_model(ceil_padded, opset_imports=[helper.make_opsetid("", 18)]), (2, 3, 14, 14))


@needs_onnx
def test_onnx_unknown_node_raises():
    graph = helper.make_graph(
        [helper.make_node("Hardmax", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4, 4])],
    )
    with pytest.raises(UnsupportedError, match="Hardmax"):
        fp.lower_model(helper.make_model(graph))


@needs_onnx
def test_onnx_export_of_torch_model_if_available(small, rng, tmp_path):
    path = tmp_path / "small.onnx"
    try:
        torch.onnx.export(small, torch.zeros(2, 3, 20, 20), str(path), dynamo=False, opset_version=17)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"torch.onnx.export unavailable: {type(e).__name__}: {e}")
    prog = fp.lower_model(str(path), (2, 3, 20, 20))
    x = rng.standard_normal((2, 3, 20, 20))
    want = small.double()(torch.from_numpy(x)).detach().numpy()
    small.float()
    assert rel_max(fp.Pipeline(prog).reference(x), want) < 1e-9
    assert sum(s.pattern.startswith("conv_bias") for s in prog.stages) == 4  # the grouped conv fused too


@needs_onnx
@pytest.mark.parametrize("opset", [13, 18])
def test_onnx_export_of_modern_cnn_forms_fuses_them(rng, tmp_path, opset):
    """PyTorch's exporter spells SiLU as x * Sigmoid(x), the SE pool as ReduceMean (axes an attribute
    before opset 18, an input from it on), hardswish / hardsigmoid as their nodes, channel shuffle
    through Shape arithmetic and chunk as Split: each imports, the activations and gates fuse, and the
    program matches float64 eager."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
            self.se1, self.se2 = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1)
            self.c2 = nn.Conv2d(8, 8, 1)
            self.fc = nn.Linear(16, 5)

        def forward(self, x):
            F = torch.nn.functional
            y = F.silu(self.bn1(self.c1(x)))
            y = y * F.hardsigmoid(self.se2(F.hardswish(self.se1(y.mean((2, 3), keepdim=True)))))
            a, b = y.chunk(2, dim=1)
            y = torch.cat([a, F.relu(self.c2(b))], 1)
            n, c, h, w = y.size()  # channel shuffle, as ShuffleNetV2 writes it
            y = y.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)
            return self.fc(torch.nn.functional.sigmoid(y).mean((2, 3)))

    m = Net().eval()
    _randomize_bn(m, torch.Generator().manual_seed(opset))
    path = tmp_path / "net.onnx"
    try:
        torch.onnx.export(m, torch.zeros(2, 3, 12, 12), str(path), dynamo=False, opset_version=opset)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"torch.onnx.export unavailable: {type(e).__name__}: {e}")
    prog = fp.lower_model(str(path), (2, 3, 12, 12))
    pats = [s.pattern for s in prog.stages]
    assert "conv_bias_act" in pats and "channel_gate" in pats, pats
    assert not any(s.attrs.get("op") in ("Sigmoid", "Mul", "ReduceMean", "HardSigmoid", "HardSwish", "Shape") for s in prog.stages if s.fallback)
    x = rng.standard_normal((2, 3, 12, 12))
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    m.float()
    assert rel_max(fp.Pipeline(prog).reference(x), want) < 1e-6  # the exporter folds BN into the conv in float32


@needs_onnx
def test_onnx_shape_arithmetic_folds_to_constants(rng):
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape (a dynamic flatten) folds on a fixed input size."""
    i64 = lambda name, vals: numpy_helper.from_array(np.asarray(vals, dtype=np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["r", "shape"], ["y"], name="flat"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [i64("zero", 0), i64("ax0", [0]), i64("minus1", [-1])])
    prog = fp.lower_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), (2, 3, 4, 4))
    assert len(prog.stages) == 2 and prog.stages[-1].kind == "flatten" and not prog.fallbacks and prog.output_shape == (2, 48)
    x = rng.standard_normal((2, 3, 4, 4))
    assert np.array_equal(fp.Pipeline(prog).reference(x), np.maximum(x, 0).reshape(2, 48))


# ------------------------------------------------------------------------------------------------
# Buffer planning
# ------------------------------------------------------------------------------------------------
def test_memory_plan_chain_reuses_buffers():
    m = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()) for _ in range(6)]).eval()
    prog = fp.lower_model(m, (2, 8, 16, 16))
    mp = plan_memory(prog, 2)
    assert mp.planned_bytes < mp.eager_bytes
    assert len(mp.sizes) == 4  # input, output, and two ping-pong buffers for the chain
    assert mp.conflicts() == []
    assert mp.planned_bytes >= mp.live_peak_bytes


def test_memory_plan_no_live_values_share(small):
    prog = fp.lower_model(small, (2, 3, 20, 20))
    mp = plan_memory(prog, 2)
    assert mp.conflicts() == []
    # the residual operand stays live across the block: its buffer differs from every value made meanwhile
    tail = prog.stages[3]
    z = tail.inputs[1]
    for s in prog.stages[2:4]:
        assert mp.assign[s.output] != mp.assign[z]
    # every pair of overlapping intervals has distinct buffers (explicitly)
    vals = list(mp.assign)
    for i, a in enumerate(vals):
        for b in vals[i + 1:]:
            (a0, a1), (b0, b1) = mp.intervals[a], mp.intervals[b]
            if a0 <= b1 and b0 <= a1:
                assert mp.assign[a] != mp.assign[b], (a, b)
    assert mp.planned_bytes < mp.eager_bytes


def test_report_on_cpu_lists_stages_and_fallbacks(small):
    pipe = fp.Pipeline(fp.lower_model(small, (2, 3, 20, 20)))
    r = pipe.report()
    for s in pipe.stages:
        assert s.pattern in r
    assert "fallbacks" in r and "sigmoid" in r and "MiB" in r


def test_compile_without_gpu_raises_cleanly(small):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    from fusekit.errors import NoGPUError

    with pytest.raises(NoGPUError):
        fp.compile(small, torch.zeros(1, 3, 20, 20))


def test_stage_cost_counts_conv_and_linear_work(small):
    from fusekit.pipeline.ir import stage_cost

    prog = fp.lower_model(small, torch.zeros(2, 3, 20, 20))
    stem, dw, fc1 = prog.stages[0], prog.stages[4], prog.stages[7]
    flops, nbytes = stage_cost(stem, 2)  # 3 -> 8 channels, 3x3, stride 2: 2 x 3 x 20 x 20 -> 2 x 8 x 10 x 10
    assert flops == 2 * (2 * 8 * 10 * 10) * 3 * 3 * 3
    assert nbytes == 2 * (2 * 3 * 20 * 20 + 2 * 8 * 10 * 10 + 8 * 3 * 3 * 3 + 8)
    assert stage_cost(dw, 2)[0] == 2 * (2 * 8 * 5 * 5) * 2 * 3 * 3  # groups=4: 2 input channels per filter
    assert stage_cost(fc1, 4)[0] == 2 * 2 * 16 * 8
    assert stage_cost(prog.stages[1], 2)[0] == 0  # pooling: bytes only


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand + ReLU6, depthwise 3x3 + ReLU6, 1x1 project, linear residual add."""

    def __init__(self, c, e=4):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(c, c * e, 1, bias=False), nn.BatchNorm2d(c * e), nn.ReLU6(inplace=True))
        self.dw = nn.Sequential(nn.Conv2d(c * e, c * e, 3, padding=1, groups=c * e, bias=False), nn.BatchNorm2d(c * e))
        self.project = nn.Sequential(nn.Conv2d(c * e, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.project(torch.nn.functional.relu6(self.dw(self.expand(x))))


def test_relu6_and_linear_residual_tails_fuse(rng):
    """ReLU6 (module and functional) fuses as conv_bias_relu6, a residual add with a clipped ReLU after
    it as conv_bias_add_act, depthwise convs included; the float64 reference matches the model."""
    torch.manual_seed(5)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU6(), InvertedResidual(8), nn.Hardtanh(0.0, 3.0)).eval()
    _randomize_bn(m, torch.Generator().manual_seed(6))
    x = rng.standard_normal((2, 3, 10, 10)) * 3
    prog = fp.lower_model(m, x.shape)
    assert [s.pattern for s in prog.stages] == ["conv_bias_relu6", "conv_bias_relu6", "conv_bias_relu6", "conv_bias_add_act"], str(prog)
    assert prog.stages[2].attrs["groups"] == 32
    assert prog.stages[3].attrs["act"] == ("clip", 3.0) and prog.fallbacks == []
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    m.float()
    assert rel_max(fp.Pipeline(prog).reference(x), want) < 1e-12


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_torch_implementation_of_every_stage_matches_reference(name, rng):
    """PyTorch's implementation of each stage (what a build runs where PyTorch's kernel measures
    faster, or cuDNN refuses a shape) computes what the stage's reference computes, stage by stage
    in float64; TorchProgram (the CLI's PyTorch side for ONNX models) gives the same output."""
    tv = pytest.importorskip("torchvision")
    from fusekit.pipeline import reference
    from fusekit.pipeline.bench import TorchProgram
    from fusekit.pipeline.ir import run_torch_stage

    torch.manual_seed(3)
    m = getattr(tv.models, name)(weights=None).eval()
    _randomize_bn(m, torch.Generator().manual_seed(4))
    x = rng.standard_normal((2, 3, 32, 32))
    prog = fp.lower_model(m, x.shape)
    env = reference.evaluate(prog, x, keep=True)
    kinds = set()
    for s in prog.stages:
        if s.pattern in ("reshape", "torch"):
            continue
        kinds.add(s.pattern)
        tenv = {n: torch.from_numpy(env[n]) for n in s.inputs}
        w = {k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in s.weights.items()}
        got = run_torch_stage(s, tenv, s.fn, w).numpy()
        assert rel_max(got, env[s.output]) < 1e-12, (s.name, s.pattern)
    want = {"resnet18": {"conv_bias_relu", "conv_bias_add_relu", "max_pool2d", "avg_pool2d", "linear_bias"},
            "mobilenet_v2": {"conv_bias_relu6", "conv_bias_add", "conv_bias", "avg_pool2d", "linear_bias"}}[name]
    assert want <= kinds, kinds
    y = TorchProgram(prog, "float64", "cpu")(torch.from_numpy(x)).numpy()
    assert rel_max(y, env[prog.output]) < 1e-12


def test_verify_moves_a_disagreeing_stage_to_pytorch(small, monkeypatch):
    """build(verify=True): a stage whose result is off (or NaN) against PyTorch's float32 result runs
    on PyTorch instead, listed in fallbacks with its error; stages within VERIFY_TOL keep their kernel."""
    from fusekit.pipeline.runtime import VERIFY_TOL

    pipe = fp.Pipeline(fp.lower_model(small, (2, 3, 20, 20)))
    n = len(pipe.stages)
    pipe._runners = [f"fused {i}" for i in range(n)]
    pipe._stage_weights = [{} for _ in range(n)]
    pipe.engines = [f"eng{i}" for i in range(n)]
    errs = {0: float("nan"), 1: 2 * VERIFY_TOL["float16"], 2: VERIFY_TOL["float16"] / 2}
    monkeypatch.setattr(pipe, "check", lambda: [
        {"stage": i, "name": pipe.stages[i].name, "pattern": pipe.stages[i].pattern, "engine": pipe.engines[i], "rel_err": e}
        for i, e in errs.items()])
    monkeypatch.setattr(pipe, "torch_runner", lambda s, w: f"torch {s.name}")
    pipe._verify()
    assert pipe._runners[:3] == [f"torch {pipe.stages[0].name}", f"torch {pipe.stages[1].name}", "fused 2"]
    assert len(pipe.build_fallbacks) == 2 and "relative error nan" in pipe.build_fallbacks[0]
    assert pipe.engines[1].startswith("torch") and pipe.engines[2] == "eng2"
    assert pipe.fallbacks[-2:] == pipe.build_fallbacks


def test_check_needs_a_built_pipeline(small):
    from fusekit.errors import FusekitError

    with pytest.raises(FusekitError, match="pipeline.check needs a built pipeline"):
        fp.Pipeline(fp.lower_model(small, (2, 3, 20, 20))).check()


@pytest.mark.parametrize("fuse_residual", [False, True])
def test_converted_model_imports_like_the_original(fuse_residual, rng):
    """A model converted with fusekit.torch.convert (its modules traced whole, as torch.nn's; BN called
    with the residual under fuse_residual) lowers to the original's fused program and values."""
    tv = pytest.importorskip("torchvision")
    ft = pytest.importorskip("fusekit.torch")
    torch.manual_seed(0)
    m = tv.models.resnet18(num_classes=10).eval()
    _randomize_bn(m, torch.Generator().manual_seed(3))
    x = rng.standard_normal((1, 3, 64, 64))
    want = fp.lower_model(m, x.shape)
    fk, _ = ft.convert(m, fuse_residual=fuse_residual)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing said while importing (fusekit modules run PyTorch's code on the CPU values)
        got = fp.lower_model(fk.eval(), x.shape)
    assert [s.pattern for s in got.stages] == [s.pattern for s in want.stages]
    assert sum(s.pattern == "conv_bias_add_relu" for s in got.stages) == 8  # every block's end: conv + BN + add + ReLU
    ref = m.double()(torch.from_numpy(x)).detach().numpy()
    m.float()
    assert rel_max(fp.reference.evaluate(got, x), ref) < 1e-10


def test_fusekit_modules_with_their_own_activation_import_with_it(rng):
    ft = pytest.importorskip("fusekit.torch")
    torch.manual_seed(0)
    m = nn.Sequential(ft.Conv2d(3, 8, 3, padding=1, activation="relu6"), ft.Conv2d(8, 8, 3, padding=1, bias=False),
                      ft.BatchNorm2d(8, activation="relu")).eval()
    _randomize_bn(m, torch.Generator().manual_seed(4))
    x = rng.standard_normal((2, 3, 10, 10)) * 4
    prog = fp.lower_model(m, x.shape)
    assert [s.pattern for s in prog.stages] == ["conv_bias_relu6", "conv_bias_relu"], str(prog)
    ref = m.double()(torch.from_numpy(x)).detach().numpy()
    assert rel_max(fp.reference.evaluate(prog, x), ref) < 1e-10


@needs_onnx
@pytest.mark.parametrize("content,match", [(b"not an onnx file at all", "could not be parsed"), (b"", "has no nodes"), (None, "is not a file")])
def test_onnx_file_that_is_missing_truncated_or_not_onnx_is_named(tmp_path, content, match):
    from fusekit.errors import OperandError

    path = tmp_path / "model.onnx"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(OperandError, match=match):
        fp.lower_model(str(path))


@needs_onnx
def test_onnx_model_lowered_for_the_wrong_channel_count_names_the_stage(rng):
    from fusekit.errors import OperandError

    model, _ = _onnx_cnn(rng)
    with pytest.raises(OperandError, match="conv1.*expected 3 input channels"):
        fp.lower_model(model, (2, 4, 8, 8))


def test_reference_of_an_input_of_another_shape_is_refused(small):
    from fusekit.errors import OperandError

    prog = fp.lower_model(small, (2, 3, 20, 20))
    with pytest.raises(OperandError, match=r"expected shape \(2, 3, 20, 20\)"):
        fp.Pipeline(prog).reference(np.zeros((2, 3, 24, 24)))


@needs_onnx
def test_onnx_lowers_and_evaluates_without_pytorch(rng, tmp_path):
    """An ONNX model whose nodes all have fusekit stages needs no PyTorch (torch blocked in a fresh
    process); one with a fallback node says PyTorch is missing, naming the node."""
    import subprocess
    import sys

    model, p = _onnx_cnn(rng)
    onnx.save(model, str(tmp_path / "cnn.onnx"))
    extra, _ = _onnx_cnn(rng, extra="Erf")
    onnx.save(extra, str(tmp_path / "erf.onnx"))
    code = f"""
import sys
sys.modules["torch"] = None  # import torch -> ImportError
import numpy as np
import fusekit.pipeline as fp
from fusekit.errors import UnsupportedError
prog = fp.lower_model({str(tmp_path / "cnn.onnx")!r}, (2, 3, 8, 8))
y = fp.Pipeline(prog).reference(np.ones((2, 3, 8, 8)))
print("shape", y.shape, [s.pattern for s in prog.stages])
try:
    fp.lower_model({str(tmp_path / "erf.onnx")!r}, (2, 3, 8, 8))
except UnsupportedError as e:
    print("refused:", e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "shape (2, 5)" in r.stdout and "'torch'" not in r.stdout
    assert "refused: " in r.stdout and "Erf" in r.stdout and "PyTorch, which is not installed" in r.stdout


def _cli(*args):
    from click.testing import CliRunner

    from fusekit.cli import main

    return CliRunner().invoke(main, list(args))


@needs_onnx
def test_cli_pipeline_refuses_what_it_would_ignore_or_could_never_allocate(rng, tmp_path):
    model, _ = _onnx_cnn(rng)  # input (N, 3, 8, 8): spatial dims fixed
    path = tmp_path / "cnn.onnx"
    onnx.save(model, str(path))
    r = _cli("pipeline", "compile", str(path), "--size", "64", "--no-gpu")
    assert r.exit_code == 2 and "fixed spatial dims (8, 8)" in r.output and "Traceback" not in r.output
    r = _cli("pipeline", "compile", str(path), "--batch", "1000000000000", "--no-gpu")
    assert r.exit_code == 2 and "--batch" in r.output and "MiB" not in r.output
    r = _cli("pipeline", "compile", str(path), "--size", "8", "--batch", "4", "--no-gpu")  # agreeing --size is fine
    assert r.exit_code == 0 and "4x3x8x8" in r.output.replace(" ", ""), r.output
    head = tmp_path / "head.onnx"
    head.write_bytes(path.read_bytes()[:300])
    r = _cli("pipeline", "compile", str(head), "--no-gpu")
    assert r.exit_code == 1 and "could not be parsed" in r.output and "Traceback" not in r.output


@needs_onnx
def test_cli_pipeline_without_a_gpu_points_at_no_gpu(rng, tmp_path):
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present: compile runs")
    except ImportError:
        pass
    model, _ = _onnx_cnn(rng)
    path = tmp_path / "cnn.onnx"
    onnx.save(model, str(path))
    r = _cli("pipeline", "compile", str(path))
    assert r.exit_code == 1 and "--no-gpu" in r.output and "Traceback" not in r.output


@needs_onnx
def test_onnx_from_pytorchs_default_dynamo_exporter(rng):
    """torch.onnx.export's default (dynamo) exporter: the pool as ReduceMean or GlobalAveragePool, the
    flatten as a Reshape with its sizes spelled out, SiLU as x * Sigmoid(x): all fused, no fallback."""
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.bn = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
            self.se1, self.se2, self.fc = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1), nn.Linear(16, 5)
            self.pool = nn.AdaptiveAvgPool2d(1)

        def forward(self, x):
            y = torch.nn.functional.silu(self.bn(self.c1(x)))
            y = y * torch.sigmoid(self.se2(torch.relu(self.se1(self.pool(y)))))
            return self.fc(torch.flatten(self.pool(y), 1))

    m = Net().eval()
    _randomize_bn(m, torch.Generator().manual_seed(5))
    try:
        onnx_program = torch.onnx.export(m, (torch.zeros(2, 3, 12, 12),), dynamo=True, verbose=False)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the dynamo exporter failed here: {type(e).__name__}: {e}")
    prog = fp.lower_model(onnx_program.model_proto, (2, 3, 12, 12))
    assert prog.fallbacks == [], prog.fallbacks
    assert "channel_gate" in [s.pattern for s in prog.stages]
    x = rng.standard_normal((2, 3, 12, 12))
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    m.float()
    assert rel_max(fp.Pipeline(prog).reference(x), want) < 1e-6


def test_onnx_fallback_op_names_are_the_fallback_functions():
    """FALLBACK_OPS (read without importing PyTorch) names exactly the ops _torch_ops implements."""
    pytest.importorskip("torch")
    from fusekit.pipeline.onnx_import import FALLBACK_OPS, _torch_ops

    assert set(_torch_ops()) == FALLBACK_OPS


def test_global_average_pools_are_recognised_and_run_as_a_mean(rng):
    """AdaptiveAvgPool2d(1) and an AvgPool2d whose unpadded window is the whole plane are global
    pools (run as one mean reduction); a smaller window, padding or a divisor override are not.
    PyTorch's run of each stage matches avg_pool2d in float64."""
    from fusekit.pipeline.ir import is_global_pool, run_torch_stage

    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 8, 1),
                      nn.Upsample(scale_factor=6), nn.AvgPool2d(6), nn.Conv2d(8, 8, 1), nn.Upsample(scale_factor=6),
                      nn.AvgPool2d(6, padding=1), nn.Upsample(scale_factor=6), nn.AvgPool2d(3),
                      nn.AvgPool2d(2, divisor_override=3)).eval()
    prog = fp.lower_model(m, (2, 3, 6, 6))
    pools = [s for s in prog.stages if s.pattern == "avg_pool2d"]
    assert [is_global_pool(s) for s in pools] == [True, True, False, False, False], [(s.kind, s.attrs) for s in pools]
    for s in pools:
        x = torch.from_numpy(rng.standard_normal(s.in_shapes[0]))
        a = s.attrs
        want = nn.functional.avg_pool2d(x, a["kernel_size"], a["stride"], a["padding"],
                                        divisor_override=a.get("divisor_override"))
        got = run_torch_stage(s, {s.inputs[0]: x}, None, {}, out=torch.empty(want.shape, dtype=torch.float64))
        assert got.shape == want.shape and float((got - want).abs().max()) < 1e-12


def test_concatenation_parts_are_planned_as_channel_slices():
    """DenseNet's growing concatenations: every part is placed in the block's output buffer at its
    channel offset, every prefix concatenation is a view of it, no two live values overlap, and the
    float64 reference is unchanged."""
    from fusekit.pipeline.memory import plan_memory
    from fusekit.pipeline.ir import concat_parts

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.BatchNorm2d(8 + 4 * k), nn.ReLU(), nn.Conv2d(8 + 4 * k, 4, 3, padding=1))
                                        for k in range(3))

        def forward(self, x):
            feats = [x]
            for layer in self.layers:
                feats.append(layer(torch.cat(feats, 1)))
            return torch.cat(feats, 1)

    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), Block(), nn.Conv2d(20, 4, 1), nn.Flatten()).eval()
    prog = fp.lower_model(m, (2, 3, 6, 6))
    mp = plan_memory(prog, 4)  # float32: 4-channel offsets are 16-byte aligned
    cats = [s for s in prog.stages if concat_parts(s) is not None]
    assert len(cats) == 4
    final = cats[-1]
    offsets = {p: mp.alias[p] for p in concat_parts(final)}
    assert [o for _, o in offsets.values()] == [0, 8, 12, 16] and {r for r, _ in offsets.values()} == {final.output}
    assert all(mp.alias[s.output] == (final.output, 0) for s in cats[:-1])  # the prefixes are views
    assert mp.conflicts() == []
    assert len({mp.assign[v] for v in [*offsets, final.output]}) == 1
    half = plan_memory(prog, 2)  # float16: only offsets of 8 channels (16 bytes) are slices cuDNN takes
    assert {half.alias[p][1] for p in concat_parts(final) if p in half.alias} == {0, 8, 16}
    assert concat_parts(final)[2] not in half.alias and half.conflicts() == []
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 6))
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    assert rel_max(fp.Pipeline(prog).reference(x), want) < 1e-12


def test_a_part_of_two_concatenations_is_placed_once():
    """A value joined into two concatenations at different offsets is a slice of one of them and
    copied into the other; the program's input is never a slice."""
    from fusekit.pipeline.memory import plan_memory

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)

        def forward(self, x):
            a, b = self.a(x), self.b(x)
            return torch.cat([a, b], 1) + torch.cat([b, a], 1) + torch.cat([x, x, a[:, :2], b[:, :2]], 1)[:, :8]

    m = Two().eval()
    prog = fp.lower_model(m, (1, 3, 4, 4))
    mp = plan_memory(prog, 4)  # float32: 4-channel offsets are 16-byte aligned
    from fusekit.pipeline.ir import concat_parts

    cats = [s for s in prog.stages if concat_parts(s) is not None]
    ab, ba, xx = cats
    a, b = concat_parts(ab)
    assert concat_parts(ba) == [b, a]
    assert {mp.alias[a], mp.alias[b]} == {(ab.output, 0), (ab.output, 4)} or {mp.alias[a], mp.alias[b]} == {(ba.output, 4), (ba.output, 0)}
    assert ab.output not in mp.alias and ba.output not in mp.alias  # neither is a slice of the other
    views = {s.output for s in prog.stages if s.attrs.get("channel_slice") is not None}
    # the slices a[:, :2], b[:, :2] sit at channels 6 and 8 of xx: 24 bytes is off cuDNN's alignment, so a[:, :2]
    # stays a view of a (xx copies it) while b[:, :2] is written into xx
    assert prog.input not in mp.alias and all(r == xx.output for p, (r, _) in mp.alias.items() if p in concat_parts(xx) and p not in views)
    assert [mp.alias[p][0] == xx.output for p in concat_parts(xx) if p in views] == [False, True]
    assert mp.conflicts() == []
    x = np.random.default_rng(1).standard_normal((1, 3, 4, 4))
    assert rel_max(fp.Pipeline(prog).reference(x), m.double()(torch.from_numpy(x)).detach().numpy()) < 1e-12


def test_a_full_width_channel_slice_is_a_view(rng):
    """GhostNet's ``torch.cat([a, b], 1)[:, :out_chs]`` with out_chs the whole width: a view of the
    concatenation (no copy, no PyTorch stage); the float64 reference unchanged."""
    from fusekit.pipeline.memory import plan_memory

    class Ghost(nn.Module):
        def __init__(self):
            super().__init__()
            self.primary, self.cheap = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 3, padding=1, groups=4)

        def forward(self, x):
            a = self.primary(x)
            return torch.cat([a, self.cheap(a)], 1)[:, :8]

    m = nn.Sequential(Ghost(), nn.Conv2d(8, 2, 1)).eval()
    prog = fp.lower_model(m, (2, 3, 5, 5))
    assert not prog.fallbacks and [s.pattern for s in prog.stages].count("channel_slice") == 1, str(prog)
    sl = next(s for s in prog.stages if s.pattern == "channel_slice")
    assert plan_memory(prog).alias[sl.output] == (sl.inputs[0], 0)
    x = rng.standard_normal((2, 3, 5, 5))
    assert rel_max(fp.Pipeline(prog).reference(x), m.double()(torch.from_numpy(x)).detach().numpy()) < 1e-12


@pytest.mark.parametrize("take", ["chunk", "split", "slice", "narrow"])
def test_channel_views_are_slices_of_their_input(take, rng):
    """chunk / split items, x[:, a:b] and narrow over channels are marked as channel views at
    import and planned as slices of their input's buffer; a part that also joins a concatenation
    is written there instead; the float64 reference is unchanged."""
    from fusekit.pipeline.memory import plan_memory

    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.branch = nn.Conv2d(3, 8, 1), nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            a, b = {"chunk": lambda: y.chunk(2, 1), "split": lambda: y.split([4, 4], 1),
                    "slice": lambda: (y[:, :4], y[:, 4:]), "narrow": lambda: (y.narrow(1, 0, 4), y.narrow(1, 4, 4))}[take]()
            return torch.cat([a, self.branch(b)], 1)

    m = Split().eval()
    prog = fp.lower_model(m, (2, 3, 5, 5))
    mp = plan_memory(prog, 4)  # float32: 4-channel offsets are 16-byte aligned
    marked = {s.output: s.attrs.get("channel_slice") for s in prog.stages if s.kind == "torch" and s.attrs.get("op") != "cat"}
    assert sorted(marked.values()) == [0, 4], marked
    conv = next(s for s in prog.stages if s.pattern.startswith("conv") and s.inputs == [prog.input])
    b = next(v for v, first in marked.items() if first == 4)
    assert mp.alias[b] == (conv.output, 4)  # the branch reads its half in place
    a = next(v for v, first in marked.items() if first == 0)
    assert mp.alias[a] == (prog.output, 0)  # written into the concatenation (the program output) by its copy
    assert mp.conflicts() == []
    x = rng.standard_normal((2, 3, 5, 5))
    assert rel_max(fp.Pipeline(prog).reference(x), m.double()(torch.from_numpy(x)).detach().numpy()) < 1e-12


def _exported(m, shape, tmp_path) -> str:
    """``m`` exported by PyTorch's TorchScript ONNX exporter (opset 17) to a file; its path."""
    path = tmp_path / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation notice
        torch.onnx.export(m, torch.zeros(shape), str(path), dynamo=False, opset_version=17)
    return str(path)


def test_onnx_channel_splits_and_slices_are_channel_views(tmp_path, rng):
    """ONNX Split and Slice over the channels of an image (what PyTorch's exporter writes for chunk
    and x[:, a:b]) are channel views: planned as slices of their input's buffer, the reference unchanged."""
    pytest.importorskip("onnx")

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.branch = nn.Conv2d(3, 8, 1), nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            a, b = y.chunk(2, 1)
            return torch.cat([a, self.branch(b), y[:, 2:6]], 1)

    m = M().eval()
    prog = fp.lower_model(_exported(m, (2, 3, 5, 5), tmp_path))
    slices = sorted(s.attrs["channel_slice"] for s in prog.stages if s.pattern == "channel_slice")
    assert slices == [0, 2, 4] and not prog.fallbacks, str(prog)
    mp = plan_memory(prog)
    assert mp.conflicts() == [] and mp.alias
    x = rng.standard_normal((2, 3, 5, 5))
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    assert rel_max(fp.Pipeline(prog).reference(x), want) < 1e-6  # the exporter's float32 constants


def test_onnx_channel_shuffle_is_one_stage(tmp_path, rng):
    """The exporter writes a channel shuffle as Reshape, Transpose, Reshape: it imports as one
    channel_shuffle stage (not three copies), matching eager."""
    pytest.importorskip("onnx")
    class Shuffle(nn.Module):  # as ShuffleNetV2 writes it (nn.ChannelShuffle does not export)
        def forward(self, x):
            n, c, h, w = x.shape
            return x.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)

    m = nn.Sequential(nn.Conv2d(3, 8, 1), Shuffle(), nn.Conv2d(8, 4, 1)).eval()
    prog = fp.lower_model(_exported(m, (2, 3, 5, 5), tmp_path))
    assert [s.pattern for s in prog.stages] == ["conv_bias", "channel_shuffle", "conv_bias"] and not prog.fallbacks, str(prog)
    x = rng.standard_normal((2, 3, 5, 5))
    assert rel_max(fp.Pipeline(prog).reference(x), m.double()(torch.from_numpy(x)).detach().numpy()) < 1e-6


def test_a_fallback_that_cannot_run_on_float_stand_ins_is_named():
    """A boolean intermediate (``~(x > 0)``) reaches shape inference as a float stand-in: the lowering
    raises an UnsupportedError naming the stage, not PyTorch's TypeError."""

    class Invert(torch.nn.Module):
        def forward(self, x):
            return x * (~(x > 0))

    with pytest.raises(UnsupportedError, match=r"stage invert \(invert\).*TypeError"):
        fp.lower_model(Invert().eval(), (1, 3, 4, 4))
