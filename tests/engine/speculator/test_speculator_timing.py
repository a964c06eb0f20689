"""The speculator's per-round phases (STATS -> the verifier's batch metrics -> the run aggregate):
the verifier sums the STATS of one call (fake link), and an SSD / separate-draft SD run on the
tiny checkpoints (spawned ranks, CPU, gloo) reports every phase of every round it answered."""

import pytest
import torch

from ssdlib import Generator, SamplingParams
from ssdlib.distributed.protocol import SPEC_PHASES, SpeculatorStats
from ssdlib.engine.leader.speculation_source import CacheSource
from ssdlib.engine.leader.verifier import LinkVerifier

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


class StatsLink:
    """Answers every outcome with the next of the given STATS."""

    vocab_size = 7
    failed = overlap = None  # a healthy link of ranks

    def __init__(self, stats):
        self.stats = list(stats)

    def send_outcome(self, msg):
        pass

    def recv_stats(self):
        return self.stats.pop(0)


def test_verifier_sums_the_stats_of_a_call_and_starts_afresh_after_a_read():
    a = SpeculatorStats(1.0, 1.0, 2, 4, 1, 4, {"push": 0.004, "build": 0.04})
    b = SpeculatorStats(3.0, 1.0, 2, 2, 1, 6, {"push": 0.001, "build": 0.01})
    c = SpeculatorStats(0.0, 1.0, 0, 0, 0, 2, {"build": 0.002})
    ver = LinkVerifier(None, StatsLink([a, b, c]), 3, torch.device("cpu"), CacheSource(3, 7))
    for slot in (0, 1):  # one row at a time: the batch empties twice in one call
        ver._leaving = [slot]
        ver.settle()
    m = ver.batch_metrics()
    assert m["speculator_rounds"] == 10
    assert m["speculator_ms_per_round"] == pytest.approx(
        {"commit": 0.0, "fallback": 0.0, "send": 0.0, "build": 5.0, "push": 0.5})
    assert m["speculator_idle_frac"] == pytest.approx(4 / 6)
    assert m["branch_kv_reused_frac"] == pytest.approx(0.5)
    m["speculator_ms_per_round"]["build"] = -1.0  # each read is a copy
    assert ver.batch_metrics()["speculator_ms_per_round"]["build"] == pytest.approx(5.0)
    ver._leaving = [0]
    ver.settle()  # the next call's first STATS: the read ones are not added again
    m = ver.batch_metrics()
    assert m["speculator_rounds"] == 2 and m["speculator_ms_per_round"]["build"] == 1.0


@pytest.mark.parametrize("mode,extra", [("ssd", {}), ("sd", {"draft_placement": "separate"})])
def test_run_reports_the_speculators_phases(tiny_dirs, mode, extra, monkeypatch):
    # plain rounds: every round an OUTCOME (chained rounds skip the speculator's round)
    monkeypatch.setenv("SSDLIB_CHAINED_ROUNDS", "0")
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   mode=mode, k=4, max_batch=1, max_len=128, **extra) as g:
        outs = g.generate(PROMPTS, GREEDY)
        run = g.last_run_metrics
    ms = run["speculator_ms_per_round"]
    assert set(ms) == set(SPEC_PHASES) and all(v >= 0 for v in ms.values()), ms
    assert ms["fallback"] > 0  # first speculations are drafted just in time
    if mode == "ssd":
        assert ms["build"] > 0 and ms["push"] > 0
    else:  # no cache: nothing built or pushed
        assert ms["build"] == ms["push"] == 0
    # b = 1: the speculator answers each sequence's admission and every round but its last
    # (answered with STATS), as many as the verifier's rounds, over both sequences
    assert run["rounds"] == sum(o.metrics["rounds"] for o in outs) > len(PROMPTS)
    assert run["speculator_rounds"] >= run["rounds"]
    assert run["speculator_rounds"] == run["rounds"]
    assert all(o.metrics["speculator_ms_per_round"] == ms for o in outs)
    assert "speculator_host_ms_per_round" not in run  # SSDLIB_HOST_TIMES is off


def test_host_times_of_both_ranks(tiny_dirs, monkeypatch):
    """SSDLIB_HOST_TIMES=1: the verifier's host-clock segments per round (h_*_s metrics) and the
    speculator's (STATS -> speculator_host_ms_per_round)."""
    from ssdlib.distributed.protocol import SPEC_HOST_SEGMENTS
    monkeypatch.setenv("SSDLIB_HOST_TIMES", "1")  # inherited by the spawned ranks
    monkeypatch.setenv("SSDLIB_CHAINED_ROUNDS", "0")  # a plain round's segments
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   mode="ssd", k=4, max_batch=1, max_len=128) as g:
        g.generate(PROMPTS, GREEDY)
        run = g.last_run_metrics
    for seg in ("launch", "read", "commit", "cache", "exchange", "timer", "between"):
        assert run[f"h_{seg}_s"] >= 0
    assert run["h_launch_s"] > 0 and run["h_read_s"] > 0
    host = run["speculator_host_ms_per_round"]
    assert set(host) == set(SPEC_HOST_SEGMENTS)
    assert host["commit"] > 0 and host["build"] > 0 and host["end"] >= 0
