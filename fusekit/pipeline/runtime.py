"""The GPU side of a pipeline: weights cast once, planned activation buffers (views of flat
arrays, channels-last images), one runner per stage writing into its output buffer, an eager
warm-up (plans built; optional autotune), each stage timed alone from CUDA-graph replays, and the
whole forward captured in one CUDA graph.

Streams: warm-up, profiling and capture all run on one side stream (``Pipeline.stream``), as
PyTorch's CUDA-graph recipe asks, and so that every fusekit call sees the same dispatch key
(fusekit keys calls by stream and pointers) in the warm-up and in the capture. Replays run on the
caller's current stream.
"""

from __future__ import annotations

import copy
import math
import statistics
import warnings
from typing import Any, Callable

import numpy as np

from ..errors import FusekitError, OperandError
from ..tensors import ITEMSIZE
from ..timing import events_ms, graph_times_ms
from . import reference as _reference
from .ir import (FLOAT32_WEIGHTS, FUSEKIT_PATTERNS, POOL_PATTERNS, Program, Stage, bind_constants, channel_rows, concat_parts,
                 fused_operands, gate_scaled_weights, is_global_pool, is_view_of, pixel_rows, pool_options, run_torch_stage)
from .kernels import channelwise_kernel, depthwise_kernel
from .memory import MemoryPlan, plan_memory

#: Largest relative error (vs PyTorch's float32 result on the same inputs) a built stage may show
#: (Pipeline.build(verify=True)): a few roundings of the stage's dtype; float32 convs may run TF32.
VERIFY_TOL = {"float16": 1e-2, "bfloat16": 4e-2, "float32": 1e-2}


class Pipeline:
    """A compiled network with fixed shapes. Build it with :func:`compile`; on the CPU,
    ``Pipeline(program)`` gives :meth:`reference`, :attr:`memory_plan` and :meth:`report` only.

    ``pipeline(x)`` copies ``x`` (any device, dtype or layout; NCHW logical shape) into the static
    input buffer, replays the CUDA graph and returns a **clone** of the static output (a fresh
    tensor the caller owns; pass ``clone=False`` to :meth:`run` to get the static output buffer
    itself, overwritten by the next call)."""

    def __init__(self, program: Program, *, dtype: str = "float16", weight_pool: dict[tuple, Any] | None = None) -> None:
        if dtype not in ITEMSIZE:
            raise ValueError(f"pipeline: dtype must be one of {tuple(ITEMSIZE)}, got {dtype!r}")
        self.program = program
        self.dtype = dtype
        self.memory_plan: MemoryPlan = plan_memory(program, ITEMSIZE[dtype])
        self.build_fallbacks: list[str] = []  # fusekit stages cuDNN refused at build (run by torch)
        self.choices: list[str] = []  # fused stages another kernel (PyTorch's, a CuPy one) runs because it measured faster
        self.engines: list[str] = ["-"] * len(program.stages)
        self.sources: list[str] = ["-"] * len(program.stages)
        self.times_ms: list[float | None] = [None] * len(program.stages)
        self.graph_captured = False
        self.capture_error: str | None = None
        self.built = False
        self.autotuned = False
        # device weights by (stage name, operand, shape): pipelines of one model at several batch sizes share them
        self._weight_pool: dict[tuple, Any] = {} if weight_pool is None else weight_pool

    # -- data ----------------------------------------------------------------------------------
    @property
    def stages(self) -> list[Stage]:
        return self.program.stages

    @property
    def fallbacks(self) -> list[str]:
        """Nodes left to PyTorch: by the lowering (no pattern) and at build (cuDNN refused)."""
        return self.program.fallbacks + self.build_fallbacks

    @property
    def weight_bytes(self) -> int:
        """Bytes the stages' weights take on the device (0 before :meth:`build`)."""
        return sum(t.numel() * t.element_size() for w in getattr(self, "_stage_weights", []) for t in w.values())

    def reference(self, x: Any) -> np.ndarray:
        """The staged network's output for ``x`` (NCHW host array) in NumPy float64 (CPU)."""
        shape = tuple(np.shape(x))
        if shape != tuple(self.program.input_shape):
            raise OperandError("pipeline.reference", "x", f"expected shape {tuple(self.program.input_shape)} (the shape it was "
                               f"lowered for), got {shape}")
        return _reference.evaluate(self.program, x)

    # -- build ---------------------------------------------------------------------------------
    def build(self, *, device: Any = None, autotune: bool = False, capture: bool = True, choose: bool = True,
              verify: bool = True, progress: Callable[[int, int, str], None] | None = None) -> "Pipeline":
        """Build on the GPU: buffers, runners, (autotune), warm-up, per-stage choice, check and
        timing, capture. ``choose``: run a stage on PyTorch's kernel where that measures faster (see
        ``choices``); False keeps every fused stage on its cuDNN graph. ``verify``: every stage's
        output is checked against PyTorch's float32 result on the same inputs (:meth:`check`); a
        stage over ``VERIFY_TOL`` runs on PyTorch instead and is listed in ``fallbacks``.
        ``progress(done, total, what)`` is called as autotuning goes, stage by stage."""
        import torch

        if not torch.cuda.is_available():
            from ..errors import NoGPUError

            raise NoGPUError("pipeline.build needs a CUDA GPU (use lower_model / Pipeline.reference on the CPU)")
        dev = torch.device("cuda", torch.cuda.current_device() if device is None else torch.device(device).index or 0)
        self.device = dev
        tdt = getattr(torch, self.dtype)
        self.torch_dtype = tdt
        plan = self.memory_plan
        shapes = self.program.shapes()
        with torch.cuda.device(dev):
            self._buffers = [torch.empty(max(int(n), 1), dtype=tdt, device=dev) for n in plan.sizes]
            self.views: dict[str, Any] = {v: self._view(v, shapes) for v in plan.assign}
            self.input_buffer = self.views[self.program.input]
            self.output_buffer = self.views[self.program.output]
            self.input_buffer.normal_()  # warm-up and capture read finite values
            self._fused: dict[int, tuple[tuple, dict, Any]] = {}  # stage -> (operands, attributes, out)
            self._noop: set[int] = set()  # stages with nothing to do (concatenations written in place)
            self._kernels: dict[int, Callable[[], None]] = {}  # stage -> a fusekit CuPy kernel for it, timed against its graph
            self._stage_weights = [self._weights(s) for s in self.stages]  # on the device, shared by both kernels of a stage
            self._runners = [self._runner(i, s) for i, s in enumerate(self.stages)]
            self.stream = torch.cuda.Stream(dev)
            self._graph = None
            if autotune:
                self._autotune(progress)
            self._warmup()
            if choose:
                self._choose()
            if verify:
                self._verify()
            self._profile()
            if capture:
                self._capture()
        self.built = True
        return self

    def _view(self, name: str, shapes: dict[str, tuple[int, ...]]) -> Any:
        shape = shapes[name]
        if name in self.memory_plan.alias:  # a channel slice of a concatenation's buffer
            root, first = self.memory_plan.place(name)
            return self._view(root, shapes)[:, first:first + shape[1]]
        flat = self._buffers[self.memory_plan.assign[name]][: int(math.prod(shape))]
        if len(shape) == 4:
            n, c, h, w = shape
            return flat.view(n, h, w, c).permute(0, 3, 1, 2)  # channels-last (N, C, H, W)
        return flat.view(shape)

    def _weights(self, s: Stage) -> dict[str, Any]:
        import torch

        out = {}
        f32 = FLOAT32_WEIGHTS.get(s.pattern, ())
        for k, v in s.weights.items():
            dt = torch.float32 if k in f32 else self.torch_dtype
            key = (s.name, s.pattern, k, tuple(np.shape(v)), dt, self.device)
            t = self._weight_pool.get(key)
            if t is None:
                t = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64)).to(device=self.device, dtype=dt)
                t = t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t.contiguous()
                self._weight_pool[key] = t
            out[k] = t
        return out

    def torch_runner(self, s: Stage, w: dict[str, Any]) -> Callable[[], None]:
        import torch

        fn = s.fn
        if isinstance(fn, torch.nn.Module):
            fn = copy.deepcopy(fn).to(device=self.device, dtype=self.torch_dtype).to(memory_format=torch.channels_last).requires_grad_(False)
        dev, tdt = self.device, self.torch_dtype
        bound = bind_constants(s, dev, tdt) if s.kind == "torch" else None  # constants on the device once, not per call
        if s.pattern in FLOAT32_WEIGHTS:  # PyTorch's kernel computes in the pipeline's dtype
            w = {k: v.to(tdt) for k, v in w.items()}
        y, names, views = self.views[s.output], s.inputs, self.views

        def run() -> None:
            run_torch_stage(s, {n: views[n] for n in names}, fn, w, dev, tdt, bound=bound, out=y)

        return run

    def _is_view(self, s: Stage) -> bool:
        """Whether the planned buffers make channel-view stage ``s``'s output its input's slice."""
        root, base = self.memory_plan.place(s.inputs[0])
        return self.memory_plan.alias.get(s.output) == (root, base + int(s.attrs["channel_slice"]))

    def _layernorm_out(self, x_rows: Any, x: Any, y: Any) -> tuple[Any, Any, Any] | None:
        """The outputs a channel layer norm's graph writes: y as rows of channels (a view of y's buffer)
        and its per-row mean and inverse deviation (float32, kept for the pipeline's life); None
        where the rows of x or y are not a view of them (a channel slice of a concatenation: the rows
        would be a copy taken once, here)."""
        import torch

        rows = channel_rows(y)
        if not (is_view_of(x_rows, x) and is_view_of(rows, y)):
            return None
        stats = torch.empty((rows.shape[0], 1, 1, 1), dtype=torch.float32, device=self.device)
        return rows, stats, torch.empty_like(stats)

    def _rows_out(self, s: Stage, operands: tuple, y: Any) -> Any:
        """A gconv stage's output as pixel rows (a view of y's buffer); None where an image operand's
        or y's rows would be a copy (a channel slice of a concatenation)."""
        images = [self.views[s.inputs[0]], *(self.views[v] for v in s.inputs[2:])]
        rows = pixel_rows(y)
        if not (is_view_of(rows, y) and all(is_view_of(r, a) for r, a in zip((operands[0], *operands[3:]), images))):
            return None
        return rows

    def _fused_runner(self, i: int, s: Stage, w: dict[str, Any], x: Any, y: Any) -> Callable[[], None]:
        """A stage with a fusekit pattern: its cuDNN graph (PyTorch's kernel where cuDNN refuses it or
        the operands cannot be given to it without a copy)."""
        import torch

        import fusekit
        from .. import ops
        from ..ops import pool

        pre = None
        if s.kind == "gconv":  # the gate-scaled weights are computed into a buffer of the stage's, then the batched matmul
            gate, wt = self.views[s.inputs[1]], w["wt"]
            sw = torch.empty((gate.shape[0], gate.shape[1], wt.shape[1]), dtype=self.torch_dtype, device=self.device)
            pre = lambda: gate_scaled_weights(gate, wt, out=sw)  # noqa: E731
            operands, attrs = fused_operands(s, self.views, w, scaled=sw)
            out = self._rows_out(s, operands, y)
        else:
            operands, attrs = fused_operands(s, self.views, w)
            out = self._layernorm_out(operands[0], x, y) if s.pattern == "layernorm" else y
        if out is None:
            self.engines[i] = "torch (channel slice)"
            return self.torch_runner(s, w)
        kernel = channelwise_kernel(s, operands, attrs, y)
        try:  # cuDNN may refuse a shape (a first-layer conv with 3 channels, say): then fusekit's kernel or torch runs it
            fusekit.plan_for(s.pattern, *operands, out=out, **attrs)
        except FusekitError as e:
            first = str(e).splitlines()[0] if str(e) else ""  # (cuDNN's engine log follows; the report keeps a line)
            self.build_fallbacks.append(f"{s.name}: cuDNN refused {s.pattern} ({type(e).__name__}: {first[:300]})")
            self.sources[i] = "-"
            if kernel is not None:  # (timed against PyTorch's in _choose)
                self.engines[i] = "cupy kernel (cuDNN refused the graph)"
                return kernel
            self.engines[i] = "torch (refused)"
            return self.torch_runner(s, w)
        if kernel is not None:  # a per-channel pointwise stage: fusekit's kernel timed against the graph and PyTorch's
            self._kernels[i] = kernel
        self.sources[i] = "pending"
        self._fused[i] = (operands, attrs, out)
        if pre is not None:
            def run() -> None:
                pre()
                fusekit.call(s.pattern, *operands, out=out, **attrs)

            return run
        dw = depthwise_kernel(s, x, y, self.device) if s.kind == "conv" and not s.attrs.get("add") else None
        if dw is not None:  # a depthwise conv: fusekit's kernel timed against the graph and PyTorch's
            self._kernels[i] = dw
        if s.pattern == "layernorm":  # the graph itself, on the rows (ops.layernorm would copy channels-last x)
            g, b, eps = w["gamma"], w["beta"], float(s.attrs["eps"])
            self._kernels[i] = lambda: pool.channel_layer_norm(x, g, b, eps, out=y)
            return lambda: fusekit.call("layernorm", *operands, out=out, **attrs)
        f = getattr(ops, s.pattern)
        return lambda: f(*operands, out=y, **attrs)

    def _concat_runner(self, i: int, s: Stage, parts: list[str]) -> Callable[[], None]:
        """A channel concatenation: the parts not already written in place are copied into their
        slices of the output; with none left it does nothing (its output is a view)."""
        alias, y = self.memory_plan.alias, self.views[s.output]
        root, base = self.memory_plan.place(s.output)
        copies, off = [], 0
        for p in parts:
            c = self.views[p].shape[1]
            if alias.get(p) != (root, base + off):
                copies.append((y[:, off:off + c], self.views[p]))
            off += c
        self.engines[i] = f"copy {len(copies)} of {len(parts)} parts" if copies else "in place (no copy)"
        if not copies:
            self._noop.add(i)

        def run() -> None:
            for dst, src in copies:
                dst.copy_(src)

        return run

    def _runner(self, i: int, s: Stage) -> Callable[[], None]:
        from ..ops import pool, resample

        w = self._stage_weights[i]
        y = self.views[s.output]
        x = self.views[s.inputs[0]] if s.inputs else None
        a = s.attrs
        parts = concat_parts(s)
        if parts is not None:
            return self._concat_runner(i, s, parts)
        if s.pattern == "channel_slice":
            if self._is_view(s):
                self.engines[i] = "view (no copy)"
                self._noop.add(i)
                return lambda: None
            self.engines[i] = "copy (channel slice)"
            return self.torch_runner(s, w)
        if s.pattern in POOL_PATTERNS and any(v in self.memory_plan.alias for v in (*s.inputs, s.output)):
            self.engines[i] = "torch (channel slice)"  # fusekit's pooling kernels take dense arrays only
            return self.torch_runner(s, w)
        if s.pattern in FUSEKIT_PATTERNS:
            return self._fused_runner(i, s, w, x, y)
        if s.pattern == "max_pool2d":
            k, st, p, kw = a["kernel_size"], a["stride"], a["padding"], pool_options(s)
            self.engines[i] = "cupy kernel"
            return lambda: pool.max_pool2d(x, k, st, p, out=y, indices=False, **kw)
        if s.pattern == "avg_pool2d" and is_global_pool(s):  # fusekit's two-pass mean, timed against PyTorch's
            from ..ops import reduce

            self.engines[i] = "cupy kernel (global mean)"
            return lambda: reduce.global_avg_pool(x, out=y)
        if s.pattern == "avg_pool2d":
            k, st, p, kw = a["kernel_size"], a["stride"], a["padding"], pool_options(s)
            self.engines[i] = "cupy kernel"
            return lambda: pool.avg_pool2d(x, k, st, p, out=y, **kw)
        if s.pattern == "channel_shuffle":
            g = int(a["groups"])
            self.engines[i] = "cupy kernel"
            return lambda: pool.channel_shuffle(x, g, out=y)
        if s.pattern == "radix_softmax":
            r, card = int(a["radix"]), int(a["cardinality"])
            self.engines[i] = "cupy kernel"
            return lambda: pool.radix_softmax(x, r, card, out=y)
        if s.pattern == "upsample_nearest2d":
            f = tuple(a["scale"])
            self.engines[i] = "cupy kernel"
            return lambda: resample.upsample_nearest2d(x, f, out=y)
        if s.pattern == "softmax":
            ax = a["axis"]
            self.engines[i] = "cupy kernel"
            return lambda: y.copy_(pool.softmax(x, ax))
        if s.pattern == "reshape":
            self.engines[i] = "copy"
            return lambda: y.copy_(x.reshape(y.shape))
        if s.pattern == "torch":
            self.engines[i] = "torch"
            return self.torch_runner(s, w)
        raise FusekitError(f"pipeline: stage {s.name} has no runner for pattern {s.pattern!r}")

    def replay(self) -> None:
        """One forward from what the input buffer holds into the output buffer, on the current stream:
        the captured CUDA graph's replay, or the stages run one by one where capture failed. What a
        timing loop calls (no copies in or out)."""
        if self._graph is not None:
            self._graph.replay()
        else:
            self.forward_eager()

    def forward_eager(self) -> None:
        """Run every stage once on the current stream (no graph)."""
        self.run_stages(0, len(self._runners))

    def run_stages(self, lo: int, hi: int) -> None:
        """Run stages ``lo`` to ``hi - 1`` once on the current stream (no graph)."""
        for r in self._runners[lo:hi]:
            r()

    def check(self, x: Any = None) -> list[dict[str, Any]]:
        """Each stage's output against PyTorch's float32 implementation of that stage on the same
        inputs, the stages run one by one (no graph) from ``x`` (a torch tensor of the input shape;
        default: what the input buffer holds). Rows {"stage", "name", "pattern", "engine", "rel_err"}; PyTorch-run stages skipped.
        Finds the stage whose plan computes wrongly when the whole output disagrees."""
        import torch

        if not hasattr(self, "_runners"):
            raise FusekitError("pipeline.check needs a built pipeline (compile it on a GPU)")
        dev, stream = self.device, self.stream

        rows: list[dict[str, Any]] = []
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.device(dev), torch.cuda.stream(stream), torch.no_grad():
            if x is not None:
                self.input_buffer.copy_(x)
            for i, (s, run) in enumerate(zip(self.stages, self._runners)):
                run()
                if s.pattern in ("reshape", "torch", "concat", "channel_slice"):
                    continue
                w = {k: v.float() for k, v in self._stage_weights[i].items()}
                ref = run_torch_stage(s, {n: self.views[n].float() for n in s.inputs}, s.fn, w, dev, torch.float32)
                y = self.views[s.output].float()
                rows.append({"stage": i, "name": s.name, "pattern": s.pattern, "engine": self.engines[i],
                             "rel_err": float((y - ref).norm() / ref.norm().clamp_min(1e-30))})
        torch.cuda.current_stream(dev).wait_stream(stream)
        return rows

    def _autotune(self, progress: Callable[[int, int, str], None] | None = None) -> None:
        import fusekit

        todo = [i for i, s in enumerate(self.stages) if s.pattern in FUSEKIT_PATTERNS and self.sources[i] == "pending"]
        for done, i in enumerate(todo):
            s = self.stages[i]
            if progress is not None:
                progress(done, len(todo), f"stage {i} {s.pattern} {'x'.join(map(str, s.out_shape))}")
            operands, attrs, out = self._fused[i]
            try:
                fusekit.autotune(s.pattern, *operands, out=out, **attrs)
            except FusekitError as e:
                warnings.warn(f"fusekit pipeline: autotune of stage {i} ({s.pattern}) failed, keeping the heuristic plan: {e}", stacklevel=3)
        if progress is not None:
            progress(len(todo), len(todo), "tuned")
        self.autotuned = True

    def _warmup(self) -> None:
        import torch

        s = self.stream
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(2):  # the first pass builds plans and compiles kernels
                self.forward_eager()
        torch.cuda.current_stream(self.device).wait_stream(s)
        s.synchronize()
        import fusekit

        with torch.cuda.stream(s):
            for i, st in enumerate(self.stages):
                if self.sources[i] == "pending":
                    operands, attrs, out = self._fused[i]
                    p = fusekit.plan_for(st.pattern, *operands, out=out, **attrs)
                    self.engines[i], self.sources[i] = p.engine, p.source

    def _stage_ms(self, runner: Callable[[], None], replays: int = 10) -> float:
        """GPU time of one stage: the stage alone captured in a CUDA graph and replayed (as the whole
        forward runs), median of ``replays`` event-timed replays queued behind a spinning kernel; a
        stage that cannot be captured alone is timed eagerly."""
        import torch

        from ..adapters import library

        ad = library("torch")
        try:
            times = graph_times_ms(ad, self.stream, runner, replays, spin=True)
        except Exception:  # noqa: BLE001 - time it eagerly instead
            torch.cuda.synchronize(self.device)
            times = events_ms(ad, runner, trials=replays, warmup=1, stream=self.stream, spin=True)
        return statistics.median(times)

    def _profile(self) -> None:
        self.times_ms = [0.0 if i in self._noop else self._timed_or_torch(i) for i in range(len(self._runners))]

    def _timed_or_torch(self, i: int) -> float:
        """Stage i's time; a fusekit CuPy kernel that cannot run is replaced by PyTorch's, said in the report."""
        try:
            return self._stage_ms(self._runners[i])
        except Exception as e:  # noqa: BLE001
            s = self.stages[i]
            if not self.engines[i].startswith("cupy"):
                raise
            self.build_fallbacks.append(f"{s.name}: fusekit's kernel for {s.pattern} could not run ({type(e).__name__}: {str(e)[:200]}); run by PyTorch")
            self._runners[i], self.engines[i] = self.torch_runner(s, self._stage_weights[i]), "torch (fusekit's kernel failed)"
            return self._stage_ms(self._runners[i])

    def _choose(self) -> None:
        """Per stage, the fastest of fusekit's kernel (the fused cuDNN graph, or the CuPy pooling
        kernel), a fusekit CuPy kernel for the same stage where there is one (a layer norm over
        channels, a depthwise convolution), and PyTorch's, each timed on the stage's own buffers as CUDA-graph replays. cuDNN's
        engines for some fusions are far slower than PyTorch's separate kernels (on the H200:
        depthwise 3x3 about 20x, a 1x1 conv with the ReLU6 clip fused up to 100x). A switch needs
        the other faster by 3% (timing noise); each is listed in ``choices``."""
        for i, s in enumerate(self.stages):
            if s.pattern not in FUSEKIT_PATTERNS + POOL_PATTERNS or self.engines[i].startswith("torch"):
                continue
            what = "fused cuDNN graph" if s.pattern in FUSEKIT_PATTERNS and not self.engines[i].startswith("cupy") else "fusekit's CuPy kernel"
            t_own = self._stage_ms(self._runners[i])
            alts = [("cupy kernel", "fusekit's CuPy kernel", self._kernels[i])] if i in self._kernels else []
            alts.append(("torch", "PyTorch", self.torch_runner(s, self._stage_weights[i])))
            timed = []
            for e, n, r in alts:
                try:
                    timed.append((self._stage_ms(r), e, n, r))
                except Exception as err:  # noqa: BLE001 - a candidate that cannot run is not chosen; said in the report
                    self.build_fallbacks.append(f"{s.name}: {n} for {s.pattern} could not run ({type(err).__name__}: {str(err)[:200]})")
            t, engine, name, alt = min(timed, key=lambda c: c[0])
            if t < 0.97 * t_own:
                self._runners[i] = alt
                self.engines[i], self.sources[i] = f"{engine} (faster: {t:.3f} vs {t_own:.3f} ms)", "-"
                self.choices.append(f"{s.name} ({s.pattern}): {name} {t:.3f} ms < {what} {t_own:.3f} ms")

    def _verify(self) -> None:
        tol = VERIFY_TOL[self.dtype]
        for r in self.check():
            if not r["rel_err"] <= tol:  # NaN too
                i, s = r["stage"], self.stages[r["stage"]]
                self._runners[i] = self.torch_runner(s, self._stage_weights[i])
                self.build_fallbacks.append(f"{s.name}: {s.pattern} ({r['engine']}) disagreed with PyTorch's float32 result on the "
                                            f"same inputs (relative error {r['rel_err']:.1e} > {tol:.0e}); run by PyTorch")
                self.engines[i], self.sources[i] = "torch (fusekit's result disagreed)", "-"

    def _capture(self) -> None:
        self._graph = self.capture_stages(0, len(self._runners))
        self.graph_captured = self._graph is not None

    def capture_stages(self, lo: int, hi: int) -> Any:
        """Stages ``lo`` to ``hi - 1`` captured in one CUDA graph on the pipeline's stream (replay it on
        any stream); None where capture fails (``capture_error`` says why; run them with
        :meth:`run_stages`)."""
        import torch

        g = torch.cuda.CUDAGraph()
        try:
            s = self.stream
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.graph(g, stream=s):
                self.run_stages(lo, hi)
            torch.cuda.current_stream(self.device).wait_stream(s)
            return g
        except Exception as e:  # noqa: BLE001 - keep the pipeline usable eagerly, say why in the report
            self.capture_error = f"{type(e).__name__}: {e}"
            warnings.warn(f"fusekit pipeline: CUDA graph capture failed, running eagerly: {self.capture_error}", stacklevel=3)
            torch.cuda.synchronize(self.device)
            return None

    # -- run -----------------------------------------------------------------------------------
    def run(self, x: Any, *, clone: bool = True, pad: bool = False) -> Any:
        """Copy ``x`` (torch tensor, CuPy or NumPy array) into the static input, unless it is that
        buffer itself, and run the forward (graph replay, or eagerly if capture failed). Returns a
        copy of the output in x's array type; with ``clone=False`` the static output buffer itself
        (a torch tensor, overwritten by the next call). ``pad``: a smaller batch is accepted, the
        rest of the input buffer zeroed, and the output's first ``len(x)`` rows returned."""
        import torch

        if not self.built:
            raise FusekitError("pipeline: not built for a GPU (use fusekit.pipeline.compile)")
        shape, static = tuple(getattr(x, "shape", ())), tuple(self.input_buffer.shape)
        b = shape[0] if pad and len(shape) == len(static) and shape[1:] == static[1:] and 0 < shape[0] <= static[0] else static[0]
        if shape != (b,) + static[1:]:
            raise OperandError("pipeline", "x", f"expected shape {static} (shapes are fixed per compiled pipeline: compile "
                               f"with batch_sizes=[...] to serve several batch sizes), got {shape}")
        kind = "torch" if isinstance(x, torch.Tensor) else ("cupy" if hasattr(x, "__cuda_array_interface__") else "numpy")
        with torch.cuda.device(self.device):
            if kind == "numpy":
                xt = torch.from_numpy(np.ascontiguousarray(x))
            else:  # CuPy: a zero-copy torch view through the CUDA array interface
                xt = x if kind == "torch" else torch.as_tensor(x, device=self.device)
            bound = xt.data_ptr() == self.input_buffer.data_ptr() and xt.stride() == self.input_buffer.stride() and xt.dtype == self.torch_dtype
            if not bound:
                self.input_buffer[:b].copy_(xt)
                if b < static[0]:
                    self.input_buffer[b:].zero_()
            self.replay()
            out = self.output_buffer if b == static[0] else self.output_buffer[:b]
            if not clone:
                return out
            if kind == "numpy":  # NumPy has no bfloat16: those come back as float32
                return (out.float() if out.dtype == torch.bfloat16 else out).cpu().numpy()
            y = out.clone()
            if kind == "cupy":
                import cupy

                return cupy.from_dlpack(y)
            return y

    __call__ = run

    # -- report --------------------------------------------------------------------------------
    def roofline(self) -> list[dict[str, Any]]:
        """Per stage: profiled time, flops and bytes, and the roofline floor max(flops / peak FLOP/s,
        bytes / peak bytes/s) with the peaks measured on this GPU (``bench.measured_peaks``);
        ``bound`` says which term sets the floor. Needs a built pipeline."""
        from .bench import measured_peaks
        from .ir import stage_cost

        if not self.built:
            raise FusekitError("pipeline: roofline needs a built pipeline (fusekit.pipeline.compile)")
        peak_flops, peak_bw = measured_peaks(self.device, self.dtype)
        item = ITEMSIZE[self.dtype]
        rows = []
        for i, s in enumerate(self.stages):
            flops, nbytes = stage_cost(s, item)
            t_c, t_m = flops / peak_flops * 1e3, nbytes / peak_bw * 1e3
            ms = self.times_ms[i]
            rows.append({
                "stage": i, "pattern": s.pattern, "engine": self.engines[i], "in": [list(x) for x in s.in_shapes], "out": list(s.out_shape),
                "ms": ms, "gflop": flops / 1e9, "mbytes": nbytes / 1e6, "floor_ms": max(t_c, t_m),
                "bound": "compute" if t_c >= t_m else "memory",
                "x_floor": None if ms is None or max(t_c, t_m) == 0 else ms / max(t_c, t_m),
            })
        return rows

    def time_split(self) -> dict[str, Any]:
        """Where the profiled GPU time goes (:func:`fusekit.pipeline.report.time_split`)."""
        from .report import time_split

        return time_split(self)

    def peaks_text(self) -> str:
        """The matmul and copy peaks measured on this GPU, as the report states them."""
        from .bench import measured_peaks

        f, b = measured_peaks(self.device, self.dtype)
        return f"{f / 1e12:.0f} TFLOP/s {self.dtype} matmul, {b / 1e12:.2f} TB/s copy"

    def report(self) -> str:
        """A table of stages (pattern, shapes, engine, plan source, eager time and its roofline floor),
        the fallbacks and memory."""
        from .report import report

        return report(self)
