"""Patterns, attributes and the CLI's --attr values are checked where they are read: a default of the
wrong type or out of its own bounds, NaN / infinite values, other scripts' digits, a pattern name that
is a path, a file that cannot load, bytes given as text."""

import math
import textwrap

import pytest
from click.testing import CliRunner

import fusekit
from fusekit.cli.common import parse_attr
from fusekit.engine.patterns import PatternError, get_pattern, list_patterns, parse_pattern, scan_patterns
from fusekit.errors import OperandError

RELU = textwrap.dedent('''
    name = "{name}"
    summary = "s"
    [operands]
    x = {{ kind = "image", role = "input" }}
    [attrs]
    {attrs}
    [[ops]]
    op = "relu"
    in = {{ input = "x" }}
    attrs = {{ upper_clip = 6.0 }}
    out = "y"
    [outputs]
    y = {{ like = "x" }}
''')


@pytest.mark.parametrize("attrs,match", [
    ('padding = { default = "abc", min = 0 }', "takes no min"),
    ('padding = { default = [1, "a"] }', "list of ints"),
    ("padding = { default = [0, 0], min = -1.5e400 }", "finite number"),
    ("padding = { default = [-1, 0], min = 0 }", "does not pass its own checks"),
    ("scale = { default = nan }", "NaN"),
    ("scale = { default = 1.0, mn = 0 }", "unknown key"),
    ("scale = { default = {} }", "must be a bool, int, float"),
])
def test_attribute_defaults_are_checked_at_load(attrs, match):
    with pytest.raises(PatternError, match=match):
        parse_pattern(RELU.format(name="p", attrs=attrs))


def test_a_good_default_loads():
    p = parse_pattern(RELU.format(name="p", attrs="padding = { default = [0, 0], min = 0 }\nupper = { default = inf, min = 0.0 }"))
    assert dict(p.normalize_attrs({}))["padding"] == (0, 0)


@pytest.mark.parametrize("value", [math.nan, -math.inf, "nan"])
def test_nan_and_infinite_attribute_values_are_refused(value):
    pat = parse_pattern(RELU.format(name="p", attrs="scale = { default = 1.0 }\nupper = { default = inf, min = 0.0 }"))
    with pytest.raises(OperandError, match="finite"):
        pat.normalize_attrs({"scale": value})
    assert dict(pat.normalize_attrs({"upper": math.inf}))["upper"] == math.inf  # inf where the default itself is inf
    with pytest.raises(OperandError, match="finite"):
        pat.normalize_attrs({"upper": math.nan})


def test_cli_oracle_refuses_nan_attribute():
    from fusekit.cli import main

    r = CliRunner().invoke(main, ["oracle", "relu", "--shape", "x=1,2,3,3", "--attr", "upper_clip=nan"])
    assert r.exit_code != 0 and "finite" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("text", ["padding=\u0661", "padding=\u0661,\u0662", "scale=\u0663.5"])
def test_cli_attr_values_take_ascii_digits_only(text):
    name, value = parse_attr(text)
    assert isinstance(value, str) or all(isinstance(v, str) for v in value)
    with pytest.raises(OperandError):
        get_pattern("conv_bias_relu").normalize_attrs({name: value} if name == "padding" else {"padding": value})


@pytest.mark.parametrize("name", ["../patterns/conv_bias_relu", "conv_bias_relu.toml", "/etc/passwd", "", 42])
def test_pattern_names_are_identifiers_not_paths(name):
    with pytest.raises(PatternError, match="identifier"):
        get_pattern(name)


def test_unloadable_pattern_files_are_not_listed(tmp_path, monkeypatch):
    (tmp_path / "broken.toml").write_bytes(b"name = \"broken\"\n\xff\xfe")
    (tmp_path / "bad-name.toml").write_text("x")
    monkeypatch.setenv("FUSEKIT_PATTERNS", str(tmp_path))
    names = list_patterns()
    assert "broken" not in names and "bad-name" not in names and "conv_bias_relu" in names
    good, bad = scan_patterns()
    assert any("broken" in str(e) and "UTF-8" in str(e) for e in bad)


def test_parse_pattern_given_bytes_says_so():
    with pytest.raises(PatternError, match="decode bytes as UTF-8"):
        parse_pattern(RELU.format(name="p", attrs="").encode())


def test_fusekit_exports_still_work():
    assert "conv_bias_relu" in fusekit.list_patterns()


@pytest.mark.parametrize("raw", ["1e23", "100000000000000000000000", "\u0665\u0661\u0662", "0", "-3", "abc", ""])
def test_cache_size_setting_is_a_bounded_ascii_integer(monkeypatch, raw):
    from fusekit import config
    from fusekit.errors import SettingError

    monkeypatch.setenv("FUSEKIT_CACHE_SIZE", raw)
    with pytest.raises(SettingError, match="FUSEKIT_CACHE_SIZE"):
        config.cache_size()


@pytest.mark.parametrize("kw,match", [({"maxsize": "abc"}, "maxsize"), ({"maxsize": 0}, "maxsize"), ({"maxsize": True}, "maxsize"),
                                      ({"maxsize": 10**9}, "maxsize"), ({"cache_dir": "FILE"}, "cache_dir")])
def test_configure_refuses_bad_settings_at_once_and_keeps_the_old_cache(tmp_path, kw, match):
    from fusekit.engine import cache as cache_mod
    from fusekit.errors import SettingError

    if kw.get("cache_dir") == "FILE":
        (tmp_path / "f").write_text("x")
        kw = {"cache_dir": tmp_path / "f" / "sub"}
    before = cache_mod.default_cache()
    with pytest.raises(SettingError, match=match):
        fusekit.configure(**kw)
    assert cache_mod.default_cache() is before


@pytest.mark.parametrize("operand,match", [
    (lambda np: np.array([["a"]]), "strings"), (lambda np: object(), "Python objects"),
    (lambda np: np.ones((1, 2, 3, 3)) + 1j, "complex values"),
])
def test_oracle_refuses_operands_without_real_numbers(operand, match):
    import numpy as np

    from fusekit.engine import oracle

    with pytest.raises(OperandError, match=f"relu: operand 'x': expected a real-valued numeric array, got {match}"):
        oracle.evaluate("relu", operand(np))


def test_oracle_refuses_a_tensor_with_autograd_history_and_a_non_pattern():
    import numpy as np

    from fusekit.engine import oracle

    torch = pytest.importorskip("torch")
    with pytest.raises(OperandError, match="detach"):
        oracle.evaluate("relu", torch.ones(1, 2, 3, 3, requires_grad=True))
    got = oracle.evaluate("relu", torch.tensor([[[[-1.0, 2.0]]]]))[0]
    assert np.array_equal(got, [[[[0.0, 2.0]]]])
    with pytest.raises(OperandError, match="pattern name or Pattern, got int 42"):
        oracle.evaluate(42, np.ones((1, 2, 3, 3)))


def test_norm_ops_given_host_tensors_say_so():
    from fusekit import ops

    torch = pytest.importorskip("torch")
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(OperandError, match="bn_normalize: operand 'x': expected a CUDA device array"):
        ops.bn_normalize(x)
    with pytest.raises(OperandError, match="bn_normalize_backward: operand 'x': expected a CUDA device array"):
        ops.bn_normalize_backward(x, x, torch.randn(3), torch.randn(3))


def test_the_readmes_pattern_example_loads_and_shadows_no_shipped_pattern(tmp_path, monkeypatch):
    """The README's pattern file, copied as a new user would, parses, has a name of its own (copied
    into $FUSEKIT_PATTERNS it cannot shadow a shipped pattern), and evaluates in the oracle."""
    import re
    from pathlib import Path

    import numpy as np

    from fusekit.engine import oracle

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    text = next(t for t in re.findall(r"```toml\n(.*?)```", readme, re.S) if "[[ops]]" in t)
    pat = parse_pattern(text)
    shipped = set(list_patterns())
    assert pat.name not in shipped
    (tmp_path / f"{pat.name}.toml").write_text(text)
    monkeypatch.setenv("FUSEKIT_PATTERNS", str(tmp_path))
    assert set(list_patterns()) == shipped | {pat.name}
    rng = np.random.default_rng(0)
    x, w, b, z = rng.standard_normal((1, 2, 5, 5)), rng.standard_normal((3, 2, 3, 3)), rng.standard_normal(3), rng.standard_normal((1, 3, 5, 5))
    mine = oracle.evaluate(pat.name, x, w, b, z, padding=1)[0]
    assert np.allclose(mine, oracle.evaluate("conv_bias_add_relu", x, w, b, z, padding=1)[0])
