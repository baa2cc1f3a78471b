"""GPU-side state that is not a plan: cuDNN handles per (device, stream, thread), one growing
workspace per (device, stream), and the facts about the GPU and libraries a plan key needs."""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass
from typing import Any

from .. import session
from ..errors import NoGPUError
from ..adapters import Adapter
from .lower import load_cudnn, preload_frontend


@dataclass(frozen=True)
class DeviceFacts:
    name: str
    cc: tuple[int, int]


@dataclass(frozen=True)
class Versions:
    cudnn_backend: int
    frontend: str


_versions: Versions | None = None


def versions() -> Versions:
    """cuDNN backend version (as ``cudnnGetVersion``) and the frontend's version; needs libcudnn."""
    global _versions
    if _versions is None:
        cudnn = load_cudnn()
        try:
            backend = int(cudnn.backend_version())
        except Exception as e:  # libcudnn missing or not loadable
            raise NoGPUError(f"the cuDNN library cannot be loaded ({e}); install fusekit[cu12] or fusekit[cu13]") from None
        _versions = Versions(backend, str(cudnn.__version__))
    return _versions


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an array library's device out-of-memory error (torch.OutOfMemoryError,
    CuPy's OutOfMemoryError, a CUDA "out of memory" runtime error)."""
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()


def release_cached_memory() -> None:
    """Hand the device memory the array libraries' pools hold unused back to the driver
    (``torch.cuda.empty_cache()``, CuPy's ``free_all_blocks()``), so that an allocation that failed
    can be tried again. Only libraries already imported are touched; failures are ignored."""
    torch, cupy = sys.modules.get("torch"), sys.modules.get("cupy")
    with contextlib.suppress(Exception):  # best effort
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    with contextlib.suppress(Exception):  # best effort (no device, a CuPy without a pool)
        if cupy is not None:
            cupy.get_default_memory_pool().free_all_blocks()


def forget_stream(handle: Any) -> None:
    """Make the next ``set_stream`` on ``handle`` take effect: building or loading some plans runs a
    capture on a scratch stream of the frontend's that it sets on the handle (instance-norm backward
    on cuDNN 9.19), and the frontend's Handle skips a stream it believes unchanged. Call it after
    every build or load (engine.planner's builds and loads, and dispatch's smaller-workspace rebuilds)."""
    if hasattr(handle, "stream"):
        handle.stream = None


class Workspace:
    """A device buffer that only grows; ``ptr`` is read at every execute."""

    __slots__ = ("adapter", "device", "size", "ptr", "_owner")

    def __init__(self, adapter: Adapter, device: int) -> None:
        self.adapter, self.device = adapter, device
        self.size, self.ptr, self._owner = 0, 0, None

    def ensure(self, nbytes: int) -> None:
        """Grow to at least ``nbytes``. If the device is out of memory, this workspace's own buffer
        is let go and the libraries' cached blocks are released (release_cached_memory), and it is
        tried once more; if that fails too, the buffer of the old size is taken back (``size`` is 0
        when even that fails) and the library's out-of-memory error propagates. During a CUDA-graph
        capture on the device nothing is released (freeing device memory there would silently
        invalidate the capture): the error propagates and the buffer stays as it was."""
        if nbytes <= self.size:
            return
        try:
            # The old buffer goes back to its stream-ordered pool; work queued on this stream
            # that still reads it runs before any reuse on the same stream.
            self._owner, self.ptr = self.adapter.bytes(nbytes, self.device)
        except Exception as e:
            if not is_out_of_memory(e) or self.adapter.capturing(self.device):
                raise
            old = self.size
            self._owner, self.ptr, self.size = None, 0, 0  # its memory may complete the request
            release_cached_memory()
            try:
                self._owner, self.ptr = self.adapter.bytes(nbytes, self.device)
            except Exception as e2:
                if is_out_of_memory(e2) and old:
                    with contextlib.suppress(Exception):  # else size stays 0: dispatch drops the calls bound to it
                        self._owner, self.ptr = self.adapter.bytes(old, self.device)
                        self.size = old
                raise
        self.size = nbytes


class Runtime:
    """Handles and workspaces. Handles are per (device, thread): cuDNN handles are not thread-safe."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._workspaces: dict[tuple, Workspace] = {}
        self._facts: dict[tuple[str, int], DeviceFacts] = {}
        self._lock = threading.Lock()

    def handle(self, adapter: Adapter, device: int, stream: int, *, create: bool = True) -> Any:
        """The calling thread's ``cudnn.Handle`` on ``device``, set to ``stream`` (None when the thread
        has none and not ``create``). One per (device, thread), so a capture stream needs no new
        handle; the stream is set per call, as PyTorch does (the Handle skips unchanged streams)."""
        handles = getattr(self._local, "handles", None)
        if handles is None:
            handles = self._local.handles = {}
        h = handles.get(device)
        if h is None:
            if not create:
                return None
            h = handles[device] = self.new_handle(adapter, device, stream)
        load_cudnn().set_stream(h, stream)
        return h

    def new_handle(self, adapter: Adapter, device: int, stream: int) -> Any:
        """A fresh cuDNN handle on ``stream``, owned by the caller (the autotuner's timing stream)."""
        cudnn = load_cudnn()
        with adapter.use_device(device):
            preload_frontend()
            h = cudnn.create_handle()
            cudnn.set_stream(h, stream)
        return h

    def release(self) -> None:
        """Drop every workspace and the calling thread's handles (dispatch forgets its calls first)."""
        with self._lock:
            self._workspaces.clear()
        self._local.handles = {}

    def workspace(self, adapter: Adapter, device: int, stream: int) -> Workspace:
        key = (adapter.name, device, stream)
        ws = self._workspaces.get(key)
        if ws is None:
            with self._lock:
                ws = self._workspaces.setdefault(key, Workspace(adapter, device))
        return ws

    def device_facts(self, adapter: Adapter, device: int) -> DeviceFacts:
        key = (adapter.name, device)
        f = self._facts.get(key)
        if f is None:
            name, cc = adapter.device_properties(device)
            f = self._facts[key] = DeviceFacts(name, cc)
        return f


def current_runtime() -> Runtime:
    """The current session's handles and workspaces (made on first use)."""
    s = session.current()
    rt = s.runtime
    if rt is None:
        rt = s.runtime = Runtime()
    return rt
