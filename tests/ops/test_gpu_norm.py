"""GPU: batch norm split into normalize / scale / shift and fused back, against PyTorch in float64."""


import pytest

import fusekit
from fusekit import ops
from helpers import rel  # noqa: E402

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
F = torch.nn.functional

CHANNELS = [1, 3, 64, 257]
TOL = {"float16": 4e-3, "bfloat16": 2.5e-2, "float32": 1e-4}
STAT_TOL = 1e-4


def img(n, c, h, w, dtype, layout):
    t = torch.randn(n, c, h, w, device="cuda").to(getattr(torch, dtype)) * 2 + 0.5
    return t.contiguous(memory_format=torch.channels_last) if layout == "NHWC" else t.contiguous()


def vec(c, lo=0.5, hi=1.5):
    return torch.rand(c, device="cuda") * (hi - lo) + lo


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("c", CHANNELS)
@pytest.mark.parametrize("relu", [False, True])
def test_batchnorm_training_forward_backward(c, dtype, layout, relu):
    """cuDNN 9.19's batch-norm node refuses C = 1, 3 and 257 on sm_90 (its engines want C a multiple
    of their vector width): those keys run as reductions + pointwise graphs, with a FusionWarning."""
    x = img(4, c, 9, 7, dtype, layout)
    gamma, beta = vec(c), torch.randn(c, device="cuda")
    rm, rv = torch.randn(c, device="cuda"), vec(c)
    y, mean, inv, nrm, nrv = ops.batchnorm(x, gamma, beta, rm, rv, epsilon=1e-5, momentum=0.1, relu=relu)
    xr = x.double().requires_grad_(True)
    gr, br = gamma.double().requires_grad_(True), beta.double().requires_grad_(True)
    rmr, rvr = rm.double().clone(), rv.double().clone()
    yr = F.batch_norm(xr, rmr, rvr, gr, br, True, 0.1, 1e-5)
    yr = torch.relu(yr) if relu else yr
    assert y.shape == x.shape and y.dtype == x.dtype and rel(y, yr) < TOL[dtype]
    assert rel(mean, x.double().mean((0, 2, 3))) < STAT_TOL or float(mean.abs().max()) < 1e-6
    assert rel(nrm, rmr) < STAT_TOL and rel(nrv, rvr) < STAT_TOL
    var = x.double().var((0, 2, 3), unbiased=False)
    assert rel(inv, 1 / torch.sqrt(var + 1e-5)) < STAT_TOL
    dy = torch.randn_like(y)
    yr.backward(dy.double())
    dx, dg, db = ops.batchnorm_backward(dy, x, gamma, mean, inv, y=y if relu else None)
    assert rel(dx, xr.grad) < TOL[dtype] * 2 and rel(dg, gr.grad) < TOL[dtype] * 2 and rel(db, br.grad) < TOL[dtype] * 2


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("c", CHANNELS)
def test_batchnorm_add_relu_forward_backward(c, dtype, layout):
    """y = relu(bn(x) + z) (a ResNet block's end) and its backward with the residual's gradient, against
    float64 autograd; C = 1, 3, 257 run split (reductions, pointwise graphs), as plain batch norm does."""
    x, z = img(4, c, 9, 7, dtype, layout), img(4, c, 9, 7, dtype, layout) - 0.5
    gamma, beta = vec(c), torch.randn(c, device="cuda")
    rm, rv = torch.randn(c, device="cuda"), vec(c)
    y, mean, inv, nrm, nrv = ops.batchnorm(x, gamma, beta, rm, rv, epsilon=1e-5, momentum=0.1, relu=True, residual=z)
    xr, zr = x.double().requires_grad_(True), z.double().requires_grad_(True)
    gr, br = gamma.double().requires_grad_(True), beta.double().requires_grad_(True)
    rmr, rvr = rm.double().clone(), rv.double().clone()
    bnr = F.batch_norm(xr, rmr, rvr, gr, br, True, 0.1, 1e-5)
    yr = torch.relu(bnr + zr)
    assert y.shape == x.shape and y.dtype == x.dtype and rel(y, yr) < TOL[dtype]
    assert rel(nrm, rmr) < STAT_TOL and rel(nrv, rvr) < STAT_TOL
    assert rel(inv, 1 / torch.sqrt(x.double().var((0, 2, 3), unbiased=False) + 1e-5)) < STAT_TOL
    dy = torch.randn_like(y)
    dx, dg, db, dz = ops.batchnorm_backward(dy, x, gamma, mean, inv, y=y, residual=True)
    assert dz.shape == z.shape and dz.dtype == dy.dtype and dx.dtype == x.dtype
    # dz is dy where fusekit's y > 0, exactly. In 16 bits some masks flip against float64 where y ~ 0
    # (each flip moves dz by a whole dy), so the BN backward is checked on fusekit's own mask; in
    # float32 the masks agree and the whole float64 chain is the reference.
    assert torch.equal(dz, dy * (y > 0))
    if dtype == "float32":
        yr.backward(dy.double())
        assert rel(dz, zr.grad) < TOL[dtype]
    else:
        bnr.backward(dz.double())
    assert rel(dx, xr.grad) < TOL[dtype] * 2 and rel(dg, gr.grad) < TOL[dtype] * 2 and rel(db, br.grad) < TOL[dtype] * 2
    with pytest.raises(fusekit.OperandError, match="residual"):
        ops.batchnorm(x, gamma, beta, rm, rv, residual=z)  # relu=False


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("c", CHANNELS)
def test_normalize_alone(c, dtype, layout):
    """Normalize without scale/shift (a framework keeps its own affine); backward gives dx only."""
    x = img(3, c, 8, 8, dtype, layout)
    y, mean, inv = ops.bn_normalize(x)
    xr = x.double().requires_grad_(True)
    yr = F.batch_norm(xr, None, None, None, None, True, 0.0, 1e-5)
    assert rel(y, yr) < TOL[dtype]
    dy = torch.randn_like(y)
    yr.backward(dy.double())
    dx = ops.bn_normalize_backward(dy, x, mean, inv)
    assert dx.shape == x.shape and rel(dx, xr.grad) < 2 * TOL[dtype]
    # with running statistics: the update equals PyTorch's
    rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    _, _, _, nrm, nrv = ops.bn_normalize(x, rm, rv, momentum=0.3)
    rmr, rvr = rm.double().clone(), rv.double().clone()
    F.batch_norm(x.double(), rmr, rvr, None, None, True, 0.3, 1e-5)
    assert rel(nrm, rmr) < STAT_TOL or float((nrm.double() - rmr).abs().max()) < 1e-6
    assert rel(nrv, rvr) < STAT_TOL


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("c", CHANNELS)
@pytest.mark.parametrize("relu", [False, True])
def test_scale_shift_alone_and_backward(c, dtype, relu):
    x = img(2, c, 6, 5, dtype, "NHWC")
    gamma, beta = vec(c), torch.randn(c, device="cuda")
    y = ops.channel_scale_shift(x, gamma, beta, relu=relu)
    xr, gr, br = (t.double().requires_grad_(True) for t in (x, gamma, beta))
    yr = xr * gr.view(1, -1, 1, 1) + br.view(1, -1, 1, 1)
    yr = torch.relu(yr) if relu else yr
    assert rel(y, yr) < TOL[dtype]
    dy = torch.randn_like(y)
    yr.backward(dy.double())
    dx, dg, db = ops.channel_scale_shift_backward(dy, x, gamma, y=y if relu else None)
    assert rel(dx, xr.grad) < TOL[dtype] * 2 and rel(dg, gr.grad) < TOL[dtype] * 2 and rel(db, br.grad) < TOL[dtype] * 2
    assert rel(ops.channel_scale_shift(x, gamma), x.double() * gamma.double().view(1, -1, 1, 1)) < TOL[dtype]
    assert rel(ops.channel_scale_shift(x, beta=beta), x.double() + beta.double().view(1, -1, 1, 1)) < TOL[dtype]


def test_scale_shift_errors():
    x = img(2, 8, 4, 4, "float16", "NHWC")
    with pytest.raises(fusekit.OperandError, match="'beta'.*needs both"):
        ops.channel_scale_shift(x, vec(8), None, relu=True)
    with pytest.raises(fusekit.OperandError, match="'gamma'.*does not broadcast"):
        ops.channel_scale_shift(x, vec(7), vec(8))
    with pytest.raises(fusekit.OperandError, match="'gamma'.*expected dtype float32"):
        ops.channel_scale_shift(x, vec(8).half(), vec(8))
    with pytest.raises(fusekit.OperandError, match="'epsilon'.*positive"):
        ops.batchnorm(x, vec(8), vec(8), epsilon=0.0)
    with pytest.raises(fusekit.OperandError, match="'momentum'.*in \\[0, 1\\]"):
        ops.batchnorm(x, vec(8), vec(8), vec(8), vec(8), momentum=1.5)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("c", CHANNELS)
def test_inference(c, dtype, layout):
    x = img(4, c, 7, 7, dtype, layout)
    gamma, beta, rm, rv = vec(c), torch.randn(c, device="cuda"), torch.randn(c, device="cuda"), vec(c)
    for relu in (False, True):
        y = ops.batchnorm_inference(x, rm, ops.inv_std(rv), gamma, beta, relu=relu)
        yr = F.batch_norm(x.double(), rm.double(), rv.double(), gamma.double(), beta.double(), False, 0.1, 1e-5)
        assert rel(y, torch.relu(yr) if relu else yr) < TOL[dtype]


def test_running_stats_track_pytorch_over_steps():
    c = 64
    rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    bn = torch.nn.BatchNorm2d(c, momentum=0.1).cuda().double()
    gamma, beta = bn.weight.detach().float().clone(), bn.bias.detach().float().clone()
    for _ in range(6):
        x = img(8, c, 10, 10, "float32", "NHWC")
        _, _, _, rm, rv = ops.batchnorm(x, gamma, beta, rm, rv, momentum=0.1)
        bn(x.double())
    assert rel(rm, bn.running_mean) < 1e-5 and rel(rv, bn.running_var) < 1e-5


def test_conv_bn_relu_inference_folded():
    x = img(2, 16, 12, 12, "float16", "NHWC")
    conv = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()
    bn = torch.nn.BatchNorm2d(32).cuda().eval()
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
    w = conv.weight.detach().half().contiguous(memory_format=torch.channels_last)
    w2, b2 = ops.fold_batchnorm(w, conv.bias.detach(), bn.running_mean, bn.running_var, bn.weight.detach(), bn.bias.detach(), bn.eps)
    assert w2.dtype == torch.float16 and w2.is_contiguous(memory_format=torch.channels_last)
    y = ops.conv_bias_relu(x, w2, b2, padding=1)
    with torch.no_grad():
        ref = torch.relu(bn.double()(F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)))
    assert rel(y, ref) < 5e-3


def test_conv_genstats_and_residual():
    x = img(4, 32, 14, 14, "float16", "NHWC")
    w = (torch.randn(64, 32, 3, 3, device="cuda") / 17).half().contiguous(memory_format=torch.channels_last)
    b = torch.randn(64, device="cuda").half()
    y, s, sq = ops.conv_genstats(x, w, padding=1)
    yr = F.conv2d(x.double(), w.double(), padding=1)
    assert rel(y, yr) < TOL["float16"]
    assert rel(s, y.double().sum((0, 2, 3))) < 1e-3 and rel(sq, (y.double() ** 2).sum((0, 2, 3))) < 1e-3
    z = img(4, 64, 14, 14, "float16", "NHWC")
    out = ops.conv_bias_add_relu(x, w, b, z, padding=1)
    ref = torch.relu(F.conv2d(x.double(), w.double(), b.double(), padding=1) + z.double())
    assert rel(out, ref) < TOL["float16"]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_layernorm_and_instancenorm(dtype, layout):
    x = img(4, 6, 5, 7, dtype, layout)
    gl, bl = vec(6 * 5 * 7).view(1, 6, 5, 7), torch.randn(1, 6, 5, 7, device="cuda")
    y, mean, inv = ops.layernorm(x, gl, bl)
    xr, gr, br = (t.double().requires_grad_(True) for t in (x, gl[0], bl[0]))
    yr = F.layer_norm(xr, (6, 5, 7), gr, br, 1e-5)
    assert rel(y, yr) < TOL[dtype]
    dy = torch.randn_like(y)
    yr.backward(dy.double())
    dx, dg, db = ops.layernorm_backward(dy, x, gl, mean, inv)
    assert rel(dx, xr.grad) < 2 * TOL[dtype] and rel(dg[0], gr.grad) < 2 * TOL[dtype] and rel(db[0], br.grad) < 2 * TOL[dtype]
    gi, bi = vec(6), torch.randn(6, device="cuda")
    y, mean, inv = ops.instancenorm(x, gi, bi)
    xr, gr, br = (t.double().requires_grad_(True) for t in (x, gi, bi))
    yr = F.instance_norm(xr, weight=gr, bias=br, eps=1e-5)
    assert rel(y, yr) < TOL[dtype]
    yr.backward(dy.double())
    dx, dg, db = ops.instancenorm_backward(dy, x, gi, mean, inv)
    assert rel(dx, xr.grad) < 2 * TOL[dtype] and rel(dg, gr.grad) < 2 * TOL[dtype] and rel(db, br.grad) < 2 * TOL[dtype]


def test_batchnorm_plan_loaded_from_disk_keeps_its_scalars(tmp_path):
    """epsilon and momentum live in the graph (pass-by-value): a plan deserialized from the disk
    cache must give the same outputs as the freshly built one, bit for bit."""
    x = img(4, 64, 9, 7, "float16", "NHWC")
    gamma, beta, rm, rv = vec(64), torch.randn(64, device="cuda"), torch.randn(64, device="cuda"), vec(64)
    args, kw = (x, gamma, beta, rm, rv), dict(epsilon=1e-3, momentum=0.3)
    built = fusekit.PlanCache(store=fusekit.DiskStore(tmp_path))
    first = ops.call("batchnorm", *args, cache=built, **kw)
    fresh = fusekit.PlanCache(store=fusekit.DiskStore(tmp_path))
    again = ops.call("batchnorm", *args, cache=fresh, **kw)
    assert fresh.stats.builds == 0 and fresh.stats.disk_hits == 1
    assert ops.plan_for("batchnorm", *args, cache=fresh, **kw).source == "disk"
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    # and the values are the ones asked for (epsilon 1e-3, momentum 0.3), not defaults
    var = x.double().var((0, 2, 3), unbiased=False)
    assert rel(again[2], 1 / torch.sqrt(var + 1e-3)) < STAT_TOL
    n = x.numel() // 64
    assert rel(again[4], 0.7 * rv.double() + 0.3 * var * n / (n - 1)) < STAT_TOL


@pytest.mark.parametrize("w_dtype, bn_dtype, out", [("float16", "float32", None), ("float32", "float32", "float16"),
                                                    ("float32", "float32", "bfloat16"), ("bfloat16", "bfloat16", None),
                                                    ("float16", "float16", None), ("float32", "float32", None)])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("bias, affine", [(True, True), (False, True), (False, False)])
def test_fold_batchnorm_kernel_matches_float64(w_dtype, bn_dtype, out, layout, bias, affine):
    """ops.fold_batchnorm (one kernel, float32 arithmetic) against the fold in float64: w' within one
    rounding of the output dtype, b' too; w' keeps w's memory layout; torch and CuPy alike."""
    k, c = 24, 5
    dt = lambda n: getattr(torch, n)  # noqa: E731
    w = (torch.randn(k, c, 3, 3, device="cuda") / 4).to(dt(w_dtype))
    w = w.contiguous(memory_format=torch.channels_last) if layout == "NHWC" else w
    b = torch.randn(k, device="cuda").to(dt(w_dtype)) if bias else None
    mean, var = torch.randn(k, device="cuda").to(dt(bn_dtype)), torch.rand(k, device="cuda").add(0.3).to(dt(bn_dtype))
    gamma, beta = (torch.randn(k, device="cuda").to(dt(bn_dtype)), torch.randn(k, device="cuda").to(dt(bn_dtype))) if affine else (None, None)
    w2, b2 = ops.fold_batchnorm(w, b, mean, var, gamma, beta, 1e-3, dtype=out)
    want_dtype = dt(out or w_dtype)
    assert w2.dtype == b2.dtype == want_dtype and w2.shape == w.shape and b2.shape == (k,)
    assert w2.stride() == w.stride()
    d = lambda t: t.double()  # noqa: E731
    s = torch.rsqrt(d(var) + 1e-3) * (d(gamma) if affine else 1.0)
    w_ref = d(w) * s.reshape(-1, 1, 1, 1)
    b_ref = ((d(b) if bias else 0.0) - d(mean)) * s + (d(beta) if affine else 0.0)
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[want_dtype]
    assert rel(w2, w_ref) < tol and rel(b2, b_ref) < tol, (rel(w2, w_ref), rel(b2, b_ref))
    if w_dtype != "bfloat16" and bn_dtype != "bfloat16" and out is None:  # CuPy arrays (no bfloat16 there): the same kernel
        cp = pytest.importorskip("cupy")
        w3, b3 = ops.fold_batchnorm(cp.from_dlpack(w), None if b is None else cp.from_dlpack(b), cp.from_dlpack(mean), cp.from_dlpack(var),
                                    None if gamma is None else cp.from_dlpack(gamma), None if beta is None else cp.from_dlpack(beta), 1e-3)
        assert isinstance(w3, cp.ndarray) and torch.equal(torch.from_dlpack(w3), w2) and torch.equal(torch.from_dlpack(b3), b2)


@pytest.mark.parametrize("shape", [(16, 1, 3, 3), (16, 8, 1, 1), (16, 1, 1, 1), (16, 8, 3, 3)])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_fold_batchnorm_keeps_the_filter_s_strides(shape, layout):
    """A depthwise or 1x1 filter's strides fit NCHW and channels-last alike; the folded filter keeps
    the very strides it came with (fused-or-split decisions are keyed on them), torch and CuPy."""
    w = torch.randn(shape, device="cuda").half()
    w = w.contiguous(memory_format=torch.channels_last) if layout == "NHWC" else w
    v = torch.rand(shape[0], device="cuda") + 0.5
    w2, _ = ops.fold_batchnorm(w, None, v, v, v, v)
    assert w2.stride() == w.stride() and w2.dtype == w.dtype
    assert rel(w2, w.double() * (v.double() * torch.rsqrt(v.double() + 1e-5)).reshape(-1, 1, 1, 1)) < 1e-3
    w4, _ = ops.fold_batchnorm(w, None, v, v, v, v, dtype="float32")  # another dtype: the same strides in elements
    assert w4.stride() == w.stride() and torch.equal(w4.half(), w2)
    cp = pytest.importorskip("cupy")
    wc = cp.from_dlpack(w)
    w3, _ = ops.fold_batchnorm(wc, None, cp.from_dlpack(v), cp.from_dlpack(v), cp.from_dlpack(v), cp.from_dlpack(v))
    assert w3.strides == wc.strides and torch.equal(torch.from_dlpack(w3), w2)


def test_fold_batchnorm_names_bad_operands():
    from fusekit.errors import OperandError

    w = torch.randn(8, 4, 3, 3, device="cuda")
    v = torch.rand(8, device="cuda")
    with pytest.raises(OperandError, match="'var': expected shape \\(8,\\)"):
        ops.fold_batchnorm(w, None, v, v[:4])
    with pytest.raises(OperandError, match="'gamma': expected dtype float32 like 'var'"):
        ops.fold_batchnorm(w, None, v, v, v.half(), v.half())
    with pytest.raises(OperandError, match="'beta': expected gamma and beta both"):
        ops.fold_batchnorm(w, None, v, v, v, None)
    with pytest.raises(OperandError, match="'w': .*strides"):
        ops.fold_batchnorm(w[:, :, :2], None, v, v)
