"""CPU: fusekit.torch as a drop-in for torch.nn, without a GPU.

- Construction: every torch argument cuDNN can run is taken ("same" padding computed, bias=False,
  groups, non-zero padding modes as an F.pad of the input); the rest are fusekit OperandErrors at construction.
- convert: modules re-classed in place of the originals (state-dict keys, parameters and buffers
  identical, load_state_dict both ways), fusion found from fx traces, the report, the four
  torchvision models.
- The modules' own logic (autograd wiring, bias=False, "same" padding, half BatchNorm, autocast casts,
  eval-mode BN folding, fusion hand-offs, non-dense inputs) runs against fake ops: PyTorch CPU
  implementations of the fusekit.ops functions the modules call, which also check the contract the
  real patterns enforce (float32 BN statistics and affine vectors, one dtype per conv, dense operands).
  The same model in float64 then must give torch.nn's outputs and gradients to rounding.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest

torch = pytest.importorskip("torch")
ft = pytest.importorskip("fusekit.torch")

from fusekit.errors import CaptureError, LayoutWarning, OperandError
from helpers import as_module, rel  # noqa: E402
from fusekit.errors import forget_warnings  # noqa: E402

F = torch.nn.functional
F32 = torch.float32


# ----------------------------------------------------------------------------------------------
# Fake ops: what fusekit.ops computes, in PyTorch on the CPU, with the patterns' operand checks
# ----------------------------------------------------------------------------------------------
def _vjp(f, inputs, dy):
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    with torch.enable_grad():
        out = f(*leaves)
        return torch.autograd.grad(out, leaves, dy)


def _channel(v, name):
    assert v.dtype == F32, f"{name}: the pattern takes float32, got {v.dtype}"
    assert v.dim() == 1 and v.is_contiguous(), f"{name}: expected a dense (C,) vector, got {tuple(v.shape)}"


def _image(*ts):
    for t in ts:
        assert t.dim() == 4 and ft.common.is_dense(t), f"operand not dense NCHW / NHWC: strides {t.stride()}"


def _same_dtype(*ts):
    assert len({t.dtype for t in ts if t is not None}) == 1, f"mixed dtypes {[t.dtype for t in ts if t is not None]}"


def _like_layout(y, x):
    """y in x's memory format (the patterns' outputs take their input's layout)."""
    return torch.empty_like(x, dtype=y.dtype).copy_(y) if y.shape == x.shape else y.contiguous(
        memory_format=torch.channels_last if x.dim() == 4 and not x.is_contiguous() else torch.contiguous_format)


INF = float("inf")


def _act(y, relu, clip=INF):
    """relu(y) clipped above at ``clip`` (ReLU6: 6), as the patterns' upper_clip."""
    return y.clamp(0, clip) if relu else y


def _mask(y, clip=INF):
    """The ReLU backward's mask, strict at both ends as PyTorch's ReLU6 backward."""
    return (y > 0) & (y < clip)


class FakeOps:
    def __init__(self):
        self.calls = []

    # convolutions
    def _conv(self, name, x, w, b, kw, relu, clip=INF):
        self.calls.append(name)
        _image(x, w)
        _same_dtype(x, w, b)
        y = F.conv2d(x, w, b, kw["stride"], kw["padding"], kw["dilation"], kw["groups"])
        return _like_layout(_act(y, relu, clip), x)

    def conv2d(self, x, w, *, padding=0, stride=1, dilation=1, groups=1):
        return self._conv("conv", x, w, None, {"padding": padding, "stride": stride, "dilation": dilation, "groups": groups}, False)

    def conv_bias(self, x, w, b, *, padding=0, stride=1, dilation=1, groups=1):
        return self._conv("conv_bias", x, w, b, {"padding": padding, "stride": stride, "dilation": dilation, "groups": groups}, False)

    def conv_bias_relu(self, x, w, b, *, padding=0, stride=1, dilation=1, groups=1):
        return self._conv("conv_bias_relu", x, w, b, {"padding": padding, "stride": stride, "dilation": dilation, "groups": groups}, True)

    def conv_bias_act(self, x, w, b, *, activation="relu", alpha=0.0, padding=0, stride=1, dilation=1, groups=1):
        from fusekit.pipeline.ir import torch_act

        y = self._conv(f"conv_bias_act:{activation}", x, w, b, {"padding": padding, "stride": stride, "dilation": dilation, "groups": groups}, False)
        return _like_layout(torch_act(y, (activation, alpha)), x)

    def conv_bias_relu6(self, x, w, b, *, padding=0, stride=1, dilation=1, groups=1):
        return self._conv("conv_bias_relu6", x, w, b, {"padding": padding, "stride": stride, "dilation": dilation, "groups": groups}, True, 6.0)

    def conv_bias_add_relu(self, x, w, b, z, *, padding=0, stride=1, dilation=1, groups=1):
        self.calls.append("conv_bias_add_relu")
        _image(x, w, z)
        _same_dtype(x, w, b, z)
        nhwc = not x.is_contiguous()
        assert z.shape[1] == w.shape[0] and z.is_contiguous(memory_format=torch.channels_last if nhwc else torch.contiguous_format), "z: x's layout"
        y = F.conv2d(x, w, b, stride, padding, dilation, groups) + z
        return _like_layout(torch.relu(y), x)

    def conv_grads(self, dz, x, w, needs, kw):
        _image(dz, x, w)
        _same_dtype(dz, x, w)
        dx, dw = _vjp(lambda a, b: F.conv2d(a, b, None, kw["stride"], kw["padding"], kw["dilation"], kw["groups"]), (x, w), dz)
        if kw.get("input_relu") and needs[0]:  # as ops: x is a ReLU's output, dx carries its backward
            self.calls.append("dgrad_drelu" if kw.get("input_clip", INF) == INF else f"dgrad_drelu{kw['input_clip']:g}")
            dx = dx * _mask(x, kw.get("input_clip", INF))
        return dx if needs[0] else None, dw if needs[1] else None

    def conv2d_backward(self, dy, x, w, *, needs=(True, True), **kw):
        self.calls.append("conv_backward")
        return self.conv_grads(dy, x, w, needs, kw)

    def conv_bias_backward(self, dy, x, w, *, needs=(True, True, True), **kw):
        self.calls.append("conv_bias_backward")
        dx, dw = self.conv_grads(dy, x, w, needs, kw)
        return dx, dw, dy.sum((0, 2, 3)) if needs[2] else None

    def conv_bias_relu_backward(self, dy, x, w, y, *, needs=(True, True, True), upper_clip=INF, **kw):
        self.calls.append("conv_bias_relu_backward")
        dz = dy * _mask(y, upper_clip)
        dx, dw = self.conv_grads(dz, x, w, needs, kw)
        return dx, dw, dz.sum((0, 2, 3)) if needs[2] else None

    def _convt(self, name, x, w, b, output_padding, kw, relu):
        self.calls.append(name)
        _image(x, w)
        _same_dtype(x, w, b)
        y = F.conv_transpose2d(x, w, b, kw["stride"], kw["padding"], output_padding, kw["groups"], kw["dilation"])
        return _like_layout(F.relu(y) if relu else y, x)

    def conv_transpose_bias(self, x, w, b, *, output_padding=0, **kw):
        return self._convt("conv_transpose_bias", x, w, b, output_padding, kw, False)

    def conv_transpose_bias_act(self, x, w, b, *, activation="relu", alpha=0.0, output_padding=0, **kw):
        from fusekit.pipeline.ir import torch_act

        y = self._convt(f"conv_transpose_bias_act:{activation}", x, w, b, output_padding, kw, False)
        return _like_layout(torch_act(y, (activation, alpha)), x)

    def conv_transpose_bias_relu(self, x, w, b, *, output_padding=0, **kw):
        return self._convt("conv_transpose_bias_relu", x, w, b, output_padding, kw, True)

    def conv_transpose_bias_relu_backward(self, dy, x, w, y, *, needs=(True, True, True), relu=True, padding=0, stride=1,
                                          dilation=1, groups=1):
        self.calls.append("conv_transpose_backward")
        dz = dy * (y > 0) if relu else dy
        s, p, d = torch.nn.modules.utils._pair(stride), torch.nn.modules.utils._pair(padding), torch.nn.modules.utils._pair(dilation)
        op = [dz.shape[2 + i] - ((x.shape[2 + i] - 1) * s[i] - 2 * p[i] + d[i] * (w.shape[2 + i] - 1) + 1) for i in range(2)]
        dx, dw = _vjp(lambda a, b: F.conv_transpose2d(a, b, None, s, p, op, groups, d), (x, w), dz)
        return dx if needs[0] else None, dw if needs[1] else None, dz.sum((0, 2, 3)) if needs[2] else None

    # linear
    def _linear(self, name, x, w, b, relu):
        self.calls.append(name)
        assert x.dim() == 2 and x.is_contiguous() and w.is_contiguous()
        _same_dtype(x, w, b)
        y = F.linear(x, w, b)
        return F.relu(y) if relu else y

    def linear_bias(self, x, w, b):
        return self._linear("linear_bias", x, w, b, False)

    def linear_bias_relu(self, x, w, b):
        return self._linear("linear_bias_relu", x, w, b, True)

    def linear_bias_backward(self, dy, x, w, *, needs=(True, True, True)):
        self.calls.append("linear_backward")
        return (dy @ w if needs[0] else None, dy.t() @ x if needs[1] else None, dy.sum(0) if needs[2] else None)

    def linear_bias_relu_backward(self, dy, x, w, y, *, needs=(True, True, True)):
        return self.linear_bias_backward(dy * (y > 0), x, w, needs=needs)

    # normalization
    def fold_batchnorm(self, w, b, mean, var, gamma=None, beta=None, epsilon=1e-5, *, dtype=None):
        """The fold kernel's arithmetic: float32, stored in ``dtype`` (not logged: no graph runs; counted
        in ``folded``)."""
        assert (gamma is None) == (beta is None) and (not w.requires_grad or not torch.is_grad_enabled())
        self.folded = getattr(self, "folded", 0) + 1
        f = lambda t: t.detach().float()  # noqa: E731
        s = torch.rsqrt(f(var) + epsilon)
        s = f(gamma) * s if gamma is not None else s
        shift = ((f(b) if b is not None else 0.0) - f(mean)) * s
        shift = shift + f(beta) if beta is not None else shift
        out = getattr(torch, dtype) if dtype else w.dtype
        return (f(w) * s.reshape(-1, 1, 1, 1)).to(out), shift.to(out)

    def affine_identity(self, x):
        c = x.shape[1]
        return torch.ones(c), torch.zeros(c), (torch.empty(c), torch.empty(c))

    def batchnorm(self, x, gamma, beta, running_mean=None, running_var=None, *, epsilon=1e-5, momentum=0.1, relu=False,
                  upper_clip=INF, residual=None):
        if residual is not None:
            assert relu and upper_clip == INF
            _image(residual)
            _same_dtype(x, residual)
        self.calls.append("batchnorm_add_relu" if residual is not None else ("batchnorm_relu" + ("6" if upper_clip == 6 else "")) if relu else "batchnorm")
        _image(x)
        for v, n in ((gamma, "gamma"), (beta, "beta")) + (((running_mean, "running_mean"), (running_var, "running_var"))
                                                          if running_mean is not None else ()):
            _channel(v, n)
        xd = x.double()
        mean, var = xd.mean((0, 2, 3)), xd.var((0, 2, 3), unbiased=False)
        inv = (var + epsilon).rsqrt()
        y = (xd - mean.view(1, -1, 1, 1)) * (inv * gamma.double()).view(1, -1, 1, 1) + beta.double().view(1, -1, 1, 1)
        if residual is not None:  # as the graph: BN output and residual summed in float32, rounded once
            y = y + residual.double()
        y = _like_layout(_act(y, relu, upper_clip).to(x.dtype), x)
        sd = torch.float64 if x.dtype == torch.float64 else F32  # float32 statistics, as the patterns (float64 runs stay exact)
        if running_mean is None:
            return y, mean.to(sd), inv.to(sd)
        m = x.shape[0] * x.shape[2] * x.shape[3]
        new_rm = running_mean.double() * (1 - momentum) + mean * momentum
        new_rv = running_var.double() * (1 - momentum) + var * (m / (m - 1)) * momentum
        return y, mean.to(sd), inv.to(sd), new_rm.to(sd), new_rv.to(sd)

    def batchnorm_backward(self, dy, x, gamma, mean, inv_var, *, y=None, needs=(True, True, True), upper_clip=INF, residual=False):
        self.calls.append("batchnorm_add_relu_backward" if residual else "batchnorm_relu_backward" if y is not None else "batchnorm_backward")
        _image(dy, x)
        _channel(gamma, "gamma")
        if y is not None:
            dy = dy * _mask(y, upper_clip)
        if residual:
            return self.batchnorm_backward(dy, x, gamma, mean, inv_var, needs=needs)[:3] + (dy,)
        m = x.shape[0] * x.shape[2] * x.shape[3]
        d, xd = dy.double(), x.double()
        mu, inv, g = (v.double().view(1, -1, 1, 1) for v in (mean, inv_var, gamma))
        xhat = (xd - mu) * inv
        dbeta, dgamma = d.sum((0, 2, 3)), (d * xhat).sum((0, 2, 3))
        dx = g * inv / m * (m * d - dbeta.view(1, -1, 1, 1) - xhat * dgamma.view(1, -1, 1, 1))
        out = (dx.to(x.dtype), dgamma.float(), dbeta.float())
        return tuple(r if n else None for r, n in zip(out, needs))

    def channel_scale_shift(self, x, gamma=None, beta=None, *, relu=False, upper_clip=INF):
        self.calls.append(("scale_shift_relu" + ("6" if upper_clip == 6 else "")) if relu else "scale_shift")
        _image(x)
        _channel(gamma, "gamma")
        _channel(beta, "beta")
        y = x.double() * gamma.double().view(1, -1, 1, 1) + beta.double().view(1, -1, 1, 1)
        return _like_layout(_act(y, relu, upper_clip).to(x.dtype), x)

    def channel_scale_shift_act(self, x, gamma, beta, *, activation="relu", alpha=0.0):
        from fusekit.pipeline.ir import torch_act

        y = self.channel_scale_shift(x, gamma, beta)
        self.calls[-1] = f"channel_scale_shift_act:{activation}"
        return _like_layout(torch_act(y, (activation, alpha)), x)

    def channel_scale_shift_backward(self, dy, x, gamma=None, *, y=None, needs=(True, True, True), upper_clip=INF):
        self.calls.append("scale_shift_backward")
        if y is not None:
            dy = dy * _mask(y, upper_clip)
        dx = (dy.double() * gamma.double().view(1, -1, 1, 1)).to(dy.dtype) if needs[0] else None
        dg = (dy.double() * x.double()).sum((0, 2, 3)).float() if needs[1] else None
        db = dy.double().sum((0, 2, 3)).float() if needs[2] else None
        return dx, dg, db

    # pointwise
    def call(self, name, *operands, out=None, **attrs):
        if name == "add_relu":
            a, b = operands
            _image(a, b)
            self.calls.append("add_relu")
            return _like_layout((a.double() + b.double()).clamp(0).to(a.dtype), a)
        assert name == "relu" and set(attrs) <= {"upper_clip"}, name
        clip = attrs.get("upper_clip", INF)
        self.calls.append("relu" if clip == INF else f"relu{clip:g}")
        (x,) = operands
        y = x.clamp(0, clip)
        if out is not None:
            out.copy_(y)
            return out
        return y

    def relu_backward(self, dy, y, *, upper_clip=INF):
        _same_dtype(dy, y)
        return dy * _mask(y, upper_clip)


class FakePool:
    def __init__(self, calls):
        self.calls = calls

    def max_pool2d(self, x, kernel_size, stride=None, padding=0, *, ceil_mode=False, indices=True, dilation=1):
        self.calls.append("max_pool2d")
        _image(x)
        y, idx = F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode, return_indices=True)
        return y, (idx.to(torch.int32) if indices else None)

    def max_pool2d_backward(self, dy, argmax, input_shape):
        n, c, h, w = input_shape
        dx = torch.zeros(n, c, h * w, dtype=dy.dtype)
        dx.scatter_add_(2, argmax.long().reshape(n, c, -1), dy.reshape(n, c, -1))
        return dx.reshape(n, c, h, w)

    def avg_pool2d(self, x, kernel_size, stride=None, padding=0, count_include_pad=True, *, ceil_mode=False, divisor_override=None):
        self.calls.append("avg_pool2d")
        _image(x)
        return F.avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)

    def avg_pool2d_backward(self, dy, input_shape, kernel_size, stride=None, padding=0, count_include_pad=True, ceil_mode=False,
                            divisor_override=None):
        z = torch.zeros(input_shape, dtype=dy.dtype)
        f = lambda a: F.avg_pool2d(a, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)  # noqa: E731
        return _vjp(f, (z,), dy)[0]

    def softmax(self, x, axis=1):
        self.calls.append("softmax")
        return torch.softmax(x, axis)

    def log_softmax(self, x, axis=1):
        self.calls.append("log_softmax")
        return torch.log_softmax(x, axis)

    def softmax_backward(self, dy, y, axis=1):
        return y * (dy - (dy * y).sum(axis, keepdim=True))

    def log_softmax_backward(self, dy, y, axis=1):
        return dy - y.exp() * dy.sum(axis, keepdim=True)


@pytest.fixture
def fake(monkeypatch):
    """fusekit.torch's modules on CPU tensors (float64 too) through the fake ops; returns the call log."""
    ops = FakeOps()
    monkeypatch.setattr(ft.common, "ops", ops)
    monkeypatch.setattr(ft.common, "pool", FakePool(ops.calls))

    def on_graphs(x, who, ranks=(4,)):
        return isinstance(x, torch.Tensor) and x.is_floating_point() and (ranks is None or x.dim() in ranks) and x.numel() > 0

    monkeypatch.setattr(ft.common, "on_graphs", on_graphs)
    return ops.calls


def clone_as(module_fk, module_torch):
    module_fk.load_state_dict(module_torch.state_dict())
    return module_fk


def compare(fk, ref, x, grads=True, tol=1e-10):
    """Forward and (when ``grads``) parameter and input gradients of two modules on copies of x.
    (Models with batch norm: tol 1e-6, its statistics are float32 as in the real patterns.)"""
    xf, xr = x.detach().requires_grad_(grads), x.detach().requires_grad_(grads)  # views: x's strides kept
    yf, yr = fk(xf), ref(xr)
    assert yf.shape == yr.shape and yf.dtype == yr.dtype
    assert rel(yf, yr) < tol
    if grads:
        g = torch.randn_like(yr)
        yf.backward(g)
        yr.backward(g)
        assert rel(xf.grad, xr.grad) < tol
        for (n, pf), (_, pr) in zip(fk.named_parameters(), ref.named_parameters()):
            if pr.grad is None:
                assert pf.grad is None or float(pf.grad.abs().max()) == 0, n
            elif float(pr.grad.norm()) < 1e-9:  # zero in exact arithmetic (a conv bias before a training BN)
                assert float(pf.grad.norm()) < 1e-6, n
            else:
                assert pf.grad is not None and pf.grad.dtype == pr.grad.dtype, n
                assert rel(pf.grad, pr.grad) < tol, n
    return yf


# ----------------------------------------------------------------------------------------------
# Construction and argument checks
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kernel, dilation, padding, expect_pad, expect_extra",
    [
        (3, 1, "same", (1, 1), None),
        (4, 1, "same", (1, 1), (0, 1, 0, 1)),
        ((2, 5), 1, "same", (0, 2), (0, 0, 0, 1)),
        (4, 2, "same", (3, 3), None),
        ((3, 4), (1, 3), "same", (1, 4), (0, 1, 0, 0)),
        (5, 1, "valid", (0, 0), None),
        (3, 1, (2, 1), (2, 1), None),
    ],
)
def test_conv_padding_is_made_explicit(kernel, dilation, padding, expect_pad, expect_extra):
    m = ft.Conv2d(4, 6, kernel, padding=padding, dilation=dilation)
    assert m._fk_pad == expect_pad and m._fk_extra == expect_extra


@pytest.mark.parametrize(
    "mode, padding, kernel, expect_extra",
    [
        ("reflect", 1, 3, (1, 1, 1, 1)),
        ("replicate", (2, 1), 3, (1, 1, 2, 2)),
        ("circular", "same", 4, (1, 2, 1, 2)),
        ("reflect", 0, 3, None),
    ],
)
def test_conv_padding_modes_pad_the_input_first(mode, padding, kernel, expect_extra):
    """Non-zero padding modes: the input is padded by F.pad as torch.nn.Conv2d does it, the conv pads
    nothing; the pad is torch's own (PyTorch's asymmetric "same" split included)."""
    m = ft.Conv2d(4, 6, kernel, padding=padding, padding_mode=mode)
    t = torch.nn.Conv2d(4, 6, kernel, padding=padding, padding_mode=mode)
    assert m._fk_pad == (0, 0) and m._fk_extra == expect_extra
    if expect_extra is not None:
        assert m._fk_extra == tuple(t._reversed_padding_repeated_twice)
    x = torch.randn(2, 4, 7, 9).contiguous(memory_format=torch.channels_last)
    y = ft.common.padded_for_conv(x, (1, 2, 1, 2), mode)
    assert y.is_contiguous(memory_format=torch.channels_last) and torch.equal(y, F.pad(x, (1, 2, 1, 2), mode=mode))


def test_constructors_take_torch_arguments():
    c = ft.Conv2d(8, 16, 3, padding="same", bias=False, groups=4)
    assert c.bias is None and c.weight.shape == (16, 2, 3, 3) and isinstance(c, torch.nn.Conv2d)
    t = ft.ConvTranspose2d(8, 4, 3, stride=2, bias=False, groups=2)
    assert t.bias is None and t.weight.shape == (8, 2, 3, 3)
    assert ft.Linear(5, 3, bias=False).bias is None
    assert ft.BatchNorm2d(4, activation="relu").activation == "relu"
    assert ft.MaxPool2d(3, 2, 1).stride == 2 and ft.AvgPool2d(2, count_include_pad=False).count_include_pad is False
    assert ft.Softmax().dim == 1 and not ft.Softmax().log and ft.Softmax(0, log=True).log
    assert ft.ReLU(inplace=True).inplace


@pytest.mark.parametrize(
    "make, operand",
    [
        (lambda: ft.Conv2d(3, 4, 3, activation="swish"), "activation"),
        (lambda: ft.Linear(3, 4, activation="mish"), "activation"),
        (lambda: ft.Linear(3, 4, activation=("relu6", 3.0)), "activation"),
        (lambda: ft.ConvTranspose2d(3, 4, 3, activation=("elu", "x")), "activation"),
        (lambda: ft.BatchNorm2d(3, activation="softplus"), "activation"),
    ],
)
def test_unsupported_arguments_are_operand_errors(make, operand):
    with pytest.raises(OperandError, match=operand) as e:
        make()
    assert e.value.operand == operand


def test_linear_wrong_width_is_an_operand_error(fake):
    with pytest.raises(OperandError, match="in_features"):
        ft.Linear(6, 3)(torch.randn(4, 5))


def test_batchnorm_training_needs_two_values_per_channel(fake):
    with pytest.raises(OperandError, match="more than 1 value per channel"):
        ft.BatchNorm2d(3)(torch.randn(1, 3, 1, 1))


def test_convert_rejects_a_non_module():
    with pytest.raises(OperandError, match="torch.nn.Module"):
        ft.convert(lambda x: x)


# ----------------------------------------------------------------------------------------------
# Module logic on fake ops, float64 against torch.nn
# ----------------------------------------------------------------------------------------------
CONV_CASES = [
    {"bias": False},
    {"bias": True, "activation": "relu"},
    {"bias": False, "activation": "relu"},
    {"groups": 4, "bias": False},
    {"groups": 8, "stride": 2},
    {"padding": "same", "kernel_size": 4},
    {"padding": "same", "kernel_size": (2, 3), "dilation": (1, 2), "bias": False},
    {"padding": "valid", "stride": 2},
    {"padding_mode": "reflect", "activation": "relu"},
    {"padding_mode": "replicate", "padding": (2, 1), "stride": 2, "bias": False},
    {"padding_mode": "circular", "padding": "same", "kernel_size": 4},
]


@pytest.mark.filterwarnings("ignore:Using padding='same'")  # torch's own, from the reference module
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("case", CONV_CASES, ids=[str(c) for c in CONV_CASES])
def test_conv2d_matches_torch(fake, case, channels_last):
    kw = {"kernel_size": 3, "padding": 1}
    kw.update(case)
    act = kw.pop("activation", None)
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(8, 16, **kw).double()
    fk = clone_as(ft.Conv2d(8, 16, activation=act, **kw).double(), ref)
    x = torch.randn(2, 8, 9, 10, dtype=torch.float64)
    if channels_last:
        x, fk, ref = (t.to(memory_format=torch.channels_last) for t in (x, fk, ref))
    full = torch.nn.Sequential(ref, torch.nn.ReLU()) if act else ref
    compare(fk, full, x)
    want = "conv_bias_relu" if act else ("conv_bias" if kw.get("bias", True) else "conv")
    assert fake[0] == want


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_transpose2d_matches_torch(fake, bias, groups):
    torch.manual_seed(0)
    ref = torch.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, bias=bias, groups=groups).double()
    fk = clone_as(ft.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, bias=bias, groups=groups).double(), ref)
    compare(fk, ref, torch.randn(2, 4, 5, 6, dtype=torch.float64))


def test_conv_transpose2d_output_size(fake):
    torch.manual_seed(0)
    ref = torch.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1).double()
    fk = clone_as(ft.ConvTranspose2d(4, 6, 3, stride=2, padding=1).double(), ref)
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    y = fk(x, output_size=(10, 10))
    assert y.shape == (2, 6, 10, 10) and rel(y, ref(x, output_size=(10, 10))) < 1e-12


@pytest.mark.parametrize("shape", [(5, 12), (2, 3, 12), (12,)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_torch(fake, shape, bias):
    torch.manual_seed(0)
    ref = torch.nn.Linear(12, 7, bias=bias).double()
    fk = clone_as(ft.Linear(12, 7, bias=bias).double(), ref)
    compare(fk, ref, torch.randn(shape, dtype=torch.float64))


def test_float32_linear_keeps_ieee_matmuls_through_pytorch(fake, monkeypatch, fresh_session):
    """Float32 Linear under a policy that keeps matmuls IEEE (the default) runs PyTorch's linear (cuDNN
    9.19 has only TF32 float32 matmul plans: 3e-4 off float64 on the H100, PyTorch 1e-7); allowing
    matmul TF32 sends it to cuDNN again, and other dtypes always go there."""
    monkeypatch.delenv("FUSEKIT_ALLOW_TF32", raising=False)
    torch.manual_seed(0)
    ref = torch.nn.Linear(12, 7)
    fk = clone_as(ft.Linear(12, 7, activation="relu"), ref)
    x = torch.randn(5, 12)
    assert torch.equal(fk(x), F.relu(ref(x))) and not fake  # PyTorch's own result, bit for bit
    monkeypatch.setenv("FUSEKIT_ALLOW_TF32", "matmul")
    fk(x)
    assert fake == ["linear_bias_relu"]
    monkeypatch.delenv("FUSEKIT_ALLOW_TF32")
    fk.double()(x.double())
    assert fake == ["linear_bias_relu"] * 2


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_train_and_eval_match_torch(fake, affine, momentum):
    torch.manual_seed(0)
    ref = torch.nn.BatchNorm2d(6, affine=affine, momentum=momentum).double()
    fk = clone_as(ft.BatchNorm2d(6, affine=affine, momentum=momentum).double(), ref)
    for _ in range(3):
        compare(fk, ref, torch.randn(4, 6, 5, 5, dtype=torch.float64) * 2 + 1, tol=1e-6)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.allclose(getattr(fk, name), getattr(ref, name)), name
    fk.eval(), ref.eval()
    compare(fk, ref, torch.randn(4, 6, 5, 5, dtype=torch.float64), tol=1e-6)  # eval: gradients to x, gamma and beta too
    assert "scale_shift" in fake and "scale_shift_backward" in fake


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batchnorm_half_parameters_and_buffers(fake, dtype):
    """model.half(): statistics in float32 (the fake asserts float32 gamma, beta, running stats), the
    running stats written back in their own dtype, gradients in the parameters' dtype."""
    torch.manual_seed(0)
    ref = torch.nn.BatchNorm2d(6, momentum=0.3)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    fk = clone_as(ft.BatchNorm2d(6, momentum=0.3), ref).to(dtype)
    for relu in (False, True):
        fk.activation = "relu" if relu else None
        for _ in range(2):
            x = torch.randn(4, 6, 5, 5) * 3 + 1
            xf = x.to(dtype).requires_grad_(True)
            y = fk(xf)
            yr = ref(x.to(dtype).float())
            if relu:
                yr = yr.relu()
            assert y.dtype == dtype and rel(y, yr) < 2e-2
            y.float().sum().backward()
            assert fk.weight.grad.dtype == dtype and xf.grad.dtype == dtype
            fk.zero_grad()
        assert fk.running_mean.dtype == dtype and fk.running_var.dtype == dtype
    ref2 = copy.deepcopy(ref)
    ref2.train()
    fk.eval()
    x = torch.randn(4, 6, 5, 5).to(dtype)
    fk.activation = None
    y = fk(x)
    yr = F.batch_norm(x.float(), fk.running_mean.float(), fk.running_var.float(), fk.weight.float(), fk.bias.float(), False, 0.0, fk.eps)
    assert y.dtype == dtype and rel(y, yr) < 2e-2


def test_autocast_casts_like_torch(fake, monkeypatch):
    """Under autocast: conv, transposed conv and Linear compute in the autocast dtype from float32
    parameters, whose gradients come back float32; BN stays in its input dtype; softmax goes float32."""
    monkeypatch.setattr(ft.common, "amp_dtype", lambda: torch.bfloat16)
    torch.manual_seed(0)
    conv, bn, lin = ft.Conv2d(4, 8, 3, padding=1), ft.BatchNorm2d(8), ft.Linear(8, 5)
    convt, sm = ft.ConvTranspose2d(8, 4, 2, stride=2), ft.Softmax(1)
    x = torch.randn(2, 4, 6, 6)
    y = conv(x)
    assert y.dtype == torch.bfloat16
    z = bn(y)
    assert z.dtype == torch.bfloat16
    assert convt(z).dtype == torch.bfloat16
    logits = lin(z.mean((2, 3)))
    assert logits.dtype == torch.bfloat16
    p = sm(logits)
    assert p.dtype == torch.float32
    (p * torch.randn(2, 5)).sum().backward()
    for m in (conv, bn, lin):
        for n, prm in m.named_parameters():
            assert prm.grad is not None and prm.grad.dtype == torch.float32, (type(m).__name__, n)
    ref = F.conv2d(x.bfloat16(), conv.weight.bfloat16(), conv.bias.bfloat16(), padding=1)
    assert rel(y, ref) < 1e-2


def test_relu_inplace_and_out_of_place(fake):
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    a = x.clone().requires_grad_(True)
    h = a * 2
    y = ft.ReLU(inplace=True)(h)
    assert y is h and h._version > 0 and torch.equal(y, (2 * x).relu())
    y.sum().backward()
    assert torch.equal(a.grad, 2.0 * (x > 0))
    b = x.clone().requires_grad_(True)
    y2 = ft.ReLU()(b)
    assert y2 is not b and torch.equal(b, x) and torch.equal(y2, x.relu())


def test_relu6_module_matches_torch_at_its_edges(fake):
    """ReLU6 forward clamps to [0, 6]; its backward passes the gradient only where 0 < x < 6 (strict at
    both ends, as PyTorch's hardtanh backward), out of place and in place."""
    x = torch.tensor([-1.0, 0.0, 3.0, 6.0, 7.5, 5.999], dtype=torch.float64).repeat(2, 1)
    for inplace in (False, True):
        fake.clear()
        a, r = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y, yr = ft.ReLU6(inplace=inplace)(a * 1.0), torch.nn.ReLU6(inplace=inplace)(r * 1.0)
        assert torch.equal(y, yr) and fake == ["relu6"]
        g = torch.randn_like(yr)
        y.backward(g)
        yr.backward(g)
        assert torch.equal(a.grad, r.grad) and torch.equal(a.grad != 0, (x > 0) & (x < 6))


def _relu6_cnn():
    """MobileNetV2's pieces: conv -> BN -> ReLU6, a depthwise conv -> BN -> ReLU6 (in place), a conv ->
    ReLU6, and a Linear -> ReLU6 (no clipped matmul graph: the ReLU6 runs on its own)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU6(),
        torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU6(inplace=True),
        torch.nn.Conv2d(8, 6, 1), torch.nn.ReLU6(),
        torch.nn.Flatten(), torch.nn.Linear(6 * 10 * 10, 5), torch.nn.ReLU6(),
    ).double()
    _randomize_bn(model)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(4.0, 6.0)  # many outputs above 6: the clip matters
                m.bias.uniform_(1.0, 2.0)
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(60.0)
    return model


def test_converted_relu6_model_train_and_eval_match_torch(fake):
    ref = _relu6_cnn()
    fk, report = ft.convert(ref)
    assert report.counts() == {"Conv2d": 3, "BatchNorm2d": 2, "ReLU6": 4, "Linear": 1}, report
    assert [names for names, _ in report.fused] == [
        ("0", "1", "2"), ("3", "4", "5"), ("6", "7"), ("2", "3"), ("5", "6")], report  # the last two: dReLU6 in the dgrads
    assert "BN+ReLU6 as one graph" in str(report)
    x = torch.randn(3, 3, 10, 10, dtype=torch.float64)
    with torch.no_grad():  # (on a copy: the running statistics stay as fk's)
        probe = copy.deepcopy(ref)
        assert float((probe[:2](x) >= 6).double().mean()) > 0.05 and float((probe[:10](x) >= 6).double().mean()) > 0.2
    compare(fk, ref, x, tol=1e-6)
    assert fake.count("batchnorm_relu6") == 2 and "conv_bias_relu6" in fake and "relu6" in fake  # the Linear's ReLU6 alone
    assert fake.count("dgrad_drelu6") == 2 and "batchnorm_relu_backward" not in fake  # both BNs' dReLU6 ran in the dgrads
    fk.eval(), ref.eval()
    fake.clear()
    compare(fk, ref, x, tol=1e-6)
    assert fake[:3] == ["conv_bias_relu6"] * 3, fake  # both BNs folded into their convs, ReLU6 in the epilogue


@pytest.mark.parametrize("act", ["relu", "relu6"])
def test_module_activation_argument(fake, act):
    """Conv2d / BatchNorm2d(activation=...) compute torch.nn's layer then F.relu / F.relu6."""
    torch.manual_seed(0)
    f = F.relu6 if act == "relu6" else F.relu
    x = 12 * torch.randn(2, 3, 6, 6, dtype=torch.float64)
    ref = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    conv = clone_as(ft.Conv2d(3, 4, 3, padding=1, activation=act).double(), ref)
    xf, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y, yr = conv(xf), f(ref(xr))
    assert rel(y, yr) < 1e-12 and (act == "relu" or bool((yr == 6).any()))
    y.sum().backward()
    yr.sum().backward()
    assert rel(xf.grad, xr.grad) < 1e-12
    bn, bref = ft.BatchNorm2d(3, activation=act).double(), torch.nn.BatchNorm2d(3).double()
    assert rel(bn(x), f(bref(x))) < 1e-6 and "activation='" + act + "'" in repr(bn)


@pytest.mark.parametrize("act", [("silu", F.silu), ("gelu", F.gelu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh")),
                                 ("sigmoid", torch.sigmoid), ("tanh", torch.tanh), ("hardswish", F.hardswish),
                                 ("hardsigmoid", F.hardsigmoid), ("leaky_relu", lambda t: F.leaky_relu(t, 0.01)),
                                 (("leaky_relu", 0.2), lambda t: F.leaky_relu(t, 0.2)), ("elu", F.elu), (("elu", 0.5), lambda t: F.elu(t, 0.5))],
                         ids=str)
def test_conv2d_takes_every_activation_of_the_fused_graphs(fake, act):
    """Conv2d(activation=...) beyond ReLU: without autograd, one conv_bias_act graph with the activation
    fused (not hardsigmoid nor ELU with alpha != 1, which cuDNN lowers with scalar constants: the conv
    graph then PyTorch's activation); with autograd, the conv graph then PyTorch's activation (its
    backward by autograd); both as torch.nn.Conv2d then the activation, gradients too."""
    name, f = act
    torch.manual_seed(1)
    x = 3 * torch.randn(2, 3, 6, 6, dtype=torch.float64)
    ref = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    conv = clone_as(ft.Conv2d(3, 4, 3, padding=1, activation=name).double(), ref)
    with torch.no_grad():
        assert rel(conv(x), f(ref(x))) < 1e-12
    fused = [c for c in fake if c.startswith("conv_bias_act:")]
    scalar_constants = name in ("hardsigmoid", ("elu", 0.5))
    assert fused == ([] if scalar_constants else [f"conv_bias_act:{name if isinstance(name, str) else name[0]}"]), fake
    fake.clear()
    xf, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y, yr = conv(xf), f(ref(xr))
    assert rel(y, yr) < 1e-12 and not any(c.startswith("conv_bias_act") for c in fake)
    (y * yr.detach()).sum().backward()
    (yr * yr.detach()).sum().backward()
    assert rel(xf.grad, xr.grad) < 1e-12 and rel(conv.weight.grad, ref.weight.grad) < 1e-12
    assert "activation=" in repr(conv)


ACTS = [("silu", F.silu), ("hardswish", F.hardswish), (("leaky_relu", 0.2), lambda t: F.leaky_relu(t, 0.2)), ("relu6", F.relu6)]


def _layers(name):
    """(fusekit layer with ``name``'s activation, the torch layer, an input, the fused graph's call name)."""
    act = "clip" if name == "relu6" else name if isinstance(name, str) else name[0]  # ReLU6 as cuDNN's clip where no ReLU6 graph
    return [
        (ft.Linear(6, 5, activation=name), torch.nn.Linear(6, 5), torch.randn(4, 6), f"linear_bias_act:{act}"),
        (ft.Linear(6, 5, bias=False, activation=name), torch.nn.Linear(6, 5, bias=False), torch.randn(2, 3, 6), f"linear_bias_act:{act}"),
        (ft.ConvTranspose2d(3, 4, 3, stride=2, activation=name), torch.nn.ConvTranspose2d(3, 4, 3, stride=2), torch.randn(2, 3, 5, 5),
         f"conv_transpose_bias_act:{act}"),
        (ft.BatchNorm2d(3, activation=name).eval(), torch.nn.BatchNorm2d(3).eval(), torch.randn(2, 3, 5, 5),
         "scale_shift_relu6" if act == "clip" else f"channel_scale_shift_act:{act}"),
    ]


@pytest.mark.parametrize("act", ACTS, ids=lambda a: str(a[0]))
def test_linear_conv_transpose_and_batchnorm_take_every_activation(fake, act):
    """Linear, ConvTranspose2d and BatchNorm2d(activation=...) beyond their ReLU graphs, as Conv2d:
    without autograd one graph with the activation fused; with autograd the layer's graph then
    PyTorch's activation; both as the torch layer then the activation, gradients too. A training
    BatchNorm2d runs the BN graph then the activation."""
    name, f = act
    torch.manual_seed(4)
    for fk, ref, x, fused in _layers(name):
        ref = ref.double()
        if isinstance(ref, torch.nn.BatchNorm2d):
            with torch.no_grad():
                ref.running_mean.uniform_(-1, 1), ref.running_var.uniform_(0.5, 2), ref.weight.uniform_(0.5, 2), ref.bias.uniform_(-1, 1)
        fk = clone_as(fk.double(), ref)
        x, tol = 3 * x.double(), 1e-6 if isinstance(ref, torch.nn.BatchNorm2d) else 1e-12  # (BN's scale and shift are float32)
        fake.clear()
        with torch.no_grad():
            assert rel(fk(x), f(ref(x))) < tol, type(fk)
        if name == "hardswish" or isinstance(ref, torch.nn.Linear):  # the activation after the layer's graph (why: fusekit.torch.modules)
            assert not any(":" in str(c) for c in fake), fake
        else:
            assert fake == [fused], fake
        compare(fk, torch.nn.Sequential(ref, as_module(f)), x, tol=tol)
        assert not any(":" in str(c) for c in fake[1:]) and "activation=" in repr(fk)
    bn, ref = ft.BatchNorm2d(3, activation=name).double(), torch.nn.BatchNorm2d(3).double()
    compare(bn, torch.nn.Sequential(ref, as_module(f)), torch.randn(4, 3, 5, 5, dtype=torch.float64), tol=1e-6)
    assert torch.allclose(bn.running_var, ref.running_var)


def test_a_folded_batchnorm_brings_its_activation_into_the_conv_graph(fake):
    """convert links a Conv2d to the BatchNorm2d(activation="silu") after it: in eval without
    autograd the BN folds into the conv and its SiLU is the conv graph's epilogue (one graph)."""
    torch.manual_seed(5)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), ft.BatchNorm2d(4, activation="silu")).double().eval()
    with torch.no_grad():
        m[1].running_var.uniform_(0.5, 2), m[1].running_mean.uniform_(-1, 1)
    ref = torch.nn.Sequential(copy.deepcopy(m[0]), clone_as(torch.nn.BatchNorm2d(4).double().eval(), m[1]), torch.nn.SiLU())
    fk, report = ft.convert(m, route="modules")
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    fake.clear()
    with torch.no_grad():
        assert rel(fk(x), ref(x)) < 1e-6  # (the fold is computed in float32)
    assert fake == ["conv_bias_act:silu"], (fake, report)


def test_convert_fuses_activation_modules_into_the_layer_before(fake):
    """convert links a SiLU / GELU / Hardswish / ... module used only by the layer before it: in eval
    without autograd conv -> BN -> SiLU is one conv_bias_act graph (BN folded, SiLU the epilogue) and
    the SiLU module passes the output on; in training the BN graph then PyTorch's SiLU; both as the
    original, gradients too. Linear runs the activation after its graph. The report lists each group
    and no longer calls the activation left alone. A SiLU called twice passes on only the output of the
    layer it is linked to (its other call, on another tensor, runs it)."""
    torch.manual_seed(6)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.act = torch.nn.Conv2d(4, 4, 1), torch.nn.SiLU()

        def forward(self, x):
            return self.act(self.conv(self.act(x)))

    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.SiLU(), torch.nn.Conv2d(4, 4, 1),
                              torch.nn.Hardswish(), Twice(), torch.nn.Flatten(), torch.nn.Linear(4 * 36, 5), torch.nn.GELU()).double()
    _randomize_bn(ref)
    fk, report = ft.convert(copy.deepcopy(ref), route="modules")
    assert fk[1]._fk_after is fk[2] and fk[3]._fk_after is fk[4] and fk[7]._fk_after is fk[8] and fk[5].conv._fk_after is fk[5].act
    groups = {names: what for names, what in report.fused}
    assert "eval: one conv+bias+SiLU graph" in groups[("0", "1", "2")] and ("3", "4") in groups and ("7", "8") in groups
    assert {t for _, t, _ in report.left_alone} == {"Flatten"}, report.left_alone
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    compare(fk, ref, x, tol=1e-6)  # training: BN statistics of the batch, the activations PyTorch's after the graphs
    fk.eval(), ref.eval()
    fake.clear()
    with torch.no_grad():
        assert rel(fk(x), ref(x)) < 1e-6
    graphs = [c for c in fake if isinstance(c, str) and c.startswith(("conv_bias_act", "linear"))]
    assert graphs[:2] == ["conv_bias_act:silu", "conv_bias_act:hardswish"] and graphs[-1].startswith("linear_bias"), fake
    compare(fk, ref, x, tol=1e-6)  # eval with autograd: the conv graphs, then PyTorch's activations


def test_conv2d_activation_is_checked_and_blocks_a_bn_link():
    """An unknown activation or alpha is an OperandError naming the argument; convert links no BN or
    ReLU to a conv that has an activation of its own (it runs before them); on a CPU tensor the
    module is torch.nn.Conv2d then the activation (PyTorch's own route)."""
    torch.manual_seed(2)
    ref = torch.nn.Conv2d(3, 4, 3).double()
    conv = clone_as(ft.Conv2d(3, 4, 3, activation=("elu", 0.3)).double(), ref)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    with pytest.warns(ft.TorchFallbackWarning):
        assert rel(conv(x), F.elu(ref(x), 0.3)) < 1e-12
    for bad in ("swish", ("elu",), ("elu", "x"), ("relu", 0.5), 3):
        with pytest.raises(OperandError, match="activation"):
            ft.Conv2d(3, 4, 3, activation=bad)
    m = torch.nn.Sequential(ft.Conv2d(3, 4, 3, activation="silu"), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    fk, report = ft.convert(m)
    assert fk[0]._fk_bn is None and fk[0]._fk_relu is None, report


@pytest.mark.parametrize("ceil", [False, True])
def test_pool_arguments_match_torch(fake, ceil):
    """MaxPool2d with dilation and return_indices (int64 indices, F.max_unpool2d takes them), and
    AvgPool2d with divisor_override, forward and backward as torch.nn's."""
    x = torch.randn(2, 3, 11, 10, dtype=torch.float64)
    for make in (lambda m: m(3, 2, 1, dilation=2, ceil_mode=ceil), lambda m: m((3, 2), (1, 2), (1, 1), (2, 3), ceil_mode=ceil)):
        compare(make(ft.MaxPool2d), make(torch.nn.MaxPool2d), x)
    fk, ref = ft.MaxPool2d(2, 2, return_indices=True, ceil_mode=ceil), torch.nn.MaxPool2d(2, 2, return_indices=True, ceil_mode=ceil)
    for grad in (True, False):
        xf = x.clone().requires_grad_(grad)
        (y, i), (yr, ir) = fk(xf), ref(x)
        assert torch.equal(y, yr) and i.dtype == torch.int64 and torch.equal(i, ir)
        assert torch.equal(F.max_unpool2d(y, i, 2, 2, output_size=x.shape[2:]), F.max_unpool2d(yr, ir, 2, 2, output_size=x.shape[2:]))
    xf = x.clone().requires_grad_(True)
    fk(xf)[0].sum().backward()
    xr = x.clone().requires_grad_(True)
    ref(xr)[0].sum().backward()
    assert torch.equal(xf.grad, xr.grad)
    for d in (1, 4):
        compare(ft.AvgPool2d(3, 2, 1, ceil_mode=ceil, divisor_override=d), torch.nn.AvgPool2d(3, 2, 1, ceil_mode=ceil, divisor_override=d), x)


def test_pools_and_softmax_match_torch(fake):
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    compare(ft.MaxPool2d(3, 2, 1), torch.nn.MaxPool2d(3, 2, 1), x)
    for shape, args in (((2, 3, 10, 11), (2, 2)), ((2, 3, 8, 9), (3, 2, 1)), ((1, 2, 7, 13), ((3, 2), (2, 3)))):
        xc = torch.randn(shape, dtype=torch.float64)  # ceil_mode: every case adds a window in some dim
        assert compare(ft.MaxPool2d(*args, ceil_mode=True), torch.nn.MaxPool2d(*args, ceil_mode=True), xc).shape != \
            torch.nn.functional.max_pool2d(xc, *args).shape
        for cip in (True, False):
            compare(ft.AvgPool2d(*args, ceil_mode=True, count_include_pad=cip), torch.nn.AvgPool2d(*args, ceil_mode=True, count_include_pad=cip), xc)
    compare(ft.AvgPool2d(3, 2, 1, count_include_pad=False), torch.nn.AvgPool2d(3, 2, 1, count_include_pad=False), x)
    compare(ft.Softmax(1), torch.nn.Softmax(1), x)
    compare(ft.LogSoftmax(1), torch.nn.LogSoftmax(1), torch.randn(4, 10, dtype=torch.float64))


def test_non_dense_input_runs_on_a_dense_copy_warned_once(fake, monkeypatch):
    forget_warnings()
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    fk = clone_as(ft.Conv2d(3, 4, 3, padding=1).double(), ref)
    big = torch.randn(2, 3, 12, 16, dtype=torch.float64)
    for x in (big[:, :, ::2, 1:9], big.transpose(2, 3)[:, :, 3:, :7]):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            compare(fk, ref, x)
        assert sum(issubclass(w.category, LayoutWarning) for w in got) == (1 if x.shape[-1] == 8 else 0)
    with pytest.warns(LayoutWarning, match="Linear"):
        compare(clone_as(ft.Linear(5, 2).double(), lin := torch.nn.Linear(5, 2).double()), lin, torch.randn(5, 4, dtype=torch.float64).t())


def test_empty_batch_returns_empty_outputs_with_gradients(fake):
    model = torch.nn.Sequential(ft.Conv2d(3, 4, 3, padding=1, bias=False), ft.BatchNorm2d(4), ft.ReLU(), ft.MaxPool2d(2),
                                torch.nn.Flatten(), ft.Linear(4 * 4 * 4, 5))
    x = torch.randn(0, 3, 8, 8, requires_grad=True)
    y = model(x)
    assert y.shape == (0, 5)
    y.sum().backward()
    assert x.grad.shape == x.shape and float(model[0].weight.grad.abs().sum()) == 0
    assert fake == []  # nothing reached the (fake) graphs


def test_cpu_tensors_run_pytorch_with_one_warning(monkeypatch):
    forget_warnings()
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(3, 4, 3, padding="same", bias=False)
    fk = clone_as(ft.Conv2d(3, 4, 3, padding="same", bias=False, activation="relu"), ref)
    x = torch.randn(2, 3, 8, 8)
    with pytest.warns(ft.TorchFallbackWarning, match="cpu tensor"):
        y = fk(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fk(x)  # once per module type and reason
    assert torch.equal(y, ref(x).relu())


# ----------------------------------------------------------------------------------------------
# Fusion hand-offs
# ----------------------------------------------------------------------------------------------
def test_hand_on_passes_only_the_exact_unmodified_tensor():
    a, b = torch.nn.ReLU(), torch.nn.ReLU()
    y = ft.common.hand_on(torch.randn(3), (a, b))
    assert not ft.common.already_done(y, b)  # b's turn comes after a's
    assert ft.common.already_done(y, a) and ft.common.already_done(y, b) and not ft.common.already_done(y, b)
    z = ft.common.hand_on(torch.randn(3), (a,))
    z.add_(1)  # modified in place after the producer: computed again
    assert not ft.common.already_done(z, a)
    w = ft.common.hand_on(torch.randn(3), (a,))
    assert not ft.common.already_done(w.clone(), a) and not ft.common.already_done(w[:2], a)


def small_cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True),
        torch.nn.Conv2d(8, 8, 3, padding="same"), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 16, 3, stride=2, groups=2), torch.nn.BatchNorm2d(16),
        torch.nn.AvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4),
        torch.nn.LogSoftmax(1),
    )


def _randomize_bn(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)


def test_converted_small_cnn_train_and_eval_match_torch(fake):
    ref = small_cnn().double()
    _randomize_bn(ref)
    fk, report = ft.convert(ref)
    assert [type(m).__module__ for m in fk] == ["fusekit.torch"] * 9 + ["torch.nn.modules.flatten"] + ["fusekit.torch"] * 4
    assert len(report.fused) == 5, report  # the last: the first ReLU's backward in the second conv's dgrad
    x = torch.randn(3, 3, 12, 12, dtype=torch.float64)
    compare(fk, ref, x, tol=1e-6)  # training: conv, then BN+ReLU fused; conv+ReLU; conv, BN; linear+ReLU
    assert "batchnorm_relu" in fake and "conv_bias_relu" in fake and "linear_bias_relu" in fake
    assert fake.count("relu") == 0  # every ReLU module handed its work to its producer
    fk.eval(), ref.eval()
    fake.clear()
    compare(fk, ref, x, tol=1e-6)  # eval: BN folded into the convs (gradients reach BN's parameters through the fold)
    assert not any(c.startswith(("batchnorm", "scale_shift")) for c in fake), fake
    assert fake[:4] == ["conv_bias_relu", "conv_bias_relu", "max_pool2d", "conv_bias"]
    with torch.no_grad():  # (the fold is computed in float32: 1e-6)
        assert rel(fk(x), ref(x)) < 1e-6
        fk[1].running_var.mul_(3)  # in-place changes reach the folded weights
        ref[1].running_var.mul_(3)
        assert rel(fk(x), ref(x)) < 1e-6
    fk[0].weight.data.mul_(0.5)  # through .data (no version bump): seen after the next .eval()
    ref[0].weight.data.mul_(0.5)
    fk.eval()
    with torch.no_grad():
        assert rel(fk(x), ref(x)) < 1e-6


def _folds(fk):
    """The (w', b') each conv of ``fk`` that folds a BN holds from its last fold without autograd (None: none held)."""
    return [m.__dict__.get("_fk_memo", (None, None, None))[2] for m in fk if isinstance(m, ft.Conv2d) and m._fk_bn is not None]


def test_eval_folds_are_computed_once_and_follow_every_change(fake):
    """Eval without autograd folds each BN into its conv once and reuses it while the conv's and BN's
    tensors are unchanged; an optimizer step, load_state_dict, a replaced parameter, a changed eps and
    (after .eval()) a write through .data are all seen. With autograd the fold is computed at every call."""
    ref = small_cnn().double()
    _randomize_bn(ref)
    fk, _ = ft.convert(ref)
    fk.eval(), ref.eval()
    x = torch.randn(3, 3, 12, 12, dtype=torch.float64)

    def check():
        with torch.no_grad():
            assert rel(fk(x), ref(x)) < 1e-6

    check()
    first = _folds(fk)
    assert all(f is not None for f in first)
    assert ft.common.ops.folded == 2  # without autograd: ops.fold_batchnorm's one kernel per conv
    check()
    assert all(a is b for a, b in zip(first, _folds(fk)))  # reused, not recomputed
    assert ft.common.ops.folded == 2
    for m in (fk, ref):  # an optimizer step on the parameters
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.3)
        opt.step()
    check()
    assert all(a is not b for a, b in zip(first, _folds(fk)))
    state = small_cnn().double().state_dict()
    fk.load_state_dict(state), ref.load_state_dict(state)
    check()
    w = torch.randn_like(ref[0].weight)
    fk[0].weight, ref[0].weight = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    check()
    fk[1].eps = ref[1].eps = 0.5
    check()
    with torch.no_grad():
        fk[7].weight.data.add_(1.0), ref[7].weight.data.add_(1.0)
    fk.eval()
    check()
    with torch.inference_mode():  # the standard inference context: inference tensors have no version counter
        assert rel(fk(x), ref(x)) < 1e-6
    # autograd: the fold at every call, gradients reach the BN's parameters (compare checks them)
    fk.eval()
    kernels = ft.common.ops.folded
    compare(fk, ref, x, tol=1e-6)
    assert _folds(fk) == [None] * 2 and ft.common.ops.folded == kernels  # the differentiable fold, not the kernel
    # a frozen model under autograd (an input gradient only): the held fold serves, gradients flow to x
    for m in (fk, ref):
        m.requires_grad_(False)
    compare(fk, ref, x, tol=1e-6)
    assert all(f is not None for f in _folds(fk)) and ft.common.ops.folded == kernels + 2


def test_converted_models_run_under_inference_mode(fake):
    """torch.inference_mode (whose tensors have no version counter) runs converted models, fused
    hand-offs and residual ends included, as no_grad does."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    for ref, size in ((small_cnn().double(), 12), (tv.models.resnet18(num_classes=10).double(), 32)):
        _randomize_bn(ref)
        fk, _ = ft.convert(ref)
        fk.eval(), ref.eval()
        x = torch.randn(2, 3, size, size, dtype=torch.float64)
        with torch.no_grad():
            want = fk(x)
        fake.clear()
        with torch.inference_mode():
            got = fk(x)
        assert got.is_inference() and torch.equal(got, want)
        assert not any(c.startswith(("batchnorm", "scale_shift")) for c in fake), fake  # still folded


def test_relu_backward_moves_into_the_consuming_convs_dgrad(fake):
    """conv -> BN -> ReLU -> conv: convert marks the second conv (its input is a ReLU output nothing
    else uses); its backward computes dx with the ReLU's mask (the dgrad + dReLU graph) and the BN
    backward then runs without its dReLU. Gradients as torch.nn's."""
    ref = small_cnn().double()
    _randomize_bn(ref)
    fk, _ = ft.convert(ref)
    assert [m._fk_drelu for m in fk if isinstance(m, ft.Conv2d)] == [False, True, False]
    compare(fk, ref, torch.randn(3, 3, 12, 12, dtype=torch.float64), tol=1e-6)
    assert fake.count("dgrad_drelu") == 1
    assert "batchnorm_backward" in fake and "batchnorm_relu_backward" not in fake  # the first BN: no dReLU of its own


class _TwoUses(torch.nn.Module):
    """A ReLU output read by a conv and by an add (a residual): its gradient is a sum."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.bn, self.relu = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        r = self.relu(self.bn(self.conv1(x)))
        return self.conv2(r) + r


def test_relu_output_with_two_uses_keeps_its_own_relu_backward(fake):
    """A ReLU output that also feeds an add is not marked for the consumer's dReLU; forced on anyway,
    the summed gradient carries no valid tag and the producer masks it itself: gradients stay exact."""
    ref = _TwoUses().double()
    _randomize_bn(ref)
    fk, _ = ft.convert(ref)
    assert not fk.conv2._fk_drelu
    x = torch.randn(2, 3, 10, 10, dtype=torch.float64)
    compare(fk, ref, x, tol=1e-6)
    assert "dgrad_drelu" not in fake and "batchnorm_relu_backward" in fake
    fk.conv2.__dict__["_fk_drelu"] = True  # as if the analysis had missed the add
    fake.clear()
    compare(fk, ref, x, tol=1e-6)
    assert "dgrad_drelu" in fake and "batchnorm_relu_backward" in fake


def test_relu_output_changed_in_place_is_not_fused(fake):
    """A ReLU output modified in place before the conv reads it (version bumped) is not a ReLU output
    any more: the conv computes a plain dgrad."""
    ref = small_cnn().double()
    fk, _ = ft.convert(ref)
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    with torch.no_grad():
        h = fk[2](fk[1](fk[0](x)))
    assert ft.common.relu_output_clip(h) == float("inf")
    h.add_(1.0)
    assert ft.common.relu_output_clip(h) is None
    h.requires_grad_(True)
    fk[3](h).sum().backward()
    assert "dgrad_drelu" not in fake and h.grad is not None


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_converted_torchvision_model_matches_torch(fake, name):
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    ref = getattr(tv.models, name)(weights=None, num_classes=10).double()
    _randomize_bn(ref)
    for m in ref.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0  # same outputs in training
    fk, _ = ft.convert(ref)
    x = torch.randn(3, 3, 64, 64, dtype=torch.float64)
    fake.clear()
    compare(fk, ref, x, tol=2e-5)  # float32 BN affine vectors and folds in a float64 model, over 20-50 layers
    if name == "mobilenet_v2":  # training: each ReLU6 inside its BN's graph forward, inside the next conv's dgrad backward
        relu6 = sum(isinstance(m, torch.nn.ReLU6) for m in ref.modules())
        assert fake.count("batchnorm_relu6") == relu6 and not any(c.startswith("relu") for c in fake)
        assert fake.count("dgrad_drelu6") + fake.count("batchnorm_relu_backward") == relu6
    blocks = sum(type(m).__name__ == "BasicBlock" for m in ref.modules())
    if name == "resnet18":  # training: each block ends in one BN + add + ReLU graph, backward one graph too
        assert fake.count("batchnorm_add_relu") == fake.count("batchnorm_add_relu_backward") == blocks == 8, fake
    fk.eval(), ref.eval()
    fake.clear()
    compare(fk, ref, x, tol=2e-5)
    assert not any(c.startswith(("batchnorm", "scale_shift")) for c in fake)  # every BN folded into its conv
    assert fake.count("add_relu") == blocks  # eval: the residual add and its ReLU as one graph
    fake.clear()
    with torch.no_grad():  # inference: each block's last conv, its folded BN, the add and the ReLU as one graph
        assert rel(fk(x), ref(x)) < 2e-5
    assert fake.count("conv_bias_add_relu") == blocks and "add_relu" not in fake, fake


#: More torchvision architectures through convert, each for what it adds: grouped convs (ResNeXt,
#: RegNet), pre-activation BN -> ReLU -> conv and concatenation (DenseNet), conv + ReLU without BN and
#: ceil-mode pools (SqueezeNet), channel shuffle (non-dense inputs: ShuffleNet), BatchNorm eps 1e-3 and
#: branches (GoogLeNet, Inception v3), SiLU / Hardswish / Sigmoid squeeze-excitation left alone
#: (EfficientNet, MnasNet, MobileNetV3), and nothing to fuse (ConvNeXt). Input size: the smallest each takes.
ARCHITECTURES = {"resnext50_32x4d": 32, "regnet_x_400mf": 32, "regnet_y_400mf": 32, "densenet121": 32, "squeezenet1_1": 64,
                 "shufflenet_v2_x0_5": 32, "googlenet": 32, "inception_v3": 75, "efficientnet_b0": 32, "mnasnet0_5": 32,
                 "mobilenet_v3_small": 32, "convnext_tiny": 32}


def _architecture(name):
    """torchvision ``name`` (random weights, 10 classes) in float64, BN statistics randomized, dropout
    and stochastic depth off (training-mode outputs comparable)."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    extra = dict(aux_logits=False, init_weights=True) if name in ("googlenet", "inception_v3") else {}
    ref = getattr(tv.models, name)(weights=None, num_classes=10, **extra).double()
    _randomize_bn(ref)
    for m in ref.modules():
        if isinstance(m, torch.nn.Dropout) or type(m).__name__ == "StochasticDepth":
            m.p = 0.0
    return ref


def _outputs_and_grads(model, x):
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y.backward(g.to(y.dtype))
    return [("output", y), ("input gradient", x.grad)] + [(n, p.grad) for n, p in model.named_parameters()]


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_converted_architectures_match_torch(fake, name, mode):
    """Converted (float64 model through the fake ops: float32 BN statistics and affine vectors, as the
    patterns take them) against the original in float64: output, input and parameter gradients each
    within 4x the error of the original model run in float32 (a mask flip of a near-zero ReLU input
    moves a gradient by more than rounding: the float32 original is the yardstick for that too)."""
    ref = _architecture(name)
    fk, report = ft.convert(copy.deepcopy(ref))
    f32 = copy.deepcopy(ref).float()
    for m in (ref, fk, f32):
        m.train(mode == "train")
    x = torch.randn(4, 3, ARCHITECTURES[name], ARCHITECTURES[name], dtype=torch.float64)
    want, got, yardstick = _outputs_and_grads(ref, x), _outputs_and_grads(fk, x), _outputs_and_grads(f32, x.float())
    for (what, w), (_, g), (_, y) in zip(want, got, yardstick):
        assert g is not None and g.dtype == w.dtype, what
        scale = float(w.norm()) + 1e-30
        e_fk, e_f32 = float((g - w).norm()) / scale, float((y.double() - w).norm()) / scale
        assert e_fk <= 4 * e_f32 + 1e-7, f"{name} {mode}: {what} off by {e_fk:.2e}, float32 PyTorch by {e_f32:.2e}"
    if name != "convnext_tiny":
        assert report.fused and (mode == "train" or any(c.startswith("conv_bias") for c in fake)), report
    assert fake, "no fusekit op ran"


# ----------------------------------------------------------------------------------------------
# convert: parameters, state dicts, report
# ----------------------------------------------------------------------------------------------
def test_convert_keeps_parameters_and_state_dict_both_ways():
    ref = small_cnn()
    fk, _ = ft.convert(ref)
    assert all(type(m).__module__.startswith("torch.nn") for m in ref.modules())  # inplace=False: a copy
    assert list(fk.state_dict()) == list(ref.state_dict())
    for (k, a), (_, b) in zip(fk.state_dict().items(), ref.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), k
    other = small_cnn()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1)
    fk.load_state_dict(other.state_dict())  # torch -> fusekit
    assert torch.equal(fk[0].weight, other[0].weight)
    ref.load_state_dict(fk.state_dict())  # fusekit -> torch
    assert torch.equal(ref[10].bias, other[10].bias)
    same, _ = ft.convert(ref, inplace=True)
    assert same is ref and isinstance(ref[0], ft.Conv2d) and ref[0].weight is same[0].weight


def test_convert_inplace_keeps_optimizer_references_and_hooks():
    ref = small_cnn()
    params = list(ref.parameters())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    seen = []
    ref[0].register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    fk, _ = ft.convert(ref, inplace=True)
    assert all(a is b for a, b in zip(params, fk.parameters()))
    assert opt.param_groups[0]["params"][0] is fk[0].weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fk(torch.randn(2, 3, 12, 12))
    assert seen == ["Conv2d"]


def test_convert_report_and_what_is_left_alone():
    class MyConv(torch.nn.Conv2d):
        pass

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), torch.nn.ReLU(), MyConv(4, 4, 1), torch.nn.Hardswish(),
        torch.nn.MaxPool2d(2, dilation=2), torch.nn.Flatten(), torch.nn.Linear(4, 2),
    )
    fk, report = ft.convert(model)
    left = {name: (t, why) for name, t, why in report.left_alone}
    assert "0" not in left and "subclass of torch.nn.Conv2d" in left["2"][1]
    assert left["3"] == ("Hardswish", "no fusekit module: runs in PyTorch") and "4" not in left
    assert type(fk[0]) is ft.Conv2d and fk[0].padding_mode == "reflect" and type(fk[2]) is MyConv
    assert report.counts() == {"Conv2d": 1, "ReLU": 1, "MaxPool2d": 1, "Linear": 1}
    assert [names for names, _ in report.fused] == [("0", "1")]  # the reflect-padded conv takes its ReLU
    text = str(report)
    for s in ("4 modules replaced", "1 fused groups", "left alone:", "Hardswish", "torch.fx", "fusekit.torch.graphed(model)"):
        assert s in text, text
    assert "graphed" not in str(ft.convert(torch.nn.Sequential(torch.nn.Flatten()))[1])  # nothing replaced: no advice


def test_convert_twice_and_fuse_off():
    fk, r1 = ft.convert(small_cnn())
    _, r2 = ft.convert(fk)
    assert r2.replaced == [] and len(r2.fused) == len(r1.fused)
    plain, r3 = ft.convert(small_cnn(), fuse=False)
    assert r3.fused == [] and len(r3.replaced) == len(r1.replaced)
    assert all(m._fk_bn is None and m._fk_relu is None for m in plain.modules() if isinstance(m, ft.modules.FusekitModule))


def test_deepcopy_keeps_links_inside_the_copy():
    fk, _ = ft.convert(small_cnn())
    dup = copy.deepcopy(fk)
    assert dup[0]._fk_bn is dup[1] and dup[1]._fk_relu is dup[2] and dup[3]._fk_relu is dup[4]


def test_untraceable_model_fuses_in_sequential_order_only(fake):
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
            self.head = torch.nn.Conv2d(4, 4, 1)
            self.act = torch.nn.ReLU()

        def forward(self, x):
            y = self.body(x)
            if y.sum() > 0:  # data-dependent: torch.fx cannot trace it
                y = self.act(self.head(y))
            return y

    torch.manual_seed(0)
    ref = Gate().double()
    _randomize_bn(ref)
    fk, report = ft.convert(ref)
    assert "nn.Sequential containers only" in report.analysis and "TraceError" in report.analysis
    assert [names for names, _ in report.fused] == [("body.0", "body.1", "body.2")]  # head -> act: order unknown
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    compare(fk, ref, x, tol=1e-6)
    fk.eval(), ref.eval()
    compare(fk, ref, x, tol=1e-6)


def test_fx_finds_functional_relu_and_shared_modules():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(4)
            self.conv2 = torch.nn.Conv2d(4, 4, 3, padding=1)
            self.relu = torch.nn.ReLU()

        def forward(self, x):
            y = F.relu(self.bn(self.conv(x)))
            z = self.conv2(y)
            return self.relu(z) + z  # conv2's output has two users: not fused with the ReLU

    fk, report = ft.convert(Block())
    assert [names for names, _ in report.fused] == [("conv", "bn")]
    assert any("bn: its output goes to a functional ReLU" in n for n in report.notes), report.notes
    assert fk.conv2._fk_relu is None


TORCHVISION = {
    # model: (replaced counts, fused groups (with the convs whose dgrad takes a ReLU's backward and the residual ends), left-alone types)
    "resnet18": ({"Conv2d": 20, "BatchNorm2d": 20, "ReLU": 9, "MaxPool2d": 1, "Linear": 1}, 36, {"AdaptiveAvgPool2d"}),
    "resnet50": ({"Conv2d": 53, "BatchNorm2d": 53, "ReLU": 17, "MaxPool2d": 1, "Linear": 1}, 101, {"AdaptiveAvgPool2d"}),
    "mobilenet_v2": ({"Conv2d": 52, "BatchNorm2d": 52, "ReLU6": 35, "Linear": 1}, 86, {"Dropout"}),
    "vgg11_bn": ({"Conv2d": 8, "BatchNorm2d": 8, "ReLU": 10, "MaxPool2d": 5, "Linear": 3}, 13, {"AdaptiveAvgPool2d", "Dropout"}),
}


@pytest.mark.parametrize("name", list(TORCHVISION))
def test_convert_torchvision_models(name):
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = getattr(tv.models, name)(weights=None)
    fk, report = ft.convert(model)
    counts, fused, left = TORCHVISION[name]
    assert report.counts() == counts, report
    assert len(report.fused) == fused and {t for _, t, _ in report.left_alone} == left, report
    assert "torch.fx traces" in report.analysis
    assert list(fk.state_dict()) == list(model.state_dict())
    fk.load_state_dict(model.state_dict())
    model.load_state_dict(fk.state_dict())
    convs = [m for m in fk.modules() if isinstance(m, ft.Conv2d)]
    assert sum(m._fk_bn is not None for m in convs) == counts["Conv2d"]  # every conv feeds a BN
    if name.startswith("resnet"):
        # the BN -> ReLU inside each block is called in forward(); fx shows it feeds only the ReLU
        blocks = [m for m in fk.modules() if type(m).__name__ in ("BasicBlock", "Bottleneck")]
        assert all(b.bn1._fk_relu is b.relu and b.bn2._fk_relu is (b.relu if hasattr(b, "bn3") else None) for b in blocks)
        assert all(getattr(b, "bn3", b.bn2)._fk_relu is None for b in blocks)  # the last BN feeds the residual add
        # fuse_residual (the default): each block's forward is rewritten so that it takes the residual: relu(bn(x) + identity) in one call
        assert all("forward" in b.__dict__ for b in blocks)
        assert type(fk.__dict__["forward"]).__name__ == "ReplayedForward" and report.route == "replayed"  # the default route
        ends = [names for names, what in report.fused if "residual add" in what]
        assert len(ends) == len(blocks), ends
        assert all(n[0].endswith(("bn2", "bn3")) and n[2].endswith("relu") for n in ends), ends
        plain, plain_report = ft.convert(model, fuse_residual=False, route="modules")
        assert not any("forward" in m.__dict__ for m in plain.modules()) and plain_report.route == "modules"
        assert len(plain_report.fused) == fused - len(blocks) and list(plain.state_dict()) == list(model.state_dict())
    print(report)


def test_converted_model_runs_on_cpu_as_torch():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = tv.models.resnet18(weights=None, num_classes=10)
    fk, _ = ft.convert(model)
    x = torch.randn(2, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ft.TorchFallbackWarning)
        for mode in (True, False):
            fk.train(mode), model.train(mode)
            assert torch.equal(fk(x), model(x))


def test_fx_tracer_keeps_fusekit_modules_as_leaves():
    import torch.fx

    fk, _ = ft.convert(small_cnn())
    graph = ft.FxTracer().trace(fk)
    assert sum(n.op == "call_module" for n in graph.nodes) == 14
    gm = torch.fx.symbolic_trace(copy.deepcopy(fk).eval())  # the default tracer records PyTorch's ops
    x = torch.randn(2, 3, 12, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ft.TorchFallbackWarning)
        assert torch.allclose(gm(x), fk.eval()(x))


def test_graphed_forward_captures_each_signature_after_its_warmup(monkeypatch):
    """The forward fusekit.torch.graphed puts on a model (the capture and replay faked, the GPU check
    waived): a signature's first ``warmup`` calls run the original forward, the next captures, later
    ones replay; the autocast dtype, shape and requires_grad each make another signature; past
    ``max_graphs`` a signature is warned about once and runs uncaptured, as one whose capture failed;
    eval-mode and no-grad calls run uncaptured; moving a parameter drops the graphs."""
    made, replays = [], []

    class Captured:
        def __init__(self, graphed, x, amp, train=True):
            if x.shape[0] == 7:
                raise CaptureError("fusekit: no plan yet for bias_grad(...)")
            if x.shape[0] == 6:
                raise RuntimeError("operation not permitted when stream is capturing")
            made.append((tuple(x.shape), x.requires_grad, amp))
            self.params, self.pending = tuple(graphed.model.parameters()), None

        def result(self, outs):
            return outs[0]

    class Replay:
        @staticmethod
        def apply(cap, x, *params):
            replays.append(tuple(x.shape))
            return (x * 2,)

    monkeypatch.setattr(ft.graphs, "Captured", Captured)
    monkeypatch.setattr(ft.graphs, "Replay", Replay)
    monkeypatch.setattr(ft.graphs.GraphedForward, "eligible",
                        lambda self, a, k: a[0] if self.model.training and torch.is_grad_enabled() and len(a) == 1 else None)
    model = ft.graphed(torch.nn.Linear(3, 3), warmup=2, max_graphs=3)
    x = torch.randn(4, 3)

    def ran_original(y, x):
        return torch.allclose(y, x @ model.weight.T + model.bias)

    assert ran_original(model(x), x) and ran_original(model(x), x) and not made
    assert torch.equal(model(x), x * 2) and made == [((4, 3), False, None)] and replays == [(4, 3)]
    assert torch.equal(model(x), x * 2) and len(made) == 1 and len(replays) == 2
    monkeypatch.setattr(ft.common, "amp_dtype", lambda: torch.float16)
    for _ in range(3):
        model(x)
    assert made[-1] == ((4, 3), False, torch.float16)
    monkeypatch.setattr(ft.common, "amp_dtype", lambda: None)
    xg = torch.randn(4, 3, requires_grad=True)
    for _ in range(3):
        model(xg)
    assert made[-1] == ((4, 3), True, None) and len(model.forward.graphs) == 3
    with pytest.warns(UserWarning, match=r"input torch.float32 \(5, 3\) \(autocast None\) runs uncaptured: max_graphs=3"):
        for _ in range(3):
            y = torch.randn(5, 3)
            assert ran_original(model(y), y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(5, 3))  # warned once
    del model.forward.graphs[next(iter(model.forward.graphs))]
    with pytest.warns(UserWarning, match=r"\(7, 3\) .* capturing failed 3 times \(fusekit: no plan yet"):
        for i in range(9):  # each attempt after `warmup` more uncaptured calls, three attempts
            y = torch.randn(7, 3)
            assert ran_original(model(y), y)
            assert any(k[0] == (7, 3) for k in model.forward.refused) == (i == 8)
    for _ in range(2):
        model(torch.randn(6, 3))
    with pytest.raises(CaptureError, match=r"capturing the training step of input torch.float32 \(6, 3\) .*RuntimeError: operation not"):
        model(torch.randn(6, 3))
    n = len(replays)
    model.eval()
    assert ran_original(model(x), x)
    model.train()
    with torch.no_grad():
        assert ran_original(model(x), x)
    assert len(replays) == n
    model.weight.data = model.weight.data.clone()  # as .to() / .half() do
    assert ran_original(model(x), x)  # the signature's warm-up again
    assert not model.forward.graphs


def test_graphed_checks_its_arguments_before_capturing(monkeypatch):
    """fusekit.torch.graphed names the bad argument (model, autocast, warmup, max_graphs, sample, a
    parameter on another device, hooks on any submodule, a model graphed twice) before anything is
    captured."""
    called = []
    monkeypatch.setattr(ft.graphs, "Captured", lambda *a, **k: called.append(a))
    model = torch.nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 8, 8)
    cases = [
        ((object(), x), {}, "'model': expected a torch.nn.Module"),
        ((model, x), {"autocast": torch.float32}, "'autocast': expected None, torch.float16 or torch.bfloat16"),
        ((model, x), {"warmup": 0}, "'warmup': expected an int >= 1"),
        ((model,), {"max_graphs": 0}, "'max_graphs': expected an int >= 1"),
        ((model, x.numpy()), {}, "'sample': expected a CUDA tensor, got ndarray"),
        ((model, x), {}, "'sample': expected a CUDA tensor, got one on cpu"),
    ]
    for args, kwargs, msg in cases:
        with pytest.raises(OperandError, match=re.escape(msg)):
            ft.graphed(*args, **kwargs)
    hooked = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    hooked[1].register_forward_hook(lambda *a: None)
    with pytest.raises(OperandError, match=r"'model': has hooks registered on it \(1\)"):
        ft.graphed(hooked)
    ft.graphed(model)
    with pytest.raises(OperandError, match="'model': is graphed already"):
        ft.graphed(model)
    assert not called


def test_a_graphed_model_copies_and_pickles_without_its_graphs(monkeypatch):
    """copy.deepcopy (an EMA of the model) and pickle give a graphed model of their own: its forward
    runs the copy's weights, holds no graphs (those of the original stay), and captures afresh."""
    import copy
    import pickle

    monkeypatch.setattr(ft.graphs.GraphedForward, "eligible", lambda self, a, k: None)  # CPU: every call uncaptured
    model = ft.graphed(torch.nn.Linear(3, 3), warmup=2, max_graphs=2)
    model.forward.graphs[("a signature",)] = object()  # stands for a capture
    x = torch.randn(4, 3)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        fwd = twin.forward
        assert isinstance(fwd, ft.graphs.GraphedForward) and fwd.model is twin and not fwd.graphs
        assert (fwd.warmup, fwd.max_graphs) == (2, 2)
        with torch.no_grad():
            twin.weight.mul_(2)
        assert torch.allclose(twin(x), x @ twin.weight.T + twin.bias)
        assert not torch.allclose(twin(x), model(x)), "the copy ran the original's weights"
        assert fwd._state() and all(t.data_ptr() != o.data_ptr() for t, o in zip(fwd.tensors, model.parameters()))
    assert ("a signature",) in model.forward.graphs


def test_graphed_eval_graphs_capture_eval_forwards_without_autograd(monkeypatch):
    """With eval_graphs=True (the default), eval-mode calls without autograd (no_grad, inference_mode) are captured per
    signature after their warm-up, forward only, and replayed (the caller gets its own output copy);
    eval with autograd and train mode without it run uncaptured; the training step keeps its own
    signature; with eval_graphs=False eval calls are never captured; copies keep the option."""
    import copy

    made = []

    class Captured:
        def __init__(self, graphed, x, amp, train=True):
            made.append((tuple(x.shape), train))
            self.params, self.pending, self.p = tuple(graphed.model.parameters()), None, graphed.model.p
            self.out = torch.empty_like(x)

        def replay_eval(self, x):  # a replay reads the weights as they are then
            self.out.copy_(self.p.detach() * x)
            return self.out.clone()

        def result(self, outs):
            return outs[0]

    class Replay:
        @staticmethod
        def apply(cap, x, *params):
            return (x * 100,)

    monkeypatch.setattr(ft.graphs, "Captured", Captured)
    monkeypatch.setattr(ft.graphs, "Replay", Replay)
    monkeypatch.setattr(ft.graphs.GraphedForward, "eligible", lambda self, a, k: a[0] if self.wants_graph() and len(a) == 1 else None)
    x = torch.randn(4, 3)
    plain = ft.graphed(_ScaleNet(), warmup=2, eval_graphs=False).eval()
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(plain(x), 3 * x)
    assert not made and not plain.forward.eval_graphs and not copy.deepcopy(plain).forward.eval_graphs
    model = ft.graphed(_ScaleNet(), warmup=2).eval()  # eval_graphs=True is the default
    with torch.no_grad():
        assert torch.equal(model(x), 3 * x) and torch.equal(model(x), 3 * x) and not made  # the warm-up, uncaptured
        y = model(x)
        assert made == [((4, 3), False)] and torch.equal(y, 3 * x)
        model.p.mul_(2)  # an in-place weight change: the next replay reads it
        y2 = model(x)
        assert torch.equal(y2, 6 * x) and torch.equal(y, 3 * x), "the caller's output must be its own copy"
    with torch.inference_mode():
        assert torch.equal(model(x), 6 * x) and len(made) == 1  # the same signature, replayed
    assert torch.equal(model(x), 6 * x) and len(made) == 1  # eval with autograd: uncaptured
    with torch.no_grad():
        model.train()
        model(x)
        model(x)
        model(x)
    assert len(made) == 1  # train mode without autograd: uncaptured
    outs = [model(x) for _ in range(3)]  # training with autograd: two warm-up calls, then its own capture
    assert torch.equal(outs[0], 6 * x) and torch.equal(outs[2], 100 * x)
    assert made[-1] == ((4, 3), True) and len(model.forward.graphs) == 2
    assert copy.deepcopy(model).forward.eval_graphs
    with pytest.raises(OperandError, match="'eval_graphs': expected True or False"):
        ft.graphed(torch.nn.Linear(2, 2), eval_graphs=1)


class _ScaleNet(torch.nn.Module):
    """y = p * x, with p one parameter (the model the fake capture below stands for)."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.tensor(3.0))

    def forward(self, x):
        return self.p * x


class _FakeCapture:
    """Captured's buffers over CPU 'graphs': the forward replay writes y = p * x and keeps x as the
    activation its backward reads (as a graph keeps saved tensors in its pool); the backward replay
    writes dL/dp = sum(dy * x) and dL/dx = dy * p."""

    def __init__(self, graphed, x, amp, train=True):
        p = graphed.model.p
        self.params, self.kind, self.diff = (p,), None, (True,)
        self.x = x.detach().clone().requires_grad_(x.requires_grad)
        self.outs, self.grad_outs = (torch.empty_like(x),), (torch.empty_like(x),)
        self.saved = torch.empty_like(x)
        self.grads = ((torch.empty_like(x),) if x.requires_grad else ()) + (torch.empty(()),)
        self.handed, self.pending = (), None

        class Graph:
            def __init__(self, fn):
                self.replay = fn

        def fwd():
            self.saved.copy_(self.x)
            self.outs[0].copy_(p.detach() * self.x.detach())

        def bwd():
            if x.requires_grad:
                self.grads[0].copy_(self.grad_outs[0] * p.detach())
            self.grads[-1].copy_((self.grad_outs[0] * self.saved).sum())

        self.fwd, self.bwd = Graph(fwd), Graph(bwd)

    def result(self, outs):
        return outs[0]


def test_graphed_replays_give_autograd_the_uncaptured_gradients(monkeypatch):
    """Replay (the autograd Function over a capture) run on a fake capture whose 'graphs' compute on
    the CPU: gradients accumulate into .grad over micro-batches without aliasing the capture's
    buffers, outputs keep their values after the next call, and two forwards before one backward
    (the second would overwrite the activations the first's backward reads) give the uncaptured
    gradients: the second call runs uncaptured."""
    monkeypatch.setattr(ft.graphs, "Captured", _FakeCapture)
    monkeypatch.setattr(ft.graphs.GraphedForward, "eligible",
                        lambda self, a, k: a[0] if self.model.training and torch.is_grad_enabled() and len(a) == 1 else None)
    model, ref = ft.graphed(_ScaleNet(), warmup=1), _ScaleNet()
    xs = [torch.randn(5) for _ in range(6)]
    for m in (model, ref):  # the warm-up call
        m(xs[0]).sum().backward()
        m.zero_grad(set_to_none=True)
    assert not model.forward.graphs
    for m in (model, ref):  # two micro-batches into one .grad (the first call captures)
        y1 = m(xs[1])
        kept = y1.detach().clone()
        (y1 * xs[2]).sum().backward()
        (m(xs[3]) * xs[4]).sum().backward()
        assert torch.equal(y1, kept), "an earlier output changed after a later call"
    cap = next(iter(model.forward.graphs.values()))
    assert torch.allclose(model.p.grad, ref.p.grad) and model.p.grad.data_ptr() != cap.grads[-1].data_ptr()
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    calls = []
    original = model.forward.original
    model.forward.original = lambda x: calls.append(1) or original(x)
    for m in (model, ref):  # two forwards, then one backward
        ((m(xs[4]) * xs[1]).sum() + (m(xs[5]) * xs[2]).sum()).backward()
    assert calls == [1], "the second forward replayed over the activations the first one's backward reads"
    assert torch.allclose(model.p.grad, ref.p.grad), f"{float(model.p.grad)} against {float(ref.p.grad)}"
    assert cap.pending is None
    model.zero_grad(set_to_none=True)
    model(xs[1])  # a replay whose output is dropped unused: its node dies, the next call replays
    model(xs[2]).sum().backward()
    assert calls == [1] and torch.allclose(model.p.grad, xs[2].sum())


# ----------------------------------------------------------------------------------------------
# Residual block ends: relu(bn(x) + r) rewritten into one BatchNorm2d call
# ----------------------------------------------------------------------------------------------
class _Block(torch.nn.Module):
    """conv -> BN, plus the input, then ReLU: as a ResNet block ends (``how``: which add and ReLU)."""

    def __init__(self, how="module", c=4):
        super().__init__()
        self.how = how
        self.conv, self.bn, self.relu = torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c), torch.nn.ReLU()

    def forward(self, x):
        out = self.bn(self.conv(x))
        if self.how == "module":
            out += x
            return self.relu(out)
        if self.how == "functional":
            return F.relu(x + out)
        if self.how == "mode":  # another graph in eval: not rewritten
            return self.relu(out + x) if self.training else self.relu(out) + x
        if self.how == "reused":  # the BN output used twice: not rewritten
            return self.relu(out + x) + out
        raise AssertionError(self.how)


@pytest.mark.parametrize("how, fused", [("module", True), ("functional", True), ("mode", False), ("reused", False)])
def test_residual_end_rewritten_into_one_bn_call(fake, how, fused):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(_Block(how), _Block(how)).double()
    _randomize_bn(ref)
    assert not any("forward" in b.__dict__ for b in ft.convert(ref, fuse_residual=False)[0])
    fk, report = ft.convert(ref)  # on by default
    assert [("forward" in b.__dict__) for b in fk] == [fused, fused]
    assert sum("residual add" in what for _, what in report.fused) == (2 if fused else 0), report
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    for mode in (True, False):
        fk.train(mode), ref.train(mode)
        fake.clear()
        compare(fk, ref, x, tol=1e-6)
        if fused:
            assert fake.count("batchnorm_add_relu" if mode else "add_relu") == 2, fake
            assert fake.count("batchnorm_add_relu_backward") == (2 if mode else 0), fake
        else:
            assert "batchnorm_add_relu" not in fake and "add_relu" not in fake
    # inference (eval, no autograd): each block end is one conv + folded BN + add + ReLU graph
    for channels_last in (False, True):
        xi = x.contiguous(memory_format=torch.channels_last) if channels_last else x
        fake.clear()
        with torch.no_grad():
            got, want = fk(xi), ref(xi)
        assert rel(got, want) < 1e-6
        assert fake == (["conv_bias_add_relu"] * 2 if fused else ["conv_bias", "relu"] * 2), fake


def test_residual_end_off_the_graphs_keeps_the_eval_fold(fake):
    """A residual cuDNN cannot take (here integers) after a conv that folded the BN in eval: the BN
    passes the folded output on and the add + ReLU run as written, the BN is not applied twice."""
    torch.manual_seed(0)
    ref = _Block().double().eval()
    _randomize_bn(ref)
    fk, _ = ft.convert(ref)
    x, r = torch.randn(2, 4, 6, 6, dtype=torch.float64), torch.randint(-2, 3, (2, 4, 6, 6))
    with torch.no_grad():
        got = fk.bn(fk.conv(x, r), r)
        want = torch.relu(ref.bn(ref.conv(x)) + r)
    assert rel(got, want) < 1e-6 and "conv_bias_add_relu" not in fake


def test_residual_end_falls_back_where_the_residual_broadcasts(fake):
    """A residual that broadcasts (here one value per channel) runs as written: bn, then PyTorch's add and ReLU."""

    class Bcast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.relu = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU()
            self.r = torch.nn.Parameter(torch.randn(1, 4, 1, 1))

        def forward(self, x):
            return self.relu(self.bn(self.conv(x)) + self.r)

    torch.manual_seed(0)
    ref = Bcast().double()
    _randomize_bn(ref)
    fk, report = ft.convert(ref)
    assert "forward" in fk.__dict__  # rewritten: whether r broadcasts shows only at run time
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    for mode in (True, False):
        fk.train(mode), ref.train(mode)
        fake.clear()
        compare(fk, ref, x, tol=1e-6)
        assert not any("add_relu" in c for c in fake), fake
        with torch.no_grad():
            assert rel(fk(x), ref(x)) < 1e-6


def test_residual_rewrite_survives_copies_and_pickles(fake):
    import pickle

    torch.manual_seed(0)
    ref = torch.nn.Sequential(_Block(), _Block()).double()
    _randomize_bn(ref)
    fk, _ = ft.convert(ref)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    want = fk(x)
    dup = copy.deepcopy(fk)
    assert dup[0].forward.__self__ is dup[0]  # bound to the copy, not to the original
    fake.clear()
    assert torch.equal(dup(x), want) and fake.count("batchnorm_add_relu") == 2
    back = pickle.loads(pickle.dumps(fk))  # the rewrite may not come back, the model's function does
    assert torch.allclose(back(x), want, rtol=1e-12, atol=1e-12)


def test_batchnorm_residual_needs_no_activation_of_its_own(fake):
    bn = ft.BatchNorm2d(4, activation="relu").double()
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64)
    with pytest.raises(OperandError, match="residual"):
        bn(x, x)
    plain = ft.BatchNorm2d(4).double()
    ref = torch.nn.BatchNorm2d(4).double()
    assert torch.allclose(plain(x, x), torch.relu(ref(x) + x), atol=1e-6)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_fuse_residual_changes_nothing_but_the_block_ends(fake, name):
    """convert (fuse_residual on, the default) against convert(fuse_residual=False) of the same model (fake ops: the fused
    end computes bn(x) + r before rounding, as the graph does; in float64 both round alike): identical
    outputs and input gradients in training and eval; only ResNeXt's Bottlenecks have ends to rewrite."""
    ref = _architecture(name)
    plain, _ = ft.convert(copy.deepcopy(ref), fuse_residual=False)
    fused, report = ft.convert(copy.deepcopy(ref))
    ends = sum("residual add" in what for _, what in report.fused)
    assert ends == (16 if name == "resnext50_32x4d" else 0), report
    x = torch.randn(2, 3, ARCHITECTURES[name], ARCHITECTURES[name], dtype=torch.float64)
    for mode in (True, False):
        outs = []
        for m in (plain, fused):
            m.train(mode)
            xi = x.clone().requires_grad_(True)
            y = m(xi)
            y.backward(torch.ones_like(y))
            outs.append((y.detach(), xi.grad))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), (name, mode)
    fake.clear()
    with torch.no_grad():  # inference: the block ends' convs add the residual in their graph
        assert torch.equal(plain(x), fused(x)), name
    assert fake.count("conv_bias_add_relu") == ends, fake
