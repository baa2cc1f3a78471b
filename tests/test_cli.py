"""The command line, on any machine (no GPU needed except where a test says so)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fusekit import cli
from fusekit.cli import main

SHAPES = ["--shape", "x=2,8,16,16", "--shape", "w=16,8,3,3", "--shape", "b=16"]


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def assert_one_line_error(result, *needles: str) -> str:
    """Failed with exit code != 0, no traceback, and exactly one non-empty line of output."""
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: ")
    assert "Traceback" not in result.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_patterns_ls_lists_shipped_patterns():
    r = invoke("patterns", "ls")
    assert r.exit_code == 0, r.output
    rows = {ln.split()[0]: ln for ln in r.output.splitlines() if ln.strip()}
    for name in ("conv_bias_relu", "conv_bias", "conv"):
        assert name in rows
    assert "x:image w:filter b:channel" in rows["conv_bias_relu"]
    assert "padding=0,0 stride=1,1 dilation=1,1" in rows["conv_bias_relu"]
    assert "x:image w:filter" in rows["conv"] and "b:channel" not in rows["conv"]


def test_patterns_show_prints_toml():
    r = invoke("patterns", "show", "conv_bias_relu")
    assert r.exit_code == 0, r.output
    assert 'name = "conv_bias_relu"' in r.output
    assert 'op = "conv_fprop"' in r.output and "[outputs]" in r.output
    assert "CONV_FPROP" not in r.output  # no shapes: no lowering


def _graph_json(output: str) -> dict:
    """The JSON document printed after the TOML text."""
    return json.loads(output[output.index("\n{") + 1 :])


@pytest.mark.parametrize(
    "attrs, hw", [((), (14, 14)), (("--attr", "padding=1"), (16, 16)), (("--attr", "padding=1", "--attr", "stride=2"), (8, 8))]
)
def test_patterns_show_lowers_with_shapes(attrs, hw):
    r = invoke("patterns", "show", "conv_bias_relu", *SHAPES, *attrs)
    assert r.exit_code == 0, r.output
    assert 'name = "conv_bias_relu"' in r.output
    g = _graph_json(r.output)
    types = [n["type"] for n in g["nodes"]]
    assert types[0] == "CONV_FPROP" and types.count("POINTWISE") == 2
    y = g["tensors"]["y"]
    assert y["dim"] == [2, 16, *hw]
    assert y["stride"] == [16 * hw[0] * hw[1], 1, 16 * hw[1], 16]  # NHWC, like x
    assert g["tensors"]["b"]["dim"] == [1, 16, 1, 1]  # channel operand given as C
    assert "HALF" in y["dtype"]


def test_patterns_show_json_nchw_float32():
    r = invoke(
        "patterns", "show", "conv", "--shape", "x=1,3,9,11", "--shape", "w=4,3,3,3",
        "--layout", "NCHW", "--dtype", "float32", "--attr", "padding=1", "--json",
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["name"] == "conv" and 'name = "conv"' in doc["text"]
    low = doc["lowered"]
    assert low["shapes"]["y"] == [1, 4, 9, 11]
    y = low["graph"]["tensors"]["y"]
    assert y["dim"] == [1, 4, 9, 11] and y["stride"] == [4 * 9 * 11, 9 * 11, 11, 1] and "FLOAT" in y["dtype"]
    assert low["graph"]["nodes"][0]["type"] == "CONV_FPROP"
    assert low["graph"]["nodes"][0]["params"]["padding"] == [1, 1]


@pytest.mark.parametrize("bad", ["x=2,a,16,16", "x", "x=", "2,8,16,16", "x=2,0,16,16", "x=2,-8,16,16"])
def test_bad_shape_is_one_line_naming_the_option(bad):
    r = invoke("patterns", "show", "conv", "--shape", bad)
    assert_one_line_error(r, "--shape", repr(bad))


def test_unknown_pattern_is_one_line():
    r = invoke("patterns", "show", "no_such_pattern")
    assert_one_line_error(r, "no_such_pattern", "conv_bias_relu")
    assert_one_line_error(invoke("oracle", "no_such_pattern", "--shape", "x=1,1,1,1"), "no_such_pattern")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--shape", "x=2,8,16,16"], "missing --shape for operand(s) w"),
        (["--shape", "x=2,8,16,16", "--shape", "w=16,8,3,3", "--shape", "q=3"], "q is not an operand"),
        (["--shape", "x=2,8,16,16", "--shape", "w=16,4,3,3"], "'w': expected 8 input channels"),
        (["--shape", "x=2,8,16", "--shape", "w=16,8,3,3"], "'x': expected a 4-D image"),
        (["--shape", "x=2,8,2,2", "--shape", "w=16,8,3,3"], "smaller than the dilated filter"),
        (["--attr", "pad=1"], "'pad': unknown attribute"),
        (["--attr", "padding"], "--attr"),
        (["--dtype", "float64"], "--dtype"),
    ],
)
def test_bad_input_is_one_line(args, needle):
    assert_one_line_error(invoke("patterns", "show", "conv", *args), needle)


def test_unknown_command_is_one_line():
    assert_one_line_error(invoke("patterns", "nope"), "nope")


def test_oracle_prints_output_shape():
    r = invoke("oracle", "conv_bias_relu", *SHAPES, "--attr", "padding=1", "--seed", "7")
    assert r.exit_code == 0, r.output
    out = [ln for ln in r.output.splitlines() if ln.strip().startswith("out y:")]
    assert len(out) == 1 and "(2, 16, 16, 16)" in out[0]
    assert "zeros" in out[0] and "min 0 " in out[0]  # relu output
    r2 = invoke("oracle", "conv_bias_relu", *SHAPES, "--attr", "padding=1", "--seed", "7")
    assert r2.output == r.output  # seeded
    r3 = invoke("oracle", "conv", "--shape", "x=1,3,10,10", "--shape", "w=5,3,3,3", "--attr", "stride=2")
    assert r3.exit_code == 0 and "(1, 5, 4, 4)" in r3.output


def test_oracle_matrix_kinds():
    """Linear patterns: matrices (M, N), a transposed weight and a row bias, as the user gives them."""
    r = invoke("oracle", "linear_bias_relu", "--shape", "x=4,8", "--shape", "w=16,8", "--shape", "b=16")
    assert r.exit_code == 0, r.output
    assert "out y: (4, 16)" in r.output
    assert_one_line_error(invoke("oracle", "matmul", "--shape", "a=4,8", "--shape", "b=7,3"), "'b'", "expected 8 rows")


def test_patterns_show_lowers_matmul():
    r = invoke("patterns", "show", "matmul", "--shape", "a=4,8", "--shape", "b=8,3", "--dtype", "float32", "--json")
    assert r.exit_code == 0, r.output
    low = json.loads(r.output)["lowered"]
    assert low["shapes"] == {"a": [4, 8], "b": [8, 3], "c": [4, 3]}
    nodes = low["graph"]["nodes"]
    assert any(n["type"] == "MATMUL" for n in nodes), nodes


def test_oracle_bad_channel_is_one_line():
    r = invoke("oracle", "conv_bias", "--shape", "x=2,8,16,16", "--shape", "w=16,8,3,3", "--shape", "b=15")
    assert_one_line_error(r, "'b'", "expected length 16")


def test_doctor_exits_zero():
    r = invoke("doctor")
    assert r.exit_code == 0, r.output
    for key in ("python", "fusekit", "cuDNN frontend", "cuDNN backend", "torch", "cupy", "driver", "status"):
        assert any(ln.startswith(key) for ln in r.output.splitlines()), key


def _sees_gpu() -> bool:
    """Whether PyTorch (or else CuPy) sees a CUDA GPU, as ``fusekit run`` checks."""
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - not installed, or no driver
        return False


@pytest.mark.skipif(_sees_gpu(), reason="this machine has a GPU: `fusekit run` runs instead of failing")
def test_run_without_gpu_fails_with_one_line():
    r = invoke("run", "conv_bias_relu", *SHAPES, "--attr", "padding=1", "--repeat", "3")
    line = assert_one_line_error(r, "GPU")
    assert r.exit_code == 1, line


def test_run_checks_input_before_gpu():
    """A bad operand is reported as such, GPU or not."""
    r = invoke("run", "conv_bias_relu", "--shape", "x=2,8,16,16", "--shape", "w=16,4,3,3", "--shape", "b=16")
    assert_one_line_error(r, "'w'", "input channels")


@pytest.mark.parametrize(
    "text, want",
    [("x=2,8,16,16", ("x", (2, 8, 16, 16))), ("b=16", ("b", (16,))), (" w = 4x3x3x3 ", ("w", (4, 3, 3, 3)))],
)
def test_parse_shape(text, want):
    assert cli.parse_shape(text) == want


@pytest.mark.parametrize(
    "text, want",
    [("padding=1", ("padding", 1)), ("stride=2,1", ("stride", (2, 1))), ("eps=1e-5", ("eps", 1e-5)), ("flag=true", ("flag", True))],
)
def test_parse_attr(text, want):
    assert cli.parse_attr(text) == want


def test_module_entry_point_runs():
    """``python -m fusekit.cli`` (the same ``main`` as the installed ``fusekit`` script)."""
    p = subprocess.run([sys.executable, "-m", "fusekit.cli", "patterns", "ls"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "conv_bias_relu" in p.stdout and "conv_bias" in p.stdout
    p = subprocess.run([sys.executable, "-m", "fusekit.cli", "patterns", "show", "nope"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr


def test_console_script_runs():
    """The ``fusekit`` console script that ``pip install`` puts beside the interpreter."""
    script = Path(sys.executable).with_name("fusekit")
    exe = str(script) if script.exists() else shutil.which("fusekit")
    if exe is None:
        pytest.skip("no installed `fusekit` console script beside this Python or on PATH")
    p = subprocess.run([exe, "patterns", "ls"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "conv_bias_relu" in p.stdout
