"""Sequences that end on their first token (EOS first, max_new_tokens=1) in every mode: they
leave before any round, next to rows that keep decoding."""

import pytest

from ssdlib import Generator, SamplingParams
from tests.eos_first import find_eos_first_prompt


@pytest.fixture(scope="module")
def eos_first_prompt(tiny_dirs):
    prompt = find_eos_first_prompt(tiny_dirs["smol_heads"])
    if prompt is None:
        pytest.skip("no EOS-first prompt found for the tiny target")
    return prompt


MODES = [dict(mode="ar"), dict(mode="sd"), dict(mode="sd", draft_placement="separate"),
         dict(mode="ssd", fallback="jit", speculator_placement="stream"),
         dict(mode="ssd", fallback="ngram", speculator_placement="stream"),
         dict(mode="ssd", fallback="jit", speculator_placement="rank")]


@pytest.mark.parametrize("kw", MODES, ids=lambda kw: "-".join(kw.values()))
def test_rows_ending_on_their_first_token(tiny_dirs, eos_first_prompt, kw):
    long = SamplingParams(max_new_tokens=12)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], eos_first_prompt, [10, 11, 12], [3, 9, 27], eos_first_prompt]
    params = [long, long, one, long, one]
    draft = None if kw["mode"] == "ar" else tiny_dirs["smol_heads_draft"]
    with Generator(target=tiny_dirs["smol_heads"], max_batch=3, max_len=64, k=4, **kw,
                   **({"draft": draft} if draft else {})) as g:
        outs = g.generate(prompts, params)
    with Generator(target=tiny_dirs["smol_heads"], max_batch=3, max_len=64) as g:
        ref = g.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert outs[1].token_ids == [] and outs[1].finish_reason == "eos"
    assert len(outs[2].token_ids) == 1 and outs[2].finish_reason == "length"
    if kw["mode"] != "ar":
        # a row that never had a round reports no acceptance (it drafted nothing)
        for i in (1, 2, 4):
            assert outs[i].metrics.get("drafted", 0) == 0, outs[i].metrics
