"""Adaptive K's measured costs come from greedy rounds only: only greedy rows decide on them
(sampled rows decide on the priors), and a sampled round may run other steps (a feature draft's
sampled proposal runs eagerly, many times its captured greedy one), which must not make greedy
rows stop drafting."""

import pytest

from ssdlib import Generator, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23]]


@pytest.mark.parametrize("mode,kw", [
    ("sd", {}), ("ssd", {"speculator_placement": "stream"}),
    ("ssd", {"speculator_placement": "rank"})])
def test_costs_are_learnt_from_greedy_rounds_only(tiny_dirs, monkeypatch, mode, kw):
    # the stream placement's rounds through the host (chained rounds learn no costs)
    monkeypatch.setenv("SSDLIB_CHAINED_ROUNDS", "0")
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   mode=mode, k=3, max_batch=3, max_len=96, **kw) as g:
        g.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=1.0, seed=3,
                                           ignore_eos=True))
        costs = g.last_run_metrics["k_costs"]
        assert costs["draft_step_ms"] is None and costs["round_ms_by_k"] == {}, costs
        g.generate(PROMPTS, SamplingParams(max_new_tokens=16, ignore_eos=True))
        costs = g.last_run_metrics["k_costs"]
        assert costs["round_ms_by_k"], costs  # the greedy rounds' times were learnt
