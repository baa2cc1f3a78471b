"""The floor of a native per-layer path: a fusekit plan executed from C++ (native/native_layer.cpp).

The uncaptured training step is bound by the layers' Python (NOTES, 2026-12-04 second session). This
builds a torch extension against the C++ headers the frontend wheel ships (site-packages/include:
cudnn_frontend's graph API, header-only), deserializes the bytes fusekit stores for a plan, and
times one call that allocates the output and executes, against fusekit's Python call (the native
pointer-array entry included) and PyTorch eager, each allocating its output. The first run also
says what the build needed (cuDNN's, CUDA's and NVRTC's headers; a compile of a minute or two).

Prediction (2026-12-04, not yet run): native ~8-10 us per call, fusekit ~15 us, eager ~15-20 us on the
small conv; outputs equal to fusekit's bit for bit (same plan, same kernel).

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from torch.utils.cpp_extension import load

    t0 = time.perf_counter()
    native = load(
        name="fusekit_native_layer_probe", sources=[os.path.join(HERE, "native", "native_layer.cpp")],
        extra_include_paths=header_dirs(), extra_cflags=["-O2", "-DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING"], verbose=False,
    )
    print(f"extension built in {time.perf_counter() - t0:.1f} s", flush=True)
    libs = [p for r in sys.path for p in glob.glob(os.path.join(r, "nvidia", "cudnn", "lib", "libcudnn.so.9"))]
    print("cuDNN for the extension: " + native.open_cudnn(libs[0] if libs else "libcudnn.so.9"), flush=True)

    cl = torch.channels_last
    for n, c, hw, k in ((8, 64, 7, 64), (64, 256, 14, 256)):
        x = torch.randn(n, c, hw, hw, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        w = (torch.randn(k, c, 3, 3, device="cuda", dtype=torch.float16) / (3 * c ** 0.5)).contiguous(memory_format=cl)
        dispatch.clear_dispatch()
        y = ops.conv2d(x, w, padding=(1, 1))
        y = ops.conv2d(x, w, padding=(1, 1))
        (call,) = list(dispatch._FAST.values())
        h = call.handle.backend_handle
        pid = native.load(h, call.plan.graph.serialize(as_bytes=True), list(call.uids))
        assert native.workspace_size(pid) <= call.workspace.size, "the stored plan needs a larger workspace"
        shape = list(y.shape)
        ws = call.workspace.ptr
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


if __name__ == "__main__":
    torch.backends.cudnn.benchmark = True
    main()
