"""Split-attention (ResNeSt) and selective-kernel (SKNet) blocks without 5-D tensors.

Both blocks hold r paths of C channels as one (N, r, C, H, W) tensor, made by ``stack`` of the paths
or by viewing an (N, r*C, H, W) image, weigh it by a softmax over the r paths and sum it over them.
The rule here rewrites each ``sum(dim=1)`` of such a tensor into what it is per path: channel slices
(views), per-path gates (the channel multiply) and adds, so only image stages remain; a softmax over
the paths of an (N, r*C, 1, 1) vector becomes one ``radix_softmax`` stage (fusekit's kernel, ``pool.radix_softmax``) whose
channel slices are the paths' gates.
"""

from __future__ import annotations

from typing import Any

from .ir import Ref, Stage, torch_fallback

SUMS = ("sum", "Tensor.sum")
VIEWS = ("Tensor.reshape", "Tensor.view", "reshape", "view")


def radix_softmax_stage(name: str, z: str, output: str, radix: int, cardinality: int) -> Stage:
    """One ``radix_softmax`` stage (fusekit's kernel) of vector ``z``."""
    return Stage("radix_softmax", [z], output, attrs={"radix": int(radix), "cardinality": int(cardinality)}, name=name)


def _dim(s: Stage) -> Any:
    args, kw = s.attrs.get("args") or [], s.attrs.get("kwargs") or {}
    return kw.get("dim", args[1] if len(args) > 1 else None)


def radix_sum(c: Any, s: Stage) -> list | None:
    """The paths summed by ``s`` (a ``sum`` over dim 1 of an (N, r, C, H, W) value), or None."""
    if s.kind != "torch" or s.attrs.get("op") not in SUMS or _dim(s) not in (1, (1,), [1]) or s.attrs.get("kwargs", {}).get("keepdim"):
        return None
    x = tuple(s.in_shapes[0]) if s.in_shapes else ()
    if len(x) != 5 or tuple(s.out_shape) != x[:1] + x[2:]:
        return None
    return _parts(c, s.inputs[0], x[1])


def _parts(c: Any, value: str, r: int) -> list | None:
    """How the r paths of 5-D ``value`` are made: ("value", name) each, ("slice", image, first, C),
    ("mul", part, part) or ("softmax", vector, r, first, C); None if not so."""
    p = c.producer(value)
    if p is None or len(p.out_shape) != 5:
        return None
    n, rr, ch = p.out_shape[:3]
    if p.kind == "torch" and p.attrs.get("op") == "stack" and _dim(p) in (1, None) and len(p.inputs) == r:
        return [("value", v) for v in p.inputs] if all(len(c.shapes[v]) == 4 for v in p.inputs) else None
    if p.kind == "torch" and p.attrs.get("op") in VIEWS and len(p.in_shapes[0]) == 4:
        x = tuple(p.in_shapes[0])
        if x[0] == n and x[1] == r * ch and x[2:] == tuple(p.out_shape[3:]):
            return [("slice", p.inputs[0], i * ch, ch) for i in range(r)]
        return None
    if p.kind == "mul" and len(p.inputs) == 2:
        a, b = (_parts(c, v, r) for v in p.inputs)
        return None if a is None or b is None else [("mul", pa, pb) for pa, pb in zip(a, b)]
    if p.kind == "softmax" and int(p.attrs.get("axis", -1)) == 1 and tuple(p.out_shape[3:]) == (1, 1):
        z = _parts(c, p.inputs[0], r)
        if z is None or any(k[0] != "slice" or k[1] != z[0][1] for k in z):
            return None
        return [("softmax", z[0][1], r, first, size) for _, _, first, size in z]
    return None


def rewrite_radix_sum(c: Any, s: Stage, parts: list) -> None:
    """``s`` becomes per-path stages ending in an add chain named as ``s``'s output; stages left
    unread are dropped."""
    made: list[Stage] = []
    names = [_materialize(c, s, part, f"{s.output}_p{i}", made) for i, part in enumerate(parts)]
    total = names[0]
    for i, v in enumerate(names[1:], 1):
        out = s.output if i == len(names) - 1 else f"{s.output}_sum{i}"
        made.append(Stage("add", [total, v], out, out_shape=tuple(s.out_shape), name=f"{s.name}+path{i}"))
        c.shapes[out] = tuple(s.out_shape)
        total = out
    at = c.stages.index(s)
    c.stages[at:at + 1] = made
    c.drop_unread()


def _materialize(c: Any, s: Stage, part: tuple, name: str, made: list[Stage]) -> str:
    kind = part[0]
    if kind == "value":
        return part[1]
    if kind == "slice":
        return _slice(c, part[1], part[2], part[3], made)
    if kind == "softmax":
        _, z, r, first, size = part
        soft = f"{z}_radix_softmax"
        if soft not in c.shapes:
            st = radix_softmax_stage(soft, z, soft, int(r), 1)
            st.out_shape = c.shapes[soft] = c.shapes[z]
            made.append(st)
        return _slice(c, soft, first, size, made)
    a, b = (_materialize(c, s, p, f"{name}{k}", made) for k, p in (("a", part[1]), ("b", part[2])))
    sa, sb = c.shapes[a], c.shapes[b]
    c.shapes[name] = tuple(max(x, y) for x, y in zip(sa, sb))
    made.append(Stage("mul", [a, b], name, out_shape=c.shapes[name], name=f"{s.name}+gate"))
    return name


def _slice(c: Any, x: str, first: int, size: int, made: list[Stage]) -> str:
    """The value of channels [first, first + size) of image ``x``: a channel_slice stage, made once."""
    import torch

    name = f"{x}_ch{first}_{size}"
    if name not in c.shapes:
        st = torch_fallback(name, [x], name, torch.narrow, [Ref(x), 1, int(first), int(size)], reason="channel slice")
        st.attrs["channel_slice"] = int(first)
        n, _, h, w = c.shapes[x]
        st.out_shape = c.shapes[name] = (n, int(size), h, w)
        made.append(st)
    return name


def radix_softmax_chain(c: Any, s: Stage) -> tuple | None:
    """ResNeSt's rSoftMax as traced, ending at ``s``: (N, K, 1, 1) z -> view (N, card, r, C) ->
    transpose(1, 2) -> softmax over dim 1 -> (N, K) -> view (N, K, 1, 1); (z, r, card, the chain's
    stages) or None. Every value in between is read once."""
    if s.kind != "torch" or s.attrs.get("op") not in VIEWS or len(s.out_shape) != 4 or tuple(s.out_shape[2:]) != (1, 1):
        return None
    chain, value = [], s.inputs[0] if len(s.inputs) == 1 else None
    for kinds in (("flatten", "torch"), ("softmax",), ("torch",), ("torch",)):
        p = c.single_use(value, *kinds) if value is not None else None
        if p is None or len(p.inputs) != 1:
            return None
        chain.append(p)
        value = p.inputs[0]
    flat, soft, trans, view = chain
    if (flat.kind == "torch" and flat.attrs.get("op") not in VIEWS) or int(soft.attrs.get("axis", -1)) != 1:
        return None
    if trans.attrs.get("op") not in ("Tensor.transpose", "transpose") or sorted((trans.attrs.get("args") or [None, 0, 0])[1:3]) != [1, 2]:
        return None
    z = tuple(view.in_shapes[0])
    if view.attrs.get("op") not in VIEWS or len(z) != 4 or z[2:] != (1, 1) or len(view.out_shape) != 4:
        return None
    n, card, r, ch = view.out_shape
    if n != z[0] or card * r * ch != z[1] or tuple(s.out_shape) != z:
        return None
    return view.inputs[0], int(r), int(card), chain


def rewrite_radix_softmax(c: Any, s: Stage, found: tuple) -> None:
    """The chain becomes one ``radix_softmax`` stage named as ``s``'s output."""
    z, r, card, chain = found
    st = radix_softmax_stage(s.output, z, s.output, r, card)
    st.out_shape, st.name = tuple(s.out_shape), "+".join([t.name for t in reversed(chain)] + [s.name])
    c.stages[c.stages.index(s)] = st
    c.drop_unread()
