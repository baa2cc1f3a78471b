"""CPU: the NumPy float64 oracle against naive nested-loop convolution."""

import numpy as np
import pytest

import fusekit
from fusekit.engine import oracle
from fusekit.errors import OperandError


def naive_conv(x, w, padding, stride, dilation):
    """Cross-correlation by the definition: plain Python loops, zero padding by bounds checks."""
    n_, c_, h_, w_ = x.shape
    k_, c2, r_, s_ = w.shape
    assert c2 == c_
    (ph, pw), (sh, sw), (dh, dw) = padding, stride, dilation

    def positions(size, pad, st, dil, taps):
        # every output position whose dilated window fits inside the padded input
        out, o = [], 0
        while o * st + dil * (taps - 1) <= size + 2 * pad - 1:
            out.append(o)
            o += 1
        return out

    rows = positions(h_, ph, sh, dh, r_)
    cols = positions(w_, pw, sw, dw, s_)
    y = np.zeros((n_, k_, len(rows), len(cols)))
    for n in range(n_):
        for k in range(k_):
            for oh in rows:
                for ow in cols:
                    acc = 0.0
                    for c in range(c_):
                        for r in range(r_):
                            ih = oh * sh - ph + r * dh
                            if not 0 <= ih < h_:
                                continue
                            for s in range(s_):
                                iw = ow * sw - pw + s * dw
                                if 0 <= iw < w_:
                                    acc += float(x[n, c, ih, iw]) * float(w[k, c, r, s])
                    y[n, k, oh, ow] = acc
    return y


# (N, C, H, W, K, R, S, padding, stride, dilation)
CASES = [
    (2, 3, 7, 6, 4, 3, 3, (1, 1), (1, 1), (1, 1)),  # 3x3 same padding
    (1, 5, 9, 8, 3, 3, 3, (0, 0), (2, 2), (1, 1)),  # stride 2, batch 1, odd channels
    (2, 3, 10, 9, 2, 3, 3, (2, 2), (1, 1), (2, 2)),  # dilation 2
    (2, 4, 5, 5, 7, 1, 1, (0, 0), (1, 1), (1, 1)),  # 1x1, odd K
    (1, 3, 8, 7, 5, 3, 2, (1, 0), (2, 1), (1, 2)),  # asymmetric everything
    (1, 1, 4, 4, 1, 4, 4, (0, 0), (1, 1), (1, 1)),  # filter as large as the image
    (3, 2, 6, 6, 3, 3, 3, (1, 1), (2, 2), (2, 2)),  # stride 2 and dilation 2 together
    (1, 7, 5, 4, 3, 2, 2, (3, 2), (3, 2), (1, 1)),  # padding larger than the filter, stride 3
]
IDS = [f"n{c[0]}c{c[1]}h{c[2]}w{c[3]}k{c[4]}r{c[5]}s{c[6]}p{c[7][0]}{c[7][1]}st{c[8][0]}{c[8][1]}d{c[9][0]}{c[9][1]}" for c in CASES]


def _inputs(rng, case):
    n, c, h, w, k, r, s, pad, st, dil = case
    x = rng.standard_normal((n, c, h, w))
    wt = rng.standard_normal((k, c, r, s))
    b = rng.standard_normal(k)
    return x, wt, b, dict(padding=pad, stride=st, dilation=dil)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_conv2d_nchw_matches_loops(rng, case):
    x, w, _, a = _inputs(rng, case)
    got = oracle.conv2d_nchw(x, w, a["padding"], a["stride"], a["dilation"])
    want = naive_conv(x, w, a["padding"], a["stride"], a["dilation"])
    assert got.shape == want.shape
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_evaluate_patterns_match_loops(rng, case):
    x, w, b, a = _inputs(rng, case)
    conv = naive_conv(x, w, a["padding"], a["stride"], a["dilation"])
    pre = conv + b[None, :, None, None]

    (y_conv,) = oracle.evaluate("conv", x, w, **a)
    (y_bias,) = oracle.evaluate("conv_bias", x, w, b, **a)
    (y_relu,) = oracle.evaluate("conv_bias_relu", x, w, b, **a)
    np.testing.assert_allclose(y_conv, conv, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(y_bias, pre, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(y_relu, np.maximum(pre, 0.0), rtol=1e-12, atol=1e-12)

    # the output shape is what the pattern's shape inference says
    pat = fusekit.get_pattern("conv_bias_relu")
    shapes = pat.infer_shapes({"x": x.shape, "w": w.shape, "b": (1, len(b), 1, 1)}, dict(pat.normalize_attrs(a)))
    assert y_relu.shape == shapes["y"] == conv.shape


def test_relu_clamps_and_passes(rng):
    x = rng.standard_normal((2, 4, 9, 9))
    w = rng.standard_normal((6, 4, 3, 3))
    b = rng.standard_normal(6)
    (pre,) = oracle.evaluate("conv_bias", x, w, b, padding=1)
    (y,) = oracle.evaluate("conv_bias_relu", x, w, b, padding=1)
    assert (pre < 0).any() and (pre > 0).any(), "random data should give both signs"
    assert (y >= 0).all()
    np.testing.assert_array_equal(y, np.maximum(pre, 0.0))
    np.testing.assert_array_equal(y[pre > 0], pre[pre > 0])
    assert (y[pre <= 0] == 0).all()


@pytest.mark.parametrize("pattern, operands", [
    ("relu", ("y",)), ("relu_backward", ("dy", "y")), ("relu_bias_grad", ("dy", "y")),
    ("batchnorm_relu_backward", None), ("channel_scale_shift_relu", None),
])
def test_upper_clip_is_relu6(rng, pattern, operands):
    """The ReLU patterns' upper_clip: the forward clamps to [0, 6]; the backward passes dy only where
    0 < y < 6 (strict at both ends, as PyTorch's ReLU6); inf (the default) is the plain ReLU."""
    y = np.array([-1.0, 0.0, 3.0, 6.0, 7.0, 5.5]).reshape(1, 6, 1, 1) * np.ones((2, 1, 2, 2))
    dy = rng.standard_normal(y.shape)
    if pattern == "relu":
        np.testing.assert_array_equal(oracle.evaluate("relu", y, upper_clip=6)[0], np.clip(y, 0, 6))
        np.testing.assert_array_equal(oracle.evaluate("relu", y)[0], np.maximum(y, 0))
    elif pattern in ("relu_backward", "relu_bias_grad"):
        mask = (y > 0) & (y < 6)
        out = oracle.evaluate(pattern, dy, y, upper_clip=6.0)
        np.testing.assert_array_equal(out[0], dy * mask)
        np.testing.assert_array_equal(oracle.evaluate(pattern, dy, y)[0], dy * (y > 0))
        if pattern == "relu_bias_grad":
            np.testing.assert_allclose(out[1].reshape(-1), (dy * mask).sum(axis=(0, 2, 3)), rtol=1e-12)
    elif pattern == "channel_scale_shift_relu":
        g, b = rng.uniform(1, 3, 6), rng.uniform(-1, 1, 6)
        x = rng.standard_normal((2, 6, 3, 3)) * 4
        want = np.clip(x * g.reshape(1, -1, 1, 1) + b.reshape(1, -1, 1, 1), 0, 6)
        np.testing.assert_allclose(oracle.evaluate(pattern, x, g, b, upper_clip=6.0)[0], want, rtol=1e-12)
    else:  # the dReLU6 in front of the BN backward equals the BN backward of the masked dy
        x = rng.standard_normal((2, 6, 2, 2))
        g, mean, inv = rng.uniform(1, 2, 6), x.mean(axis=(0, 2, 3)), 1 / np.sqrt(x.var(axis=(0, 2, 3)) + 1e-5)
        fused = oracle.evaluate(pattern, dy, y, x, g, mean, inv, upper_clip=6.0)
        split = oracle.evaluate("batchnorm_backward", dy * ((y > 0) & (y < 6)), x, g, mean, inv)
        for a, b in zip(fused, split):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(OperandError, match="upper_clip") as e:
        oracle.evaluate("relu", y, upper_clip=-1.0)
    assert e.value.operand == "upper_clip"


def test_bias_shapes_agree(rng):
    x = rng.standard_normal((2, 3, 6, 6))
    w = rng.standard_normal((5, 3, 3, 3))
    b = rng.standard_normal(5)
    (y_vec,) = oracle.evaluate("conv_bias_relu", x, w, b, padding=1)
    (y_4d,) = oracle.evaluate("conv_bias_relu", x, w, b.reshape(1, 5, 1, 1), padding=1)
    (y_list,) = oracle.evaluate("conv_bias_relu", x, w, list(b), padding=1)
    np.testing.assert_array_equal(y_vec, y_4d)
    np.testing.assert_array_equal(y_vec, y_list)
    # and the bias really is per output channel
    (y0,) = oracle.evaluate("conv_bias", x, w, np.zeros(5), padding=1)
    (y1,) = oracle.evaluate("conv_bias", x, w, b, padding=1)
    np.testing.assert_allclose(y1 - y0, np.broadcast_to(b[None, :, None, None], y0.shape), rtol=1e-12, atol=1e-12)


def test_evaluate_accepts_pattern_object_and_int_attrs(rng):
    x = rng.standard_normal((1, 2, 7, 7))
    w = rng.standard_normal((3, 2, 3, 3))
    pat = fusekit.get_pattern("conv")
    (a,) = oracle.evaluate(pat, x, w, padding=1, stride=2)
    (b,) = oracle.evaluate("conv", x, w, padding=(1, 1), stride=[2, 2])
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, naive_conv(x, w, (1, 1), (2, 2), (1, 1)), rtol=1e-12, atol=1e-12)


def test_evaluate_upcasts_low_precision_inputs(rng):
    x = rng.standard_normal((1, 3, 5, 5)).astype(np.float16)
    w = rng.standard_normal((2, 3, 3, 3)).astype(np.float16)
    (y,) = oracle.evaluate("conv", x, w)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, naive_conv(x.astype(np.float64), w.astype(np.float64), (0, 0), (1, 1), (1, 1)), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# shape checks: the error names the operand at fault
# ----------------------------------------------------------------------------------------------
def test_channel_mismatch_names_w(rng):
    x = rng.standard_normal((2, 8, 9, 9))
    w = rng.standard_normal((16, 4, 3, 3))
    b = rng.standard_normal(16)
    with pytest.raises(OperandError, match=r"conv_bias_relu: operand 'w': expected 8 input channels") as ei:
        oracle.evaluate("conv_bias_relu", x, w, b, padding=1)
    assert ei.value.operand == "w"


def test_bias_length_names_b(rng):
    x = rng.standard_normal((2, 8, 9, 9))
    w = rng.standard_normal((16, 8, 3, 3))
    for bad in (rng.standard_normal(15), rng.standard_normal((1, 17, 1, 1))):
        with pytest.raises(OperandError, match=r"operand 'b': expected length 16") as ei:
            oracle.evaluate("conv_bias", x, w, bad)
        assert ei.value.operand == "b"


@pytest.mark.parametrize(
    "xshape, wshape, attrs",
    [
        ((1, 2, 2, 2), (3, 2, 3, 3), {}),  # image smaller than the filter
        ((1, 2, 5, 5), (3, 2, 3, 3), {"dilation": 3}),  # dilated filter spans 7
        ((1, 2, 6, 2), (3, 2, 3, 3), {"padding": (1, 0)}),  # too narrow in W only
    ],
)
def test_too_small_image_names_x(rng, xshape, wshape, attrs):
    x = rng.standard_normal(xshape)
    w = rng.standard_normal(wshape)
    with pytest.raises(OperandError, match=r"operand 'x': spatial size .* smaller than the dilated filter") as ei:
        oracle.evaluate("conv", x, w, **attrs)
    assert ei.value.operand == "x"


def test_operand_count_and_attrs_checked(rng):
    x = rng.standard_normal((1, 2, 5, 5))
    w = rng.standard_normal((3, 2, 3, 3))
    with pytest.raises(TypeError, match=r"conv_bias_relu takes 3 operands"):
        oracle.evaluate("conv_bias_relu", x, w)
    with pytest.raises(OperandError, match=r"'groups_of': unknown attribute"):
        oracle.evaluate("conv", x, w, groups_of=2)
    with pytest.raises(OperandError, match=r"'stride': expected values >= 1"):
        oracle.evaluate("conv", x, w, stride=0)


def _block_diagonal(w: np.ndarray, groups: int) -> np.ndarray:
    """The dense (K, C, R, S) filter equal to a grouped one: zeros outside each group's block."""
    k, cg, r, s = w.shape
    full = np.zeros((k, cg * groups, r, s))
    kg = k // groups
    for g in range(groups):
        full[g * kg : (g + 1) * kg, g * cg : (g + 1) * cg] = w[g * kg : (g + 1) * kg]
    return full


@pytest.mark.parametrize("groups,c,k", [(2, 4, 6), (3, 3, 3), (4, 4, 8)])  # (3, 3, 3): depthwise
def test_grouped_conv_equals_block_diagonal_dense_conv(rng, groups, c, k):
    """A grouped convolution forward, dgrad and wgrad equal the dense ones with a block-diagonal
    filter: an independent check of the oracle's group split."""
    x = rng.standard_normal((2, c, 7, 6))
    w = rng.standard_normal((k, c // groups, 3, 3))
    attrs = dict(padding=1, stride=2, dilation=1)
    (y,) = oracle.evaluate("conv", x, w, groups=groups, **attrs)
    (y_dense,) = oracle.evaluate("conv", x, _block_diagonal(w, groups), **attrs)
    np.testing.assert_allclose(y, y_dense, rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    (dx,) = oracle.evaluate("conv_dgrad", dy, w, groups=groups, output_padding=(0, 1), **attrs)
    (dx_dense,) = oracle.evaluate("conv_dgrad", dy, _block_diagonal(w, groups), output_padding=(0, 1), **attrs)
    assert dx.shape == x.shape
    np.testing.assert_allclose(dx, dx_dense, rtol=1e-12, atol=1e-12)
    (dw,) = oracle.evaluate("conv_wgrad", x, dy, groups=groups, kernel=(3, 3), **attrs)
    (dw_dense,) = oracle.evaluate("conv_wgrad", x, dy, kernel=(3, 3), **attrs)
    assert dw.shape == w.shape
    kg, cg = k // groups, c // groups
    for g in range(groups):  # each group's filter gradient is its diagonal block of the dense one
        np.testing.assert_allclose(dw[g * kg : (g + 1) * kg], dw_dense[g * kg : (g + 1) * kg, g * cg : (g + 1) * cg], rtol=1e-12, atol=1e-12)


def test_grouped_conv_shape_errors_name_the_operand(rng):
    x = rng.standard_normal((1, 6, 5, 5))
    with pytest.raises(OperandError, match=r"operand 'w': expected 2 input channels \(6 channels / 3 groups\)"):
        oracle.evaluate("conv", x, rng.standard_normal((3, 6, 3, 3)), groups=3)
    with pytest.raises(OperandError, match=r"operand 'w': 4 filters do not split into 3 groups"):
        oracle.evaluate("conv", x, rng.standard_normal((4, 2, 3, 3)), groups=3)
    with pytest.raises(OperandError, match=r"operand 'x': 6 channels do not split into 4 groups"):
        oracle.evaluate("conv", x, rng.standard_normal((4, 1, 3, 3)), groups=4)
    with pytest.raises(OperandError, match=r"'groups': expected values >= 1"):
        oracle.evaluate("conv", x, rng.standard_normal((4, 6, 3, 3)), groups=0)
