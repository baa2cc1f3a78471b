"""GPU: convolution gradients and transposed convolutions whose few-channel side is channels-last
(the autoencoder's 3-channel image) have a route through NCHW memory; each route, forced and as
timed on first use, against float64 PyTorch, for torch and CuPy arrays, in both plan modes."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from helpers import float64_nchw, rel

import fusekit
from fusekit import dispatch, ops, session, timing

F = torch.nn.functional
BOUND = {"float32": 2e-3, "float16": 5e-3}  # float32 convolutions may run TF32 (the default policy, as PyTorch's)


def _arrays(lib: str, *ts: torch.Tensor):
    """The tensors as ``lib`` arrays (CuPy: the same memory through DLPack), layouts kept."""
    if lib == "torch":
        return ts
    cp = pytest.importorskip("cupy")
    return tuple(cp.from_dlpack(t) for t in ts)


def _torch(a) -> torch.Tensor:
    return a if isinstance(a, torch.Tensor) else torch.from_dlpack(a)


def _is_channels_last(a) -> bool:
    return _torch(a).is_contiguous(memory_format=torch.channels_last)


class _Forced(dict):
    """FUSION_TIMES in which every tag of a forced (name, mode) answers the forced (fused ms, split ms)."""

    def __init__(self) -> None:
        super().__init__()
        self.forced: dict[tuple, tuple] = {}

    def get(self, k, default=None):
        return self.forced.get((k[0][0], k[1])) or super().get(k, default)

    def __contains__(self, k) -> bool:
        return (k[0][0], k[1]) in self.forced or super().__contains__(k)


@pytest.fixture(params=["heuristic", "autotune"])
def mode(request, fresh_session):
    fresh_session.fusion_times = _Forced()
    fusekit.configure(mode=request.param, disk=False)
    yield request.param
    fusekit.configure()


def _force(mode: str, name: str, alternative: bool) -> None:
    """Make fused_or_split take the alternative route (or the first one) of every ``name`` tag, untimed."""
    session.current().fusion_times.forced[(name, mode)] = (1.0, 0.5) if alternative else (0.5, 1.0)


def _choice(name: str, mode: str) -> tuple:
    """(what fused_or_split runs for the one ``name`` call of a test, its (fused ms, split ms))."""
    times = session.current().fusion_times
    timed = [k[0] for k in dict.keys(times) if k[0][0] == name and k[1] == mode]
    assert len(timed) <= 1, timed
    t = timed[0] if timed else (name, ())
    return dispatch.fusion_choice(t, mode), times.get((t, mode))


@pytest.mark.parametrize("lib", ["torch", "cupy"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("route", ["direct", "via_nchw", "timed"])
def test_three_channel_image_gradients_match_float64(mode, lib, dtype, route):
    """dx and dw of conv2d(x, w), x a 64x3x32x32 channels-last image, stride 2: the dgrad written
    channels-last or NCHW (copied back), the wgrad reading the image or an NCHW copy of it."""
    cl = torch.channels_last
    g = torch.Generator(device="cuda").manual_seed(3)
    dt = getattr(torch, dtype)
    x = torch.randn(64, 3, 32, 32, device="cuda", generator=g).to(dt).contiguous(memory_format=cl)
    w = (torch.randn(16, 3, 3, 3, device="cuda", generator=g) * 0.3).to(dt).contiguous(memory_format=cl)
    dz = torch.randn(64, 16, 16, 16, device="cuda", generator=g).to(dt).contiguous(memory_format=cl)
    xa, wa, dza = _arrays(lib, x, w, dz)
    tags = ("conv_dgrad_via_nchw", "conv_wgrad_via_nchw")
    if route != "timed":
        for t in tags:
            _force(mode, t, route == "via_nchw")
    dx, dw = ops.conv2d_backward(dza, xa, wa, padding=1, stride=2)
    xr, wr = float64_nchw(x).requires_grad_(True), float64_nchw(w).requires_grad_(True)
    F.conv2d(xr, wr, padding=1, stride=2).backward(float64_nchw(dz))
    dx, dw = _torch(dx), _torch(dw)
    assert dx.dtype == dt and dx.shape == x.shape and _is_channels_last(dx)
    assert rel(dx, xr.grad) < BOUND[dtype] and rel(dw, wr.grad) < BOUND[dtype]
    got = [_choice(t, mode) for t in tags]
    choices = [c for c, _ in got]
    print(f"{lib} {dtype} {mode} {route}: dx {rel(dx, xr.grad):.1e}, dw {rel(dw, wr.grad):.1e}; "
          f"times {[t for _, t in got]} -> {choices}")
    want = {"direct": "fused", "via_nchw": "split"}.get(route)
    assert all(c is not None and (want is None or c == want) for c in choices)


@pytest.mark.heavy
@pytest.mark.parametrize("lib", ["torch", "cupy"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("route", ["fused", "split", "split_nchw", "timed"])
def test_transposed_conv_to_three_channels_matches_float64(mode, lib, dtype, route):
    """relu(conv_transpose2d(x, w) + b), 16 -> 3 channels, stride 2, channels-last: the fused graph,
    the channels-last split, the split through an NCHW dgrad output, or as timed; then its backward
    (the weight gradient's image is the 3-channel gradient)."""
    cl = torch.channels_last
    g = torch.Generator(device="cuda").manual_seed(4)
    dt = getattr(torch, dtype)
    x = torch.randn(64, 16, 32, 32, device="cuda", generator=g).to(dt).contiguous(memory_format=cl)
    w = (torch.randn(16, 3, 3, 3, device="cuda", generator=g) * 0.2).to(dt).contiguous(memory_format=cl)
    b = (torch.rand(3, device="cuda", generator=g) * 0.5).to(dt)
    dy = torch.randn(64, 3, 64, 64, device="cuda", generator=g).to(dt).contiguous(memory_format=cl)
    xa, wa, ba, dya = _arrays(lib, x, w, b, dy)
    outer, inner = "conv_transpose_bias_relu", "conv_transpose_bias_relu_split_nchw"
    if route != "timed":
        _force(mode, outer, route != "fused")
        _force(mode, inner, route == "split_nchw")
    kw = dict(padding=1, stride=2)
    y = ops.conv_transpose_bias_relu(xa, wa, ba, output_padding=1, **kw)
    dx, dw, db = ops.conv_transpose_bias_relu_backward(dya, xa, wa, y, **kw)
    y, dx, dw, db = (_torch(a) for a in (y, dx, dw, db))
    xr, wr, br = (float64_nchw(t).requires_grad_(True) for t in (x, w, b))
    pre = F.conv_transpose2d(xr, wr, br, output_padding=1, **kw)
    ref = F.relu(pre.detach())
    # the backward through fusekit's own ReLU mask: rounding (TF32, float16) moves outputs near zero
    # across it, and each flip moves a random-sign gradient sum far more than the convolutions' error
    pre.backward(float64_nchw(dy) * (float64_nchw(y) > 0))
    assert y.dtype == dt and y.shape == ref.shape and _is_channels_last(y)
    errs = [rel(a, r) for a, r in ((y, ref), (dx, xr.grad), (dw, wr.grad), (db, br.grad))]
    print(f"{lib} {dtype} {mode} {route}: y/dx/dw/db {' '.join(f'{e:.1e}' for e in errs)}; "
          f"outer {_choice(outer, mode)}, inner {_choice(inner, mode)}")
    assert max(errs) < BOUND[dtype], errs
    assert _choice(outer, mode)[0] is not None
    if _choice(outer, mode)[0] == "split":
        assert _choice(inner, mode)[0] is not None


@pytest.mark.alone  # times the GPU: other processes' kernels would be in its figures
def test_cupy_first_call_timing_reads_gpu_time_as_torch_does():
    """fused_or_split times both routes with fusekit.timing.device_ms: on CuPy arrays it read the host's
    launch rate (a 22 us dgrad timed 104 us, 5x torch's figure for the same graph); with a spin kernel queued first it reads GPU time, as on torch tensors."""
    cp = pytest.importorskip("cupy")
    from fusekit.adapters import library

    cl = torch.channels_last
    dz = torch.randn(64, 16, 32, 32, device="cuda").contiguous(memory_format=cl)
    w = torch.randn(16, 3, 3, 3, device="cuda").contiguous(memory_format=cl)
    conv = dict(padding=(1, 1), stride=(2, 2), dilation=(1, 1), groups=1, output_padding=(1, 1))
    dzc, wc = cp.from_dlpack(dz), cp.from_dlpack(w)
    fns = {"torch": lambda: dispatch.call("conv_dgrad", dz, w, **conv), "cupy": lambda: dispatch.call("conv_dgrad", dzc, wc, **conv)}
    for fn in fns.values():
        fn()
    ms = {lib: sorted(timing.device_ms(library(lib), fn) for _ in range(5))[2] for lib, fn in fns.items()}
    print(f"device_ms of one dgrad: torch {ms['torch'] * 1e3:.1f} us, cupy {ms['cupy'] * 1e3:.1f} us")
    assert ms["cupy"] < 1.5 * ms["torch"] + 0.003, ms
