"""GPU: every conv pattern against the float64 oracle, on fresh random inputs, poisoned outputs."""

import numpy as np
import pytest

import fusekit
from fusekit.engine import oracle

pytestmark = pytest.mark.gpu

# (N, C, H, W, K, R, S, padding, stride, dilation)
SHAPES = [
    (2, 64, 28, 28, 64, 3, 3, 1, 1, 1),  # 3x3
    (4, 32, 17, 17, 48, 3, 3, 1, 2, 1),  # stride 2, odd spatial
    (2, 64, 14, 14, 256, 1, 1, 0, 1, 1),  # 1x1
    (2, 3, 32, 32, 16, 7, 7, 3, 2, 1),  # 7x7 stem, stride 2, C=3
    (1, 5, 9, 11, 7, 3, 3, 1, 1, 1),  # batch 1, odd channels both sides
    (3, 16, 12, 12, 24, 3, 3, 2, 1, 2),  # dilation 2
    (1, 128, 7, 7, 33, 1, 1, 0, 1, 1),  # batch 1, odd K
]
IDS = [f"n{s[0]}c{s[1]}h{s[2]}w{s[3]}k{s[4]}r{s[5]}s{s[6]}p{s[7]}st{s[8]}d{s[9]}" for s in SHAPES]
PATTERNS = ["conv_bias_relu", "conv_bias", "conv", "conv_bias_relu6", "conv_bias_add"]
# Normwise relative error bounds against float64 (inputs rounded to the dtype first): fp16 and bf16
# outputs carry one rounding of 2^-11 / 2^-8; fp32 may run on TF32 tensor cores (10-bit mantissa).
TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 2e-3}
# Elementwise bounds, relative to the magnitude conv(|x|, |w|) + |b| + |z| of each output element (the
# forward error bound of a dot product): for outputs too small for normwise statistics, where
# cancellation makes ||ref|| tiny. TF32 may truncate both factors to 10 bits (2 x 2^-10 per product).
BOUND_TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 4e-3}


def _torch():
    return pytest.importorskip("torch")


def _make(lib, shape, dtype, layout, rng, scale=1.0):
    """(device array, its exact values as float64) from fresh random data (times scale)."""
    data = (rng.standard_normal(shape) * scale).astype(np.float32)
    if lib == "torch":
        torch = _torch()
        t = torch.from_numpy(data).to("cuda").to(getattr(torch, dtype))
        if layout == "NHWC" and t.dim() == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        return t, t.double().cpu().numpy()
    cp = pytest.importorskip("cupy")
    if dtype == "bfloat16":
        pytest.skip("bf16 through CuPy is covered by the torch cases")
    a = cp.asarray(data.astype(dtype))
    if layout == "NHWC" and a.ndim == 4:
        a = fusekit.nhwc(cp.ascontiguousarray(a.transpose(0, 2, 3, 1)))
    return a, cp.asnumpy(a).astype(np.float64)


def _host(a):
    if hasattr(a, "detach"):
        return a.detach().double().cpu().numpy()
    import cupy as cp

    return cp.asnumpy(a).astype(np.float64)


def _poisoned_like(lib, ref_shape, dtype, layout):
    if lib == "torch":
        torch = _torch()
        fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
        return torch.full(ref_shape, float("nan"), dtype=getattr(torch, dtype), device="cuda").contiguous(memory_format=fmt)
    import cupy as cp

    n, c, h, w = ref_shape
    if layout == "NHWC":
        return fusekit.nhwc(cp.full((n, h, w, c), np.nan, dtype=dtype))
    return cp.full(ref_shape, np.nan, dtype=dtype)


def _written(y, ref):
    """y on the host as float64, checked for ref's shape and for elements never written (NaN / Inf)."""
    yh = _host(y)
    assert yh.shape == ref.shape
    assert np.isfinite(yh).all(), "output has NaN/Inf: some element was not written"
    return yh


def _check(y, ref, dtype):
    yh = _written(y, ref)
    err = np.linalg.norm(yh - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err < TOL[dtype], f"relative error {err:.3e} over {TOL[dtype]:.0e}"
    # elementwise: no single element far off (catches a wrong tile that the norm would average away)
    worst = np.abs(yh - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert worst < 20 * TOL[dtype], f"worst element off by {worst:.3e} of max|ref|"
    return err


def _check_bound(y, ref, mag, dtype):
    """Every element within BOUND_TOL of its own magnitude (garbage or a missing write fails)."""
    yh = _written(y, ref)
    worst = (np.abs(yh - ref) / mag).max()
    assert worst < BOUND_TOL[dtype], f"element off by {worst:.3e} of its magnitude, over {BOUND_TOL[dtype]:.0e}"


def _magnitude(refs, attrs):
    """conv(|x|, |w|) (+ |b|) (+ |z|): what each output's rounding error is relative to."""
    mag = oracle.evaluate("conv", np.abs(refs[0]), np.abs(refs[1]), **attrs)[0]
    if len(refs) > 2:
        mag = mag + np.abs(refs[2]).reshape(1, -1, 1, 1)
    if len(refs) > 3:
        mag = mag + np.abs(refs[3])
    return mag


def _run_case(lib, pattern, shape, dtype, layout, rng, elementwise=False):
    """elementwise: check each element against its own error bound instead of the normwise error."""
    n, c, h, w, k, r, s, pad, st, dil = shape
    # ReLU6: x scaled up so that a good share of outputs is clipped at 6
    x, xr = _make(lib, (n, c, h, w), dtype, layout, rng, 4.0 if pattern == "conv_bias_relu6" else 1.0)
    wt, wr = _make(lib, (k, c, r, s), dtype, layout, rng)
    operands, refs = [x, wt], [xr, wr]
    if pattern != "conv":
        b, br = _make(lib, (k,), dtype, "NCHW", rng)
        operands.append(b)
        refs.append(br)
    attrs = dict(padding=pad, stride=st, dilation=dil)
    if pattern.startswith("conv_bias_add"):  # the residual z, shaped like the output
        shape_y = oracle.evaluate("conv", xr, wr, **attrs)[0].shape
        z, zr = _make(lib, shape_y, dtype, layout, rng)
        operands.append(z)
        refs.append(zr)
    (ref,) = oracle.evaluate(pattern, *refs, **attrs)
    check = _check
    if elementwise:
        mag = _magnitude(refs, attrs)

        def check(y, ref, dtype):
            _check_bound(y, ref, mag, dtype)

    # output allocated by fusekit, in the input's layout and array type
    y = fusekit.call(pattern, *operands, **attrs)
    assert type(y) is type(x)
    if lib == "torch":
        torch = _torch()
        want_fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
        assert y.is_contiguous(memory_format=want_fmt)
    check(y, ref, dtype)
    # into a poisoned out buffer
    out = _poisoned_like(lib, ref.shape, dtype, layout)
    y2 = fusekit.call(pattern, *operands, out=out, **attrs)
    assert y2 is out
    check(out, ref, dtype)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_pattern_torch(pattern, shape, dtype, layout, rng):
    _run_case("torch", pattern, shape, dtype, layout, rng)


#: Residual-add convolutions with a 1x1 output: on NCHW x cuDNN 9.19 built them and returned garbage
#: (found by the fuzzer; fusekit.engine.lower.untrusted runs them on channels-last copies).
#: Four outputs are too few for a normwise error: on the H100 a float32 TF32 engine that truncates its
#: inputs gave 2.2e-3 and 2.9e-3 normwise (replayed exactly on the host with truncated inputs; each
#: element within 4.3e-4 of its magnitude), so these cases check every element against its own bound.
ONE_BY_ONE = [(2, 2, 1, 2, 2, 1, 1, 0, (1, 2), 1), (3, 8, 3, 3, 16, 3, 3, 0, 1, 1), (2, 6, 2, 2, 4, 1, 1, 0, 2, 1)]


@pytest.mark.parametrize("lib", ["torch", "cupy"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("shape", ONE_BY_ONE, ids=lambda s: "x".join(map(str, s[:4])))
@pytest.mark.parametrize("pattern", ["conv_bias_add", "conv_bias_add_relu"])
def test_residual_add_with_a_one_by_one_output(pattern, shape, dtype, layout, lib, rng):
    if lib == "cupy":
        pytest.importorskip("cupy")
    _run_case(lib, pattern, shape, dtype, layout, rng, elementwise=True)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("shape", SHAPES[:3] + SHAPES[4:5], ids=IDS[:3] + IDS[4:5])
def test_conv_bias_relu_cupy(shape, dtype, layout, rng):
    _run_case("cupy", "conv_bias_relu", shape, dtype, layout, rng)


def test_dlpack_producer(rng):
    """Any __dlpack__ producer is taken (zero-copy) and the result is a CuPy array."""
    cp = pytest.importorskip("cupy")
    torch = _torch()

    class Producer:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, **kw):
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    x, xr = _make("torch", (2, 8, 9, 9), "float16", "NHWC", rng)
    w, wr = _make("torch", (16, 8, 3, 3), "float16", "NHWC", rng)
    b, br = _make("torch", (16,), "float16", "NCHW", rng)
    y = fusekit.conv_bias_relu(Producer(x), Producer(w), Producer(b), padding=1)
    assert isinstance(y, cp.ndarray)
    torch.cuda.synchronize()
    (ref,) = oracle.evaluate("conv_bias_relu", xr, wr, br, padding=1)
    _check(y, ref, "float16")


def test_cache_hit_returns_same_plan(rng):
    torch = _torch()
    x, _ = _make("torch", (2, 16, 10, 10), "float16", "NHWC", rng)
    w, _ = _make("torch", (32, 16, 3, 3), "float16", "NHWC", rng)
    b, _ = _make("torch", (32,), "float16", "NCHW", rng)
    cache = fusekit.default_cache()
    fusekit.dispatch.clear_dispatch()  # calls of earlier tests with these shapes must not count
    p1 = fusekit.plan_for("conv_bias_relu", x, w, b, padding=1)
    builds = cache.stats.builds
    p2 = fusekit.plan_for("conv_bias_relu", x, w, b, padding=(1, 1))
    assert p1 is p2 and cache.stats.builds == builds
    hits = cache.stats.hits
    fusekit.conv_bias_relu(x, w, b, padding=1)  # resolves once through the cache (a hit) ...
    fusekit.conv_bias_relu(x, w, b, padding=1)  # ... then dispatches without touching it
    torch.cuda.synchronize()
    assert cache.stats.builds == builds and cache.stats.hits == hits + 1
    # fresh arrays of the same signature reuse the plan
    x2, _ = _make("torch", (2, 16, 10, 10), "float16", "NHWC", rng)
    assert fusekit.plan_for("conv_bias_relu", x2, w, b, padding=1) is p1
    # another dtype is another plan
    p3 = fusekit.plan_for("conv_bias_relu", x.float(), w.float(), b.float(), padding=1)
    assert p3 is not p1 and p3.key.specs[0][1].dtype == "float32"
    assert p1.workspace_size >= 0 and p1.engine


def test_current_stream_is_used(rng):
    """Work goes on the caller's current torch stream; results are right after syncing it."""
    torch = _torch()
    x, xr = _make("torch", (4, 32, 20, 20), "float16", "NHWC", rng)
    w, wr = _make("torch", (32, 32, 3, 3), "float16", "NHWC", rng)
    b, br = _make("torch", (32,), "float16", "NCHW", rng)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = fusekit.conv_bias_relu(x, w, b, padding=1)
        plan = fusekit.plan_for("conv_bias_relu", x, w, b, padding=1)
    s.synchronize()
    (ref,) = oracle.evaluate("conv_bias_relu", xr, wr, br, padding=1)
    _check(y, ref, "float16")
    assert plan is fusekit.plan_for("conv_bias_relu", x, w, b, padding=1)  # same key on another stream


def test_cuda_graph_capture(rng):
    """A warmed-up fused call can be captured in a CUDA graph and replayed on new data."""
    torch = _torch()
    x, _ = _make("torch", (2, 32, 16, 16), "float16", "NHWC", rng)
    w, wr = _make("torch", (64, 32, 3, 3), "float16", "NHWC", rng)
    b, br = _make("torch", (64,), "float16", "NCHW", rng)
    out = torch.empty((2, 64, 16, 16), dtype=torch.float16, device="cuda").contiguous(memory_format=torch.channels_last)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fusekit.conv_bias_relu(x, w, b, padding=1, out=out)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fusekit.conv_bias_relu(x, w, b, padding=1, out=out)
    x_new, xr_new = _make("torch", (2, 32, 16, 16), "float16", "NHWC", rng)
    x.copy_(x_new)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    (ref,) = oracle.evaluate("conv_bias_relu", xr_new, wr, br, padding=1)
    _check(out, ref, "float16")


def test_errors_before_cudnn(rng):
    torch = _torch()
    x, _ = _make("torch", (2, 8, 9, 9), "float16", "NHWC", rng)
    w, _ = _make("torch", (16, 8, 3, 3), "float16", "NHWC", rng)
    b, _ = _make("torch", (16,), "float16", "NCHW", rng)
    with pytest.raises(fusekit.OperandError, match="'w'.*expected 8 input channels"):
        fusekit.conv_bias_relu(x, w[:, :4].contiguous(), b, padding=1)
    with pytest.raises(fusekit.OperandError, match="'b'.*expected length 16"):
        fusekit.conv_bias_relu(x, w, b[:15].contiguous(), padding=1)
    with pytest.raises(fusekit.OperandError, match="'x'.*host"):
        fusekit.conv_bias_relu(x.cpu(), w, b, padding=1)
    with pytest.raises(fusekit.OperandError, match="'w'.*dtype float16"):
        fusekit.conv_bias_relu(x, w.float(), b, padding=1)
    with pytest.raises(fusekit.OperandError, match="'x'.*unsupported dtype float64"):
        fusekit.conv_bias_relu(x.double(), w.double(), b.double(), padding=1)
    with pytest.raises(fusekit.OperandError, match="'x'.*neither dense"):
        fusekit.conv_bias_relu(x[:, :, ::2, ::2], w, b, padding=1)
    with pytest.raises(fusekit.OperandError, match="'y'.*expected out of shape"):
        fusekit.conv_bias_relu(x, w, b, padding=1, out=torch.empty((2, 16, 8, 8), dtype=torch.float16, device="cuda"))


def test_native_execute_is_taken_and_matches_graph_execute(rng, tmp_path):
    """Dispatch executes through the frontend's native pointer-array entry (lower.native_execute) on
    frontend 1.32; its output equals graph.execute's, bit for bit, on the same inputs."""
    torch = _torch()
    from fusekit import dispatch
    from fusekit.engine import lower

    x, _ = _make("torch", (4, 32, 9, 9), "float16", "NHWC", rng)
    w, _ = _make("torch", (48, 32, 3, 3), "float16", "NHWC", rng, 0.1)
    b, _ = _make("torch", (48,), "float16", "NCHW", rng)
    dispatch.clear_dispatch()
    y = fusekit.call("conv_bias_relu", x, w, b, padding=1)
    c = dispatch.resolved_call(fusekit.plan_for("conv_bias_relu", x, w, b, padding=1))
    assert c is not None and dispatch.resolved_calls() == 1
    assert c.native is not None, "frontend 1.32's native execute entry was not taken"
    ref = y.clone()
    c.native = None  # the same call through graph.execute
    y2 = fusekit.call("conv_bias_relu", x, w, b, padding=1, out=torch.full_like(y, float("nan")))
    torch.cuda.synchronize()
    assert torch.equal(y2, ref)
    # a plan loaded from the disk store (deserialized: the backend's own plan index) takes it too
    store = fusekit.DiskStore(tmp_path)
    fusekit.plan_for("conv_bias_relu", x, w, b, padding=1, cache=fusekit.PlanCache(store=store))
    loaded = fusekit.PlanCache(store=store)
    plan = fusekit.plan_for("conv_bias_relu", x, w, b, padding=1, cache=loaded)
    assert plan.source == "disk" and lower.native_execute(plan.graph, plan.uids) is not None
    y3 = fusekit.call("conv_bias_relu", x, w, b, padding=1, cache=loaded, out=torch.full_like(y, float("nan")))
    torch.cuda.synchronize()
    assert loaded.stats.disk_hits == 1 and torch.equal(y3, ref)


def test_conv_writes_the_channel_slice_beside_the_one_it_reads():
    """GhostNet's cheap operation: a conv reading channels [0, 16) of a channels-last buffer writes
    channels [16, 32) of the same buffer (the ranges interleave in memory, no element is shared): it
    runs on cuDNN, matches float64 and leaves what it reads alone. A slice starting off cuDNN's 16-byte
    alignment (channel 3 in float16) is an OperandError naming it."""
    torch = pytest.importorskip("torch")
    from fusekit.errors import OperandError

    F = torch.nn.functional
    g = torch.Generator(device="cuda").manual_seed(11)
    buf = torch.randn(4, 32, 14, 14, device="cuda", generator=g).half().contiguous(memory_format=torch.channels_last)
    w = (torch.randn(16, 16, 3, 3, device="cuda", generator=g) / 12).half().contiguous(memory_format=torch.channels_last)
    b = torch.randn(16, device="cuda", generator=g).half()
    x, before = buf[:, :16], buf[:, :16].clone()
    want = F.relu(F.conv2d(before.double(), w.double(), b.double(), padding=1))
    fusekit.conv_bias_relu(x, w, b, padding=1, out=buf[:, 16:])
    torch.cuda.synchronize()
    assert torch.equal(buf[:, :16], before)
    got = buf[:, 16:].double()
    assert float((got - want).norm() / want.norm()) < 2e-3
    with pytest.raises(OperandError, match="aligned"):
        fusekit.conv_bias_relu(buf[:, 3:19], w, b, padding=1)
