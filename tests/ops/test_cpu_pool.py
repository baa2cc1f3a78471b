"""CPU: fusekit.pool's NumPy references against naive loops, finite differences and PyTorch (when
importable); every user error raised before a launch; and the CUDA kernels' own source compiled for
the host by g++ (a small CUDA shim, warps emulated by 32 threads) and run through the public API."""

import ctypes
import itertools
import math
import re
import shutil
import subprocess
import threading

import numpy as np
import pytest

from fusekit import adapters, pool, tensors
from fusekit.ops import resample
from fusekit.errors import OperandError
from helpers import rel
from fusekit.engine import oracle


def pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


# ----------------------------------------------------------------------------------------------
# naive loops (written from PyTorch's definitions, independently of fusekit.pool)
# ----------------------------------------------------------------------------------------------
def out_size(size, k, s, p):
    return (size + 2 * p - k) // s + 1


def naive_max_pool(x, k, s, p):
    (kh, kw), (sh, sw), (ph, pw) = pair(k), pair(s), pair(p)
    n, c, h, w = x.shape
    ho, wo = out_size(h, kh, sh, ph), out_size(w, kw, sw, pw)
    y, am = np.empty((n, c, ho, wo)), np.empty((n, c, ho, wo), dtype=np.int64)
    for b, ch, i, j in itertools.product(range(n), range(c), range(ho), range(wo)):
        best, arg = None, None
        for di, dj in itertools.product(range(kh), range(kw)):
            r, q = i * sh - ph + di, j * sw - pw + dj
            if 0 <= r < h and 0 <= q < w and (best is None or x[b, ch, r, q] > best):
                best, arg = x[b, ch, r, q], r * w + q
        y[b, ch, i, j], am[b, ch, i, j] = best, arg
    return y, am


def naive_avg_window(i, j, h, w, k, s, p, count_include_pad):
    """Input cells of output (i, j) and its divisor."""
    (kh, kw), (sh, sw), (ph, pw) = pair(k), pair(s), pair(p)
    cells, padded = [], 0
    for di, dj in itertools.product(range(kh), range(kw)):
        r, q = i * sh - ph + di, j * sw - pw + dj
        if -ph <= r < h + ph and -pw <= q < w + pw:
            padded += 1
        if 0 <= r < h and 0 <= q < w:
            cells.append((r, q))
    return cells, (padded if count_include_pad else len(cells))


def naive_avg_pool(x, k, s, p, cip):
    (kh, kw), (sh, sw), (ph, pw) = pair(k), pair(s), pair(p)
    n, c, h, w = x.shape
    ho, wo = out_size(h, kh, sh, ph), out_size(w, kw, sw, pw)
    y = np.empty((n, c, ho, wo))
    for b, ch, i, j in itertools.product(range(n), range(c), range(ho), range(wo)):
        cells, div = naive_avg_window(i, j, h, w, k, s, p, cip)
        y[b, ch, i, j] = sum(x[b, ch, r, q] for r, q in cells) / div
    return y


def naive_avg_pool_backward(dy, shape, k, s, p, cip):
    n, c, h, w = shape
    dx = np.zeros(shape)
    for b, ch, i, j in itertools.product(range(n), range(c), range(dy.shape[2]), range(dy.shape[3])):
        cells, div = naive_avg_window(i, j, h, w, k, s, p, cip)
        for r, q in cells:
            dx[b, ch, r, q] += dy[b, ch, i, j] / div
    return dx


def naive_max_pool_backward(dy, am, shape):
    dx = np.zeros(shape)
    w = shape[3]
    for b, ch, i, j in itertools.product(*(range(d) for d in dy.shape)):
        a = am[b, ch, i, j]
        dx[b, ch, a // w, a % w] += dy[b, ch, i, j]
    return dx


def naive_softmax(x, axis, log=False):
    x = np.moveaxis(x, axis, -1)
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        row = [float(v) for v in x[idx]]
        m = max(row)
        total = sum(math.exp(v - m) for v in row)
        out[idx] = [(v - m) - math.log(total) if log else math.exp(v - m) / total for v in row]
    return np.moveaxis(out, -1, axis)


# (N, C, H, W) x (kernel, stride, padding): kernel 2/3, stride 1/2, padding 0/1; stride 1 overlaps
SHAPES = [(2, 3, 5, 6), (1, 1, 4, 4), (1, 2, 7, 5), (1, 2, 2, 3)]
GEOMS = [(k, s, p) for k in (2, 3) for s in (1, 2) for p in (0, 1)] + [((3, 2), (2, 1), (1, 0)), ((2, 3), (1, 2), (1, 1))]


def fits(shape, k, s, p):
    (kh, kw), (ph, pw) = pair(k), pair(p)
    return shape[2] + 2 * ph >= kh and shape[3] + 2 * pw >= kw


CASES = [(sh, g) for sh in SHAPES for g in GEOMS if fits(sh, *g)]
CASE_IDS = [f"{'x'.join(map(str, sh))}-k{g[0]}s{g[1]}p{g[2]}".replace(" ", "") for sh, g in CASES]


@pytest.mark.parametrize("shape, geom", CASES, ids=CASE_IDS)
def test_max_pool_reference_matches_naive_loops(shape, geom, rng):
    x = rng.standard_normal(shape)
    y, am = oracle.max_pool2d_reference(x, *geom)
    yn, amn = naive_max_pool(x, *geom)
    np.testing.assert_array_equal(y, yn)
    np.testing.assert_array_equal(am, amn)
    dy = rng.standard_normal(y.shape)
    np.testing.assert_allclose(oracle.max_pool2d_backward_reference(dy, am, shape), naive_max_pool_backward(dy, amn, shape), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cip", [True, False])
@pytest.mark.parametrize("shape, geom", CASES, ids=CASE_IDS)
def test_avg_pool_reference_matches_naive_loops(shape, geom, cip, rng):
    x = rng.standard_normal(shape)
    y = oracle.avg_pool2d_reference(x, *geom, count_include_pad=cip)
    np.testing.assert_allclose(y, naive_avg_pool(x, *geom, cip), rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx = oracle.avg_pool2d_backward_reference(dy, shape, *geom, count_include_pad=cip)
    np.testing.assert_allclose(dx, naive_avg_pool_backward(dy, shape, *geom, cip), rtol=1e-12, atol=1e-12)


def test_max_pool_reference_ties_padding_and_nan():
    x = np.zeros((1, 1, 4, 4))  # all ties: the first cell of each window, never the padding
    _, am = oracle.max_pool2d_reference(x, 3, 2, 1)
    np.testing.assert_array_equal(am[0, 0], [[0, 1], [4, 5]])
    x = np.full((1, 1, 3, 3), -np.inf)  # -inf input still beats -inf padding: the first real cell
    y, am = oracle.max_pool2d_reference(x, 3, 1, 1)
    assert np.all(y == -np.inf)
    np.testing.assert_array_equal(am[0, 0], [[0, 0, 1], [0, 0, 1], [3, 3, 4]])
    x = np.arange(16.0).reshape(1, 1, 4, 4)
    x[0, 0, 0, 0] = np.nan  # NaN wins (and propagates), as PyTorch
    y, am = oracle.max_pool2d_reference(x, 2)
    assert np.isnan(y[0, 0, 0, 0]) and am[0, 0, 0, 0] == 0
    assert am[0, 0, 1, 1] == 15


@pytest.mark.parametrize("shape, axis", [((2, 5, 3, 4), 1), ((4, 7), 1), ((3, 6), 0), ((2, 3, 4, 5), -1), ((1, 1, 2, 2), 1)])
def test_softmax_references_match_naive_loops(shape, axis, rng):
    x = 4 * rng.standard_normal(shape)
    y, ly = oracle.softmax_reference(x, axis), oracle.log_softmax_reference(x, axis)
    np.testing.assert_allclose(y, naive_softmax(x, axis), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(ly, naive_softmax(x, axis, log=True), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(y.sum(axis=axis), 1.0, rtol=1e-12)
    big = oracle.softmax_reference(x + 1000.0, axis)  # stable: shifting the logits changes nothing
    np.testing.assert_allclose(big, y, rtol=1e-9, atol=1e-15)


# ----------------------------------------------------------------------------------------------
# backward references against central finite differences of sum(dy * f(x))
# ----------------------------------------------------------------------------------------------
def numeric_grad(f, x, dy, eps=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        g[i] = (dy * (f(xp) - f(xm))).sum() / (2 * eps)  # difference first: two full sums would cancel to ~1e-8
    return g


@pytest.mark.parametrize("cip", [True, False])
@pytest.mark.parametrize("geom", [(3, 1, 1), (2, 2, 1), (3, 2, 0), ((3, 2), (1, 2), (1, 1))])
def test_avg_pool_backward_reference_is_the_gradient(geom, cip, rng):
    x = rng.standard_normal((2, 2, 5, 6))
    dy = rng.standard_normal(oracle.avg_pool2d_reference(x, *geom, count_include_pad=cip).shape)
    g = numeric_grad(lambda t: oracle.avg_pool2d_reference(t, *geom, count_include_pad=cip), x, dy)
    dx = oracle.avg_pool2d_backward_reference(dy, x.shape, *geom, count_include_pad=cip)
    np.testing.assert_allclose(dx, g, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("geom", [(3, 1, 1), (2, 2, 1), (3, 2, 0), (2, 1, 0)])
def test_max_pool_backward_reference_is_the_gradient(geom, rng):
    shape = (2, 2, 5, 6)
    x = rng.permutation(np.prod(shape)).reshape(shape) * 0.1  # distinct values: argmax is stable under eps
    y, am = oracle.max_pool2d_reference(x, *geom)
    dy = rng.standard_normal(y.shape)
    g = numeric_grad(lambda t: oracle.max_pool2d_reference(t, *geom)[0], x, dy)
    np.testing.assert_allclose(oracle.max_pool2d_backward_reference(dy, am, shape), g, rtol=1e-6, atol=1e-8)


DILATED = [  # (shape, kernel, stride, padding, dilation): windows whose first taps fall in the padding too
    ((2, 3, 9, 11), 3, 1, 1, 2), ((1, 2, 10, 7), 2, 2, 1, 3), ((2, 3, 8, 9), (3, 2), (2, 1), (1, 1), (2, 3)),
    ((1, 1, 5, 5), 3, 1, 0, 2), ((2, 2, 12, 12), 3, 2, 1, 3),
]


@pytest.mark.parametrize("ceil", [False, True])
@pytest.mark.parametrize("case", DILATED, ids=lambda c: "x".join(map(str, c[0])) + f"-k{c[1]}s{c[2]}p{c[3]}d{c[4]}".replace(" ", ""))
def test_dilated_max_pool_reference_matches_torch(case, ceil, rng):
    torch = pytest.importorskip("torch")
    shape, k, s, p, d = case
    x = rng.standard_normal(shape)
    x[0, 0, :2, :2] = 5.0  # ties: the first tap in row-major window order wins
    xt = torch.tensor(x, requires_grad=True)
    yt, it = torch.nn.functional.max_pool2d(xt, k, s, p, d, ceil_mode=ceil, return_indices=True)
    y, am = oracle.max_pool2d_reference(x, k, s, p, ceil_mode=ceil, dilation=d)
    np.testing.assert_array_equal(y, yt.detach().numpy())
    np.testing.assert_array_equal(am, it.numpy())
    g = pool.pool2d_geometry(shape, k, s, p, ceil_mode=ceil, dilation=d)
    assert (g.ho, g.wo) == tuple(yt.shape[2:]) and (g.dh, g.dw) == ((d, d) if isinstance(d, int) else d)


@pytest.mark.parametrize("ceil", [False, True])
@pytest.mark.parametrize("divisor", [1, 3, 7])
def test_avg_pool_divisor_override_reference_matches_torch(divisor, ceil, rng):
    torch = pytest.importorskip("torch")
    shape = (2, 3, 9, 10)
    x, dy_shape = rng.standard_normal(shape), None
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.nn.functional.avg_pool2d(xt, 3, 2, 1, ceil, True, divisor)
    y = oracle.avg_pool2d_reference(x, 3, 2, 1, ceil_mode=ceil, divisor_override=divisor)
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    dy_shape = y.shape
    dy = rng.standard_normal(dy_shape)
    yt.backward(torch.tensor(dy))
    dx = oracle.avg_pool2d_backward_reference(dy, shape, 3, 2, 1, ceil_mode=ceil, divisor_override=divisor)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape, axis", [((2, 4, 3, 2), 1), ((3, 5), 1), ((3, 5), 0)])
def test_softmax_backward_references_are_the_gradients(shape, axis, rng):
    x, dy = rng.standard_normal(shape), rng.standard_normal(shape)
    g = numeric_grad(lambda t: oracle.softmax_reference(t, axis), x, dy)
    dx = oracle.softmax_backward_reference(dy, oracle.softmax_reference(x, axis), axis)
    np.testing.assert_allclose(dx, g, rtol=1e-6, atol=1e-8)
    g = numeric_grad(lambda t: oracle.log_softmax_reference(t, axis), x, dy)
    dx = oracle.log_softmax_backward_reference(dy, oracle.log_softmax_reference(x, axis), axis)
    np.testing.assert_allclose(dx, g, rtol=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------------------------
# references against PyTorch (CPU build), float64
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ceil", [False, True])
@pytest.mark.parametrize("shape, geom", CASES, ids=CASE_IDS)
def test_pool_references_match_torch(shape, geom, ceil, rng):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = rng.standard_normal(shape)
    xt = torch.tensor(x, requires_grad=True)
    yt, it = F.max_pool2d(xt, *geom, ceil_mode=ceil, return_indices=True)
    y, am = oracle.max_pool2d_reference(x, *geom, ceil_mode=ceil)
    np.testing.assert_array_equal(y, yt.detach().numpy())
    np.testing.assert_array_equal(am, it.numpy())
    dy = rng.standard_normal(y.shape)
    yt.backward(torch.tensor(dy))
    np.testing.assert_allclose(oracle.max_pool2d_backward_reference(dy, am, shape), xt.grad.numpy(), rtol=1e-12, atol=1e-12)
    for cip in (True, False):
        xt.grad = None
        yt = F.avg_pool2d(xt, *geom, ceil_mode=ceil, count_include_pad=cip)
        np.testing.assert_allclose(oracle.avg_pool2d_reference(x, *geom, count_include_pad=cip, ceil_mode=ceil), yt.detach().numpy(),
                                   rtol=1e-12, atol=1e-12)
        yt.backward(torch.tensor(dy))
        dx = oracle.avg_pool2d_backward_reference(dy, shape, *geom, count_include_pad=cip, ceil_mode=ceil)
        np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 257, 2, 3), (6, 10), (3, 1000)])
def test_softmax_references_match_torch(shape, rng):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x, dy = 3 * rng.standard_normal(shape), rng.standard_normal(shape)
    for fn, ref, bwd in (
        (F.softmax, oracle.softmax_reference, oracle.softmax_backward_reference),
        (F.log_softmax, oracle.log_softmax_reference, oracle.log_softmax_backward_reference),
    ):
        xt = torch.tensor(x, requires_grad=True)
        yt = fn(xt, dim=1)
        y = ref(x, 1)
        np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-14)
        yt.backward(torch.tensor(dy))
        np.testing.assert_allclose(bwd(dy, y, 1), xt.grad.numpy(), rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# geometry checks
# ----------------------------------------------------------------------------------------------
def test_geometry_normalizes_and_uses_the_floor_formula():
    assert pool.pool2d_geometry((1, 1, 7, 8), 3) == pool.PoolGeometry(3, 3, 3, 3, 0, 0, 2, 2)
    assert pool.pool2d_geometry((1, 1, 7, 8), 3, 2, 1) == pool.PoolGeometry(3, 3, 2, 2, 1, 1, 4, 4)
    assert pool.pool2d_geometry((1, 1, 7, 8), (3, 2), (1, 2), (1, 0)) == pool.PoolGeometry(3, 2, 1, 2, 1, 0, 7, 4)
    assert pool.pool2d_geometry((1, 1, 1, 1), 2, 1, 1).ho == 2
    assert pool.pool2d_geometry((1, 1, 4, 4), np.int64(2)).ho == 2


@pytest.mark.parametrize(
    "size, k, s, p, floor, ceil",
    [(11, 2, 2, 0, 5, 6), (10, 2, 2, 0, 5, 5), (8, 3, 2, 1, 4, 5), (5, 3, 3, 1, 2, 2), (7, 3, 3, 0, 2, 3), (112, 3, 2, 1, 56, 57)],
)
def test_geometry_ceil_mode_adds_a_window_that_starts_on_real_input(size, k, s, p, floor, ceil):
    """ceil_mode: one more window where the last would start inside the input or its left padding, not
    in the right padding (5 with k 3 / s 3 / p 1: a third window would start at 5, the right pad)."""
    assert pool.pool2d_geometry((1, 1, size, size), k, s, p).ho == floor
    g = pool.pool2d_geometry((1, 1, size, size), k, s, p, ceil_mode=True)
    assert g.ho == g.wo == ceil and (ceil - 1) * s - p < size


@pytest.mark.parametrize(
    "shape, args, operand, match",
    [
        ((1, 1, 2, 5), (3,), "kernel_size", "kernel 3 larger than padded input height 2"),
        ((1, 1, 5, 2), (3, 1, 0), "kernel_size", "kernel 3 larger than padded input width 2"),
        ((1, 1, 1, 1), (4, 1, 1), "kernel_size", "kernel 4 larger than padded input height 1 \\+ 2\\*1 = 3"),
        ((1, 1, 5, 5), (0,), "kernel_size", ">= 1"),
        ((1, 1, 5, 5), ((2, 0),), "kernel_size", ">= 1"),
        ((1, 1, 5, 5), ((2, 2, 2),), "kernel_size", "an int or a pair"),
        ((1, 1, 5, 5), (2.0,), "kernel_size", "an int or a pair"),
        ((1, 1, 5, 5), (True,), "kernel_size", "an int or a pair"),
        ((1, 1, 5, 5), ("3",), "kernel_size", "an int or a pair"),
        ((1, 1, 5, 5), (2, 0), "stride", ">= 1"),
        ((1, 1, 5, 5), (2, (1, -1)), "stride", ">= 1"),
        ((1, 1, 5, 5), (3, 1, -1), "padding", ">= 0"),
        ((1, 1, 5, 5), (3, 1, 2), "padding", "height padding 2 is more than half the kernel 3"),
        ((1, 1, 5, 5), ((3, 2), 1, (1, 2)), "padding", "width padding 2 is more than half the kernel 2"),
        ((1, 1, 5), (2,), "x", "expected a 4-D image"),
        ((1, 0, 5, 5), (2,), "x", "every dim >= 1"),
    ],
)
def test_geometry_errors(shape, args, operand, match):
    with pytest.raises(OperandError, match=match) as ei:
        pool.pool2d_geometry(shape, *args, pattern="max_pool2d")
    assert ei.value.operand == operand
    assert str(ei.value).startswith("max_pool2d: operand ")


@pytest.mark.parametrize("dilation, operand, match", [
    (3, "kernel_size", r"kernel 3 dilated by 3 \(extent 7\) larger than padded input height 5 \+ 2\*0 = 5"),
    (0, "dilation", ">= 1"), ((2, -1), "dilation", ">= 1"), (1.5, "dilation", "an int or a pair"),
])
def test_geometry_dilation_errors(dilation, operand, match):
    with pytest.raises(OperandError, match=match) as ei:
        pool.pool2d_geometry((1, 1, 5, 5), 3, 1, 0, pattern="max_pool2d", dilation=dilation)
    assert ei.value.operand == operand


def test_references_check_geometry():
    with pytest.raises(OperandError, match="kernel 5 larger"):
        oracle.max_pool2d_reference(np.zeros((1, 1, 3, 3)), 5)
    with pytest.raises(OperandError, match="padding"):
        oracle.avg_pool2d_reference(np.zeros((1, 1, 3, 3)), 2, 1, 2)
    with pytest.raises(OperandError, match="expected shape"):
        oracle.avg_pool2d_backward_reference(np.zeros((1, 1, 2, 2)), (1, 1, 3, 3), 2, 2)


# ----------------------------------------------------------------------------------------------
# public API errors without a GPU: host arrays, and fake device arrays with a tripwire on launching
# ----------------------------------------------------------------------------------------------
def call_each(x):
    """Every public function on ``x`` in each array slot."""
    return {
        "max_pool2d": lambda: pool.max_pool2d(x, 2),
        "max_pool2d_backward": lambda: pool.max_pool2d_backward(x, x, (1, 1, 4, 4)),
        "avg_pool2d": lambda: pool.avg_pool2d(x, 2),
        "avg_pool2d_backward": lambda: pool.avg_pool2d_backward(x, (1, 1, 4, 4), 2),
        "softmax": lambda: pool.softmax(x),
        "log_softmax": lambda: pool.log_softmax(x),
        "softmax_backward": lambda: pool.softmax_backward(x, x),
        "log_softmax_backward": lambda: pool.log_softmax_backward(x, x),
    }


@pytest.mark.parametrize("fn", list(call_each(None)))
def test_numpy_input_is_rejected_as_host_memory(fn):
    x = np.zeros((1, 1, 2, 2), np.float32)
    with pytest.raises(OperandError, match="host \\(CPU\\) memory") as ei:
        call_each(x)[fn]()
    assert ei.value.pattern == fn
    assert ei.value.operand in ("x", "dy")


@pytest.mark.parametrize("fn", list(call_each(None)))
def test_cpu_torch_tensor_is_rejected_as_host_memory(fn):
    torch = pytest.importorskip("torch")
    with pytest.raises(OperandError, match="host \\(CPU\\) memory"):
        call_each(torch.zeros(1, 1, 2, 2))[fn]()


def test_other_objects_are_rejected():
    with pytest.raises(OperandError, match="expected a CuPy array, a torch tensor"):
        pool.softmax([[1.0, 2.0]])


class FakeDev:
    """A 'device array' that only knows its metadata."""

    def __init__(self, shape, dtype="float16", layout="NCHW", strides=None, device=0):
        self.shape = tuple(shape)
        if strides is None:
            if layout == "NHWC":
                n, c, h, w = self.shape
                strides = (h * w * c, 1, w * c, c)
            else:
                strides = tensors.row_strides(self.shape)
        self.strides, self.dtype, self.device = tuple(strides), dtype, device


class FakeDevAdapter(adapters.Adapter):
    name = "fake"

    def describe(self, a):
        return a.shape, a.strides, a.dtype, a.device


class Launched(Exception):
    pass


class Tripwire:
    def __init__(self, pattern, first):
        raise Launched(pattern)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(pool, "Launch", Tripwire)
    with adapters.registered(FakeDev, FakeDevAdapter()):
        yield


@pytest.mark.usefixtures("fake")
@pytest.mark.parametrize(
    "call, pattern, operand, match",
    [
        (lambda: pool.max_pool2d(FakeDev((1, 1, 4, 4), "float64"), 2), "max_pool2d", "x", "unsupported dtype float64"),
        (lambda: pool.max_pool2d(FakeDev((1, 4, 4)), 2), "max_pool2d", "x", "expected a 4-D image"),
        (lambda: pool.max_pool2d(FakeDev((2, 3, 4, 5), strides=(120, 40, 10, 2)), 2), "max_pool2d", "x", "neither dense NCHW"),
        (lambda: pool.max_pool2d(FakeDev((1, 1, 2, 4)), 3), "max_pool2d", "kernel_size", "kernel 3 larger than padded input height 2"),
        (lambda: pool.max_pool2d(FakeDev((1, 1, 6, 6)), 3, 1, 2), "max_pool2d", "padding", "more than half"),
        (lambda: pool.avg_pool2d(FakeDev((1, 1, 4, 4), "int32"), 2), "avg_pool2d", "x", "unsupported dtype int32"),
        (lambda: pool.avg_pool2d(FakeDev((4, 4)), 2), "avg_pool2d", "x", "expected a 4-D image"),
        (lambda: pool.max_pool2d_backward(FakeDev((1, 1, 2, 2)), FakeDev((1, 1, 2, 2), "float16"), (1, 1, 4, 4)),
         "max_pool2d_backward", "argmax", "unsupported dtype float16; expected one of int32, int64"),
        (lambda: pool.max_pool2d_backward(FakeDev((1, 1, 2, 2)), FakeDev((1, 1, 2, 3), "int32"), (1, 1, 4, 4)),
         "max_pool2d_backward", "argmax", "expected dy's shape"),
        (lambda: pool.max_pool2d_backward(FakeDev((1, 1, 2, 2)), FakeDev((1, 1, 2, 2), "int32", device=1), (1, 1, 4, 4)),
         "max_pool2d_backward", "argmax", "is on cuda:1"),
        (lambda: pool.max_pool2d_backward(FakeDev((1, 1, 2, 2)), FakeDev((1, 1, 2, 2), "int32"), (1, 2, 4, 4)),
         "max_pool2d_backward", "input_shape", "differ from dy's"),
        (lambda: pool.max_pool2d_backward(FakeDev((1, 1, 2, 2)), FakeDev((1, 1, 2, 2), "int32"), (1, 1, 4)),
         "max_pool2d_backward", "input_shape", "expected 4 positive ints"),
        (lambda: pool.max_pool2d_backward(FakeDev((1, 1, 2, 2)), FakeDev((1, 1, 2, 2), "int32"), None),
         "max_pool2d_backward", "input_shape", "expected 4 ints"),
        (lambda: pool.avg_pool2d_backward(FakeDev((1, 1, 3, 3)), (1, 1, 4, 4), 2), "avg_pool2d_backward", "dy", "expected shape \\(1, 1, 2, 2\\)"),
        (lambda: pool.avg_pool2d_backward(FakeDev((1, 1, 2, 2)), (1, 1, 4, 4), 2, 2, 3), "avg_pool2d_backward", "padding", "more than half"),
        (lambda: pool.softmax(FakeDev((3,))), "softmax", "x", "expected a 2-D \\(batch, classes\\) array or a 4-D image"),
        (lambda: pool.softmax(FakeDev((2, 3, 4))), "softmax", "x", "got rank 3"),
        (lambda: pool.softmax(FakeDev((4, 3), strides=(1, 4))), "softmax", "x", "dense row-major"),
        (lambda: pool.softmax(FakeDev((4, 3), "bool")), "softmax", "x", "unsupported dtype bool"),
        (lambda: pool.softmax(FakeDev((4, 3)), axis=2), "softmax", "axis", "expected an int in \\[-2, 2\\)"),
        (lambda: pool.log_softmax(FakeDev((1, 2, 3, 3)), axis=1.0), "log_softmax", "axis", "expected an int"),
        (lambda: pool.softmax_backward(FakeDev((4, 3)), FakeDev((4, 3), "float32")), "softmax_backward", "y", "expected dtype float16 like 'dy'"),
        (lambda: pool.softmax_backward(FakeDev((4, 3)), FakeDev((3, 4))), "softmax_backward", "y", "expected dy's shape"),
        (lambda: pool.log_softmax_backward(FakeDev((4, 3), device=1), FakeDev((4, 3))), "log_softmax_backward", "y", "put all operands on one device"),
        (lambda: pool.log_softmax_backward(FakeDev((4, 3), "float64"), FakeDev((4, 3))), "log_softmax_backward", "dy", "unsupported dtype"),
    ],
)
def test_errors_before_launch(call, pattern, operand, match):
    with pytest.raises(OperandError, match=match) as ei:
        call()
    assert (ei.value.pattern, ei.value.operand) == (pattern, operand)


@pytest.mark.usefixtures("fake")
@pytest.mark.parametrize(
    "call",
    [
        lambda: pool.max_pool2d(FakeDev((2, 3, 5, 5), "bfloat16", "NHWC"), 3, 2, 1),
        lambda: pool.max_pool2d(FakeDev((1, 1, 1, 1), "float32", strides=(7, 8, 9, 10)), 1),  # size-1 dims: any stride
        lambda: pool.max_pool2d_backward(FakeDev((1, 3, 2, 2)), FakeDev((1, 3, 2, 2), "int64", "NHWC"), (1, 3, 4, 4)),
        lambda: pool.avg_pool2d_backward(FakeDev((1, 1, 2, 2)), (1, 1, 4, 5), 2, count_include_pad=False),
        lambda: pool.softmax(FakeDev((4, 3), "float32"), axis=-1),
        lambda: pool.log_softmax_backward(FakeDev((2, 5, 3, 3), layout="NHWC"), FakeDev((2, 5, 3, 3))),
    ],
)
def test_valid_calls_reach_the_launch(call):
    with pytest.raises(Launched):
        call()


# ----------------------------------------------------------------------------------------------
# the CUDA kernels themselves, compiled for the host with a CUDA shim (g++, C++20, _Float16)
# ----------------------------------------------------------------------------------------------
SHIM = r"""
#include <cstring>
#include <math.h>
#include <barrier>
#define __global__
#define __device__
#define __forceinline__ inline
struct u3 { unsigned int x, y, z; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
static thread_local u3 threadIdx, blockIdx;
static u3 blockDim, gridDim;
extern "C" void set_dims(unsigned g, unsigned b) { gridDim = {g, 1, 1}; blockDim = {b, 1, 1}; }
extern "C" void set_idx(unsigned bi, unsigned ti) { blockIdx = {bi, 0, 0}; threadIdx = {ti, 0, 0}; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static std::barrier<>* warp_barrier = new std::barrier<>(32);
static float warp_lanes[32];
inline float __shfl_xor_sync(unsigned, float v, int o) {  // one warp at a time, its 32 lanes as threads
    int lane = threadIdx.x & 31; warp_lanes[lane] = v; warp_barrier->arrive_and_wait();
    float r = warp_lanes[lane ^ o]; warp_barrier->arrive_and_wait(); return r;
}
inline float atomicAdd(float* p, float v) { float o = *p; *p = o + v; return o; }  // threads run one by one
"""
HOST_F16 = r"""
typedef unsigned short T;
inline float ld(const T* p, long long i) { _Float16 h; memcpy(&h, p + i, 2); return (float)h; }
inline void st(T* p, long long i, float v) { _Float16 h = (_Float16)v; memcpy(p + i, &h, 2); }
"""
STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "int32": np.int32, "int64": np.int64}


def bf16_round(x):
    """float32 -> bfloat16 bits, round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


class HostArray:
    """Host memory posing as a device array of a fusekit dtype name (bfloat16 held as uint16 bits)."""

    def __init__(self, a, name):
        self.a, self.name = a, name

    def values(self):
        if self.name == "bfloat16":
            return (self.a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return self.a.astype(np.float64)


class HostAdapter(adapters.Adapter):
    name = "host"

    def describe(self, h):
        return h.a.shape, tuple(s // h.a.itemsize for s in h.a.strides), h.name, 0


def host_array(x64, dtype, layout):
    """(HostArray of logical ``x64`` in dtype and layout, its exact float64 values)."""
    base = np.ascontiguousarray(x64.transpose(0, 2, 3, 1) if layout == "NHWC" else x64)
    store = bf16_round(base) if dtype == "bfloat16" else base.astype(STORAGE[dtype])
    if layout == "NHWC":
        store = store.transpose(0, 3, 1, 2)
    h = HostArray(store, dtype)
    return h, h.values()


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ to compile the kernels for the host")
    d = tmp_path_factory.mktemp("pool_kernels")
    probe = d / "probe.cpp"
    probe.write_text("#include <barrier>\nint main() { _Float16 h = (_Float16)1.5f; std::barrier<> b(1); return (int)(float)h - 1; }\n")
    if subprocess.run([cxx, "-std=c++20", "-pthread", str(probe), "-o", str(d / "probe")], capture_output=True).returncode:
        pytest.skip("g++ lacks C++20 <barrier> or _Float16")
    libs = {}
    for dtype in pool.FLOAT_DTYPES:
        src, so = d / f"pool_{dtype}.cpp", d / f"pool_{dtype}.so"
        src.write_text(SHIM + (HOST_F16 if dtype == "float16" else pool.dtype_prelude(dtype)) + pool.kernel_file("pool.cu"))
        r = subprocess.run([cxx, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", str(src), "-o", str(so)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        libs[dtype] = ctypes.CDLL(str(so))
    libs["signatures"] = {dtype: kernel_signatures(cxx, dtype) for dtype in pool.FLOAT_DTYPES}
    assert set(libs["signatures"]["float32"]) == {
        "max_pool_fwd", "max_pool_fwd_nhwc_vec", "max_pool_bwd_i32", "max_pool_bwd_i64", "cast_f32", "avg_pool_fwd", "avg_pool_bwd", "softmax_rows", "softmax_rows_warp",
        "layer_norm_channels", "channel_shuffle", "upsample_nearest", "radix_softmax", "depthwise_conv", "depthwise_conv_nhwc_vec", "depthwise_conv_nhwc_tile", "channel_sums", "scaled_store",
        "channel_pointwise", "channel_pointwise_nhwc_vec", "channel_gate_mul", "channel_gate_nhwc_vec",
    }
    return libs


def kernel_signatures(cxx, dtype):
    """{kernel: [parameter type, ...]} of the extern "C" kernels, from the preprocessed CUDA source."""
    src = "#define __global__\n#define __device__\n#define __forceinline__ inline\n" + pool.kernel_source(dtype)
    text = subprocess.run([cxx, "-E", "-P", "-x", "c++", "-"], input=src, capture_output=True, text=True, check=True).stdout
    sigs = {}
    for name, params in re.findall(r'extern "C" void (\w+)\s*\(([^)]*)\)', text):
        sigs[name] = [" ".join(p.split()[:-1]).replace(" *", "*").replace("const ", "") for p in params.split(",")]
    return sigs


# what CuPy packs for each argument must be what the kernel declares (CuPy does not check)
SCALAR_OF = {np.int32: "int", np.int64: "long long", np.float32: "float"}
POINTEE = {"float": np.float32, "int": np.int32, "long long": np.int64}


def check_args(sig, args, dtype):
    assert len(args) == len(sig), (len(args), sig)
    for a, decl in zip(args, sig, strict=True):
        if decl.endswith("*"):
            assert isinstance(a, np.ndarray), (decl, type(a))
            want = STORAGE[dtype] if decl == "T*" else POINTEE[decl[:-1]]
            assert a.dtype == want, (decl, a.dtype)
        else:
            assert SCALAR_OF[type(a)] == decl, (decl, type(a))


@pytest.fixture
def host_launch(host_kernels, monkeypatch):
    """pool's GPU side replaced by host memory and the host-compiled kernels (grid of 2 blocks)."""

    class HostLaunch:
        def __init__(self, pattern, first):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def view(self, op):
            return op.array.a

        def empty(self, like, shape, layout, dtype=None, zero=False):
            name = dtype or like.dtype
            logical = (shape[0], shape[2], shape[3], shape[1]) if layout == "NHWC" else shape
            base = np.empty(logical, STORAGE[name])
            base.view(np.uint8)[...] = 0 if zero else 0xFF  # poison: NaN for floats, -1 for ints
            a = base.transpose(0, 3, 1, 2) if layout == "NHWC" else base
            return HostArray(a, name), a

        def zeros_f32(self, size):
            return np.zeros(size, np.float32)

        @staticmethod
        def address(view):
            return view.ctypes.data

        launched: list = []

        def run(self, dtype, name, threads, args):
            HostLaunch.launched.append(name)
            check_args(host_kernels["signatures"][dtype][name], args, dtype)
            lib = host_kernels[dtype]
            fn = getattr(lib, name)
            conv = {np.int32: ctypes.c_int, np.int64: ctypes.c_longlong, np.float32: ctypes.c_float}
            cargs = [ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray) else conv[type(a)](a.item()) for a in args]
            warp = name in pool.WARP_KERNELS
            lib.set_dims(2, 32 if warp else 3)
            for b in range(2):
                if warp:
                    def lane(t, b=b):
                        lib.set_idx(b, t)
                        fn(*cargs)

                    lanes = [threading.Thread(target=lane, args=(t,)) for t in range(32)]
                    for t in lanes:
                        t.start()
                    for t in lanes:
                        t.join()
                else:
                    for t in range(3):
                        lib.set_idx(b, t)
                        fn(*cargs)

    monkeypatch.setattr(pool, "Launch", HostLaunch)
    with adapters.registered(HostArray, HostAdapter()):
        yield


HOST_TOL = {"float32": 2e-6, "float16": 2e-3, "bfloat16": 1.6e-2}


def dense_in(h, layout):
    """``h`` is dense in ``layout`` (NCHW | NHWC | ROW); strides of size-1 dims do not matter."""
    canon = {"NCHW": tensors.nchw_strides, "NHWC": tensors.nhwc_strides, "ROW": tensors.row_strides}[layout]
    return tensors.matches(tuple(s // h.a.itemsize for s in h.a.strides), canon(h.a.shape), h.a.shape)


HOST_POOL = [(2, 3, 7, 9, 3, 2, 1), (1, 1, 5, 5, 2, 1, 0), (2, 4, 6, 7, 3, 1, 1), (1, 3, 9, 8, (3, 2), (2, 1), (1, 0)), (1, 257, 3, 5, 2, 1, 1),
             (2, 1, 9, 11, 3, 2, 1), (2, 64, 9, 11, 3, 1, 1),  # these two as test_gpu_pool's avg_pool2d cases
             (2, 16, 9, 11, 3, 2, 1), (1, 8, 2, 3, 3, 2, 1),  # channels-last inference kernel: 16-byte lanes
             # other size-1 dims: H = 1, W = 1, a 1x1 plane (NHWC strides then match NCHW too)
             (2, 3, 1, 7, (1, 3), (1, 2), (0, 1)), (2, 3, 6, 1, (3, 1), (2, 1), (1, 0)), (2, 5, 1, 1, 1, 1, 0),
             # ceil_mode: windows past the input's bottom / right edge (clipped to it; divisors as PyTorch's)
             (2, 3, 8, 11, 2, 2, 0, "ceil"), (1, 16, 8, 9, 3, 2, 1, "ceil"), (2, 4, 7, 12, (3, 2), (3, 3), (1, 0), "ceil")]


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize("case", HOST_POOL, ids=lambda c: "x".join(map(str, c[:4])) + ("-ceil" if c[-1] == "ceil" else ""))
def test_host_compiled_pool_kernels(case, dtype, layout, rng):
    n, c, h, w, *geom = case
    ceil = bool(geom[-1] == "ceil")
    geom = geom[:3]
    x, xv = host_array(rng.standard_normal((n, c, h, w)), dtype, layout)
    y, am = pool.max_pool2d(x, *geom, ceil_mode=ceil)
    yr, amr = oracle.max_pool2d_reference(xv, *geom, ceil_mode=ceil)
    assert am.name == "int32" and am.a.dtype == np.int32
    np.testing.assert_array_equal(y.values(), yr)
    np.testing.assert_array_equal(am.a, amr)
    assert dense_in(y, layout) and dense_in(am, layout)
    pool.Launch.launched.clear()
    yi, none = pool.max_pool2d(x, *geom, ceil_mode=ceil, indices=False)  # inference: no argmax (NHWC, C % lanes == 0: 16-byte lanes)
    np.testing.assert_array_equal(yi.values(), yr)
    assert none is None and dense_in(yi, layout)
    lanes = 16 // np.dtype(STORAGE[dtype]).itemsize
    want = "max_pool_fwd_nhwc_vec" if layout == "NHWC" and c % lanes == 0 else "max_pool_fwd"
    assert pool.Launch.launched == [want], pool.Launch.launched
    dy, dyv = host_array(rng.standard_normal(yr.shape), dtype, layout)
    other = "NCHW" if layout == "NHWC" else "NHWC"
    am64 = host_array(amr.astype(np.float64), "float32", other)[0]  # int64 argmax in the other layout
    am64 = HostArray(am64.a.astype(np.int64), "int64")
    for idx in (am, am64):
        dx = pool.max_pool2d_backward(dy, idx, (n, c, h, w))
        assert rel(dx.values(), oracle.max_pool2d_backward_reference(dyv, amr, (n, c, h, w))) < HOST_TOL[dtype]
        assert dense_in(dx, layout)
    for cip in (True, False):
        y = pool.avg_pool2d(x, *geom, count_include_pad=cip, ceil_mode=ceil)
        assert rel(y.values(), oracle.avg_pool2d_reference(xv, *geom, count_include_pad=cip, ceil_mode=ceil)) < HOST_TOL[dtype]
        assert dense_in(y, layout)
        dx = pool.avg_pool2d_backward(dy, (n, c, h, w), *geom, count_include_pad=cip, ceil_mode=ceil)
        ref = oracle.avg_pool2d_backward_reference(dyv, (n, c, h, w), *geom, count_include_pad=cip, ceil_mode=ceil)
        assert rel(dx.values(), ref) < HOST_TOL[dtype]
        assert np.isfinite(dx.values()).all()


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize("ceil", [False, True])
@pytest.mark.parametrize("case", DILATED[:3] + [((2, 16, 9, 11), 3, 2, 1, 2)], ids=lambda c: "x".join(map(str, c[0])))
def test_host_compiled_dilated_max_pool(case, ceil, dtype, layout, rng):
    """Dilated windows in both max-pool kernels (with argmax; channels-last 16-byte lanes without),
    the argmax PyTorch's index, and the backward through it."""
    shape, k, s, p, d = case
    x, xv = host_array(rng.standard_normal(shape), dtype, layout)
    y, am = pool.max_pool2d(x, k, s, p, ceil_mode=ceil, dilation=d)
    yr, amr = oracle.max_pool2d_reference(xv, k, s, p, ceil_mode=ceil, dilation=d)
    np.testing.assert_array_equal(y.values(), yr)
    np.testing.assert_array_equal(am.a, amr)
    pool.Launch.launched.clear()
    yi, _ = pool.max_pool2d(x, k, s, p, ceil_mode=ceil, dilation=d, indices=False)
    np.testing.assert_array_equal(yi.values(), yr)
    lanes = 16 // np.dtype(STORAGE[dtype]).itemsize
    assert pool.Launch.launched == ["max_pool_fwd_nhwc_vec" if layout == "NHWC" and shape[1] % lanes == 0 else "max_pool_fwd"]
    dy, dyv = host_array(rng.standard_normal(yr.shape), dtype, layout)
    dx = pool.max_pool2d_backward(dy, am, shape)
    assert rel(dx.values(), oracle.max_pool2d_backward_reference(dyv, amr, shape)) < HOST_TOL[dtype]


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize("divisor", [1, 5])
def test_host_compiled_avg_pool_divisor_override(divisor, dtype, layout, rng):
    shape = (2, 3, 9, 10)
    x, xv = host_array(rng.standard_normal(shape), dtype, layout)
    for ceil in (False, True):
        y = pool.avg_pool2d(x, 3, 2, 1, ceil_mode=ceil, divisor_override=divisor)
        assert rel(y.values(), oracle.avg_pool2d_reference(xv, 3, 2, 1, ceil_mode=ceil, divisor_override=divisor)) < HOST_TOL[dtype]
        dy, dyv = host_array(rng.standard_normal(y.a.shape), dtype, layout)
        dx = pool.avg_pool2d_backward(dy, shape, 3, 2, 1, ceil_mode=ceil, divisor_override=divisor)
        want = oracle.avg_pool2d_backward_reference(dyv, shape, 3, 2, 1, ceil_mode=ceil, divisor_override=divisor)
        assert rel(dx.values(), want) < HOST_TOL[dtype]
    for bad in (0, -2, 2.5, True):
        with pytest.raises(OperandError, match="divisor_override") as e:
            pool.avg_pool2d(x, 3, divisor_override=bad)
        assert e.value.operand == "divisor_override"


HOST_SOFTMAX = [
    ((2, 3, 5, 7), "NCHW", 1), ((2, 3, 5, 7), "NHWC", 1), ((2, 64, 3, 5), "NHWC", 1), ((1, 257, 3, 3), "NHWC", 1),
    ((2, 64, 3, 5), "NCHW", 1), ((1, 1, 4, 5), "NHWC", 1), ((7, 10), "ROW", 1), ((5, 1000), "ROW", 1),
    ((9, 4), "ROW", 0), ((2, 3, 5, 7), "NHWC", 3), ((2, 3, 40, 7), "NHWC", 0),
    ((2, 1, 4, 5), "NHWC", 1), ((2, 4, 1, 5), "NHWC", 1), ((2, 4, 5, 1), "NHWC", 1), ((2, 40, 1, 1), "NHWC", 1),
    ((2, 4, 1, 5), "NHWC", 3),
]


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize("shape, layout, axis", HOST_SOFTMAX, ids=lambda v: str(v).replace(" ", ""))
def test_host_compiled_softmax_kernels(shape, layout, axis, dtype, rng):
    def make(data, lay):
        if len(shape) == 2:
            store = bf16_round(data) if dtype == "bfloat16" else data.astype(STORAGE[dtype])
            h = HostArray(store, dtype)
            return h, h.values()
        return host_array(data, dtype, lay)

    x, xv = make(3 * rng.standard_normal(shape), layout)
    y, ly = pool.softmax(x, axis), pool.log_softmax(x, axis)
    assert rel(y.values(), oracle.softmax_reference(xv, axis)) < HOST_TOL[dtype]
    assert rel(ly.values(), oracle.log_softmax_reference(xv, axis)) < HOST_TOL[dtype]
    assert dense_in(y, layout) and dense_in(ly, layout)
    for dy_layout in {layout, "NCHW" if layout == "NHWC" else layout}:
        dy, dyv = make(rng.standard_normal(shape), dy_layout)
        dx = pool.softmax_backward(dy, y, axis)
        assert rel(dx.values(), oracle.softmax_backward_reference(dyv, y.values(), axis)) < 2 * HOST_TOL[dtype]
        dx = pool.log_softmax_backward(dy, ly, axis)
        assert rel(dx.values(), oracle.log_softmax_backward_reference(dyv, ly.values(), axis)) < 2 * HOST_TOL[dtype]
        assert dense_in(dx, dy_layout)


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape", [(2, 3, 2, 3), (1, 40, 3, 2), (2, 96, 2, 2), (1, 257, 1, 3)], ids=lambda v: "x".join(map(str, v)))
def test_host_compiled_channel_layer_norm(shape, layout, dtype, rng):
    """The layer norm kernel, lanes striding over the channels of each position, against float64:
    with and without weight and bias, an offset that the mean removes, into ``out`` of the other layout."""
    x, xv = host_array(2 * rng.standard_normal(shape) + 3, dtype, layout)
    c = shape[1]
    g, b = (HostArray(v.astype(np.float32), "float32") for v in (rng.uniform(0.5, 1.5, c), rng.standard_normal(c)))
    y = pool.channel_layer_norm(x, g, b, 1e-5)
    # float32: a row of 3 channels near the +3 offset loses digits to x - mean (a few ulps of the mean
    # over a small deviation), as any float32 layer norm does
    tol = 2e-5 if dtype == "float32" else HOST_TOL[dtype]
    assert rel(y.values(), oracle.channel_layer_norm_reference(xv, g.values(), b.values(), 1e-5)) < tol
    assert dense_in(y, layout)
    other = "NCHW" if layout == "NHWC" else "NHWC"
    out, _ = host_array(np.zeros(shape), dtype, other)
    assert pool.channel_layer_norm(x, out=out) is out
    assert rel(out.values(), oracle.channel_layer_norm_reference(xv)) < tol


def _exact_new_and_into_out(run, want, layout, dtype):
    """``run(out)`` of a kernel that copies stored values: with out None a new array dense in
    ``layout``, then into ``out`` of the other layout (returned as is); both exactly ``want``."""
    y = run(None)
    np.testing.assert_array_equal(y.values(), want)
    assert dense_in(y, layout)
    out, _ = host_array(np.zeros(want.shape), dtype, "NCHW" if layout == "NHWC" else "NHWC")
    assert run(out) is out
    np.testing.assert_array_equal(out.values(), want)


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape, groups", [((2, 12, 3, 2), 2), ((1, 12, 2, 3), 3), ((2, 6, 1, 2), 6), ((1, 5, 2, 2), 1)])
def test_host_compiled_channel_shuffle(shape, groups, layout, dtype, rng):
    """Exact (a permutation of the stored values), into a new array of x's layout or ``out`` of the other."""
    x, xv = host_array(rng.standard_normal(shape), dtype, layout)
    _exact_new_and_into_out(lambda out: pool.channel_shuffle(x, groups, out=out), oracle.channel_shuffle_reference(xv, groups), layout, dtype)


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape, scale", [((2, 3, 3, 2), 2), ((1, 4, 2, 3), (4, 2)), ((1, 2, 2, 1), (1, 8)), ((1, 3, 2, 2), (3, 1))])
def test_host_compiled_upsample_nearest(shape, scale, layout, dtype, rng):
    """Exact (each stored value repeated), into a new array of x's layout or ``out`` of the other."""
    x, xv = host_array(rng.standard_normal(shape), dtype, layout)
    _exact_new_and_into_out(lambda out: resample.upsample_nearest2d(x, scale, out=out), oracle.upsample_nearest2d_reference(xv, scale),
                            layout, dtype)


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("scale, words", [(0, "scale.*>= 1"), ((2, 2, 2), "scale.*pair of ints"), (1.5, "scale.*pair of ints")])
def test_upsample_nearest_refuses_a_bad_scale_and_a_wrong_out(scale, words, rng):
    x, _ = host_array(rng.standard_normal((1, 4, 2, 2)), "float32", "NHWC")
    with pytest.raises(OperandError, match=words):
        resample.upsample_nearest2d(x, scale)
    out, _ = host_array(np.zeros((1, 4, 2, 2)), "float32", "NHWC")
    with pytest.raises(OperandError, match="out"):
        resample.upsample_nearest2d(x, 2, out=out)


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize("radix, card, c", [(2, 1, 3), (4, 2, 5), (1, 3, 2)])
def test_host_compiled_radix_softmax(radix, card, c, dtype, rng):
    """Against float64 (the softmax accumulated in float32, stored in the dtype); ``out`` is written."""
    shape = (2, radix * card * c, 1, 1)
    z, zv = host_array(rng.standard_normal(shape) * 3, dtype, "NCHW")
    want = oracle.radix_softmax_reference(zv, radix, card)
    tol = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6}[dtype]
    assert rel(pool.radix_softmax(z, radix, card).values(), want) < tol
    out, _ = host_array(np.zeros(shape), dtype, "NHWC")
    assert pool.radix_softmax(z, radix, card, out=out) is out
    assert rel(out.values(), want) < tol


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("shape, radix, card, words", [((1, 12, 1, 1), 0, 1, "radix.*positive int"), ((1, 12, 1, 1), 2, True, "cardinality"),
                                                        ((1, 12, 1, 1), 5, 1, "multiple of cardinality \\* radix = 5"),
                                                        ((1, 12, 2, 1), 2, 1, "K, 1, 1")])
def test_radix_softmax_refuses_what_it_cannot_split(shape, radix, card, words, rng):
    z, _ = host_array(rng.standard_normal(shape), "float32", "NCHW")
    with pytest.raises(OperandError, match=words):
        pool.radix_softmax(z, radix, card)


DEPTHWISE = [  # (shape, R x S, stride, padding, dilation)
    ((2, 5, 7, 6), (3, 3), 1, 1, 1), ((1, 4, 9, 9), (7, 7), 1, 3, 1), ((2, 3, 8, 7), (5, 5), 2, 2, 1), ((1, 6, 9, 10), (3, 3), 1, 2, 2),
    ((2, 4, 5, 6), (3, 1), (2, 1), (1, 0), 1), ((1, 2, 4, 4), (1, 1), 1, 0, 1),
    ((2, 16, 7, 6), (7, 7), 1, 3, 1), ((1, 24, 9, 8), (3, 3), 2, 1, 1), ((1, 8, 6, 6), (5, 5), 1, 4, 2),  # channels-last: 16-byte lanes
    ((1, 8, 5, 13), (3, 9), 1, (1, 4), 1), ((2, 16, 6, 5), (5, 3), (2, 1), (2, 1), (2, 1)), ((1, 8, 4, 4), (11, 11), 1, 5, 1)]


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", DEPTHWISE, ids=str)
@pytest.mark.parametrize("act", [("identity", 0.0), ("relu", 0.0), ("clip", 6.0), ("silu", 0.0), ("gelu", 0.0), ("gelu_tanh", 0.0),
                                 ("sigmoid", 0.0), ("tanh", 0.0), ("hardswish", 0.0), ("hardsigmoid", 0.0), ("leaky_relu", 0.2),
                                 ("elu", 0.7)], ids=str)
def test_host_compiled_depthwise_conv(case, act, layout, dtype, rng):
    """The depthwise kernel against float64 (every activation, stride, padding, dilation, with and
    without bias), its filter as given (C, 1, R, S) and as depthwise_taps' (R, S, C) view, into a new
    array of x's layout or ``out`` of the other."""
    from fusekit.ops import depthwise

    shape, (r, s), stride, padding, dilation = case
    c = shape[1]
    x, xv = host_array(3 * rng.standard_normal(shape), dtype, layout)
    w64, b64 = rng.standard_normal((c, 1, r, s)) / (r * s) ** 0.5, rng.standard_normal(c)
    w, b = HostArray(w64.astype(np.float32), "float32"), HostArray(b64.astype(np.float32), "float32")
    want = oracle.depthwise_conv2d_reference(xv, w.values(), b.values(), pair(padding), pair(stride), pair(dilation), *act)
    taps = HostArray(depthwise.depthwise_taps(w.a), "float32")
    launched = pool.Launch.launched
    launched.clear()
    y = depthwise.depthwise_conv2d(x, taps, b, stride=stride, padding=padding, dilation=dilation, activation=act[0], alpha=act[1])
    assert y.values().shape == want.shape and rel(y.values(), want) < HOST_TOL[dtype]
    assert dense_in(y, layout)
    vec = layout == "NHWC" and c % (4 if dtype == "float32" else 8) == 0  # dense channels-last, whole 16-byte lanes
    tile = vec and pair(stride)[1] == pair(dilation)[1] == 1 and s <= 9  # unit steps along W: a window of loads
    assert launched == ["depthwise_conv_nhwc_tile" if tile else "depthwise_conv_nhwc_vec" if vec else "depthwise_conv"], launched
    other = "NCHW" if layout == "NHWC" else "NHWC"
    out, _ = host_array(np.zeros(want.shape), dtype, other)
    got = depthwise.depthwise_conv2d(x, w, stride=stride, padding=padding, dilation=dilation, activation=act[0], alpha=act[1], out=out)
    nob = oracle.depthwise_conv2d_reference(xv, w.values(), None, pair(padding), pair(stride), pair(dilation), *act)
    assert got is out and rel(out.values(), nob) < HOST_TOL[dtype]


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize(("layout", "stride", "kernel"), [("NCHW", 2, "depthwise_conv"), ("NHWC", 2, "depthwise_conv_nhwc_vec"),
                                                          ("NHWC", 1, "depthwise_conv_nhwc_tile")])
def test_host_compiled_depthwise_conv_with_extra_padding_after(layout, stride, kernel, dtype, rng):
    """TensorFlow's asymmetric "same" padding (``extra_padding`` rows / columns after x): every kernel
    reads zeros past x, against float64 of the explicitly padded input."""
    from fusekit.ops import depthwise

    x, xv = host_array(3 * rng.standard_normal((2, 16, 8, 7)), dtype, layout)
    w = HostArray((rng.standard_normal((16, 1, 3, 3)) / 3).astype(np.float32), "float32")
    padded = np.pad(xv, ((0, 0), (0, 0), (0, 1), (0, 2)))
    want = oracle.depthwise_conv2d_reference(padded, w.values(), None, (0, 0), (stride, stride), (1, 1), "silu", 0.0)
    launched = pool.Launch.launched
    launched.clear()
    y = depthwise.depthwise_conv2d(x, HostArray(depthwise.depthwise_taps(w.a), "float32"), stride=stride, activation="silu",
                                   extra_padding=(1, 2))
    assert launched == [kernel] and y.values().shape == want.shape and rel(y.values(), want) < HOST_TOL[dtype]


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("stride", [1, 2])
def test_host_compiled_depthwise_conv_on_channel_slices(stride, layout, dtype, rng):
    """x a channel slice of a larger image (ShuffleNet's chunk, MixNet's split) and ``out`` a channel
    slice of a concatenation's buffer: the strided kernel reads and writes through their strides,
    against float64, leaving the rest of the buffer as it was."""
    from fusekit.ops import depthwise

    big, bigv = host_array(3 * rng.standard_normal((2, 24, 7, 6)), dtype, layout)
    x, xv = HostArray(big.a[:, 8:16], dtype), bigv[:, 8:16]
    w = HostArray((rng.standard_normal((8, 1, 3, 3)) / 3).astype(np.float32), "float32")
    want = oracle.depthwise_conv2d_reference(xv, w.values(), None, (1, 1), (stride, stride), (1, 1), "relu", 0.0)
    launched = pool.Launch.launched
    launched.clear()
    y = depthwise.depthwise_conv2d(x, w, stride=stride, padding=1, activation="relu")
    assert rel(y.values(), want) < HOST_TOL[dtype] and dense_in(y, "NHWC") and launched == ["depthwise_conv"], launched
    cat, catv = host_array(np.full((2, 20) + want.shape[2:], 7.0), dtype, layout)
    out = HostArray(cat.a[:, 4:12], dtype)
    assert depthwise.depthwise_conv2d(x, w, stride=stride, padding=1, activation="relu", out=out) is out
    assert rel(out.values(), want) < HOST_TOL[dtype]
    rest = np.concatenate([cat.values()[:, :4], cat.values()[:, 12:]], axis=1)
    assert (rest == 7.0).all()
    overlapping = HostArray(np.lib.stride_tricks.as_strided(cat.a, want.shape, (cat.a.itemsize,) * 4), dtype)
    with pytest.raises(OperandError, match="out"):
        depthwise.depthwise_conv2d(x, w, stride=stride, padding=1, out=overlapping)


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape", [(2, 5, 7, 6), (3, 40, 1, 1), (1, 3, 9, 11), (2, 24, 2, 3)], ids=str)
@pytest.mark.parametrize("target", [1, 7, 1 << 18])
def test_host_compiled_global_avg_pool(shape, layout, dtype, target, rng, monkeypatch):
    """Partial sums over every split of the planes (one split, several, one per position), then the
    scaled store: x.mean((2, 3)) within one rounding, into a new array or ``out`` of the other layout."""
    from fusekit.ops import reduce

    monkeypatch.setattr(reduce, "TARGET_THREADS", target)
    x, xv = host_array(2 * rng.standard_normal(shape) + 1, dtype, layout)
    want = xv.mean(axis=(2, 3), keepdims=True)
    y = reduce.global_avg_pool(x)
    assert y.values().shape == want.shape and rel(y.values(), want) < HOST_TOL[dtype]
    out, _ = host_array(np.zeros(want.shape), dtype, "NCHW" if layout == "NHWC" else "NHWC")
    assert reduce.global_avg_pool(x, out=out) is out and rel(out.values(), want) < HOST_TOL[dtype]


CHANNELWISE = [(2, 16, 3, 5), (1, 24, 1, 1), (2, 5, 4, 3), (1, 8, 7, 7)]


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape", CHANNELWISE, ids=str)
@pytest.mark.parametrize("form", ["affine", "affine+z", "z", "act only"])
@pytest.mark.parametrize("act", [("identity", 0.0), ("relu", 0.0), ("clip", 6.0), ("silu", 0.0), ("hardswish", 0.0), ("elu", 0.7)], ids=str)
def test_host_compiled_channel_pointwise(act, form, shape, layout, dtype, rng):
    """act(x * gamma + beta + z) in every form (affine or not, with z or not) against float64, the
    16-byte channels-last kernel where every operand is dense channels-last with whole lanes of
    channels, else the strided one; into a new array of x's layout or ``out`` of the other."""
    from fusekit.ops import channelwise

    c = shape[1]
    x, xv = host_array(3 * rng.standard_normal(shape), dtype, layout)
    z, zv = host_array(rng.standard_normal(shape), dtype, layout) if "z" in form else (None, 0.0)
    g64, b64 = rng.standard_normal(c), rng.standard_normal(c)
    g, b = (HostArray(g64.astype(np.float32), "float32"), HostArray(b64.astype(np.float32), "float32")) if "affine" in form else (None, None)
    pre = xv * g.values().reshape(1, c, 1, 1) + b.values().reshape(1, c, 1, 1) if g is not None else xv
    want = oracle.activation(pre + zv, *act)
    launched = pool.Launch.launched
    launched.clear()
    y = channelwise.pointwise(x, g, b, z, activation=act[0], alpha=act[1])
    assert rel(y.values(), want) < HOST_TOL[dtype] and dense_in(y, layout)
    vec = layout == "NHWC" and shape[2] * shape[3] > 1 and c % (4 if dtype == "float32" else 8) == 0
    assert launched == ["channel_pointwise_nhwc_vec" if vec else "channel_pointwise"], launched
    out, _ = host_array(np.zeros(shape), dtype, "NCHW" if layout == "NHWC" else "NHWC")
    assert channelwise.pointwise(x, g, b, z, activation=act[0], alpha=act[1], out=out) is out and rel(out.values(), want) < HOST_TOL[dtype]


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape", CHANNELWISE, ids=str)
def test_host_compiled_channel_gate(shape, layout, dtype, rng):
    """x * s with s (N, C, 1, 1) against float64 (each image its own gate), the 16-byte channels-last
    kernel where x and y are dense channels-last with whole lanes of channels."""
    from fusekit.ops import channelwise

    n, c = shape[:2]
    x, xv = host_array(3 * rng.standard_normal(shape), dtype, layout)
    s, sv = host_array(rng.random((n, c, 1, 1)), dtype, "NCHW")
    launched = pool.Launch.launched
    launched.clear()
    y = channelwise.gate(x, s)
    assert rel(y.values(), xv * sv) < HOST_TOL[dtype] and dense_in(y, layout)
    vec = layout == "NHWC" and shape[2] * shape[3] > 1 and c % (4 if dtype == "float32" else 8) == 0
    assert launched == ["channel_gate_nhwc_vec" if vec else "channel_gate_mul"], launched


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("bad, words", [
    ({"gamma": 4}, "pass gamma and beta together"), ({"gamma": 3, "beta": 3}, "gamma.*float32 host vector of x's 4 channels"),
    ({"z": (1, 4, 5, 4)}, "z.*x's shape"), ({"activation": "mish"}, "activation"), ({"activation": "clip", "alpha": 0.0}, "alpha"),
    ({"s": (1, 4, 1, 2)}, "s.*gate of shape \\(1, 4, 1, 1\\)"),
])
def test_channelwise_bad_operands_are_named(bad, words, rng):
    from fusekit.ops import channelwise

    x, _ = host_array(rng.standard_normal((1, 4, 5, 5)), "float32", "NHWC")
    vec = lambda k: HostArray(rng.standard_normal(bad[k]).astype(np.float32), "float32") if k in bad else None  # noqa: E731
    with pytest.raises(OperandError, match=words):
        if "s" in bad:
            channelwise.gate(x, host_array(rng.standard_normal(bad["s"]), "float32", "NCHW")[0])
        else:
            z = host_array(rng.standard_normal(bad["z"]), "float32", "NHWC")[0] if "z" in bad else None
            channelwise.pointwise(x, vec("gamma"), vec("beta"), z, **{k: v for k, v in bad.items() if k in ("activation", "alpha")})


def test_depthwise_kernel_codes_are_the_fused_graphs_activations():
    from fusekit.ops import depthwise

    from fusekit.engine.patterns import ACTIVATIONS

    assert set(depthwise.ACT_CODES) == set(ACTIVATIONS)


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("bad, words", [
    ({"w": "f16"}, "w.*float32 host filter of shape \\(4, 1, R, S\\)"), ({"w": (3, 1, 3, 3)}, "w.*shape"),
    ({"stride": 0}, "argument 'stride': expected values >= 1"), ({"padding": (1, -1)}, "argument 'padding': expected values >= 0"), ({"activation": "mish"}, "activation"),
    ({"activation": "clip", "alpha": 0.0}, "alpha"), ({"alpha": float("nan")}, "alpha"), ({"w": (4, 1, 9, 9)}, "does not fit"),
    ({"b": 3}, "b.*float32 host vector of x's 4 channels"),
])
def test_depthwise_conv_bad_operands_are_named(bad, words, rng):
    from fusekit.ops import depthwise

    x, _ = host_array(rng.standard_normal((1, 4, 5, 5)), "float32", "NHWC")
    wshape = bad.get("w") if isinstance(bad.get("w"), tuple) else (4, 1, 3, 3)
    w = HostArray(rng.standard_normal(wshape).astype(np.float16 if bad.get("w") == "f16" else np.float32),
                  "float16" if bad.get("w") == "f16" else "float32")
    b = HostArray(rng.standard_normal(bad["b"]).astype(np.float32), "float32") if "b" in bad else None
    kw = {k: v for k, v in bad.items() if k not in ("w", "b")}
    with pytest.raises(OperandError, match=words):
        depthwise.depthwise_conv2d(x, w, b, **kw)


@pytest.mark.usefixtures("host_launch")
@pytest.mark.parametrize("groups", [0, 5, 2.0, True])
def test_channel_shuffle_refuses_groups_that_do_not_divide_the_channels(groups, rng):
    x, _ = host_array(rng.standard_normal((1, 12, 2, 2)), "float32", "NHWC")
    with pytest.raises(OperandError, match="groups.*positive int dividing x's 12 channels"):
        pool.channel_shuffle(x, groups)


# ----------------------------------------------------------------------------------------------
# the GPU tests' float64 reference copies (tests/torchref.py), on CuPy's strides for size-1 dims
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 1, 9, 11), (2, 3, 1, 1), (1, 1, 9, 11), (1, 3, 9, 11), (2, 3, 1, 11), (2, 3, 9, 1)])
def test_reference_copies_are_nchw_whatever_the_strides_of_size1_dims(shape, rng):
    """fusekit.nhwc of a CuPy (N, H, W, C) buffer has stride 1 on C, also when C = 1: torch calls
    that tensor contiguous (``.contiguous()`` returns it unchanged) but runs it as channels-last.
    test_gpu_pool's references were then computed by torch's CUDA channels-last avg_pool2d
    backward (shifted by the padding, pytorch#188344): every cupy-NHWC-C=1 padded case failed."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    from helpers import float64_nchw

    n, c, h, w = shape
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    t = torch.from_numpy(x).permute(0, 3, 1, 2)  # the strides of fusekit.nhwc(cupy array)
    assert t.stride() == tensors.nhwc_strides(shape)
    ref = float64_nchw(t)
    assert ref.dtype == torch.float64 and ref.stride() == tensors.nchw_strides(shape)
    np.testing.assert_array_equal(ref.numpy(), x.transpose(0, 3, 1, 2))
    # torch computes on it in its contiguous format: NCHW results and gradients
    leaf = ref.requires_grad_(True)
    y = F.avg_pool2d(leaf, 1)
    assert y.stride() == tensors.nchw_strides(tuple(y.shape))
    y.backward(float64_nchw(torch.ones_like(y)))
    assert leaf.grad.stride() == tensors.nchw_strides(shape)


def test_cuda_sources_ship_as_package_files():
    """The kernels' CUDA C lives in fusekit/ops/kernels/ (package data, listed in pyproject.toml): every
    storage dtype's prelude and both modules load, with their suffixes substituted."""
    import tomllib
    from pathlib import Path

    from fusekit.ops import pool

    for dt in pool.FLOAT_DTYPES:
        src = pool.kernel_source(dt)
        assert "$" not in src and "typedef" in src and 'extern "C" __global__ void max_pool_fwd(' in src
        assert "typedef" in pool.dtype_prelude(dt, "_w") and "ld_w(" in pool.dtype_prelude(dt, "_w")
    assert 'extern "C" __global__ void fold_batchnorm(' in pool.kernel_file("fold_batchnorm.cu")
    with pytest.raises(ValueError, match="float64"):
        pool.dtype_prelude("float64")
    shipped = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    kernels = Path(pool.__file__).parent / "kernels"
    assert shipped["fusekit.ops"] == ["kernels/*.cu", "kernels/*.cuh"] and sorted(p.suffix for p in kernels.iterdir()) == [".cu", ".cu", ".cuh", ".cuh", ".cuh"]
