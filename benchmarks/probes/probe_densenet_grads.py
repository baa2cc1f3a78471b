"""Converted torchvision DenseNet-121 (and Inception v3 in amp-fp16): which parameter gradients of a
training step differ from float64 more than the unconverted model's, with TF32 convolutions on and off
on both sides (a precision spread falls with TF32 off on both; a defect does not)."""

import copy
import sys

import torch

sys.path.insert(0, "tests")
import test_gpu_torch_dropin as G  # noqa: E402

import fusekit  # noqa: E402


def errors(name, precision, size, gscale):
    base = G._torchvision(name, size)
    fk, _ = G.ft().convert(base)
    ref64 = copy.deepcopy(base).double()
    x = G.cl(torch.randn(4, 3, size, size, device="cuda"))
    g = torch.randn(4, 100, device="cuda", dtype=torch.float64) * gscale
    got = G._training_step({"fusekit": fk, "torch": base, "float64": ref64}, x, g, precision)

    def rel(a, w):
        a, w = a.detach().double(), w.detach().double()
        return float((a - w).norm() / w.norm().clamp_min(1e-30)) if torch.isfinite(a).all() else float("inf")

    rows = [(rel(f, w), rel(t, w), what) for (what, f), (_, t), (_, w) in zip(got["fusekit"], got["torch"], got["float64"])]
    worst = sorted(rows, key=lambda r: r[0] / max(r[1], 1e-12), reverse=True)[:5]
    print(f"{name} {precision} size {size} g*{gscale} tf32={torch.backends.cudnn.allow_tf32}: worst ratio rows (fusekit, torch):", flush=True)
    for ef, et, what in worst:
        print(f"   {what}: {ef:.2e} {et:.2e}", flush=True)


for tf32 in (True, False):
    torch.backends.cudnn.allow_tf32 = tf32
    fusekit.configure(allow_tf32="conv" if tf32 else "none")
    errors("densenet121", "fp32", 64, 1.0)
torch.backends.cudnn.allow_tf32 = True
fusekit.configure(allow_tf32="conv")
for gscale in (1.0, 0.01):
    errors("inception_v3", "amp-fp16", 80, gscale)
errors("densenet121", "amp-fp16", 64, 0.01)
