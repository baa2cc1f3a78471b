"""GPU-side state that is not a plan: cuDNN handles per (device, stream, thread), one growing
workspace per (device, stream), and the facts about the GPU and libraries a plan key needs."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..errors import NoGPUError
from ..tensors import Adapter
from .lower import load_cudnn


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


class Workspace:
    """A device buffer that only grows; ``ptr`` is read at every execute."""

    __slots__ = ("adapter", "device", "size", "ptr", "_owner")

    def __init__(self, adapter: Adapter, device: int) -> None:
        self.adapter, self.device = adapter, device
        self.size, self.ptr, self._owner = 0, 0, None

    def ensure(self, nbytes: int) -> None:
        if nbytes > self.size:
            # The old buffer goes back to its stream-ordered pool; work queued on this stream
            # that still reads it runs before any reuse on the same stream.
            self._owner, self.ptr = self.adapter.bytes(nbytes, self.device)
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
            h = cudnn.create_handle()
            cudnn.set_stream(h, stream)
        return h

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


RUNTIME = Runtime()
