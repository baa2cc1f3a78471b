"""fusekit.session: one owner of what dispatch learns while it runs; a scoped session starts from
nothing and the previous one comes back after it; an observer sees every executed graph."""

import warnings
from types import SimpleNamespace

import pytest

import fusekit
from fusekit import session
from fusekit.dispatch import calls, execute
from fusekit.errors import warn_once


def test_scoped_session_starts_empty_and_puts_the_previous_one_back(monkeypatch):
    monkeypatch.setenv("FUSEKIT_CACHE_DIR", "off")
    outer = session.current()
    outer.split.add(("tag",))
    with session.scoped() as s:
        assert session.current() is s and s is not outer
        assert not s.split and not s.calls and not s.tapes and s.cache is None
        cache = fusekit.default_cache()
        assert s.cache is cache and cache is not outer.cache
        s.fusion_times[("t", "heuristic")] = (1.0, 2.0)
    assert session.current() is outer and ("tag",) in outer.split and ("t", "heuristic") not in outer.fusion_times
    outer.split.discard(("tag",))
    mine = session.Session()
    with session.scoped(mine) as s:
        assert s is mine
    assert session.current() is outer


def test_a_warning_given_once_is_given_again_in_a_fresh_session():
    with session.scoped():
        with pytest.warns(UserWarning, match="first"):
            assert warn_once(("k",), "first", UserWarning)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not warn_once(("k",), "again", UserWarning)
    with session.scoped():
        with pytest.warns(UserWarning, match="anew"):
            assert warn_once(("k",), "anew", UserWarning)


def test_release_forgets_calls_and_bumps_the_generation():
    with session.scoped() as s:
        s.calls[("sig",)] = object()
        s.tapes[("key",)] = object()
        s.last_out[7] = ((0, 4),)
        gen = s.generation
        s.release()
        assert not s.calls and not s.tapes and not s.last_out and s.generation == gen + 1


def test_an_observer_sees_every_executed_graph_until_it_stops():
    executed = []

    class Graph:
        def execute(self, arrays, ws, handle=None, tensor_uids=None):
            executed.append(tuple(arrays))

    plan = SimpleNamespace(graph=Graph(), uids=(1, 2))
    handle = SimpleNamespace(stream=0)
    c = calls.Call(plan, handle, 0, SimpleNamespace(ptr=0), (), SimpleNamespace(ptr=lambda a: a))
    assert c.native is None
    with session.scoped() as s:
        seen = []
        stop = s.observe(lambda call, operands, outs: seen.append((call, operands, outs)))
        execute.launch(c, (10,), (20,), False)
        stop()
        execute.launch(c, (11,), (21,), False)
    assert executed == [(10, 20), (11, 21)] and seen == [(c, (10,), (20,))]
