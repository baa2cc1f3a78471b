"""A block-level tape, prototyped: one converted ResNet-50 Bottleneck's training forward and backward
recorded as aten ops (a TorchDispatchMode) interleaved with fusekit's resolved cuDNN calls
(dispatch._run_call), then replayed under one autograd node, against the same block run as modules
and against PyTorch eager's block. The staged plan's second step (benchmarks/NOTES.md, 2026-12-06):
does replaying a whole block from Python keep its numerics, and what host time does it cost?

Slots are keyed by (data_ptr, shape, strides, dtype): saved tensors come back from autograd as new
Python objects over the same memory. Tensors a block reads that it did not make and that are not its
input, parameters, buffers or upstream gradient are constants of the tape (cached vectors).

    python benchmarks/probes/probe_block_tape.py [--batch 64] [--reps 30] [--rounds 5]
    python benchmarks/probes/probe_block_tape.py --whole [--batch 64] [--rounds 5]   # every block of the model replayed
    python benchmarks/probes/probe_block_tape.py --cpu-smoke   # the recorder on plain torch blocks, CPU float32

``--whole``: every residual block of layer1-4 recorded on its input of one real forward and swapped
for its replay (stem and head stay modules); the whole model's loss and gradients against the module
path, then host ms of forward + backward: eager, fusekit modules, fusekit with replayed blocks.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


class Tape:
    """Entries ("aten", func, spec, leaves, outs) / ("fk", call, operands, given, outs); a leaf or an
    operand is ("slot", i) or a plain value; outs are the slots the entry's tensors go to."""

    def __init__(self) -> None:
        self.where: dict[tuple, int] = {}
        self.consts: dict[int, torch.Tensor] = {}
        self.n = 0
        self.entries: list[tuple] = []
        self.inside = 0  # > 0 while a fusekit call runs (its allocations and copies are its own)
        self.phase_start = 0

    def slot(self, t: torch.Tensor) -> int:
        s = self.where.get(_key(t))
        if s is None:
            s = self.new(t)
            self.consts[s] = t
        return s

    def new(self, t: torch.Tensor) -> int:
        s = self.n
        self.n += 1
        self.where[_key(t)] = s
        return s

    def _ref(self, v: Any) -> Any:
        return ("slot", self.slot(v)) if isinstance(v, torch.Tensor) else v

    def aten(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if "_local_scalar_dense" in str(func):
            raise RuntimeError("a host read (.item()) inside the block: not tapeable")
        if not kwargs and not any(isinstance(v, (list, tuple)) for v in args):  # flat: tensors at known positions
            refs = [self._ref(v) for v in args]
            spec = None
        else:
            leaves, spec = tree_flatten((args, kwargs))
            refs = [self._ref(v) for v in leaves]
        outs = [self.new(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.entries.append(("aten", func, spec, refs, outs))

    def fk(self, c: Any, operands: tuple, given: tuple | None, res: tuple) -> None:
        ops = [self._ref(a) for a in operands]
        giv = None if given is None else [self._ref(a) for a in given]
        outs = [self.new(t) for t in res] if given is None else []
        self.entries.append(("fk", c, ops, giv, outs))

    def run(self, vals: list, start: int, stop: int) -> None:
        from fusekit import dispatch

        def get(r: Any) -> Any:
            return vals[r[1]] if type(r) is tuple and len(r) == 2 and r[0] == "slot" else r

        for e in self.entries[start:stop]:
            if e[0] == "aten":
                _, func, spec, refs, outs = e
                if spec is None:
                    r = func(*[get(v) for v in refs])
                else:
                    args, kwargs = tree_unflatten([get(v) for v in refs], spec)
                    r = func(*args, **kwargs)
                res = (r,) if isinstance(r, torch.Tensor) else [t for t in tree_flatten(r)[0] if isinstance(t, torch.Tensor)]
            else:
                _, c, ops, giv, outs = e
                if giv is None:
                    res = dispatch.launch(c, tuple(get(r) for r in ops), (), True)
                else:
                    dispatch.launch(c, tuple(get(r) for r in ops), tuple(get(r) for r in giv), False)
                    res = []
            for s, t in zip(outs, res):
                vals[s] = t


class _Mode(TorchDispatchMode):
    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.tape.inside:
            self.tape.aten(func, args, kwargs, out)
        return out


class Recording:
    """Record into ``tape`` while active: aten ops (the dispatch mode) and fusekit calls (dispatch._run_call patched)."""

    def __init__(self, tape: Tape) -> None:
        self.tape, self.mode = tape, _Mode(tape)

    def __enter__(self) -> "Recording":
        from fusekit import dispatch

        self.real = real = dispatch._run_call
        tape = self.tape

        def run_call(c, operands, outs, alloc):  # noqa: ANN001
            tape.inside += 1
            try:
                res = real(c, operands, outs, alloc)
            finally:
                tape.inside -= 1
            tape.fk(c, operands, None if alloc else outs, res)
            return res

        dispatch._run_call = run_call
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        from fusekit import dispatch

        self.mode.__exit__(*exc)
        dispatch._run_call = self.real


class BlockTape:
    """``block``'s training forward and backward for input ``x`` (under the autocast in force)."""

    def __init__(self, block: torch.nn.Module, x: torch.Tensor) -> None:
        self.block = block
        self.params = [p for p in block.parameters() if p.requires_grad]
        self.buffers = list(block.buffers())
        tape = self.tape = Tape()
        xs = x.detach().clone().requires_grad_(True)
        self.x_sig = (xs.shape, xs.stride(), xs.dtype, xs.device)
        self.inputs = [tape.new(xs)] + [tape.new(p) for p in self.params] + [tape.new(b) for b in self.buffers]
        with Recording(tape):
            out = block(xs)
        self.fwd_end = len(tape.entries)
        self.out = tape.where[_key(out)]
        g = torch.randn_like(out)
        self.g, self.g_stride = tape.new(g), g.stride()
        with Recording(tape):
            grads = torch.autograd.grad(out, [xs] + self.params, g, allow_unused=True)
        self.grads = [None if t is None else tape.where.get(_key(t)) for t in grads]
        missing = [i for i, (t, s) in enumerate(zip(grads, self.grads)) if t is not None and s is None]
        if missing:
            raise RuntimeError(f"gradients {missing} were made outside the recording (not tapeable)")
        self.n_aten = (sum(e[0] == "aten" for e in tape.entries[:self.fwd_end]), sum(e[0] == "aten" for e in tape.entries[self.fwd_end:]))
        self.n_fk = (sum(e[0] == "fk" for e in tape.entries[:self.fwd_end]), sum(e[0] == "fk" for e in tape.entries[self.fwd_end:]))

    def forward_vals(self, x: torch.Tensor, params: tuple) -> list:
        vals: list = [None] * self.tape.n
        for s, t in zip(self.inputs, [x, *params, *self.buffers]):
            vals[s] = t
        for s, t in self.tape.consts.items():
            vals[s] = t
        self.tape.run(vals, 0, self.fwd_end)
        return vals


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bt: BlockTape, x, *params):  # noqa: ANN001
        vals = bt.forward_vals(x, params)
        ctx.bt, ctx.vals = bt, vals
        return vals[bt.out]

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        bt, vals = ctx.bt, ctx.vals
        if g.stride() != bt.g_stride:  # the recorded ops read the upstream gradient with the recording's strides
            g = torch.empty_strided(g.shape, bt.g_stride, dtype=g.dtype, device=g.device).copy_(g)
        vals[bt.g] = g
        bt.tape.run(vals, bt.fwd_end, len(bt.tape.entries))
        grads = [None if s is None else vals[s] for s in bt.grads]
        vals.clear()  # the gradients' only references are ours: AccumulateGrad adopts them instead of copying
        ctx.vals = None
        return (None, *grads)


def replay(bt: BlockTape, x: torch.Tensor) -> torch.Tensor:
    if (x.shape, x.stride(), x.dtype, x.device) != bt.x_sig:
        raise RuntimeError(f"this tape was recorded for input {bt.x_sig}, got {(x.shape, x.stride(), x.dtype, x.device)}")
    return _Replay.apply(bt, x, *bt.params)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def compare(block: torch.nn.Module, bt: BlockTape, x: torch.Tensor, autocast: Any) -> str:
    """The block as modules and as a replay from one state: output, gradients, running statistics."""
    state = copy.deepcopy(block.state_dict())
    with torch.no_grad(), autocast():
        g = torch.randn_like(block(x.detach().clone()).float())
    block.load_state_dict(state)
    res = []
    for f in (lambda xx: block(xx), lambda xx: replay(bt, xx)):
        xx = x.detach().clone().requires_grad_(True)
        with autocast():
            out = f(xx)
        grads = torch.autograd.grad(out, [xx] + bt.params, g.to(out.dtype), allow_unused=True)
        res.append((out.detach().clone(), [None if t is None else t.detach().clone() for t in grads],
                    {k: v.detach().clone() for k, v in block.state_dict().items()}))
        block.load_state_dict(state)
    (o1, g1, s1), (o2, g2, s2) = res
    worst = max((rel(a, b) for a, b in zip(g2, g1) if a is not None and b is not None and b.norm() > 0), default=0.0)
    nones = sum((a is None) != (b is None) for a, b in zip(g2, g1))
    stats = max((rel(s2[k].float(), s1[k].float()) for k in s1 if s1[k].is_floating_point() and s1[k].norm() > 0), default=0.0)
    return (f"output equal {torch.equal(o1, o2)} (rel {rel(o2, o1):.1e}); gradients: largest rel difference {worst:.1e}, "
            f"None mismatches {nones}; buffers after one step: largest rel difference {stats:.1e}")


def host_ms(fn: Any, reps: int) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = (time.perf_counter() - t) * 1e3 / reps
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return dt


def taped_model(model: torch.nn.Module, x: torch.Tensor, autocast: Any) -> torch.nn.Module:
    """A copy of ``model`` (a torchvision ResNet) whose layer1-4 blocks replay tapes recorded on
    their inputs of one forward of ``x``."""
    model = copy.deepcopy(model)
    seen: dict[int, torch.Tensor] = {}
    blocks = [b for name in ("layer1", "layer2", "layer3", "layer4") for b in getattr(model, name)]
    hooks = [b.register_forward_pre_hook(lambda m, a: seen.__setitem__(id(m), a[0].detach().clone())) for b in blocks]
    with torch.no_grad(), autocast():
        model(x)
    for h in hooks:
        h.remove()
    state = copy.deepcopy(model.state_dict())  # recording runs each block once more (its running stats move)
    for b in blocks:
        with autocast():
            b.bt = BlockTape(b, seen[id(b)])
        b.forward = (lambda bt: lambda x: replay(bt, x))(b.bt)  # an instance attribute: keys and parameters stay
    model.load_state_dict(state)
    return model


def whole_compare(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: Any) -> str:
    """Loss and gradients of one step of ``a`` and ``b`` (the same parameters) from one state."""
    import torch.nn.functional as F

    state = copy.deepcopy(a.state_dict())
    out = []
    for m in (a, b):
        m.load_state_dict(state)
        with autocast():
            loss = F.cross_entropy(m(x), y)
        grads = torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad], allow_unused=True)
        out.append((float(loss.detach()), grads))
    a.load_state_dict(state)
    (la, ga), (lb, gb) = out
    worst = max((rel(q, p) for p, q in zip(ga, gb) if p is not None and q is not None and p.norm() > 0), default=0.0)
    return f"loss {la:.6f} (modules) against {lb:.6f} (replayed blocks); gradients: largest rel difference {worst:.1e}"


def cpu_smoke() -> None:
    import torchvision

    torch.manual_seed(0)
    block = torchvision.models.resnet50(weights=None).layer3[1].train()
    x = torch.randn(4, 1024, 14, 14)
    bt = BlockTape(block, x)
    print(f"CPU torchvision Bottleneck: aten ops forward/backward {bt.n_aten}, fusekit calls {bt.n_fk}, "
          f"{len(bt.tape.consts)} constants")
    import contextlib

    print(compare(block, bt, x, contextlib.nullcontext))
    model = torchvision.models.resnet18(weights=None, num_classes=10).train()
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    tm = taped_model(model, x, contextlib.nullcontext)
    print("CPU torchvision ResNet-18, every block replayed:", whole_compare(model, tm, x, y, contextlib.nullcontext))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--whole", action="store_true")
    args = ap.parse_args()
    if args.cpu_smoke:
        cpu_smoke()
        return
    if args.whole:
        whole(args)
        return
    import torchvision

    import fusekit.torch as ft

    torch.manual_seed(0)
    base = torchvision.models.resnet50(weights=None).cuda().to(memory_format=torch.channels_last).train()
    fk, _ = ft.convert(copy.deepcopy(base))
    blocks = {"eager": base.layer3[1], "fusekit": fk.layer3[1]}
    x = torch.randn(args.batch, 1024, 14, 14, device="cuda").contiguous(memory_format=torch.channels_last)

    def amp():
        return torch.autocast("cuda", dtype=torch.float16)

    def fwd_bwd(f):
        xx = x.detach().requires_grad_(True)
        with amp():
            out = f(xx)
        out.backward(torch.ones_like(out))

    for _ in range(4):  # plans, fusekit's own op tapes
        for b in blocks.values():
            fwd_bwd(b)
    with amp():
        bt = BlockTape(blocks["fusekit"], x)
    print(f"converted Bottleneck b{args.batch}: aten ops forward/backward {bt.n_aten}, fusekit calls {bt.n_fk}, "
          f"{len(bt.tape.consts)} constants, {bt.tape.n} slots", flush=True)
    print(compare(blocks["fusekit"], bt, x, amp), flush=True)
    sides = {"eager": lambda: fwd_bwd(blocks["eager"]), "fusekit modules": lambda: fwd_bwd(blocks["fusekit"]),
             "tape replay": lambda: fwd_bwd(lambda xx: replay(bt, xx))}
    for f in sides.values():
        f()
    res: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.rounds):
        for k, f in sides.items():
            res[k].append(host_ms(f, args.reps))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} us" for k, v in res.items()), flush=True)
    med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
    print("forward + backward host us per block (median of rounds): " + ", ".join(f"{k} {v:.0f}" for k, v in med.items())
          + f"; modules / replay {med['fusekit modules'] / med['tape replay']:.2f}x, eager / replay {med['eager'] / med['tape replay']:.2f}x")


def whole(args: argparse.Namespace) -> None:
    import torch.nn.functional as F
    import torchvision

    import fusekit.torch as ft

    torch.manual_seed(0)
    base = torchvision.models.resnet50(weights=None).cuda().to(memory_format=torch.channels_last).train()
    fk, _ = ft.convert(copy.deepcopy(base))
    x = torch.randn(args.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device="cuda")

    def amp():
        return torch.autocast("cuda", dtype=torch.float16)

    def fwd_bwd(m):
        with amp():
            loss = F.cross_entropy(m(x), y)
        loss.backward()
        m.zero_grad(set_to_none=True)

    for _ in range(4):  # plans, fusekit's own op tapes
        fwd_bwd(base)
        fwd_bwd(fk)
    t = time.perf_counter()
    tm = taped_model(fk, x, amp)
    n = [(m.bt.n_aten, m.bt.n_fk) for m in tm.modules() if isinstance(getattr(m, "bt", None), BlockTape)]
    print(f"ResNet-50 b{args.batch}: {len(n)} blocks recorded in {time.perf_counter() - t:.1f} s; aten ops forward / backward "
          f"{sum(a[0][0] for a in n)} / {sum(a[0][1] for a in n)}, fusekit calls {sum(a[1][0] for a in n)} / {sum(a[1][1] for a in n)}",
          flush=True)
    print(whole_compare(fk, tm, x, y, amp), flush=True)
    sides = {"eager": base, "fusekit modules": fk, "replayed blocks": tm}
    for m in sides.values():
        fwd_bwd(m)
    res: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.rounds):
        for k, m in sides.items():
            res[k].append(host_ms(lambda: fwd_bwd(m), 3))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in res.items()), flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print("forward + backward host ms (median of rounds): " + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
          + f"; eager / replayed {med['eager'] / med['replayed blocks']:.2f}x", flush=True)
    # the issue's measure: bench_train_models' uncaptured AMP step (GradScaler, SGD momentum), CUDA events
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from bench_train_models import Data, make_step

    from fusekit.pipeline.bench import cuda_time_ms

    data = Data(args.batch, 224)
    data.reset()
    data.x, data.y = x, y
    steps = {k: make_step(m, data, "amp-fp16", captured=False)[0] for k, m in sides.items()}
    out: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(3):
        for k, f in steps.items():
            out[k].append(cuda_time_ms(f, iters=10, trials=3, warmup=2))
    st = {k: statistics.median(v) for k, v in out.items()}
    print("whole AMP step ms (CUDA events, median of 3 x 3 trials of 10): " + ", ".join(f"{k} {v:.2f}" for k, v in st.items())
          + f"; eager / replayed {st['eager'] / st['replayed blocks']:.2f}x")


if __name__ == "__main__":
    main()
