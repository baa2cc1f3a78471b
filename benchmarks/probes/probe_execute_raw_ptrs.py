"""Host cost of one cuDNN execute through the frontend's raw-pointer entry, against fusekit's path.

The uncaptured training step is host-bound (NOTES, eighth session: 333 executes a ResNet-50 step,
the frontend's execute 15-25 us of a ~100 us layer). frontend 1.32's lowered (C++) graph has
``_execute_with_raw_ptrs(void*[] in ascending-uid order, n, workspace, handle, plan index)``: one
native crossing with five ints, skipping the pygraph's Python normalization of the operands.

Prediction (2026-12-04, not yet run): ~5-8 us per execute against 15-25 us for ``graph.execute``
with the same tensors, i.e. ~3 ms off a ResNet-50 step; the outputs identical.

Sides, one small channels-last float16 conv (GPU time well under the host's), tight loops of
--calls, medians of --rounds alternated: ``fusekit`` (ops.conv2d with out=), ``execute`` (the
pygraph's execute as fusekit's dispatch calls it), ``raw`` (pointers written into a ctypes array,
then _execute_with_raw_ptrs).

    python benchmarks/probes/probe_execute_raw_ptrs.py [--calls 2000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from fusekit import dispatch, ops  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from cudnn._handle import to_backend_handle

    cl = torch.channels_last
    x = torch.randn(8, 64, 7, 7, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = (torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.float16) / 24).contiguous(memory_format=cl)
    y = ops.conv2d(x, w, padding=(1, 1))
    calls = [c for c in dispatch._FAST.values() if c.plan.key.pattern == "conv"]
    assert len(calls) == 1, f"expected one conv call in the dispatch table, got {len(calls)}"
    c = calls[0]
    arrays = (x, w, y)
    lowered = c.graph._lowered_graph
    lowered._prepare_variant_pack_template()
    order = list(lowered._get_variant_pack_uids_sorted())
    pos = [list(c.uids).index(u) for u in order]
    ptrs = (ctypes.c_void_p * len(order))()
    address = ctypes.addressof(ptrs)
    handle = to_backend_handle(c.handle)
    ws = c.workspace.ptr
    print(f"plan {c.plan.engine}; uids {c.uids}, backend order {order}; workspace {c.plan.workspace_size} B")

    def fusekit_side() -> None:
        ops.conv2d(x, w, padding=(1, 1), out=y)

    def execute_side() -> None:
        c.graph.execute(arrays, ws, handle=c.handle, tensor_uids=c.uids)

    def raw_side() -> None:
        for i, p in enumerate(pos):
            ptrs[i] = arrays[p].data_ptr()
        lowered._execute_with_raw_ptrs(address, len(order), ws, handle, -1)

    sides = {"fusekit": fusekit_side, "execute": execute_side, "raw": raw_side}
    ref = y.clone()
    for name, fn in sides.items():
        y.zero_()
        fn()
        torch.cuda.synchronize()
        print(f"{name}: output equal to fusekit's first: {bool(torch.equal(y, ref))}")
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            times[name].append(per_call_us(fn, args.calls))
    for name, ts in times.items():
        print(f"{name:8s} {statistics.median(ts):7.2f} us per call (rounds {', '.join(f'{t:.1f}' for t in ts)})")


if __name__ == "__main__":
    main()
