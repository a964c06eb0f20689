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
