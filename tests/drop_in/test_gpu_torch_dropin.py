"""GPU: fusekit.torch as a drop-in for torch.nn.

- Each new argument (bias=False, groups, "same" / "valid" padding, non-zero padding modes, max-pool ceil_mode, transposed and Linear variants)
  forward and backward against torch.nn in float64 on the same rounded inputs and weights.
- BatchNorm2d with float16 / bfloat16 parameters and buffers, empty batches, non-dense inputs.
- Autocast (float16, bfloat16) with float32 parameters, and GradScaler training steps.
- convert() on torchvision ResNet-18/50, MobileNetV2, VGG-11-BN: forward in training and eval mode
  against the unconverted model, within a few times PyTorch's own error against float64; eleven more
  architectures (ResNeXt, RegNet, DenseNet, ShuffleNet, GoogLeNet, Inception, EfficientNet, MnasNet,
  MobileNetV3, ConvNeXt): training forward + backward and eval forward the same way.
- The ResNet-18 training example (fp16 AMP, channels-last, SGD momentum) tracks the unconverted model.
- A whole training step (forward, backward, optimizer step) captured in a CUDA graph replays with the
  uncaptured step's loss.
"""

from __future__ import annotations

import copy
import math
import re
import sys
import warnings
from pathlib import Path

import pytest
from helpers import as_module, rel  # noqa: E402
from fusekit.errors import forget_warnings  # noqa: E402
from fusekit.dispatch import record

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
F = torch.nn.functional

TOL = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 5e-3}  # as tests/test_gpu_backward.py (float32: TF32)
BN_TOL = {"float16": 4e-3, "bfloat16": 2.5e-2, "float32": 1e-4}  # as tests/test_gpu_norm.py
DTYPES = ["float16", "bfloat16", "float32"]


def ft():
    import fusekit.torch

    return fusekit.torch


def cl(t):
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


def _pair(mod_fk, mod_ref, dtype, channels_last=True):
    """(fusekit module in dtype on the GPU, float64 torch.nn module with the same rounded weights)."""
    mod_ref.load_state_dict(mod_fk.state_dict())
    fk = mod_fk.to("cuda", getattr(torch, dtype))
    if channels_last:
        fk = fk.to(memory_format=torch.channels_last)
    ref = mod_ref.to("cuda")
    with torch.no_grad():
        for pr, pf in zip(ref.parameters(), fk.parameters()):
            pr.copy_(pf.double())
    return fk, ref.double()


def _check_module(fk, ref, x, dtype, relu=False, tol_scale=1.0):
    """Forward and backward of fusekit module ``fk`` (input x in dtype) against float64 ``ref`` on the
    same rounded input. ``relu``: ref is the pre-activation; its backward goes through fusekit's own
    ReLU mask (a float64 forward would flip elements within the forward's rounding of zero)."""
    tol = TOL[dtype] * tol_scale
    xf = x.detach().clone().requires_grad_(True)
    xr = x.detach().double().requires_grad_(True)
    y = fk(xf)
    pre = ref(xr)
    yr = pre.relu() if relu else pre
    assert y.shape == yr.shape and y.dtype == x.dtype
    assert rel(y, yr) < tol, f"forward {rel(y, yr):.2e}"
    dy = torch.randn_like(y)
    y.backward(dy)
    (pre * (y.detach() > 0) if relu else pre).backward(dy.double())
    assert rel(xf.grad, xr.grad) < 2 * tol, f"dx {rel(xf.grad, xr.grad):.2e}"
    for (name, pf), (_, pr) in zip(fk.named_parameters(), ref.named_parameters()):
        assert pf.grad is not None and pf.grad.dtype == pf.dtype, name
        assert rel(pf.grad, pr.grad) < 2 * tol, f"d{name} {rel(pf.grad, pr.grad):.2e}"


# ----------------------------------------------------------------------------------------------
# Each new argument against torch.nn in float64
# ----------------------------------------------------------------------------------------------
CONV_CASES = {
    "nobias": {"bias": False},
    "nobias_relu": {"bias": False, "activation": "relu"},
    "groups4": {"groups": 4},
    "depthwise_s2": {"groups": 32, "stride": 2, "bias": False},
    "same3": {"padding": "same"},
    "same4_asym": {"padding": "same", "kernel_size": 4, "bias": False},
    "same_dil2": {"padding": "same", "dilation": 2, "activation": "relu"},
    "valid_s2": {"padding": "valid", "stride": 2},
    "reflect_relu": {"padding_mode": "reflect", "activation": "relu"},
    "replicate_s2": {"padding_mode": "replicate", "padding": (2, 1), "stride": 2, "bias": False},
    "circular_same4": {"padding_mode": "circular", "padding": "same", "kernel_size": 4},
}


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv2d_arguments_match_torch(case, dtype, layout):
    kw = {"kernel_size": 3, "padding": 1, **CONV_CASES[case]}
    act = kw.pop("activation", None)
    torch.manual_seed(0)
    fk, ref = _pair(ft().Conv2d(32, 64, activation=act, **kw), torch.nn.Conv2d(32, 64, **kw), dtype, layout == "NHWC")
    x = torch.randn(2, 32, 13, 14, device="cuda").to(getattr(torch, dtype))
    _check_module(fk, ref, cl(x) if layout == "NHWC" else x, dtype, relu=act == "relu")


EPILOGUES = {"silu": F.silu, "gelu": F.gelu, "hardswish": F.hardswish, "sigmoid": torch.sigmoid, ("leaky_relu", 0.2): lambda t: F.leaky_relu(t, 0.2)}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("act", list(EPILOGUES), ids=str)
def test_conv2d_activation_epilogues_match_torch(act, dtype):
    """Conv2d(activation=silu, ...): without autograd one fused conv + bias + activation graph, with
    autograd the conv graph then PyTorch's activation; both against torch.nn.Conv2d + the activation in
    float64, gradients too."""
    torch.manual_seed(3)
    fk, ref = _pair(ft().Conv2d(32, 48, 3, padding=1, activation=act), torch.nn.Conv2d(32, 48, 3, padding=1), dtype)
    x = cl(torch.randn(4, 32, 14, 14, device="cuda").to(getattr(torch, dtype)))
    with torch.no_grad():
        assert rel(fk(x), EPILOGUES[act](ref(x.double()))) < TOL[dtype]
    _check_module(fk, torch.nn.Sequential(ref, as_module(EPILOGUES[act])), x, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("act", ["silu", "hardswish", ("leaky_relu", 0.2), "relu6"], ids=str)
@pytest.mark.parametrize("layer", ["Linear", "ConvTranspose2d", "BatchNorm2d"])
def test_layer_activation_epilogues_match_torch(layer, act, dtype):
    """Linear, ConvTranspose2d and BatchNorm2d (eval) with an activation their ReLU graphs lack:
    without autograd one graph with the activation fused, with autograd the layer's graph then
    PyTorch's activation; against the torch layer + activation in float64, gradients too."""
    torch.manual_seed(4)
    f = F.relu6 if act == "relu6" else EPILOGUES[act]
    make = {"Linear": lambda m: m(64, 48), "ConvTranspose2d": lambda m: m(32, 24, 3, stride=2, padding=1, output_padding=1),
            "BatchNorm2d": lambda m: m(32)}[layer]
    fk, ref = _pair(make(lambda *a, **k: getattr(ft(), layer)(*a, activation=act, **k)), make(getattr(torch.nn, layer)), dtype)
    if layer == "BatchNorm2d":
        with torch.no_grad():
            for m in (fk, ref):
                m.running_mean.copy_(torch.linspace(-1, 1, 32)), m.running_var.copy_(torch.linspace(0.5, 2, 32))
        fk.eval(), ref.eval()
    x = cl(torch.randn(*((16, 64) if layer == "Linear" else (4, 32, 14, 14)), device="cuda").to(getattr(torch, dtype)))
    with torch.no_grad():
        assert rel(fk(x), f(ref(x.double()))) < TOL[dtype]
    _check_module(fk, torch.nn.Sequential(ref, as_module(f)), x, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias, groups, act", [(False, 1, None), (True, 2, None), (False, 4, "relu")])
def test_conv_transpose2d_arguments_match_torch(bias, groups, act, dtype):
    kw = {"kernel_size": 3, "stride": 2, "padding": 1, "output_padding": 1, "bias": bias, "groups": groups}
    torch.manual_seed(0)
    fk, ref = _pair(ft().ConvTranspose2d(16, 32, activation=act, **kw), torch.nn.ConvTranspose2d(16, 32, **kw), dtype)
    _check_module(fk, ref, cl(torch.randn(2, 16, 9, 9, device="cuda").to(getattr(torch, dtype))), dtype, relu=act == "relu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, bias, act", [((16, 64), False, None), ((4, 5, 64), True, "relu"), ((64,), False, "relu")])
def test_linear_arguments_match_torch(shape, bias, act, dtype):
    torch.manual_seed(0)
    fk, ref = _pair(ft().Linear(64, 48, bias=bias, activation=act), torch.nn.Linear(64, 48, bias=bias), dtype)
    _check_module(fk, ref, torch.randn(shape, device="cuda").to(getattr(torch, dtype)), dtype, relu=act == "relu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("args", [(2, 2), (3, 2, 1), ((3, 2), (2, 3))])
@pytest.mark.parametrize("kind", ["max", "avg", "avg_nopad"])
def test_pool2d_ceil_mode_matches_torch(kind, args, dtype):
    """ceil_mode=True on 12x13 images (each geometry adds a window in at least one dim), against
    float64 PyTorch on the same rounded input: max pooling's output exactly, averages (PyTorch's
    divisors for the clipped windows) and every dx within rounding."""
    torch.manual_seed(0)
    kw = {"ceil_mode": True} if kind != "avg_nopad" else {"ceil_mode": True, "count_include_pad": False}
    fk, ref = (ft().MaxPool2d, torch.nn.MaxPool2d) if kind == "max" else (ft().AvgPool2d, torch.nn.AvgPool2d)
    x = cl(torch.randn(2, 16, 12, 13, device="cuda")).to(getattr(torch, dtype))
    xf = x.clone().requires_grad_(True)
    # the float64 reference NCHW: PyTorch's CUDA channels-last avg_pool2d backward drops the padding
    # offset (pytorch/pytorch#188344; see test_gpu_pool.autograd)
    xr = x.double().contiguous().requires_grad_(True)
    y, yr = fk(*args, **kw)(xf), ref(*args, **kw)(xr)
    assert y.shape == yr.shape != torch.nn.functional.max_pool2d(x, *args).shape and y.dtype == x.dtype
    assert rel(y, yr) < TOL[dtype]
    if kind == "max":
        assert torch.equal(y, ref(*args, **kw)(x))
    dy = torch.randn_like(y)
    y.backward(dy)
    yr.backward(dy.double())
    assert rel(xf.grad, xr.grad) < 2 * TOL[dtype], f"dx {rel(xf.grad, xr.grad):.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_pool_module_arguments_match_torch(dtype):
    """MaxPool2d(dilation, return_indices) and AvgPool2d(divisor_override) modules on CUDA tensors:
    outputs and indices as torch.nn's (F.max_unpool2d takes the indices), input gradients within rounding."""
    dt = getattr(torch, dtype)
    x = cl(torch.randn(4, 32, 15, 13, device="cuda", dtype=dt))
    for fk, ref in ((ft().MaxPool2d(3, 2, 1, dilation=2, return_indices=True, ceil_mode=True),
                     torch.nn.MaxPool2d(3, 2, 1, dilation=2, return_indices=True, ceil_mode=True)),
                    (ft().MaxPool2d(2, return_indices=True), torch.nn.MaxPool2d(2, return_indices=True))):
        xf, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        (y, i), (yr, ir) = fk(xf), ref(xr)
        assert torch.equal(y, yr) and i.dtype == torch.int64 and torch.equal(i, ir)
        with torch.no_grad():
            assert torch.equal(fk(x)[1], ir)  # inference computes the indices too when asked
        dy = torch.randn_like(y)
        y.backward(dy)
        yr.backward(dy)
        assert rel(xf.grad, xr.grad) < TOL[dtype]
        if ref.dilation == 1:
            size = x.shape[2:]  # 15x13: the default 14x12 would not hold the last row and column's indices
            assert torch.equal(F.max_unpool2d(y, i, 2, output_size=size), F.max_unpool2d(yr, ir, 2, output_size=size))
    fk, ref = ft().AvgPool2d(3, 2, 1, divisor_override=4), torch.nn.AvgPool2d(3, 2, 1, divisor_override=4)
    # an NCHW float64 reference: PyTorch's CUDA channels-last avg_pool2d backward drops the padding offset (tests/torchref.py)
    xf, xr = x.clone().requires_grad_(True), x.double().contiguous().requires_grad_(True)
    y, yr = fk(xf), ref(xr)
    assert rel(y, yr) < TOL[dtype]
    dy = torch.randn_like(y)
    y.backward(dy)
    yr.backward(dy.double())
    assert rel(xf.grad, xr.grad) < TOL[dtype]


def test_conv_transpose2d_output_size():
    torch.manual_seed(0)
    fk, ref = _pair(ft().ConvTranspose2d(16, 8, 3, stride=2, padding=1), torch.nn.ConvTranspose2d(16, 8, 3, stride=2, padding=1), "float32")
    x = cl(torch.randn(2, 16, 7, 7, device="cuda"))
    y = fk(x, output_size=(14, 14))
    assert y.shape == (2, 8, 14, 14) and rel(y, ref(x.double(), output_size=(14, 14))) < TOL["float32"]


# ----------------------------------------------------------------------------------------------
# Half batch norm, empty batches, non-dense inputs
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_batchnorm_half_parameters_and_buffers(dtype, relu):
    """model.half() / .bfloat16(): BN trains and evaluates as PyTorch's (statistics in float32, running
    stats written back in their own dtype), forward and backward, against float64."""
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    fk = ft().BatchNorm2d(64, momentum=0.2, activation="relu" if relu else None)
    with torch.no_grad():
        fk.weight.uniform_(0.5, 1.5)
        fk.bias.uniform_(-0.5, 0.5)
    ref = torch.nn.BatchNorm2d(64, momentum=0.2)
    ref.load_state_dict(fk.state_dict())
    fk = fk.to("cuda", dt)
    ref = ref.to("cuda").double()
    with torch.no_grad():
        ref.weight.copy_(fk.weight.double())
        ref.bias.copy_(fk.bias.double())
    for _ in range(3):
        x = cl(torch.randn(8, 64, 10, 10, device="cuda") * 2 + 0.5).to(dt)
        _check_module(fk, torch.nn.Sequential(ref), x, dtype, relu=relu, tol_scale=BN_TOL[dtype] / TOL[dtype])
        fk.zero_grad(), ref.zero_grad()
    assert fk.running_mean.dtype == dt and fk.running_var.dtype == dt and int(fk.num_batches_tracked) == 3
    stat_tol = {"float16": 2e-3, "bfloat16": 1.6e-2}[dtype]  # one rounding to the buffers' dtype per update
    assert rel(fk.running_mean, ref.running_mean) < stat_tol and rel(fk.running_var, ref.running_var) < stat_tol
    fk.eval(), ref.eval()
    with torch.no_grad():
        ref.running_mean.copy_(fk.running_mean.double())
        ref.running_var.copy_(fk.running_var.double())
    x = cl(torch.randn(8, 64, 10, 10, device="cuda")).to(dt)
    _check_module(fk, torch.nn.Sequential(ref), x, dtype, relu=relu, tol_scale=BN_TOL[dtype] / TOL[dtype])


def test_model_half_trains_like_torch_half():
    """A converted model made .half() (parameters and BN buffers float16) trains a few steps like the same
    torch.nn model made .half()."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1, bias=False), torch.nn.BatchNorm2d(32), torch.nn.ReLU(inplace=True),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), torch.nn.BatchNorm2d(64), torch.nn.ReLU(inplace=True),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    )
    fk, _ = ft().convert(base)
    models = [m.cuda().half().to(memory_format=torch.channels_last) for m in (fk, copy.deepcopy(base))]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(5):
        x = cl(torch.randn(16, 3, 16, 16, device="cuda", generator=gen)).half()
        t = torch.randint(0, 10, (16,), device="cuda", generator=gen)
        losses = []
        for m, o in zip(models, opts):
            loss = F.cross_entropy(m(x).float(), t)
            o.zero_grad()
            loss.backward()
            o.step()
            losses.append(loss.item())
        assert all(math.isfinite(v) for v in losses) and abs(losses[0] - losses[1]) / losses[1] < 1e-2, losses
    assert models[0][1].running_var.dtype == torch.float16
    assert rel(models[0][1].running_var, models[1][1].running_var) < 1e-2


def test_empty_batch_returns_empty_outputs_and_backward_works():
    ftm = ft()
    layers = [
        (ftm.Conv2d(8, 16, 3, padding=1, bias=False), torch.nn.Conv2d(8, 16, 3, padding=1, bias=False), (0, 8, 10, 10)),
        (ftm.ConvTranspose2d(8, 4, 2, stride=2), torch.nn.ConvTranspose2d(8, 4, 2, stride=2), (0, 8, 5, 5)),
        (ftm.Linear(8, 3), torch.nn.Linear(8, 3), (0, 8)),
        (ftm.BatchNorm2d(8), torch.nn.BatchNorm2d(8), (0, 8, 4, 4)),
        (ftm.ReLU(), torch.nn.ReLU(), (0, 8, 4, 4)),
        (ftm.MaxPool2d(2), torch.nn.MaxPool2d(2), (0, 8, 4, 4)),
        (ftm.AvgPool2d(2), torch.nn.AvgPool2d(2), (0, 8, 4, 4)),
        (ftm.Softmax(1), torch.nn.Softmax(1), (0, 10)),
    ]
    for fk, ref, shape in layers:
        fk, ref = fk.cuda(), ref.cuda()
        if list(ref.parameters()):
            ref.load_state_dict(fk.state_dict())
        x = torch.randn(shape, device="cuda", requires_grad=True)
        y, yr = fk(x), ref(x)
        assert y.shape == yr.shape and y.dtype == yr.dtype and y.numel() == 0, type(fk).__name__
        y.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        for p in fk.parameters():
            assert p.grad is None or float(p.grad.abs().sum()) == 0


def test_non_dense_inputs_run_on_dense_copies(monkeypatch):
    from fusekit.errors import LayoutWarning

    forget_warnings()
    torch.manual_seed(0)
    fk, ref = _pair(ft().Conv2d(16, 32, 3, padding=1), torch.nn.Conv2d(16, 32, 3, padding=1), "float16")
    big = cl(torch.randn(4, 16, 20, 24, device="cuda")).half()
    x = big[1:3, :, 2:14:2, 3:19]  # strided: neither dense NCHW nor dense channels-last
    with pytest.warns(LayoutWarning, match="Conv2d"):
        y = fk(x)
    assert rel(y, ref(x.double())) < TOL["float16"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayoutWarning)  # warned once
        y2 = fk(x)
    assert torch.equal(y, y2)
    bn = ft().BatchNorm2d(16).cuda()
    with pytest.warns(LayoutWarning, match="BatchNorm2d"):
        z = bn(x)
    assert rel(z, F.batch_norm(x.double(), None, None, training=True)) < BN_TOL["float16"]


# ----------------------------------------------------------------------------------------------
# Autocast and GradScaler
# ----------------------------------------------------------------------------------------------
def _amp_net():
    return torch.nn.Sequential(
        torch.nn.Conv2d(16, 32, 3, padding=1, bias=False), torch.nn.BatchNorm2d(32), torch.nn.ReLU(inplace=True),
        torch.nn.ConvTranspose2d(32, 32, 2, stride=2), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(64, 10),
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_autocast_runs_in_the_autocast_dtype(dtype):
    """Under torch.autocast each layer's output dtype is torch.nn's, values within the autocast dtype's
    tolerance of float64, and float32 parameters get float32 gradients close to torch.nn's."""
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    base = _amp_net().cuda().to(memory_format=torch.channels_last)
    fk, _ = ft().convert(base)
    ref64 = copy.deepcopy(base).double()
    x = cl(torch.randn(4, 16, 16, 16, device="cuda"))
    dtypes = {}
    for tag, model in (("fusekit", fk), ("torch", base)):
        seen = []
        hooks = [m.register_forward_hook(lambda m, i, o, s=seen: s.append(o.dtype)) for m in model]
        with torch.autocast("cuda", dtype=dt):
            y = model(x)
        for h in hooks:
            h.remove()
        dtypes[tag] = seen
        (y.float() * torch.linspace(-1, 1, 10, device="cuda")).sum().backward()
    assert dtypes["fusekit"] == dtypes["torch"], dtypes
    assert dtypes["fusekit"][0] == dt and dtypes["fusekit"][-1] == dt
    y64 = ref64(x.double())
    (y64 * torch.linspace(-1, 1, 10, device="cuda").double()).sum().backward()
    with torch.autocast("cuda", dtype=dt), torch.no_grad():
        yf, yt = fk(x), base(x)
    e_fk, e_t = rel(yf, y64), rel(yt, y64)
    print(f"autocast {dtype}: output error fusekit {e_fk:.2e}, torch {e_t:.2e}")
    assert e_fk < max(3 * e_t, 2 * TOL[dtype])
    for (n, pf), (_, pt), (_, p64) in zip(fk.named_parameters(), base.named_parameters(), ref64.named_parameters()):
        assert pf.dtype == torch.float32 and pf.grad.dtype == torch.float32, n
        ef, et = rel(pf.grad, p64.grad), rel(pt.grad, p64.grad)
        assert ef < max(3 * et, 4 * TOL[dtype]), f"{n}: gradient error fusekit {ef:.2e}, torch {et:.2e}"


def test_gradscaler_steps_like_torch():
    torch.manual_seed(0)
    base = _amp_net().cuda().to(memory_format=torch.channels_last)
    fk, _ = ft().convert(base)
    models = [fk, base]
    opts = [torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9) for m in models]
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**12) for _ in models]
    gen = torch.Generator(device="cuda").manual_seed(3)
    for step in range(6):
        x = cl(torch.randn(8, 16, 16, 16, device="cuda", generator=gen))
        t = torch.randint(0, 10, (8,), device="cuda", generator=gen)
        losses = []
        for m, o, s in zip(models, opts, scalers):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(m(x), t)
            o.zero_grad()
            s.scale(loss).backward()
            s.step(o)
            s.update()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) / losses[1] < 2e-2, (step, losses)
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in fk.parameters())


# ----------------------------------------------------------------------------------------------
# convert on torchvision models
# ----------------------------------------------------------------------------------------------
FLOOR = {"fp32": 3e-3, "amp-fp16": 2e-2, "amp-bf16": 8e-2, "half": 2e-2}
MODELS = [(m, p) for m in ("resnet18", "resnet50", "mobilenet_v2", "vgg11_bn") for p in ("fp32", "amp-fp16")]
MODELS += [("resnet18", "amp-bf16"), ("resnet18", "half")]


def _torchvision(name, size=64):
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    extra = dict(aux_logits=False, init_weights=True) if name in ("googlenet", "inception_v3") else {}
    model = getattr(tv.models, name)(weights=None, num_classes=100, **extra)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout) or type(m).__name__ == "StochasticDepth":
            m.p = 0.0  # training-mode outputs comparable
    model = model.cuda().to(memory_format=torch.channels_last)
    with torch.no_grad():  # running statistics of real activations, so eval mode is a normalized network
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.momentum = None
        model.train()
        for _ in range(3):
            model(cl(torch.randn(8, 3, size, size, device="cuda")))
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.momentum = 0.1
                m.weight.uniform_(0.7, 1.3)
                m.bias.uniform_(-0.2, 0.2)
    return model


def _forward(model, x, precision):
    if precision.startswith("amp"):
        with torch.autocast("cuda", dtype=torch.float16 if precision == "amp-fp16" else torch.bfloat16):
            return model(x)
    return model(x.half() if precision == "half" else x)


def _training_step(models: dict, x, g, precision):
    """One training-mode forward + backward of each of ``models`` ({"fusekit", "torch", "float64"}: the
    last in float64, the others in ``precision``) on x, loss sum(y * g): per model, [("output", y),
    ("input gradient", dx)] followed by (name, gradient) for every parameter."""
    got = {}
    for key, m in models.items():
        m.train()
        xi = (x.double() if key == "float64" else x).detach().clone().requires_grad_(True)
        y = m(xi) if key == "float64" else _forward(m, xi, precision)
        (y.double() * g).sum().backward()
        got[key] = [("output", y.detach()), ("input gradient", xi.grad)] + [(n, p.grad) for n, p in m.named_parameters()]
    return got


@pytest.mark.heavy
@pytest.mark.parametrize("name, precision", MODELS + [("resnet50-residual", "amp-fp16"), ("resnet18-residual", "fp32")])
def test_converted_torchvision_model_matches_original(name, precision):
    """Converted vs original, both against a float64 copy: the converted model's output error (eval and
    training mode) within 3x the original's, or a floor for the precision; the same running stats
    after a training-mode forward; in eval every conv -> BN pair ran as one folded graph.
    "-residual": converted with fuse_residual."""
    name, residual = name.removesuffix("-residual"), name.endswith("-residual")
    base = _torchvision(name)
    fk, report = ft().convert(base, fuse_residual=residual)
    if precision == "half":
        base, fk = base.half(), fk.half()
    ref64 = copy.deepcopy(base).double()
    x = cl(torch.randn(4, 3, 64, 64, device="cuda"))
    passed, added = [], []  # per BN call: whether its input came from a conv that did its work (folded), and the residual's add + ReLU too

    def handed_on(m, i, s=passed):
        ids = ft().common.tagged(i[0], ft().common.DONE)
        s.append(ids is not None and ids[0] == id(m))
        added.append(len(i) == 2 and ft().common.tagged(i[0], ft().common.ADDED) == id(i[1]))

    for bn in (m for m in fk.modules() if isinstance(m, ft().BatchNorm2d)):
        bn.register_forward_pre_hook(handed_on)
    for mode in ("eval", "train"):
        for m in (fk, base, ref64):
            m.train(mode == "train")
        passed.clear(), added.clear()
        with torch.no_grad():
            y64 = ref64(x.double())
            yf, yt = _forward(fk, x, precision), _forward(base, x, precision)
        e_fk, e_t = rel(yf, y64), rel(yt, y64)
        print(f"{name} {precision} {mode}: output error vs float64: fusekit {e_fk:.2e}, torch {e_t:.2e}")
        assert yf.dtype == yt.dtype and yf.shape == yt.shape
        assert e_fk < max(3 * e_t, FLOOR[precision]), f"{mode}: fusekit {e_fk:.2e} vs torch {e_t:.2e}"
        if mode == "eval":  # every BN that follows a conv was folded into it (the BN passed its input on)
            folded = sum(what.startswith("training: conv") for _, what in report.fused)
            assert folded > 0 and sum(passed) == folded, (sum(passed), folded, len(passed))
            ends = sum("residual add" in what for _, what in report.fused)  # no autograd: conv + BN + add + ReLU in one graph
            assert sum(added) == ends and (ends > 0) == residual, (sum(added), ends)
            counts = (sum(passed), sum(added))
            passed.clear(), added.clear()
            with torch.inference_mode():  # the same graphs on inference tensors, with the folds held since the no_grad call
                yi = _forward(fk, x, precision)
            assert yi.is_inference() and (sum(passed), sum(added)) == counts
            assert rel(yi, yf) < 1e-3, rel(yi, yf)
    for (n, bf), (_, bt) in zip(fk.named_buffers(), base.named_buffers()):
        if bf.is_floating_point():
            assert bf.dtype == bt.dtype and rel(bf, bt) < max(FLOOR[precision], 1e-2), n


#: More architectures (what each adds: tests/test_cpu_torch_dropin.py ARCHITECTURES), input 64x64 (Inception v3: 80).
ARCHITECTURES = ["resnext50_32x4d", "regnet_x_400mf", "regnet_y_400mf", "densenet121", "shufflenet_v2_x0_5", "googlenet",
                 "inception_v3", "efficientnet_b0", "mnasnet0_5", "mobilenet_v3_small", "convnext_tiny"]


@pytest.mark.heavy
@pytest.mark.parametrize("precision", ["amp-fp16", "fp32"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_converted_architectures_train_and_eval_like_the_original(name, precision):
    """A training-mode forward + backward and an eval forward of the converted model vs the original,
    both against a float64 copy: output, input gradient and every parameter's gradient within 3x the
    original's error (or the precision's floor; for parameter gradients 5e-2, as above, or 3x the
    original's error on the whole model's gradient), and the fusekit gradient as a whole within 3x too."""
    size = 80 if name == "inception_v3" else 64
    base = _torchvision(name, size)
    fk, report = ft().convert(base)
    ref64 = copy.deepcopy(base).double()
    x = cl(torch.randn(4, 3, size, size, device="cuda"))
    # a mean-reduced loss's scale: with unit gradients Inception v3's fp16 weight gradients near 65504 overflowed
    g = torch.randn(4, 100, device="cuda", dtype=torch.float64) * 1e-2
    got = _training_step({"fusekit": fk, "torch": base, "float64": ref64}, x, g, precision)
    # a parameter's gradient error against PyTorch's on that parameter, or on the model's gradient as a
    # whole: DenseNet-121 at 2x2 maps (BN over 16 values) puts PyTorch's own fp16 gradients 10-30% off
    # float64 layer by layer, and one layer's lucky 3.5e-2 is no yardstick
    flat = {k: torch.cat([g.double().flatten() for _, g in v[2:]]) for k, v in got.items()}
    e_model = rel(flat["torch"], flat["float64"])
    bad = []
    for (what, f), (_, t), (_, w) in zip(got["fusekit"], got["torch"], got["float64"]):
        e_fk, e_t = rel(f, w), rel(t, w)
        floor = FLOOR[precision] if what in ("output", "input gradient") else max(5e-2, 3 * e_model)
        if not e_fk < max(3 * e_t, floor):
            bad.append((what, f"{e_fk:.2e}", f"{e_t:.2e}"))
    assert not bad, f"{name} {precision} training: {bad[:8]}"
    assert rel(flat["fusekit"], flat["float64"]) < max(3 * e_model, 5e-3), (rel(flat["fusekit"], flat["float64"]), e_model)
    for m in (fk, base, ref64):
        m.eval()
    with torch.no_grad():
        y64 = ref64(x.double())
        e_fk, e_t = rel(_forward(fk, x, precision), y64), rel(_forward(base, x, precision), y64)
    print(f"{name} {precision}: {len(report.fused)} fused; eval output error fusekit {e_fk:.2e}, torch {e_t:.2e}")
    assert e_fk < max(3 * e_t, FLOOR[precision]), f"eval: fusekit {e_fk:.2e} vs torch {e_t:.2e}"


def test_converted_squeezenet_runs_its_ceil_mode_pools_on_fusekit():
    """SqueezeNet 1.1's MaxPool2d(3, 2, ceil_mode=True) layers are replaced, not left alone; in
    training mode under fp16 autocast the converted model's output and input gradient are within 3x
    the original's error against float64 (or the precision's floor)."""
    base = _torchvision("squeezenet1_1")
    fk, report = ft().convert(base)
    assert report.counts().get("MaxPool2d") == 3 and not [n for n, t, _ in report.left_alone if t == "MaxPool2d"], str(report)
    ref64 = copy.deepcopy(base).double()
    x = cl(torch.randn(4, 3, 64, 64, device="cuda"))
    g = torch.randn(4, 100, device="cuda", dtype=torch.float64)
    got = _training_step({"fusekit": fk, "torch": base, "float64": ref64}, x, g, "amp-fp16")
    for i, what in enumerate(("output", "dx")):
        e_fk, e_t = rel(got["fusekit"][i][1], got["float64"][i][1]), rel(got["torch"][i][1], got["float64"][i][1])
        assert e_fk < max(3 * e_t, FLOOR["amp-fp16"]), f"{what}: fusekit {e_fk:.2e} vs torch {e_t:.2e}"


@pytest.mark.parametrize("name, precision, residual", [
    ("resnet18", "amp-fp16", False), ("resnet50", "amp-fp16", False), ("resnet50", "fp32", False), ("mobilenet_v2", "amp-fp16", False),
    ("mobilenet_v2", "fp32", False), ("resnet18", "amp-fp16", True), ("resnet50", "amp-fp16", True), ("resnet50", "fp32", True),
])
@pytest.mark.heavy
def test_converted_model_gradients_match_original(name, precision, residual):
    """One training-mode backward (AMP fp16, or float32) of the converted model vs the original, both
    against a float64 copy: every parameter's gradient error within 3x the original's (or 5e-2).
    ``residual``: converted with fuse_residual (each block ends in BN + add + ReLU graphs)."""
    base = _torchvision(name)
    fk, report = ft().convert(base, fuse_residual=residual)
    assert sum("residual add" in what for _, what in report.fused) == (sum(type(m).__name__ in ("BasicBlock", "Bottleneck")
                                                                           for m in base.modules()) if residual else 0)
    ref64 = copy.deepcopy(base).double()
    x = cl(torch.randn(4, 3, 64, 64, device="cuda"))
    g = torch.randn(4, 100, device="cuda")
    for m, inp in ((fk, x), (base, x), (ref64, x.double())):
        m.train()
        with torch.autocast("cuda", dtype=torch.float16, enabled=m is not ref64 and precision == "amp-fp16"):
            y = m(inp)
        (y.double() * g.double()).sum().backward()
    errors = []
    for pname, p64 in ref64.named_parameters():
        pf, pt = fk.get_parameter(pname).grad, base.get_parameter(pname).grad
        errors.append((rel(pf, p64.grad), rel(pt, p64.grad), pname))
    for ef, et, pname in sorted(errors, key=lambda e: e[0] / max(e[1], 1e-12), reverse=True)[:8]:
        print(f"{pname}: gradient error fusekit {ef:.2e}, torch {et:.2e}")
    bad = [(pname, f"{ef:.2e}", f"{et:.2e}") for ef, et, pname in errors if not ef < max(3 * et, 5e-2)]
    assert not bad, bad


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_relu_backward_in_the_next_convs_dgrad_matches_float64(dtype, monkeypatch):
    """conv -> BN -> ReLU -> conv -> BN -> ReLU -> conv (ResNet's bottleneck order), converted: the two
    later convs compute their input gradient with the ReLU's mask (dgrad + dReLU), the BNs skip their
    own; every gradient as close to float64 as with the fusion turned off (within 2x, or the dtype's
    tolerance), and the fused path really ran."""
    import fusekit.ops.conv as opsconv

    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Conv2d(16, 32, 1, bias=False), torch.nn.BatchNorm2d(32), torch.nn.ReLU(inplace=True),
        torch.nn.Conv2d(32, 32, 3, padding=1, bias=False), torch.nn.BatchNorm2d(32), torch.nn.ReLU(inplace=True),
        torch.nn.Conv2d(32, 64, 1, bias=False),
    ).cuda()
    ref64 = copy.deepcopy(base).double()
    dt = getattr(torch, dtype)
    x = cl(torch.randn(8, 16, 14, 14, device="cuda"))
    g = cl(torch.randn(8, 64, 14, 14, device="cuda"))
    seen = []
    real = opsconv.conv_grads
    monkeypatch.setattr(opsconv, "conv_grads", lambda *a: seen.append(a[9]) or real(*a))  # input_relu

    def grads(model, fused):
        for m in model.modules():
            if isinstance(m, ft().Conv2d):
                m.__dict__["_fk_drelu"] = fused and m is not model[0]
        xi = x.to(dt).requires_grad_(True)
        (model(xi).double() * g.double()).sum().backward()
        return [xi.grad] + [p.grad for p in model.parameters()]

    xr = x.double().requires_grad_(True)
    (ref64(xr) * g.double()).sum().backward()
    want = [xr.grad] + [p.grad for p in ref64.parameters()]
    errs = {}
    for fused in (True, False):
        fk, _ = ft().convert(base)
        fk = fk.to(dt).to(memory_format=torch.channels_last).train()
        seen.clear()
        errs[fused] = [rel(a, b) for a, b in zip(grads(fk, fused), want)]
        assert seen == ([True, True, False] if fused else [False] * 3)  # backward order: the last conv first
    print(f"{dtype}: gradient errors vs float64, fused {max(errs[True]):.2e}, unfused {max(errs[False]):.2e}")
    for ef, eu in zip(errs[True], errs[False]):
        assert ef < max(2 * eu, TOL[dtype])


@pytest.mark.parametrize("precision", ["fp32", "amp-fp16"])
def test_converted_relu6_blocks_train_on_fused_graphs(precision, monkeypatch):
    """MobileNetV2's inverted residual (1x1 expand -> BN -> ReLU6, depthwise 3x3 -> BN -> ReLU6, 1x1
    project -> BN, + x), converted: in training the BNs run BN+ReLU6 graphs and the convs after a
    ReLU6 take its backward into their dgrad; output, input and parameter gradients (training) and
    output (eval, folded) within 3x the original's error against float64, or a floor."""
    import fusekit.ops.conv as opsconv

    class Block(torch.nn.Module):
        def __init__(self, c=32, e=4):
            super().__init__()
            h = c * e
            self.body = torch.nn.Sequential(
                torch.nn.Conv2d(c, h, 1, bias=False), torch.nn.BatchNorm2d(h), torch.nn.ReLU6(inplace=True),
                torch.nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), torch.nn.BatchNorm2d(h), torch.nn.ReLU6(inplace=True),
                torch.nn.Conv2d(h, c, 1, bias=False), torch.nn.BatchNorm2d(c),
            )

        def forward(self, x):
            return x + self.body(x)

    torch.manual_seed(0)
    base = Block().cuda().to(memory_format=torch.channels_last)
    with torch.no_grad():
        for m in base.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(2.0, 4.0)  # a good share of activations above 6: the clip matters
                m.bias.uniform_(0.5, 1.5)
                m.running_var.uniform_(0.5, 2.0)
    fk, report = ft().convert(base)
    assert report.counts().get("ReLU6") == 2 and sum("BN+ReLU6" in what for _, what in report.fused) == 2, report
    ref64 = copy.deepcopy(base).double()
    clips, fed = [], []
    real_bn, real_grads = ft().common.ops.batchnorm, opsconv.conv_grads
    monkeypatch.setattr(ft().common.ops, "batchnorm", lambda *a, **k: clips.append(k.get("upper_clip")) or real_bn(*a, **k))
    monkeypatch.setattr(opsconv, "conv_grads", lambda *a: fed.append(a[9:]) or real_grads(*a))
    x = cl(torch.randn(8, 32, 14, 14, device="cuda"))
    g = cl(torch.randn(8, 32, 14, 14, device="cuda"))
    amp = precision == "amp-fp16"
    errs = {}
    for m in (fk, base, ref64):
        m.train()
        xi = (x.double() if m is ref64 else x.clone()).requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp and m is not ref64):
            y = m(xi)
        (y.double() * g.double()).sum().backward()
        errs[id(m)] = [y.detach(), xi.grad] + [p.grad for p in m.parameters()]
    assert clips == [6.0, 6.0, math.inf]  # the two BN+ReLU6 graphs, then the project BN alone
    assert sorted(fed) == sorted([(False, math.inf), (True, 6.0), (True, 6.0)])  # the depthwise and project dgrads take the dReLU6
    want = errs[id(ref64)]
    floor = 3e-3 if precision == "fp32" else 2e-2
    for i, (a, b, w) in enumerate(zip(errs[id(fk)], errs[id(base)], want)):
        ef, et = rel(a, w), rel(b, w)
        assert ef < max(3 * et, floor), f"{i}: fusekit {ef:.2e} vs torch {et:.2e}"
    for m in (fk, base, ref64):
        m.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=amp):
        yf, yt = fk(x), base(x)
    y64 = ref64(x.double())
    assert rel(yf, y64) < max(3 * rel(yt, y64), floor)


# ----------------------------------------------------------------------------------------------
# Training: the example, and a captured training step
# ----------------------------------------------------------------------------------------------
@pytest.mark.heavy
def test_train_resnet_example_tracks_eager():
    """examples/train_resnet.py for 30 steps: the converted ResNet-18 (fp16 AMP, channels-last, SGD
    momentum) tracks the eager one from the same weights: within 1% over the first 10 steps (where a
    wrong gradient would show) and 5% over all 30. Random-init ResNet training is chaotic (see the
    example's docstring); should the 30-step gap pass 5%, it must stay within twice the gap of eager
    against eager from weights perturbed by a relative 1e-3."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import train_resnet

    steps = 30
    fk, ea, report = train_resnet.run(steps=steps)
    print(report)
    for i in range(steps):
        print(f"step {i:3d}: fusekit {fk[i]:.4f}  eager {ea[i]:.4f}")
    early, gap = train_resnet.max_relative_gap(fk[:10], ea[:10]), train_resnet.max_relative_gap(fk, ea)
    print(f"loss fusekit {fk[0]:.4f} -> {fk[-1]:.4f}, eager {ea[0]:.4f} -> {ea[-1]:.4f}; "
          f"max relative gap {early:.4f} (10 steps), {gap:.4f} ({steps} steps)")
    assert all(math.isfinite(v) for v in fk + ea)
    assert sum(fk[-5:]) < sum(fk[:5]), "the loss must fall"
    assert early < 0.01
    if gap >= 0.05:
        control = train_resnet.max_relative_gap(train_resnet.control_losses(steps), ea)
        print(f"control (eager, weights perturbed by 1e-3): max relative gap {control:.4f}")
        assert gap < 2 * control, f"gap {gap:.4f} vs chaos control {control:.4f}"


@pytest.mark.parametrize("wrap", ["graphed", "replayed"])
def test_train_resnet_example_wrapped_tracks_uncaptured(wrap):
    """fusekit.torch.graphed / replayed on examples/train_resnet.py's converted ResNet-18 (fp16
    autocast): 30 steps of the same loop (fp16 AMP, GradScaler, SGD momentum) track the uncaptured
    converted model from the same weights on the same batches: within 1% over the first 10 steps, 5%
    over all 30; replayed, the steps after the recordings replay."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import train_resnet

    steps = 30
    batches = train_resnet.synthetic_batches(steps, 64, 64)
    curves, times = {}, {}
    for name in ("uncaptured", wrap):
        _, fused, _ = train_resnet.make_models()
        if name == "graphed":
            fused = ft().graphed(fused, batches[0][0], autocast=torch.float16)
        elif name == "replayed":
            fused = ft().replayed(fused)
        curves[name] = train_resnet.train(fused, batches, steps, times=times.setdefault(name, []))
    fg, fu = curves[wrap], curves["uncaptured"]
    for i in range(steps):
        print(f"step {i:3d}: {wrap} {fg[i]:.4f}  uncaptured {fu[i]:.4f}")
    med = {k: sorted(v[10:])[len(v[10:]) // 2] for k, v in times.items()}
    early, gap = train_resnet.max_relative_gap(fg[:10], fu[:10]), train_resnet.max_relative_gap(fg, fu)
    print(f"max relative gap {early:.4f} (10 steps), {gap:.4f} ({steps} steps); ms per step {wrap} {med[wrap]:.2f}, "
          f"uncaptured {med['uncaptured']:.2f}")
    assert all(math.isfinite(v) for v in fg)
    assert sum(fg[-5:]) < sum(fg[:5]), "the loss must fall"
    assert early < 0.01 and gap < 0.05
    if wrap == "replayed":
        # 2 warm-up steps, then recordings until two agree (2 unless fusekit still settles a plan)
        assert fused.forward.replays >= steps - 8, (fused.forward.replays, fused.forward.refused)


def _graph_net():
    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1, bias=False), torch.nn.BatchNorm2d(32), torch.nn.ReLU(inplace=True),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1, bias=False), torch.nn.BatchNorm2d(64), torch.nn.ReLU(inplace=True),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    )
    fk, report = ft().convert(base)
    assert len(report.fused) == 2
    return fk.cuda().to(memory_format=torch.channels_last)


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # SGD keeps no host-side step count
    return torch.optim.Adam(params, lr=1e-3, capturable=True)


def _sync(src, src_opt, dst, dst_opt):
    """dst (model and optimizer state) := src, as copies."""
    dst.load_state_dict(src.state_dict())
    for ps, pd in zip(src.parameters(), dst.parameters()):
        dst_opt.state[pd] = {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in src_opt.state[ps].items()}


@pytest.mark.parametrize("precision", ["fp32", "amp-fp16"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_cuda_graph_training_step_replays_the_eager_step(kind, precision):
    """PyTorch's whole-network capture recipe on a converted model: warm-up on a side stream (the plans
    for every shape exist before the capture; fusekit raises CaptureError for a new one inside it),
    capture forward + backward + optimizer step, replay on fresh data; each replay's loss and the
    weights after it equal an uncaptured step of the same model from the same state."""
    amp = precision == "amp-fp16"
    captured = _graph_net()
    eager = copy.deepcopy(captured)
    opt_c, opt_e = _optimizer(kind, captured.parameters()), _optimizer(kind, eager.parameters())
    static_x = cl(torch.randn(16, 3, 16, 16, device="cuda"))
    static_t = torch.randint(0, 10, (16,), device="cuda")

    def step(model, opt, x, t):
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp, cache_enabled=False):
            loss = F.cross_entropy(model(x), t)
        loss.backward()
        opt.step()
        return loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt_c.zero_grad(set_to_none=True)
            step(captured, opt_c, static_x, static_t)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    opt_c.zero_grad(set_to_none=True)
    with torch.cuda.graph(g, stream=s):
        static_loss = step(captured, opt_c, static_x, static_t)
    torch.cuda.synchronize()

    _sync(captured, opt_c, eager, opt_e)
    gen = torch.Generator(device="cuda").manual_seed(5)
    loss_tol, update_tol = (2e-3, 5e-2) if amp else (1e-4, 1e-2)
    for i in range(4):
        x = cl(torch.randn(16, 3, 16, 16, device="cuda", generator=gen))
        t = torch.randint(0, 10, (16,), device="cuda", generator=gen)
        before = [p.detach().clone() for p in captured.parameters()]
        static_x.copy_(x)
        static_t.copy_(t)
        g.replay()
        opt_e.zero_grad(set_to_none=True)
        loss_e = step(eager, opt_e, x, t)
        torch.cuda.synchronize()
        lc, le = float(static_loss), float(loss_e)
        print(f"{kind} {precision} replay {i}: captured loss {lc:.6f}, eager {le:.6f}")
        assert math.isfinite(lc) and abs(lc - le) / le < loss_tol
        for (n, pc), pe, p0 in zip(captured.named_parameters(), eager.parameters(), before):
            assert not torch.equal(pc, p0), f"replay {i}: {n} was not updated"
            assert rel(pc - p0, pe - p0) < update_tol, f"replay {i}: update of {n} differs by {rel(pc - p0, pe - p0):.2e}"
        _sync(captured, opt_c, eager, opt_e)  # the next step starts from the same state on both sides
    assert int(captured[1].num_batches_tracked) == 3 + 4  # warm-up steps and replays (a capture runs nothing)


def _amp_step(model, opt, gs, x, t):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.cross_entropy(model(x), t)
    gs.scale(loss).backward()
    gs.step(opt)
    gs.update()
    return float(loss)


def test_graphed_trains_like_the_uncaptured_model():
    """fusekit.torch.graphed(model) with no sample, in the ordinary loop (fp16 autocast with its weight
    cache, GradScaler, SGD momentum): its first steps run uncaptured, then one capture, then replays;
    per step the loss and weight updates of the same converted model run uncaptured from the same
    state, and the batch-norm running statistics and step counts end equal (the capture runs no extra
    training pass)."""
    graphed = ft().graphed(_graph_net(), warmup=2)
    eager = _graph_net()
    sides = [(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), torch.amp.GradScaler("cuda", init_scale=2.0**10))
             for m in (graphed, eager)]
    gen = torch.Generator(device="cuda").manual_seed(7)
    for i in range(6):
        x = cl(torch.randn(16, 3, 16, 16, device="cuda", generator=gen))
        t = torch.randint(0, 10, (16,), device="cuda", generator=gen)
        losses, updates = [], []
        for model, opt, gs in sides:
            before = [p.detach().clone() for p in model.parameters()]
            losses.append(_amp_step(model, opt, gs, x, t))
            updates.append([p.detach() - p0 for p, p0 in zip(model.parameters(), before)])
        print(f"step {i}: graphed loss {losses[0]:.6f}, uncaptured {losses[1]:.6f}, graphs {len(graphed.forward.graphs)}")
        assert len(graphed.forward.graphs) == (1 if i >= 2 else 0)
        assert math.isfinite(losses[0]) and abs(losses[0] - losses[1]) / losses[1] < 2e-3
        for (n, _), ug, ue in zip(graphed.named_parameters(), *updates):
            assert ug.abs().max() > 0, f"step {i}: {n} was not updated"
            assert rel(ug, ue) < 5e-2, f"step {i}: update of {n} differs by {rel(ug, ue):.2e}"
        for (n, bg), be in zip(graphed.named_buffers(), eager.buffers()):
            if n.endswith("num_batches_tracked"):
                assert int(bg) == int(be) == i + 1, f"step {i}: {n} {int(bg)} against {int(be)}"
            else:
                assert rel(bg, be) < 1e-2, f"step {i}: {n} differs by {rel(bg, be):.2e}"
        _sync(graphed, sides[0][1], eager, sides[1][1])  # the next step starts from the same state
        sides[1][2].load_state_dict(sides[0][2].state_dict())


def test_graphed_outputs_and_gradients_are_the_callers_own():
    """A replayed forward's output keeps its values after the next call, and gradients accumulate
    over micro-batches into .grad (zeroed in place or set to None) as uncaptured ones do: .grad is
    never the graphs' buffer, which the next replay overwrites. Float32, TF32 off."""
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        graphed = ft().graphed(_graph_net(), warmup=1)
        eager = _graph_net()
        gen = torch.Generator(device="cuda").manual_seed(3)
        batches = [(cl(torch.randn(8, 3, 16, 16, device="cuda", generator=gen)), torch.randint(0, 10, (8,), device="cuda", generator=gen))
                   for _ in range(8)]
        for set_to_none in (True, False):
            for k in range(0, 8, 2):
                for model in (graphed, eager):
                    model.zero_grad(set_to_none=set_to_none)
                    outs = []
                    for x, t in batches[k:k + 2]:  # two micro-batches, one optimizer step's worth of gradient
                        y = model(x)
                        outs.append((y, y.detach().clone()))
                        F.cross_entropy(y, t).backward()
                    for y, kept in outs:
                        assert torch.equal(y, kept), "an earlier output changed after a later call"
                assert graphed.forward.graphs, "no graph captured"
                cap = next(iter(graphed.forward.graphs.values()))
                for (n, pg), pe in zip(graphed.named_parameters(), eager.parameters()):
                    assert all(pg.grad.data_ptr() != g.data_ptr() for g in cap.grads if g is not None), f"{n}.grad is a graph buffer"
                    assert rel(pg.grad, pe.grad) < 1e-4, f"set_to_none={set_to_none}, step {k}: {n}.grad differs by {rel(pg.grad, pe.grad):.2e}"
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False


def test_graphed_captures_each_signature_and_runs_eval_uncaptured():
    """graphed(model, sample) captures the sample's signature at once (the caller's sample keeps its
    values); another batch size gets a graph of its own after the warm-up calls, with outputs as the
    uncaptured model's; an eval-mode no-grad call in its signature's warm-up runs uncaptured. A model left on
    the CPU is named before anything is captured; moving the model drops its graphs."""
    from fusekit.errors import OperandError

    model = _graph_net()
    sample = cl(torch.randn(8, 3, 16, 16, device="cuda"))
    kept = sample.clone()
    with pytest.raises(OperandError, match=r"'model\.0\.weight': expected on cuda:0"):
        ft().graphed(model.cpu(), sample)
    model = ft().graphed(model.cuda(), sample, warmup=2)
    assert torch.equal(sample, kept), "the capture wrote into the caller's sample"
    assert len(model.forward.graphs) == 1
    ref = _graph_net()
    for n in (8, 4, 4, 4, 8):  # training steps: the warm-up calls of a signature build its backward plans too
        ref.load_state_dict(model.state_dict())
        x = cl(torch.randn(n, 3, 16, 16, device="cuda"))
        y, y_ref = model(x), ref(x)
        assert y.shape == (n, 10) and rel(y, y_ref) < 1e-3
        y.square().mean().backward()
    assert len(model.forward.graphs) == 2
    model.eval()
    x = cl(torch.randn(3, 3, 16, 16, device="cuda"))
    with torch.no_grad():
        y = model(x)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert rel(y, ref.eval()(x)) < 1e-3
    model.train()
    model.half()
    assert model(cl(torch.randn(4, 3, 16, 16, device="cuda", dtype=torch.float16))).dtype == torch.float16
    assert not model.forward.graphs, "the graphs of the float32 model were kept"


def test_graphed_eval_graphs_replay_the_eval_forward():
    """graphed(model) (eval_graphs=True, the default) on a converted ResNet-18: eval calls under no_grad and
    inference_mode are captured after the warm-up and replayed, with outputs as PyTorch's (the caller's
    own tensors); a replay after an in-place change of weights and running statistics gives the
    changed model's output; a training step after it captures its own graph and trains as before."""
    base = _torchvision("resnet18")
    fk, _ = ft().convert(base)
    model = ft().graphed(fk, warmup=2)
    model.eval(), base.eval()
    x = cl(torch.randn(4, 3, 64, 64, device="cuda"))
    with torch.no_grad():
        want = base(x)
        ys = [model(x) for _ in range(4)]  # two warm-up calls, the capture, a replay
        assert len(model.forward.graphs) == 1 and not next(iter(model.forward.graphs))[6]
        assert all(rel(y, want) < 3e-3 for y in ys)
        assert ys[2].data_ptr() != ys[3].data_ptr(), "replays must hand out their own outputs"
        for m in (fk, base):
            m.layer1[0].bn1.running_var.mul_(4.0)
            m.layer2[1].conv2.weight.mul_(-0.5)
        want2 = base(x)
        assert rel(want2, want) > 1e-2
        assert rel(model(x), want2) < 3e-3, "a replay used folds from before the change"
        assert rel(ys[3], want) < 3e-3, "a replay overwrote an earlier output"
    with torch.inference_mode():
        assert rel(model(x), want2) < 3e-3 and len(model.forward.graphs) == 1
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        loss = model(x).float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    assert len(model.forward.graphs) == 2


@pytest.mark.parametrize("residual", [False, True])
def test_captured_eval_forward_sees_weight_changes_on_replay(residual):
    """A converted model's eval forward captured in a CUDA graph computes its BN folds inside the graph:
    a replay after the weights or running statistics changed in place gives the changed model's output
    (uncaptured calls reuse their folds while nothing changed, and see the change too)."""
    from fusekit.pipeline.bench import capture

    base = _torchvision("resnet18")
    fk, _ = ft().convert(base, fuse_residual=residual)
    fk.eval(), base.eval()
    x = cl(torch.randn(4, 3, 64, 64, device="cuda"))
    with torch.no_grad():
        want = base(x)
        assert rel(fk(x), want) < 3e-3  # uncaptured: the folds are computed and held
        y = [None]
        g2 = capture(lambda: y.__setitem__(0, fk(x)))
        g2.replay()
        assert rel(y[0], want) < 3e-3
        for m in (fk, base):  # in place, as an optimizer step or an EMA update writes
            m.layer1[0].bn1.running_var.mul_(4.0)
            m.layer2[1].conv2.weight.mul_(-0.5)
            m.bn1.bias.add_(0.3)
        want2 = base(x)
        assert rel(want2, want) > 1e-2  # the change matters
        g2.replay()
        assert rel(y[0], want2) < 3e-3, "a replay used folds from before the change"
        assert rel(fk(x), want2) < 3e-3, "an uncaptured call used folds from before the change"


@pytest.mark.heavy
@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16, None], ids=["amp-fp16", "bf16", "fp32"])
def test_replayed_model_trains_as_its_modules_do(amp):
    """fusekit.torch.replayed on a converted ResNet-18: after the warm-up and recorded SGD steps
    (GradScaler in float16) the whole training forward and backward replay from a tape (aten ops,
    fusekit graphs, pooling). Each of three later steps, from one state, gives the loss, gradients
    and running statistics of the same step run as modules; the weights move between steps (a tape
    reads them as they are)."""
    tv = pytest.importorskip("torchvision")
    import torch.nn.functional as F

    torch.manual_seed(0)
    model, _ = ft().convert(tv.models.resnet18(weights=None, num_classes=10))
    model = ft().replayed(model.cuda().to(memory_format=torch.channels_last).train())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gs = torch.amp.GradScaler("cuda", init_scale=2.0**10, enabled=amp is torch.float16)

    def fwd_bwd(x, y):
        with torch.autocast("cuda", dtype=amp or torch.float16, enabled=amp is not None):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        gs.scale(loss).backward()
        return float(loss.detach()), [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    def batch():
        return cl(torch.randn(8, 3, 64, 64, device="cuda")), torch.randint(0, 10, (8,), device="cuda")

    for i in range(8):  # warm-up and recordings (two that agree; more if fusekit still settles its plans)
        fwd_bwd(*batch())
        gs.step(opt)
        gs.update()
        if model.forward.tapes:
            break
    fw = model.forward
    assert fw.tapes, (fw.calls, {k[0]: n for k, (_, n) in fw.recordings.items()}, fw.refused)
    assert i >= fw.warmup + 1
    for i in range(3):
        x, y = batch()
        # the same step as modules and replayed, from one state
        state = copy.deepcopy(model.state_dict())
        model.forward.enabled = False
        want = fwd_bwd(x, y), copy.deepcopy(model.state_dict())
        model.load_state_dict(state)
        model.forward.enabled = True
        before = model.forward.replays
        got = fwd_bwd(x, y), copy.deepcopy(model.state_dict())
        assert model.forward.replays == before + 1, model.forward.refused
        assert math.isfinite(got[0][0]) and abs(got[0][0] - want[0][0]) <= 1e-3 * abs(want[0][0]), (got[0][0], want[0][0])
        assert max(rel(a.float(), b.float()) for a, b in zip(got[0][1], want[0][1]) if b is not None and b.norm() > 0) < 1e-3
        assert max(rel(a.float(), b.float()) for a, b in zip(got[1].values(), want[1].values()) if b.float().norm() > 0) < 1e-3
        gs.step(opt)
        gs.update()
    tape = next(iter(model.forward.tapes.values()))
    assert sum(e[0] == 1 for e in tape.entries) >= 40, "the tape holds too few fusekit graphs: layers ran outside fusekit"
    assert any(e[0] == 2 for e in tape.entries), "the max pool (a fusekit kernel of its own) is not in the tape"
    from fusekit.torch.tape import _name

    names = [_name(e) for e in tape.entries]
    fwd, bwd = names[:tape.fwd_end], names[tape.fwd_end:]

    def merged(name, op):  # how many recorded ops one merged entry stands for (0: not a merged one)
        m = re.fullmatch(rf"aten\.{re.escape(op)} x(\d+) \(one foreach \w+\)", name)
        return int(m.group(1)) if m else 0

    # the 20 batch norms' running statistics and batch counts, merged at the forward's end
    assert sorted([merged(fwd[-2], "_foreach_copy_"), merged(fwd[-1], "_foreach_copy_")]) == [0, 20], fwd[-4:]
    assert sorted([merged(fwd[-2], "add_"), merged(fwd[-1], "add_")]) == [0, 20], fwd[-4:]
    if amp is not None:  # autocast's casts of the 21 weights (and more), and their gradients' casts back
        assert merged(fwd[0], "_to_copy") >= 21 and merged(bwd[-1], "_to_copy") >= 21, (fwd[:2], bwd[-2:])


def test_tapes_replay_a_training_step_as_the_ops_run_it(monkeypatch, fresh_session):
    """Recorded dispatch (dispatch.taped) in a converted ResNet-18's uncaptured AMP training: from the
    third call of a signature on, the conv and batch-norm ops replay their resolved calls; six SGD
    steps give the losses and weights of the same steps run without tapes."""
    tv = pytest.importorskip("torchvision")
    import torch.nn.functional as F

    import fusekit
    from fusekit import dispatch

    torch.manual_seed(0)
    fk, _ = ft().convert(tv.models.resnet18(weights=None, num_classes=10))
    fk = fk.cuda().to(memory_format=torch.channels_last).train()
    init = copy.deepcopy(fk.state_dict())
    batches = [(cl(torch.randn(8, 3, 64, 64, device="cuda")), torch.randint(0, 10, (8,), device="cuda")) for _ in range(6)]

    def train(on):
        monkeypatch.setattr(fusekit.config.TUNABLES, "tapes", on)
        dispatch.clear_dispatch()
        fk.load_state_dict(init)
        opt = torch.optim.SGD(fk.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for x, y in batches:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(fk(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        return losses, [t.detach().clone() for t in fk.state_dict().values()]

    off = train(False)
    assert not fresh_session.tapes
    on = train(True)
    replaying = [t for t in fresh_session.tapes.values() if type(t) is record.Tape]
    assert len(replaying) >= 20, f"only {len(replaying)} ops replay"
    assert all(math.isfinite(v) for v in on[0])
    assert max(abs(a - b) / abs(b) for a, b in zip(on[0], off[0])) < 1e-3, (on[0], off[0])
    assert max(rel(a.float(), b.float()) for a, b in zip(on[1], off[1]) if b.float().norm() > 0) < 1e-3
