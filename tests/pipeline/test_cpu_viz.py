"""CPU: fusekit.viz draws a pattern's lowered graph (operand, virtual and output tensors, ops) without a GPU."""

import pytest

import fusekit
from fusekit.tensors import TensorSpec

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")  # the test process only; the notebooks leave the backend to the environment
plt = pytest.importorskip("matplotlib.pyplot")
viz = pytest.importorskip("fusekit.viz")

CBR = {"x": (2, 8, 9, 9), "w": (16, 8, 3, 3), "b": (16,)}
BNRB = {"dy": (2, 8, 4, 4), "y": (2, 8, 4, 4), "x": (2, 8, 4, 4), "gamma": (8,), "mean": (8,), "inv_var": (8,)}


def texts(fig):
    return {t.get_text() for ax in fig.axes for t in ax.texts}


def test_conv_bias_relu_diagram():
    fig = viz.draw_graph("conv_bias_relu", CBR, {"padding": 1, "stride": 2})
    try:
        got = texts(fig)
        for label in ("x", "w", "b", "y", "conv", "pre", "conv_fprop", "bias", "relu"):
            assert label in got, label
        assert "(2, 16, 5, 5)\nfloat16 NHWC" in got  # y's dims after the stride-2 conv
        assert "(2, 16, 5, 5)\nfloat32 virtual" in got  # conv and pre never reach memory
        assert any("CONV_FPROP" in t for t in got)  # the cuDNN node it lowers to
    finally:
        plt.close(fig)


def test_layout_order_and_kinds():
    tensors, ops = viz.graph_layout("conv_bias_relu", CBR, {"padding": 1})
    assert [o["op"] for o in ops] == ["conv_fprop", "bias", "relu"]
    assert [o["x"] for o in ops] == sorted(o["x"] for o in ops)  # left to right by op order
    assert {n: t["kind"] for n, t in tensors.items()} == {
        "x": "operand", "w": "operand", "b": "operand", "conv": "virtual", "pre": "virtual", "y": "output"}
    assert tensors["b"]["shape"] == (1, 16, 1, 1)  # as cuDNN sees a channel vector
    assert tensors["x"]["x"] < tensors["conv"]["x"] < tensors["y"]["x"]


def test_batchnorm_relu_backward_diagram():
    fig = viz.draw_graph("batchnorm_relu_backward", BNRB)
    try:
        got = texts(fig)
        for label in ("dy", "y", "x", "gamma", "mean", "inv_var", "dz", "dx", "dgamma", "dbeta", "relu_backward", "batchnorm_backward"):
            assert label in got, label
    finally:
        plt.close(fig)


def test_specs_accepted_and_svg():
    specs = {
        "x": TensorSpec.build((2, 8, 9, 9), "float32", 0, "NCHW"),
        "w": TensorSpec.build((16, 8, 3, 3), "float32", 0, "NCHW"),
        "b": TensorSpec.build((1, 16, 1, 1), "float32", 0, "NCHW", view=(16,)),
    }
    tensors, _ = viz.graph_layout("conv_bias_relu", specs, {"padding": 1})
    assert tensors["y"]["dtype"] == "float32" and tensors["y"]["layout"] == "NCHW"
    svg = viz.to_svg("conv_bias_relu", CBR, {"padding": 1})
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg


def test_bad_pattern_name_is_pattern_error():
    with pytest.raises(fusekit.PatternError):
        viz.draw_graph("no_such_pattern", CBR)


def test_bad_shapes_are_operand_errors():
    with pytest.raises(fusekit.OperandError, match="w"):
        viz.draw_graph("conv_bias_relu", {"x": (2, 8, 9, 9), "w": (16, 4, 3, 3), "b": (16,)})
