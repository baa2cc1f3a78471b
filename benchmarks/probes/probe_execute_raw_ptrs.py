"""Host cost of one cuDNN execute through the frontend's raw-pointer entry, against fusekit's path.

The uncaptured training step is host-bound (NOTES, eighth session: 333 executes a ResNet-50 step,
the frontend's execute 15-25 us of a ~100 us layer). frontend 1.32's lowered (C++) graph has
``_execute_with_raw_ptrs(void*[] in ascending-uid order, n, workspace, handle, plan index)``: one
native crossing with five ints, skipping the pygraph's Python normalization of the operands.

Prediction (2026-12-04): ~5-8 us per execute against 15-25 us for ``graph.execute`` with the same
tensors, i.e. ~3 ms off a ResNet-50 step; the outputs identical. Seen (2026-12-04, run 2): fusekit
33.6 us, execute 22.6, raw 13.2, outputs equal; dispatch now takes the raw entry (lower.native_execute),
and ``fusekit-pygraph`` is its former path. Run 3 (another machine, host ~1.6x faster): fusekit with
the entry 13.5 us, execute 13.0, raw 8.0 (its fusekit-pygraph side toggled the wrong dispatch entry:
fixed, not yet rerun).

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

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from fusekit import dispatch, ops, session  # noqa: E402
from common import per_call_us  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from cudnn._handle import to_backend_handle

    cl = torch.channels_last
    x = torch.randn(8, 64, 7, 7, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = (torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.float16) / 24).contiguous(memory_format=cl)
    dispatch.clear_dispatch()
    y = ops.conv2d(x, w, padding=(1, 1))
    y = ops.conv2d(x, w, padding=(1, 1))
    table = list(session.current().calls.items())
    print(f"dispatch table: {len(table)} entries: {[getattr(getattr(c.plan, 'key', None), 'pattern', type(c.plan).__name__) for _, c in table]}")
    assert table, "the conv call did not enter the dispatch table"
    c = table[-1][1]
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

    ops.conv2d(x, w, padding=(1, 1), out=y)  # the out= call: a dispatch entry of its own
    entries = list(session.current().calls.values())
    natives = [e.native for e in entries]

    def fusekit_pygraph_side() -> None:  # fusekit's dispatch with graph.execute (lower.native_execute off)
        for e in entries:
            e.native = None
        try:
            ops.conv2d(x, w, padding=(1, 1), out=y)
        finally:
            for e, n in zip(entries, natives):
                e.native = n

    print(f"dispatch entries {len(entries)}; each takes the native entry: {[n is not None for n in natives]}")
    sides = {"fusekit": fusekit_side, "fusekit-pygraph": fusekit_pygraph_side, "execute": execute_side, "raw": raw_side}
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
