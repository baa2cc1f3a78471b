"""GPU: ReLU6 (the ReLU patterns' ``upper_clip=6``) against PyTorch in float64: the forward clamp and
the backward mask bit for bit at the edges (0 and 6 exactly), and every fused graph that carries the
clipped ReLU (conv epilogue, training BN+ReLU6 and its dReLU6 backward, the dgrad + dReLU6 of the
next conv, scale-shift), in three dtypes and both layouts."""

import math

import pytest
from helpers import rel, rnd

from fusekit import ops
from fusekit.ops.common import relu_bias_grad

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
F = torch.nn.functional

DTYPES = ["float16", "bfloat16", "float32"]
LAYOUTS = ["NHWC", "NCHW"]
TOL = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 5e-3}
BN_TOL = {"float16": 4e-3, "bfloat16": 2.5e-2, "float32": 1e-4}


def edgy(shape, dtype, cl):
    """Values spread over [-4, 10] (a quarter above 6), with exact 0s and 6s planted."""
    x = rnd(shape, dtype, cl) * 4 + 3
    flat = x.view(-1) if x.is_contiguous() else x.permute(0, 2, 3, 1).reshape(-1)
    assert flat.data_ptr() == x.data_ptr()
    flat[::7] = 0.0
    flat[3::11] = 6.0
    return x


def mask6(y):
    return (y > 0) & (y < 6)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_relu6_forward_and_backward_are_exact(dtype, layout):
    cl = layout == "NHWC"
    x = edgy((4, 24, 9, 9), dtype, cl)
    y = ops.call("relu", x, upper_clip=6.0)
    assert torch.equal(y, torch.clamp(x, 0, 6)) and y.is_contiguous(memory_format=torch.channels_last) == cl
    assert bool((y == 6).any()) and bool((y == 0).any())
    dy = rnd(tuple(x.shape), dtype, cl)
    dx = ops.relu_backward(dy, y, upper_clip=6.0)
    assert torch.equal(dx, dy * mask6(y))
    assert torch.equal(ops.relu_backward(dy, y), dy * (y > 0))  # the plain ReLU's mask is unchanged
    dz, db = relu_bias_grad(dy, y, True, 6.0)  # the relu_bias_grad graph (or its split) with the clip
    assert torch.equal(dz, dy * mask6(y))
    assert rel(db, (dy.double() * mask6(y)).sum((0, 2, 3))) < 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [1, 24])
def test_conv_bias_relu6_forward_and_backward(groups, dtype, layout):
    """Dense and depthwise (MobileNet's) conv + bias + ReLU6 forward; its backward (dReLU6 + bias
    gradient, dgrad, wgrad) against float64 autograd through fusekit's own clip mask."""
    cl = layout == "NHWC"
    c = 24
    x = rnd((4, c, 10, 10), dtype, cl) * 3
    wt = rnd((c, c // groups, 3, 3), dtype, cl, 3 / math.sqrt(9 * c // groups))
    b = rnd((c,), dtype) + 2
    kw = dict(padding=1, stride=1, dilation=1, groups=groups)
    y = ops.conv_bias_relu6(x, wt, b, **kw)
    pre = F.conv2d(x.double(), wt.double(), b.double(), **kw)
    assert rel(y, pre.clamp(0, 6)) < TOL[dtype]
    assert float((y == 6).double().mean()) > 0.05, "the clip must matter"
    dy = rnd(tuple(y.shape), dtype, cl)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, wt, b)]
    (F.conv2d(*leaves, **kw) * mask6(y).double()).backward(dy.double())  # the mask of fusekit's own y
    dx, dw, db = ops.conv_bias_relu_backward(dy, x, wt, y, upper_clip=6.0, **kw)
    for got, want, name in ((dx, leaves[0].grad, "dx"), (dw, leaves[1].grad, "dw"), (db, leaves[2].grad, "db")):
        assert rel(got, want) < 2 * TOL[dtype], f"{name} {rel(got, want):.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_dgrad_drelu6_fusion(dtype):
    """dx of a conv whose input is a ReLU6 output, with that ReLU6's backward fused into the dgrad."""
    x0 = rnd((4, 16, 12, 12), dtype, True) * 4 + 2
    x = torch.clamp(x0, 0, 6)
    wt = rnd((32, 16, 3, 3), dtype, True, 1 / 12)
    dy = rnd((4, 32, 12, 12), dtype, True)
    kw = dict(padding=1, stride=1, dilation=1, groups=1)
    dx, _ = ops.conv2d_backward(dy, x, wt, needs=(True, False), input_relu=True, input_clip=6.0, **kw)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, wt)]
    F.conv2d(*leaves, **kw).backward(dy.double())
    want = leaves[0].grad * mask6(x).double()
    assert rel(dx, want) < TOL[dtype]
    assert torch.equal(dx[~mask6(x)], torch.zeros_like(dx[~mask6(x)]))  # 0 and 6 exactly: no gradient


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_batchnorm_relu6_training_forward_and_backward(dtype, layout):
    """Training BN + ReLU6 (one graph, or its split where cuDNN refuses) and the dReLU6 + BN backward,
    against float64 F.batch_norm; running statistics as PyTorch's."""
    cl = layout == "NHWC"
    n, c = 8, 32
    x = rnd((n, c, 7, 7), dtype, cl) + 0.5
    gamma = (torch.rand(c, device="cuda") * 4 + 2).float()  # outputs above 6 in every channel
    beta = (torch.rand(c, device="cuda") + 1).float()
    rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    y, mean, inv, nrm, nrv = ops.batchnorm(x, gamma, beta, rm, rv, epsilon=1e-5, momentum=0.1, relu=True, upper_clip=6.0)
    rm64, rv64 = rm.double().clone(), rv.double().clone()
    leaves = [t.detach().double().requires_grad_(True) for t in (x, gamma, beta)]
    pre = F.batch_norm(leaves[0], rm64, rv64, leaves[1], leaves[2], training=True, momentum=0.1, eps=1e-5)
    assert rel(y, pre.clamp(0, 6)) < BN_TOL[dtype]
    assert float((y == 6).double().mean()) > 0.05 and float((y == 0).double().mean()) > 0.02
    assert rel(nrm, rm64) < 1e-5 and rel(nrv, rv64) < 1e-5
    dy = rnd(tuple(y.shape), dtype, cl)
    (pre * mask6(y).double()).backward(dy.double())
    dx, dg, db = ops.batchnorm_backward(dy, x, gamma, mean, inv, y=y, upper_clip=6.0)
    for got, want, name in ((dx, leaves[0].grad, "dx"), (dg, leaves[1].grad, "dgamma"), (db, leaves[2].grad, "dbeta")):
        assert rel(got, want) < 2 * BN_TOL[dtype] + 1e-4, f"{name} {rel(got, want):.2e}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_shift_and_inference_bn_relu6(dtype, layout):
    cl = layout == "NHWC"
    c = 16
    x = rnd((4, c, 6, 6), dtype, cl) * 3
    g, b = (torch.rand(c, device="cuda") * 3 + 1).float(), (torch.rand(c, device="cuda") * 2).float()
    y = ops.channel_scale_shift(x, g, b, relu=True, upper_clip=6.0)
    want = (x.double() * g.double().view(1, -1, 1, 1) + b.double().view(1, -1, 1, 1)).clamp(0, 6)
    assert rel(y, want) < TOL[dtype] and bool((y == 6).any())
    mean, inv_std = torch.randn(c, device="cuda") * 0.1, (torch.rand(c, device="cuda") + 0.5)
    y2 = ops.batchnorm_inference(x, mean, inv_std, g, b, relu=True, upper_clip=6.0)
    want2 = ((x.double() - mean.double().view(1, -1, 1, 1)) * (inv_std * g).double().view(1, -1, 1, 1)
             + b.double().view(1, -1, 1, 1)).clamp(0, 6)
    assert rel(y2, want2) < TOL[dtype]
    dy = rnd(tuple(y.shape), dtype, cl)
    dx, dg, db = ops.channel_scale_shift_backward(dy, x, g, y=y, upper_clip=6.0)
    dz = dy.double() * mask6(y)
    assert rel(dx, dz * g.double().view(1, -1, 1, 1)) < TOL[dtype]
    assert rel(dg, (dz * x.double()).sum((0, 2, 3))) < 1e-3 and rel(db, dz.sum((0, 2, 3))) < 1e-3
