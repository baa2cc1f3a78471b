"""CPU: pattern files (loading, validation messages, lookup through $FUSEKIT_PATTERNS, attributes, digest)."""

import os
from pathlib import Path

import numpy as np
import pytest

import fusekit
from fusekit.engine import oracle, patterns
from fusekit.errors import OperandError, PatternError
from fusekit.engine.patterns import OPS, get_pattern, list_patterns, load_pattern, parse_pattern
from fusekit.errors import forget_warnings
from fusekit.dispatch import execute

SHIPPED_DIR = Path(patterns.__file__).resolve().parents[2] / "patterns"
SHIPPED = sorted(p.stem for p in SHIPPED_DIR.glob("*.toml"))

# A small valid pattern; the malformed cases below each break one thing in it.
GOOD = """\
name = "{name}"
summary = "conv then bias then relu"

[operands]
x = {{ kind = "image", role = "input" }}
w = {{ kind = "filter", role = "weight" }}
b = {{ kind = "channel", role = "bias" }}

[attrs]
padding = {{ default = [0, 0], min = 0 }}
stride = {{ default = [1, 1], min = 1 }}
dilation = {{ default = [1, 1], min = 1 }}

[[ops]]
op = "conv_fprop"
in = {{ image = "x", weight = "w" }}
attrs = ["padding", "stride", "dilation"]
out = "conv"

[[ops]]
op = "bias"
in = {{ input = "conv", bias = "b" }}
out = "pre"

[[ops]]
op = "relu"
in = {{ input = "pre" }}
out = "y"

[outputs]
y = {{ like = "x" }}
"""


def good(name="mypat"):
    return GOOD.format(name=name)


def write(tmp_path, text, stem="mypat"):
    path = tmp_path / f"{stem}.toml"
    path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------
# shipped patterns
# ----------------------------------------------------------------------------------------------
def test_shipped_set_is_present():
    assert {"conv", "conv_bias", "conv_bias_relu"} <= set(SHIPPED)
    assert set(SHIPPED) <= set(list_patterns())


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_pattern_loads(name):
    pat = load_pattern(SHIPPED_DIR / f"{name}.toml")
    assert pat.name == name
    assert pat.source.endswith(f"{name}.toml")
    assert pat.ops and pat.operands and pat.outputs
    assert all(op.op in OPS for op in pat.ops)
    names = set(pat.operand_names)
    produced = {o for op in pat.ops for o in op.produces}
    for out, like in pat.outputs.items():
        assert out in produced
        assert like in names
    # every op reads something defined before it
    defined = set(names)
    for op in pat.ops:
        assert set(op.inputs.values()) <= defined
        defined.add(op.out)
    assert len(pat.digest) == 16 and int(pat.digest, 16) >= 0
    # the registry gives the same pattern
    assert get_pattern(name) == pat


def test_shipped_digests_differ():
    digests = [get_pattern(n).digest for n in SHIPPED]
    assert len(set(digests)) == len(digests)


def test_good_template_parses(tmp_path):
    """The base of the malformed cases is itself valid (so each case breaks exactly one thing)."""
    pat = load_pattern(write(tmp_path, good()))
    assert pat.name == "mypat"
    assert [op.op for op in pat.ops] == ["conv_fprop", "bias", "relu"]
    assert pat.operand_names == ("x", "w", "b")


# ----------------------------------------------------------------------------------------------
# malformed files
# ----------------------------------------------------------------------------------------------
MALFORMED = {
    "invalid_toml": (lambda t: t.replace('name = "mypat"', 'name = "mypat'), r"not valid TOML"),
    "unknown_op": (lambda t: t.replace('op = "relu"', 'op = "gelu_tanh"'), r"ops\[2\]: unknown op 'gelu_tanh'"),
    "undefined_operand": (
        lambda t: t.replace('in = { input = "pre" }', 'in = { input = "nope" }'),
        r"ops\[2\] \(relu\): port 'input' reads undefined operand 'nope'",
    ),
    "value_used_before_produced": (
        lambda t: t.replace('in = { input = "conv", bias = "b" }', 'in = { input = "y", bias = "b" }'),
        r"ops\[1\] \(bias\): port 'input' reads undefined operand 'y'",
    ),
    "output_not_produced": (
        lambda t: t.replace('y = { like = "x" }', 'z = { like = "x" }'),
        r"output 'z' is not produced by any op",
    ),
    "unknown_kind": (
        lambda t: t.replace('b = { kind = "channel", role = "bias" }', 'b = { kind = "tensor5d", role = "bias" }'),
        r"operand 'b' has unknown kind 'tensor5d'",
    ),
    "undeclared_pattern_attr": (
        lambda t: t.replace(
            'attrs = ["padding", "stride", "dilation"]', 'attrs = { padding = "pad", stride = "stride", dilation = "dilation" }'
        ),
        r"ops\[0\] \(conv_fprop\): attribute 'padding' refers to undeclared pattern attribute 'pad'",
    ),
    "missing_op_attr": (
        lambda t: t.replace('attrs = ["padding", "stride", "dilation"]', 'attrs = ["padding", "stride"]'),
        r"ops\[0\] \(conv_fprop\): attribute\(s\) \['dilation'\] not given",
    ),
    "unknown_op_attr": (
        lambda t: t.replace('attrs = ["padding", "stride", "dilation"]', 'attrs = ["padding", "stride", "dilation", "kernel"]'),
        r"unknown op attribute 'kernel'",
    ),
    "wrong_ports": (
        lambda t: t.replace('in = { input = "pre" }', 'in = { x = "pre" }'),
        r"ops\[2\] \(relu\): ports must be \['input'\]",
    ),
    "unknown_role": (
        lambda t: t.replace('w = { kind = "filter", role = "weight" }', 'w = { kind = "filter", role = "kernel" }'),
        r"operand 'w' has unknown role 'kernel'",
    ),
    "duplicate_out": (lambda t: t.replace('out = "pre"', 'out = "conv"'), r"'out' 'conv' is already defined"),
    "attr_without_default": (
        lambda t: t.replace("stride = { default = [1, 1], min = 1 }", "stride = { min = 1 }"),
        r"attribute 'stride' needs a default",
    ),
    "unknown_top_level_key": (lambda t: "extra = 1\n" + t, r"unknown top-level key\(s\) \['extra'\]"),
    "output_like_non_operand": (
        lambda t: t.replace('y = { like = "x" }', 'y = { like = "conv" }'),
        r"output 'y' needs like = one of the operands",
    ),
    "no_ops": (
        lambda t: t.split("[[ops]]")[0] + '[outputs]\ny = { like = "x" }\n',
        r"'ops' must be a non-empty array",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_raises_pattern_error(tmp_path, case):
    mutate, message = MALFORMED[case]
    text = mutate(good())
    assert text != good(), "the mutation must change the file"
    path = write(tmp_path, text)
    with pytest.raises(PatternError, match=message) as ei:
        load_pattern(path)
    # the message names the file it came from
    assert str(path) in str(ei.value)
    assert ei.value.source == str(path)
    assert isinstance(ei.value, fusekit.FusekitError)
    # the same text in memory fails the same way
    with pytest.raises(PatternError, match=message):
        parse_pattern(text)


def test_name_must_match_file_name(tmp_path):
    path = write(tmp_path, good("mypat"), stem="otherpat")
    with pytest.raises(PatternError, match=r"name 'mypat' must match the file name 'otherpat'") as ei:
        load_pattern(path)
    assert str(path) in str(ei.value)
    # parse_pattern alone (no file) has no such rule
    assert parse_pattern(good("mypat")).name == "mypat"


def test_name_must_be_identifier():
    with pytest.raises(PatternError, match="'name' must be an identifier"):
        parse_pattern(good("my-pat"))


def test_in_memory_source_is_the_name():
    with pytest.raises(PatternError, match=r"^pattern mypat: .*unknown op") as ei:
        parse_pattern(good().replace('op = "relu"', 'op = "nope"'))
    assert ei.value.source == "mypat"


# ----------------------------------------------------------------------------------------------
# $FUSEKIT_PATTERNS
# ----------------------------------------------------------------------------------------------
CONV_RELU = """\
name = "conv_relu"
summary = "user pattern: conv then relu"

[operands]
x = { kind = "image" }
w = { kind = "filter", role = "weight" }

[attrs]
padding = { default = [0, 0], min = 0 }
stride = { default = [1, 1], min = 1 }
dilation = { default = [1, 1], min = 1 }

[[ops]]
op = "conv_fprop"
in = { image = "x", weight = "w" }
attrs = ["padding", "stride", "dilation"]
out = "conv"

[[ops]]
op = "relu"
in = { input = "conv" }
out = "y"

[outputs]
y = { like = "x" }
"""


@pytest.fixture
def clean_registry(monkeypatch, fresh_session):
    monkeypatch.delenv("FUSEKIT_PATTERNS", raising=False)


def test_user_pattern_from_env(tmp_path, monkeypatch, clean_registry, rng):
    with pytest.raises(PatternError, match=r"no file conv_relu\.toml"):
        get_pattern("conv_relu")
    assert "conv_relu" not in list_patterns()

    user = tmp_path / "user"
    user.mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    (user / "conv_relu.toml").write_text(CONV_RELU, encoding="utf-8")
    monkeypatch.setenv("FUSEKIT_PATTERNS", os.pathsep.join([str(empty), str(user)]))

    names = list_patterns()
    assert "conv_relu" in names and set(SHIPPED) <= set(names)
    pat = get_pattern("conv_relu")
    assert pat.name == "conv_relu"
    assert Path(pat.source) == user / "conv_relu.toml"
    assert get_pattern("conv_relu") is pat  # loaded once
    assert get_pattern("conv").source.endswith("conv.toml")  # shipped ones still found

    # and it runs through the oracle like a shipped one
    x = rng.standard_normal((2, 3, 6, 5))
    w = rng.standard_normal((4, 3, 3, 3))
    (y,) = oracle.evaluate("conv_relu", x, w, padding=1)
    np.testing.assert_array_equal(y, np.maximum(oracle.conv2d_nchw(x, w, (1, 1), (1, 1), (1, 1)), 0.0))


def test_user_dir_comes_before_shipped(tmp_path, monkeypatch, clean_registry):
    text = (SHIPPED_DIR / "conv.toml").read_text(encoding="utf-8")
    text = text.replace('summary = "', 'summary = "USER OVERRIDE ')
    (tmp_path / "conv.toml").write_text(text, encoding="utf-8")
    monkeypatch.setenv("FUSEKIT_PATTERNS", str(tmp_path))
    pat = get_pattern("conv")
    assert pat.summary.startswith("USER OVERRIDE")
    assert Path(pat.source) == tmp_path / "conv.toml"


def test_unknown_pattern_lists_known(clean_registry):
    with pytest.raises(PatternError, match=r"no file no_such_pattern\.toml.*known: .*conv_bias_relu"):
        get_pattern("no_such_pattern")


# ----------------------------------------------------------------------------------------------
# attributes
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def cbr():
    return get_pattern("conv_bias_relu")


def test_normalize_defaults_in_file_order(cbr):
    norm = cbr.normalize_attrs({})
    assert [k for k, _ in norm] == [a.name for a in cbr.attrs] == ["padding", "stride", "dilation", "groups"]
    assert dict(norm) == {a.name: a.default for a in cbr.attrs}
    hash(norm)


@pytest.mark.parametrize("value", [0, 1, 2, 5])
def test_normalize_int_broadcasts_to_pair(cbr, value):
    norm = dict(cbr.normalize_attrs({"padding": value, "stride": value + 1, "dilation": value + 1}))
    assert norm == {"padding": (value, value), "stride": (value + 1,) * 2, "dilation": (value + 1,) * 2, "groups": 1}
    assert all(type(v) is tuple and all(type(i) is int for i in v) for k, v in norm.items() if k != "groups")


def test_normalize_sequences(cbr):
    a = cbr.normalize_attrs({"padding": [1, 2], "stride": (2, 1)})
    b = cbr.normalize_attrs({"stride": [2, 1], "padding": (1, 2)})
    assert a == b  # order of the given mapping and list/tuple do not matter
    assert dict(a)["padding"] == (1, 2) and dict(a)["stride"] == (2, 1)
    hash(a)


@pytest.mark.parametrize(
    "attr, value, message",
    [
        ("padding", -1, r"expected values >= 0"),
        ("padding", (1, -2), r"expected values >= 0"),
        ("stride", 0, r"expected values >= 1"),
        ("stride", (1, 0), r"expected values >= 1"),
        ("dilation", 0, r"expected values >= 1"),
        ("padding", 1.5, r"expected an int or a sequence of 2 ints"),
        ("padding", "1", r"expected an int or a sequence of 2 ints"),
        ("stride", None, r"expected an int or a sequence of 2 ints"),
        ("stride", True, r"expected an int or a sequence of 2 ints"),
        ("stride", (1, 2, 3), r"expected an int or a sequence of 2 ints"),
        ("dilation", (1,), r"expected an int or a sequence of 2 ints"),
        ("dilation", (1, 1.5), r"expected an int or a sequence of 2 ints"),
    ],
)
def test_normalize_bad_values(cbr, attr, value, message):
    with pytest.raises(OperandError, match=message) as ei:
        cbr.normalize_attrs({attr: value})
    assert ei.value.operand == attr
    assert f"'{attr}'" in str(ei.value)
    assert "conv_bias_relu" in str(ei.value)


def test_normalize_unknown_attribute(cbr):
    with pytest.raises(OperandError, match=r"'group': unknown attribute; this pattern takes \['dilation', 'groups', 'padding', 'stride'\]") as ei:
        cbr.normalize_attrs({"padding": 1, "group": 2})
    assert ei.value.operand == "group"


# ----------------------------------------------------------------------------------------------
# digest
# ----------------------------------------------------------------------------------------------
def test_digest_ignores_whitespace_and_comments():
    base = parse_pattern(good()).digest
    spaced = good().replace(" = ", "   =   ").replace("\n[", "\n\n\n[").replace("{ ", "{").replace(" }", "}")
    commented = "# a comment\n" + good().replace('out = "y"', 'out = "y"   # the result')
    assert spaced != good() and commented != good()
    assert parse_pattern(spaced).digest == base
    assert parse_pattern(commented).digest == base
    # the shipped file's digest does not depend on its comments either
    shipped = (SHIPPED_DIR / "conv_bias_relu.toml").read_text(encoding="utf-8")
    stripped = "\n".join(line.split("#")[0].rstrip() for line in shipped.splitlines())
    assert stripped != shipped
    assert parse_pattern(stripped).digest == get_pattern("conv_bias_relu").digest


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.replace('in = { input = "pre" }\nout = "y"', 'in = { input = "pre" }\nout = "y2"').replace(
            'y = { like = "x" }', 'y2 = { like = "x" }'
        ),
        lambda t: t.replace('attrs = ["padding", "stride", "dilation"]', 'attrs = { padding = [1, 1], stride = "stride", dilation = "dilation" }'),
        lambda t: t.replace("[[ops]]\nop = \"relu\"\nin = { input = \"pre\" }\nout = \"y\"", "[[ops]]\nop = \"relu\"\nin = { input = \"pre\" }\nout = \"r\"\n\n[[ops]]\nop = \"relu\"\nin = { input = \"r\" }\nout = \"y\""),
        lambda t: t.replace("padding = { default = [0, 0], min = 0 }", "padding = { default = [1, 1], min = 0 }"),
    ],
    ids=["renamed_output", "literal_op_attr", "extra_op", "changed_default"],
)
def test_digest_changes_with_content(change):
    text = change(good())
    assert text != good()
    assert parse_pattern(text).digest != parse_pattern(good()).digest


def test_digest_changes_when_op_changes():
    relu_to_add = good().replace(
        'op = "relu"\nin = { input = "pre" }', 'op = "add"\nin = { a = "pre", b = "b" }'
    )
    assert relu_to_add != good()
    assert parse_pattern(relu_to_add).digest != parse_pattern(good()).digest


# ----------------------------------------------------------------------------------------------
# broken files and directories; dims and attributes cuDNN cannot take
# ----------------------------------------------------------------------------------------------
def test_non_utf8_file_is_a_pattern_error(tmp_path):
    path = tmp_path / "mypat.toml"
    path.write_bytes(good().replace("conv then bias", "caf\xe9").encode("latin-1"))
    with pytest.raises(PatternError, match=r"not UTF-8 text \(byte 0xe9 at offset \d+\)") as ei:
        load_pattern(path)
    assert ei.value.source == str(path)


def test_unreadable_file_is_a_pattern_error(tmp_path):
    (tmp_path / "mypat.toml").mkdir()  # a directory where a file should be
    with pytest.raises(PatternError, match=r"mypat\.toml: cannot be read"):
        load_pattern(tmp_path / "mypat.toml")


def test_scan_patterns_goes_on_past_a_broken_file(tmp_path, monkeypatch, clean_registry):
    write(tmp_path, good())
    (tmp_path / "broken.toml").write_bytes(b'name = "broken"\nsummary = "\xff"\n')
    write(tmp_path, good("typo").replace('op = "relu"', 'op = "nope"'), stem="typo")
    monkeypatch.setenv("FUSEKIT_PATTERNS", str(tmp_path))
    good_, bad = patterns.scan_patterns()
    names = [p.name for p in good_]
    assert "mypat" in names and set(SHIPPED) <= set(names)
    assert sorted(e.source for e in bad) == [str(tmp_path / "broken.toml"), str(tmp_path / "typo.toml")]
    assert all(isinstance(e, PatternError) for e in bad)


def test_missing_pattern_directory_warns_once(tmp_path, monkeypatch, clean_registry):
    forget_warnings()
    missing, afile = tmp_path / "nonexistent", tmp_path / "file.txt"
    afile.write_text("", encoding="utf-8")
    monkeypatch.setenv("FUSEKIT_PATTERNS", os.pathsep.join([str(missing), str(afile)]))
    with pytest.warns(patterns.PatternWarning) as record:
        get_pattern("conv")  # looked up: still found among the shipped ones
        list_patterns()
    messages = [str(w.message) for w in record]
    assert messages == [
        f"FUSEKIT_PATTERNS: pattern directory {missing} does not exist; no patterns are read from it",
        f"FUSEKIT_PATTERNS: pattern directory {afile} is not a directory; no patterns are read from it",
    ]


def test_existing_pattern_directory_does_not_warn(tmp_path, monkeypatch, clean_registry, recwarn):
    forget_warnings()
    monkeypatch.setenv("FUSEKIT_PATTERNS", str(tmp_path))
    list_patterns()
    assert not [w for w in recwarn if issubclass(w.category, patterns.PatternWarning)]


@pytest.mark.parametrize(
    "attr, value",
    [("padding", 10**12), ("padding", (0, 2**31)), ("stride", 2**63), ("dilation", (1, 10**30))],
)
def test_attributes_beyond_int32_are_refused(cbr, attr, value):
    with pytest.raises(OperandError, match=rf"conv_bias_relu: attribute '{attr}': expected values of at most 2147483647") as ei:
        cbr.normalize_attrs({attr: value})
    assert ei.value.operand == attr
    assert dict(cbr.normalize_attrs({attr: 2**31 - 1}))[attr] in (2**31 - 1, (2**31 - 1,) * 2)  # the bound itself is fine


@pytest.mark.parametrize(
    "shapes, attrs, culprit, message",
    [
        ({"x": (1, 1, 10**12, 4), "w": (1, 1, 1, 1), "b": (1, 1, 1, 1)}, {}, "operand 'x'", r"dim 1000000000000 is larger than 2147483647"),
        ({"x": (1, 1, 4, 4), "w": (1, 1, 1, 1), "b": (1, 10**25, 1, 1)}, {}, "operand 'b'", r"dim 10+ is larger"),
        ({"x": (2**31 - 1,) * 4, "w": (1, 1, 1, 1), "b": (1, 1, 1, 1)}, {}, "operand 'x'", r"elements \(2\^123 or more\) are too many: .*fewer than 2\^63"),
        ({"x": (1, 1, 4, 4), "w": (1, 1, 3, 3), "b": (1, 1, 1, 1)}, {"padding": 2**31 - 1}, "intermediate value 'conv'", r"dim 4294967296 is larger"),
    ],
)
def test_shapes_beyond_cudnn_limits_are_refused(cbr, shapes, attrs, culprit, message):
    with pytest.raises(OperandError, match=message) as ei:
        cbr.infer_shapes(shapes, dict(cbr.normalize_attrs(attrs)))
    assert f"conv_bias_relu: {culprit}" in str(ei.value)


def test_shapes_at_the_limits_are_accepted(cbr):
    big = 2**31 - 1
    env = cbr.infer_shapes({"x": (1, 1, big, 1), "w": (1, 1, 1, 1), "b": (1, 1, 1, 1)}, dict(cbr.normalize_attrs({})))
    assert env["y"] == (1, 1, big, 1)


def test_epilogue_operands_are_the_inputs_only_a_convolution_epilogue_reads():
    from fusekit.engine.patterns import get_pattern

    assert get_pattern("conv_bias_add_relu").epilogue_operands == ("z",)
    assert get_pattern("conv_bias_add").epilogue_operands == ("z",)
    assert get_pattern("conv_dgrad_drelu").epilogue_operands == ("x",)
    for name in ("conv_bias_relu", "linear_bias", "add_relu", "batchnorm_relu", "conv_wgrad"):
        assert get_pattern(name).epilogue_operands == (), name


def test_dispatch_fences_an_epilogue_operand_overlapping_the_last_output_on_its_stream(monkeypatch):
    """The fence goes in only when the residual overlaps an output of the graph executed just
    before on the same stream (byte ranges, so views into it count too)."""
    from fusekit import dispatch

    fenced = []

    class Ad:
        @staticmethod
        def ptr(a):
            return a

        def fence(self, dev):
            fenced.append(dev)

    class C:
        stream, device, out_adapter, epilogue = 7, 3, Ad(), ((3, 100),)  # operand 3 (z), 100 bytes

    last_out = {7: ((1000, 400),), 8: ((5000, 100),)}
    for z, expect in ((1000, 1), (1300, 1), (1399, 1), (901, 1), (900, 0), (1400, 0), (5000, 0)):
        fenced.clear()
        execute.fence_if_racing(C, (0, 0, 0, z), last_out)
        assert len(fenced) == expect, (z, fenced)
    C.stream = 9  # nothing executed on this stream yet
    fenced.clear()
    execute.fence_if_racing(C, (0, 0, 0, 1000), last_out)
    assert not fenced
