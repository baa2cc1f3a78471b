"""The GPU fuzzer's report (tests/test_gpu_fuzz.py), exercised on the CPU: every failing case is in
$FUSEKIT_FUZZ_REPORT as soon as it fails, the last one being hypothesis's shrunk case, so a device
run cut short by its time limit still says what failed."""

import json

import pytest

pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")


def test_failures_reach_the_report_as_they_happen(tmp_path, monkeypatch):
    from hypothesis import given
    from hypothesis import strategies as st

    import test_gpu_fuzz as fz

    monkeypatch.setenv("FUSEKIT_FUZZ_REPORT", str(tmp_path / "fuzz.json"))
    monkeypatch.setattr(fz, "FAILED", [])
    monkeypatch.setattr(fz, "RAN", fz.Counter())
    settings_, regressions = fz.fuzz("demo", 30)

    @settings_
    @given(case=st.fixed_dictionaries({"n": st.integers(0, 100)}))
    @regressions
    def demo(case):
        fz.RAN["demo"] += 1
        got = torch.tensor([float(case["n"])])
        fz.check("demo value", got, torch.tensor([1.0]) if case["n"] >= 50 else got, 1e-3, case)

    with pytest.raises(AssertionError, match="relative error"):
        demo()
    r = json.loads(open(fz.report_path()).read())
    assert r["failures"] >= 1 and r["cases"] == r["per_test"]["demo"] >= r["failures"]
    assert r["last_failures"][-1]["case"] == {"n": 50}  # shrunk to the smallest failing value
    assert r["last_failures"][-1]["test"] == "demo" and "AssertionError" in r["last_failures"][-1]["problem"]


def test_each_xdist_worker_writes_a_report_of_its_own(monkeypatch):
    import test_gpu_fuzz as fz

    monkeypatch.setenv("FUSEKIT_FUZZ_REPORT", "/out/fuzz.json")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert fz.report_path() == "/out/fuzz.json"
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert fz.report_path() == "/out/fuzz.gw3.json"
    monkeypatch.delenv("FUSEKIT_FUZZ_REPORT")
    assert fz.report_path() is None
