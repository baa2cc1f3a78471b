"""What the frontend's ``execute`` costs per operand form: the same tensor objects every call (as a
tight loop passes them), a fresh tensor object each call (as a model's activations arrive), and bare
device addresses. Whether torch publishes the DLPack C exchange vtable the frontend reads operands
through natively, and a profile of where a fresh-object execute spends its host time.

    python benchmarks/probes/probe_execute_operands.py
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import timing
from fusekit import dispatch, ops


def main() -> None:
    print(f"torch {torch.__version__}: __dlpack_c_exchange_api__ {hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}")
    cl = torch.channels_last
    x = torch.randn(8, 256, 7, 7, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    w = torch.randn(256, 256, 3, 3, device="cuda", dtype=torch.half).contiguous(memory_format=cl)
    for _ in range(3):
        y = ops.conv2d(x, w, padding=1)
    c = next(c for c in dispatch._FAST.values() if c.plan.key.pattern == "conv")
    g, h, ws, uids = c.graph, c.handle, c.workspace.ptr, c.uids
    px, pw, py = x.data_ptr(), w.data_ptr(), y.data_ptr()
    forms = {
        "same tensor objects": lambda: g.execute((x, w, y), ws, handle=h, tensor_uids=uids),
        "fresh view of the output": lambda: g.execute((x, w, y.view(y.shape)), ws, handle=h, tensor_uids=uids),
        "  (the view alone)": lambda: y.view(y.shape),
        "fresh views of all three": lambda: g.execute((x.view(x.shape), w.view(w.shape), y.view(y.shape)), ws, handle=h, tensor_uids=uids),
        "bare addresses (ints)": lambda: g.execute((px, pw, py), ws, handle=h, tensor_uids=uids),
        "addresses read per call": lambda: g.execute((x.data_ptr(), w.data_ptr(), y.data_ptr()), ws, handle=h, tensor_uids=uids),
        "fusekit ops.conv2d": lambda: ops.conv2d(x, w, padding=1),
        "fusekit ops.conv2d, out=y": lambda: ops.conv2d(x, w, padding=1, out=y),
    }
    for name, fn in forms.items():
        print(f"{name:<28} {timing.host_us(fn):7.1f} us per call", flush=True)
    for name in ("fresh views of all three", "addresses read per call", "fusekit ops.conv2d"):
        fn = forms[name]
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(8)
        print(f"--- profile, {name}, 300 calls:")
        print("\n".join(line for line in s.getvalue().splitlines() if "(" in line and "/" in line or "ncalls" in line))


if __name__ == "__main__":
    main()
