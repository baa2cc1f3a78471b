"""Activation buffer planning over a Program's stage order.

Every value (the input, each stage's output) lives from the stage that writes it to the last stage
that reads it (the input from -1, the program's output to the end). Buffers are flat arrays of the
activation dtype, so one buffer can hold a channels-last image and later a row-major matrix: a value
is a view of its buffer's first ``numel`` elements. Greedy in stage order: a stage's output takes
the smallest free buffer that is large enough, else the largest free one (grown), else a new one;
the buffers of values whose last reader is this stage are freed *after* its output is placed (so an
output never shares memory with its own inputs). The input and the output get their own buffers.

Channel concatenations are planned without copies where they can be: the parts of a
``torch.cat(xs, 1)`` of images are placed as channel slices of the concatenation's buffer, so their
producers write there directly and the concatenation itself is a view; channel views (``chunk`` /
``split`` items) are slices of their input's buffer (see :func:`channel_aliases`).
A value and the buffer it is a slice of form one group, allocated for the union of their lifetimes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .ir import Program, concat_parts


@dataclass
class MemoryPlan:
    """value -> buffer index; buffer sizes in elements; each value's [first, last] stage interval."""

    assign: dict[str, int]
    sizes: list[int]
    intervals: dict[str, tuple[int, int]]
    numel: dict[str, int]
    itemsize: int
    pinned: tuple[str, ...] = field(default=())
    #: value -> (the value whose buffer holds it, first channel there): concatenation parts and views
    alias: dict[str, tuple[str, int]] = field(default_factory=dict)

    def place(self, v: str) -> tuple[str, int]:
        """(the value whose own buffer holds ``v``, ``v``'s first channel there): ``(v, 0)`` unless
        ``v`` is a channel slice."""
        return self.alias.get(v, (v, 0))

    @property
    def planned_bytes(self) -> int:
        """Bytes of all buffers together (they are all allocated for the pipeline's lifetime)."""
        return sum(self.sizes) * self.itemsize

    @property
    def eager_bytes(self) -> int:
        """Bytes of every value with its own allocation (an upper bound on eager execution's)."""
        return sum(self.numel.values()) * self.itemsize

    @property
    def live_peak_bytes(self) -> int:
        """Largest total size of the values live at one stage (a lower bound for any plan)."""
        if not self.intervals:
            return 0
        hi = max(b for _, b in self.intervals.values())
        lo = min(a for a, _ in self.intervals.values())
        groups = self._group_intervals()
        return max(sum(self.numel[v] for v, (a, b) in groups.items() if a <= t <= b) for t in range(lo, hi + 1)) * self.itemsize

    def _group_intervals(self) -> dict[str, tuple[int, int]]:
        """Each buffer-owning value's interval, widened over the values that are slices of it."""
        out: dict[str, tuple[int, int]] = {}
        for v, (a, b) in self.intervals.items():
            r = self.place(v)[0]
            a0, b0 = out.get(r, (a, b))
            out[r] = (min(a, a0), max(b, b0))
        return out

    def conflicts(self) -> list[tuple[str, str]]:
        """Pairs of values that are live at the same time and share a buffer (must be empty)."""
        groups = self._group_intervals()
        vals = list(groups)
        bad = []
        for i, a in enumerate(vals):
            for b in vals[i + 1:]:
                if self.assign[a] == self.assign[b]:
                    (a0, a1), (b0, b1) = groups[a], groups[b]
                    if a0 <= b1 and b0 <= a1:
                        bad.append((a, b))
        return bad


#: Byte alignment a channel slice must start at to be handed to cuDNN (its graphs' tensor alignment);
#: which graphs take slices at all: benchmarks/probes/probe_strided_concat.py.
SLICE_ALIGNMENT = 16


def channel_aliases(prog: Program, itemsize: int = 2) -> dict[str, tuple[str, int]]:
    """Channel slices for copy-free concatenation: value -> (the value whose buffer holds it, first
    channel). Concatenations are visited last to first; each part is placed in its concatenation's
    buffer unless it is the input or the output, or already placed elsewhere (then the concatenation
    copies it). A concatenation whose
    parts already sit side by side in one buffer (DenseNet's growing prefixes) is itself a slice.
    Then, in stage order, a stage marked ``channel_slice`` (a ``chunk`` or ``split`` item, ``x[:, a:b]``)
    whose output is not placed yet becomes a slice of its input's buffer. Only slices whose first
    channel is :data:`SLICE_ALIGNMENT`-byte aligned are made (cuDNN refuses others): the rest get
    their own buffers (and a copy)."""
    producer = {s.output: s for s in prog.stages}
    shapes = prog.shapes()
    pinned = {prog.input, prog.output}
    alias: dict[str, tuple[str, int]] = {}

    def where(v: str) -> tuple[str, int]:
        return alias.get(v, (v, 0))

    def aligned(first: int) -> bool:
        return first * itemsize % SLICE_ALIGNMENT == 0

    for s in reversed(prog.stages):
        parts = concat_parts(s)
        if parts is None:
            continue
        widths = [shapes[p][1] for p in parts]
        offsets = [sum(widths[:k]) for k in range(len(parts))]
        placed = [where(p) for p in parts]
        if (s.output not in alias and s.output not in pinned and all(p in alias for p in parts)
                and len({r for r, _ in placed}) == 1 and all(o == placed[0][1] + off for (_, o), off in zip(placed, offsets))
                and aligned(placed[0][1])):
            alias[s.output] = placed[0]  # its parts are already contiguous in one buffer
            continue
        root, base = where(s.output)
        for p, off in zip(parts, offsets):
            st = producer.get(p)
            if p in alias or p in pinned or st is None or p == root or not aligned(base + off):
                continue
            alias[p] = (root, base + off)
    for s in prog.stages:  # channel views (chunk / split items): slices of their input's buffer
        first = s.attrs.get("channel_slice")
        if first is not None and s.output not in alias and s.output not in pinned:
            root, base = where(s.inputs[0])
            if aligned(base + int(first)):
                alias[s.output] = (root, base + int(first))
    return alias
def plan_memory(prog: Program, itemsize: int = 2) -> MemoryPlan:
    """Assign every value of ``prog`` to a buffer (see the module docstring)."""
    shapes = prog.shapes()
    numel = {v: int(math.prod(s)) for v, s in shapes.items()}
    alias = channel_aliases(prog, itemsize)
    n = len(prog.stages)
    first = {prog.input: -1}
    last = {prog.input: -1}
    for i, s in enumerate(prog.stages):
        first[s.output] = i
        last.setdefault(s.output, i)
        for v in s.inputs:
            last[v] = max(last.get(v, -1), i)
    last[prog.output] = n
    root = {v: alias[v][0] if v in alias else v for v in first}
    group_last: dict[str, int] = {}
    for v, r in root.items():
        group_last[r] = max(group_last.get(r, -1), last[v])
    pinned = (prog.input, prog.output)
    sizes: list[int] = []
    owner: dict[str, int] = {}  # buffer-owning value -> buffer
    free: list[int] = []

    def new(size: int) -> int:
        sizes.append(size)
        return len(sizes) - 1

    owner[prog.input] = new(numel[prog.input])
    for i, s in enumerate(prog.stages):
        r = root[s.output]
        if r not in owner:
            need = numel[r]
            if r in pinned:
                b = new(need)
            else:
                fits = [f for f in free if sizes[f] >= need]
                if fits:
                    b = min(fits, key=lambda f: sizes[f])
                elif free:
                    b = max(free, key=lambda f: sizes[f])
                    sizes[b] = need
                else:
                    b = new(need)
                if b in free:
                    free.remove(b)
            owner[r] = b
        dead = {root[w] for w in set(s.inputs) | {s.output}}
        for w in dead:
            if group_last[w] <= i and w not in pinned and owner[w] not in free:
                free.append(owner[w])
    assign = {v: owner[root[v]] for v in first}
    intervals = {v: (first[v], last[v]) for v in assign}
    return MemoryPlan(assign, sizes, intervals, {v: numel[v] for v in assign}, itemsize, pinned, alias)
