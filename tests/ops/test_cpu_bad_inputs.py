"""The bad-input suite: wrong command lines, pattern files, settings, API calls and model files, each
answered by a fusekit error (or a one-line CLI error with a non-zero exit) that names what was
wrong: never a traceback, never a silent acceptance, never a hang. ``CASES`` is the whole list; the
README's reliability section gives its count (checked below)."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import fusekit
from fusekit import config
from fusekit.cli import main
from fusekit.errors import FusekitError

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 60.0  # a case still running after this long is a hang


@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # "cli" | "api"
    run: Callable[[Path], object]  # cli: returns (args, env); api: called, must raise a FusekitError
    mentions: str  # a fragment the error must contain (what was wrong)


# ----------------------------------------------------------------------------------------------
# command lines
# ----------------------------------------------------------------------------------------------
GOOD = ("x=2,8,6,6", "w=16,8,3,3", "b=16")
SHAPED = {"oracle": ["oracle"], "run": ["run"], "bench": ["bench"], "autotune": ["autotune"], "show": ["patterns", "show"]}
BAD_SHAPES = [  # (replacement for one operand's --shape, what the error names)
    ("x2,8,6,6", "NAME=VALUE"), ("q=1,2", "q is not an operand"), ("x=2,a,6,6", "'a'"), ("x=2,-8,6,6", "'-8'"),
    ("x=0,8,6,6", "'0'"), ("x=2,8,6", "rank 3"), ("x=\uff12,8,6,6", "positive integer"), ("w=16,4,3,3", "'w'"),
    ("b=15", "'b'"), ("x=", "NAME=VALUE"), ("x=2,8,6,6,1", "rank 5"), ("w=16,8,3", "'w'"), ("b=16,1", "'b'"),
]
BAD_ATTRS = [
    ("bogus=1", "bogus"), ("padding=nan", "nan"), ("padding=inf", "inf"), ("padding=-1", "padding"), ("stride=0", "stride"),
    ("padding=\u0661", "padding"), ("padding", "NAME=VALUE"), ("padding=1,2,3", "padding"), ("dilation=0", "dilation"),
    ("padding=1e400", "padding"), ("groups=0", "groups"), ("groups=3", "groups"), ("stride=1.5", "stride"),
]
BAD_NAMES = [("no_such_pattern", "no_such_pattern"), ("../patterns/conv_bias_relu", "identifier"), ("conv_bias_r\u00e9lu", "conv_bias_r")]


def _shapes(replace: str | None) -> list[str]:
    name = replace.split("=")[0] if replace and "=" in replace else None
    shapes = [replace if name and s.startswith(name + "=") else s for s in GOOD]
    if replace and (name is None or name not in ("x", "w", "b")):
        shapes.append(replace)
    return [a for s in shapes for a in ("--shape", s)]


def _cli(args: list[str], env: dict[str, str] | None = None) -> Callable[[Path], object]:
    return lambda tmp: ([a.replace("{tmp}", str(tmp)) for a in args], {k: v.replace("{tmp}", str(tmp)) for k, v in (env or {}).items()})


def _command_line_cases() -> list[Case]:
    cases = []
    for cmd, pre in SHAPED.items():
        for s, m in BAD_SHAPES:
            cases.append(Case(f"cli-{cmd}-shape[{s}]", "cli", _cli(pre + ["conv_bias_relu"] + _shapes(s)), m))
        cases.append(Case(f"cli-{cmd}-filter-larger-than-input", "cli",
                          _cli(pre + ["conv_bias_relu", "--shape", "x=2,8,3,3", "--shape", "w=16,8,7,7", "--shape", "b=16"]), "w"))
        for a, m in BAD_ATTRS:
            cases.append(Case(f"cli-{cmd}-attr[{a}]", "cli", _cli(pre + ["conv_bias_relu"] + _shapes(None) + ["--attr", a]), m))
        for n, m in BAD_NAMES:
            cases.append(Case(f"cli-{cmd}-name[{n}]", "cli", _cli(pre + [n] + _shapes(None)), m))
        if cmd != "oracle":
            cases.append(Case(f"cli-{cmd}-dtype", "cli", _cli(pre + ["conv_bias_relu"] + _shapes(None) + ["--dtype", "float64"]), "float64"))
            cases.append(Case(f"cli-{cmd}-layout", "cli", _cli(pre + ["conv_bias_relu"] + _shapes(None) + ["--layout", "nchwc"]), "nchwc"))
    g = ["conv_bias_relu"] + _shapes(None)
    cases += [
        Case("cli-oracle-seed-negative", "cli", _cli(["oracle"] + g + ["--seed", "-1"]), "--seed"),
        Case("cli-run-repeat-zero", "cli", _cli(["run"] + g + ["--repeat", "0"]), "--repeat"),
        Case("cli-run-warmup-negative", "cli", _cli(["run"] + g + ["--warmup", "-1"]), "--warmup"),
        Case("cli-bench-repeat-zero", "cli", _cli(["bench"] + g + ["--repeat", "0"]), "--repeat"),
        Case("cli-autotune-budget-negative", "cli", _cli(["autotune"] + g + ["--budget", "-1"]), "--budget"),
        Case("cli-autotune-max-candidates-zero", "cli", _cli(["autotune"] + g + ["--max-candidates", "0"]), "--max-candidates"),
        Case("cli-autotune-workspace-limit-words", "cli", _cli(["autotune"] + g + ["--workspace-limit", "lots"]), "lots"),
        Case("cli-autotune-spec-missing", "cli", _cli(["autotune", "--spec", "{tmp}/none.toml"]), "none.toml"),
        Case("cli-autotune-spec-not-toml", "cli", _cli(["autotune", "--spec", "{tmp}/garbage.toml"]), "garbage.toml"),
        Case("cli-autotune-spec-unknown-pattern", "cli", _cli(["autotune", "--spec", "{tmp}/unknown.toml"]), "no_such_pattern"),
        Case("cli-autotune-spec-no-layers", "cli", _cli(["autotune", "--spec", "{tmp}/empty.toml"]), "layer"),
        Case("cli-autotune-no-pattern", "cli", _cli(["autotune"]), "PATTERN"),
        Case("cli-oracle-no-shapes", "cli", _cli(["oracle", "conv_bias_relu"]), "shape"),
        Case("cli-unknown-command", "cli", _cli(["frobnicate"]), "frobnicate"),
        Case("cli-patterns-show-missing", "cli", _cli(["patterns", "show", "nope"]), "nope"),
        Case("cli-cache-dir-is-a-file-ls", "cli", _cli(["cache", "ls", "--cache-dir", "{tmp}/garbage.toml"]), "garbage.toml"),
        Case("cli-cache-dir-is-a-file-verify", "cli", _cli(["cache", "verify", "--cache-dir", "{tmp}/garbage.toml"]), "garbage.toml"),
        Case("cli-cache-show-unknown-key", "cli", _cli(["cache", "show", "0123456789abcdef", "--cache-dir", "{tmp}/store"]), "0123456789abcdef"),
        Case("cli-cache-import-missing", "cli", _cli(["cache", "import", "{tmp}/none.tar", "--cache-dir", "{tmp}/store"]), "none.tar"),
        Case("cli-cache-import-not-an-archive", "cli", _cli(["cache", "import", "{tmp}/garbage.toml", "--cache-dir", "{tmp}/store"]), "garbage.toml"),
        Case("cli-cache-export-into-a-file", "cli", _cli(["cache", "export", "{tmp}/garbage.toml/x.tar", "--cache-dir", "{tmp}/store"]), "garbage.toml"),
        Case("cli-doctor-env-cache-size-words", "cli", _cli(["doctor"], {"FUSEKIT_CACHE_SIZE": "lots"}), "FUSEKIT_CACHE_SIZE"),
        Case("cli-doctor-env-mode", "cli", _cli(["doctor"], {"FUSEKIT_MODE": "fast"}), "FUSEKIT_MODE"),
        Case("cli-doctor-env-tf32", "cli", _cli(["doctor"], {"FUSEKIT_ALLOW_TF32": "sometimes"}), "FUSEKIT_ALLOW_TF32"),
        Case("cli-doctor-env-cache-dir-a-file", "cli", _cli(["doctor"], {"FUSEKIT_CACHE_DIR": "{tmp}/garbage.toml"}), "garbage.toml"),
    ]
    for opt, value, m in (("--batch", "0", "--batch"), ("--batch", "70000", "--batch"), ("--size", "0", "--size"),
                          ("--size", "100000", "--size"), ("--dtype", "int8", "int8"), ("--batch", "two", "two")):
        cases.append(Case(f"cli-pipeline-compile{opt}[{value}]", "cli", _cli(["pipeline", "compile", "{tmp}/model.onnx", opt, value, "--no-gpu"]), m))
    for f in ("none.onnx", "garbage.toml", "empty.onnx", "truncated.onnx", "store"):
        cases.append(Case(f"cli-pipeline-compile-file[{f}]", "cli", _cli(["pipeline", "compile", "{tmp}/" + f, "--no-gpu"]), f))
    return cases


# ----------------------------------------------------------------------------------------------
# pattern files
# ----------------------------------------------------------------------------------------------
PATTERN = (ROOT / "patterns" / "conv_bias_relu.toml").read_text()
PATTERN_EDITS = [  # (id, (old, new) edit of a good pattern file, what the error names)
    ("no-name", ('name = "conv_bias_relu"\n', ""), "name"),
    ("name-not-identifier", ('name = "conv_bias_relu"', 'name = "conv bias"'), "conv bias"),
    ("unknown-op", ('op = "bias"', 'op = "biass"'), "biass"),
    ("unknown-kind", ('kind = "filter"', 'kind = "filtre"'), "filtre"),
    ("unknown-role", ('role = "weight"', 'role = "wait"'), "wait"),
    ("default-not-a-number", ('groups = { default = 1, min = 1 }', 'groups = { default = "abc", min = 1 }'), "groups"),
    ("default-nan", ('groups = { default = 1, min = 1 }', 'groups = { default = nan, min = 1 }'), "groups"),
    ("default-empty-list", ('padding = { default = [0, 0], min = 0 }', 'padding = { default = [], min = 0 }'), "padding"),
    ("default-below-min", ('groups = { default = 1, min = 1 }', 'groups = { default = 0, min = 1 }'), "groups"),
    ("undefined-input", ('in = { input = "pre" }', 'in = { input = "nothing" }'), "nothing"),
    ("output-never-made", ('[outputs]\ny = { like = "x" }', '[outputs]\nz = { like = "x" }'), "z"),
    ("like-unknown", ('y = { like = "x" }', 'y = { like = "q" }'), "q"),
    ("op-attr-unknown", ('attrs = ["padding", "stride", "dilation", "groups"]', 'attrs = ["padding", "stride", "dilation", "groups", "bogus"]'), "bogus"),
    ("no-ops", (PATTERN[PATTERN.index("[[ops]]"):PATTERN.index("[outputs]")], ""), "ops"),
    ("no-operands", ('[operands]\nx = { kind = "image", role = "input" }\nw = { kind = "filter", role = "weight" }\nb = { kind = "channel", role = "bias" }\n', ""), "operand"),
    ("port-unknown", ('in = { image = "x", weight = "w" }', 'in = { picture = "x", weight = "w" }'), "picture"),
    ("not-toml", ("[operands]", "[operands"), "toml"),
    ("operand-twice-as-output", ('[outputs]\ny = { like = "x" }', '[outputs]\nx = { like = "x" }'), "x"),
    ("saved-unknown", ('saved = ["x", "w", "y"]', 'saved = ["x", "w", "nope"]'), "nope"),
    ("backward-a-path", ('backward = ["relu_bias_grad", "conv_dgrad", "conv_wgrad"]', 'backward = ["../conv_dgrad"]'), "../conv_dgrad"),
    ("attr-bad-min", ('stride = { default = [1, 1], min = 1 }', 'stride = { default = [1, 1], min = "one" }'), "stride"),
    ("summary-not-a-string", ('summary = "2-D', 'summary = 3\nold_summary = "2-D'), "summary"),
    ("operand-not-a-table", ('x = { kind = "image", role = "input" }', 'x = "image"'), "x"),
    ("ops-not-a-list", ("[[ops]]\nop = \"relu\"", "[ops2]\nop = \"relu\""), "ops2"),
]


def _pattern_case(edit: tuple[str, str]) -> Callable[[Path], object]:
    old, new = edit

    def run(tmp: Path) -> object:
        assert old in PATTERN, old
        return fusekit.parse_pattern(PATTERN.replace(old, new, 1), source="bad.toml")

    return run


def _file_case(data: bytes) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        (tmp / "bad_file.toml").write_bytes(data)
        return fusekit.load_pattern(tmp / "bad_file.toml")

    return run


# ----------------------------------------------------------------------------------------------
# settings
# ----------------------------------------------------------------------------------------------
def _env_case(var: str, value: str, read: Callable[[], object]) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        old = os.environ.get(var)
        os.environ[var] = value.replace("{tmp}", str(tmp))
        try:
            return read()
        finally:
            os.environ.pop(var) if old is None else os.environ.__setitem__(var, old)

    return run


def _configure_case(**kw: object) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        kw2 = {k: (str(v).replace("{tmp}", str(tmp)) if isinstance(v, str) else v) for k, v in kw.items()}
        return fusekit.configure(disk=False, **kw2)

    return run


SETTINGS = (
    [(f"env-cache-size[{v}]", _env_case("FUSEKIT_CACHE_SIZE", v, config.cache_size), "FUSEKIT_CACHE_SIZE")
     for v in ("lots", "-1", "0", "1e23", "1000001", "1.5", "\uff11", "nan", "0x10")]
    + [(f"env-mode[{v}]", _env_case("FUSEKIT_MODE", v, config.mode), "FUSEKIT_MODE") for v in ("fast", "AUTOTUNE ", "1", "")]
    + [(f"env-tf32[{v}]", _env_case("FUSEKIT_ALLOW_TF32", v, config.allow_tf32), "FUSEKIT_ALLOW_TF32")
       for v in ("sometimes", "conv,linear", ",", "2", "yes please")]
    + [(f"configure-maxsize[{v!r}]", _configure_case(maxsize=v), "maxsize") for v in ("abc", 0, -3, 10**7, 1.5, "1e3", float("nan"))]
    + [(f"configure-mode[{v!r}]", _configure_case(mode=v), "mode") for v in ("fast", 3, "")]
    + [(f"configure-allow-tf32[{v!r}]", _configure_case(allow_tf32=v), "allow_tf32")
       for v in ("sometimes", 1, 0.5, ["conv"], {"linear": True}, {"conv": 1})]
    + [("configure-cache-dir-is-a-file", lambda tmp: fusekit.configure(cache_dir=str(tmp / "garbage.toml")), "garbage.toml")]
)


# ----------------------------------------------------------------------------------------------
# Python API: operands, attributes, models
# ----------------------------------------------------------------------------------------------
def _oracle(*ops: object, pattern: str = "conv_bias_relu", **attrs: object) -> Callable[[Path], object]:
    from fusekit.engine import oracle

    return lambda tmp: oracle.evaluate(pattern, *ops, **attrs)


R = np.random.default_rng(0)
X, W, B = R.standard_normal((2, 8, 6, 6)), R.standard_normal((16, 8, 3, 3)), R.standard_normal(16)
API = [
    ("oracle-too-few-operands", _oracle(X, W), "takes 3"),
    ("oracle-too-many-operands", _oracle(X, W, B, B), "takes 3"),
    ("oracle-x-rank-3", _oracle(X[0], W, B), "'x'"),
    ("oracle-x-rank-5", _oracle(X[None], W, B), "'x'"),
    ("oracle-w-channels", _oracle(X, W[:, :4], B), "'w'"),
    ("oracle-b-length", _oracle(X, W, B[:3]), "'b'"),
    ("oracle-b-matrix", _oracle(X, W, B[:, None]), "'b'"),
    ("oracle-complex", _oracle(X.astype(complex), W, B), "complex"),
    ("oracle-strings", _oracle(X, W, "b"), "'b'"),
    ("oracle-object", _oracle(X, object(), B), "'w'"),
    ("oracle-none", _oracle(None, W, B), "'x'"),
    ("oracle-datetimes", _oracle(np.zeros(X.shape, "datetime64[s]"), W, B), "'x'"),
    ("oracle-padding-words", _oracle(X, W, B, padding="abc"), "padding"),
    ("oracle-padding-negative", _oracle(X, W, B, padding=-1), "padding"),
    ("oracle-stride-zero", _oracle(X, W, B, stride=(0, 1)), "stride"),
    ("oracle-stride-nan", _oracle(X, W, B, stride=float("nan")), "stride"),
    ("oracle-dilation-three", _oracle(X, W, B, dilation=(1, 1, 1)), "dilation"),
    ("oracle-groups-not-dividing", _oracle(X, W, B, groups=3), "groups"),
    ("oracle-unknown-attribute", _oracle(X, W, B, bogus=1), "bogus"),
    ("oracle-filter-larger-than-input", _oracle(X[:, :, :2, :2], W, B), "w"),
    ("oracle-unknown-pattern", _oracle(X, pattern="no_such_pattern"), "no_such_pattern"),
    ("oracle-pattern-path", _oracle(X, pattern="../patterns/relu"), "identifier"),
    ("oracle-act-unknown-activation", _oracle(X, pattern="act", activation="swishy", alpha=0.0), "swishy"),
    ("oracle-act-alpha-nan", _oracle(X, pattern="act", activation="leaky_relu", alpha=float("nan")), "alpha"),
    ("oracle-add-shapes", _oracle(X, X[:, :4], pattern="add_act", activation="relu", alpha=0.0), "b"),
    ("oracle-linear-shapes", _oracle(R.standard_normal((4, 8)), R.standard_normal((3, 7)), R.standard_normal(3), pattern="linear_bias"), "w"),
    ("oracle-linear-rank", _oracle(X, R.standard_normal((3, 8)), R.standard_normal(3), pattern="linear_bias"), "x"),
    ("oracle-relu-clip-nan", _oracle(X, pattern="relu", upper_clip=float("nan")), "upper_clip"),
    ("oracle-gate-shape", _oracle(X, R.standard_normal((2, 4, 1, 1)), pattern="channel_gate"), "s"),
    ("parse-pattern-bytes", lambda tmp: fusekit.parse_pattern(PATTERN.encode()), "str"),
]


def _ops_host(fn: str, *args: object, **kw: object) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        from fusekit import ops

        return getattr(ops, fn)(*args, **kw)

    return run


API += [(f"ops-host-array-{fn}", _ops_host(fn, *args), "host")
        for fn, args in (("conv_bias_relu", (X.astype(np.float16), W.astype(np.float16), B.astype(np.float16))),
                         ("conv_bias", (X.astype(np.float16), W.astype(np.float16), B.astype(np.float16))),
                         ("conv2d", (X.astype(np.float16), W.astype(np.float16))),
                         ("act", (X.astype(np.float16),)),
                         ("conv_bias_act", (X.astype(np.float16), W.astype(np.float16), B.astype(np.float16))))]


def _lower(model_or_path: object, shape: tuple[int, ...] | None = None) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        import fusekit.pipeline as fp

        m = model_or_path.replace("{tmp}", str(tmp)) if isinstance(model_or_path, str) else model_or_path
        return fp.lower_model(m, shape) if shape is not None else fp.lower_model(m)

    return run


API += [
    ("lower-not-a-model", _lower("notamodel", (1, 3, 8, 8)), "notamodel"),
    ("lower-missing-onnx", _lower("{tmp}/none.onnx"), "none.onnx"),
    ("lower-empty-onnx", _lower("{tmp}/empty.onnx"), "empty.onnx"),
    ("lower-truncated-onnx", _lower("{tmp}/truncated.onnx"), "truncated.onnx"),
    ("lower-text-file", _lower("{tmp}/garbage.toml"), "garbage.toml"),
    ("lower-directory", _lower("{tmp}/store"), "store"),
    ("lower-an-int", _lower(3, (1, 3, 8, 8)), "model"),
]


def _torch_cases() -> list[tuple[str, Callable[[Path], object], str]]:
    try:
        import torch
    except ImportError:
        return []
    nn = torch.nn
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()

    def lower(shape: object) -> Callable[[Path], object]:
        def run(tmp: Path) -> object:
            import fusekit.pipeline as fp

            return fp.lower_model(conv, shape)

        return run

    def reference(shape: tuple[int, ...]) -> Callable[[Path], object]:
        def run(tmp: Path) -> object:
            import fusekit.pipeline as fp

            return fp.Pipeline(fp.lower_model(conv, (1, 3, 8, 8))).reference(np.zeros(shape))

        return run

    return [
        ("lower-wrong-channels", lower((1, 4, 8, 8)), "4"),
        ("lower-rank-3-input", lower((3, 8, 8)), "(3, 8, 8)"),
        ("lower-too-small-input", lower((1, 3, 2, 2)), "(1, 3, 2, 2)"),
        ("lower-negative-size", lower((1, 3, -8, 8)), "-8"),
        ("lower-shape-of-words", lower("1,3,8,8"), "1,3,8,8"),
        ("reference-wrong-shape", reference((1, 3, 9, 8)), "(1, 3, 9, 8)"),
        ("reference-wrong-batch", reference((2, 3, 8, 8)), "(2, 3, 8, 8)"),
    ]


def _all_cases() -> list[Case]:
    cases = _command_line_cases()
    cases += [Case(f"pattern-{i}", "api", _pattern_case(e), m) for i, e, m in PATTERN_EDITS]
    cases += [Case(f"pattern-file-{i}", "api", _file_case(d), m) for i, d, m in (
        ("empty", b"", "name"), ("binary", bytes(range(256)), "bad_file.toml"), ("utf16", PATTERN.encode("utf-16"), "bad_file.toml"),
        ("json", b'{"name": "x"}', "bad_file.toml"))]
    cases += [Case(f"setting-{i}", "api", r, m) for i, r, m in SETTINGS]
    cases += [Case(f"api-{i}", "api", r, m) for i, r, m in API + _torch_cases()]
    return cases


CASES = _all_cases()


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """The files the cases name: a text file, an empty and a truncated "model", a store, specs."""
    (tmp_path / "garbage.toml").write_text("this is not [ toml\n")
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "truncated.onnx").write_bytes(b"\x08\x07\x12\x07pytorch\x1a\x032.1:\x9a\x02\n")
    (tmp_path / "model.onnx").write_bytes(b"\x08\x07")
    (tmp_path / "store").mkdir()
    (tmp_path / "unknown.toml").write_text('[[layer]]\npattern = "no_such_pattern"\nshapes = { x = [1, 2, 3, 4] }\n')
    (tmp_path / "empty.toml").write_text("# no layers\n")
    return tmp_path


def _within(seconds: float, fn: Callable[[], object]) -> tuple[object, BaseException | None]:
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - judged by the caller
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hang: still running after {seconds:.0f} s"
    return box.get("value"), box.get("error")  # type: ignore[return-value]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_clearly(case: Case, files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEKIT_CACHE_DIR", str(files / "cache"))
    before = fusekit.default_cache()
    try:
        if case.kind == "cli":
            args, env = case.run(files)
            result, err = _within(HANG_S, lambda: CliRunner().invoke(main, args, env=env))
            assert err is None, err
            out = result.output
            assert result.exit_code != 0, f"accepted silently (exit 0): {out[-500:]}"
            tb = result.exception is not None and not isinstance(result.exception, SystemExit)
            assert not tb and "Traceback" not in out, f"traceback: {result.exception!r}\n{out[-1500:]}"
            said = [ln for ln in out.splitlines() if re.search(r"error|invalid|problem", ln, re.IGNORECASE)]
            assert said, f"no line says what is wrong: {out[-500:]}"
            assert case.mentions in out, f"the error does not say {case.mentions!r}: {out[-500:]}"
        else:
            value, err = _within(HANG_S, lambda: case.run(files))
            assert err is not None, f"accepted silently, returned {type(value).__name__}"
            assert isinstance(err, FusekitError), f"{type(err).__name__} (not a fusekit error): {err}"
            assert case.mentions in str(err), f"the error does not say {case.mentions!r}: {err}"
    finally:
        fusekit.configure(disk=False) if fusekit.default_cache() is not before else None


def test_the_suite_has_at_least_250_cases_and_the_readme_says_how_many() -> None:
    assert len(CASES) >= 250, len(CASES)
    m = re.search(r"bad-input suite\s.{0,120}? has (\d[\d,]*) cases", (ROOT / "README.md").read_text(), re.DOTALL)
    assert m and int(m.group(1).replace(",", "")) == len(CASES), (m and m.group(0), len(CASES))
