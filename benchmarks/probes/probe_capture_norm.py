"""Probe: instance-norm backward captured in a CUDA graph vs eager (device run 2 saw dgamma = 0 on replay)."""

import numpy as np
import torch

import fusekit
from fusekit import ops

rng = np.random.default_rng(0)


def t(shape, dtype=torch.float16, pos=False):
    a = rng.standard_normal(shape).astype(np.float32)
    a = np.abs(a) + 0.5 if pos else a
    x = torch.from_numpy(a).cuda().to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 and dtype == torch.float16 else x


x, dy = t((4, 8, 6, 6)), t((4, 8, 6, 6))
g, b = t((8,), torch.float32, True), t((8,), torch.float32)
y, mean, inv = ops.instancenorm(x, g, b)
print("fwd plan", fusekit.plan_for("instancenorm", x, g, b).engine)
print("bwd plan", fusekit.plan_for("instancenorm_backward", dy, x, g, mean, inv).engine,
      "ws", fusekit.plan_for("instancenorm_backward", dy, x, g, mean, inv).workspace_size)
print("mean/inv shapes", tuple(mean.shape), tuple(inv.shape), mean.dtype)


def bwd():
    return ops.instancenorm_backward(dy, x, g, mean, inv)


ref = [r.clone() for r in bwd()]
torch.cuda.synchronize()
for mode in ("side-stream warm-up, default capture stream", "warm-up on the capture stream"):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        bwd()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    kw = {} if mode.startswith("side") else {"stream": s}
    with torch.cuda.graph(gr, **kw):
        out = bwd()
    gr.replay()
    torch.cuda.synchronize()
    for name, o, r in zip(("dx", "dgamma", "dbeta"), out, ref):
        err = float((o.double() - r.double()).norm() / r.double().norm())
        print(f"[{mode}] {name}: rel err {err:.2e}, |out| {float(o.double().norm()):.3e}")
# same backward through a CuPy stream capture
try:
    import cupy as cp

    cx, cdy, cg, cm, ci = (cp.from_dlpack(a) for a in (x, dy, g, mean, inv))
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        ops.instancenorm_backward(cdy, cx, cg, cm, ci)
        st.synchronize()
        st.begin_capture()
        out = ops.instancenorm_backward(cdy, cx, cg, cm, ci)
        graph = st.end_capture()
        graph.launch(st)
        st.synchronize()
    for name, o, r in zip(("dx", "dgamma", "dbeta"), out, ref):
        o = torch.from_dlpack(o)
        print(f"[cupy] {name}: rel err {float((o.double() - r.double()).norm() / r.double().norm()):.2e}")
except Exception as e:  # noqa: BLE001
    print("cupy probe failed:", type(e).__name__, e)
