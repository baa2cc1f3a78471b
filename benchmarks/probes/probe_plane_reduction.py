"""Can cuDNN compute squeeze-excitation's global average pool in a graph on this GPU? A reduction of
x (N, C, H, W) to (N, C, 1, 1): alone, and as a second output of conv + bias + SiLU (1x1 and depthwise
3x3), in float32 and half; and the gate x * s folded into a convolution's input. Timed against
torch.mean over (H, W) (CUDA events, median of 20)."""
import statistics

import torch, cudnn

torch.manual_seed(0)
h = cudnn.create_handle()
cudnn.set_stream(handle=h, stream=torch.cuda.current_stream().cuda_stream)
HALF, FLOAT = cudnn.data_type.HALF, cudnn.data_type.FLOAT
cl = lambda t: t.contiguous(memory_format=torch.channels_last)  # noqa: E731


def ms(fn):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(21)]
    fn(); fn()
    ev[0].record()
    for e in ev[1:]:
        fn(); e.record()
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(20))


def run(tag, build):
    try:
        g = cudnn.pygraph(io_data_type=HALF, intermediate_data_type=FLOAT, compute_data_type=FLOAT, handle=h)
        pack, checks = build(g)
        g.validate(); g.build_operation_graph(); g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support(); g.build_plans()
        ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
        go = lambda: g.execute(pack, ws, handle=h)  # noqa: E731
        go(); torch.cuda.synchronize()
        errs = " ".join(f"{n} {float((y.float() - r).norm() / r.norm()):.1e}" for n, y, r in checks)
        print(f"{tag}: OK {g.get_execution_plan_count()} plans, rel_err {errs}, {ms(go):.4f} ms")
    except Exception as e:  # noqa: BLE001
        print(f"{tag}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def T(g, name, t, dt=HALF):
    return g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=dt)


def out(Y, t, dt=HALF):
    Y.set_output(True).set_data_type(dt).set_dim(list(t.shape)).set_stride(list(t.stride()))


for (n, c, hw) in ((32, 32, 112), (32, 96, 56), (32, 480, 14)):
    x = cl(torch.randn(n, c, hw, hw, device="cuda").half())
    ref = x.float().sum((2, 3), keepdim=True)
    print(f"--- x {n}x{c}x{hw}x{hw}: torch.mean over (H, W) {ms(lambda: torch.mean(x, (2, 3), keepdim=True)):.4f} ms, "
          f"F.adaptive_avg_pool2d {ms(lambda: torch.nn.functional.adaptive_avg_pool2d(x, 1)):.4f} ms")
    for sdt in (FLOAT, HALF):
        def alone(g, sdt=sdt):
            X = T(g, "x", x)
            s = cl(torch.empty(n, c, 1, 1, device="cuda", dtype=torch.float if sdt == FLOAT else torch.half))
            S = g.reduction(input=X, mode=cudnn.reduction_mode.ADD)
            out(S, s, sdt)
            return {X: x, S: s}, [("sum", s, ref)]
        run(f"reduction (N,C,1,1) alone out={sdt}", alone)

    for groups in (1, c):
        w = cl(torch.randn(c, c // groups, 1 if groups == 1 else 3, 1 if groups == 1 else 3, device="cuda").half() * 0.1)
        b = cl(torch.randn(1, c, 1, 1, device="cuda").half())
        pad = 0 if groups == 1 else 1
        yref = torch.nn.functional.silu(torch.nn.functional.conv2d(x.float(), w.float(), b.float().flatten(), padding=pad, groups=groups))

        def fused(g, groups=groups, w=w, b=b, pad=pad, yref=yref):
            X, W, B = T(g, "x", x), T(g, "w", w), T(g, "b", b)
            Yc = g.conv_fprop(image=X, weight=W, padding=[pad, pad], stride=[1, 1], dilation=[1, 1], compute_data_type=FLOAT)
            A = g.swish(input=g.bias(input=Yc, bias=B))
            y, s = torch.empty_like(x), cl(torch.empty(n, c, 1, 1, device="cuda"))
            out(A, y)
            S = g.reduction(input=A, mode=cudnn.reduction_mode.ADD)
            out(S, s, FLOAT)
            return {X: x, W: w, B: b, A: y, S: s}, [("y", y, yref), ("sum", s, yref.sum((2, 3), keepdim=True))]
        run(f"conv(groups={groups}) + bias + silu -> y and its (N,C,1,1) sum", fused)

    def gate_prologue(g):
        w = cl(torch.randn(c, c, 1, 1, device="cuda").half() * 0.1)
        s = cl(torch.rand(n, c, 1, 1, device="cuda").half())
        X, S, W = T(g, "x", x), T(g, "s", s), T(g, "w", w)
        Yc = g.conv_fprop(image=g.mul(a=X, b=S), weight=W, padding=[0, 0], stride=[1, 1], dilation=[1, 1], compute_data_type=FLOAT)
        y = torch.empty_like(x)
        out(Yc, y)
        return {X: x, S: s, W: w, Yc: y}, [("y", y, torch.nn.functional.conv2d(x.float() * s.float(), w.float()))]
    run("gate x * s(N,C,1,1) as a 1x1 conv's input", gate_prologue)
