"""`fusekit cache ...` on a temporary store filled by DiskStore.write (no GPU, no cuDNN)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time

import pytest
from click.testing import CliRunner

from fusekit.config import TUNABLES
from fusekit.engine.cache import DiskStore
from fusekit.cli import main


from plankeys import key  # noqa: E402
from plankeys import specs as _specs  # noqa: E402



TUNING = [
    {"index": 0, "name": "eng0_k3=1", "time_us": 30.5, "workspace": 0, "error": 0.0, "verdict": "ok"},
    {"index": 1, "name": "eng12_k2=1_k5=3", "time_us": 12.25, "workspace": 123456, "error": 1e-4, "verdict": "ok"},
    {"index": 2, "name": "eng7_k1=0", "time_us": None, "workspace": 4096, "error": 0.5, "verdict": "rejected: differs from the heuristic plan"},
    {"index": 3, "name": "eng9_k9=9", "time_us": None, "workspace": -1, "error": None, "verdict": "failed: not built (RuntimeError)"},
]


def meta(tuned: bool) -> dict:
    return {
        "engine": "eng12_k2=1_k5=3" if tuned else "eng0_k3=1",
        "engine_id": 12 if tuned else 0,
        "knobs": {"k2": 1, "k5": 3} if tuned else {"k3": 1},
        "uids": [7, 3, 11, 2],
        "workspace_size": 123456 if tuned else 0,
        "candidates": 4,
        "build_ms": 12.5,
        "source": "tuned" if tuned else "built",
        "tuning": TUNING if tuned else None,
    }


@pytest.fixture
def store(tmp_path) -> DiskStore:
    """Two entries: a tuned conv_bias_relu (batch 2) and a heuristics-built one (batch 4, NCHW)."""
    s = DiskStore(tmp_path / "cache")
    s.write(key(), meta(True), b"serialized-graph-1" * 40)
    s.write(key(specs=_specs(n=4, layout="NCHW")), meta(False), b"serialized-graph-2" * 30)
    return s


TUNED = key().fingerprint()
BUILT = key(specs=_specs(n=4, layout="NCHW")).fingerprint()


def invoke(*args: str, input: str | None = None, env: dict | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input, env=env)


def assert_one_line_error(result, *needles: str) -> str:
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: ") and "Traceback" not in result.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _rows(output: str) -> dict[str, str]:
    """Table rows of `cache ls` by their KEY cell."""
    return {ln.split()[0]: ln for ln in output.splitlines() if ln.strip() and len(ln.split()[0]) == 12 and ln.split()[0] != "KEY"}


# ----------------------------------------------------------------------------------------------
# ls
# ----------------------------------------------------------------------------------------------
def test_ls_lists_every_entry(store):
    r = invoke("cache", "ls", "--cache-dir", store.root)
    assert r.exit_code == 0, r.output
    header = r.output.splitlines()[0].split()
    assert header == ["KEY", "PATTERN", "SHAPES", "ATTRS", "DTYPE", "LAYOUT", "GPU", "CUDNN", "SOURCE", "ENGINE", "CREATED"]
    rows = _rows(r.output)
    assert set(rows) == {TUNED[:12], BUILT[:12]}
    tuned, built = rows[TUNED[:12]], rows[BUILT[:12]]
    for row in (tuned, built):
        assert "conv_bias_relu" in row and "NVIDIA H200 sm_90" in row and "9.10.0" in row and "padding=1,1" in row
    assert "x=2,8,9,9 w=16,8,3,3 b=16 -> y=2,16,9,9" in tuned  # shapes as --shape takes them
    assert " tuned " in tuned and "eng12_k2=1_k5=3" in tuned and "NHWC" in tuned and "float16" in tuned
    assert " built " in built and "eng0_k3=1" in built and "NCHW" in built and "x=4,8,9,9" in built
    assert "stride" not in tuned  # default attributes left out
    assert f"2 plans in {store.plans_dir}" in r.output
    assert all(ln == ln.rstrip() for ln in r.output.splitlines())  # no padding blanks in pipes


def test_ls_empty_and_missing_directory(tmp_path):
    r = invoke("cache", "ls", "--cache-dir", tmp_path / "nothing")
    assert r.exit_code == 0 and "0 plans in" in r.output and "(empty)" in r.output


def test_ls_reports_bad_entries(store):
    p = store.path(key())
    p.write_bytes(p.read_bytes()[:-5])
    r = invoke("cache", "ls", "--cache-dir", store.root)
    assert r.exit_code == 0
    assert set(_rows(r.output)) == {BUILT[:12]}
    assert "1 bad entry (not listed)" in r.output and "fusekit cache verify" in r.output


def test_ls_uses_the_default_directory(store):
    r = invoke("cache", "ls", env={"FUSEKIT_CACHE_DIR": str(store.root)})
    assert r.exit_code == 0 and set(_rows(r.output)) == {TUNED[:12], BUILT[:12]}


def test_disk_cache_off_is_one_line():
    assert_one_line_error(invoke("cache", "ls", env={"FUSEKIT_CACHE_DIR": "off"}), "disk plan cache is off", "--cache-dir")


# ----------------------------------------------------------------------------------------------
# show
# ----------------------------------------------------------------------------------------------
def _json_block(output: str) -> dict:
    lines = output.splitlines()
    start = lines.index("{")
    end = lines.index("}", start)
    return json.loads("\n".join(lines[start : end + 1]))


@pytest.mark.parametrize("prefix", [TUNED[:6], TUNED[:1] if TUNED[0] != BUILT[0] else TUNED[:2], TUNED, TUNED[:8].upper()])
def test_show_by_prefix_prints_header_and_candidates(store, prefix):
    r = invoke("cache", "show", prefix, "--cache-dir", store.root)
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].startswith(f"plan {TUNED}")
    header = _json_block(r.output)
    assert header["key_digest"] == TUNED and header["key"]["pattern"] == "conv_bias_relu"
    assert header["plan"]["engine"] == "eng12_k2=1_k5=3" and header["plan"]["source"] == "tuned"
    assert header["plan"]["tuning"].startswith("4 candidates")  # the table has them
    assert header["key"]["specs"][0][1]["shape"] == [2, 8, 9, 9]
    rows = {ln.split()[1]: ln for ln in r.output.splitlines() if ln[:1].isdigit() and len(ln.split()) > 2 and ln.split()[1].startswith("eng")}
    assert set(rows) == {c["name"] for c in TUNING}
    assert rows["eng12_k2=1_k5=3"].rstrip().endswith("best") and "12.25" in rows["eng12_k2=1_k5=3"]
    assert rows["eng0_k3=1"].rstrip().endswith("heuristic") and "2.49x" in rows["eng0_k3=1"]
    assert "rejected" in rows["eng7_k1=0"] and "failed: not built" in rows["eng9_k9=9"]
    assert "2.49x speed-up" in r.output


def test_show_built_entry_has_no_candidate_table(store):
    r = invoke("cache", "show", BUILT[:10], "--cache-dir", store.root)
    assert r.exit_code == 0, r.output
    header = _json_block(r.output)
    assert header["plan"]["tuning"] is None and header["plan"]["source"] == "built"
    assert "tuning candidates" not in r.output and "speed-up" not in r.output


def test_show_json_is_the_whole_header(store):
    r = invoke("cache", "show", TUNED[:10], "--cache-dir", store.root, "--json")
    assert r.exit_code == 0, r.output
    header = json.loads(r.output)
    assert header["plan"]["tuning"] == TUNING
    assert header["blob_len"] == len(b"serialized-graph-1" * 40)


def test_show_unknown_prefix_is_one_line(store):
    stems = {TUNED, BUILT}
    missing = next(c for c in "0123456789abcdef" if not any(s.startswith(c) for s in stems))
    assert_one_line_error(invoke("cache", "show", missing, "--cache-dir", store.root), "no stored plan", repr(missing))
    assert_one_line_error(invoke("cache", "show", "xyz", "--cache-dir", store.root), "'xyz' is not a key")
    assert_one_line_error(invoke("cache", "show", TUNED + "0", "--cache-dir", store.root), "no stored plan")


def test_show_ambiguous_prefix_is_one_line(tmp_path):
    s = DiskStore(tmp_path)
    stems = []
    for n in range(1, 18):  # 17 keys: two of them share a first hex digit
        k = key(specs=_specs(n=n))
        s.write(k, meta(False), b"blob")
        stems.append(k.fingerprint())
    first = next(c for c in "0123456789abcdef" if sum(st.startswith(c) for st in stems) >= 2)
    count = sum(st.startswith(first) for st in stems)
    line = assert_one_line_error(invoke("cache", "show", first, "--cache-dir", tmp_path), "ambiguous", f"matches {count} stored plans", "give more digits")
    assert all(st[:5] in line for st in stems if st.startswith(first))


def test_show_bad_entry_is_one_line(store):
    p = store.path(key())
    p.write_bytes(b"garbage")
    assert_one_line_error(invoke("cache", "show", TUNED[:8], "--cache-dir", store.root), "is bad", "verify --fix")


# ----------------------------------------------------------------------------------------------
# verify
# ----------------------------------------------------------------------------------------------
def test_verify_finds_a_corrupted_entry_and_fix_moves_it(store):
    r = invoke("cache", "verify", "--cache-dir", store.root)
    assert r.exit_code == 0 and "checked 2 stored plans" in r.output and "none is bad" in r.output
    p = store.path(key())
    data = bytearray(p.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte in the serialized graph
    p.write_bytes(bytes(data))

    r = invoke("cache", "verify", "--cache-dir", store.root)
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert lines[0].startswith(f"bad {TUNED[:12]}:") and "checksum mismatch" in lines[0]
    assert lines[-1] == "Error: 1 of 2 stored plans failed their checks; `fusekit cache verify --fix` moves them aside"
    assert p.exists()  # not moved without --fix

    r = invoke("cache", "verify", "--fix", "--cache-dir", store.root)
    assert r.exit_code == 0, r.output
    assert "moved 1 bad entry aside" in r.output and "kept 1 good plan" in r.output
    assert not p.exists()
    assert len(list(p.parent.glob(f"{p.name}.*.bad"))) == 1
    r = invoke("cache", "verify", "--cache-dir", store.root)
    assert r.exit_code == 0 and "checked 1 stored plan " in r.output


# ----------------------------------------------------------------------------------------------
# export / import
# ----------------------------------------------------------------------------------------------
def test_export_import_round_trip(store, tmp_path):
    archive = tmp_path / "plans.tar.gz"
    r = invoke("cache", "export", archive, "--cache-dir", store.root)
    assert r.exit_code == 0, r.output
    assert f"exported 2 plans from {store.plans_dir} to {archive}" in r.output

    other = DiskStore(tmp_path / "elsewhere")
    r = invoke("cache", "import", archive, "--cache-dir", other.root)
    assert r.exit_code == 0, r.output
    assert "imported 2 plans" in r.output and "(2 new, 0 replaced)" in r.output
    for k in (key(), key(specs=_specs(n=4, layout="NCHW"))):
        assert other.path(k).read_bytes() == store.path(k).read_bytes()  # byte for byte
    ls = invoke("cache", "ls", "--cache-dir", other.root)
    assert set(_rows(ls.output)) == {TUNED[:12], BUILT[:12]}

    r = invoke("cache", "import", archive, "--cache-dir", other.root)
    assert r.exit_code == 0 and "(0 new, 2 replaced)" in r.output


def test_export_skips_bad_entries(store, tmp_path):
    store.path(key()).write_bytes(b"garbage")
    r = invoke("cache", "export", tmp_path / "x.tar.gz", "--cache-dir", store.root)
    assert r.exit_code == 0 and "exported 1 plan " in r.output and "skipped 1 bad entry" in r.output


def test_import_reports_problems(store, tmp_path):
    archive = tmp_path / "mixed.tar.gz"
    good = store.path(key())
    bad = bytearray(store.path(key(specs=_specs(n=4, layout="NCHW"))).read_bytes())
    bad[-1] ^= 0xFF
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(good, arcname=f"plans/{good.parent.name}/{good.name}")
        info = tarfile.TarInfo(f"plans/{BUILT[:2]}/{BUILT}.plan")
        info.size = len(bad)
        tar.addfile(info, io.BytesIO(bytes(bad)))
    other = tmp_path / "other"
    r = invoke("cache", "import", archive, "--cache-dir", other)
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert lines[0].startswith("imported 1 plan into") and "(1 new, 0 replaced)" in lines[0]
    assert lines[1].startswith("  skipped: ") and "checksum mismatch" in lines[1]
    assert lines[-1] == f"Error: 1 entry of {archive} failed their checks and were skipped"
    assert [p.stem for p in DiskStore(other).entries()] == [TUNED]


def test_import_errors_are_one_line(tmp_path):
    not_tar = tmp_path / "notes.txt"
    not_tar.write_text("hello")
    assert_one_line_error(invoke("cache", "import", not_tar, "--cache-dir", tmp_path / "c"), "not a fusekit cache export")
    assert_one_line_error(invoke("cache", "import", tmp_path / "missing.tar.gz", "--cache-dir", tmp_path / "c"), "cannot read", "missing.tar.gz")


def test_export_to_a_missing_directory_is_one_line(store, tmp_path):
    assert_one_line_error(invoke("cache", "export", tmp_path / "no" / "such" / "x.tar.gz", "--cache-dir", store.root), "cannot write")


# ----------------------------------------------------------------------------------------------
# clear
# ----------------------------------------------------------------------------------------------
def test_clear_yes_empties_the_store(store):
    r = invoke("cache", "clear", "--yes", "--cache-dir", store.root)
    assert r.exit_code == 0, r.output
    assert f"removed 2 plans from {store.plans_dir}" in r.output
    assert list(store.entries()) == []
    r = invoke("cache", "clear", "--yes", "--cache-dir", store.root)
    assert r.exit_code == 0 and "nothing to clear" in r.output


def test_clear_asks_first(store):
    r = invoke("cache", "clear", "--cache-dir", store.root, input="n\n")
    assert r.exit_code == 1 and "delete 2 stored plans" in r.output and "Aborted" in r.output
    assert len(list(store.entries())) == 2
    r = invoke("cache", "clear", "--cache-dir", store.root, input="y\n")
    assert r.exit_code == 0 and "removed 2 plans" in r.output
    assert list(store.entries()) == []


def test_cache_commands_need_no_gpu_and_take_help():
    r = invoke("cache", "--help")
    assert r.exit_code == 0
    for cmd in ("ls", "show", "clear", "export", "import", "verify"):
        assert cmd in r.output
    assert_one_line_error(invoke("cache", "nope"), "nope")


# ----------------------------------------------------------------------------------------------
# leftovers of interrupted writes, untrusted entries
# ----------------------------------------------------------------------------------------------
def _leftover(store: DiskStore, age_s: float, size: int, shard: str) -> os.PathLike:
    d = store.plans_dir / shard
    d.mkdir(parents=True, exist_ok=True)
    p = d / f".{shard}cdef01.k3j_x9.tmp"
    p.write_bytes(b"\0" * size)
    t = time.time() - age_s
    os.utime(p, (t, t))
    return p


def test_ls_and_verify_report_leftovers(store):
    young = _leftover(store, 5, 1024, "ab")
    old = _leftover(store, TUNABLES.leftover_age_s + 60, 2048, "cd")
    r = invoke("cache", "ls", "--cache-dir", store.root)
    assert r.exit_code == 0, r.output
    assert set(_rows(r.output)) == {TUNED[:12], BUILT[:12]}
    assert "2 leftover temporary files (3.0 KiB) from interrupted writes" in r.output
    assert young.exists() and old.exists()  # ls changes nothing

    r = invoke("cache", "verify", "--cache-dir", store.root)
    assert r.exit_code == 0, r.output
    assert "removed 1 leftover temporary file (2.0 KiB) of interrupted writes (older than 10 min)" in r.output
    assert "kept 1 leftover temporary file (1.0 KiB) younger than 10 min" in r.output
    assert r.output.strip().splitlines()[-1].startswith("checked 2 stored plans")
    assert young.exists() and not old.exists()


def test_clear_removes_stale_leftovers_only(store):
    young = _leftover(store, 5, 10, "ab")
    old = _leftover(store, TUNABLES.leftover_age_s + 60, 10, "cd")
    r = invoke("cache", "clear", "--yes", "--cache-dir", store.root)
    assert r.exit_code == 0 and "removed 2 plans" in r.output and "(and 1 other file)" in r.output, r.output
    assert "kept 1 leftover temporary file" in r.output and "a write may still be in progress" in r.output  # says what it kept
    assert young.exists() and not old.exists()


def test_verify_and_ls_refuse_an_entry_others_can_write(store):
    p = store.path(key())
    p.chmod(0o666)
    r = invoke("cache", "ls", "--cache-dir", store.root)
    assert set(_rows(r.output)) == {BUILT[:12]} and "1 bad entry (not listed)" in r.output
    r = invoke("cache", "verify", "--cache-dir", store.root)
    assert r.exit_code == 1
    assert r.output.startswith(f"bad {TUNED[:12]}: ") and "writable by group or others (mode 0o666)" in r.output


# ----------------------------------------------------------------------------------------------
# doctor shows invalid settings
# ----------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:FUSEKIT_PATTERNS")
def test_doctor_shows_invalid_settings(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    env = {
        "FUSEKIT_CACHE_DIR": str(f),
        "FUSEKIT_CACHE_SIZE": "many",
        "FUSEKIT_MODE": "fast",
        "FUSEKIT_PATTERNS": str(tmp_path / "no-such-dir"),
    }
    r = invoke("doctor", env=env)
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    problems = [ln for ln in r.output.splitlines() if ln.startswith("problem ")]
    assert len(problems) == 4, r.output
    assert any(f"FUSEKIT_CACHE_DIR={str(f)!r} is invalid: expected a directory" in ln for ln in problems)
    assert any("FUSEKIT_CACHE_SIZE='many' is invalid: expected an integer from 1 to 1,000,000" in ln for ln in problems)
    assert any("FUSEKIT_MODE='fast' is invalid: expected one of heuristic, autotune" in ln for ln in problems)
    assert any("FUSEKIT_PATTERNS" in ln and "no-such-dir" in ln for ln in problems)
    status = [ln for ln in r.output.splitlines() if ln.startswith("status ")]
    assert len(status) == 1 and "4 invalid setting(s)" in status[0]


def test_doctor_without_problems_exits_zero(tmp_path):
    env = {"FUSEKIT_CACHE_DIR": str(tmp_path / "c"), "FUSEKIT_CACHE_SIZE": "8", "FUSEKIT_MODE": "autotune", "FUSEKIT_PATTERNS": str(tmp_path)}
    r = invoke("doctor", env=env)
    assert r.exit_code == 0, r.output
    assert not any(ln.startswith("problem ") for ln in r.output.splitlines())
    assert not (tmp_path / "c").exists()  # doctor creates nothing


def test_fused_or_split_decisions_are_counted_verified_and_cleared(store):
    """`cache ls` counts the stored fused-or-split decisions, `verify` checks them with the plans
    (a bad one named and moved aside by --fix), `clear` removes them."""
    k = {"tag": "batchnorm_relu", "attrs": [], "arrays": [[[8, 64, 7, 7], "float16", [3136, 1, 448, 64]]], "mode": "heuristic"}
    good = store.write_fusion(k, 0.02, 0.03, "fused")
    bad = store.write_fusion({**k, "mode": "autotune"}, 0.02, 0.01, "split")
    r = invoke("cache", "ls", "--cache-dir", store.root)
    assert r.exit_code == 0 and "2 fused-or-split decisions in" in r.output
    rows = [ln.split() for ln in r.output.splitlines() if ln.startswith((good.stem[:12], bad.stem[:12]))]
    assert sorted(rows) == sorted([
        [good.stem[:12], "batchnorm_relu", "float16[8,64,7,7]:NHWC", "-", "heuristic", "?", "sm_??", "20.0", "30.0", "fused"],
        [bad.stem[:12], "batchnorm_relu", "float16[8,64,7,7]:NHWC", "-", "autotune", "?", "sm_??", "20.0", "10.0", "split"],
    ]), r.output
    r = invoke("cache", "verify", "--cache-dir", store.root)
    assert r.exit_code == 0 and "checked 2 stored plans and 2 fused-or-split decisions" in r.output
    r = invoke("cache", "show", good.stem[:10], "--json", "--cache-dir", store.root)
    assert r.exit_code == 0 and json.loads(r.output)["key"] == k and json.loads(r.output)["choice"] == "fused", r.output
    r = invoke("cache", "show", good.stem[:10], "--cache-dir", store.root)
    assert r.exit_code == 0 and r.output.startswith(f"fused-or-split decision {good.stem}") and '"split_ms": 0.03' in r.output
    bad.write_bytes(bad.read_bytes()[:-20])  # truncated
    assert_one_line_error(invoke("cache", "show", bad.stem[:12], "--cache-dir", store.root), "stored decision", "is bad", "verify --fix")
    r = invoke("cache", "ls", "--cache-dir", store.root)
    assert "1 fused-or-split decision in" in r.output and "1 bad entry (not listed)" in r.output
    r = invoke("cache", "verify", "--cache-dir", store.root)
    assert r.exit_code == 1 and f"bad {bad.stem[:12]}:" in r.output and "not JSON" in r.output
    assert "1 of 2 stored plans and 2 fused-or-split decisions failed their checks" in r.output
    r = invoke("cache", "verify", "--fix", "--cache-dir", store.root)
    assert r.exit_code == 0 and "kept 3 good entries" in r.output and not bad.exists() and good.exists()
    archive = store.root.parent / "with-decisions.tar.gz"
    r = invoke("cache", "export", str(archive), "--cache-dir", store.root)
    assert r.exit_code == 0 and "exported 2 plans" in r.output and "with 1 fused-or-split decision" in r.output, r.output
    other = store.root.parent / "other"
    r = invoke("cache", "import", str(archive), "--cache-dir", other)
    assert r.exit_code == 0 and "imported 2 plans" in r.output and "1 new fused-or-split decision" in r.output, r.output
    assert DiskStore(other).read_fusion(k) == (0.02, 0.03)
    r = invoke("cache", "clear", "--yes", "--cache-dir", store.root)
    assert r.exit_code == 0 and not good.exists() and not list(store.fusion_dir.glob("*/*"))
