"""Probe of frontend 1.32's norm nodes on the GPU: batchnorm (training), inference, backward,
genstats, layernorm/instancenorm, and pointwise scale/shift + reductions in one graph."""
import traceback
import numpy as np
import torch, cudnn

dev = "cuda"
h = cudnn.create_handle()
cudnn.set_stream(h, torch.cuda.current_stream().cuda_stream)
N, C, H, W = 8, 64, 14, 14
F = cudnn.data_type.FLOAT
HALF = cudnn.data_type.HALF


def nhwc(shape):
    n, c, hh, ww = shape
    return [hh * ww * c, 1, ww * c, c]


def try_(name, fn):
    try:
        fn()
        print(f"[ok] {name}")
    except Exception as e:
        print(f"[FAIL] {name}: {type(e).__name__}: {str(e)[:400]}")
        traceback.print_exc(limit=2)


x = torch.randn(N, C, H, W, device=dev).half().contiguous(memory_format=torch.channels_last)
scale = torch.rand(1, C, 1, 1, device=dev) + 0.5
bias = torch.randn(1, C, 1, 1, device=dev)
rm = torch.zeros(1, C, 1, 1, device=dev)
rv = torch.ones(1, C, 1, 1, device=dev)


def bn_train(eps_mode):
    g = cudnn.pygraph(io_data_type=HALF, intermediate_data_type=F, compute_data_type=F, handle=h)
    X = g.tensor(name="x", dim=[N, C, H, W], stride=nhwc([N, C, H, W]), data_type=HALF)
    S = g.tensor(name="s", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=F)
    B = g.tensor(name="b", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=F)
    RM = g.tensor(name="rm", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=F)
    RV = g.tensor(name="rv", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=F)
    if eps_mode == "pbv":
        E = g.tensor(name="eps", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=F, is_pass_by_value=True)
        M = g.tensor(name="mom", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=F, is_pass_by_value=True)
    else:
        E = g.tensor_scalar(1e-5, cudnn.data_type.FLOAT, name="eps")
        M = g.tensor_scalar(0.1, cudnn.data_type.FLOAT, name="mom")
    outs = g.batchnorm(X, S, B, in_running_mean=RM, in_running_var=RV, epsilon=E, momentum=M, name="bn")
    print("   batchnorm returned", type(outs), len(outs))
    Y, mean, iv, nrm, nrv = outs
    Y.set_output(True).set_data_type(HALF).set_dim([N, C, H, W]).set_stride(nhwc([N, C, H, W]))
    for t in (mean, iv, nrm, nrv):
        t.set_output(True).set_data_type(F).set_dim([1, C, 1, 1]).set_stride([C, 1, C, C])
    R = g.relu(Y, name="relu") if False else None
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    y = torch.empty_like(x)
    mo, ivo, nrmo, nrvo = [torch.empty(1, C, 1, 1, device=dev) for _ in range(4)]
    bufs = [x, scale, bias, rm, rv]
    uids = [X.uid, S.uid, B.uid, RM.uid, RV.uid]
    if eps_mode == "pbv":
        bufs += [np.full((1, 1, 1, 1), 1e-5, np.float32), np.full((1, 1, 1, 1), 0.1, np.float32)]
        uids += [E.uid, M.uid]
    bufs += [y, mo, ivo, nrmo, nrvo]
    uids += [Y.uid, mean.uid, iv.uid, nrm.uid, nrv.uid]
    ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=dev)
    g.execute(bufs, ws, handle=h, tensor_uids=uids)
    torch.cuda.synchronize()
    ref = torch.nn.functional.batch_norm(x.float(), rm.flatten().clone(), rv.flatten().clone(), scale.flatten(), bias.flatten(), True, 0.1, 1e-5)
    print("   y err", float((y.float() - ref).norm() / ref.norm()), "mean err", float((mo.flatten() - x.float().mean((0, 2, 3))).abs().max()))
    rvr = x.float().var((0, 2, 3), unbiased=True) * 0.1 + 0.9
    print("   next_rv err", float((nrvo.flatten() - rvr).abs().max()), "inv_var vs 1/sqrt(var+eps)", float((ivo.flatten() - 1 / torch.sqrt(x.float().var((0, 2, 3), unbiased=False) + 1e-5)).abs().max()))
    try:
        blob = g.serialize(as_bytes=True)
        g2 = cudnn.pygraph(handle=h)
        g2.deserialize(h, blob)
        y.fill_(float("nan"))
        g2.execute(bufs, ws, handle=h, tensor_uids=uids)
        torch.cuda.synchronize()
        print("   deserialized ok, finite:", bool(torch.isfinite(y).all()))
    except Exception as e:
        print("   serialize/deserialize:", type(e).__name__, str(e)[:200])
    return mo, ivo


try_("batchnorm training, eps/momentum pass-by-value numpy", lambda: bn_train("pbv"))
try_("batchnorm training, tensor_scalar", lambda: bn_train("scalar"))


def bn_bwd():
    mean = x.float().mean((0, 2, 3), keepdim=True)
    iv = 1 / torch.sqrt(x.float().var((0, 2, 3), unbiased=False, keepdim=True) + 1e-5)
    g = cudnn.pygraph(io_data_type=HALF, intermediate_data_type=F, compute_data_type=F, handle=h)
    X = g.tensor(name="x", dim=[N, C, H, W], stride=nhwc([N, C, H, W]), data_type=HALF)
    DY = g.tensor(name="dy", dim=[N, C, H, W], stride=nhwc([N, C, H, W]), data_type=HALF)
    S = g.tensor(name="s", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=F)
    M = g.tensor(name="m", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=F)
    IV = g.tensor(name="iv", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=F)
    DX, DS, DB = g.batchnorm_backward(DY, X, S, M, IV, name="bnb")
    DX.set_output(True).set_data_type(HALF).set_dim([N, C, H, W]).set_stride(nhwc([N, C, H, W]))
    DS.set_output(True).set_data_type(F).set_dim([1, C, 1, 1]).set_stride([C, 1, C, C])
    DB.set_output(True).set_data_type(F).set_dim([1, C, 1, 1]).set_stride([C, 1, C, C])
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    dy = torch.randn_like(x)
    dx = torch.empty_like(x)
    ds, db = torch.empty(1, C, 1, 1, device=dev), torch.empty(1, C, 1, 1, device=dev)
    ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=dev)
    g.execute([dy, x, scale, mean, iv, dx, ds, db], ws, handle=h, tensor_uids=[DY.uid, X.uid, S.uid, M.uid, IV.uid, DX.uid, DS.uid, DB.uid])
    torch.cuda.synchronize()
    xr = x.double().requires_grad_(True)
    sr = scale.flatten().double().requires_grad_(True)
    br = bias.flatten().double().requires_grad_(True)
    yr = torch.nn.functional.batch_norm(xr, None, None, sr, br, True, 0.1, 1e-5)
    yr.backward(dy.double())
    print("   dx err", float((dx.double() - xr.grad).norm() / xr.grad.norm()), "dscale err", float((ds.flatten().double() - sr.grad).norm() / sr.grad.norm()))


try_("batchnorm_backward", bn_bwd)


def bn_inf_relu():
    g = cudnn.pygraph(io_data_type=HALF, intermediate_data_type=F, compute_data_type=F, handle=h)
    X = g.tensor(name="x", dim=[N, C, H, W], stride=nhwc([N, C, H, W]), data_type=HALF)
    M = g.tensor(name="m", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=F)
    IV = g.tensor(name="iv", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=F)
    S = g.tensor(name="s", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=F)
    B = g.tensor(name="b", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=F)
    Y = g.batchnorm_inference(X, M, IV, S, B, name="bni")
    R = g.relu(Y, name="r")
    R.set_output(True).set_data_type(HALF).set_dim([N, C, H, W]).set_stride(nhwc([N, C, H, W]))
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    print("   bn_inference+relu built; ws", g.get_workspace_size())


try_("batchnorm_inference + relu", bn_inf_relu)


def pointwise_scale_shift_and_sums():
    g = cudnn.pygraph(io_data_type=HALF, intermediate_data_type=F, compute_data_type=F, handle=h)
    X = g.tensor(name="x", dim=[N, C, H, W], stride=nhwc([N, C, H, W]), data_type=HALF)
    S = g.tensor(name="s", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=F)
    B = g.tensor(name="b", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=F)
    T = g.mul(X, S, name="mul")
    Y = g.add(T, B, name="add")
    R = g.relu(Y, name="relu")
    R.set_output(True).set_data_type(HALF).set_dim([N, C, H, W]).set_stride(nhwc([N, C, H, W]))
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    out = torch.empty_like(x)
    ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=dev)
    g.execute([x, scale, bias, out], ws, handle=h, tensor_uids=[X.uid, S.uid, B.uid, R.uid])
    torch.cuda.synchronize()
    ref = torch.relu(x.float() * scale + bias)
    print("   scale/shift/relu err", float((out.float() - ref).norm() / ref.norm()))


try_("pointwise scale+shift+relu", pointwise_scale_shift_and_sums)


def pointwise_reduction_two_outputs():
    g = cudnn.pygraph(io_data_type=HALF, intermediate_data_type=F, compute_data_type=F, handle=h)
    DY = g.tensor(name="dy", dim=[N, C, H, W], stride=nhwc([N, C, H, W]), data_type=HALF)
    X = g.tensor(name="x", dim=[N, C, H, W], stride=nhwc([N, C, H, W]), data_type=HALF)
    P = g.mul(DY, X, name="p")
    DG = g.reduction(P, mode=cudnn.reduction_mode.ADD, name="dg")
    DG.set_output(True).set_data_type(F).set_dim([1, C, 1, 1]).set_stride([C, 1, C, C])
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    print("   mul -> reduction built")


try_("mul -> reduction (dgamma)", pointwise_reduction_two_outputs)


def genstats():
    g = cudnn.pygraph(io_data_type=HALF, intermediate_data_type=F, compute_data_type=F, handle=h)
    X = g.tensor(name="x", dim=[N, C, H, W], stride=nhwc([N, C, H, W]), data_type=HALF)
    Wt = g.tensor(name="w", dim=[C, C, 3, 3], stride=nhwc([C, C, 3, 3]), data_type=HALF)
    Y = g.conv_fprop(X, Wt, padding=[1, 1], stride=[1, 1], dilation=[1, 1], name="conv")
    Y.set_output(True).set_data_type(HALF).set_dim([N, C, H, W]).set_stride(nhwc([N, C, H, W]))
    SUM, SQ = g.genstats(Y, name="gs")
    for t in (SUM, SQ):
        t.set_output(True).set_data_type(F).set_dim([1, C, 1, 1]).set_stride([C, 1, C, C])
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    print("   conv + genstats built")


try_("conv + genstats", genstats)


def layernorm():
    g = cudnn.pygraph(io_data_type=HALF, intermediate_data_type=F, compute_data_type=F, handle=h)
    X = g.tensor(name="x", dim=[N, C, H, W], stride=nhwc([N, C, H, W]), data_type=HALF)
    S = g.tensor(name="s", dim=[1, C, H, W], stride=nhwc([1, C, H, W]), data_type=F)
    B = g.tensor(name="b", dim=[1, C, H, W], stride=nhwc([1, C, H, W]), data_type=F)
    E = g.tensor(name="eps", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=F, is_pass_by_value=True)
    Y, M, IV = g.layernorm(X, S, B, E, norm_forward_phase=cudnn.norm_forward_phase.TRAINING, name="ln")
    Y.set_output(True).set_data_type(HALF)
    M.set_output(True).set_data_type(F)
    IV.set_output(True).set_data_type(F)
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    print("   layernorm built", M.dim, IV.dim)


try_("layernorm", layernorm)
