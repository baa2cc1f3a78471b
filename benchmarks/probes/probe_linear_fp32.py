"""fusekit.torch.Linear in float32 (DenseNet-121's classifier, 1024 -> 100, batch 4): output, dx, dw
and db against float64, with PyTorch's for scale, under the numerics policies "none" and the
default (TF32 for convolutions only). Question: does the float32 matmul path run IEEE float32?"""

import torch

import fusekit
import fusekit.torch as ft

torch.backends.cuda.matmul.allow_tf32 = False


def rel(a, w):
    return float((a.double() - w).norm() / w.norm())


for policy in ("none", "conv"):
    fusekit.configure(allow_tf32=policy, disk=False)
    for n, fin, fout in ((4, 1024, 100), (64, 2048, 1000), (4, 64, 8)):
        torch.manual_seed(0)
        ref = torch.nn.Linear(fin, fout).cuda()
        fk = ft.Linear(fin, fout).cuda()
        fk.load_state_dict(ref.state_dict())
        r64 = torch.nn.Linear(fin, fout).cuda().double()
        r64.load_state_dict(ref.state_dict())
        x = torch.randn(n, fin, device="cuda")
        g = torch.randn(n, fout, device="cuda", dtype=torch.float64)
        out = {}
        for key, m in (("fusekit", fk), ("torch", ref), ("float64", r64)):
            xi = (x.double() if key == "float64" else x).clone().requires_grad_(True)
            y = m(xi)
            (y.double() * g).sum().backward()
            out[key] = (y.detach(), xi.grad, m.weight.grad, m.bias.grad)
        row = " ".join(f"{what} fk {rel(f, w):.1e} torch {rel(t, w):.1e}" for what, f, t, w in
                       zip(("y", "dx", "dw", "db"), out["fusekit"], out["torch"], out["float64"]))
        print(f"policy {policy} {n}x{fin}->{fout}: {row}", flush=True)
