"""fusekit.timing, the one timer, on a stand-in adapter whose events read a scripted GPU clock: what
is inside the events is what counts, trials are read at the end, a spin comes first, a captured
graph is replayed once before it is timed."""

import pytest

from fusekit import timing


class Clock:
    """A GPU clock that advances by the cost of each queued piece of work; the host sees it all."""

    def __init__(self):
        self.t, self.log = 0.0, []

    def work(self, ms, what):
        self.t += ms
        self.log.append(what)


class FakeAdapter:
    def __init__(self, clock):
        self.clock = clock

    def event(self):
        return {}

    def record(self, e):
        e["t"] = self.clock.t
        self.clock.log.append("record")

    def elapsed_ms(self, a, b):
        return b["t"] - a["t"]

    def synchronize(self):
        self.clock.log.append("sync")

    def spin(self, cycles=4_000_000):
        self.clock.work(2.0, "spin")

    def use_stream(self, stream):
        import contextlib

        self.clock.log.append(f"stream {stream}")
        return contextlib.nullcontext()

    def capture(self, stream, fn):
        fn()  # once eagerly, then "captured"
        self.clock.log.append("captured")
        return lambda: self.clock.work(0.5, "replay")


def test_events_time_what_runs_between_them_per_call():
    c = Clock()
    ad = FakeAdapter(c)
    fresh = []
    times = timing.events_ms(ad, lambda: c.work(0.25, "fn"), iters=4, trials=3, warmup=2,
                             before_trial=lambda: (fresh.append(1), c.work(7.0, "fresh")), spin=True)
    assert times == pytest.approx([0.25] * 3) and len(fresh) == 3  # the fresh input's 7 ms is outside the events
    assert c.log[:4] == ["stream None", "fn", "fn", "sync"] and c.log[4] == "spin" and c.log.count("spin") == 1
    assert timing.median_ms(ad, lambda: c.work(1.5, "fn"), iters=2, trials=5, warmup=0) == 1.5


def test_device_ms_spins_first_and_graph_times_replay_once_untimed():
    c = Clock()
    ad = FakeAdapter(c)
    assert timing.device_ms(ad, lambda: c.work(0.1, "fn"), reps=5) == pytest.approx(0.1)
    assert c.log.index("spin") < c.log.index("record")
    c.log.clear()
    times = timing.graph_times_ms(ad, "side", lambda: c.work(0.5, "fn"), trials=4)
    assert times == pytest.approx([0.5] * 4)
    assert c.log[:3] == ["fn", "captured", "stream side"] and c.log.count("replay") == 5  # one warm-up replay


def test_host_us_is_the_median_wall_time_per_call_with_synchronize_outside():
    syncs = []
    us = timing.host_us(lambda: None, calls=50, trials=5, warmup=3, synchronize=lambda: syncs.append(1))
    assert 0 < us < 1000 and len(syncs) == 6  # after the warm-up and after each trial
