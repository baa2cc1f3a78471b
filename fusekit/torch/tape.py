"""The tape of a replayed training step: the aten ops and fusekit calls it ran, with every
tensor named by its slot (an input, a constant, or an earlier op's output), checked for what a
replay cannot hold, compacted (casts and buffer updates merged into foreach launches) and replayed
(see :mod:`fusekit.torch.replay`)."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import dispatch, session

#: aten ops a tape cannot hold: host reads of device values, and outputs whose shape depends on them.
_HOST_READS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item", "equal", "is_nonzero")
#: in-place ops that change a tensor's shape or strides (a detach replayed as the tensor it aliases would share them)
_RESHAPES_IN_PLACE = ("as_strided_", "resize_", "resize_as_", "t_", "transpose_", "squeeze_", "unsqueeze_", "swapdims_",
                      "swapaxes_", "set_")
_aten = torch.ops.aten
_UNKNOWN = -1  # the alias class of a tensor that may share memory with any other


class NotReplayable(Exception):
    """A recording met something a replay cannot repeat (the reason is the message)."""


class _Slot(int):
    """A recorded argument that is the tensor in this slot."""

    __slots__ = ()


class _Slots(tuple):
    """A recorded list argument of tensors (slots; None kept)."""

    __slots__ = ()


class _Tree:
    """A recorded call whose arguments needed pytree (tensors in keyword or nested arguments)."""

    __slots__ = ("spec",)

    def __init__(self, spec: Any) -> None:
        self.spec = spec


def _has_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) or (type(v) in (list, tuple, dict) and any(isinstance(t, torch.Tensor) for t in tree_flatten(v)[0]))


def _tkey(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _slots(r: Any) -> list[int]:
    """The slots a ref names."""
    return [r] if type(r) is _Slot else [t for t in r if type(t) is _Slot] if type(r) is _Slots else []


def _storage(t: torch.Tensor) -> int:
    """The alias class of a tensor the tape did not make (inputs, parameters, constants): its
    storage's address (they stay alive while the tape does, so no other storage takes it)."""
    try:
        return t.untyped_storage().data_ptr() or _UNKNOWN
    except Exception:  # noqa: BLE001 - no plain storage: may alias anything
        return _UNKNOWN


class _Batch:
    """Several recorded ops replayed as one foreach launch (:meth:`_Tape.compact`)."""

    __slots__ = ("__name__", "fn", "arg")

    def __init__(self, name: str, fn: Any, arg: Any = None) -> None:
        self.__name__, self.fn, self.arg = name, fn, arg

    def __call__(self, *lists: list) -> Any:
        return self.fn(self.arg, *lists)


def _cast_all(dtype: Any, srcs: list, outs: list | None = None) -> list:
    """``srcs`` cast to ``dtype``, into ``outs`` (replay buffers) or new tensors of their strides."""
    if outs is None:
        outs = [torch.empty_like(t, dtype=dtype) for t in srcs]  # the recorded casts kept their sources' strides
    torch._foreach_copy_(outs, srcs)
    return outs


def _copy_all(_: Any, dsts: list, srcs: list) -> None:
    torch._foreach_copy_(dsts, srcs)


def _add_all(value: Any, ts: list) -> list:
    torch._foreach_add_(ts, value)
    return ts


class _Tape:
    """One recording. ``entries`` are ``(kind, f, a, refs, outs)``: kind 0 an aten op (or, once
    compacted, a _Batch of them) and 2 a whole fusekit op (``a``: keyword arguments, None or a _Tree;
    ``refs``: the arguments), kind 1 a fusekit call (``a``: its operands; ``refs``: the outputs it was
    given, None when it allocated them), kind 3 a detach (``outs[0]`` is ``refs[0]``). A ref is a
    _Slot, a _Slots list or a plain value; ``outs`` are the slots the entry's tensors fill.
    Slots ``0 .. n_in - 1`` are the input and the parameters that want gradients; buffers and other
    tensors the module reads but did not make are constants (``consts``)."""

    def __init__(self, inputs: list[torch.Tensor], protected: int) -> None:
        self.where: dict[tuple, int] = {}
        self.cls: list[int] = []  # slot -> alias class (slots of one class may share memory)
        self.casts: dict[int, Any] = {}  # entry -> dtype, for aten._to_copy entries that only change the dtype
        self.metas: dict[int, tuple] = {}  # slot -> (shape, strides, dtype, device) of an output a fusekit call or a cast made
        self.bufs: list[tuple[int, ...] | None] = []  # entry -> the replay buffers its fusekit call or cast batch writes (plan_buffers)
        self.buffers: list[tuple] = []  # buffer -> (shape, strides, dtype, device)
        self.pool: list[torch.Tensor] | None = None  # the buffers, made at the first replay
        self.lent = False  # a replay holds the pool (its backward is still to come)
        self.consts: dict[int, torch.Tensor] = {}
        self.readers: dict[int, int] = {}  # constant slot -> the entry that first read it
        self.entries: list[tuple] = []
        self.n = 0
        self.protected = protected  # inputs 0 .. protected-1 (x, parameters) must not be written in place
        self.inside = 0  # > 0 while a fusekit call runs (its allocations and copies are its own)
        self.refused: str | None = None
        for t in inputs:
            self._new(t, _storage(t))
        self.n_in = self.n
        self.fwd_end = 0
        self.out = self.g = -1
        self.g_layout: tuple = ()
        self.grads: list[int | None] = []
        self.drop: tuple[int, ...] = ()
        self.out_read = False
        self.generation = session.current().generation  # the resolved calls it holds are valid while this holds

    def _new(self, t: torch.Tensor, cls: int | None = None) -> int:
        """A new slot for ``t``; its alias class ``cls`` (None: new memory, a class of its own)."""
        s = self.n
        self.n += 1
        self.where[_tkey(t)] = s
        self.cls.append(-2 - s if cls is None else cls)
        return s

    def _ref(self, v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v if type(v) not in (list, tuple) or not any(isinstance(t, torch.Tensor) for t in v) else \
                _Slots([None if t is None else self._ref(t) for t in v])
        k = _tkey(v)
        s = self.where.get(k)
        if s is None:  # read, not made here: a constant (a cached vector)
            s = self._new(v, _storage(v))
            self.consts[s] = v
            self.readers[s] = len(self.entries)
        return _Slot(s)

    def reading(self, func: Any, args: tuple, kwargs: dict) -> tuple | None:
        """Before aten op ``func`` runs (an in-place restride changes what it reads): its arguments
        as :meth:`_args` gives them; None when the recording is refused."""
        if self.refused is not None:
            return None
        name = func.__name__.split(".")[0]
        if name in _HOST_READS:
            self.refused = f"it reads a device value on the host (aten.{name}, e.g. .item())"
            return None
        for a, v in zip(func._schema.arguments, args):
            if a.alias_info is not None and a.alias_info.is_write and isinstance(v, torch.Tensor):
                s = self.where.get(_tkey(v))
                if s is not None and s < self.protected:
                    self.refused = f"aten.{name} writes its input or a parameter in place"
                    return None
        return self._args(args, kwargs)

    def whole(self, fn: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """A fusekit op that launches its own kernels (pooling, softmax), noted as one call of ``fn``."""
        if self.refused is None:
            self.made(2, fn, self._args(args, kwargs), out)

    def _args(self, args: tuple, kwargs: dict) -> tuple:
        """(keyword arguments or None, refs): tensors as slots, lists of tensors as _Slots, other values
        as they are; (_Tree, refs of pytree leaves) where tensors sit deeper or among keywords."""
        if not any(map(_has_tensor, kwargs.values())) and all(
                type(v) not in (list, tuple) or all(isinstance(t, torch.Tensor) or t is None for t in v) or not _has_tensor(v)
                for v in args):
            return (kwargs or None), tuple([self._ref(v) for v in args])
        leaves, spec = tree_flatten((args, kwargs))
        return _Tree(spec), tuple([self._ref(v) for v in leaves])

    def _out_class(self, func: Any, read: tuple) -> int | None:
        """The alias class an aten op's outputs share with an argument (views, in-place and out=
        ops, by its schema); None where they are new memory."""
        sets = {a for r in func._schema.returns if r.alias_info is not None for a in r.alias_info.before_set}
        if not sets:
            return None
        if type(read[0]) is not _Tree:
            for arg, r in zip(func._schema.arguments, read[1]):
                if arg.alias_info is not None and sets & set(arg.alias_info.before_set):
                    classes = {self.cls[s] for s in _slots(r)}
                    return classes.pop() if len(classes) == 1 else _UNKNOWN  # which list element: not said
        return _UNKNOWN

    def made(self, kind: int, func: Any, read: tuple, out: Any, args: tuple = ()) -> None:
        """Note op ``func`` (kind 0 aten, 2 a whole fusekit op) that read ``read`` (``args``: the
        arguments themselves) and returned ``out``."""
        if self.refused is not None:
            return
        cls = self._out_class(func, read) if kind == 0 else None
        if (func is _aten._to_copy.default and isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor)
                and type(read[0]) is not _Tree and set(read[0] or ()) <= {"dtype", "layout", "device", "pin_memory", "memory_format"}
                and out.device == args[0].device and out.layout == args[0].layout == torch.strided and out.stride() == args[0].stride()
                and (args[0].is_contiguous() or args[0].is_contiguous(memory_format=torch.channels_last))):
            self.casts[len(self.entries)] = out.dtype  # a dtype change, strides kept: empty_like + a foreach copy redo it
        outs = []
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if kind == 2:  # a fusekit op's result is new memory, unless it is an argument (out=) again
                    same = self.where.get(_tkey(t))
                    cls = None if same is None else self.cls[same]
                outs.append(self._new(t, cls))
            elif t is not None:
                self.refused = f"{func.__name__} returns a host value ({type(t).__name__})"
                return
        if len(self.entries) in self.casts:
            self.metas[outs[0]] = (tuple(out.shape), out.stride(), out.dtype, out.device)
        self.entries.append((kind, func, read[0], read[1], tuple(outs)))

    def fk(self, c: Any, operands: tuple, given: tuple | None, res: tuple) -> None:
        if self.refused is not None:
            return
        ops = tuple([self._ref(a) for a in operands])
        giv = None if given is None else tuple([self._ref(a) for a in given])
        outs = tuple([self._new(t) for t in res]) if given is None else ()
        for s, t in zip(outs, res):
            self.metas[s] = (tuple(t.shape), t.stride(), t.dtype, t.device)
        self.entries.append((1, c, ops, giv, outs))

    def reads(self, e: tuple) -> list[int]:
        """The slots entry ``e`` reads."""
        refs = list(e[3] or ()) + (list(e[2]) if e[0] == 1 else [])
        return [s for r in refs for s in _slots(r)]

    def writes(self, e: tuple) -> list[int]:
        """The slots entry ``e`` writes in place (a whole fusekit op, or an op with a nested argument
        list: every slot it reads)."""
        kind, f, a, refs, _ = e
        if kind == 1:
            return list(refs or ())
        if kind != 0 or type(a) is _Tree:
            return self.reads(e)
        return [s for arg, r in zip(f._schema.arguments, refs) if arg.alias_info is not None and arg.alias_info.is_write
                for s in _slots(r)]

    def _last_touch(self) -> dict[int, int]:
        """Alias class -> the last entry that reads, writes or makes it (what an entry writes in
        place it reads too)."""
        last: dict[int, int] = {}
        for i, e in enumerate(self.entries):
            for s in self.reads(e) + list(e[4]):
                last[self.cls[s]] = i
        return last

    def compact(self) -> None:
        """Fewer host calls per replay, the same results. Moved and merged into foreach launches: the
        forward's dtype casts of the input and parameters (autocast's) to its start; its in-place
        updates of buffers that no later op reads (running statistics, batch counts) to its end;
        the backward's dtype casts that no later op reads (gradients back to the parameters' dtype)
        to its end. A detach replays as the tensor it aliases."""
        if self.refused is not None:
            return
        E, cls = self.entries, self.cls
        last = self._last_touch()
        wrote: dict[int, int] = {}  # alias class -> the last entry that writes it in place
        for i, e in enumerate(E):
            for s in self.writes(e):
                wrote[cls[s]] = i
        unknown = last.get(_UNKNOWN, -1)  # no move across an op on memory that may alias anything
        kept = {self.out, *[s for s in self.grads if s is not None]}

        def alone(i: int, made: list[int], read: list[int]) -> bool:
            """Entry i may move to the end of its phase: nothing after it touches what it makes or
            writes, nor writes what it reads."""
            return (unknown <= i and all(cls[s] != _UNKNOWN and last[cls[s]] == i for s in made)
                    and all(cls[s] != _UNKNOWN and wrote.get(cls[s], -1) < i for s in read))

        first: list[tuple] = []  # (i, kind of batch, key, refs, outs)
        end_fwd: list[tuple] = []
        end_bwd: list[tuple] = []
        alias: set[int] = set()
        restrided = {cls[s] for e in E if e[0] == 0 and e[1].__name__.split(".")[0] in _RESHAPES_IN_PLACE for s in self.writes(e)}
        for i, (kind, f, a, refs, outs) in enumerate(E):
            if kind != 0:
                continue
            fwd = i < self.fwd_end
            if i in self.casts and type(refs[0]) is _Slot:
                if fwd and refs[0] < self.protected:
                    first.append((i, "cast", self.casts[i], refs[0], outs[0]))
                elif not fwd and alone(i, [outs[0]], [refs[0]]):
                    end_bwd.append((i, "cast", self.casts[i], refs[0], outs[0]))
            elif (f is _aten.detach.default and outs and outs[0] not in kept and type(refs[0]) is _Slot
                  and cls[refs[0]] not in restrided and _UNKNOWN not in restrided):
                alias.add(i)
            elif fwd and f is _aten._foreach_copy_.default and not a and len(refs) == 2:
                dst, src = _slots(refs[0]), _slots(refs[1])
                if len(dst) == len(refs[0]) and all(s in self.consts for s in dst) and alone(i, dst + list(outs), src):
                    end_fwd.append((i, "copy", None, dst, src))
            elif (fwd and f is _aten.add_.Tensor and not a and len(refs) == 2 and type(refs[0]) is _Slot and refs[0] in self.consts
                  and type(refs[1]) in (int, float) and alone(i, [refs[0], *outs], [])):
                end_fwd.append((i, "add", refs[1], refs[0], outs[0] if outs else None))
        # the ops moved to one end run in any order: none writes what another reads or writes
        written = [cls[s] for b in end_fwd for s in ((b[3],) if b[1] == "add" else b[3])]
        read = {cls[s] for b in end_fwd if b[1] == "copy" for s in b[4]}
        if len(set(written)) != len(written) or read & set(written):
            end_fwd = []
        moved = {b[0] for b in first + end_fwd + end_bwd}
        if not moved and not alias:
            return

        def batched(group: list[tuple]) -> list[tuple]:
            out = []
            for key in dict.fromkeys((b[1], b[2]) for b in group):
                bs = [b for b in group if (b[1], b[2]) == key]
                if key[0] == "cast":
                    out.append((0, _Batch(f"_to_copy x{len(bs)} (one foreach copy)", _cast_all, key[1]), None,
                                (_Slots([b[3] for b in bs]),), tuple(b[4] for b in bs)))
                elif key[0] == "copy":
                    out.append((0, _Batch(f"_foreach_copy_ x{len(bs)} (one foreach copy)", _copy_all), None,
                                (_Slots([s for b in bs for s in b[3]]), _Slots([s for b in bs for s in b[4]])), ()))
                else:
                    outs = tuple(b[4] for b in bs)
                    out.append((0, _Batch(f"add_ x{len(bs)} (one foreach add)", _add_all, key[1]), None,
                                (_Slots([b[3] for b in bs]),), outs if None not in outs else ()))
            return out

        def rest(lo: int, hi: int) -> list[tuple]:
            return [(3, None, None, E[i][3][:1], E[i][4]) if i in alias else E[i] for i in range(lo, hi) if i not in moved]

        fwd = batched(first) + rest(0, self.fwd_end) + batched(end_fwd)
        self.entries = fwd + rest(self.fwd_end, len(E)) + batched(end_bwd)
        self.fwd_end = len(fwd)
        self.casts = {}

    def plan_buffers(self) -> None:
        """Which outputs of fusekit calls and of merged dtype casts a replay writes into buffers kept
        from one replay to the next (``bufs``), instead of allocating them: outputs that never reach
        the caller (the result, the gradients and what aliases them are new each time). Outputs whose
        lifetimes in the step do not overlap share a buffer of their shape, strides, dtype and
        device; the kernels run in stream order, as the caching allocator's reuse relies on too."""
        E, cls = self.entries, self.cls
        self.bufs = [None] * len(E)
        if self.refused is not None or any(e[0] == 0 and getattr(e[1], "__name__", "").split(".")[0] == "set_" for e in E):
            return  # set_ would make a buffer (or a constant) share another tensor's memory
        last = self._last_touch()
        leaving = {cls[self.out], *[cls[s] for s in self.grads if s is not None]}
        free: dict[tuple, list[int]] = {}  # meta -> buffers free from the next entry on
        held: list[tuple[int, int, tuple]] = []  # (last entry, buffer, meta) in use
        for i, (kind, f, _, refs, outs) in enumerate(E):
            for h in [h for h in held if h[0] < i]:
                held.remove(h)
                free.setdefault(h[2], []).append(h[1])
            makes = refs is None if kind == 1 else type(f) is _Batch and f.fn is _cast_all  # allocates its outputs
            if not makes or not outs or _UNKNOWN in leaving or any(
                    cls[s] in leaving or cls[s] == _UNKNOWN or s not in self.metas for s in outs):
                continue
            ids = []
            for s in outs:
                meta = self.metas[s]
                b = free[meta].pop() if free.get(meta) else len(self.buffers)
                if b == len(self.buffers):
                    self.buffers.append(meta)
                ids.append(b)
                held.append((last[cls[s]], b, meta))
            self.bufs[i] = tuple(ids)

    def lease(self) -> list[torch.Tensor] | None:
        """The replay buffers for one replay (made at the first); None while another replay holds
        them (its backward is still to come): that replay allocates its outputs."""
        if self.lent or not self.buffers:
            return None
        if self.pool is None:
            self.pool = [torch.empty_strided(shape, strides, dtype=dtype, device=device) for shape, strides, dtype, device in self.buffers]
        self.lent = True
        return self.pool

    def finish(self) -> None:
        """Check the recording once ``out``, ``g`` and ``grads`` are set; find the forward's slots the
        backward does not read (a replay lets them go after its forward)."""
        self.where = {}  # memory addresses are done with; the slots stay
        if self.refused is None and (self.out < 0 or any(s is not None and s < 0 for s in self.grads)):
            self.refused = "its output or a gradient was made outside the recording"
        if self.refused is None and self.out < self.n_in:
            self.refused = "it returns its input or a parameter itself"
        later = {s for e in self.entries[self.fwd_end:] for s in self.reads(e)}
        later.update(s for s in self.grads if s is not None)
        made = {s for e in self.entries[:self.fwd_end] for s in e[4]}
        self.drop = tuple(sorted(s for s in made if s not in later and s != self.out))
        self.out_read = self.out in later  # the backward reads the forward's result

    def difference(self, other: "_Tape") -> str | None:
        """How two recordings differ (None: the same ops on the same wiring and constants)."""
        for i, (a, b) in enumerate(zip(self.entries, other.entries)):
            if a[0] != b[0] or (a[1] is not b[1] and (a[0] != 1 or a[1].plan.key != b[1].plan.key)):  # a call resolved again: its plan's key
                return f"op {i} is {_name(a)} in one, {_name(b)} in the other"
            if a[2:] != b[2:]:
                return f"op {i} ({_name(a)}) has other arguments or outputs: {str(a[2:])[:200]} against {str(b[2:])[:200]}"
        if len(self.entries) != len(other.entries) or self.fwd_end != other.fwd_end:
            return f"{self.fwd_end} + {len(self.entries) - self.fwd_end} ops against {other.fwd_end} + {len(other.entries) - other.fwd_end}"
        for s in self.consts.keys() | other.consts.keys():
            a, b = self.consts.get(s), other.consts.get(s)
            if a is not b:
                t, i = (a, self.readers[s]) if a is not None else (b, other.readers[s])
                e = self.entries[i] if i < len(self.entries) else None
                where = "?" if e is None else f"{_name(e)}, op {i} of the {'forward' if i < self.fwd_end else 'backward'}"
                return (f"a tensor it reads is another one each time ({t.dtype} {list(t.shape)} strides {t.stride()}, "
                        f"first read by {where}): made outside the recording")
        if (self.out, self.g, self.grads, self.g_layout) != (other.out, other.g, other.grads, other.g_layout):
            return "the output, the upstream gradient's layout or the gradients come from other slots"
        return None

    def run(self, vals: list, start: int, stop: int, pool: list | None = None) -> None:
        """Run entries ``start:stop`` on ``vals`` (slot -> tensor), filling their output slots; with
        ``pool`` (:meth:`lease`), fusekit calls and cast batches write into the buffers :meth:`plan_buffers` gave them."""
        launch = dispatch.execute.launch
        bufs = itertools.repeat(None) if pool is None else self.bufs[start:stop]
        for (kind, f, a, refs, outs), ids in zip(self.entries[start:stop], bufs):
            if kind == 3:  # a detach: the tensor it aliases
                vals[outs[0]] = vals[refs[0]]
            elif kind != 1:  # an aten op or a whole fusekit op; a: keyword arguments, None or a _Tree
                args = [vals[r] if type(r) is _Slot else [None if t is None else vals[t] for t in r] if type(r) is _Slots else r
                        for r in refs]
                if ids is not None:  # a batch of casts into replay buffers
                    args.append([pool[b] for b in ids])
                if a is None:
                    r = f(*args)
                elif type(a) is _Tree:
                    p, kw = tree_unflatten(args, a.spec)
                    r = f(*p, **kw)
                else:
                    r = f(*args, **a)
                if outs:
                    if isinstance(r, torch.Tensor):
                        vals[outs[0]] = r
                    else:
                        flat = r if type(r) in (tuple, list) and not any(type(t) in (tuple, list) for t in r) else tree_flatten(r)[0]
                        for s, t in zip(outs, [t for t in flat if isinstance(t, torch.Tensor)]):
                            vals[s] = t
            else:  # fusekit call: a its operands, refs the outputs it was given (None: it allocated them)
                ops = tuple([vals[r] if type(r) is _Slot else r for r in a])
                if ids is not None:
                    for s, t in zip(outs, launch(f, ops, tuple([pool[b] for b in ids]), False)):
                        vals[s] = t
                elif refs is None:
                    for s, t in zip(outs, launch(f, ops, (), True)):
                        vals[s] = t
                else:
                    launch(f, ops, tuple([vals[r] for r in refs]), False)


def _name(e: tuple) -> str:
    if e[0] == 3:
        return "aten.detach (the tensor it aliases)"
    if e[0] == 1:
        return f"fusekit graph {getattr(getattr(e[1].plan, 'key', None), 'pattern', '?')}"
    return f"aten.{e[1].__name__}" if e[0] == 0 else f"fusekit.ops.{e[1].__name__}"
