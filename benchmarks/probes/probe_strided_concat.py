"""Can cuDNN graphs read and write channel slices of a wider channels-last buffer (what copy-free
concatenation needs)? conv+bias+relu and a scale-shift-relu pointwise graph with the input, the
output or both as channel slices; plan count, error against PyTorch and time against dense."""
import statistics
import torch, cudnn

torch.manual_seed(0)
dev = "cuda"
h = cudnn.create_handle()
cudnn.set_stream(handle=h, stream=torch.cuda.current_stream().cuda_stream)
HALF, FLOAT = cudnn.data_type.HALF, cudnn.data_type.FLOAT


def slice_of(n, c, hh, ww, total, off):
    buf = torch.randn(n, hh, ww, total, device=dev, dtype=torch.float16)
    return buf[..., off:off + c].permute(0, 3, 1, 2), buf


def timeit(fn, reps=20):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def planned(g, out, y, pack):
    """Graph ``g`` with ``out`` written into ``y`` (its strides as given), planned (heuristics A, then
    FALLBACK); returns a function that executes it."""
    out.set_output(True).set_data_type(HALF).set_dim(list(y.shape)).set_stride(list(y.stride()))
    g.validate(); g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support(); g.build_plans()
    ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=dev)
    return lambda: g.execute({**pack, out: y}, ws, handle=h)


def conv_case(n, c, hh, k, in_total, out_total):
    x, _ = slice_of(n, c, hh, hh, in_total, 0) if in_total else (torch.randn(n, c, hh, hh, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last), None)
    w = (torch.randn(k, c, 3, 3, device=dev, dtype=torch.float16) * 0.05).contiguous(memory_format=torch.channels_last)
    b = torch.randn(1, k, 1, 1, device=dev, dtype=torch.float16)
    if out_total:
        y, ybuf = slice_of(n, k, hh, hh, out_total, out_total - k)
    else:
        y = torch.empty(n, k, hh, hh, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    g = cudnn.pygraph(io_data_type=HALF, intermediate_data_type=FLOAT, compute_data_type=FLOAT, handle=h)
    X = g.tensor(name="x", dim=list(x.shape), stride=list(x.stride()), data_type=HALF)
    W = g.tensor(name="w", dim=list(w.shape), stride=list(w.stride()), data_type=HALF)
    B = g.tensor(name="b", dim=list(b.shape), stride=list(b.stride()), data_type=HALF)
    C = g.conv_fprop(image=X, weight=W, padding=[1, 1], stride=[1, 1], dilation=[1, 1], compute_data_type=FLOAT)
    R = g.relu(input=g.bias(input=C, bias=B))
    run = planned(g, R, y, {X: x, W: w, B: b})
    before = ybuf.clone() if out_total else None
    run(); torch.cuda.synchronize()
    ref = torch.relu(torch.nn.functional.conv2d(x.float(), w.float(), b.flatten().float(), padding=1))
    err = float((y.float() - ref).norm() / ref.norm())
    untouched = True if not out_total else bool(torch.equal(ybuf[..., : out_total - k], before[..., : out_total - k]))
    return g.get_execution_plan_count(), err, untouched, timeit(run)


def pointwise_case(n, c, hh, in_total):
    x, _ = slice_of(n, c, hh, hh, in_total, 0)
    s = torch.rand(1, c, 1, 1, device=dev, dtype=torch.float32) + 0.5
    t = torch.rand(1, c, 1, 1, device=dev, dtype=torch.float32) - 0.5
    y = torch.empty(n, c, hh, hh, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    g = cudnn.pygraph(io_data_type=HALF, intermediate_data_type=FLOAT, compute_data_type=FLOAT, handle=h)
    X = g.tensor(name="x", dim=list(x.shape), stride=list(x.stride()), data_type=HALF)
    S = g.tensor(name="s", dim=list(s.shape), stride=list(s.stride()), data_type=FLOAT)
    T = g.tensor(name="t", dim=list(t.shape), stride=list(t.stride()), data_type=FLOAT)
    R = g.relu(input=g.add(a=g.mul(a=X, b=S), b=T))
    run = planned(g, R, y, {X: x, S: s, T: t})
    run(); torch.cuda.synchronize()
    ref = torch.relu(x.float() * s + t)
    return g.get_execution_plan_count(), float((y.float() - ref).norm() / ref.norm()), timeit(run)


for n, c, hh, k, tot in [(32, 128, 56, 32, 256), (32, 512, 28, 32, 512 + 32), (32, 96, 14, 32, 1024)]:
    for name, it, ot in [("dense", 0, 0), ("in slice", tot, 0), ("out slice", 0, tot), ("both", tot, tot)]:
        try:
            plans, err, untouched, ms = conv_case(n, c, hh, k, it and max(it, c + 32), ot)
            print(f"conv3x3 n{n} c{c} {hh}x{hh} k{k} {name:9s} total {tot}: plans {plans} rel_err {err:.1e} others untouched {untouched} {ms:.4f} ms")
        except Exception as e:  # noqa: BLE001
            print(f"conv3x3 n{n} c{c} {hh}x{hh} k{k} {name:9s} total {tot}: REFUSED {type(e).__name__}: {str(e)[:300]}")
    for tot2 in (c, tot if tot > c else c + 32):
        try:
            plans, err, ms = pointwise_case(n, c, hh, tot2)
            print(f"scale-shift-relu n{n} c{c} {hh}x{hh} in total {tot2}: plans {plans} rel_err {err:.1e} {ms:.4f} ms")
        except Exception as e:  # noqa: BLE001
            print(f"scale-shift-relu n{n} c{c} {hh}x{hh} in total {tot2}: REFUSED {type(e).__name__}: {str(e)[:300]}")
