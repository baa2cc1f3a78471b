"""Every notebook in notebooks/ executes top to bottom on the CPU (GPU cells take their CPU branch
without a GPU) and shows what it is about: figures inline, the checks it prints."""

import os
import re
import time
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
#: Key figures exported by notebooks/execute.py (cells tagged figure:NAME -> <notebook>_<NAME>.png); README links them.
FIGURE_TAGS = {
    "01_quickstart": ["graph", "speedup"],
    "02_autotune": ["candidates"],
    "03_batchnorm_split": ["variants"],
    "04_training": ["loss", "reconstructions", "train_step", "train_models"],
    "05_pipeline": ["stages", "speedup", "committed"],
    "06_model_zoo": ["stage_map", "zoo_speedup"],
}


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


def _shown(nb) -> str:
    """Printed text and the plain-text form of displayed objects (rich renders tables as a display in Jupyter)."""
    return _text(nb) + "".join("".join(o.get("data", {}).get("text/plain", "")) for o in _outputs(nb)
                               if o.get("output_type") in ("display_data", "execute_result"))


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


def _torchvision() -> bool:
    try:
        import torch  # noqa: F401
        import torchvision  # noqa: F401

        return True
    except Exception:  # noqa: BLE001 - ImportError, or a torchvision built for another PyTorch (RuntimeError)
        return False


def _says_what_is_missing(nb) -> bool:
    """The first output names what is missing: PyTorch, or (PyTorch present) a usable torchvision."""
    first = _first_output(nb)
    return ("no usable torchvision here" in first) if _torch() else ("no PyTorch here" in first)


def check_pipeline(nb, text, cpu):
    results = "../benchmarks/results/NVIDIA-H200-pipeline.json"
    assert "precomputed: " + results in text
    assert re.search(r"resnet50, batch 1: fusekit [0-9.]+ ms; PyTorch eager [0-9.]+ ms \([0-9.]+x\)", text)  # the committed figures
    if cpu:
        assert "no CUDA GPU" in _first_output(nb) or _says_what_is_missing(nb)
        assert results in _first_output(nb)
    if not _torchvision():  # CI without torchvision: the committed plot only, and the notebook says what is missing
        assert _says_what_is_missing(nb) and _pngs(nb) >= 1
        return
    # the partition: ResNet-50's 54 convolutions, BN folded, every one fused, no fallback
    m = re.search(r"ResNet-50 \(1, 3, 224, 224\): (\d+) PyTorch ops -> (\d+) stages: (.*)", text)
    assert m and int(m.group(2)) == 57 and int(m.group(1)) > 100, m and m.group(0)
    assert "fallbacks (stages PyTorch runs): none" in text
    shown = _shown(nb)
    assert "fusekit pipeline (torch.fx, float16, channels-last)" in shown and "layer4_2_conv3" in shown  # report()'s table
    assert "stages: 57 (54 fused cuDNN graphs, 0 PyTorch fallbacks)" in text
    assert "module Mish has no fusekit rule" in text  # what a fallback looks like
    m = re.search(r"staged float64 reference vs PyTorch float64 \(CPU\): relative error ([0-9.e+-]+)", text)
    assert m and float(m.group(1)) < 1e-12
    if cpu:
        assert _pngs(nb) >= 2  # the stages and the committed speed-ups
    else:
        assert "CUDA graph: captured" in text
        m = re.search(r"fusekit fp16 pipeline \(GPU\) vs PyTorch float64 \(CPU\): relative error ([0-9.e+-]+)", text)
        assert m and float(m.group(1)) < 0.05
        assert len(re.findall(r"measured here: ResNet-50, batch \d+: fusekit", text)) == 2
        assert _pngs(nb) >= 3


def check_model_zoo(nb, text, cpu):
    assert re.search(r"precomputed: \.\./benchmarks/results/[^ ]+-zoo\.json \(NVIDIA", text)
    assert re.search(r"resnet50, batch 32: fusekit [0-9.]+ ms; best PyTorch [0-9.]+ ms \([0-9.]+x\)", text)  # the committed rows
    if not _torchvision():
        assert _says_what_is_missing(nb) and _pngs(nb) >= 1
        return
    if cpu:
        assert "no CUDA GPU here" in _first_output(nb)
    # the lowering: EfficientNet-B0, MobileNetV3, RegNetY and DenseNet (its concatenations planned in
    # place) and ShuffleNetV2 (its shuffles fusekit's kernel) entirely fusekit's
    for name in ("efficientnet_b0", "mobilenet_v3_large", "regnet_y_400mf", "densenet121", "shufflenet_v2_x1_0"):
        assert re.search(name + r": \d+ stages, 100% fused \(\d+ cuDNN graphs, \d+ fusekit kernels\); PyTorch: none", text), name
    m = re.search(r"staged float64 reference vs PyTorch float64 \(CPU\): relative error ([0-9.e+-]+)", text)
    assert m and float(m.group(1)) < 1e-12
    m = re.search(r"torch.compile\(backend=.*\) on (the GPU|the CPU).*: output \(8, 1000\), relative difference to the model's own output ([0-9.e+-]+)", text)
    assert m and float(m.group(2)) < (5e-2 if m.group(1) == "the GPU" else 1e-6), m and m.group(0)  # (GPU: float16 pipeline vs float16 eager)
    if cpu:
        assert _pngs(nb) >= 2
    else:
        assert re.search(r"measured here: EfficientNet-B0, batch 32: fusekit [0-9.]+ ms", text)
        assert _pngs(nb) >= 2


CHECKS = {
    "01_quickstart": check_quickstart,
    "02_autotune": check_autotune,
    "03_batchnorm_split": check_batchnorm_split,
    "04_training": check_training,
    "05_pipeline": check_pipeline,
    "06_model_zoo": check_model_zoo,
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
def test_notebook_key_figures_tagged(path):
    """The figures notebooks/execute.py exports (and the README shows) are chosen by cell tags, not by position."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    tags = [t.partition(":")[2] for c in nb.cells for t in c.metadata.get("tags", []) if t.startswith("figure:")]
    assert tags == FIGURE_TAGS[path.stem]


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


def _tiny_notebook(nbformat, path, fail=False):
    from nbformat.v4 import new_code_cell, new_notebook

    cells = [
        new_code_cell("import matplotlib.pyplot as plt\nprint('hello from the kernel')"),
        new_code_cell("plt.plot([1, 2, 3]);", metadata={"tags": ["figure:line"]}),
        new_code_cell("plt.plot([3, 2, 1]);"),  # not tagged: not exported
        new_code_cell("print('no figure here')", metadata={"tags": ["figure"]}),
        new_code_cell("fig, axes = plt.subplots(1, 2)\nplt.show()\nplt.figure(); plt.plot([0, 1]);", metadata={"tags": ["figure"]}),
    ]
    if fail:
        cells.append(new_code_cell("raise ValueError('boom')"))
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}})
    nbformat.write(nb, path)


def test_execute_script_writes_copies_and_tagged_figures(tmp_path):
    """notebooks/execute.py (what benchmarks/device_run.sh calls on a GPU): executed copies, PNGs of tagged cells only, exit codes."""
    import json
    import subprocess
    import sys

    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    good, bad = tmp_path / "tiny.ipynb", tmp_path / "broken.ipynb"
    _tiny_notebook(nbformat, good)
    _tiny_notebook(nbformat, bad, fail=True)
    out, figs = tmp_path / "out", tmp_path / "figs"
    script = NOTEBOOK_DIR / "execute.py"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    r = subprocess.run([sys.executable, str(script), str(good), "--out", str(out), "--figures", str(figs)],
                       capture_output=True, text=True, timeout=240, env=env, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tiny.ipynb: ok" in r.stdout and "1 passed, 0 failed" in r.stdout
    assert "no PNG from tiny_2" in r.stdout  # the tagged cell that drew nothing is named
    assert sorted(p.name for p in figs.iterdir()) == ["tiny_3.png", "tiny_3_2.png", "tiny_line.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in figs.iterdir())
    executed = nbformat.read(out / "tiny.ipynb", as_version=4)
    assert "hello from the kernel" in _text(executed)
    assert json.loads((out / "summary.json").read_text())[0]["ok"] is True

    r = subprocess.run([sys.executable, str(script), str(bad), "--out", str(out)], capture_output=True, text=True, timeout=240, env=env,
                       check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "broken.ipynb: FAILED" in r.stdout and "ValueError: boom" in r.stdout
    assert "hello from the kernel" in _text(nbformat.read(out / "broken.ipynb", as_version=4))  # kept up to the error
