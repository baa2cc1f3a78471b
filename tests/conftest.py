import os

import numpy as np
import pytest


def _gpu_status() -> str | None:
    """None when a CUDA GPU, PyTorch or CuPy, and libcudnn are usable; else why not."""
    try:
        import cudnn
    except Exception as e:  # noqa: BLE001
        return f"cuDNN frontend not importable: {e}"
    count = 0
    try:
        import torch

        count = torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        try:
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # noqa: BLE001
            return f"neither PyTorch nor CuPy sees a CUDA GPU ({type(e).__name__})"
    if count < 1:
        return "no CUDA GPU on this machine"
    try:
        cudnn.backend_version()
    except Exception as e:  # noqa: BLE001
        return f"libcudnn not loadable: {e}"
    return None


GPU_SKIP_REASON = _gpu_status()

# Under pytest-xdist (benchmarks/device_run.sh tests-xdist) each worker keeps its own plan cache
# directory, as device_run.sh's separate runs do: no worker's tests see another's plans.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("FUSEKIT_CACHE_DIR", "").startswith("/"):
    os.environ["FUSEKIT_CACHE_DIR"] += "-" + os.environ["PYTEST_XDIST_WORKER"]


def pytest_configure(config):
    # FUSEKIT_TEST_CUDAGRAPH_HISTORY=1 (device_run.sh tests-diag): torch.compile's CUDA-graph trees
    # record where each tensor in their pools was allocated, so an "untracked tensor" error names it
    if os.environ.get("FUSEKIT_TEST_CUDAGRAPH_HISTORY") == "1":
        import torch._inductor.config as inductor_config

        inductor_config.triton.cudagraph_trees_history_recording = True


def pytest_collection_modifyitems(config, items):
    if GPU_SKIP_REASON is None:  # the heavy tests first (a stable sort: the same order in every xdist worker)
        items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {GPU_SKIP_REASON}")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def rng():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("FUSEKIT_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def fresh_session():
    """A new fusekit session for the test: its own call table, refusals, fused-or-split decisions,
    tapes, warnings given and default plan cache (made on first use), released afterwards."""
    from fusekit import session

    with session.scoped() as s:
        yield s
