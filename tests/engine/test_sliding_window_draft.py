"""A draft with a sliding attention window (config ``sliding_window``; the default draft has one)
keeps SD and SSD exact on prompts longer than its window: greedy output equals AR token for
token, on the plain path and on the captured-step path (run eagerly on CPU), where the window
reaches the draft's steps through ``slot_attention``'s ``kv_start``."""

import json
import os
import shutil

import pytest
import torch

from ssdlib import Generator, SamplingParams

WINDOW = 128
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def windowed_draft(tiny_dirs, tmp_path_factory):
    """The close draft of the tiny target, with a window shorter than the prompts."""
    out = str(tmp_path_factory.mktemp("windowed_draft"))
    shutil.copytree(tiny_dirs["smol_heads_draft"], out, dirs_exist_ok=True)
    return with_window(out)


def with_window(draft: str) -> str:
    """The checkpoint directory ``draft``, its config.json given a window of WINDOW (Mistral)."""
    path = os.path.join(draft, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(sliding_window=WINDOW, model_type="mistral", architectures=["MistralForCausalLM"])
    with open(path, "w") as f:
        json.dump(cfg, f)
    return draft


@pytest.fixture(scope="module")
def long_prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 90, (n,), generator=g).tolist() for n in (150, 171, 133)]


@pytest.fixture(scope="module")
def ar_long(tiny_dirs, long_prompts):
    with Generator(target=tiny_dirs["smol_heads"], max_batch=3, max_len=224) as g:
        return [o.token_ids for o in g.generate(long_prompts, GREEDY)]


@pytest.mark.parametrize("mode,kw,path", [
    ("sd", {}, None),
    ("ssd", {"speculator_placement": "stream", "fallback": "jit"}, None),
    ("sd", {}, "eager-all"),
    ("ssd", {"speculator_placement": "stream", "fallback": "jit"}, "eager-all")])
def test_greedy_equals_ar_with_a_windowed_draft(tiny_dirs, windowed_draft, long_prompts, ar_long,
                                                monkeypatch, mode, kw, path):
    if path:
        monkeypatch.setenv("SSDLIB_STEP_GRAPHS", path)
    with Generator(target=tiny_dirs["smol_heads"], draft=windowed_draft, mode=mode, k=4,
                   max_batch=3, max_len=224, adaptive_k=False, **kw) as g:
        outs = g.generate(long_prompts, GREEDY)
    assert [o.token_ids for o in outs] == ar_long
    assert all(o.metrics["rounds"] < 24 for o in outs)  # the draft was accepted now and then


def test_the_window_reaches_the_engines_draft(tiny_dirs, windowed_draft, long_prompts):
    """The windowed draft proposes other tokens than the same weights without a window once the
    context is longer than the window (so the engine really runs it windowed)."""
    def acceptance(draft):
        with Generator(target=tiny_dirs["smol_heads"], draft=draft, mode="sd", k=4, max_batch=3,
                       max_len=224, adaptive_k=False) as g:
            outs = g.generate(long_prompts, GREEDY)
        return [o.metrics["accepted"] for o in outs]

    assert acceptance(windowed_draft) != acceptance(tiny_dirs["smol_heads_draft"])


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    """A target with room for prompts past the windowed draft's reach (2 layers x 127), and its
    close draft with a window of 128."""
    from tests.tiny import make_noisy_draft, make_tiny_llama

    root = tmp_path_factory.mktemp("reach")
    target = make_tiny_llama(str(root / "t"), "smol_heads", scale=2.0,
                             max_position_embeddings=1024)
    draft = with_window(make_noisy_draft(target, str(root / "d"), 0.03))
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (300, 341)]
    with Generator(target=target, max_batch=2, max_len=420) as gen:
        ar = [o.token_ids for o in gen.generate(prompts, GREEDY)]
    return target, draft, prompts, ar


@pytest.mark.parametrize("mode,kw,path", [
    ("sd", {}, None),
    ("ssd", {"speculator_placement": "stream", "fallback": "jit"}, None),
    ("sd", {}, "eager-all")])
def test_greedy_equals_ar_past_the_draft_s_reach(long_pair, monkeypatch, mode, kw, path):
    """Prompts longer than the draft's reach: its prefill feeds only their last positions
    (``Drafter.first_read`` > 0), and greedy SD and SSD still equal AR token for token."""
    from ssdlib.engine.drafter import Drafter

    target, draft, prompts, ar = long_pair
    if path:
        monkeypatch.setenv("SSDLIB_STEP_GRAPHS", path)
    cuts = []
    real = Drafter.first_read

    def spy(self, n):
        start = real(self, n)
        cuts.append(start)
        return start
    monkeypatch.setattr(Drafter, "first_read", spy)
    with Generator(target=target, draft=draft, mode=mode, k=4, max_batch=2, max_len=420,
                   adaptive_k=False, **kw) as g:
        outs = g.generate(prompts, GREEDY)
    assert max(cuts) > 0  # the prefill was cut
    assert [o.token_ids for o in outs] == ar
    assert all(o.metrics["rounds"] < 24 for o in outs)  # the draft was accepted now and then
