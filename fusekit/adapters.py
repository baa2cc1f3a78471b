"""Array adapters: how fusekit reads and makes arrays of CuPy, PyTorch and any ``__dlpack__``
producer (their specs, pointers, streams, allocation, timing), and the registry that finds the
adapter of an array (the hot path keeps per-type views of it)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from .errors import CaptureError, NoGPUError, OperandError
from .tensors import alignment, TensorSpec


class Adapter:
    """How fusekit reads and makes arrays of one library. ``probe`` is on the hot path."""

    name = "?"
    #: Whether allocations made while a stream captures a CUDA graph are safe (PyTorch's allocator
    #: serves them from the graph's private pool).
    allocates_in_capture = False

    def probe(self, a: Any) -> tuple[tuple, int]:
        """(hashable signature of everything in the spec, data pointer)."""
        raise NotImplementedError

    def describe(self, a: Any) -> tuple[tuple, tuple, str, int | None]:
        """(shape, strides in elements, dtype name, CUDA ordinal or None for host memory)."""
        raise NotImplementedError

    def sig(self, a: Any) -> tuple:
        """Dispatch signature, the hot path: (shape, strides, dtype, device, pointer % 32)."""
        s, ptr = self.probe(a)
        return (*s[:4], ptr & 31)

    def ptr(self, a: Any) -> int:
        """Device address of ``a``'s first element (the hot path)."""
        return self.probe(a)[1]

    # -- timing primitives (fusekit.timing times with them) --------------------------------------
    def event(self) -> Any:
        """A CUDA event that records time."""
        raise NotImplementedError

    def record(self, event: Any) -> None:
        """Record ``event`` on the library's current stream."""
        raise NotImplementedError

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two recorded events, once ``end`` has completed."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for the library's current stream."""
        raise NotImplementedError

    def spin(self, cycles: int = 4_000_000) -> None:
        """Queue a kernel on the current stream that spins ``cycles`` GPU clocks (~2 ms), as
        torch.cuda._sleep: calls queued behind it are timed on the GPU, not at the host's launch
        rate (without it, a 22 us dgrad timed 104 us)."""
        raise NotImplementedError

    def use_stream(self, stream: Any) -> Any:
        """A context manager making ``stream`` (the library's stream object; None: leave it) current."""
        raise NotImplementedError

    def capture(self, stream: Any, fn: Any) -> Any:
        """Run ``fn()`` once on ``stream``, then capture it there in a CUDA graph; returns a function
        that replays the graph on the current stream."""
        raise NotImplementedError

    def fence(self, device: int) -> None:
        """Queue one tiny ordinary kernel on the current stream (capturable: no allocation after the
        first call on ``device``). A kernel after it cannot start before everything queued before
        it has finished, which a cuDNN kernel launched with programmatic dependent launch may do."""
        raise NotImplementedError

    def empty(self, spec: TensorSpec) -> Any:
        """Uninitialised array of ``spec`` (logical NCHW dims, layout's memory order)."""
        raise NotImplementedError

    def stream(self, device: int) -> int:
        """The library's current stream on ``device`` (a cudaStream_t as int)."""
        raise NotImplementedError

    def capturing(self, device: int) -> bool:
        """Whether the library's current stream on ``device`` is capturing a CUDA graph."""
        return False

    def bytes(self, nbytes: int, device: int) -> tuple[Any, int]:
        """(owner, pointer) of a device buffer of ``nbytes``, on the current stream's pool."""
        raise NotImplementedError

    def kept(self, make: Callable[[], Any], device: int) -> Any:
        """``make()``: an array fusekit keeps across calls (a workspace, cached constants)."""
        return make()

    def use_device(self, device: int) -> Any:
        """Context manager making ``device`` current."""
        raise NotImplementedError

    def device_properties(self, device: int) -> tuple[str, tuple[int, int]]:
        raise NotImplementedError

    def randn(self, spec: TensorSpec) -> Any:
        """Fresh standard-normal data of ``spec`` (rounded to its dtype), for tuning and tests."""
        raise NotImplementedError

    def to_numpy(self, a: Any) -> Any:
        """Host float64 copy of ``a`` (synchronizes)."""
        raise NotImplementedError

    def astype(self, a: Any, dtype: str) -> Any:
        """``a`` converted to ``dtype`` (a dtype name, as in TensorSpec)."""
        raise NotImplementedError

    def relayout(self, a: Any, layout: str) -> Any:
        """A dense copy of the 4-D array ``a`` in ``layout`` ("NCHW" or "NHWC"), same logical shape."""
        raise NotImplementedError

    def copy_into(self, dst: Any, src: Any) -> None:
        """``dst[...] = src`` on the current stream, whatever the two layouts."""
        raise NotImplementedError

    def new_stream(self, device: int) -> tuple[Any, int]:
        """(stream object, cudaStream_t) of a fresh non-default stream (for capturing)."""
        raise NotImplementedError


_SPIN_SOURCE = r"""
extern "C" __global__ void fusekit_spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


class CupyAdapter(Adapter):
    name = "cupy"

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self._names = {cupy.dtype("float16"): "float16", cupy.dtype("float32"): "float32", cupy.dtype("float64"): "float64"}
        try:
            self._names[cupy.dtype("bfloat16")] = "bfloat16"
        except TypeError:  # a CuPy without bfloat16
            pass
        self._dtypes = {v: k for k, v in self._names.items()}
        self._fences: dict = {}  # device -> one-element buffer the fence kernel writes
        self._spin_kernel = None

    def probe(self, a):
        ptr = a.data.ptr
        return (a.shape, a.strides, a.dtype, a.data.device_id, alignment(ptr)), ptr

    @staticmethod
    def ptr(a):
        return a.data.ptr

    def event(self):
        return self.cp.cuda.Event()

    def record(self, event):
        event.record()

    def elapsed_ms(self, start, end):
        end.synchronize()
        return float(self.cp.cuda.get_elapsed_time(start, end))

    def synchronize(self):
        self.cp.cuda.get_current_stream().synchronize()

    def spin(self, cycles=4_000_000):
        import numpy as np

        k = self._spin_kernel
        if k is None:
            k = self._spin_kernel = self.cp.RawKernel(_SPIN_SOURCE, "fusekit_spin")
        k((1,), (1,), (np.int64(cycles),))

    def use_stream(self, stream):
        return contextlib.nullcontext() if stream is None else stream

    def capture(self, stream, fn):
        with stream:
            fn()
        stream.synchronize()
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
        return lambda: graph.launch(self.cp.cuda.get_current_stream())

    def fence(self, device):
        buf = self._fences.get(device)
        if buf is None:
            if self.capturing(device):  # a cudaMalloc would break the capture
                raise CaptureError(
                    f"fusekit: the first fused call reading a residual or ReLU mask on device {device} is inside a CUDA-graph "
                    "capture, where making the fence kernel's buffer could break it: call it once before capturing (warm-up)"
                )
            with self.cp.cuda.Device(device):
                buf = self._fences[device] = self.cp.zeros(1, dtype=self.cp.int32)
        buf.fill(1)  # an elementwise kernel (CuPy fills zeros with a memset)

    @staticmethod
    def sig(a):
        return (a.shape, a.strides, a.dtype, a.data.device_id, a.data.ptr & 31)

    def describe(self, a):
        item = a.dtype.itemsize
        return a.shape, tuple(s // item for s in a.strides), self._names.get(a.dtype, str(a.dtype)), a.data.device_id

    def empty(self, spec):
        cp = self.cp
        dt = self._dtypes.get(spec.dtype)
        if dt is None:
            raise OperandError("fusekit", "out", f"this CuPy build has no {spec.dtype}; use torch tensors for it")
        with cp.cuda.Device(spec.device):
            if spec.layout == "NHWC":
                n, c, h, w = spec.shape
                return cp.empty((n, h, w, c), dtype=dt).transpose(0, 3, 1, 2)
            return cp.empty(spec.view or spec.shape, dtype=dt)

    def stream(self, device):
        return self.cp.cuda.get_current_stream(device).ptr

    def capturing(self, device):
        return bool(self.cp.cuda.get_current_stream(device).is_capturing())

    def bytes(self, nbytes, device):
        with self.cp.cuda.Device(device):
            mem = self.cp.cuda.alloc(max(nbytes, 1))
        return mem, mem.ptr

    def use_device(self, device):
        return self.cp.cuda.Device(device)

    def device_properties(self, device):
        p = self.cp.cuda.runtime.getDeviceProperties(device)
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        return name, (int(p["major"]), int(p["minor"]))

    def randn(self, spec):
        cp = self.cp
        with cp.cuda.Device(spec.device):
            if spec.layout == "NHWC":
                n, c, h, w = spec.shape
                a = cp.random.standard_normal((n, h, w, c), dtype=cp.float32).astype(self._dtypes[spec.dtype])
                return a.transpose(0, 3, 1, 2)
            return cp.random.standard_normal(spec.view or spec.shape, dtype=cp.float32).astype(self._dtypes[spec.dtype])

    def to_numpy(self, a):
        import numpy as np

        return self.cp.asnumpy(a).astype(np.float64)

    def astype(self, a, dtype):
        return a.astype(self._dtypes[dtype])

    def relayout(self, a, layout):
        cp = self.cp
        with cp.cuda.Device(a.data.device_id):
            if layout == "NHWC":
                return cp.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
            return cp.ascontiguousarray(a)

    def copy_into(self, dst, src):
        dst[...] = src

    def new_stream(self, device):
        with self.cp.cuda.Device(device):
            s = self.cp.cuda.Stream(non_blocking=True)
        return s, s.ptr


class TorchAdapter(Adapter):
    name = "torch"
    allocates_in_capture = True

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self._names = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}
        self._dtypes = {v: k for k, v in self._names.items()}
        self._devices: dict = {}  # device index -> torch.device (empty() runs at every call)
        self._fences: dict = {}  # device -> one-element tensor the fence kernel writes
        self._side: dict = {}  # device -> the stream kept() allocates on
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:  # the same answer without building a torch.cuda.Stream
            self.stream = raw  # type: ignore[method-assign]

    def probe(self, a):
        ptr = a.data_ptr()
        return (a.shape, a.stride(), a.dtype, a.get_device(), alignment(ptr)), ptr

    @staticmethod
    def sig(a):
        return (a.shape, a.stride(), a.dtype, a.get_device(), a.data_ptr() & 31)

    @staticmethod
    def ptr(a):
        return a.data_ptr()

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def record(self, event):
        event.record()

    def elapsed_ms(self, start, end):
        end.synchronize()
        return float(start.elapsed_time(end))

    def synchronize(self):
        self.torch.cuda.current_stream().synchronize()

    def spin(self, cycles=4_000_000):
        sleep = getattr(self.torch.cuda, "_sleep", None)
        if sleep is not None:
            sleep(cycles)

    def use_stream(self, stream):
        return contextlib.nullcontext() if stream is None else self.torch.cuda.stream(stream)

    def capture(self, stream, fn):
        cuda = self.torch.cuda
        stream.wait_stream(cuda.current_stream(stream.device))
        with cuda.stream(stream):
            fn()
        stream.synchronize()
        g = cuda.CUDAGraph()
        with cuda.graph(g, stream=stream):
            fn()
        return g.replay

    def kept(self, make, device):
        """Outside a capture, made with a side stream current: a CUDA-graph memory pool that takes the
        current stream's allocations (torch.compile's CUDA-graph trees warm up in one) must own only
        what its graph's outputs hold, so what fusekit keeps is not taken from it. The caller's stream
        waits for what ``make`` queued (a fill); freed later, it waits for the caller's stream."""
        t = self.torch
        if self.capturing(device):
            return make()
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = t.cuda.Stream(device=device)
        cur = t.cuda.current_stream(device)
        with t.cuda.stream(side):
            a = make()
        cur.wait_stream(side)
        a.record_stream(cur)
        return a

    def fence(self, device):
        t = self._fences.get(device)
        if t is None:
            t = self._fences[device] = self.kept(lambda: self.torch.zeros(1, dtype=self.torch.int32, device=self._device(device)), device)
        t.fill_(1)

    def describe(self, a):
        dev = a.device
        return tuple(a.shape), tuple(a.stride()), self._names.get(a.dtype, str(a.dtype).replace("torch.", "")), (
            dev.index if dev.type == "cuda" else None
        )

    def _device(self, index):
        d = self._devices.get(index)
        if d is None:
            d = self._devices[index] = self.torch.device("cuda", index)
        return d

    def empty(self, spec):
        t = self.torch
        if spec.layout == "NHWC":
            return t.empty(spec.shape, dtype=self._dtypes[spec.dtype], device=self._device(spec.device), memory_format=t.channels_last)
        return t.empty(spec.view or spec.shape, dtype=self._dtypes[spec.dtype], device=self._device(spec.device))

    def stream(self, device):
        return self.torch.cuda.current_stream(device).cuda_stream

    def capturing(self, device):
        with self.torch.cuda.device(device):
            return bool(self.torch.cuda.is_current_stream_capturing())

    def bytes(self, nbytes, device):
        buf = self.kept(lambda: self.torch.empty(max(nbytes, 1), dtype=self.torch.uint8, device=f"cuda:{device}"), device)
        return buf, buf.data_ptr()

    def use_device(self, device):
        return self.torch.cuda.device(device)

    def device_properties(self, device):
        p = self.torch.cuda.get_device_properties(device)
        return p.name, (p.major, p.minor)

    def randn(self, spec):
        t = self.torch
        if spec.layout == "NHWC":
            x = t.randn(spec.shape, dtype=t.float32, device=f"cuda:{spec.device}")
            return x.to(self._dtypes[spec.dtype]).contiguous(memory_format=t.channels_last)
        return t.randn(spec.view or spec.shape, dtype=t.float32, device=f"cuda:{spec.device}").to(self._dtypes[spec.dtype])

    def to_numpy(self, a):
        return a.detach().double().cpu().numpy()

    def astype(self, a, dtype):
        return a.to(self._dtypes[dtype])

    def relayout(self, a, layout):
        return a.contiguous(memory_format=self.torch.channels_last if layout == "NHWC" else self.torch.contiguous_format)

    def copy_into(self, dst, src):
        dst.copy_(src)

    def new_stream(self, device):
        s = self.torch.cuda.Stream(device=device)
        return s, s.cuda_stream


_BY_TYPE: dict[type, Adapter] = {}
_BY_NAME: dict[str, Adapter] = {}
# The hot path's per-type views of the adapters (filled as array types are first seen).
SIGNATURES: dict[type, Any] = {}
STREAMS: dict[type, Any] = {}


def _register(t: type, ad: Adapter) -> Adapter:
    _BY_TYPE[t] = ad
    SIGNATURES[t] = ad.sig
    STREAMS[t] = ad.stream
    return ad


@contextlib.contextmanager
def registered(t: type, ad: Adapter) -> Iterator[Adapter]:
    """Arrays of type ``t`` read through ``ad`` while the block runs (a plug-in array type, or a test's
    stand-in); the registry is as it was afterwards."""
    before = [(table, table.get(t)) for table in (_BY_TYPE, SIGNATURES, STREAMS)]
    _register(t, ad)
    try:
        yield ad
    finally:
        for table, v in before:
            if v is None:
                table.pop(t, None)
            else:
                table[t] = v


def library(name: str) -> Adapter:
    """The adapter for 'cupy' or 'torch' (NoGPUError when that library is not installed)."""
    ad = _BY_NAME.get(name)
    if ad is None:
        try:
            ad = CupyAdapter() if name == "cupy" else TorchAdapter()
        except ImportError as e:
            raise NoGPUError(f"{name} is not installed ({e}); install fusekit[cu12], fusekit[cu13] or fusekit[torch]") from None
        _BY_NAME[name] = ad
    return ad


def adapter_for(a: Any, pattern: str = "fusekit", name: str = "array") -> Adapter:
    """The adapter that reads ``a``; raises OperandError for anything fusekit cannot take."""
    ad = _BY_TYPE.get(type(a))
    if ad is not None:
        if type(a) not in SIGNATURES:  # registered directly in _BY_TYPE (tests, plug-ins)
            _register(type(a), ad)
        return ad
    mod = type(a).__module__.split(".")[0]
    if mod in ("cupy", "torch"):
        return _register(type(a), library(mod))
    if mod == "numpy":
        raise OperandError(pattern, name, "expected a CUDA device array, got a NumPy array in host (CPU) memory")
    raise OperandError(
        pattern, name, f"expected a CuPy array, a torch tensor or a __dlpack__ producer, got {type(a).__module__}.{type(a).__name__}"
    )


def as_device_array(a: Any, pattern: str = "fusekit", name: str = "array") -> Any:
    """``a`` itself if CuPy or torch; a zero-copy CuPy (else torch) view of another ``__dlpack__`` producer."""
    mod = type(a).__module__.split(".")[0]
    if mod in ("cupy", "torch", "numpy") or type(a) in _BY_TYPE or not hasattr(a, "__dlpack__"):
        return a
    dev = getattr(a, "__dlpack_device__", None)
    if dev is not None and dev()[0] not in (2, 13):  # kDLCUDA, kDLCUDAManaged
        raise OperandError(pattern, name, f"expected a CUDA device array, got a __dlpack__ producer on device type {dev()[0]}")
    errors = []
    for lib in ("cupy", "torch"):
        try:
            mod_ = __import__(lib)
            return mod_.from_dlpack(a)
        except ImportError as e:
            errors.append(str(e))
        except Exception as e:  # noqa: BLE001 - report what the library said
            raise OperandError(pattern, name, f"could not import through __dlpack__ ({lib}: {e})") from None
    raise NoGPUError(f"need CuPy or PyTorch to take a __dlpack__ producer: {errors}")
