"""What fusekit offers cuDNN when it refuses a description of a call (no GPU needed)."""

import json
import warnings

import pytest

import fusekit
from fusekit import dispatch
from fusekit.engine import keys
from fusekit.tensors import TensorSpec
from fusekit.dispatch import choice


def specs_for(pattern, shapes, layout="NCHW", dtype="float16"):
    pat = fusekit.get_pattern(pattern)
    specs = keys.shape_specs(pat, shapes, dtype, layout)
    norm = pat.normalize_attrs({})
    specs.update(keys.output_specs(pat, specs, norm))
    return pat, specs


def test_nchw_backward_pieces_fall_back_to_channels_last_copies():
    pat, specs = specs_for("relu_bias_grad", {"dy": (2, 8, 5, 5), "y": (2, 8, 5, 5)})
    (alt, copies), = dispatch.alternatives(pat, specs)
    names = pat.operand_names + tuple(pat.outputs)
    assert {names[i] for i in copies} == {"dy", "y", "dz"}  # db is a channel vector: layout-free
    assert all(alt[n].layout == "NHWC" and alt[n].shape == specs[n].shape for n in ("dy", "y", "dz"))
    assert alt["db"] == specs["db"]


def test_channels_last_calls_have_no_layout_fallback():
    pat, specs = specs_for("relu_bias_grad", {"dy": (2, 8, 5, 5), "y": (2, 8, 5, 5)}, layout="NHWC")
    assert dispatch.alternatives(pat, specs) == []


def test_filters_are_copied_too_for_transposed_convolution():
    pat, specs = specs_for("conv_transpose_bias", {"x": (4, 8, 8, 8), "w": (8, 4, 3, 3), "b": (4,)}, dtype="float32")
    (alt, copies), = dispatch.alternatives(pat, specs)
    names = pat.operand_names + tuple(pat.outputs)
    assert {names[i] for i in copies} == {"x", "w", "y"}


def test_one_channel_elementwise_patterns_are_redescribed_without_copies():
    pat, specs = specs_for("channel_scale_shift_relu", {"x": (2, 1, 6, 5), "gamma": (1,), "beta": (1,)})
    alts = dispatch.alternatives(pat, specs)
    alt, copies = alts[0]
    assert copies == frozenset()
    # (N, 1, H, W) dense is the same memory as channels-last (N, W, H, 1): element (n, w, h, 0) is x[n, 0, h, w]
    assert alt["x"] == TensorSpec.build((2, 5, 6, 1), "float16", 0, "NHWC")
    assert alt["x"].strides == (30, 1, 5, 5) and alt["y"] == alt["x"]
    assert alt["gamma"] == specs["gamma"]
    # the lowering accepts the new description (channel vectors broadcast as single values)
    from fusekit.engine import lower

    low = lower.lower(pat, alt, dict(pat.normalize_attrs({})))
    assert low.graph.inspect()["tensors"]["x"]["dim"] == [2, 5, 6, 1]


def test_one_channel_batch_norm_node_has_no_redescription():
    pat, specs = specs_for("batchnorm", {"x": (2, 1, 6, 5), "gamma": (1,), "beta": (1,), "running_mean": (1,), "running_var": (1,)})
    assert all(copies for _, copies in dispatch.alternatives(pat, specs))  # only the layout copy is offered


def _memory(spec):
    """Element offsets of a dense spec, in its logical (N, C, H, W) order."""
    import numpy as np

    idx = np.zeros(spec.shape, dtype=np.int64)
    for d, (size, stride) in enumerate(zip(spec.shape, spec.strides)):
        shape = [1] * len(spec.shape)
        shape[d] = size
        idx = idx + (np.arange(size) * stride).reshape(shape)
    return idx


@pytest.mark.parametrize("shape", [(2, 1, 6, 5), (1, 1, 9, 1), (3, 1, 4, 1), (4, 1, 1, 1), (1, 1, 1, 7)])
def test_one_channel_redescription_covers_the_same_memory_with_more_than_one_channel(shape):
    """(N, 1, H, 1) and (N, 1, 1, 1) included: the redescription must not keep C = 1 (the GPU fuzzer's
    first batch-norm case, (1, 1, 9, 1), was refused in both of its descriptions)."""
    import numpy as np

    pat, specs = specs_for("batchnorm_inference", {"x": shape, "mean": (1,), "inv_std": (1,), "gamma": (1,), "beta": (1,)})
    alt, copies = dispatch.alternatives(pat, specs)[0]
    assert copies == frozenset() and alt["x"].layout == "NHWC" and alt["x"].shape[1] > 1 and alt["y"] == alt["x"]
    offsets = _memory(alt["x"])
    assert np.array_equal(np.sort(offsets.ravel()), np.arange(offsets.size))  # every element once: same memory
    assert np.array_equal(np.sort(_memory(specs["x"]).ravel()), np.sort(offsets.ravel()))
    from fusekit.engine import lower

    low = lower.lower(pat, alt, dict(pat.normalize_attrs({})))
    assert low.graph.inspect()["tensors"]["x"]["dim"] == list(alt["x"].shape)


def test_a_single_value_has_no_one_channel_redescription():
    pat, specs = specs_for("batchnorm_inference", {"x": (1, 1, 1, 1), "mean": (1,), "inv_std": (1,), "gamma": (1,), "beta": (1,)})
    assert all(copies for _, copies in dispatch.alternatives(pat, specs))  # at most the layout copy


def test_fused_or_split_warns_once_per_kind_with_the_refusal_s_first_line(monkeypatch, fresh_session):
    """A refused fused graph runs split from then on, said once per kind of graph (a model's every
    shape of it is refused alike) in one line: cuDNN's refusal carries its multi-line engine log,
    the warning keeps the sentence naming what was refused."""
    log = "cuDNN cannot run bn_relu_bwd(dy=float16[4, 8, 2, 2]) on GPU: no engine\n{\"engineId\":0}\nWarning: CUDNN_STATUS_NOT_SUPPORTED"
    ran = []

    def fused():
        ran.append("fused")
        raise fusekit.UnsupportedError(log)

    tag = ("bn_relu_bwd", (), ((4, 8, 2, 2), "float16", (32, 4, 2, 1)))
    with pytest.warns(fusekit.FusionWarning) as got:
        assert dispatch.fused_or_split(tag, fused, lambda: "split") == "split"
    (w,) = got
    msg = str(w.message)
    assert "\n" not in msg and "bn_relu_bwd(dy=float16[4, 8, 2, 2]) on GPU: no engine" in msg and "engineId" not in msg
    assert "no engine for bn_relu_bwd with float16[4, 8, 2, 2]; running it as separate graphs (" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.fused_or_split(tag, fused, lambda: "split") == "split"  # no second warning, no second try
    assert ran == ["fused"]
    other = (tag[0], (), ((8, 8, 2, 2), "float16", (32, 4, 2, 1)))  # the same kind at another shape: refused, runs split, unsaid
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.fused_or_split(other, fused, lambda: "split") == "split"
    assert ran == ["fused", "fused"] and other in fresh_session.split
    with pytest.warns(fusekit.FusionWarning, match="no engine for conv_relu_bwd"):  # another kind is said
        dispatch.fused_or_split(("conv_relu_bwd",) + tag[1:], fused, lambda: "split")
    assert choice.first_line(ValueError("x" * 500)).endswith("…") and len(choice.first_line(ValueError("x" * 500))) == 300


def test_route_refusal_says_which_route_runs_instead(monkeypatch):
    """Route tags choose between two layouts of the same graphs: the warning names the other route,
    not 'separate graphs'."""

    def direct():
        raise fusekit.UnsupportedError("cuDNN cannot run conv_dgrad(dy=float16[2, 16, 4, 4]) on GPU: no engine")

    tag = ("conv_dgrad_via_nchw", (), ((2, 16, 4, 4), "float16", (256, 1, 64, 16)))
    with pytest.warns(fusekit.FusionWarning) as got:
        assert dispatch.fused_or_split(tag, direct, lambda: "nchw", instead="writing NCHW, then a channels-last copy") == "nchw"
    msg = str(got[0].message)
    assert "running it writing NCHW, then a channels-last copy (cuDNN cannot run conv_dgrad(" in msg
    assert "separate graphs" not in msg and "fused pattern" not in msg


@pytest.mark.parametrize("fused_ms,split_ms,mode,expect", [
    (1.0, 0.5, "autotune", "split"),  # split measured faster: kept from then on
    (1.0, 0.99, "autotune", "fused"),  # within the 3% margin: the fused graph stays
    (1.0, 0.5, "heuristic", "split"),  # heuristic plans are timed too (a fused plan 3x slower than split)
    (0.5, 1.0, "heuristic", "fused"),
])
def test_fused_or_split_keeps_the_faster_in_each_mode(monkeypatch, fused_ms, split_ms, mode, expect, fresh_session):
    from types import SimpleNamespace

    from fusekit import dispatch

    cache = SimpleNamespace(mode=mode, store=None)
    monkeypatch.setattr(choice, "default_cache", lambda: cache)
    runs = []
    fused = lambda: runs.append("fused") or "fused"  # noqa: E731
    split = lambda: runs.append("split") or "split"  # noqa: E731
    times = {fused: fused_ms, split: split_ms}

    class Ad:
        describe = staticmethod(lambda a: ((), (), "float16", 0))
        capturing = staticmethod(lambda dev: False)
        device_ms = staticmethod(lambda fn: (fn(), times[fn])[1])

    monkeypatch.setattr(choice, "adapter_for", lambda a: Ad)
    monkeypatch.setattr(choice, "device_ms", lambda ad, fn: ad.device_ms(fn))  # the stand-in adapter's timings
    tag = ("conv_transpose_bias_relu", ((1, 1), (2, 2)), ((64, 32, 8, 8), "float32", (2048, 1, 256, 32)))
    assert dispatch.fusion_choice(tag) is None
    assert dispatch.fused_or_split(tag, fused, split, like=object()) == expect
    assert fresh_session.fusion_times == {(tag, mode): (fused_ms, split_ms)} and dispatch.fusion_choice(tag) == expect
    assert runs.count("fused") >= 4 and runs.count("split") >= 4  # one untimed run each, then three timed
    runs.clear()
    assert dispatch.fused_or_split(tag, fused, split, like=object()) == expect
    assert runs == [expect]  # later calls: no timing, the kept path only
    # the other plan mode decides for itself (its plans can rank the two the other way)
    cache.mode = "autotune" if mode == "heuristic" else "heuristic"
    times[fused], times[split] = split_ms, fused_ms
    other = "split" if fused_ms < fusekit.config.TUNABLES.split_margin * split_ms else "fused"
    assert dispatch.fused_or_split(tag, fused, split, like=object()) == other
    assert len(fresh_session.fusion_times) == 2 and dispatch.fusion_choice(tag, mode) == expect


def test_fused_or_split_times_nothing_inside_a_capture_and_checks_operands_first(monkeypatch, fresh_session):
    """Inside a capture the fused graph runs untimed (and is timed on the first call outside one);
    the fused call runs before the adapter is asked anything, so bad operands get its OperandError."""
    from types import SimpleNamespace

    import fusekit
    from fusekit import dispatch

    monkeypatch.setattr(choice, "default_cache", lambda: SimpleNamespace(mode="heuristic", store=None))
    capturing = [True]

    class Ad:
        describe = staticmethod(lambda a: ((), (), "float16", 0))
        capturing = staticmethod(lambda dev: capturing[0])
        device_ms = staticmethod(lambda fn: (fn(), 1.0)[1])

    monkeypatch.setattr(choice, "adapter_for", lambda a: Ad)
    monkeypatch.setattr(choice, "device_ms", lambda ad, fn: ad.device_ms(fn))  # the stand-in adapter's timings
    tag = ("conv_dgrad_drelu", ((0, 0), 1, 1, 1, 1), ((8, 8, 4, 4), "float16", (128, 16, 4, 1)))
    runs = []
    assert dispatch.fused_or_split(tag, lambda: runs.append("f") or "f", lambda: runs.append("s") or "s", like=object()) == "f"
    assert runs == ["f"] and fresh_session.fusion_times == {}
    capturing[0] = False
    dispatch.fused_or_split(tag, lambda: runs.append("f") or "f", lambda: runs.append("s") or "s", like=object())
    assert (tag, "heuristic") in fresh_session.fusion_times

    def bad():
        raise fusekit.OperandError("conv_dgrad_drelu", "dy", "expected a CUDA device array")

    def host_adapter(a):  # what asking PyTorch about a host tensor's device raised before the reordering
        raise RuntimeError("invalid argument to exchangeDevice")

    monkeypatch.setattr(choice, "adapter_for", host_adapter)
    with pytest.raises(fusekit.OperandError, match="operand 'dy'"):
        dispatch.fused_or_split(("conv_dgrad_drelu", "other"), bad, lambda: "s", like=object())


def test_cupy_fence_first_made_inside_a_capture_raises_capture_error(monkeypatch):
    """CuPy cannot allocate inside a stream capture: the fence buffer's first use there says to warm
    up (a CaptureError) instead of failing inside CUDA."""
    pytest.importorskip("cupy")
    from fusekit.errors import CaptureError
    from fusekit.adapters import CupyAdapter

    ad = CupyAdapter()
    monkeypatch.setattr(ad, "capturing", lambda dev: True)
    monkeypatch.setattr(ad.cp, "zeros", lambda *a, **k: pytest.fail("allocated inside a capture"))
    with pytest.raises(CaptureError, match="warm-up"):
        ad.fence(0)


def test_fused_or_split_decisions_persist_across_processes_and_bad_files_are_timed_again(monkeypatch, tmp_path, fresh_session):
    """A timed decision is written to the plan cache's disk store; a later process (here: the
    in-memory table emptied) reads it and runs the kept path without timing. A file that fails its
    checks is moved aside with a warning and the pair is timed again; another GPU or plan mode
    does not reuse it."""
    from types import SimpleNamespace

    import fusekit
    from fusekit import dispatch
    from fusekit.engine.cache import DiskStore, PlanCache

    cache = PlanCache(store=DiskStore(tmp_path), mode="heuristic")
    monkeypatch.setattr(choice, "default_cache", lambda: cache)
    gpu = ["Test GPU"]
    fresh_session.runtime = SimpleNamespace(device_facts=lambda ad, dev: SimpleNamespace(name=gpu[0], cc=(9, 0)), release=lambda: None)
    monkeypatch.setattr(choice, "versions", lambda: SimpleNamespace(cudnn_backend=91900, frontend="1.32.0"))
    timings = []

    class Ad:
        describe = staticmethod(lambda a: ((), (), "float16", 0))
        capturing = staticmethod(lambda dev: False)

        @staticmethod
        def device_ms(fn):
            timings.append(fn)
            fn()
            return 1.0 if fn is fused else 0.5

    monkeypatch.setattr(choice, "adapter_for", lambda a: Ad)
    monkeypatch.setattr(choice, "device_ms", lambda ad, fn: ad.device_ms(fn))  # the stand-in adapter's timings
    runs = []
    fused = lambda: runs.append("fused") or "fused"  # noqa: E731
    split = lambda: runs.append("split") or "split"  # noqa: E731
    tag = ("conv_dgrad_via_nchw", ((64, 3, 64, 64), (1, 1), (2, 2), (1, 1), 1), ((64, 16, 32, 32), "float16", (16384, 1, 512, 16)))

    assert dispatch.fused_or_split(tag, fused, split, like=object()) == "split" and len(timings) == 6
    (f,) = DiskStore(tmp_path).decisions()
    record = json.loads(f.read_bytes())
    assert (record["fused_ms"], record["split_ms"], record["choice"]) == (1.0, 0.5, "split")
    assert record["key"]["arrays"] == [[[64, 16, 32, 32], "float16", [16384, 1, 512, 16]]] and record["key"]["gpu"] == "Test GPU"

    def fresh():  # a new process: nothing in memory
        fresh_session.fusion_times.clear()
        timings.clear()
        runs.clear()

    fresh()
    assert dispatch.fused_or_split(tag, fused, split, like=object()) == "split"
    assert timings == [] and runs == ["fused", "split"]  # the fused call checks the operands; then the stored choice
    assert fresh_session.fusion_times == {(tag, "heuristic"): (1.0, 0.5)}

    fresh()
    cache.mode = "autotune"  # another plan mode: timed for itself
    dispatch.fused_or_split(tag, fused, split, like=object())
    assert len(timings) == 6 and len(list(DiskStore(tmp_path).decisions())) == 2
    cache.mode = "heuristic"

    fresh()
    gpu[0] = "Other GPU"  # another GPU: timed for itself
    dispatch.fused_or_split(tag, fused, split, like=object())
    assert len(timings) == 6 and len(list(DiskStore(tmp_path).decisions())) == 3
    gpu[0] = "Test GPU"

    for bad in (b"{not json", json.dumps({**record, "split_ms": -1.0}).encode(), json.dumps({**record, "key": {**record["key"], "mode": "x"}}).encode()):
        f.write_bytes(bad)
        fresh()
        with pytest.warns(fusekit.CacheWarning, match="ignoring"):
            assert dispatch.fused_or_split(tag, fused, split, like=object()) == "split"
        assert len(timings) == 6  # timed again
        assert json.loads(f.read_bytes())["split_ms"] == 0.5  # and rewritten whole
    assert len(list(f.parent.glob("*.bad"))) == 3


def test_fused_or_split_decisions_follow_the_store_through_verify_clear_export_and_import(tmp_path):
    from fusekit.engine.cache import DiskStore

    store = DiskStore(tmp_path / "a")
    key = {"tag": "batchnorm_relu", "attrs": [], "arrays": [[[8, 64, 7, 7], "float16", [3136, 1, 448, 64]]], "mode": "heuristic"}
    p = store.write_fusion(key, 0.02, 0.03, "fused")
    assert store.read_fusion(key) == (0.02, 0.03) and store.read_fusion({**key, "mode": "autotune"}) is None
    assert store.verify() == []
    archive = tmp_path / "x.tar.gz"
    store.export(archive)
    other = DiskStore(tmp_path / "b")
    assert other.import_(archive) == (0, [])  # no plans, one decision
    assert other.read_fusion(key) == (0.02, 0.03)
    p.write_bytes(b"garbage")
    assert [q for q, _ in store.verify()] == [p]
    store.clear()
    assert list(store.decisions()) == [] and list(p.parent.iterdir()) == []


@pytest.mark.parametrize("pattern", ["conv_bias_add", "conv_bias_add_relu"])
def test_nchw_residual_add_convolutions_run_on_channels_last_copies(pattern):
    """cuDNN 9.19 built these on NCHW x (1x1 output) and computed garbage: fusekit refuses the NCHW
    description itself, before cuDNN, in the build and in a load from the disk store."""
    from types import SimpleNamespace

    from fusekit.engine import lower
    from fusekit.engine.planner import planner
    from fusekit.errors import UnsupportedError

    pat, specs = specs_for(pattern, {"x": (2, 2, 1, 2), "w": (2, 2, 1, 1), "b": (2,), "z": (2, 2, 1, 1)})
    attrs = dict(pat.normalize_attrs({}))
    assert "NCHW" in lower.untrusted(pat, specs)
    with pytest.raises(UnsupportedError, match="not trusted"):
        lower.build_plans(pat, specs, attrs, None, ("A",))
    key = SimpleNamespace(specs=tuple(specs.items()), attrs=tuple(attrs.items()), describe=lambda: pattern)
    _, load = planner(pat, key, None, None, None)
    with pytest.raises(UnsupportedError, match="not trusted"):
        load(None)
    alt, copies = dispatch.alternatives(pat, specs)[-1]
    names = pat.operand_names + tuple(pat.outputs)
    assert "x" in {names[i] for i in copies} and lower.untrusted(pat, alt) == ""
    _, nhwc = specs_for(pattern, {"x": (2, 2, 1, 2), "w": (2, 2, 1, 1), "b": (2,), "z": (2, 2, 1, 1)}, layout="NHWC")
    assert lower.untrusted(pat, nhwc) == ""
    plain, plain_specs = specs_for("conv_bias", {"x": (2, 2, 1, 2), "w": (2, 2, 1, 1), "b": (2,)})
    assert lower.untrusted(plain, plain_specs) == ""  # no residual: cuDNN's NCHW plans computed right


@pytest.mark.parametrize("name, groups, timed", [
    ("conv_bias_relu6", 1, True),  # cuDNN 9.19's heuristics give a dense conv + ReLU6 its slow fallback engine
    ("conv_bias_relu6", 4, True),
    ("conv_bias_relu", 4, True),  # grouped: cuDNN may have no fused engine
    ("conv_bias_relu", 1, False),  # dense conv + bias + ReLU: the fused graph, untimed
    ("conv_bias", 1, False),
])
def test_conv_epilogues_timed_against_the_split_where_cudnn_may_be_slow(monkeypatch, name, groups, timed):
    """Which conv epilogues go through fused_or_split (timed against conv + pointwise graphs) and
    which run their one graph directly; a timed one's tag names the pattern, attributes and arrays."""
    import numpy as np

    from fusekit.ops import conv

    seen, ran = [], []
    monkeypatch.setattr(conv, "fused_or_split", lambda tag, fused, split, like=None: seen.append((tag, like)) or fused())
    monkeypatch.setattr(conv, "run", lambda pat, names, values, operands, out: ran.append((pat, values)) or "y")
    x, w, b = np.zeros((2, 8, 5, 5), np.float16), np.zeros((8, 8 // groups, 1, 1), np.float16), np.zeros(8, np.float32)
    assert getattr(conv, name)(x, w, b, groups=groups) == "y"
    assert ran == [(name, (0, 1, 1, groups))]
    assert len(seen) == timed
    if timed:
        (tag, like), = seen
        assert tag[0] == name and tag[1] == (0, 1, 1, groups) and like is x
        assert [a[0] for a in tag[2:]] == [x.shape, w.shape, b.shape]
