"""GPU: fusekit.pool's CuPy kernels against the NumPy references and torch.nn.functional (forward
and autograd), on fresh random inputs: float16 / bfloat16 / float32, NCHW and NHWC, C in
{1, 3, 64, 257}, CuPy arrays and torch tensors (bfloat16 through torch when CuPy has none)."""

import functools

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
F = torch.nn.functional

import fusekit  # noqa: E402
from fusekit import adapters, pool  # noqa: E402
from fusekit.ops import resample  # noqa: E402
from fusekit.errors import OperandError  # noqa: E402
from helpers import float64_nchw, host64, rel  # noqa: E402
from fusekit.engine import oracle  # noqa: E402

LIBS = ["cupy", "torch"]
DTYPES = ["float16", "bfloat16", "float32"]
LAYOUTS = ["NCHW", "NHWC"]
CHANNELS = [1, 3, 64, 257]
TOL = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 2e-5}
# (kernel, stride, padding); stride 1 with kernel 3 overlaps windows; odd 9x11 planes
GEOMS = [(3, 2, 1), (3, 1, 1), (2, 2, 0), ((3, 2), (2, 1), (1, 0))]
GEOM_IDS = ["k3s2p1", "k3s1p1", "k2s2p0", "k32s21p10"]
HW = (9, 11)


@functools.cache
def cupy_has_bf16() -> bool:
    try:
        a = cp.zeros(2, dtype=cp.float32).astype(cp.dtype("bfloat16"))
        return adapters.library("cupy").describe(a)[2] == "bfloat16" and torch.from_dlpack(a).dtype == torch.bfloat16
    except Exception:  # noqa: BLE001
        return False


def need(lib, dtype):
    if lib == "cupy" and dtype == "bfloat16" and not cupy_has_bf16():
        pytest.skip("this CuPy has no bfloat16; bfloat16 is tested through torch tensors")


def make(lib, shape, dtype, layout, scale=1.0):
    """Fresh standard-normal data (times scale) rounded to dtype, dense in layout (NCHW | NHWC | ROW)."""
    if lib == "torch":
        t = (torch.randn(shape, device="cuda") * scale).to(getattr(torch, dtype))
        return t.contiguous(memory_format=torch.channels_last) if layout == "NHWC" else t
    dt = cp.dtype("bfloat16") if dtype == "bfloat16" else cp.dtype(dtype)
    if layout == "NHWC":
        n, c, h, w = shape
        return fusekit.nhwc((cp.random.standard_normal((n, h, w, c), dtype=cp.float32) * scale).astype(dt))
    return (cp.random.standard_normal(shape, dtype=cp.float32) * scale).astype(dt)


def as_torch(a):
    return a if isinstance(a, torch.Tensor) else torch.from_dlpack(a)


def check_result(a, lib, dtype, shape, layout):
    """Caller's array type, dtype, shape, memory layout, all finite."""
    assert isinstance(a, torch.Tensor if lib == "torch" else cp.ndarray), type(a)
    t = as_torch(a)
    assert t.dtype == (torch.int32 if dtype == "int32" else getattr(torch, dtype))
    assert tuple(t.shape) == tuple(shape)
    assert t.is_cuda
    fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
    assert t.is_contiguous(memory_format=fmt), (layout, t.stride())
    if t.is_floating_point():
        assert torch.isfinite(t).all(), "non-finite result"


def autograd(fn, inputs, dy):
    """fn's value and input gradients in float64 on the (rounded) inputs.

    The float64 copies are NCHW-contiguous whatever the operands' layout: the values do not depend
    on it, and PyTorch's CUDA channels_last avg_pool2d backward drops the padding offset (input
    gradients shifted by the padding for padding > 0; pytorch/pytorch#188344, fixed by #188345), so
    a channels_last reference would be wrong for every padded NHWC case. The copies get NCHW
    strides on every dim (torchref.float64_nchw): ``.double().contiguous()`` kept a CuPy NHWC
    array's stride 1 on C = 1, which torch still runs as channels_last (the cupy-NHWC-C=1 cases).
    """
    leaves = [float64_nchw(as_torch(t)).requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    y.backward(float64_nchw(as_torch(dy)))
    return y.detach(), [t.grad for t in leaves]


# ----------------------------------------------------------------------------------------------
# pooling
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("geom", GEOMS, ids=GEOM_IDS)
@pytest.mark.parametrize("c", CHANNELS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lib", LIBS)
def test_max_pool2d(lib, dtype, layout, c, geom):
    need(lib, dtype)
    shape = (2, c, *HW)
    x = make(lib, shape, dtype, layout)
    xt = as_torch(x)
    y, am = pool.max_pool2d(x, *geom)
    ref_y, ref_i = F.max_pool2d(xt, *geom, return_indices=True)
    check_result(y, lib, dtype, ref_y.shape, layout)
    check_result(am, lib, "int32", ref_y.shape, layout)
    # the max is exact, and ties keep the first window position in both
    assert torch.equal(as_torch(y), ref_y)
    assert torch.equal(as_torch(am).long(), ref_i)
    y_inf, none = pool.max_pool2d(x, *geom, indices=False)  # inference (NHWC, C % 8 == 0: the 16-byte-lane kernel)
    check_result(y_inf, lib, dtype, ref_y.shape, layout)
    assert none is None and torch.equal(as_torch(y_inf), ref_y)
    ny, ni = oracle.max_pool2d_reference(host64(x), *geom)
    np.testing.assert_array_equal(host64(y), ny)
    np.testing.assert_array_equal(as_torch(am).cpu().numpy(), ni)

    dy = make(lib, tuple(ref_y.shape), dtype, layout)
    dx = pool.max_pool2d_backward(dy, am, shape)
    check_result(dx, lib, dtype, shape, layout)
    _, (g,) = autograd(lambda a: F.max_pool2d(a, *geom), [x], dy)
    assert rel(dx, g) < TOL[dtype]
    assert rel(host64(dx), oracle.max_pool2d_backward_reference(host64(dy), ni, shape)) < TOL[dtype]
    # PyTorch's int64 indices are accepted as they are
    idx64 = ref_i if lib == "torch" else cp.from_dlpack(ref_i)
    assert rel(pool.max_pool2d_backward(dy, idx64, shape), g) < TOL[dtype]


@pytest.mark.parametrize("geom", GEOMS, ids=GEOM_IDS)
@pytest.mark.parametrize("c", CHANNELS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lib", LIBS)
def test_avg_pool2d(lib, dtype, layout, c, geom):
    need(lib, dtype)
    shape = (2, c, *HW)
    x = make(lib, shape, dtype, layout)
    for cip in (True, False):
        y = pool.avg_pool2d(x, *geom, count_include_pad=cip)
        dy = make(lib, tuple(as_torch(y).shape), dtype, layout)
        ref_y, (g,) = autograd(lambda a, cip=cip: F.avg_pool2d(a, *geom, count_include_pad=cip), [x], dy)
        check_result(y, lib, dtype, ref_y.shape, layout)
        assert rel(y, ref_y) < TOL[dtype]
        assert rel(y, F.avg_pool2d(as_torch(x), *geom, count_include_pad=cip)) < TOL[dtype]  # torch in x's dtype
        assert rel(host64(y), oracle.avg_pool2d_reference(host64(x), *geom, count_include_pad=cip)) < TOL[dtype]
        dx = pool.avg_pool2d_backward(dy, shape, *geom, count_include_pad=cip)
        check_result(dx, lib, dtype, shape, layout)
        assert rel(dx, g) < TOL[dtype]
        ref = oracle.avg_pool2d_backward_reference(host64(dy), shape, *geom, count_include_pad=cip)
        assert rel(host64(dx), ref) < TOL[dtype]


@pytest.mark.parametrize("geom", [(2, 2, 0), (3, 3, 1), ((2, 3), (2, 2), (0, 1))], ids=["k2s2p0", "k3s3p1", "k23s22p01"])
@pytest.mark.parametrize("c", [3, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lib", LIBS)
def test_pool2d_ceil_mode(lib, dtype, layout, c, geom):
    """ceil_mode on 9x11 planes (each geometry adds a window past the input's edge in some dim): max
    values and argmax exactly PyTorch's (the 16-byte-lane inference kernel too, at C = 64 NHWC),
    averages with PyTorch's divisors and both backwards within rounding."""
    need(lib, dtype)
    shape = (2, c, *HW)
    x = make(lib, shape, dtype, layout)
    xt = as_torch(x)
    ref_y, ref_i = F.max_pool2d(xt, *geom, ceil_mode=True, return_indices=True)
    assert ref_y.shape != F.max_pool2d(xt, *geom).shape
    y, am = pool.max_pool2d(x, *geom, ceil_mode=True)
    check_result(y, lib, dtype, ref_y.shape, layout)
    assert torch.equal(as_torch(y), ref_y) and torch.equal(as_torch(am).long(), ref_i)
    assert torch.equal(as_torch(pool.max_pool2d(x, *geom, ceil_mode=True, indices=False)[0]), ref_y)
    dy = make(lib, tuple(ref_y.shape), dtype, layout)
    _, (g,) = autograd(lambda a: F.max_pool2d(a, *geom, ceil_mode=True), [x], dy)
    assert rel(pool.max_pool2d_backward(dy, am, shape), g) < TOL[dtype]
    for cip in (True, False):
        y = pool.avg_pool2d(x, *geom, count_include_pad=cip, ceil_mode=True)
        ref_y, (g,) = autograd(lambda a, cip=cip: F.avg_pool2d(a, *geom, ceil_mode=True, count_include_pad=cip), [x], dy)
        check_result(y, lib, dtype, ref_y.shape, layout)
        assert rel(y, ref_y) < TOL[dtype]
        dx = pool.avg_pool2d_backward(dy, shape, *geom, count_include_pad=cip, ceil_mode=True)
        check_result(dx, lib, dtype, shape, layout)
        assert rel(dx, g) < TOL[dtype]


@pytest.mark.parametrize("geom", [(3, 1, 1, 2), (2, 2, 1, 3), ((3, 2), (2, 1), (1, 1), (2, 3))], ids=["k3s1p1d2", "k2s2p1d3", "k32s21p11d23"])
@pytest.mark.parametrize("ceil", [False, True])
@pytest.mark.parametrize("c", [3, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lib", LIBS)
def test_dilated_max_pool2d(lib, dtype, layout, c, ceil, geom):
    """Dilated windows (taps d apart, the first inside the input): max values and argmax exactly
    PyTorch's, the 16-byte-lane inference kernel too (C = 64 NHWC), the backward within rounding."""
    need(lib, dtype)
    k, s, p, d = geom
    shape = (2, c, *HW)
    x = make(lib, shape, dtype, layout)
    ref_y, ref_i = F.max_pool2d(as_torch(x), k, s, p, d, ceil_mode=ceil, return_indices=True)
    y, am = pool.max_pool2d(x, k, s, p, ceil_mode=ceil, dilation=d)
    check_result(y, lib, dtype, ref_y.shape, layout)
    assert torch.equal(as_torch(y), ref_y) and torch.equal(as_torch(am).long(), ref_i)
    assert torch.equal(as_torch(pool.max_pool2d(x, k, s, p, ceil_mode=ceil, dilation=d, indices=False)[0]), ref_y)
    dy = make(lib, tuple(ref_y.shape), dtype, layout)
    _, (g,) = autograd(lambda a: F.max_pool2d(a, k, s, p, d, ceil_mode=ceil), [x], dy)
    assert rel(pool.max_pool2d_backward(dy, am, shape), g) < TOL[dtype]


@pytest.mark.parametrize("divisor", [1, 5])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lib", LIBS)
def test_avg_pool2d_divisor_override(lib, dtype, layout, divisor):
    need(lib, dtype)
    shape = (2, 64, *HW)
    x = make(lib, shape, dtype, layout)
    for ceil in (False, True):
        y = pool.avg_pool2d(x, 3, 2, 1, ceil_mode=ceil, divisor_override=divisor)
        dy = make(lib, tuple(as_torch(y).shape), dtype, layout)
        ref_y, (g,) = autograd(lambda a, ceil=ceil: F.avg_pool2d(a, 3, 2, 1, ceil, True, divisor), [x], dy)
        check_result(y, lib, dtype, ref_y.shape, layout)
        assert rel(y, ref_y) < TOL[dtype]
        dx = pool.avg_pool2d_backward(dy, shape, 3, 2, 1, ceil_mode=ceil, divisor_override=divisor)
        check_result(dx, lib, dtype, shape, layout)
        assert rel(dx, g) < TOL[dtype]


@pytest.mark.parametrize("lib", LIBS)
def test_pool_backward_with_argmax_and_dy_in_different_layouts(lib):
    x = make(lib, (2, 64, 9, 11), "float32", "NHWC")
    y, am = pool.max_pool2d(x, 3, 1, 1)
    am_nchw = as_torch(am).contiguous()
    am_nchw = am_nchw if lib == "torch" else cp.from_dlpack(am_nchw)
    dy = make(lib, tuple(as_torch(y).shape), "float32", "NCHW")
    dx = pool.max_pool2d_backward(dy, am_nchw, (2, 64, 9, 11))
    check_result(dx, lib, "float32", (2, 64, 9, 11), "NCHW")  # dx follows dy's layout
    _, (g,) = autograd(lambda a: F.max_pool2d(a, 3, 1, 1), [x], dy)
    assert rel(dx, g) < TOL["float32"]


def test_max_pool2d_large_planes_and_batch():
    x = make("torch", (8, 64, 57, 55), "float16", "NHWC")
    y, am = pool.max_pool2d(x, 3, 2, 1)
    ref_y, ref_i = F.max_pool2d(x, 3, 2, 1, return_indices=True)
    assert torch.equal(y, ref_y) and torch.equal(am.long(), ref_i)
    xn = x.clone()
    xn[1, 5, 10, 10], xn[7, 63, 56, 54], xn[3, 8, 0, 0] = float("nan"), float("nan"), float("-inf")
    for dt in ("float16", "bfloat16", "float32"):  # inference kernel: NaN wins, padding never does
        xd = xn.to(getattr(torch, dt)).contiguous(memory_format=torch.channels_last)
        got, _ = pool.max_pool2d(xd, 3, 2, 1, indices=False)
        torch.testing.assert_close(got, F.max_pool2d(xd, 3, 2, 1), rtol=0, atol=0, equal_nan=True)
        assert torch.isnan(got[1, 5, 5, 5]) and torch.isnan(got[7, 63, 28, 27])
    dy = torch.randn_like(y)
    dx = pool.max_pool2d_backward(dy, am, x.shape)
    _, (g,) = autograd(lambda a: F.max_pool2d(a, 3, 2, 1), [x], dy)
    assert rel(dx, g) < TOL["float16"]


# ----------------------------------------------------------------------------------------------
# softmax
# ----------------------------------------------------------------------------------------------
SOFTMAX_SHAPES = [((2, c, 5, 7), lay) for c in CHANNELS for lay in LAYOUTS] + [((8, 10), "ROW"), ((4, 1000), "ROW"), ((16, 257), "ROW")]
SOFTMAX_IDS = [f"{'x'.join(map(str, s))}-{lay}" for s, lay in SOFTMAX_SHAPES]


@pytest.mark.parametrize("shape, layout", SOFTMAX_SHAPES, ids=SOFTMAX_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lib", LIBS)
def test_softmax_and_log_softmax(lib, dtype, shape, layout):
    need(lib, dtype)
    out_layout = "NCHW" if layout == "ROW" else layout
    x = make(lib, shape, dtype, layout, scale=3.0)
    dy = make(lib, shape, dtype, layout)
    for fwd, bwd, tfn, ref_fwd, ref_bwd in (
        (pool.softmax, pool.softmax_backward, F.softmax, oracle.softmax_reference, oracle.softmax_backward_reference),
        (pool.log_softmax, pool.log_softmax_backward, F.log_softmax, oracle.log_softmax_reference, oracle.log_softmax_backward_reference),
    ):
        y = fwd(x)
        ref_y, (g,) = autograd(lambda a, tfn=tfn: tfn(a, dim=1), [x], dy)
        check_result(y, lib, dtype, shape, out_layout)
        assert rel(y, ref_y) < TOL[dtype], fwd.__name__
        assert rel(y, tfn(as_torch(x), dim=1)) < TOL[dtype], fwd.__name__  # torch in x's dtype
        assert rel(host64(y), ref_fwd(host64(x), 1)) < TOL[dtype], fwd.__name__
        dx = bwd(dy, y)
        check_result(dx, lib, dtype, shape, out_layout)
        assert rel(dx, g) < TOL[dtype], bwd.__name__
        assert rel(host64(dx), ref_bwd(host64(dy), host64(y), 1)) < TOL[dtype], bwd.__name__


@pytest.mark.parametrize("lib", LIBS)
def test_softmax_backward_follows_dy_layout(lib):
    y = pool.softmax(make(lib, (2, 64, 5, 7), "float16", "NHWC"))
    dy = make(lib, (2, 64, 5, 7), "float16", "NCHW")
    dx = pool.softmax_backward(dy, y)
    check_result(dx, lib, "float16", (2, 64, 5, 7), "NCHW")
    assert rel(host64(dx), oracle.softmax_backward_reference(host64(dy), host64(y), 1)) < TOL["float16"]


@pytest.mark.parametrize("shape, layout, axis", [((2, 3, 5, 40), "NCHW", -1), ((2, 3, 5, 7), "NHWC", 2), ((40, 6), "ROW", 0), ((3, 4096), "ROW", 1)])
def test_softmax_other_axes(shape, layout, axis):
    x = make("cupy", shape, "float32", layout, scale=3.0)
    dy = make("cupy", shape, "float32", layout)
    y, ly = pool.softmax(x, axis), pool.log_softmax(x, axis)
    assert rel(host64(y), oracle.softmax_reference(host64(x), axis)) < TOL["float32"]
    assert rel(host64(ly), oracle.log_softmax_reference(host64(x), axis)) < TOL["float32"]
    dx = pool.softmax_backward(dy, y, axis)
    assert rel(host64(dx), oracle.softmax_backward_reference(host64(dy), host64(y), axis)) < TOL["float32"]
    dx = pool.log_softmax_backward(dy, ly, axis)
    assert rel(host64(dx), oracle.log_softmax_backward_reference(host64(dy), host64(ly), axis)) < TOL["float32"]


def test_softmax_is_stable_for_large_logits():
    x = make("torch", (4, 1000), "float32", "ROW", scale=10.0) + 1e4  # exp(x) overflows without the max shift
    y, ly = pool.softmax(x), pool.log_softmax(x)
    assert torch.isfinite(y).all() and torch.isfinite(ly).all()
    assert rel(y, F.softmax(x.double(), dim=1)) < TOL["float32"]
    assert rel(ly, F.log_softmax(x.double(), dim=1)) < TOL["float32"]


# ----------------------------------------------------------------------------------------------
# layer norm over channels
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("c", [3, 64, 96, 257, 768])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lib", LIBS)
def test_channel_layer_norm_against_float64_and_torch(lib, dtype, layout, c):
    need(lib, dtype)
    shape = (2, c, 5, 7)
    x = make(lib, shape, dtype, layout, scale=2.0)
    x += 3  # an offset the mean must remove (in place: x keeps its layout)
    g = make(lib, (c,), "float32", "ROW") * 0.5 + 1
    b = make(lib, (c,), "float32", "ROW")
    y = pool.channel_layer_norm(x, g, b, 1e-5)
    check_result(y, lib, dtype, shape, layout)
    assert rel(host64(y), oracle.channel_layer_norm_reference(host64(x), host64(g), host64(b), 1e-5)) < TOL[dtype]
    xt, gt, bt = as_torch(x), as_torch(g), as_torch(b)
    want = F.layer_norm(xt.float().permute(0, 2, 3, 1), (c,), gt, bt, 1e-5).permute(0, 3, 1, 2)
    assert rel(y, want) < TOL[dtype]
    plain = pool.channel_layer_norm(x)
    assert rel(host64(plain), oracle.channel_layer_norm_reference(host64(x))) < TOL[dtype]


def test_channel_layer_norm_writes_out_in_its_layout():
    x = make("torch", (4, 96, 6, 6), "float16", "NHWC")
    g, b = torch.rand(96, device="cuda") + 0.5, torch.randn(96, device="cuda")
    out = torch.full((4, 96, 6, 6), float("nan"), dtype=torch.float16, device="cuda")  # NCHW, unlike x
    assert pool.channel_layer_norm(x, g, b, out=out) is out
    assert rel(host64(out), oracle.channel_layer_norm_reference(host64(x), host64(g), host64(b))) < TOL["float16"]


@pytest.mark.parametrize("kwargs, operand, words", [
    ({"weight": "half", "bias": "ok"}, "weight", "float32"),
    ({"weight": "short", "bias": "ok"}, "weight", "vector of x's 8 channels"),
    ({"weight": "ok"}, "bias", "together"),
    ({"eps": 0.0}, "eps", "positive"),
    ({"out": "wrong"}, "out", "shape"),
])
def test_channel_layer_norm_bad_operands(kwargs, operand, words):
    x = make("torch", (2, 8, 3, 3), "float16", "NHWC")
    made = {"half": torch.ones(8, device="cuda", dtype=torch.float16), "short": torch.ones(7, device="cuda"),
            "ok": torch.ones(8, device="cuda"), "wrong": torch.empty(2, 8, 3, 4, device="cuda", dtype=torch.float16)}
    args = {k: made.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(OperandError) as e:
        pool.channel_layer_norm(x, **args)
    assert operand in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("shape, groups", [((2, 116, 7, 5), 2), ((2, 24, 5, 7), 3), ((1, 64, 3, 3), 8)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lib", LIBS)
def test_channel_shuffle_is_torchs_exactly(lib, layout, shape, groups):
    x = make(lib, shape, "float16", layout)
    y = pool.channel_shuffle(x, groups)
    check_result(y, lib, "float16", shape, layout)
    assert torch.equal(as_torch(y), F.channel_shuffle(as_torch(x), groups))
    assert np.array_equal(host64(y), oracle.channel_shuffle_reference(host64(x), groups))


@pytest.mark.parametrize("radix, card, c", [(2, 1, 64), (4, 2, 32), (2, 1, 1024)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lib", LIBS)
def test_radix_softmax_against_float64_and_torch(lib, dtype, radix, card, c):
    """ResNeSt's rSoftMax / SKNet's path softmax: against float64 and within rounding of PyTorch's
    view-transpose-softmax."""
    if lib == "cupy" and dtype == "bfloat16" and not cupy_has_bf16():
        pytest.skip("this CuPy has no bfloat16")
    z = make(lib, (8, radix * card * c, 1, 1), dtype, "NCHW", scale=3.0)
    y = pool.radix_softmax(z, radix, card)
    want = oracle.radix_softmax_reference(host64(z), radix, card)
    check_result(y, lib, dtype, want.shape, "NCHW")
    assert rel(host64(y), want) < TOL[dtype], rel(host64(y), want)
    zt = as_torch(z).float()
    assert rel(as_torch(y), zt.reshape(8, card, radix, -1).transpose(1, 2).softmax(1).reshape(zt.shape)) < TOL[dtype]


@pytest.mark.parametrize("shape, scale", [((2, 18, 7, 5), 2), ((1, 32, 14, 14), (4, 4)), ((4, 8, 3, 1), (2, 8))])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lib", LIBS)
def test_upsample_nearest_is_torchs_exactly(lib, layout, dtype, shape, scale):
    if lib == "cupy" and dtype == "bfloat16" and not cupy_has_bf16():
        pytest.skip("this CuPy has no bfloat16")
    x = make(lib, shape, dtype, layout)
    y = resample.upsample_nearest2d(x, scale)
    want = oracle.upsample_nearest2d_reference(host64(x), scale)
    check_result(y, lib, dtype, want.shape, layout)
    sf = (scale, scale) if isinstance(scale, int) else scale
    assert torch.equal(as_torch(y), F.interpolate(as_torch(x), scale_factor=tuple(float(f) for f in sf), mode="nearest"))
    assert np.array_equal(host64(y), want)


@pytest.mark.parametrize("shape", [(32, 96, 56, 56), (32, 1152, 7, 7), (2, 3, 9, 11), (8, 40, 1, 1)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lib", LIBS)
def test_global_avg_pool_against_float64_and_torch(lib, layout, dtype, shape):
    """fusekit's two-pass global mean against float64 and within rounding of PyTorch's mean."""
    if lib == "cupy" and dtype == "bfloat16" and not cupy_has_bf16():
        pytest.skip("this CuPy has no bfloat16")
    from fusekit.ops import reduce

    x = make(lib, shape, dtype, layout, scale=2.0)
    want = host64(x).mean(axis=(2, 3), keepdims=True)
    y = reduce.global_avg_pool(x)
    check_result(y, lib, dtype, want.shape, layout)
    assert rel(host64(y), want) < TOL[dtype], rel(host64(y), want)
    xt = as_torch(x)
    assert rel(as_torch(y), xt.float().mean((2, 3), keepdim=True)) < TOL[dtype]


DW_CASES = [((4, 96, 28, 28), 7, 1, 3, 1), ((2, 144, 28, 28), 3, 2, 1, 1), ((2, 40, 14, 15), 5, 1, 2, 1), ((2, 32, 13, 13), 3, 1, 2, 2),
            ((1, 257, 9, 9), 9, 1, 4, 1)]
DW_ACTS = [("identity", 0.0), ("relu", 0.0), ("clip", 6.0), ("silu", 0.0), ("gelu", 0.0), ("hardswish", 0.0), ("leaky_relu", 0.1)]


DW_MATRIX = ([(lib, layout, dtype, case, ("identity", 0.0)) for lib in LIBS for layout in LAYOUTS for dtype in DTYPES for case in DW_CASES]
             + [(lib, "NHWC", "float16", DW_CASES[0], act) for lib in LIBS for act in DW_ACTS[1:]])


@pytest.mark.parametrize("lib, layout, dtype, case, act", DW_MATRIX, ids=str)
def test_depthwise_conv_against_float64_and_torch(lib, layout, dtype, case, act):
    """fusekit's depthwise kernel (bias and each activation) against float64, within PyTorch's own
    depthwise Conv2d error in the same dtype; the filter as given and as depthwise_taps' view."""
    if lib == "cupy" and dtype == "bfloat16" and not cupy_has_bf16():
        pytest.skip("this CuPy has no bfloat16")
    from fusekit.ops import depthwise

    shape, k, stride, pad, dil = case
    c = shape[1]
    x = make(lib, shape, dtype, layout)
    w = torch.randn(c, 1, k, k, device="cuda") / k
    b = torch.randn(c, device="cuda")
    if lib == "cupy":
        w, b = cp.from_dlpack(w), cp.from_dlpack(b)
    want = oracle.depthwise_conv2d_reference(host64(x), host64(w), host64(b), (pad, pad), (stride, stride), (dil, dil), *act)
    for filt in (w, depthwise.depthwise_taps(w)):
        y = depthwise.depthwise_conv2d(x, filt, b, stride=stride, padding=pad, dilation=dil, activation=act[0], alpha=act[1])
        check_result(y, lib, dtype, want.shape, layout)
        assert rel(host64(y), want) < TOL[dtype], rel(host64(y), want)
    xt = as_torch(x)  # and PyTorch's depthwise Conv2d agrees in the same dtype (identity: no activation's rounding)
    if act[0] == "identity":
        ref = F.conv2d(xt, as_torch(w).to(xt.dtype), as_torch(b).to(xt.dtype), stride, pad, dil, c)
        assert rel(as_torch(y), ref) < 2 * TOL[dtype]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_depthwise_conv_on_channel_slices_against_float64(lib, dtype):
    """x a channel half of a channels-last image (ShuffleNet's chunk) and ``out`` a channel slice of a
    concatenation's buffer: written through its strides, the rest of the buffer untouched."""
    if lib == "cupy" and dtype == "bfloat16" and not cupy_has_bf16():
        pytest.skip("this CuPy has no bfloat16")
    from fusekit.ops import depthwise

    big = make(lib, (4, 116, 28, 28), dtype, "NHWC")
    x = big[:, 58:]
    w = torch.randn(58, 1, 3, 3, device="cuda") / 3
    if lib == "cupy":
        w = cp.from_dlpack(w)
    want = oracle.depthwise_conv2d_reference(host64(x), host64(w), None, (1, 1), (2, 2), (1, 1), "identity", 0.0)
    y = depthwise.depthwise_conv2d(x, w, stride=2, padding=1)
    assert rel(host64(y), want) < TOL[dtype]
    cat = make(lib, (4, 116, 14, 14), dtype, "NHWC")
    before = host64(cat)
    got = depthwise.depthwise_conv2d(x, depthwise.depthwise_taps(w), stride=2, padding=1, out=cat[:, :58])
    assert rel(host64(got), want) < TOL[dtype]
    assert (host64(cat)[:, 58:] == before[:, 58:]).all()


CW_SHAPES = [(4, 96, 28, 28), (2, 40, 7, 7), (2, 257, 9, 9), (8, 1024, 7, 7)]


CW_ACTS = [("identity", 0.0), ("relu", 0.0), ("silu", 0.0), ("hardswish", 0.0)]
CW_MATRIX = ([(shape, lib, layout, dtype, ("identity", 0.0), "affine") for shape in CW_SHAPES for lib in LIBS for layout in LAYOUTS
              for dtype in DTYPES]
             + [(CW_SHAPES[0], "torch", "NHWC", "float16", act, form) for act in CW_ACTS for form in ("affine+z", "z", "act only")]
             + [(CW_SHAPES[0], "torch", "NHWC", "float16", act, "affine") for act in CW_ACTS[1:]])


@pytest.mark.parametrize("shape, lib, layout, dtype, act, form", CW_MATRIX, ids=str)
def test_channelwise_pointwise_and_gate_against_float64_and_torch(shape, lib, layout, dtype, act, form):
    """fusekit's per-channel kernels (ops.channelwise: scale-shift, + residual, activation; the
    channel gate) against float64, and PyTorch's same ops in the same dtype."""
    if lib == "cupy" and dtype == "bfloat16" and not cupy_has_bf16():
        pytest.skip("this CuPy has no bfloat16")
    from fusekit.ops import channelwise

    n, c = shape[:2]
    x = make(lib, shape, dtype, layout)
    z = make(lib, shape, dtype, layout) if "z" in form else None
    g, b = (torch.rand(c, device="cuda") + 0.5, torch.randn(c, device="cuda")) if "affine" in form else (None, None)
    if lib == "cupy" and g is not None:
        g, b = cp.from_dlpack(g), cp.from_dlpack(b)
    pre = host64(x) * host64(g).reshape(1, c, 1, 1) + host64(b).reshape(1, c, 1, 1) if g is not None else host64(x)
    want = oracle.activation(pre + (host64(z) if z is not None else 0.0), *act)
    y = channelwise.pointwise(x, g, b, z, activation=act[0], alpha=act[1])
    check_result(y, lib, dtype, want.shape, layout)
    assert rel(host64(y), want) < TOL[dtype], rel(host64(y), want)
    if act[0] == "identity" and form == "affine":  # PyTorch's in the same dtype
        xt = as_torch(x)
        ref = xt * as_torch(g).to(xt.dtype).reshape(1, c, 1, 1) + as_torch(b).to(xt.dtype).reshape(1, c, 1, 1)
        assert rel(as_torch(y), ref) < 2 * TOL[dtype]
    if form == "affine" and act[0] == "identity":
        s = make(lib, (n, c, 1, 1), dtype, "NCHW")
        gated = channelwise.gate(x, s)
        check_result(gated, lib, dtype, shape, layout)
        assert rel(host64(gated), host64(x) * host64(s)) < TOL[dtype]


# ----------------------------------------------------------------------------------------------
# streams, autograd-tracked inputs, errors
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def launch_streams(monkeypatch):
    """The CuPy current stream at every kernel launch."""
    seen = []
    real = pool.pool_kernel

    def spy(dtype, name):
        k = real(dtype, name)

        def launch(*args, **kwargs):
            seen.append(cp.cuda.get_current_stream().ptr)
            return k(*args, **kwargs)

        return launch

    monkeypatch.setattr(pool, "pool_kernel", spy)
    return seen


def test_torch_inputs_run_on_torchs_current_stream(launch_streams):
    x = make("torch", (4, 64, 33, 31), "float16", "NHWC")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x2 = x * 2  # queued on the side stream: the kernels must run after it
        y, am = pool.max_pool2d(x2, 3, 2, 1)
        dx = pool.max_pool2d_backward(torch.ones_like(y), am, x2.shape)
        s = pool.softmax(x2)
    side.synchronize()
    assert launch_streams and all(p == side.cuda_stream for p in launch_streams)
    assert torch.equal(y, F.max_pool2d(x2, 3, 2, 1))
    assert rel(s, F.softmax(x2.double(), dim=1)) < TOL["float16"]
    assert float(dx.double().sum()) == y.numel()


def test_cupy_inputs_run_on_cupys_current_stream(launch_streams):
    x = make("cupy", (2, 3, 9, 11), "float32", "NHWC")
    cp.cuda.Device().synchronize()  # x was made on the null stream; the side stream does not wait for it
    with cp.cuda.Stream(non_blocking=True) as st:
        y = pool.avg_pool2d(x, 3, 1, 1)
        st.synchronize()
    assert launch_streams == [st.ptr]
    assert rel(host64(y), oracle.avg_pool2d_reference(host64(x), 3, 1, 1)) < TOL["float32"]


def test_tensors_that_require_grad_are_read_without_autograd():
    x = make("torch", (2, 3, 9, 11), "float32", "NCHW").requires_grad_(True)
    y, _ = pool.max_pool2d(x, 2)
    assert not y.requires_grad
    assert torch.equal(y, F.max_pool2d(x.detach(), 2))


def test_gpu_operand_errors():
    x64 = cp.zeros((1, 1, 4, 4), cp.float64)
    with pytest.raises(OperandError, match="unsupported dtype float64") as ei:
        pool.max_pool2d(x64, 2)
    assert ei.value.operand == "x"
    with pytest.raises(OperandError, match="neither dense NCHW"):
        pool.avg_pool2d(cp.zeros((1, 2, 8, 8), cp.float32)[:, :, ::2], 2)
    with pytest.raises(OperandError, match="kernel 5 larger than padded input"):
        pool.max_pool2d(torch.zeros(1, 1, 3, 3, device="cuda"), 5)
    with pytest.raises(OperandError, match="dense row-major"):
        pool.softmax(cp.zeros((4, 3), cp.float32).T)
    with pytest.raises(OperandError, match="expected a 2-D"):
        pool.softmax(cp.zeros((2, 3, 4), cp.float32))
    with pytest.raises(OperandError, match="expected dtype float32 like 'dy'"):
        pool.softmax_backward(cp.zeros((2, 3), cp.float32), cp.zeros((2, 3), cp.float16))


@pytest.mark.parametrize("out_layout", LAYOUTS)
@pytest.mark.parametrize("lib", LIBS)
def test_pooling_into_out_without_indices(lib, out_layout):
    """out= (any dense layout) receives the same values as a fresh result; indices=False makes no
    argmax; a wrong out shape or array type is an OperandError naming 'out'."""
    x = make(lib, (2, 8, 9, 11), "float16", "NHWC")
    want, _ = pool.max_pool2d(x, 3, 2, 1)
    out = make(lib, tuple(want.shape), "float16", out_layout) * float("nan")
    y, am = pool.max_pool2d(x, 3, 2, 1, out=out, indices=False)
    assert y is out and am is None
    assert np.array_equal(host64(y), host64(want))
    out2 = make(lib, tuple(want.shape), "float16", out_layout) * float("nan")
    assert pool.avg_pool2d(x, 3, 2, 1, out=out2) is out2
    assert np.array_equal(host64(out2), host64(pool.avg_pool2d(x, 3, 2, 1)))
    with pytest.raises(OperandError, match=r"max_pool2d: operand 'out': expected a \w+ array of shape \(2, 8, 5, 6\)"):
        pool.max_pool2d(x, 3, 2, 1, out=make(lib, (2, 8, 5, 5), "float16", "NCHW"))
