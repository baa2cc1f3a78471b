"""Activation buffer planning over a Program's stage order.

Every value (the input, each stage's output) lives from the stage that writes it to the last stage
that reads it (the input from -1, the program's output to the end). Buffers are flat arrays of the
activation dtype, so one buffer can hold a channels-last image and later a row-major matrix: a value
is a view of its buffer's first ``numel`` elements. Greedy in stage order: a stage's output takes
the smallest free buffer that is large enough, else the largest free one (grown), else a new one;
the buffers of values whose last reader is this stage are freed *after* its output is placed (so an
output never shares memory with its own inputs). The input and the output get their own buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .ir import Program


@dataclass
class MemoryPlan:
    """value -> buffer index; buffer sizes in elements; each value's [first, last] stage interval."""

    assign: dict[str, int]
    sizes: list[int]
    intervals: dict[str, tuple[int, int]]
    numel: dict[str, int]
    itemsize: int
    pinned: tuple[str, ...] = field(default=())

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
        return max(sum(self.numel[v] for v, (a, b) in self.intervals.items() if a <= t <= b) for t in range(lo, hi + 1)) * self.itemsize

    def conflicts(self) -> list[tuple[str, str]]:
        """Pairs of values that are live at the same time and share a buffer (must be empty)."""
        vals = list(self.assign)
        bad = []
        for i, a in enumerate(vals):
            for b in vals[i + 1:]:
                if self.assign[a] == self.assign[b]:
                    (a0, a1), (b0, b1) = self.intervals[a], self.intervals[b]
                    if a0 <= b1 and b0 <= a1:
                        bad.append((a, b))
        return bad


def plan_memory(prog: Program, itemsize: int = 2) -> MemoryPlan:
    """Assign every value of ``prog`` to a buffer (see the module docstring)."""
    shapes = prog.shapes()
    numel = {v: int(math.prod(s)) for v, s in shapes.items()}
    n = len(prog.stages)
    first = {prog.input: -1}
    last = {prog.input: -1}
    for i, s in enumerate(prog.stages):
        first[s.output] = i
        last.setdefault(s.output, i)
        for v in s.inputs:
            last[v] = max(last.get(v, -1), i)
    last[prog.output] = n
    pinned = (prog.input, prog.output)
    sizes: list[int] = []
    assign: dict[str, int] = {}
    free: list[int] = []

    def new(size: int) -> int:
        sizes.append(size)
        return len(sizes) - 1

    assign[prog.input] = new(numel[prog.input])
    for i, s in enumerate(prog.stages):
        v = s.output
        need = numel[v]
        if v in pinned:
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
        assign[v] = b
        dead = {w for w in set(s.inputs) | {v} if last.get(w, -1) <= i and w not in pinned}
        for w in dead:
            if assign[w] not in free:
                free.append(assign[w])
    intervals = {v: (first[v], last[v]) for v in assign}
    return MemoryPlan(assign, sizes, intervals, {v: numel[v] for v in assign}, itemsize, pinned)
