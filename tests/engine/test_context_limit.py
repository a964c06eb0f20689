"""Near the context limit SD and SSD produce exactly what AR produces before "length", not fewer
tokens."""

import pytest

from ssdlib import Generator, SamplingParams
from ssdlib.engine_config import EngineConfig
from ssdlib.errors import ConfigError

MAX_LEN = 16
# prompts of 8 tokens (7 generated before the limit, fewer than k + 1 = 6 short of it) and 14
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 9, 27, 4, 8, 16, 32, 64, 5, 25, 7, 49, 11, 21]]


@pytest.fixture(scope="module")
def ar_reference(tiny_dirs):
    with Generator(target=tiny_dirs["smol_heads"], max_len=MAX_LEN) as g:
        return g.generate(PROMPTS, SamplingParams(max_new_tokens=100, ignore_eos=True))


@pytest.mark.parametrize("kw", [dict(mode="sd"), dict(mode="sd", draft_placement="separate"),
                                dict(mode="ssd")], ids=lambda kw: "-".join(kw.values()))
def test_speculative_modes_fill_the_context_like_ar(tiny_dirs, ar_reference, kw):
    assert [len(o.token_ids) for o in ar_reference] == [MAX_LEN - 1 - len(p) for p in PROMPTS]
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   max_len=MAX_LEN, k=5, **kw) as g:
        outs = g.generate(PROMPTS, SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ar_reference]
    assert [o.finish_reason for o in outs] == ["length", "length"]


def test_k_beyond_the_position_slack_is_refused(monkeypatch):
    import ssdlib.engine_config as engine_config

    monkeypatch.setattr(engine_config, "POSITION_SLACK", 4)
    with pytest.raises(ConfigError, match="--k 5.*positions past"):
        EngineConfig(target="t", draft="d", mode="sd", k=5)
    EngineConfig(target="t", draft="d", mode="sd", k=3)
