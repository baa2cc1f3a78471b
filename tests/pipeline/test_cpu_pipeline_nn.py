"""fusekit.pipeline import of a fusekit.nn.Sequential, on the CPU: layers stand in as plain objects with
the attributes fusekit.nn's layers have (CuPy needs a GPU to make real ones); the lowered program's
float64 reference is checked against the layers' math written out in NumPy."""

import numpy as np
import pytest

import fusekit.pipeline as fp
from fusekit.engine import oracle
from fusekit.errors import UnsupportedError
from fusekit.ops import pool


def _layer(kind, **attrs):
    cls = type(kind, (), {"__module__": "fusekit.nn"})
    obj = cls()
    obj.__dict__.update(attrs)
    return obj


class _P:  # fusekit.nn.Parameter
    def __init__(self, data):
        self.data = data


def _model(rng):
    w1, b1 = rng.standard_normal((8, 3, 3, 3)) * 0.3, rng.standard_normal(8) * 0.1
    bn = dict(num_features=8, eps=1e-5, relu=True, weight=_P(rng.uniform(0.5, 1.5, 8)), bias=_P(rng.standard_normal(8) * 0.1),
              running_mean=rng.standard_normal(8) * 0.2, running_var=rng.uniform(0.5, 1.5, 8))
    w2, b2 = rng.standard_normal((16, 8, 3, 3)) * 0.2, rng.standard_normal(16) * 0.1
    wl, bl = rng.standard_normal((5, 16 * 4 * 4)) * 0.05, rng.standard_normal(5) * 0.1
    conv = dict(padding=1, stride=1, dilation=1)
    layers = [
        _layer("Conv2d", weight=_P(w1), bias=_P(b1), conv=conv, activation=None),
        _layer("BatchNorm2d", **bn),
        _layer("MaxPool2d", kernel_size=2, stride=None, padding=0),
        _layer("Sequential", layers=[_layer("Conv2d", weight=_P(w2), bias=_P(b2), conv=dict(conv, stride=2), activation="relu")]),
        _layer("Flatten"),
        _layer("Linear", weight=_P(wl), bias=_P(bl), activation=None),
        _layer("Softmax", axis=1, log=False),
    ]
    seq = _layer("Sequential", layers=layers)

    def numpy_forward(x):
        (y,) = oracle.evaluate("conv_bias", x, w1, b1, padding=1)
        sh = (1, -1, 1, 1)
        y = (y - bn["running_mean"].reshape(sh)) / np.sqrt(bn["running_var"].reshape(sh) + 1e-5)
        y = np.maximum(y * bn["weight"].data.reshape(sh) + bn["bias"].data.reshape(sh), 0)
        y = oracle.max_pool2d_reference(y, 2, 2, 0)[0]
        (y,) = oracle.evaluate("conv_bias_relu", y, w2, b2, padding=1, stride=2)
        y = y.reshape(y.shape[0], -1) @ wl.T + bl
        e = np.exp(y - y.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    return seq, numpy_forward


def test_sequential_lowers_to_fused_stages_and_matches_its_math(rng):
    seq, numpy_forward = _model(rng)
    x = rng.standard_normal((2, 3, 16, 16))
    prog = fp.lower_model(seq, x.shape)
    assert prog.source == "fusekit.nn"
    assert [s.pattern for s in prog.stages] == ["conv_bias_relu", "max_pool2d", "conv_bias_relu", "reshape", "linear_bias", "softmax"]
    assert not prog.fallbacks
    assert prog.output_shape == (2, 5)
    got = fp.Pipeline(prog).reference(x)
    want = numpy_forward(x)
    assert np.abs(got - want).max() < 1e-12


def test_sequential_without_running_stats_or_unknown_layer_is_refused(rng):
    seq, _ = _model(rng)
    seq.layers[1].running_mean = None
    with pytest.raises(UnsupportedError, match="without running statistics"):
        fp.lower_model(seq, (2, 3, 16, 16))
    odd = _layer("Sequential", layers=[_layer("Dropout2d")])
    with pytest.raises(UnsupportedError, match=r"fusekit.nn.Dropout2d has no pipeline rule \(supported: Conv2d"):
        fp.lower_model(odd, (2, 3, 16, 16))
    with pytest.raises(TypeError, match="needs an example input"):
        fp.trace(seq)


def test_relu6_layers_lower_to_a_clipped_conv_epilogue(rng):
    """Conv2d(activation="relu6") lowers to one conv_bias_relu6 stage, a ReLU6 layer after a conv too,
    and a dilated max pool keeps its dilation; values as the layers' math."""
    w1, b1 = rng.standard_normal((8, 3, 3, 3)), rng.standard_normal(8)
    w2, b2 = rng.standard_normal((4, 8, 1, 1)), rng.standard_normal(4)
    conv = dict(padding=1, stride=1, dilation=1)
    seq = _layer("Sequential", layers=[
        _layer("Conv2d", weight=_P(w1), bias=_P(b1), conv=conv, activation="relu6"),
        _layer("Conv2d", weight=_P(w2), bias=_P(b2), conv=dict(conv, padding=0), activation=None), _layer("ReLU6"),
        _layer("MaxPool2d", kernel_size=3, stride=1, padding=1, dilation=2, ceil_mode=False),
    ])
    x = 3 * rng.standard_normal((2, 3, 10, 10))
    prog = fp.lower_model(seq, x.shape)
    assert [s.pattern for s in prog.stages] == ["conv_bias_relu6", "conv_bias_relu6", "max_pool2d"]
    (y,) = oracle.evaluate("conv_bias", x, w1, b1, padding=1)
    y = np.clip(y, 0, 6)
    assert (y == 6).mean() > 0.05
    (y,) = oracle.evaluate("conv_bias", y, w2, b2)
    want = oracle.max_pool2d_reference(np.clip(y, 0, 6), 3, 1, 1, dilation=2)[0]
    assert np.abs(fp.Pipeline(prog).reference(x) - want).max() < 1e-12


@pytest.mark.parametrize("count_include_pad", [True, False])
def test_sequential_average_pool_lowers_with_its_arguments(rng, count_include_pad):
    """fusekit.nn.AvgPool2d (kernel, stride, padding as its args; count_include_pad, ceil_mode) is an
    avgpool stage whose float64 reference is the oracle's."""
    seq = _layer("Sequential", layers=[_layer("AvgPool2d", args=(3, 2, 1), count_include_pad=count_include_pad, ceil_mode=True)])
    x = rng.standard_normal((2, 3, 9, 10))
    prog = fp.lower_model(seq, x.shape)
    (st,) = prog.stages
    assert st.pattern == "avg_pool2d" and st.attrs["kernel_size"] == (3, 3) and st.attrs["stride"] == (2, 2)
    want = oracle.avg_pool2d_reference(x, 3, 2, 1, ceil_mode=True, count_include_pad=count_include_pad)
    assert np.abs(fp.Pipeline(prog).reference(x) - want).max() < 1e-12
