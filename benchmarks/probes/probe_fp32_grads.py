"""Probe: float32 dgrad / wgrad accuracy per candidate plan against float64 PyTorch (run on the GPU).

Run 13 saw 2-3.5e-2 relative error for float32 gradients; this lists each plan's name, numerical notes
and error so the cause (TF32, down-converted inputs, reduced-precision reductions) can be read off.
"""
import math

import cudnn
import torch
import torch.nn.functional as F

import fusekit
from fusekit import ops, tensors
from fusekit.engine import lower
from fusekit.engine.runtime import RUNTIME

torch.manual_seed(0)
ad = tensors.library("torch")
NOTES = [n for n in dir(cudnn.numerical_note) if not n.startswith("_")]


def rel(a, ref):
    return float((a.double() - ref).norm() / ref.norm())


def probe(pattern, arrays, out_shape, attrs, ref):
    pat = fusekit.get_pattern(pattern)
    out = torch.empty(out_shape, device="cuda", dtype=torch.float32).contiguous(memory_format=torch.channels_last)
    plan = ops.plan_for(pattern, *arrays, **attrs)
    got = ops.call(pattern, *arrays, **attrs)
    print(f"== {pattern} float32 {[tuple(a.shape) for a in arrays]} heuristic plan {plan.engine}: rel err {rel(got, ref):.2e}")
    h = RUNTIME.handle(ad, 0, ad.stream(0))
    ws = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    N = cudnn.numerical_note
    for label, drop in [("all", []), ("-down/-rpr", [N.DOWN_CONVERT_INPUTS, N.REDUCED_PRECISION_REDUCTION]),
                        ("-down/-rpr/-tc", [N.DOWN_CONVERT_INPUTS, N.REDUCED_PRECISION_REDUCTION, N.TENSOR_CORE]),
                        ("-fft/-winograd", [N.FFT, N.WINOGRAD])]:
        L = lower.lower(pat, dict(plan.key.specs), dict(plan.key.attrs), handle=h)
        g = L.graph
        try:
            g.validate(); g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            if drop:
                g.deselect_numeric_notes(drop)
            g.build_plans(cudnn.build_plan_policy.ALL)
        except Exception as e:  # noqa: BLE001
            print(f"  [{label}] build failed: {str(e)[:150]}")
            continue
        rows = []
        for i in range(g.get_execution_plan_count()):
            try:
                out.fill_(float("nan"))
                g.execute_plan_at_index(list(arrays) + [out], ws, i, h, tensor_uids=L.uids)
                torch.cuda.synchronize()
                rows.append(f"{g.get_plan_name_at_index(i)[:40]}={rel(out, ref):.1e}")
            except Exception as e:  # noqa: BLE001
                rows.append(f"{i}:unsupported")
        print(f"  [{label}] {len(rows)} plans: " + "; ".join(rows)[:1500])


for (n, c, h, w, k, r, p) in [(2, 16, 12, 12, 32, 3, 1), (4, 32, 8, 8, 64, 1, 0)]:
    cl = lambda t: t.contiguous(memory_format=torch.channels_last)  # noqa: E731
    x = cl(torch.randn(n, c, h, w, device="cuda"))
    wt = cl(torch.randn(k, c, r, r, device="cuda") / math.sqrt(c * r * r))
    dy = cl(torch.randn(n, k, h + 2 * p - r + 1, w + 2 * p - r + 1, device="cuda"))
    xd, wd = x.double().requires_grad_(), wt.double().requires_grad_()
    F.conv2d(xd, wd, padding=p).backward(dy.double())
    try:
        probe("conv_dgrad", [dy, wt], x.shape, dict(padding=p), xd.grad)
    except Exception as e:  # noqa: BLE001
        print("dgrad probe failed:", repr(e)[:300])
    try:
        probe("conv_wgrad", [x, dy], wt.shape, dict(padding=p, kernel=r), wd.grad)
    except Exception as e:  # noqa: BLE001
        print("wgrad probe failed:", repr(e)[:300])
