"""ssdlib.generator.run_metrics: the run aggregate of per-output metrics (no model needed)."""

import pytest

from ssdlib.engine.leader.sequence import Output
from ssdlib.generator import is_phase_key, run_metrics


def out(index, tokens, prefill_s, decode_s, **metrics):
    m = dict(tokens=tokens, prefill_s=prefill_s, decode_s=decode_s,
             total_s=prefill_s + decode_s, decode_tok_s=(tokens - 1) / decode_s, **metrics)
    return Output(index, list(range(tokens)), "", "length", m, prompt_tokens=4)


def test_decode_tok_s_is_wall_clock_under_continuous_batching():
    # 8 sequences through 2 slots: four waves of 1 s each, every sequence makes 101 tokens
    # (1 from its prefill, 100 from decode rounds); the first token comes after 0.1 s
    outs = [out(i, 101, 0.1, 0.9) for i in range(8)]
    run = run_metrics(outs, wall_s=4.1)
    # 800 decode tokens in the 4.0 s from the first token to the end of the call; the old
    # definition divided them by one sequence's 0.9 s of decode (889 tok/s)
    assert run["decode_tok_s"] == pytest.approx(800 / 4.0)
    assert run["ttft_s"] == pytest.approx(0.1)
    assert run["tok_s"] == pytest.approx(808 / 4.1)
    assert run["decode_tok_s"] <= run["tokens"] / (run["wall_s"] - run["ttft_s"])


def test_ttft_is_the_first_admitted_sequence():
    # outputs in any order: the first sequence is the lowest index (requests admitted in order)
    outs = [out(1, 11, 0.01, 1.0), out(0, 11, 0.5, 1.0)]
    run = run_metrics(outs, wall_s=2.5)
    assert run["ttft_s"] == pytest.approx(0.5)
    assert run["decode_tok_s"] == pytest.approx(20 / 2.0)


def test_single_sequence_matches_its_own_decode_rate():
    o = out(0, 51, 0.2, 1.0)
    run = run_metrics([o], wall_s=1.2)
    assert run["decode_tok_s"] == pytest.approx(o.metrics["decode_tok_s"])


def test_phase_times_are_summed_generically():
    outs = [out(0, 11, 0.1, 1.0, rounds=10, draft_s=0.2, verify_s=0.5, host_s=0.1),
            out(1, 6, 0.1, 0.5, rounds=5, draft_s=0.1, verify_s=0.25, cache_build_s=0.05)]
    run = run_metrics(outs, wall_s=1.1)
    assert run["rounds"] == 15
    assert run["draft_s"] == pytest.approx(0.3)
    assert run["verify_s"] == pytest.approx(0.75)
    assert run["host_s"] == pytest.approx(0.1)  # a key only some outputs have
    assert run["cache_build_s"] == pytest.approx(0.05)
    assert run["prefill_s"] == pytest.approx(0.1)  # a span: the longest, not summed
    assert "total_s" not in run and "decode_s" not in run
    phases = sorted(k for k in run if is_phase_key(k))
    assert phases == ["cache_build_s", "draft_s", "host_s", "verify_s"]


def test_empty_run():
    run = run_metrics([], wall_s=0.0)
    assert run["tokens"] == 0 and run["decode_tok_s"] == 0.0 and run["rounds"] == 0


def test_speculator_rounds_are_per_call_not_summed():
    ms = {"commit": 0.1, "lookup": 0.2, "fallback": 1.0, "send": 0.1, "build": 2.0}
    outs = [out(i, 11, 0.1, 1.0, rounds=10, speculator_rounds=20, speculator_ms_per_round=ms)
            for i in range(2)]
    outs.append(out(2, 11, 0.1, 1.0, rounds=10))  # an output without them (e.g. cancelled)
    run = run_metrics(outs, wall_s=3.0)
    assert run["speculator_rounds"] == 20 and run["speculator_ms_per_round"] == ms
    assert run["speculator_ms_per_round"] is not ms  # a copy, not the output's dict
    assert not any(is_phase_key(k) for k in run if k.startswith("speculator"))
    assert "speculator_rounds" not in run_metrics([out(0, 11, 0.1, 1.0)], wall_s=1.0)
