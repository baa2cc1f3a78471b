"""CPU: benchmarks/zoo.py's records and table: the speed-up is the best PyTorch figure over fusekit's
faster one (heuristic or autotuned), and the table shows which figures a row has."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import zoo  # noqa: E402

META = {"gpu": "Test GPU", "date": "2026-12-08T01:00:00", "torch": "2.11", "cudnn": 91900, "iters": 10, "trials": 5}


def _rec(**kw):
    rec = {"model": "resnet50", "batch": 32, "compiled": True, "fusekit_ms": 1.3, "torch_eager_ms": 3.5, "torch_graph_ms": 2.6,
           "fused_time_fraction": 0.98, "fused_stages": 57, "stages": 57, "rel_err": 3e-2, "torch_fp16_rel_err": 2.9e-2,
           "top1_agreement": 0.98, "torch_fp16_top1_agreement": 0.97, "date": META["date"]}
    rec.update(kw)
    return rec


def test_speedup_takes_the_best_pytorch_variant_and_fusekits_faster_figure():
    plain = _rec(torch_compile_max_autotune_ms=1.77, torch_compile_max_autotune_s=236.0)
    zoo._best(plain)
    assert plain["best_torch_ms"] == 1.77 and plain["speedup_vs_best"] == pytest.approx(1.77 / 1.3)
    tuned = _rec(torch_compile_max_autotune_ms=1.77, torch_compile_max_autotune_s=236.0, fusekit_autotuned_ms=1.18)
    zoo._best(tuned)
    assert tuned["speedup_vs_best"] == pytest.approx(1.77 / 1.18)
    slower_tuning = _rec(fusekit_autotuned_ms=1.5)  # an autotuned figure that lost to the heuristic's is not the one compared
    zoo._best(slower_tuning)
    assert slower_tuning["best_torch_ms"] == 2.6 and slower_tuning["speedup_vs_best"] == pytest.approx(2.6 / 1.3)


def test_table_marks_tuned_figures_and_max_autotune_compile_times():
    recs = [_rec(torch_compile_max_autotune_ms=1.77, torch_compile_max_autotune_s=236.0, fusekit_autotuned_ms=1.18),
            _rec(model="densenet121", fusekit_ms=3.2, torch_graph_ms=5.1)]
    for r in recs:
        zoo._best(r)
    rows = {ln.split(" | ")[0][2:]: ln for ln in zoo.markdown(recs, META).splitlines() if ln.startswith("| resnet50") or ln.startswith("| densenet")}
    assert "1.300 / 1.180 tuned" in rows["resnet50"] and "1.770 (236)" in rows["resnet50"] and "1.50x" in rows["resnet50"]
    assert "tuned" not in rows["densenet121"] and "| - |" in rows["densenet121"]
