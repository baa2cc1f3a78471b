"""``fusekit doctor``: versions, GPUs, driver, plan cache and settings of this machine (exits 0 with or
without a GPU, 1 when a FUSEKIT_* setting is invalid)."""

from __future__ import annotations

import ctypes
import os
import platform
import re
import sys
from typing import Any, Callable

import click
import numpy as np

import fusekit
from fusekit import config
from fusekit.engine.cache import DiskStore
from fusekit.engine.patterns import list_patterns, pattern_dirs

from .common import Command, device_props, one_line, setting


def _probe(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - doctor reports, never crashes
        return f"unavailable ({type(e).__name__}: {one_line(str(e)) or 'no message'})"


def _driver() -> str:
    parts = []
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", fh.read())
        if m:
            parts.append(f"NVIDIA {m.group(1)}")
    except OSError:
        pass
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value:
            parts.append(f"CUDA {v.value // 1000}.{v.value % 1000 // 10} (libcuda)")
    except OSError:
        pass
    return ", ".join(parts) if parts else "none found (no /proc/driver/nvidia/version, libcuda.so.1 not loadable)"


def _cache_info() -> str:
    """Where the default plan cache keeps plans on disk and how it picks them (creates nothing)."""
    mode = config.mode()
    if config.disk_cache_off():
        return f"in memory only (FUSEKIT_CACHE_DIR={setting('FUSEKIT_CACHE_DIR')}), mode {mode}"
    store = DiskStore()  # $FUSEKIT_CACHE_DIR or the user cache directory
    n, d = sum(1 for _ in store.entries()), sum(1 for _ in store.decisions())
    info = f"memory + disk at {store.root} ({n} stored plan(s), {d} fused-or-split decision(s)), mode {mode}"
    try:
        store.check_dirs()
    except PermissionError as e:
        info += f"; its plans are not used: {e}"
    return info


def _devices(lib: str, mod: Any, count: int) -> list[str]:
    out = []
    for i in range(count):
        name, (major, minor), mem = device_props(lib, mod, i)
        out.append(f"{name}, compute capability {major}.{minor}, {mem / 2**30:.1f} GiB")
    return out


def _torch_info() -> tuple[str, list[str]]:
    import torch

    count = torch.cuda.device_count()
    cuda = torch.version.cuda or "none (CPU-only build)"
    return f"{torch.__version__} (CUDA {cuda}), sees {count} GPU(s)", _devices("torch", torch, count)


def _cupy_info() -> tuple[str, list[str]]:
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError without a driver
        return f"{cupy.__version__}, sees no GPU ({one_line(str(e))})", []
    return f"{cupy.__version__}, sees {count} GPU(s)", _devices("cupy", cupy, count)


@click.command("doctor", cls=Command)
def doctor() -> None:
    """Report versions, GPUs, driver and settings; exits 0 with or without a GPU, 1 if a setting is invalid.

    Lists Python, fusekit, the cuDNN frontend and backend, PyTorch and CuPy (and whether they see a
    GPU), each GPU's name and compute capability, the NVIDIA driver, the plan cache and every
    FUSEKIT_* setting, with a "problem" row for each invalid one.
    """
    rows: list[tuple[str, str]] = []
    rows.append(("python", f"{platform.python_version()} ({sys.executable})"))
    rows.append(("platform", platform.platform()))
    rows.append(("fusekit", f"{config.__version__} ({os.path.dirname(os.path.abspath(fusekit.__file__))})"))
    rows.append(("patterns", _probe(lambda: f"{', '.join(list_patterns()) or 'none'} from {os.pathsep.join(map(str, pattern_dirs()))}")))
    rows.append(("numpy", np.__version__))

    frontend_ok = backend_ok = False
    cudnn: Any = None
    try:
        import cudnn as cudnn_mod

        cudnn = cudnn_mod
        frontend_ok = True
        rows.append(("cuDNN frontend", str(getattr(cudnn, "__version__", "?"))))
    except Exception as e:  # noqa: BLE001
        rows.append(("cuDNN frontend", f"not importable ({type(e).__name__}: {one_line(str(e))})"))
    backend = "not checked (no frontend)"
    if frontend_ok:
        try:
            ver = cudnn.backend_version()
            try:
                ver = f"{cudnn.backend_version_string()} ({ver})"
            except Exception:  # noqa: BLE001
                pass
            backend, backend_ok = str(ver), True
        except Exception as e:  # noqa: BLE001
            backend = f"not loadable ({one_line(str(e))}); install fusekit[cu12] or fusekit[cu13] on a GPU machine"
    rows.append(("cuDNN backend", backend))

    gpus: list[str] = []
    libs_with_gpu: list[str] = []
    for lib, info in (("torch", _torch_info), ("cupy", _cupy_info)):
        try:
            text, devs = info()
        except ImportError as e:
            text, devs = f"not installed ({one_line(str(e))})", []
        except Exception as e:  # noqa: BLE001
            text, devs = f"unavailable ({type(e).__name__}: {one_line(str(e))})", []
        rows.append((lib, text))
        if devs:
            libs_with_gpu.append(lib)
            gpus = gpus or devs
    for i, d in enumerate(gpus):
        rows.append((f"gpu {i}", d))
    if not gpus:
        rows.append(("gpu", "none seen by torch or cupy"))
    rows.append(("driver", _probe(_driver)))
    rows.append(("plan cache", _probe(_cache_info)))
    rows.extend(config.describe())
    problems = config.problems()
    rows.extend(("problem", p) for p in problems)

    if frontend_ok and backend_ok and libs_with_gpu:
        verdict = f"ready: `fusekit run` and the GPU tests can run (through {libs_with_gpu[0]})"
    else:
        why = []
        if not libs_with_gpu:
            why.append("no GPU seen by torch or cupy")
        if not frontend_ok:
            why.append("cuDNN frontend not importable")
        elif not backend_ok:
            why.append("cuDNN backend library not loadable")
        verdict = f"no GPU path ({'; '.join(why)}); patterns, oracle and graph lowering still work"
    if problems:
        verdict = f"{len(problems)} invalid setting(s) (the problem rows above); {verdict}"
    rows.append(("status", verdict))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k.ljust(width)}  {v}")
    if problems:
        raise SystemExit(1)
