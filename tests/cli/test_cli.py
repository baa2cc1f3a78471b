"""The command line, on any machine (no GPU needed except where a test says so)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fusekit import cli
from fusekit.cli import main
from fusekit.errors import forget_warnings

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
    r = invoke("patterns", "ls", "--wide")
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


def strict_json(text: str):
    """json.loads that refuses Infinity / NaN, as jq and other strict parsers do."""
    def refuse(c):
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(text, parse_constant=refuse)


def test_patterns_show_json_is_strict_json():
    """A plain ReLU's upper_clip is inf: the JSON says "inf", not the Infinity jq refuses."""
    r = invoke("patterns", "show", "relu", "--json")
    assert r.exit_code == 0, r.output
    assert strict_json(r.output)["attrs"] == {"upper_clip": "inf"}
    r = invoke("patterns", "show", "relu", "--shape", "x=2,3,4,5", "--dtype", "float16", "--json")
    assert r.exit_code == 0, r.output
    doc = strict_json(r.output)
    assert doc["lowered"]["shapes"]["y"] == [2, 3, 4, 5]


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


def test_doctor_counts_the_stored_plans_and_decisions(tmp_path, monkeypatch):
    from fusekit.engine.cache import DiskStore

    DiskStore(tmp_path).write_fusion({"tag": "batchnorm_relu", "mode": "heuristic"}, 0.02, 0.03, "fused")
    monkeypatch.setenv("FUSEKIT_CACHE_DIR", str(tmp_path))
    r = invoke("doctor")
    assert r.exit_code == 0 and f"disk at {tmp_path} (0 stored plan(s), 1 fused-or-split decision(s))" in r.output, r.output


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


# ----------------------------------------------------------------------------------------------
# autotune: spec files, input checks before the GPU, and the command with a stand-in tuner
# ----------------------------------------------------------------------------------------------
SPEC = """
[[layer]]
pattern = "conv_bias_relu"
shapes = { x = [2, 8, 16, 16], w = [16, 8, 3, 3], b = [16] }
attrs = { padding = 1, stride = [1, 1] }

[[layer]]
pattern = "linear_bias_relu"
shapes = { x = [4, 8], w = [16, 8], b = [16] }
dtype = "bfloat16"

[[layer]]
pattern = "conv"
shapes = { x = [1, 3, 9, 11], w = [4, 3, 3, 3] }
layout = "nchw"
"""

LAYER1 = """
[[layer]]
pattern = "conv_bias_relu"
shapes = { x = [2, 8, 16, 16], w = [16, 8, 3, 3], b = [16] }
"""


def test_parse_spec_valid():
    a, b, c = cli.parse_spec(SPEC, "net.toml")
    assert (a.index, b.index, c.index) == (1, 2, 3)
    assert a.pattern == "conv_bias_relu"
    assert a.shapes == {"x": (2, 8, 16, 16), "w": (16, 8, 3, 3), "b": (16,)}
    assert a.attrs == {"padding": 1, "stride": (1, 1)}
    assert (a.dtype, a.layout) == ("float16", "NHWC")
    assert b.pattern == "linear_bias_relu" and b.dtype == "bfloat16" and b.attrs == {}
    assert c.shapes == {"x": (1, 3, 9, 11), "w": (4, 3, 3, 3)} and c.layout == "NCHW"
    # --dtype / --layout are the defaults of layers that do not say
    a2, b2, c2 = cli.parse_spec(SPEC, dtype="float32", layout="NCHW")
    assert (a2.dtype, a2.layout) == ("float32", "NCHW") and b2.dtype == "bfloat16" and c2.dtype == "float32"
    assert "padding=1" in a.describe() and "x=2,8,16,16" in a.describe()


def test_load_spec_reads_a_file(tmp_path):
    f = tmp_path / "net.toml"
    f.write_text(SPEC)
    assert cli.load_spec(f) == cli.parse_spec(SPEC, str(f))
    with pytest.raises(cli.SpecError, match="cannot read"):
        cli.load_spec(tmp_path / "missing.toml")


def _layer(pattern="conv", shapes="{ x = [1, 3, 8, 8], w = [4, 3, 3, 3] }", extra=""):
    return f'\n[[layer]]\npattern = "{pattern}"\nshapes = {shapes}\n{extra}\n'


BAD_SPECS = [
    ("[[layer]\npattern = 'conv'\n", ["not valid TOML", "line 1"]),
    ("[[layers]]\npattern = 'conv'\n", ["unknown top-level key 'layers'"]),
    ("", ["no [[layer]] tables"]),
    ("layer = 3\n", ["'layer' must be [[layer]] tables"]),
    ("layer = [1, 2]\n", ["'layer' must be [[layer]] tables"]),
    (LAYER1 + _layer(extra="shape = 3"), ["layer 2 (conv)", "key 'shape'", "unknown key"]),
    ("[[layer]]\nshapes = { x = [1, 3, 8, 8] }\n", ["layer 1:", "key 'pattern'", "missing"]),
    ("[[layer]]\npattern = 3\n", ["layer 1:", "key 'pattern'", "expected a pattern name"]),
    (LAYER1 + _layer(pattern="no_such_pattern"), ["layer 2 (no_such_pattern)", "key 'pattern'", "no pattern 'no_such_pattern'", "conv_bias_relu"]),
    ('[[layer]]\npattern = "conv"\n', ["layer 1 (conv)", "key 'shapes'", "missing", "x = [N, C, H, W]"]),
    (_layer(shapes="[1, 2]"), ["key 'shapes'", "expected a table"]),
    (_layer(shapes='{ x = ["a"], w = [4, 3, 3, 3] }'), ["key 'shapes.x'", "positive integers"]),
    (_layer(shapes="{ x = [1, 0, 8, 8], w = [4, 3, 3, 3] }"), ["key 'shapes.x'", "positive integers"]),
    (_layer(shapes="{ x = [], w = [4, 3, 3, 3] }"), ["key 'shapes.x'", "positive integers"]),
    (_layer(shapes="{ x = [1, 3, 8.5, 8], w = [4, 3, 3, 3] }"), ["key 'shapes.x'", "positive integers"]),
    (_layer(shapes="{ x = [1, 3, true, 8], w = [4, 3, 3, 3] }"), ["key 'shapes.x'", "positive integers"]),
    (_layer(shapes="{ x = 3, w = [4, 3, 3, 3] }"), ["key 'shapes.x'", "positive integers"]),
    (_layer(shapes="{ x = [1, 3, 8, 8], w = [4, 3, 3, 3], q = [3] }"), ["key 'shapes.q'", "not an operand of conv"]),
    (_layer(shapes="{ x = [1, 3, 8, 8] }"), ["key 'shapes'", "missing operand(s) w of conv"]),
    (LAYER1 + _layer("conv_bias", "{ x = [2, 8, 16, 16], w = [16, 4, 3, 3], b = [16] }"), ["layer 2 (conv_bias)", "key 'shapes.w'", "input channels"]),
    (_layer("conv_bias", "{ x = [2, 8, 16, 16], w = [16, 8, 3, 3], b = [15] }"), ["key 'shapes.b'", "expected length 16"]),
    (_layer(shapes="{ x = [1, 3, 8], w = [4, 3, 3, 3] }"), ["key 'shapes.x'", "4-D"]),
    (_layer(shapes="{ x = [1, 3, 2, 2], w = [4, 3, 3, 3] }"), ["key 'shapes.x'", "smaller than the dilated filter"]),
    (_layer(extra="attrs = 3"), ["key 'attrs'", "expected a table"]),
    (_layer(extra="attrs = { pad = 1 }"), ["key 'attrs.pad'", "unknown attribute"]),
    (_layer(extra='attrs = { padding = "a" }'), ["key 'attrs.padding'", "expected an int or a sequence of 2 ints"]),
    (_layer(extra="attrs = { padding = { h = 1 } }"), ["key 'attrs.padding'", "number, boolean, string"]),
    (_layer(extra="attrs = { padding = -1 }"), ["key 'attrs.padding'", ">= 0"]),
    (_layer(extra="attrs = { stride = [1, 1, 1] }"), ["key 'attrs.stride'"]),
    (_layer(extra='dtype = "float64"'), ["key 'dtype'", "float16, bfloat16, float32", "'float64'"]),
    (_layer(extra="dtype = 16"), ["key 'dtype'"]),
    (_layer(extra='layout = "NCWH"'), ["key 'layout'", "NHWC, NCHW"]),
]


@pytest.mark.parametrize("text, needles", BAD_SPECS)
def test_parse_spec_invalid(text, needles):
    with pytest.raises(cli.SpecError) as ei:
        cli.parse_spec(text, "net.toml")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("spec net.toml: "), msg
    for n in needles:
        assert n in msg, msg


@pytest.mark.parametrize("text, needles", [BAD_SPECS[0], BAD_SPECS[8], BAD_SPECS[19], BAD_SPECS[25]])
def test_autotune_bad_spec_is_one_line_before_the_gpu(tmp_path, text, needles):
    f = tmp_path / "net.toml"
    f.write_text(text)
    line = assert_one_line_error(invoke("autotune", "--spec", str(f)), f"spec {f}", *needles)
    assert "CUDA GPU" not in line


def test_autotune_missing_spec_file_is_one_line(tmp_path):
    assert_one_line_error(invoke("autotune", "--spec", str(tmp_path / "nope.toml")), "nope.toml", "cannot read")


@pytest.mark.parametrize(
    "args, needles",
    [
        (["no_such_pattern", "--shape", "x=1,1,1,1"], ["no_such_pattern", "conv_bias_relu"]),
        (["conv_bias_relu", "--shape", "x=2,8,16,16", "--shape", "w=16,4,3,3", "--shape", "b=16"], ["'w'", "input channels"]),
        (["conv_bias_relu", "--shape", "x=2,8,16,16"], ["missing --shape for operand(s) w, b"]),
        (["conv", "--shape", "x=2,8,16,16", "--shape", "w=16,8,3,3", "--attr", "pad=1"], ["'pad'", "unknown attribute"]),
        (["conv", "--shape", "x=2,8,16,16", "--shape", "w=16,8,3,3", "--shape", "q=3"], ["q is not an operand"]),
        ([], ["give a PATTERN", "--spec FILE"]),
        (["conv", "--shape", "x=2,8,16,16", "--spec", "net.toml"], ["not both"]),
        (["conv", "--shape", "x=1,3,8,8", "--shape", "w=4,3,3,3", "--plot", "out.svg"], ["--plot", ".png"]),
        (["conv", "--shape", "x=1,3,8,8", "--shape", "w=4,3,3,3", "--plot", "/no/such/dir/out.png"], ["--plot", "does not exist"]),
        (["conv", "--workspace-limit", "12X"], ["--workspace-limit", "12X"]),
        (["conv", "--budget", "0"], ["--budget"]),
        (["conv", "--max-candidates", "0"], ["--max-candidates"]),
    ],
)
def test_autotune_checks_input_before_gpu(args, needles):
    line = assert_one_line_error(invoke("autotune", *args), *needles)
    assert "CUDA GPU" not in line


@pytest.mark.skipif(_sees_gpu(), reason="this machine has a GPU: `fusekit autotune` tunes instead of failing")
def test_autotune_without_gpu_fails_with_one_line(tmp_path):
    r = invoke("autotune", "conv_bias_relu", *SHAPES, "--attr", "padding=1", "--cache-dir", str(tmp_path))
    line = assert_one_line_error(r, "fusekit autotune needs a CUDA GPU: ")
    assert r.exit_code == 1, line
    f = tmp_path / "net.toml"
    f.write_text(SPEC)
    r = invoke("autotune", "--spec", str(f), "--cache-dir", str(tmp_path))
    assert_one_line_error(r, "fusekit autotune needs a CUDA GPU: ")
    assert r.exit_code == 1
    assert not (tmp_path / "plans").exists()  # nothing written


@pytest.mark.parametrize("text, want", [("268435456", 268435456), ("256MiB", 256 * 2**20), ("256M", 256 * 2**20), ("1g", 2**30), ("64 KiB", 65536), ("0", 0)])
def test_parse_bytes(text, want):
    assert cli.parse_bytes(text) == want


@pytest.mark.parametrize("text", ["", "12X", "-5", "1.5.2M", "MiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        cli.parse_bytes(text)


class FakeTuner:
    """Stands in for fusekit.autotune.autotune_shapes on a machine without a GPU: reports progress,
    writes a tuned entry to the cache's disk store and returns a TuneResult like the real one."""

    TIMES = (20.0, 8.0, 15.0, None, 11.0)  # candidate 3 is rejected; 1 is the fastest; 0 the heuristic plan

    def __init__(self, fail_dtype=None):
        self.calls = []
        self.fail_dtype = fail_dtype

    def __call__(self, pattern, shapes, *, dtype="float16", layout="NHWC", device=0, library=None, options=None, cache=None, **attrs):
        from fusekit.engine.autotune import Candidate, TuneResult
        from fusekit.engine.cache import PlanKey
        from fusekit.errors import UnsupportedError
        from fusekit.engine.patterns import get_pattern

        self.calls.append(dict(pattern=pattern, shapes=shapes, dtype=dtype, layout=layout, library=library, options=options, attrs=attrs))
        if dtype == self.fail_dtype:
            raise UnsupportedError(f"cuDNN cannot run {pattern} in {dtype}")
        pat = get_pattern(pattern)
        specs = cli.check_tune_input(pat, shapes, attrs, dtype, layout)
        key = PlanKey(pat.name, pat.digest, tuple(specs.items()), (32,) * len(specs), pat.normalize_attrs(attrs), "float32", "Fake GPU", (9, 0), 91000, "1.32.0")
        cands = []
        for i, t in enumerate(self.TIMES):
            c = Candidate(i, f"eng{i}_k{i}=1", engine_id=i, workspace=1024 * i)
            if t is None:
                c.verdict, c.error = "rejected: differs from the heuristic plan by 1.0e-01 (> 4e-03)", 0.1
            else:
                c.time_us, c.times_us, c.error, c.verdict = t, [t], (0.0 if i == 0 else 1e-4), "ok"
            cands.append(c)
            options.progress(i + 1, len(self.TIMES), c)
        meta = {"engine": "eng1_k1=1", "engine_id": 1, "knobs": {"k1": 1}, "uids": [1, 2, 3], "workspace_size": 1024,
                "candidates": len(cands), "build_ms": 5.0, "source": "tuned", "tuning": [c.to_json() for c in cands]}
        cache.store.write(key, meta, b"not a real cuDNN plan")
        return TuneResult(key, cands, 1, 20.0, 8.0, 0.25)


@pytest.fixture
def fake_tuner(monkeypatch):
    import importlib

    tuner = FakeTuner()
    monkeypatch.setattr(importlib.import_module("fusekit.engine.autotune"), "autotune_shapes", tuner)
    monkeypatch.setattr(importlib.import_module("fusekit.cli.autotune"), "require_gpu", lambda command: ("torch", None))
    return tuner


def test_autotune_tables_summary_plot_and_cache(fake_tuner, tmp_path):
    png = tmp_path / "times.png"
    r = invoke(
        "autotune", "conv_bias_relu", *SHAPES, "--attr", "padding=1", "--budget", "1.5", "--max-candidates", "8",
        "--workspace-limit", "256MiB", "--deterministic", "--cache-dir", str(tmp_path / "cache"), "--plot", str(png),
    )
    assert r.exit_code == 0, r.output
    (call,) = fake_tuner.calls
    assert call["pattern"] == "conv_bias_relu" and call["shapes"]["w"] == (16, 8, 3, 3) and call["attrs"] == {"padding": 1}
    assert call["library"] == "torch" and (call["dtype"], call["layout"]) == ("float16", "NHWC")
    opt = call["options"]
    assert (opt.budget_s, opt.max_candidates, opt.workspace_limit, opt.deterministic) == (1.5, 8, 256 * 2**20, True)
    rows = {ln.split()[1]: ln for ln in r.output.splitlines() if re.match(r"^\d+\s+eng\d", ln)}
    assert set(rows) == {f"eng{i}_k{i}=1" for i in range(5)}
    assert rows["eng1_k1=1"].rstrip().endswith("best") and "8.00" in rows["eng1_k1=1"]
    assert rows["eng0_k0=1"].rstrip().endswith("heuristic") and "2.50x" in rows["eng0_k0=1"]
    assert "rejected" in rows["eng3_k3=1"]
    order = [ln.split()[1] for ln in r.output.splitlines() if re.match(r"^\d+\s+eng\d", ln)]
    assert order == ["eng1_k1=1", "eng4_k4=1", "eng2_k2=1", "eng0_k0=1", "eng3_k3=1"]  # fastest first, then the rest
    assert "2.50x speed-up" in r.output and "4 of 5 candidates timed" in r.output
    assert "1 tuned plan saved to the plan cache at" in r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ls = invoke("cache", "ls", "--cache-dir", str(tmp_path / "cache"))
    assert ls.exit_code == 0 and "conv_bias_relu" in ls.output and "Fake GPU" in ls.output and "padding=1,1" in ls.output


def test_autotune_spec_runs_every_layer_once(fake_tuner, tmp_path):
    f = tmp_path / "net.toml"
    f.write_text(SPEC + LAYER1.replace("[[layer]]", "[[layer]]\nattrs = { padding = [1, 1], stride = 1 }"))
    r = invoke("autotune", "--spec", str(f), "--cache-dir", str(tmp_path / "cache"), "--plot", str(tmp_path / "p.png"))
    assert r.exit_code == 0, r.output
    assert [c["pattern"] for c in fake_tuner.calls] == ["conv_bias_relu", "linear_bias_relu", "conv"]
    assert [c["dtype"] for c in fake_tuner.calls] == ["float16", "bfloat16", "float16"]
    assert "layer 4: the same key as layer 1; skipped" in r.output
    assert r.output.count("speed-up") == 3 and "3 tuned plans saved" in r.output
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert len(list((tmp_path / "cache" / "plans").glob("*/*.plan"))) == 3


def test_autotune_spec_reports_a_failing_layer_and_goes_on(fake_tuner, tmp_path):
    fake_tuner.fail_dtype = "bfloat16"
    f = tmp_path / "net.toml"
    f.write_text(SPEC)
    r = invoke("autotune", "--spec", str(f), "--cache-dir", str(tmp_path / "cache"))
    assert r.exit_code == 1
    assert "layer 2: linear_bias_relu bfloat16" in r.output and "FAILED: cuDNN cannot run linear_bias_relu in bfloat16" in r.output
    assert r.output.count("speed-up") == 2
    assert r.output.rstrip().splitlines()[-1] == "Error: 1 of 3 layers could not be tuned: layer(s) 2"


def test_autotune_single_failure_is_one_line(fake_tuner, tmp_path):
    fake_tuner.fail_dtype = "float32"
    r = invoke("autotune", "conv", "--shape", "x=1,3,8,8", "--shape", "w=4,3,3,3", "--dtype", "float32", "--cache-dir", str(tmp_path))
    assert_one_line_error(r, "tuning conv float32", "cuDNN cannot run conv in float32")


def test_plot_tuning_writes_a_png(tmp_path):
    ok = [{"index": i, "name": f"e{i}", "time_us": t, "workspace": 0, "error": 0.0, "verdict": "ok"} for i, t in enumerate([5.0, 2.0, 40.0])]
    none = [{"index": 0, "name": "e0", "time_us": None, "workspace": 0, "error": None, "verdict": "failed: x"}]
    cli.plot_tuning([("a very long label " * 5, ok), ("nothing ran", none)], tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tuning_summary_picks_best_and_first_plan():
    cands = [
        {"index": 2, "name": "c", "time_us": 3.0, "verdict": "ok"},
        {"index": 0, "name": "a", "time_us": None, "verdict": "failed: x"},
        {"index": 1, "name": "b", "time_us": 9.0, "verdict": "ok"},
    ]
    best, first = cli.tuning_summary(cands)
    assert best["name"] == "c" and first["name"] == "b"
    assert cli.tuning_summary([cands[1]]) == (None, None)


# ----------------------------------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(_sees_gpu(), reason="this machine has a GPU: `fusekit bench` runs instead of failing")
def test_bench_without_gpu_fails_with_one_line():
    r = invoke("bench", "conv_bias_relu", *SHAPES, "--attr", "padding=1", "--repeat", "3")
    assert_one_line_error(r, "fusekit bench needs a CUDA GPU: ")
    assert r.exit_code == 1
    r = invoke("bench", "batchnorm_inference", "--shape", "x=2,8,4,4", *(f"--shape={n}=8" for n in ("mean", "inv_std", "gamma", "beta")))
    assert_one_line_error(r, "fusekit bench needs a CUDA GPU: ")


@pytest.mark.parametrize(
    "args, needles",
    [
        (["no_such_pattern", "--shape", "x=1,1,1,1"], ["no_such_pattern"]),
        (["conv_bias_relu", "--shape", "x=2,8,16,16", "--shape", "w=16,4,3,3", "--shape", "b=16"], ["'w'", "input channels"]),
        (["conv_bias_relu", "--shape", "x=2,8,16,16"], ["missing --shape"]),
        (["conv", "--shape", "x=1,3,8,8", "--shape", "w=4,3,3,3", "--repeat", "0"], ["--repeat"]),
    ],
)
def test_bench_checks_input_before_gpu(args, needles):
    line = assert_one_line_error(invoke("bench", *args), *needles)
    assert "CUDA GPU" not in line


REF_CASES = [
    ("conv", {"x": (2, 3, 9, 8), "w": (4, 3, 3, 2)}, {"padding": 1, "stride": (2, 1)}),
    ("conv_bias", {"x": (2, 3, 7, 7), "w": (5, 3, 3, 3), "b": (5,)}, {"dilation": 2}),
    ("conv_bias_relu", {"x": (1, 4, 6, 6), "w": (3, 4, 3, 3), "b": (3,)}, {"padding": 1}),
    ("conv_bias_add_relu", {"x": (1, 4, 6, 6), "w": (3, 4, 3, 3), "b": (3,), "z": (1, 3, 6, 6)}, {"padding": 1}),
    ("conv_transpose_bias", {"x": (2, 4, 5, 5), "w": (4, 3, 3, 3), "b": (3,)}, {"stride": 2, "padding": 1, "output_padding": 1}),
    ("conv_transpose_bias_relu", {"x": (1, 4, 5, 6), "w": (4, 2, 2, 3), "b": (2,)}, {"stride": 2}),
    ("linear_bias", {"x": (4, 8), "w": (6, 8), "b": (6,)}, {}),
    ("linear_bias_relu", {"x": (5, 3), "w": (7, 3), "b": (7,)}, {}),
    ("matmul", {"a": (4, 8), "b": (8, 3)}, {}),
    ("relu", {"x": (2, 3, 4, 5)}, {}),
    ("relu", {"x": (2, 3, 4, 5)}, {"upper_clip": 0.5}),
    ("conv_bias_relu6", {"x": (2, 3, 6, 6), "w": (4, 3, 3, 3), "b": (4,)}, {"padding": 1}),
    ("batchnorm_inference", {"x": (2, 3, 4, 4), "mean": (3,), "inv_std": (3,), "gamma": (3,), "beta": (3,)}, {}),
    ("batchnorm_inference_relu", {"x": (2, 3, 4, 4), "mean": (3,), "inv_std": (3,), "gamma": (3,), "beta": (3,)}, {}),
]


@pytest.mark.parametrize("name, shapes, attrs", REF_CASES, ids=[c[0] for c in REF_CASES])
def test_bench_torch_references_match_the_oracle(name, shapes, attrs):
    """The PyTorch side of `fusekit bench` computes what the pattern does (float64, on the CPU)."""
    torch = pytest.importorskip("torch")
    from fusekit.engine import oracle
    from fusekit.engine.patterns import get_pattern

    ref = cli.torch_references()[name]
    pat = get_pattern(name)
    rng = np.random.default_rng(0)
    arrays = []
    for o in pat.operands:
        a = rng.standard_normal(shapes[o.name])
        arrays.append(np.abs(a) + 0.5 if o.name in ref.positive else a)
    want = oracle.evaluate(pat, *arrays, **attrs)[0]
    tensors = [torch.from_numpy(a) for a in arrays]
    args = ref.prepare(tensors) if ref.prepare else tensors
    got = ref.fn(*args, **dict(pat.normalize_attrs(attrs))).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_bench_references_cover_the_common_patterns():
    pytest.importorskip("torch")
    refs = cli.torch_references()
    for name in ("conv", "conv_bias", "conv_bias_relu", "conv_transpose_bias", "conv_transpose_bias_relu",
                 "linear_bias", "linear_bias_relu", "relu", "batchnorm_inference", "batchnorm_inference_relu"):
        assert name in refs and refs[name].what


# ----------------------------------------------------------------------------------------------
# On a GPU (skipped elsewhere): the real tuner and benchmark, end to end
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_autotune_on_gpu(tmp_path):
    png = tmp_path / "t.png"
    r = invoke("autotune", "conv_bias_relu", *SHAPES, "--attr", "padding=1", "--budget", "2", "--max-candidates", "6",
               "--cache-dir", str(tmp_path / "cache"), "--plot", str(png))
    assert r.exit_code == 0, r.output
    assert "speed-up" in r.output and "best" in r.output and "heuristic" in r.output
    assert png.read_bytes()[:4] == b"\x89PNG"
    ls = invoke("cache", "ls", "--cache-dir", str(tmp_path / "cache"))
    assert ls.exit_code == 0 and "conv_bias_relu" in ls.output and "tuned" in ls.output
    assert invoke("cache", "verify", "--cache-dir", str(tmp_path / "cache")).exit_code == 0


@pytest.mark.gpu
def test_autotune_spec_file_on_gpu(tmp_path):
    """A spec file end to end: every layer tuned, written to the store, listed by `cache ls`."""
    spec = tmp_path / "net.toml"
    spec.write_text(
        '[[layer]]\npattern = "conv_bias_relu"\nshapes = { x = [4, 16, 14, 14], w = [32, 16, 3, 3], b = [32] }\nattrs = { padding = 1 }\n\n'
        '[[layer]]\npattern = "conv_bias"\nshapes = { x = [4, 32, 14, 14], w = [64, 32, 1, 1], b = [64] }\n'
    )
    r = invoke("autotune", "--spec", str(spec), "--budget", "1", "--max-candidates", "4", "--cache-dir", str(tmp_path / "cache"))
    assert r.exit_code == 0, r.output
    ls = invoke("cache", "ls", "--cache-dir", str(tmp_path / "cache"))
    assert ls.exit_code == 0 and "conv_bias_relu" in ls.output and "conv_bias " in ls.output + " " and ls.output.count("tuned") >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("args", [
    ["conv_bias_relu", *SHAPES, "--attr", "padding=1"],
    ["linear_bias_relu", "--shape", "x=64,128", "--shape", "w=256,128", "--shape", "b=256"],
    ["conv_bias", *SHAPES, "--attr", "padding=1"],
    ["conv_genstats", "--shape", "x=2,8,8,8", "--shape", "w=8,8,3,3", "--attr", "padding=1"],
])
def test_bench_on_gpu(args):
    r = invoke("bench", *args, "--repeat", "10", "--warmup", "3")
    assert r.exit_code == 0, r.output
    assert "fusekit" in r.output and "median (us)" in r.output


# ----------------------------------------------------------------------------------------------
# a new user on a CPU machine: huge shapes, bad seeds, broken pattern directories, narrow terminals
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shapes, needles",
    [
        (["--shape", "x=1000000000000"], ["operand 'x'", "larger than 2147483647"]),
        (["--shape", "x=2,8,1000000,1000000"], ["more than its limit of 2.0 GiB", "operand 'x'", "TiB"]),
        (["--shape", "x=2,8,3000,3000"], ["would need 2.1 GiB", "limit of 2.0 GiB", "'x' of shape (2, 8, 3000, 3000)"]),
    ],
)
def test_oracle_refuses_shapes_too_large_for_host_memory(shapes, needles):
    """No numpy _ArrayMemoryError traceback: one line naming the operand and the limit."""
    assert_one_line_error(invoke("oracle", "relu", *shapes), *needles)


def test_oracle_memory_limit_counts_outputs():
    r = invoke("oracle", "conv_bias_relu", "--shape", "x=1,1,4,4", "--shape", "w=1,1,1,1", "--shape", "b=1", "--attr", "padding=9000")
    assert_one_line_error(r, "conv_bias_relu", "output 'y' of shape (1, 1, 18004, 18004)", "limit of 2.0 GiB")


def test_oracle_seed_must_not_be_negative():
    r = invoke("oracle", "relu", "--shape", "x=2,3", "--seed", "-1")
    assert r.exit_code == 2
    assert_one_line_error(r, "--seed", "-1", ">=0")
    assert invoke("oracle", "relu", "--shape", "x=2,3", "--seed", "0").exit_code == 0


@pytest.mark.parametrize(
    "args, needles",
    [
        (["relu", "--shape", "x=1000000000000"], ["relu: operand 'x'", "dim 1000000000000", "2147483647"]),
        (["relu", "--shape", "x=99999999999999999999999,3"], ["operand 'x'", "dim 99999999999999999999999"]),
        (["relu", "--shape", "x=2147483647,2147483647,2147483647,4"], ["operand 'x'", "2^63"]),
        (["conv", "--attr", "padding=1000000000000"], ["conv: attribute 'padding'", "at most 2147483647"]),
        (["conv", "--shape", "x=1,1,4,4", "--shape", "w=1,1,3,3", "--attr", "padding=1000000000000,0"], ["attribute 'padding'"]),
        (["conv", "--shape", "x=1,1,4,4", "--shape", "w=1,1,3,3", "--attr", "stride=99999999999999999999"], ["attribute 'stride'"]),
        (["conv", "--shape", "x=1,1,4,4", "--shape", "w=1,1,3,3", "--attr", "padding=2147483647"], ["output 'y'", "dim 4294967296"]),
    ],
)
def test_patterns_show_refuses_absurd_dims_and_attrs(args, needles):
    assert_one_line_error(invoke("patterns", "show", *args), *needles)


@pytest.fixture
def user_patterns(tmp_path, monkeypatch, fresh_session):
    """An empty $FUSEKIT_PATTERNS directory, a fresh session (registry, warnings given)."""
    d = tmp_path / "user"
    d.mkdir()
    monkeypatch.setenv("FUSEKIT_PATTERNS", str(d))
    return d


def test_non_utf8_pattern_file_is_skipped_with_a_warning(user_patterns):
    bad = user_patterns / "latin1.toml"
    bad.write_bytes('name = "latin1"\nsummary = "caf\xe9"\n'.encode("latin-1"))
    for args in (["patterns", "ls"], ["patterns", "ls", "--wide"]):
        r = invoke(*args)
        assert r.exit_code == 0, r.output
        assert "conv_bias_relu" in r.stdout and "latin1" not in r.stdout
        warning = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(warning) == 1 and warning[0].startswith("Warning: ") and str(bad) in warning[0] and "UTF-8" in warning[0]
    assert_one_line_error(invoke("patterns", "show", "latin1"), str(bad), "not UTF-8")
    assert_one_line_error(invoke("oracle", "latin1", "--shape", "x=2"), str(bad), "not UTF-8")
    assert invoke("oracle", "relu", "--shape", "x=2,3").exit_code == 0  # the other patterns still work


def test_missing_pattern_directory_is_warned_about_once(user_patterns, monkeypatch, tmp_path):
    missing = tmp_path / "nonexistent"
    monkeypatch.setenv("FUSEKIT_PATTERNS", str(missing))
    r = invoke("patterns", "ls")
    assert r.exit_code == 0, r.output
    assert "conv_bias_relu" in r.stdout
    warnings_ = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert warnings_ == [f"Warning: FUSEKIT_PATTERNS: pattern directory {missing} does not exist; no patterns are read from it"]
    r = invoke("oracle", "relu", "--shape", "x=2,3")
    assert r.exit_code == 0 and "does not exist" not in r.stderr  # once per process


def test_patterns_ls_fits_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    r = invoke("patterns", "ls")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= 80, "\n".join(ln for ln in lines if len(ln) > 80)
    rows = {ln.split()[0]: ln for ln in lines if ln.strip()}
    assert set(rows) >= {"NAME", "conv", "conv_bias_relu", "batchnorm_inference_relu", "shift_grad"}
    assert rows["conv_bias_relu"].split()[1:4] == ["x", "w", "b"]  # operand names in full
    assert "…" in rows["batchnorm"]  # long fields cut short
    assert "--wide" in r.stdout
    wide = invoke("patterns", "ls", "--wide")
    assert max(len(ln) for ln in wide.stdout.splitlines()) > 80  # everything, however wide
