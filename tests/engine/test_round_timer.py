"""RoundTimer (host clocks on CPU; CUDA events on GPU): phases per round, and the sampled mode
(SSDLIB_TIME_EVERY) that times one round in N and counts it N times."""

import time

import pytest

from ssdlib.engine.timing import RoundTimer
from ssdlib.errors import ConfigError


class Row:
    def __init__(self):
        self.metrics = {}


def run_round(timer, rows, pause=0.002):
    timer.start()
    time.sleep(pause)
    timer.mark("verify")
    timer.mark("host")
    return timer.add_to(rows)


def test_every_round_timed_by_default(monkeypatch):
    monkeypatch.delenv("SSDLIB_TIME_EVERY", raising=False)
    timer, rows = RoundTimer("cpu"), [Row(), Row()]
    for _ in range(3):
        phases = run_round(timer, rows)
        assert set(phases) == {"verify", "host"} and phases["verify"] >= 0.002
    for r in rows:
        assert 0.006 <= r.metrics["verify_s"] < 1.0 and "host_s" in r.metrics


def test_sampled_rounds_count_every_times(monkeypatch):
    monkeypatch.setenv("SSDLIB_TIME_EVERY", "4")
    timer, row = RoundTimer("cpu"), Row()
    assert timer.every == 4
    timed = []
    for i in range(8):
        phases = run_round(timer, [row])
        timed.append(bool(phases))
        if i == 0:
            first = phases["verify"]
            assert row.metrics["verify_s"] == pytest.approx(4 * first)
            assert timer.totals()["verify"] == pytest.approx(4 * first)
    assert timed == [True, False, False, False] * 2
    assert timer.totals() == {}  # the last round was not timed
    # two timed rounds of >= 2 ms each, counted 4 times: an estimate of the 8 rounds' sum
    assert row.metrics["verify_s"] >= 8 * 0.002


@pytest.mark.parametrize("bad", ["0", "-2", "x"])
def test_bad_sampling_period_is_a_clear_error(monkeypatch, bad):
    monkeypatch.setenv("SSDLIB_TIME_EVERY", bad)
    with pytest.raises(ConfigError, match="SSDLIB_TIME_EVERY"):
        RoundTimer("cpu")


class Seq(Row):
    def __init__(self, finished=False):
        super().__init__()
        self.finished = finished


def test_deferred_round_is_added_by_flush(monkeypatch):
    """add_to(defer=True) keeps the round; flush() (the loop calls it once its next step is
    launched) adds it; the next add_to flushes a kept round first."""
    monkeypatch.delenv("SSDLIB_TIME_EVERY", raising=False)
    timer, rows = RoundTimer("cpu"), [Seq(), Seq()]
    timer.start()
    time.sleep(0.002)
    timer.mark("verify")
    assert timer.add_to(rows, defer=True) == {}
    assert rows[0].metrics == {}
    phases = timer.flush()
    assert phases["verify"] >= 0.002
    assert rows[1].metrics["verify_s"] == pytest.approx(phases["verify"])
    assert timer.flush() == {}  # nothing kept any more
    timer.start()
    timer.mark("verify")
    timer.add_to(rows, defer=True)
    timer.start()
    timer.mark("verify")
    assert "verify" in timer.add_to(rows)  # not deferred: this round, after the kept one
    assert rows[0].metrics["verify_s"] >= phases["verify"]
    assert timer.flush() == {}


def test_round_with_a_finished_sequence_is_read_at_once(monkeypatch):
    """A sequence that ended leaves with its output: its last round cannot wait for a flush."""
    monkeypatch.delenv("SSDLIB_TIME_EVERY", raising=False)
    timer, rows = RoundTimer("cpu"), [Seq(), Seq(finished=True)]
    timer.start()
    timer.mark("verify")
    assert "verify" in timer.add_to(rows, defer=True)
    assert all("verify_s" in r.metrics for r in rows)
    assert timer.flush() == {}


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA events")
def test_deferred_rounds_on_gpu_use_their_own_events():
    """On GPU a kept round's events stay untouched while the next round records its own."""
    import torch
    timer, rows = RoundTimer("cuda", every=1), [Seq()]
    x = torch.zeros(1 << 20, device="cuda")
    for _ in range(3):
        timer.start()
        for _ in range(20):
            x.add_(1)
        timer.mark("verify")
        timer.add_to(rows, defer=True)
        timer.flush()
    assert rows[0].metrics["verify_s"] > 0
    timer.start()
    timer.mark("verify")
    kept = timer._marks
    timer.add_to(rows, defer=True)
    timer.start()
    assert timer._marks[0][1] is not kept[0][1]


def test_host_clock_segments(monkeypatch):
    from ssdlib.engine.timing import HostClock
    rows = [Seq()]
    off = HostClock(on=False)
    off.start(), off.tick("launch"), off.add_to(rows)
    assert rows[0].metrics == {}
    clock = HostClock(on=True)
    for _ in range(2):
        clock.start()
        time.sleep(0.002)
        clock.tick("launch")
        clock.tick("read")
        clock.add_to(rows)
        time.sleep(0.001)
    m = rows[0].metrics
    assert m["h_launch_s"] >= 0.004 and "h_read_s" in m
    assert m["h_between_s"] >= 0.001  # once: from the first round's end to the second's start
    # an admission between two rounds is not "between" time
    before = m["h_between_s"]
    clock.admitted()
    time.sleep(0.01)
    clock.start()
    clock.tick("launch")
    clock.add_to(rows)
    assert m["h_between_s"] == before
