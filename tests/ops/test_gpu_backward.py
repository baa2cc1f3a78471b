"""GPU: backward passes, transposed convolution and fully connected layers against PyTorch autograd
in float64 on the same (rounded) inputs, plus the torch modules and the training run."""

import math
import sys
from pathlib import Path

import pytest
from helpers import rel, rnd

from fusekit import ops

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
F = torch.nn.functional

# (N, C, H, W, K, R, padding, stride, dilation)
SHAPES = [
    (2, 16, 12, 12, 32, 3, 1, 1, 1),
    (2, 16, 13, 13, 24, 3, 1, 2, 1),  # stride 2, odd size
    (4, 32, 8, 8, 64, 1, 0, 1, 1),  # 1x1
    (1, 5, 9, 11, 7, 3, 1, 1, 1),  # batch 1, odd channels
    (2, 8, 16, 16, 8, 3, 2, 1, 2),  # dilation 2
    (1, 3, 20, 20, 16, 5, 2, 2, 1),  # 5x5 stride 2, C=3
]
IDS = [f"n{s[0]}c{s[1]}h{s[2]}w{s[3]}k{s[4]}r{s[5]}p{s[6]}s{s[7]}d{s[8]}" for s in SHAPES]
TOL = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 5e-3}


def masked(f, y):
    """f followed by the ReLU mask of fusekit's own output y. The backward under test multiplies by
    (y > 0); a float64 forward would put a few elements with |pre-activation| below the forward's
    rounding on the other side of zero and each such flip costs a whole dy element, which would
    measure the forward's rounding (TF32 for float32, the bf16 intermediate of a split graph), not
    the backward. The forward is checked on its own against the float64 ReLU output."""
    mask = (y.double() > 0).double()
    return lambda *a: f(*a) * mask


def ref_grads(f, inputs, dy):
    leaves = [t.detach().double().requires_grad_(True) for t in inputs]
    y = f(*leaves)
    y.backward(dy.double())
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_conv_bias_relu_backward(shape, dtype, layout):
    n, c, h, w, k, r, p, s, d = shape
    cl = layout == "NHWC"
    x, wt, b = rnd((n, c, h, w), dtype, cl), rnd((k, c, r, r), dtype, cl, 1 / math.sqrt(c * r * r)), rnd((k,), dtype)
    kw = dict(padding=p, stride=s, dilation=d)
    y = ops.conv_bias_relu(x, wt, b, **kw)
    dy = rnd(tuple(y.shape), dtype, cl)
    yr = torch.relu(F.conv2d(x.double(), wt.double(), b.double(), **kw))
    assert rel(y, yr) < TOL[dtype]
    _, (dxr, dwr, dbr) = ref_grads(masked(lambda a, b_, c_: F.conv2d(a, b_, c_, **kw), y), [x, wt, b], dy)
    dx, dw, db = ops.conv_bias_relu_backward(dy, x, wt, y, **kw)
    assert dx.shape == x.shape and dw.shape == wt.shape and db.shape == b.shape
    assert rel(dx, dxr) < TOL[dtype] and rel(dw, dwr) < TOL[dtype] and rel(db, dbr) < TOL[dtype]
    if cl:
        assert dx.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("shape", SHAPES[:4], ids=IDS[:4])
def test_conv_bias_and_conv_backward(shape, dtype):
    n, c, h, w, k, r, p, s, d = shape
    x, wt, b = rnd((n, c, h, w), dtype, True), rnd((k, c, r, r), dtype, True, 1 / math.sqrt(c * r * r)), rnd((k,), dtype)
    kw = dict(padding=p, stride=s, dilation=d)
    y = ops.conv_bias(x, wt, b, **kw)
    dy = rnd(tuple(y.shape), dtype, True)
    _, (dxr, dwr, dbr) = ref_grads(lambda a, b_, c_: F.conv2d(a, b_, c_, **kw), [x, wt, b], dy)
    dx, dw, db = ops.conv_bias_backward(dy, x, wt, **kw)
    assert max(rel(dx, dxr), rel(dw, dwr), rel(db, dbr)) < TOL[dtype]
    dx2, dw2 = ops.conv2d_backward(dy, x, wt, **kw)
    assert max(rel(dx2, dxr), rel(dw2, dwr)) < TOL[dtype]


def test_only_requested_gradients_are_made():
    x, wt, b = rnd((2, 8, 10, 10), "float16", True), rnd((16, 8, 3, 3), "float16", True, 0.1), rnd((16,), "float16")
    y = ops.conv_bias_relu(x, wt, b, padding=1)
    dy = rnd(tuple(y.shape), "float16", True)
    dx, dw, db = ops.conv_bias_relu_backward(dy, x, wt, y, padding=1, needs=(False, True, False))
    assert dx is None and db is None and dw is not None
    _, (_, dwr, _) = ref_grads(lambda a, b_, c_: torch.relu(F.conv2d(a, b_, c_, padding=1)), [x, wt, b], dy)
    assert rel(dw, dwr) < TOL["float16"]


@pytest.mark.parametrize("lib", ["torch", "cupy"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("c", [1, 3, 16])
def test_few_channel_bias_gradients(c, dtype, lib):
    """ReLU backward + bias gradient and the bias gradient alone on few channels (run on rows of
    pixels of the channels-last memory) against float64, torch tensors and CuPy NHWC arrays."""
    import fusekit
    from fusekit.ops.common import bias_grad, relu_bias_grad

    dy, y = rnd((64, c, 32, 32), dtype, True), torch.relu(rnd((64, c, 32, 32), dtype, True))
    want = dy.double() * (y.double() > 0)
    if lib == "cupy":
        cp = pytest.importorskip("cupy")
        as_cp = lambda t: fusekit.nhwc(cp.from_dlpack(t.permute(0, 2, 3, 1).contiguous()))  # noqa: E731
        dz, db = relu_bias_grad(as_cp(dy), as_cp(y), True)
        dz = torch.from_dlpack(dz.transpose(0, 2, 3, 1).copy()).permute(0, 3, 1, 2)
        db, db_only = torch.from_dlpack(db), torch.from_dlpack(bias_grad(as_cp(dy)))
    else:
        dz, db = relu_bias_grad(dy, y, True)
        db_only = bias_grad(dy)
        assert dz.is_contiguous(memory_format=torch.channels_last)
    assert dz.shape == dy.shape and db.shape == db_only.shape == (c,)
    assert rel(dz, want) == 0.0
    # each channel sums 65,536 terms that largely cancel (C = 1, float32, H100: 3.0e-5 relative to a sum
    # of 1.77, about 2e-9 of the terms' magnitudes): the error is bounded against the sum of |terms|, which
    # one term dropped or counted twice (~1 of ~3e4) would still exceed 30-fold
    for got, terms in ((db, want), (db_only, dy.double())):
        err = (got.double() - terms.sum((0, 2, 3))).abs() / terms.abs().sum((0, 2, 3))
        assert float(err.max()) < 1e-6


@pytest.mark.parametrize("shape", SHAPES[:3], ids=IDS[:3])
def test_dgrad_drelu_fusion(shape):
    """dx with the previous ReLU's backward fused (x = that ReLU's output)."""
    n, c, h, w, k, r, p, s, d = shape
    x0 = rnd((n, c, h, w), "float16", True)
    x = torch.relu(x0)  # this conv's input came out of a ReLU
    wt, b = rnd((k, c, r, r), "float16", True, 1 / math.sqrt(c * r * r)), rnd((k,), "float16")
    kw = dict(padding=p, stride=s, dilation=d)
    y = ops.conv_bias_relu(x, wt, b, **kw)
    dy = rnd(tuple(y.shape), "float16", True)
    _, (dx0r, _, _) = ref_grads(lambda a, b_, c_: torch.relu(F.conv2d(torch.relu(a), b_, c_, **kw)), [x0, wt, b], dy)
    dx, _, _ = ops.conv_bias_relu_backward(dy, x, wt, y, input_relu=True, **kw)
    assert rel(dx, dx0r) < TOL["float16"]


# (N, C_in, H, W, C_out, R, padding, stride, output_padding)
TSHAPES = [(2, 16, 8, 8, 8, 3, 1, 2, 1), (1, 32, 7, 9, 3, 4, 1, 2, 0), (2, 8, 10, 10, 16, 3, 1, 1, 0), (3, 5, 6, 6, 7, 3, 0, 2, 1)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", TSHAPES)
@pytest.mark.parametrize("relu", [True, False])
def test_conv_transpose(shape, dtype, relu):
    n, ci, h, w, co, r, p, s, op = shape
    x, wt, b = rnd((n, ci, h, w), dtype, True), rnd((ci, co, r, r), dtype, True, 1 / math.sqrt(ci * r * r)), rnd((co,), dtype)
    kw = dict(padding=p, stride=s, output_padding=op)
    f = ops.conv_transpose_bias_relu if relu else ops.conv_transpose_bias
    y = f(x, wt, b, **kw)
    act = torch.relu if relu else (lambda t: t)
    dy = rnd(tuple(y.shape), dtype, True)
    yr = act(F.conv_transpose2d(x.double(), wt.double(), b.double(), **kw))
    assert y.shape == yr.shape and rel(y, yr) < TOL[dtype]
    f = lambda a, b_, c_: F.conv_transpose2d(a, b_, c_, **kw)  # noqa: E731
    _, (dxr, dwr, dbr) = ref_grads(masked(f, y) if relu else f, [x, wt, b], dy)
    dx, dw, db = ops.conv_transpose_bias_relu_backward(dy, x, wt, y, padding=p, stride=s, relu=relu)
    assert max(rel(dx, dxr), rel(dw, dwr), rel(db, dbr)) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("dims", [(32, 64, 48), (1, 17, 5), (128, 256, 10), (7, 33, 65)])
@pytest.mark.parametrize("relu", [True, False])
def test_linear(dims, dtype, relu):
    bsz, fin, fout = dims
    x, wt, b = rnd((bsz, fin), dtype), rnd((fout, fin), dtype, scale=1 / math.sqrt(fin)), rnd((fout,), dtype)
    y = (ops.linear_bias_relu if relu else ops.linear_bias)(x, wt, b)
    act = torch.relu if relu else (lambda t: t)
    dy = rnd((bsz, fout), dtype)
    yr = act(F.linear(x.double(), wt.double(), b.double()))
    assert y.shape == (bsz, fout) and rel(y, yr) < TOL[dtype]
    f = lambda a, b_, c_: F.linear(a, b_, c_)  # noqa: E731
    _, (dxr, dwr, dbr) = ref_grads(masked(f, y) if relu else f, [x, wt, b], dy)
    if relu:
        dx, dw, db = ops.linear_bias_relu_backward(dy, x, wt, y)
    else:
        dx, dw, db = ops.linear_bias_backward(dy, x, wt)
    assert dx.shape == x.shape and dw.shape == wt.shape and db.shape == b.shape
    assert max(rel(dx, dxr), rel(dw, dwr), rel(db, dbr)) < TOL[dtype]


def test_torch_modules_match_eager_gradients():
    """fusekit.torch modules are drop-ins: same forward and gradients as torch.nn (float32, TF32 tolerance)."""
    import fusekit.torch as ft

    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1),
        torch.nn.Flatten(), torch.nn.Linear(4 * 16 * 16, 10), torch.nn.ReLU(),
    ).cuda()
    fused = torch.nn.Sequential(
        ft.Conv2d(3, 8, 3, padding=1, activation="relu"), ft.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1),
        torch.nn.Flatten(), ft.Linear(4 * 16 * 16, 10, activation="relu"),
    ).cuda()
    fused[0].load_state_dict(eager[0].state_dict())
    fused[1].load_state_dict(eager[2].state_dict())
    fused[3].load_state_dict(eager[4].state_dict())
    x = torch.randn(4, 3, 8, 8, device="cuda")
    ye, yf = eager(x), fused(x)
    assert rel(yf.detach(), ye.detach().double()) < 5e-3
    g = torch.randn_like(ye)
    ye.backward(g)
    yf.backward(g)
    for pe, pf in zip([eager[0], eager[2], eager[4]], [fused[0], fused[1], fused[3]]):
        assert rel(pf.weight.grad, pe.weight.grad.double()) < 5e-3
        assert rel(pf.bias.grad, pe.bias.grad.double()) < 5e-3


def test_autoencoder_trains_like_eager():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import autoencoder

    steps = 300
    fk, ea = autoencoder.run(steps)
    print(f"loss {fk[0]:.4f} -> {fk[-1]:.5f} (fusekit), {ea[0]:.4f} -> {ea[-1]:.5f} (eager)")
    assert all(math.isfinite(v) for v in fk)
    assert fk[0] / min(fk[-10:]) >= 10, "the loss must fall at least 10x"
    checkpoints = list(range(0, steps, 30)) + [steps - 1]
    worst = max(abs(fk[i] - ea[i]) / ea[i] for i in checkpoints)
    print(f"worst relative gap to the eager loss curve at checkpoints: {worst:.3f}")
    assert worst < 0.15
