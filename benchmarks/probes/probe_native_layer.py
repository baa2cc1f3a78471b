"""The floor of a native per-layer path: a fusekit plan executed from C++ (native/native_layer.cpp).

The uncaptured training step is bound by the layers' Python (NOTES, 2026-12-04 second session). This
builds a torch extension against the C++ headers the frontend wheel ships (site-packages/include:
cudnn_frontend's graph API, header-only), deserializes the bytes fusekit stores for a plan, and
times one call that allocates the output and executes, against fusekit's Python call (the native
pointer-array entry included) and PyTorch eager, each allocating its output. The first run also
says what the build needed (cuDNN's, CUDA's and NVRTC's headers; a compile of a minute or two).

Then one convolution layer's forward + backward: fusekit.torch.Conv2d, a C++ autograd node over the same
three plans (conv, conv_dgrad, conv_wgrad), and torch.nn.Conv2d, gradients compared to eager's.

Prediction (2026-12-04): native ~8-10 us per call, fusekit ~15 us, eager ~15-20 us on the small conv;
outputs equal bit for bit. Seen (2026-12-04, third session, CXX=/usr/bin/g++): small conv native 9.95 us,
fusekit 18.68, eager 15.55, outputs equal; training layer (forward + backward) native 110 us,
fusekit.torch 264, eager 121 (small) and 111 / 221 / 119 (64x256x14x14); gradients equal to eager's.

    python benchmarks/probes/probe_native_layer.py [--calls 2000] [--rounds 5]
    (PROBE_INCLUDE=DIR[:DIR]: more folders to look for the headers in)
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from fusekit import dispatch, ops  # noqa: E402
from common import per_call_us  # noqa: E402


WARMUP = os.environ.get("PROBE_WARMUP", "0") == "1"  # the frontend's throwaway capture after deserialize


def header_dirs() -> list[str]:
    """Include folders for the frontend's headers, cuDNN's, NVRTC's and CUDA's runtime; exits naming any missing."""
    import cudnn
    from torch.utils.cpp_extension import CUDA_HOME

    roots = [os.path.dirname(os.path.dirname(cudnn.__file__))] + [p for p in sys.path if os.path.isdir(p)]
    want = {"cudnn_frontend.h": None, "cudnn.h": None, "nvrtc.h": None, "cuda_runtime_api.h": None}
    cands = [os.path.join(r, "include") for r in roots] + [os.path.join(CUDA_HOME or "/usr/local/cuda", "include")]
    cands += [d for r in roots for d in glob.glob(os.path.join(r, "nvidia", "*", "include"))]
    cands += [d for r in roots for d in glob.glob(os.path.join(r, "nvidia", "*", "*", "include"))]
    cands += [d for d in os.environ.get("PROBE_INCLUDE", "").split(os.pathsep) if d]  # e.g. a carried folder of headers
    for name in want:
        want[name] = next((d for d in cands if os.path.isfile(os.path.join(d, name))), None)
    missing = [n for n, d in want.items() if d is None]
    print("headers: " + ", ".join(f"{n} in {d}" for n, d in want.items()), flush=True)
    if missing:
        sys.exit(f"probe_native_layer: no {', '.join(missing)} on this machine (looked in {len(cands)} folders)")
    return sorted({d for d in want.values() if d})


def build_native():
    """Build (or reuse) and import the probe's extension, pointed at the process's libcudnn. Exits when
    the compiler linked its own libstdc++ statically (a wrapper such as /opt/gcc/bin/g++ on the lent
    machine does): that copy's locale facets crash the frontend's first stringstream (seen: a segfault
    in ExecutionPlan_v8::buildTag); set CXX=/usr/bin/g++ then."""
    import subprocess

    from torch.utils.cpp_extension import load

    # the frontend opens libcudart itself (12 before 13 unless told): the one torch runs on
    os.environ.setdefault("CUDNN_FRONTEND_CUDART_LIB_NAME", f"libcudart.so.{(torch.version.cuda or '13').split('.')[0]}")
    t0 = time.perf_counter()
    native = load(
        name="fusekit_native_layer_probe", sources=[os.path.join(HERE, "native", "native_layer.cpp")],
        extra_include_paths=header_dirs(), extra_cflags=["-O2", "-DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING"], verbose=False,
    )
    print(f"extension built in {time.perf_counter() - t0:.1f} s (CXX={os.environ.get('CXX', 'c++')})", flush=True)
    needed = subprocess.run(["ldd", native.__file__], capture_output=True, text=True).stdout
    if "libstdc++" not in needed:
        sys.exit(f"probe_native_layer: {native.__file__} carries its own libstdc++ (statically linked); rebuild with CXX=/usr/bin/g++")
    libs = [p for r in sys.path for p in glob.glob(os.path.join(r, "nvidia", "cudnn", "lib", "libcudnn.so.9"))]
    print("cuDNN for the extension: " + native.open_cudnn(libs[0] if libs else "libcudnn.so.9"), flush=True)
    return native


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    native = build_native()

    cl = torch.channels_last
    for n, c, hw, k in ((8, 64, 7, 64), (64, 256, 14, 256)):
        x = torch.randn(n, c, hw, hw, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        w = (torch.randn(k, c, 3, 3, device="cuda", dtype=torch.float16) / (3 * c ** 0.5)).contiguous(memory_format=cl)
        dispatch.clear_dispatch()
        y = ops.conv2d(x, w, padding=(1, 1))
        y = ops.conv2d(x, w, padding=(1, 1))
        (call,) = list(dispatch._FAST.values())
        print(f"fusekit conv ran; loading its plan ({call.plan.engine}) natively", flush=True)
        h = call.handle.backend_handle
        pid = native.load(h, call.plan.graph.serialize(as_bytes=True), list(call.uids), WARMUP)
        assert native.workspace_size(pid) <= call.workspace.size, "the stored plan needs a larger workspace"
        shape = list(y.shape)
        ws = call.workspace.ptr
        print("loaded; running", flush=True)
        yn = native.run(pid, h, [x, w], shape, ws)
        torch.cuda.synchronize()
        print(f"conv {n}x{c}x{hw}x{hw} -> {k}, 3x3: plan {call.plan.engine}; native output equal to fusekit's: "
              f"{bool(torch.equal(yn, y))}", flush=True)
        sides = {
            "fusekit": lambda: ops.conv2d(x, w, padding=(1, 1)),
            "native": lambda: native.run(pid, h, [x, w], shape, ws),
            "eager": lambda: torch.nn.functional.conv2d(x, w, padding=1),
            "alloc only": lambda: torch.empty_like(y),
        }
        times: dict[str, list[float]] = {s: [] for s in sides}
        for _ in range(args.rounds):
            for s, fn in sides.items():
                times[s].append(per_call_us(fn, args.calls))
        for s, ts in times.items():
            print(f"  {s:10s} {statistics.median(ts):7.2f} us per call (rounds {', '.join(f'{t:.1f}' for t in ts)})", flush=True)
        train_layer(native, x, w, args)


def conv_plans(native, x: torch.Tensor, w: torch.Tensor, **conv) -> tuple | None:
    """The three plans fusekit runs for a bias-free conv layer's forward and backward (conv, conv_dgrad,
    conv_wgrad), found by running fusekit's own path once and loaded into the extension:
    (plan ids, backend handle, workspace pointer, output shape); None when that path ran other graphs
    (channels-last copies, other routes) or the stored plans need a larger workspace."""
    seen = []
    real = dispatch._execute

    def record(c, arrays, handle):
        seen.append(c)
        real(c, arrays, handle)

    dispatch._execute = record
    try:
        with torch.no_grad():
            y = ops.conv2d(x, w, **conv)
            ops.conv2d_backward(torch.randn_like(y), x, w, needs=(True, True), **conv)
    finally:
        dispatch._execute = real
    if [c.plan.key.pattern for c in seen] != ["conv", "conv_dgrad", "conv_wgrad"] or any(c.relayout for c in seen):
        return None
    ws = max((c.workspace for c in seen), key=lambda w: w.size)
    h = seen[0].handle.backend_handle
    ids = [native.load(h, c.plan.graph.serialize(as_bytes=True), list(c.uids), WARMUP) for c in seen]
    if max(native.workspace_size(i) for i in ids) > ws.size:
        return None
    return ids, h, ws.ptr, list(y.shape)


def train_layer(native, x: torch.Tensor, w: torch.Tensor, args: argparse.Namespace) -> None:
    """Forward + backward of one bias-free 3x3 convolution: fusekit.torch.Conv2d, the C++ autograd
    node over the same three plans (conv, conv_dgrad, conv_wgrad), and torch.nn.Conv2d; gradients compared."""
    import fusekit.torch as ft

    k, c = int(w.shape[0]), int(w.shape[1])
    cl = torch.channels_last
    dy = torch.randn(x.shape[0], k, x.shape[2], x.shape[3], device="cuda", dtype=x.dtype).contiguous(memory_format=cl)
    found = conv_plans(native, x, w, padding=(1, 1))
    assert found is not None, "fusekit ran other graphs than conv, conv_dgrad, conv_wgrad (or needs a larger workspace)"
    ids, h, ws_ptr, shape = found
    xs = x.detach().clone().requires_grad_(True)
    fk = ft.Conv2d(c, k, 3, padding=1, bias=False).cuda().to(dtype=x.dtype, memory_format=cl)
    eager = torch.nn.Conv2d(c, k, 3, padding=1, bias=False).cuda().to(dtype=x.dtype, memory_format=cl)
    wn = w.detach().clone().requires_grad_(True)
    with torch.no_grad():
        fk.weight.copy_(w)
        eager.weight.copy_(w)

    def step(fn):
        def go():
            xs.grad = None
            fn(xs).backward(dy)
        return go

    sides = {
        "fusekit.torch": step(fk),
        "native": step(lambda t: native.conv(t, wn, ids, h, ws_ptr, shape)),
        "eager": step(eager),
    }
    grads = {}
    for s, go in sides.items():
        fk.weight.grad = eager.weight.grad = wn.grad = None
        go()
        torch.cuda.synchronize()
        grads[s] = (xs.grad.double(), {"fusekit.torch": fk.weight, "native": wn, "eager": eager.weight}[s].grad.double())
    for s in ("fusekit.torch", "native"):
        dx_err = float((grads[s][0] - grads["eager"][0]).norm() / grads["eager"][0].norm())
        dw_err = float((grads[s][1] - grads["eager"][1]).norm() / grads["eager"][1].norm())
        print(f"  train {s}: dx {dx_err:.1e}, dw {dw_err:.1e} relative to eager's", flush=True)
    times: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(args.rounds):
        for s, go in sides.items():
            times[s].append(per_call_us(go, max(args.calls // 4, 50)))
    for s, ts in times.items():
        print(f"  train {s:13s} {statistics.median(ts):7.2f} us per forward + backward (rounds {', '.join(f'{t:.1f}' for t in ts)})",
              flush=True)


if __name__ == "__main__":
    torch.backends.cudnn.benchmark = True
    main()
