"""CPU: benchmarks/bench_compile.py's table: each row's ratios are Inductor's time over fusekit's."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_compile  # noqa: E402


def test_table_rows_give_speedups_over_each_inductor_mode_and_mark_what_did_not_run():
    recs = [{"model": "resnet50", "batch": 32, "fusekit_ms": 1.0, "inductor_ms": 2.0, "inductor_max_autotune_ms": 1.5,
             "fusekit_compile_s": 20.0, "inductor_compile_s": 60.0, "inductor_max_autotune_compile_s": 240.0,
             "fusekit_rel_err": 3e-3, "torch_fp16_rel_err": 2.9e-3},
            {"model": "convnext_tiny", "batch": 1, "fusekit_ms": None, "inductor_ms": 0.8, "fusekit_error": "UnsupportedError: x"}]
    text = bench_compile.markdown(recs, {"gpu": "Test GPU", "date": "2026-12-07T13:00:00", "torch": "2.11", "iters": 10, "trials": 5})
    rows = [ln for ln in text.splitlines() if ln.startswith("| resnet50") or ln.startswith("| convnext")]
    assert "| 2.00x | 1.50x | 20 / 60 / 240 | 3.0e-03 (2.9e-03) |" in rows[0]
    assert "| - |" in rows[1] and "-x" in rows[1]


def test_training_rows_name_their_phase_and_reduce_overhead_gets_its_own_table():
    recs = [{"model": "resnet50", "batch": 64, "phase": "training", "fusekit_ms": 20.0, "inductor_ms": 21.0},
            {"model": "resnet50", "batch": 32, "phase": "inference", "fusekit_ms": 1.0, "inductor_ms": 2.0,
             "fusekit_reduce_overhead_ms": 1.0, "inductor_reduce_overhead_ms": 1.6}]
    text = bench_compile.markdown(recs, {"gpu": "Test GPU", "date": "2026-12-07T13:00:00", "torch": "2.11", "iters": 10, "trials": 5})
    assert "| resnet50 | 64 | training | 20.000 | 21.000 |" in text
    assert 'mode="reduce-overhead"' in text and "| resnet50 | 32 | 1.000 | 1.600 | 1.60x |" in text


def test_the_backend_is_named_where_registered_else_passed_as_the_callable(monkeypatch):
    import torch._dynamo

    from fusekit.backend import backend

    monkeypatch.setattr(torch._dynamo, "list_backends", lambda *a, **k: ["inductor"])
    assert bench_compile.fusekit_backend() is backend
    monkeypatch.setattr(torch._dynamo, "list_backends", lambda *a, **k: ["inductor", "fusekit"])
    assert bench_compile.fusekit_backend() == "fusekit"


def test_training_rows_report_gradient_errors_against_float64():
    """A training row's error column is its parameter gradients' against float64, eager AMP's beside
    it; grad_rel_err measures that on the model's current weights (here a float32 CPU model, so the
    error is float32 rounding, not zero)."""
    import torch

    recs = [{"model": "resnet50", "batch": 64, "phase": "training", "fusekit_ms": 20.0, "inductor_ms": 24.0,
             "fusekit_grad_rel_err": 4e-3, "torch_amp_grad_rel_err": 3.5e-3, "fusekit_rel_err": 9.0}]
    text = bench_compile.markdown(recs, {"gpu": "Test GPU", "date": "2026-12-07T13:00:00", "torch": "2.11", "iters": 10, "trials": 5})
    assert "| 4.0e-03 (3.5e-03) |" in text and "9.0e+00" not in text
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 36, 10))
    x, labels = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    err = bench_compile.grad_rel_err(model, model, x, labels)
    assert 0 < err < 1e-5, err
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the float64 reference is a copy


def test_a_new_run_replaces_only_the_rows_it_measures_again():
    old = [{"model": "resnet50", "phase": "inference", "batch": 32, "fusekit_ms": 1.3, "date": "d1"},
           {"model": "resnet50", "phase": "training", "batch": 64, "fusekit_ms": 20.0, "date": "d1"}]
    got = bench_compile.merge(old, {"model": "resnet50", "phase": "inference", "batch": 32, "fusekit_ms": 1.2, "date": "d2"})
    assert [(r["phase"], r["date"]) for r in got] == [("training", "d1"), ("inference", "d2")]
    got = bench_compile.merge(got, {"model": "efficientnet_b0", "phase": "inference", "batch": 32, "fusekit_ms": 1.4, "date": "d2"})
    assert len(got) == 3
    text = bench_compile.markdown(got, {"gpu": "Test GPU", "date": "d2", "torch": "2.11", "iters": 10, "trials": 5})
    assert "Runs d1, d2 (each row names its own)" in text and text.count("| d1 |") == 1
