"""SSDLIB_Q_AFTER_BUILD=1: the speculator sends a sampling SPEC's q once its cache build is
launched instead of before it. The messages and every random draw are the same, so sampled and
greedy rows give the same tokens with it as without it (CPU, gloo)."""

import pytest

from ssdlib import Generator, SamplingParams
from ssdlib.engine.speculator.outcomes import q_after_build
from ssdlib.errors import ConfigError

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23], [40, 41]]


def _run(tiny_dirs):
    sampled = SamplingParams(max_new_tokens=20, temperature=1.0, seed=5, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=20, ignore_eos=True)
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   mode="ssd", k=3, max_batch=2, max_len=128, fallback="jit", device="cpu") as g:
        outs = g.generate(PROMPTS, [sampled, greedy, sampled, sampled])
        return [o.token_ids for o in outs], g.last_run_metrics


def test_same_tokens_with_q_after_build(tiny_dirs, monkeypatch):
    monkeypatch.setenv("SSDLIB_Q_AFTER_BUILD", "0")
    before, run_before = _run(tiny_dirs)
    monkeypatch.setenv("SSDLIB_Q_AFTER_BUILD", "1")
    after, run_after = _run(tiny_dirs)
    assert after == before
    assert run_after["acceptance_rate"] == run_before["acceptance_rate"]
    assert run_after["hit_rate"] == run_before["hit_rate"] and run_after["hit_rate"] > 0


def test_bad_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SSDLIB_Q_AFTER_BUILD", "2")
    with pytest.raises(ConfigError, match="SSDLIB_Q_AFTER_BUILD must be 0 or 1"):
        q_after_build()
    monkeypatch.setenv("SSDLIB_Q_AFTER_BUILD", "1")
    assert q_after_build() is True
