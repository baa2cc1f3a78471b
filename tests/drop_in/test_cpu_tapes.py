"""Recorded dispatch (dispatch.taped) on the CPU: what is recorded, when a tape replays, and what
keeps an op from being replayed. The calls are stand-ins (dispatch.execute.launch patched to run a torch
function per call); the GPU tests run the real graphs through tapes (test_gpu_torch_dropin)."""
from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

import fusekit  # noqa: E402
from fusekit import adapters, dispatch  # noqa: E402
from fusekit.adapters import TorchAdapter  # noqa: E402
from fusekit.dispatch import execute, record  # noqa: E402
from stand_in_calls import call, launcher  # noqa: E402


@pytest.fixture
def fake(monkeypatch):
    """Calls c with c.fn(*operands) -> outputs (alloc) or c.fn(*operands, out=outs); each launch logged."""
    launched: list = []
    monkeypatch.setattr(execute, "launch", launcher(launched))
    monkeypatch.setitem(adapters.SIGNATURES, torch.Tensor, TorchAdapter.sig)
    monkeypatch.setitem(adapters.STREAMS, torch.Tensor, lambda device: 7)
    monkeypatch.setattr(record, "adapter_for", lambda a: types.SimpleNamespace(capturing=lambda device: False))
    return launched


MUL = call("mul", lambda a, b: (a * b,))
ADD = call("add", lambda a, b: (a + b,))
SCALE_INTO = call("scale_into", lambda a, s, out: out[0].copy_(a * s))


def _run(c, *operands, out=None):
    res = record.run_call(c, operands, () if out is None else out, out is None)
    return res[0] if len(res) == 1 else res


def test_a_tape_replays_the_recorded_calls_once_two_recordings_agree(fake):
    scratch = torch.empty(4)  # an array the op reads that is not an argument: a constant of the tape
    ran = []

    def op(x, w, b):
        ran.append(1)
        y = _run(MUL, x, w)
        _run(SCALE_INTO, y, b, out=(scratch,))
        return y, _run(ADD, y, scratch), None

    for i in range(5):
        x, w, b = (torch.randn(4) for _ in range(3))
        y, z, none = dispatch.taped(("op",), lambda: op(x, w, b), (x, w, b))
        assert torch.equal(y, x * w) and torch.equal(z, x * w + x * w * b) and none is None
        assert y.data_ptr() != x.data_ptr()
    assert len(ran) == 2, "the first two calls record, later ones replay"
    assert fake == ["mul", "scale_into", "add"] * 5


def test_another_signature_or_aliasing_records_again(fake):
    ran = []

    def op(a, b):
        ran.append(1)
        return _run(ADD, a, b)

    a = torch.randn(4)
    for _ in range(3):
        dispatch.taped(("k",), lambda: op(a, a), (a, a))
    assert len(ran) == 2
    b = torch.randn(4)
    assert torch.equal(dispatch.taped(("k",), lambda: op(a, b), (a, b)), a + b) and len(ran) == 3, "(a, b) replayed (a, a)'s tape"
    c = torch.randn(5)
    dispatch.taped(("k",), lambda: op(c, c), (c, c))
    assert len(ran) == 4, "another shape replayed"
    dispatch.taped(("other",), lambda: op(a, a), (a, a))
    assert len(ran) == 5, "another key replayed"


def test_arrays_made_outside_dispatch_keep_an_op_unrecorded(fake, fresh_session):
    ran = []

    def makes_a_temporary(x):  # a fresh array each call that a run reads
        ran.append(1)
        return _run(ADD, x, x * 2)

    def returns_its_own(x):  # a result that no run made
        ran.append(1)
        return _run(ADD, x, x) + 1

    x = torch.randn(4)
    for _ in range(8):
        assert torch.equal(dispatch.taped(("tmp",), lambda: makes_a_temporary(x), (x,)), 3 * x)
    assert len(ran) == 8 and any(v is record.NEVER for v in fresh_session.tapes.values())
    ran.clear()
    for _ in range(3):
        assert torch.equal(dispatch.taped(("own",), lambda: returns_its_own(x), (x,)), 2 * x + 1)
    assert len(ran) == 3


def test_tapes_off_and_cleared(fake, monkeypatch, fresh_session):
    ran = []

    def op(x):
        ran.append(1)
        return _run(MUL, x, x)

    x = torch.randn(3)
    for _ in range(3):
        dispatch.taped(("sq",), lambda: op(x), (x,))
    assert len(ran) == 2
    dispatch.clear_dispatch()
    dispatch.taped(("sq",), lambda: op(x), (x,))
    assert len(ran) == 3, "clear_dispatch must drop the tapes (they hold resolved calls)"
    with fusekit.settings(tapes=False):
        for _ in range(3):
            dispatch.taped(("sq",), lambda: op(x), (x,))
    assert len(ran) == 6
    monkeypatch.setattr(record, "adapter_for", lambda a: types.SimpleNamespace(capturing=lambda device: True))
    dispatch.clear_dispatch()
    for _ in range(3):
        dispatch.taped(("sq",), lambda: op(x), (x,))
    assert len(ran) == 9 and not fresh_session.tapes, "recorded inside a CUDA-graph capture"


def test_an_op_replayed_inside_a_recording_is_recorded_too(fake):
    """A taped op called by another op that is being recorded: its replay's calls are part of the
    outer recording, so the outer op gets a tape of its own."""
    inner_ran, outer_ran = [], []

    def inner(a):
        inner_ran.append(1)
        return _run(MUL, a, a)

    def outer(a):
        outer_ran.append(1)
        sq = dispatch.taped(("inner",), lambda: inner(a), (a,))
        return _run(ADD, sq, a)

    x = torch.randn(4)
    for _ in range(3):
        dispatch.taped(("inner",), lambda: inner(x), (x,))
    assert len(inner_ran) == 2
    for _ in range(4):
        assert torch.equal(dispatch.taped(("outer",), lambda: outer(x), (x,)), x * x + x)
    assert len(outer_ran) == 2 and len(inner_ran) == 2
