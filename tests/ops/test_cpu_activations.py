"""CPU: activations as an attribute of fused graphs (the ``act`` op): the float64 oracle against
PyTorch's definitions, attribute checks, and the cuDNN graph each activation lowers to."""

import math

import numpy as np
import pytest

import fusekit
from fusekit.engine import oracle
from fusekit.engine.lower import lower
from fusekit.engine.patterns import ACTIVATIONS
from fusekit.errors import OperandError
from fusekit.tensors import TensorSpec

# activation -> (alpha, PyTorch function name and kwargs)
TORCH = {
    "identity": (0.0, None), "relu": (0.0, ("relu", {})), "clip": (6.0, ("relu6", {})), "silu": (0.0, ("silu", {})),
    "gelu": (0.0, ("gelu", {})), "gelu_tanh": (0.0, ("gelu", {"approximate": "tanh"})), "sigmoid": (0.0, ("sigmoid", {})),
    "tanh": (0.0, ("tanh", {})), "hardswish": (0.0, ("hardswish", {})), "hardsigmoid": (0.0, ("hardsigmoid", {})),
    "leaky_relu": (0.1, ("leaky_relu", {"negative_slope": 0.1})), "elu": (0.7, ("elu", {"alpha": 0.7})),
}

# activation -> pointwise modes of its cuDNN lowering, in order
MODES = {
    "identity": ["identity"], "relu": ["relu"], "clip": ["relu"], "silu": ["swish"], "gelu": ["gelu"],
    "gelu_tanh": ["gelu_approx_tanh"], "sigmoid": ["sigmoid"], "tanh": ["tanh"], "leaky_relu": ["leaky_relu"],
    "hardsigmoid": ["mul", "add", "relu"], "hardswish": ["add", "relu", "mul", "mul"], "elu": ["min", "exp", "sub", "mul", "relu", "add"],
}


def test_every_activation_is_tested():
    assert set(TORCH) == set(ACTIVATIONS) == set(MODES)


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_oracle_matches_pytorch_float64(act):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal(4000) * 5
    x[:4] = [-3.0, 3.0, 0.0, 6.0]  # the kinks
    alpha, fn = TORCH[act]
    got = oracle.activation(x, act, alpha)
    t = torch.from_numpy(x)
    want = t if fn is None else getattr(torch.nn.functional, fn[0])(t, **fn[1])
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-13, atol=1e-15)


def test_elu_oracle_alpha_one_and_large_inputs_stay_finite():
    x = np.array([-800.0, -1.0, 0.0, 800.0])
    for act in ("sigmoid", "silu", "elu", "gelu", "tanh"):
        assert np.isfinite(oracle.activation(x, act, 1.0)).all(), act


@pytest.mark.parametrize("bad", [{"activation": "swish"}, {"activation": 3}, {"activation": "clip", "alpha": 0.0},
                                 {"activation": "leaky_relu", "alpha": float("nan")}])
def test_bad_activation_attributes_are_named(bad):
    x, w, b = np.ones((1, 2, 3, 3)), np.ones((2, 2, 1, 1)), np.zeros(2)
    with pytest.raises(OperandError) as e:
        oracle.evaluate("conv_bias_act", x, w, b, **bad)
    assert "conv_bias_act" in str(e.value) and ("activation" in str(e.value) or "alpha" in str(e.value))


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_conv_bias_act_oracle_is_conv_then_activation(act):
    rng = np.random.default_rng(2)
    x, w, b = rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(4)
    alpha = TORCH[act][0]
    pre = oracle.evaluate("conv_bias", x, w, b, padding=1)[0]
    got = oracle.evaluate("conv_bias_act", x, w, b, padding=1, activation=act, alpha=alpha)[0]
    np.testing.assert_allclose(got, oracle.activation(pre, act, alpha), rtol=0, atol=0)


def test_scale_shift_act_gate_and_add_act_oracles():
    rng = np.random.default_rng(3)
    x, s = rng.standard_normal((2, 5, 4, 4)), rng.standard_normal((2, 5, 1, 1))
    g, b = rng.standard_normal(5), rng.standard_normal(5)
    y = oracle.evaluate("channel_scale_shift_act", x, g, b, activation="hardswish")[0]
    np.testing.assert_allclose(y, oracle.activation(x * g.reshape(1, -1, 1, 1) + b.reshape(1, -1, 1, 1), "hardswish"))
    np.testing.assert_allclose(oracle.evaluate("channel_gate", x, s)[0], x * s)
    np.testing.assert_allclose(oracle.evaluate("add_act", x, x, activation="silu")[0], oracle.activation(2 * x, "silu"))
    with pytest.raises(OperandError, match="channel_gate"):
        oracle.evaluate("channel_gate", x, rng.standard_normal((1, 4, 1, 1)))


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
@pytest.mark.parametrize("pattern", ["conv_bias_act", "linear_bias_act", "act"])
def test_lowered_graph_has_the_activation_modes(pattern, act):
    pytest.importorskip("cudnn")
    pat = fusekit.get_pattern(pattern)
    attrs = dict(pat.normalize_attrs({"activation": act, "alpha": TORCH[act][0]}))
    if pattern == "conv_bias_act":
        specs = {"x": TensorSpec.build((2, 8, 6, 6), "float16", 0, "NHWC"), "w": TensorSpec.build((4, 8, 3, 3), "float16", 0, "NHWC"),
                 "b": TensorSpec.build((1, 4, 1, 1), "float16", 0, "NCHW"), "y": TensorSpec.build((2, 4, 4, 4), "float16", 0, "NHWC")}
        head = ["CONV_FPROP", "bias"]
    elif pattern == "linear_bias_act":
        specs = {"x": TensorSpec.build((1, 5, 8), "float16", 0, "ROW"), "w": TensorSpec.build((1, 8, 3), "float16", 0, "ROW"),
                 "b": TensorSpec.build((1, 1, 3), "float16", 0, "ROW"), "y": TensorSpec.build((1, 5, 3), "float16", 0, "ROW")}
        head = ["MATMUL", "bias"]
    else:
        specs = {"x": TensorSpec.build((2, 8, 6, 6), "float32", 0, "NHWC"), "y": TensorSpec.build((2, 8, 6, 6), "float32", 0, "NHWC")}
        head = []
    info = lower(pat, specs, attrs).graph.inspect()
    got = [nd["params"]["mode"] if nd["type"] == "POINTWISE" else nd["type"] for nd in info["nodes"]]
    assert got == head + MODES[act]
    rank = len(specs["x"].shape)
    for t in info["tensors"].values():  # scalar constants carry the I/O rank (they broadcast)
        if t.get("is_pass_by_value"):
            assert t["dim"] == [1] * rank
    last = info["nodes"][-1]
    if act == "clip":
        assert last["params"]["upper_clip"] == pytest.approx(6.0)
    if act == "hardsigmoid":
        assert last["params"]["upper_clip"] == pytest.approx(1.0)
    assert not math.isnan(attrs["alpha"])
