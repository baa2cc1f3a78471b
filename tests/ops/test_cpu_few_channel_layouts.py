"""CPU: convolution gradients with a few-channel channels-last side (the dgrad output, the wgrad
image, a transposed conv's output) also have a route through NCHW memory, chosen by timing on the
GPU; here the routes' structure, layouts and values, each graph evaluated by the oracle."""

import numpy as np
import pytest

from fusekit.engine import oracle
from fusekit.ops import common, conv

torch = pytest.importorskip("torch")
CL = torch.channels_last


def _cl(t):
    return t.contiguous(memory_format=CL)


@pytest.mark.parametrize("c, layout, channels, want", [
    (3, "NHWC", None, True), (2, "NHWC", None, True), (3, "NCHW", None, False), (1, "NHWC", None, False),
    (4, "NHWC", None, False), (16, "NHWC", None, False), (16, "NHWC", 3, True), (16, "NCHW", 3, False), (16, "NHWC", 8, False),
])
def test_few_channels_last_says_which_arrays_have_an_nchw_route(c, layout, channels, want):
    a = torch.randn(2, c, 5, 6)
    a = _cl(a) if layout == "NHWC" else a.contiguous()
    assert common.few_channels_last(a, channels) is want


def test_few_channels_last_refuses_what_is_not_a_dense_channels_last_image():
    wide = _cl(torch.randn(2, 4, 5, 6))
    assert common.few_channels_last(wide[:, :3]) is False  # a channel slice: not dense
    assert common.few_channels_last(_cl(torch.randn(0, 3, 5, 6))) is False  # empty
    assert common.few_channels_last(np.zeros((2, 3, 5, 6))) is False  # not a torch / CuPy array
    assert common.few_channels_last(torch.randn(3, 5, 6)) is False  # not 4-D


@pytest.mark.parametrize("cin, cout, k, stride, padding, dilation, output_padding, groups", [
    (16, 3, 3, 2, 1, 1, 1, 1), (8, 2, 4, 2, 1, 1, 0, 1), (6, 3, 3, 3, 2, 2, 1, 3), (4, 3, (3, 5), (1, 2), (0, 2), 1, (0, 1), 1),
])
def test_transposed_conv_output_shape_is_pytorchs(cin, cout, k, stride, padding, dilation, output_padding, groups):
    x = torch.randn(2, cin, 7, 9)
    w = torch.randn(cin, cout // groups, *((k, k) if isinstance(k, int) else k))
    ref = torch.nn.functional.conv_transpose2d(x, w, stride=stride, padding=padding, output_padding=output_padding, groups=groups,
                                               dilation=dilation)
    assert conv.convt_shape(x, w, (padding, stride, dilation, output_padding, groups)) == tuple(ref.shape)


class _Oracle:
    """Stands in for dispatch.call on host float64 tensors: each graph evaluated by the oracle, the result
    in ``out`` (any layout) or in the first operand's layout; records (pattern, operand layouts, out layout)."""

    def __init__(self):
        self.seen = []

    @staticmethod
    def layout(a):
        return "NCHW" if a.is_contiguous() else "NHWC" if a.is_contiguous(memory_format=CL) else "other"

    def __call__(self, name, *a, out=None, **kw):
        self.seen.append((name, tuple(self.layout(x) for x in a if x.dim() == 4), None if out is None else self.layout(out)))
        (r,) = oracle.evaluate(name, *(x.contiguous().numpy() for x in a), **kw)
        r = torch.from_numpy(np.ascontiguousarray(r))
        if r.dim() == 4 and r.shape[0] == 1 and r.shape[2:] == (1, 1) and name in ("bias_grad",):
            r = r.reshape(-1)
        if out is not None:
            out.copy_(r.reshape(out.shape))
            return out
        return _cl(r) if a[0].dim() == 4 and self.layout(a[0]) == "NHWC" and r.dim() == 4 else r


@pytest.fixture
def routes(monkeypatch):
    """(oracle call recorder, chosen tags): fused_or_split runs the route named by ``pick`` (the tag -> bool
    "take the alternative" map, default True) and records each tag's first element."""
    rec, tags, pick = _Oracle(), [], {}
    rec.tags = []  # the whole tags

    def fused_or_split(tag, fused, split, like=None, instead="as separate graphs"):
        tags.append(tag[0])
        rec.tags.append(tag)
        return split() if pick.get(tag[0], True) else fused()

    for m in (conv, common):
        monkeypatch.setattr(m, "call", rec)
        monkeypatch.setattr(m, "fused_or_split", fused_or_split)
    monkeypatch.setattr(conv, "empty_as", lambda like, shape, layout: (
        _cl(torch.empty(shape, dtype=like.dtype)) if layout == "NHWC" else torch.empty(shape, dtype=like.dtype)))
    monkeypatch.setattr(conv, "affine_identity", lambda y: (torch.ones(y.shape[1], dtype=torch.float32),))
    return rec, tags, pick


def _ref_grads(x, w, dy, **kw):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = torch.nn.functional.conv2d(x, w, **kw)
    y.backward(dy)
    return x.grad, w.grad


def test_first_conv_gradients_of_a_three_channel_image_route_through_nchw(routes):
    """dx of a 3-channel channels-last image: the dgrad writes NCHW, copied back to channels-last;
    dw: the wgrad reads an NCHW copy of the image. Both equal PyTorch's float64 gradients."""
    rec, tags, pick = routes
    g = torch.Generator().manual_seed(1)
    x = _cl(torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64))
    w = torch.randn(5, 3, 3, 3, generator=g, dtype=torch.float64)
    dz = _cl(torch.randn(2, 5, 4, 4, generator=g, dtype=torch.float64))
    dx, dw = conv.conv2d_backward(dz, x, w, padding=1, stride=2)
    assert tags == ["conv_dgrad_via_nchw", "conv_wgrad_via_nchw"]
    assert rec.seen == [("conv_dgrad", ("NHWC", "NCHW"), "NCHW"), ("conv_wgrad", ("NCHW", "NHWC"), None)]
    rx, rw = _ref_grads(x, w, dz, padding=1, stride=2)
    assert dx.is_contiguous(memory_format=CL)
    torch.testing.assert_close(dx, rx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, rw, rtol=1e-12, atol=1e-12)
    # the direct routes when timing keeps them
    rec.seen.clear()
    pick.update({"conv_dgrad_via_nchw": False, "conv_wgrad_via_nchw": False})
    dx2, dw2 = conv.conv2d_backward(dz, x, w, padding=1, stride=2)
    assert rec.seen == [("conv_dgrad", ("NHWC", "NCHW"), None), ("conv_wgrad", ("NHWC", "NHWC"), None)]
    torch.testing.assert_close(dx2, rx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw2, rw, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("c, layout", [(16, "NHWC"), (3, "NCHW"), (1, "NHWC"), (4, "NHWC")])
def test_other_convolution_gradients_take_no_extra_route(routes, c, layout):
    rec, tags, _ = routes
    x = torch.randn(2, c, 8, 8, dtype=torch.float64)
    x = _cl(x) if layout == "NHWC" else x
    w = torch.randn(5, c, 3, 3, dtype=torch.float64)
    dz = torch.randn(2, 5, 8, 8, dtype=torch.float64)
    dz = _cl(dz) if layout == "NHWC" else dz
    dx, dw = conv.conv2d_backward(dz, x, w, padding=1)
    assert tags == [] and [s[0] for s in rec.seen] == ["conv_dgrad", "conv_wgrad"] and all(s[2] is None for s in rec.seen)
    rx, rw = _ref_grads(x, w, dz, padding=1)
    torch.testing.assert_close(dx, rx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, rw, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("relu", [True, False])
def test_transposed_conv_to_three_channels_splits_through_nchw(routes, relu):
    """conv_transpose(16 -> 3) + bias (+ ReLU): the fused graph against a split whose layout is itself
    timed; the NCHW split's dgrad writes NCHW and its pointwise graph writes channels-last; its backward's
    weight gradient reads an NCHW copy of the 3-channel gradient image. Values: PyTorch's in float64."""
    rec, tags, pick = routes
    g = torch.Generator().manual_seed(2)
    x = _cl(torch.randn(2, 16, 5, 5, generator=g, dtype=torch.float64))
    w = torch.randn(16, 3, 3, 3, generator=g, dtype=torch.float64)
    b = torch.randn(3, generator=g).double()  # float32 values: the pointwise graphs take the bias in float32
    attrs = dict(padding=1, stride=2, output_padding=1)
    ref = torch.nn.functional.conv_transpose2d(x, w, b, **attrs)
    ref = ref.relu() if relu else ref
    fn = conv.conv_transpose_bias_relu if relu else conv.conv_transpose_bias
    y = fn(x, w, b, **attrs)
    name = "conv_transpose_bias_relu" if relu else "conv_transpose_bias"
    assert tags == [name, name + "_split_nchw"]
    pointwise = "channel_scale_shift_relu" if relu else "channel_shift"
    assert [(s[0], s[2]) for s in rec.seen] == [("conv_dgrad", "NCHW"), (pointwise, "NHWC")]
    assert rec.seen[1][1] == ("NCHW",)
    assert y.shape == ref.shape and y.is_contiguous(memory_format=CL)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    # timing kept the channels-last split
    rec.seen.clear()
    pick[name + "_split_nchw"] = False
    torch.testing.assert_close(fn(x, w, b, **attrs), ref, rtol=1e-12, atol=1e-12)
    assert [(s[0], s[2]) for s in rec.seen] == [("conv_dgrad", None), (pointwise, None)]
    # backward: dw = wgrad(image = the 3-channel dz, gradient = x), through an NCHW copy of dz
    rec.seen.clear()
    tags.clear()
    dy = _cl(torch.randn(ref.shape, generator=g, dtype=torch.float64))
    _, dw, _ = conv.conv_transpose_bias_relu_backward(dy, x, w, y, padding=1, stride=2, relu=relu)
    assert "conv_wgrad_via_nchw" in tags
    assert ("conv_wgrad", ("NCHW", "NHWC"), None) in rec.seen
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = torch.nn.functional.conv_transpose2d(xr, wr, b, **attrs)
    (out.relu() if relu else out).backward(dy)
    torch.testing.assert_close(dw, wr.grad, rtol=1e-12, atol=1e-12)


def test_a_given_out_keeps_the_plain_split(routes):
    rec, tags, _ = routes
    x = _cl(torch.randn(2, 16, 5, 5, dtype=torch.float64))
    w = torch.randn(16, 3, 3, 3, dtype=torch.float64)
    b = torch.randn(3, dtype=torch.float64)
    out = torch.empty(2, 3, 10, 10, dtype=torch.float64)
    conv.conv_transpose_bias_relu(x, w, b, padding=1, stride=2, output_padding=1, out=out)
    assert tags == ["conv_transpose_bias_relu"]
    assert [(s[0], s[2]) for s in rec.seen] == [("conv_dgrad", None), ("channel_scale_shift_relu", "NCHW")]


def test_host_tensors_on_the_few_channel_routes_name_the_operand():
    """Host (CPU) channels-last tensors with 3 channels qualify for the NCHW routes; the first graph
    they reach refuses them naming its operand, before anything reaches cuDNN or any timing."""
    import fusekit
    from fusekit import ops

    x = _cl(torch.ones(2, 3, 8, 8))
    dz = _cl(torch.ones(2, 5, 4, 4))
    assert common.few_channels_last(x) and common.few_channels_last(dz, 3)
    with pytest.raises(fusekit.OperandError, match=r"conv_dgrad: operand 'dy': expected a CUDA device array"):
        ops.conv2d_backward(dz, x, torch.ones(5, 3, 3, 3), padding=1, stride=2)
    with pytest.raises(fusekit.OperandError, match=r"conv_wgrad: operand 'x': expected a CUDA device array"):
        ops.conv2d_backward(dz, x, torch.ones(5, 3, 3, 3), padding=1, stride=2, needs=(False, True))
    with pytest.raises(fusekit.OperandError, match=r"conv_transpose_bias_relu: operand 'x': expected a CUDA device array"):
        ops.conv_transpose_bias_relu(dz, torch.ones(5, 3, 3, 3), torch.ones(3), padding=1, stride=2, output_padding=1)


def test_timing_decisions_are_kept_per_stride_kernel_and_layout(routes):
    """fused_or_split keeps one decision per tag, so a tag must tell apart calls whose graphs differ:
    the same dgrad operands at stride 2 and stride 1 (other output shapes), the same wgrad operands
    with a 3x3 and a 2x2 kernel, the same arrays channels-last and NCHW. (Tags were pattern, shapes and
    dtypes: the first call's timing decided for all of them.)"""
    rec, _, _ = routes
    g = torch.Generator().manual_seed(2)
    dz = _cl(torch.randn(2, 5, 4, 4, generator=g, dtype=torch.float64))
    w3 = torch.randn(5, 3, 3, 3, generator=g, dtype=torch.float64)
    w2 = torch.randn(5, 3, 2, 2, generator=g, dtype=torch.float64)
    x8, x4 = (_cl(torch.randn(2, 3, n, n, generator=g, dtype=torch.float64)) for n in (8, 4))
    for x, w, kw in ((x8, w3, dict(padding=1, stride=2)), (x4, w3, dict(padding=1, stride=1)), (x8, w2, dict(padding=0, stride=2))):
        dx, dw = conv.conv2d_backward(dz, x, w, **kw)
        rx, rw = _ref_grads(x, w, dz, **kw)
        torch.testing.assert_close(dx, rx, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dw, rw, rtol=1e-12, atol=1e-12)
    dgrads = [t for t in rec.tags if t[0] == "conv_dgrad_via_nchw"]
    wgrads = [t for t in rec.tags if t[0] == "conv_wgrad_via_nchw"]
    assert len(dgrads) == 3 and dgrads[0][2:] == dgrads[1][2:] and dgrads[0] != dgrads[1]  # same dz, w; stride 2 vs 1
    assert len(wgrads) == 3 and wgrads[0][2:] == wgrads[2][2:] and wgrads[0] != wgrads[2]  # same x, dz; 3x3 vs 2x2
    assert len(set(dgrads)) == 3 and len(set(wgrads)) == 3
    a = torch.randn(2, 16, 5, 5)
    assert common.tag("t", a) != common.tag("t", _cl(a))  # same shape and dtype, another layout
    assert common.tag("t", a, attrs=([1, 1], 2)) == common.tag("t", a, attrs=((1, 1), 2))  # lists as tuples: hashable
    hash(common.tag("t", a, attrs=([1, 1], [2, 2])))
