"""GPU: grouped and depthwise convolutions (forward with every epilogue, dgrad, wgrad, transposed)
against PyTorch float64 on the same rounded inputs. Where cuDNN has no fused engine for a grouped
epilogue, fusekit runs the conv graph and a pointwise one and says so with a FusionWarning: the
results must be right either way; the test prints which path ran."""

import math
import warnings

import pytest
from helpers import rel, rnd

from fusekit import ops
from fusekit.errors import FusionWarning, OperandError

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
F = torch.nn.functional

# (N, C, H, W, K, R, padding, stride, groups)
SHAPES = [
    (2, 32, 14, 14, 32, 3, 1, 1, 32),  # depthwise 3x3 (MobileNet)
    (2, 32, 15, 15, 32, 3, 1, 2, 32),  # depthwise, stride 2, odd size
    (2, 16, 12, 12, 64, 3, 1, 1, 16),  # depthwise with multiplier 4 (K = 4 C)
    (2, 64, 10, 10, 128, 3, 1, 1, 4),  # grouped (ResNeXt-like)
    (1, 24, 9, 9, 48, 1, 0, 1, 2),  # grouped 1x1
]
IDS = [f"n{s[0]}c{s[1]}h{s[2]}k{s[4]}r{s[5]}s{s[7]}g{s[8]}" for s in SHAPES]
TOL = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 5e-3}


def _operands(shape, dtype, cl=True):
    n, c, h, w, k, r, p, s, g = shape
    x = rnd((n, c, h, w), dtype, cl)
    wt = rnd((k, c // g, r, r), dtype, cl, 1 / math.sqrt(c // g * r * r))
    return x, wt, rnd((k,), dtype), dict(padding=p, stride=s, groups=g)


def _run(f, *args, **kw):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        y = f(*args, **kw)
    split = [w for w in got if issubclass(w.category, FusionWarning)]
    print(f"{f.__name__} groups={kw.get('groups')}: {'split graphs' if split else 'one fused graph'}")
    return y


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_grouped_forward_epilogues(shape, dtype, layout):
    x, wt, b, kw = _operands(shape, dtype, layout == "NHWC")
    ref = F.conv2d(x.double(), wt.double(), b.double(), **kw)
    z = rnd(tuple(ref.shape), dtype, layout == "NHWC")
    assert rel(_run(ops.conv2d, x, wt, **kw), F.conv2d(x.double(), wt.double(), None, **kw)) < TOL[dtype]
    assert rel(_run(ops.conv_bias, x, wt, b, **kw), ref) < TOL[dtype]
    y = _run(ops.conv_bias_relu, x, wt, b, **kw)
    assert y.shape == ref.shape and rel(y, ref.relu()) < TOL[dtype]
    assert rel(_run(ops.conv_bias_add_relu, x, wt, b, z, **kw), (ref + z.double()).relu()) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_grouped_backward(shape, dtype):
    x, wt, b, kw = _operands(shape, dtype)
    y = ops.conv_bias(x, wt, b, **kw)
    dy = rnd(tuple(y.shape), dtype, True)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, wt, b)]
    F.conv2d(*leaves, **kw).backward(dy.double())
    dx, dw, db = ops.conv_bias_backward(dy, x, wt, **kw)
    assert dx.shape == x.shape and dw.shape == wt.shape
    for got, leaf, name in zip((dx, dw, db), leaves, ("dx", "dw", "db")):
        err = rel(got, leaf.grad)
        assert err < TOL[dtype], f"{name}: relative error {err:.3e}"


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("groups", [2, 8])
def test_grouped_conv_transpose(groups, dtype):
    n, ci, h, co, r = 2, 16, 9, 32, 3
    x = rnd((n, ci, h, h), dtype, True)
    wt = rnd((ci, co // groups, r, r), dtype, True, 1 / math.sqrt(ci * r * r / groups))
    b = rnd((co,), dtype)
    kw = dict(padding=1, stride=2, output_padding=1, groups=groups)
    y = _run(ops.conv_transpose_bias_relu, x, wt, b, **kw)
    ref = F.conv_transpose2d(x.double(), wt.double(), b.double(), **kw).relu()
    assert y.shape == ref.shape and rel(y, ref) < TOL[dtype]


def test_group_mismatch_is_a_fusekit_error():
    x = rnd((1, 6, 8, 8), "float16", True)
    with pytest.raises(OperandError, match="operand 'w': expected 2 input channels"):
        ops.conv2d(x, rnd((6, 6, 3, 3), "float16", True), groups=3)
    with pytest.raises(OperandError, match="do not split into 4 groups"):
        ops.conv2d(x, rnd((4, 1, 3, 3), "float16", True), groups=4)
