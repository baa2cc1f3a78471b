"""Which forms of a constant does cuDNN's pointwise runtime fusion compile on this GPU? relu6(x + 3)
with 3 as a RUNTIME_PARAM scalar, a pass-by-value host tensor, or a (1,1,1,1) device tensor; alone
and as a conv epilogue. And the squeeze-excitation multiply x * s, s (N, C, 1, 1), in half and float."""
import torch, cudnn

torch.manual_seed(0)
h = cudnn.create_handle()
cudnn.set_stream(handle=h, stream=torch.cuda.current_stream().cuda_stream)
HALF, FLOAT = cudnn.data_type.HALF, cudnn.data_type.FLOAT
cl = lambda t: t.contiguous(memory_format=torch.channels_last)  # noqa: E731


def run(tag, build):
    try:
        g = cudnn.pygraph(io_data_type=HALF, intermediate_data_type=FLOAT, compute_data_type=FLOAT, handle=h)
        pack, y, ref = build(g)
        g.validate(); g.build_operation_graph(); g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support(); g.build_plans()
        ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
        g.execute(pack, ws, handle=h); torch.cuda.synchronize()
        print(f"{tag}: OK rel_err {float((y.float() - ref).norm() / ref.norm()):.1e}")
    except Exception as e:  # noqa: BLE001
        print(f"{tag}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}")


x = cl(torch.randn(8, 32, 14, 14, device="cuda").half() * 3)
w = cl(torch.randn(32, 32, 3, 3, device="cuda").half() * 0.1)


def const(g, kind):
    if kind == "scalar":
        return g.tensor_scalar(3.0, cudnn.scalar_type.RUNTIME_PARAM, name="three").set_dim([1] * 4).set_stride([1] * 4), {}
    if kind == "scalar_f32":  # a NumPy float32 value: the binding's float overload, if it picks by type
        import numpy as np
        return g.tensor_scalar(np.float32(3.0), cudnn.scalar_type.RUNTIME_PARAM, name="three"), {}
    if kind == "scalar_plain":  # as created, no dims set afterwards
        return g.tensor_scalar(3.0, cudnn.scalar_type.RUNTIME_PARAM, name="three"), {}
    if kind == "host":
        t = torch.full((1, 1, 1, 1), 3.0)
        T = g.tensor(name="three", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=FLOAT, is_pass_by_value=True)
        return T, {T: t}
    t = torch.full((1, 1, 1, 1), 3.0, device="cuda")
    T = g.tensor(name="three", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=FLOAT)
    return T, {T: t}


for kind in ("scalar", "scalar_f32", "scalar_plain", "host", "device"):
    for conv in (False, True):
        def build(g, kind=kind, conv=conv):
            X = g.tensor(name="x", dim=list(x.shape), stride=list(x.stride()), data_type=HALF)
            pack = {X: x}
            inp = X
            ref_in = x.float()
            if conv:
                W = g.tensor(name="w", dim=list(w.shape), stride=list(w.stride()), data_type=HALF)
                pack[W] = w
                inp = g.conv_fprop(image=X, weight=W, padding=[1, 1], stride=[1, 1], dilation=[1, 1], compute_data_type=FLOAT)
                ref_in = torch.nn.functional.conv2d(x.float(), w.float(), padding=1)
            C, extra = const(g, kind)
            pack.update(extra)
            Y = g.relu(input=g.add(a=inp, b=C), upper_clip=6.0)
            y = cl(torch.empty_like(x))
            Y.set_output(True).set_data_type(HALF).set_dim(list(y.shape)).set_stride(list(y.stride()))
            pack[Y] = y
            return pack, y, torch.clamp(ref_in + 3, 0, 6)
        run(f"relu6(x + 3) const={kind} conv_epilogue={conv}", build)

for sdt in (HALF, FLOAT):
    def build(g, sdt=sdt):
        s = (torch.rand(8, 32, 1, 1, device="cuda")).to(torch.half if sdt == HALF else torch.float)
        X = g.tensor(name="x", dim=list(x.shape), stride=list(x.stride()), data_type=HALF)
        S = g.tensor(name="s", dim=list(s.shape), stride=list(s.stride()), data_type=sdt)
        Y = g.mul(a=X, b=S)
        y = cl(torch.empty_like(x))
        Y.set_output(True).set_data_type(HALF).set_dim(list(y.shape)).set_stride(list(y.stride()))
        return {X: x, S: s, Y: y}, y, x.float() * s.float()
    run(f"gate x * s(N,C,1,1) s={sdt}", build)
