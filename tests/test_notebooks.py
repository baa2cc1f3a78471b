"""Every notebook in notebooks/ executes top to bottom on the CPU (GPU cells take their CPU branch
without a GPU) and shows what it is about: figures inline, the checks it prints."""

import os
import re
import time
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
#: A notebook's CPU run should take well under this (CI: 2 cores; each takes ~4-7 s on a laptop-class CPU).
TIME_LIMIT_S = 90


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def _outputs(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def _text(nb) -> str:
    return "".join(o.get("text", "") for o in _outputs(nb) if o.get("output_type") == "stream")


def _pngs(nb) -> int:
    return sum("image/png" in o.get("data", {}) for o in _outputs(nb))


def _first_output(nb) -> str:
    for c in nb.cells:
        if c.cell_type == "code" and c.get("outputs"):
            return "".join(o.get("text", "") for o in c.outputs)
    return ""


def check_quickstart(nb, text, cpu):
    assert "cuDNN frontend" in text and "status" in text  # fusekit doctor's report
    assert 'name = "conv_bias_relu"' in text  # the pattern file
    assert "CONV_FPROP" in text  # its lowered graph, as inspect() reports it
    m = re.search(r"oracle vs a NumPy window convolution \(float64, CPU\): relative error ([0-9.e+-]+)", text)
    assert m and float(m.group(1)) < 1e-12, "the oracle check's relative error"
    assert "CacheStats(hits=0, misses=0, builds=0" in text
    assert "geometric mean:" in text
    assert _pngs(nb) >= 2  # the graph diagram and the speed-up plot
    if cpu:
        assert "no CUDA GPU" in _first_output(nb)


def check_autotune(nb, text, cpu):
    assert _pngs(nb) >= 1
    if cpu:
        assert "NVIDIA-H200-autotune.json" in _first_output(nb)
        assert "precomputed: ../benchmarks/results/NVIDIA-H200-autotune.json" in text
        assert re.search(r"heuristic [0-9.]+ us, winner [0-9.]+ us", text)
        assert "cold" in text and "warm" in text


def check_batchnorm_split(nb, text, cpu):
    for what in ("forward: split vs fused agree to", "backward: split dx vs fused dx agree to"):
        m = re.search(re.escape(what) + r" ([0-9.e+-]+)", text)
        assert m and float(m.group(1)) < 1e-12, what
    assert _pngs(nb) >= 1
    if cpu:
        assert "NVIDIA-H200-norm.json" in _first_output(nb)
        assert "floor" in text


def _torch() -> bool:
    try:
        import torch  # noqa: F401

        return True
    except ImportError:
        return False


def check_training(nb, text, cpu):
    if _torch():  # the tiny eager run (CPU) or both models (GPU)
        assert _pngs(nb) >= 3  # loss curves, image grid, committed step times
        assert re.search(r"PyTorch eager: loss [0-9.]+ -> [0-9.]+", text)
    else:  # CI without PyTorch: the committed figures only, and the notebook says so
        assert _pngs(nb) >= 1 and "no PyTorch here" in _first_output(nb)
    assert "precomputed: ../benchmarks/results/NVIDIA-H200-train.json" in text
    if cpu:
        assert "NOT fusekit" in _first_output(nb)


CHECKS = {
    "01_quickstart": check_quickstart,
    "02_autotune": check_autotune,
    "03_batchnorm_split": check_batchnorm_split,
    "04_training": check_training,
}


def test_expected_notebooks_present():
    assert sorted(CHECKS) == [p.stem for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_stored_clean(path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            assert not c.get("outputs") and c.get("execution_count") is None, "store notebooks without outputs"
            # plots must show inline: the backend is the environment's (the quick start's plot once vanished under Agg)
            assert "matplotlib.use(" not in c.source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # the kernel's inline backend turns figures into image/png outputs (it needs no display)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    client.execute()
    took = time.perf_counter() - t0
    print(f"{path.name}: executed in {took:.1f} s")
    errors = [o for o in _outputs(nb) if o.get("output_type") == "error"]
    assert not errors
    CHECKS[path.stem](nb, _text(nb), cpu=not _cuda())
    if not os.environ.get("FUSEKIT_TEST_NO_TIME_LIMIT"):
        assert took < TIME_LIMIT_S, f"{path.name} took {took:.0f} s on the CPU"
