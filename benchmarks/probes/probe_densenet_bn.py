"""Converted DenseNet-121, float32 with TF32 off on both sides: fusekit's parameter gradients in
denseblock4 were 5e-3 off float64 where PyTorch's were 1e-5 (probe_densenet_grads). Which tensor
first differs: per BatchNorm of denseblock4 and norm5, its input, output, output gradient, input
gradient, dgamma and dbeta, fusekit and PyTorch each against float64; then the worst layer alone
(fusekit.torch.BatchNorm2d vs torch.nn.BatchNorm2d on that layer's float64 input, same dy)."""

import copy
import sys

import torch

sys.path.insert(0, "tests")
import test_gpu_torch_dropin as G  # noqa: E402

import os  # noqa: E402

import fusekit  # noqa: E402

PRECISION = os.environ.get("PRECISION", "fp32")  # amp-fp16: autocast on both sides, TF32 settings as they are
if PRECISION == "fp32":
    torch.backends.cudnn.allow_tf32 = False
    fusekit.configure(allow_tf32="none")


def rel(a, w):
    if a is None or w is None:
        return float("nan")
    a, w = a.detach().double(), w.detach().double()
    return float((a - w).norm() / w.norm().clamp_min(1e-30))


base = G._torchvision("densenet121", 64)
fk, report = G.ft().convert(base)
print([f for f in report.fused if "norm5" in str(f)], flush=True)
ref64 = copy.deepcopy(base).double()
x = G.cl(torch.randn(4, 3, 64, 64, device="cuda"))
g = torch.randn(4, 100, device="cuda", dtype=torch.float64) * 1e-2
names = ["features.denseblock4.denselayer13.norm1", "features.denseblock4.denselayer13.norm2",
         "features.denseblock4.denselayer16.norm2", "features.norm5"]
rec = {}
for key, m in (("fusekit", fk), ("torch", base), ("float64", ref64)):
    for n in names:
        def hook(mod, i, o, key=key, n=n):
            i[0].retain_grad()
            o.retain_grad()
            rec[(key, n)] = (i[0], o, mod)
        m.get_submodule(n).register_forward_hook(hook)
    m.train()
    xi = (x.double() if key == "float64" else x).detach().clone().requires_grad_(True)
    ((m(xi) if key == "float64" else G._forward(m, xi, PRECISION)).double() * g).sum().backward()
for n in names:
    print(n, flush=True)
    for key in ("fusekit", "torch"):
        (i, o, mod), (i64, o64, mod64) = rec[(key, n)], rec[("float64", n)]
        same = o is i
        print(f"   {key:8s} x {rel(i, i64):.1e} y {rel(o, o64):.1e} dy {rel(o.grad, o64.grad):.1e} dx {rel(i.grad, i64.grad):.1e} "
              f"dgamma {rel(mod.weight.grad, mod64.weight.grad):.1e} dbeta {rel(mod.bias.grad, mod64.bias.grad):.1e} (y is x: {same})", flush=True)
# the last layer alone, on float64's input rounded to float32, the same float64 dy
n = "features.norm5"
if PRECISION != "fp32":
    sys.exit()
i64, o64, mod64 = rec[("float64", n)]
xin = G.cl(i64.detach().float())
dy = o64.grad.detach()
for key, mod in (("fusekit", copy.deepcopy(fk.get_submodule(n))), ("torch", copy.deepcopy(base.get_submodule(n)))):
    mod.train()
    for h in list(mod._forward_hooks):
        del mod._forward_hooks[h]
    xi = xin.detach().clone().requires_grad_(True)
    y = mod(xi)
    y.backward(dy.float())
    ref = torch.nn.BatchNorm2d(mod64.num_features).double().cuda()
    ref.load_state_dict(copy.deepcopy(mod64).state_dict())
    ref.running_mean.copy_(mod.running_mean)  # only to keep them comparable; training mode ignores them
    xr = xin.double().detach().clone().requires_grad_(True)
    yr = ref(xr)
    if getattr(mod, '_fk_relu', None) is not None:
        yr = torch.relu(yr)
    yr.backward(dy)
    print(f"alone {key:8s} y {rel(y, yr):.1e} dx {rel(xi.grad, xr.grad):.1e} dgamma {rel(mod.weight.grad, ref.weight.grad):.1e} "
          f"dbeta {rel(mod.bias.grad, ref.bias.grad):.1e} relu fused: {getattr(mod, '_fk_relu', None) is not None}", flush=True)
