"""Thm 12's a_p is the draft's per-token acceptance: the speculator's estimator counts the
rounds whose verified speculation the draft drafted (a cache hit, a jit draft) and not those of a
fallback's n-gram proposal or random tokens, which a verify mostly rejects at once and which
would pull a_p (and with it the fan-out's branches for late outcomes) down. Plain rounds here;
chained rounds: tests/distributed/test_stream_placement.py."""

import pytest

from ssdlib import Generator, SamplingParams
from ssdlib.speculative.fanout import FanoutEstimator

DRAFTED = ("cache", "first", "jit")  # the sources of speculations the draft drafted


@pytest.mark.parametrize("fallback", ["random", "ngram"])
def test_a_p_counts_only_the_drafts_speculations(tiny_dirs, monkeypatch, fallback):
    counted = []
    real = FanoutEstimator.observe_verify

    def observe(self, accepted, num_draft):
        counted.extend(zip(accepted, num_draft))
        real(self, accepted, num_draft)

    monkeypatch.setattr(FanoutEstimator, "observe_verify", observe)
    monkeypatch.setenv("SSDLIB_CHAINED_ROUNDS", "0")
    # a random draft: many misses, so the fallback's speculations are many
    from tests.tiny import make_tiny_llama
    draft = make_tiny_llama(str(tiny_dirs["smol_heads"]) + "-random-draft", "smol_heads", seed=5)
    with Generator(target=tiny_dirs["smol_heads"], draft=draft, mode="ssd", k=3, max_batch=2,
                   max_len=128, fallback=fallback, adaptive_k=False,
                   speculator_placement="stream") as g:
        outs = g.generate([[5, 6, 7, 8, 9], [3, 1, 4, 1, 5]],
                          SamplingParams(max_new_tokens=40, ignore_eos=True))
    by_source = {}
    for o in outs:
        for source, (rounds, tokens) in o.metrics["accepted_by_source"].items():
            t, r = by_source.get(source, (0, 0))
            by_source[source] = (t + tokens, r + rounds)
    fallback_rounds = sum(r for s, (_, r) in by_source.items() if s not in DRAFTED)
    assert fallback_rounds > 0, by_source
    drafted = [by_source.get(s, (0, 0)) for s in DRAFTED]
    # every drafted speculation's round but the last of each row (its outcome ends the row and
    # is never committed on the speculator) is counted, with its accepted tokens
    assert sum(r for _, r in drafted) - len(outs) <= len(counted) <= sum(r for _, r in drafted)
    assert sum(k for k, _ in counted) <= sum(t for t, _ in drafted)
