"""Is squeeze-excitation's gate cheaper folded into the 1x1 projection after it? At EfficientNet-B0's
shapes (float16, channels-last, batch 32): (a) y = conv1x1(x * s) as PyTorch runs it (the gate
multiply, then the convolution) against (b) the same as one batched matmul with per-sample weights,
y[n] = x[n] (HW x C) @ (s[n] * W^T) (C x K): the scaled weights are N*C*K elements instead of the
gate's N*H*W*C, so it can only pay where K < H*W. CUDA-graph replays, median of 20; relative error
of each against float64."""
import statistics

import torch

torch.manual_seed(0)
F = torch.nn.functional


def ms(fn):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(21)]
    g.replay(); ev[0].record()
    for e in ev[1:]:
        g.replay(); e.record()
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(20))


# (C expanded, K projected, H = W) of EfficientNet-B0's MBConv blocks
for c, k, hw in ((32, 16, 112), (96, 24, 56), (144, 24, 56), (144, 40, 28), (240, 40, 28), (240, 80, 14), (480, 80, 14),
                 (480, 112, 14), (672, 112, 14), (672, 192, 7), (1152, 192, 7), (1152, 320, 7)):
    n = 32
    x = torch.randn(n, c, hw, hw, device="cuda").half().contiguous(memory_format=torch.channels_last)
    s = torch.rand(n, c, 1, 1, device="cuda").half()
    w = (torch.randn(k, c, 1, 1, device="cuda") / c ** 0.5).half().contiguous(memory_format=torch.channels_last)
    ref = F.conv2d(x.double() * s.double(), w.double())
    xr = x.permute(0, 2, 3, 1).reshape(n, hw * hw, c)  # a view: channels-last rows
    wt = w.reshape(k, c).t()  # (C, K)
    sw = torch.empty(n, c, k, device="cuda", dtype=torch.half)
    yb = torch.empty(n, hw * hw, k, device="cuda", dtype=torch.half)
    out = {}

    def split():
        out["a"] = F.conv2d(x * s, w)

    def folded():
        torch.mul(s.reshape(n, c, 1), wt, out=sw)
        torch.bmm(xr, sw, out=yb)

    ta, tb = ms(split), ms(folded)
    split(); folded(); torch.cuda.synchronize()
    yf = yb.reshape(n, hw, hw, k).permute(0, 3, 1, 2)
    rel = lambda y: float((y.double() - ref).norm() / ref.norm())  # noqa: E731
    print(f"C {c:4} K {k:3} HW {hw:3}: gate + conv {ta:.4f} ms (err {rel(out['a']):.1e}), "
          f"per-sample-weight bmm {tb:.4f} ms (err {rel(yf):.1e}), {ta / tb:.2f}x")
