"""Executing a resolved call: bind the handle to its stream, fence a racing epilogue operand, and
bind the arrays' pointers to the plan (:func:`execute`, the one place that does)."""

from __future__ import annotations

from typing import Any, Sequence

from .. import session
from ..engine.lower import load_cudnn
from .calls import Call


def bind(c: Call) -> Any:
    """The call's cudnn.Handle (one per device and thread), set to the call's stream."""
    load_cudnn().set_stream(c.handle, c.stream)
    return c.handle


def execute(c: Call, arrays: Sequence[Any], handle: Any) -> None:
    """Queue the call's plan on ``arrays`` (operands then outputs, in ``c.uids`` order): the one place that
    binds arrays' pointers to a plan."""
    native = c.native
    if native is None:
        c.graph.execute(arrays, c.workspace.ptr, handle=handle, tensor_uids=c.uids)
        return
    fn, ptrs, address, pos, index = native
    ptr = c.out_adapter.ptr
    for i, p in enumerate(pos):
        ptrs[i] = ptr(arrays[p])
    try:
        fn(address, len(pos), c.workspace.ptr, handle.backend_handle, index)
    except TypeError:  # the private entry's signature changed (another 1.32.x): nothing ran; use graph.execute
        c.native = None
        c.graph.execute(arrays, c.workspace.ptr, handle=handle, tensor_uids=c.uids)


def fence_if_racing(c: Call, arrays: Sequence[Any], last_out: dict[int, tuple]) -> None:
    """Queue a fence kernel when an epilogue operand overlaps an output of the graph executed just
    before on this stream. On the H200 with cuDNN 9.19 a
    conv+bias+add+ReLU kernel started before the conv that wrote its residual had finished, when
    the two ran back to back in a CUDA graph (the output off by 1e-2); an ordinary kernel between
    them removed it. Fusekit cannot see other libraries' kernels in between: it fences anyway."""
    last = last_out.get(c.stream)
    if not last:
        return
    ad = c.out_adapter
    for i, n in c.epilogue:
        p = ad.ptr(arrays[i])
        if any(p < q + m and q < p + n for q, m in last):
            ad.fence(c.device)
            return


def execute_relayout(c: Call, operands: tuple, outs: tuple, alloc: bool) -> tuple:
    """Execute ``c`` on channels-last copies of its NCHW arrays; results go back in the caller's layout."""
    ad, n_in = c.out_adapter, len(operands)
    ins = tuple(ad.relayout(a, "NHWC") if i in c.relayout else a for i, a in enumerate(operands))
    tmp = tuple(ad.empty(s) if (alloc or n_in + j in c.relayout) else outs[j] for j, s in enumerate(c.outs))
    execute(c, ins + tmp, bind(c))
    res = []
    for j, t in enumerate(tmp):
        if n_in + j in c.relayout:
            if alloc:
                t = ad.relayout(t, "NCHW")
            else:
                ad.copy_into(outs[j], t)
                t = outs[j]
        res.append(t)
    return tuple(res)


def launch(c: Call, operands: tuple, outs: tuple, alloc: bool) -> tuple:
    """Execute resolved call ``c`` on ``operands`` into ``outs`` (new arrays with ``alloc``); its outputs."""
    s = session.current()
    last_out = s.last_out
    arrays = operands + outs
    if c.epilogue:
        fence_if_racing(c, arrays, last_out)
    if c.relayout:
        outs = execute_relayout(c, operands, outs, alloc)
        last_out.pop(c.stream, None)  # copies back to the caller's layout ran after it
    else:
        if alloc:
            outs = tuple([c.out_adapter.empty(sp) for sp in c.outs])
            arrays = operands + outs
        h = c.handle
        if h.stream != c.stream:
            bind(c)
        execute(c, arrays, h)
        ptr = c.out_adapter.ptr
        last_out[c.stream] = tuple([(ptr(o), n) for o, n in zip(outs, c.out_nbytes)])
    if s.observers:
        for fn in tuple(s.observers):
            fn(c, operands, outs)
    return outs
