"""A draft vocabulary (``draft_vocab=N``): the draft's head scores only the first N tokens of its
ranking (draft_vocab.safetensors), so the draft never proposes any other; SD and SSD stay exact
(greedy equals AR, sampled output keeps the target's distribution), with a standalone draft and
with a feature draft, and the draft's logits equal the plain reference (the full head masked)."""

import shutil
from collections import Counter

import pytest
import torch

from ssdlib import Generator
from ssdlib.engine.runner.model_runner import ModelRunner
from ssdlib.layers.subset_head import reference_subset_logits
from ssdlib.loading.draft import load_draft
from ssdlib.loading.draft_vocab import draft_token_ids, write_ranking
from ssdlib.loading.feature_draft import load_feature_draft
from ssdlib.loading import load_checkpoint
from tests.engine.test_feature_draft_sd import _feature_draft
from tests.engine.test_speculative_exact import (GREEDY, PROMPTS, check_equal, exact_joint,
                                                 sample_pairs)
from tests.speculative.spec_stats import chi2_test


def _with_ranking(source: str, out, ranked: list[int]) -> str:
    """A copy of the draft directory ``source`` at ``out`` with ``ranked`` as its ranking."""
    shutil.copytree(source, out)
    ranked_t = torch.tensor(ranked, dtype=torch.int64)
    write_ranking(str(out), ranked_t, torch.arange(len(ranked), 0, -1))
    return str(out)


@pytest.fixture(scope="module")
def ar_reference(tiny_dirs):
    with Generator(target=tiny_dirs["smol_heads"], max_batch=4, max_len=128) as g:
        return [o.token_ids for o in g.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def without_favourites(tiny_dirs, ar_reference):
    """A ranking of every token but the 3 the target writes most often in the reference."""
    vocab = load_checkpoint(tiny_dirs["smol_heads"]).config.vocab_size
    favourites = {t for t, _ in Counter(t for r in ar_reference for t in r).most_common(3)}
    return [t for t in range(vocab) if t not in favourites]


@pytest.fixture(scope="module")
def ranked_draft(tiny_dirs, tmp_path_factory, without_favourites):
    return _with_ranking(tiny_dirs["smol_heads_draft"],
                         tmp_path_factory.mktemp("dv") / "draft", without_favourites)


@pytest.fixture(scope="module")
def ranked_feature_draft(tiny_dirs, tmp_path_factory, without_favourites):
    plain = _feature_draft(tiny_dirs["smol_heads"], tmp_path_factory.mktemp("fdv") / "plain")
    return _with_ranking(plain, tmp_path_factory.mktemp("fdv") / "ranked", without_favourites)


def test_the_draft_heads_logits_are_the_full_heads_masked(tiny_dirs, ranked_draft,
                                                          ranked_feature_draft):
    target_ck = load_checkpoint(tiny_dirs["smol_heads"])
    vocab = target_ck.config.vocab_size
    ids = draft_token_ids(ranked_draft, 40, vocab, target_ck.config.eos_token_ids)
    assert 40 <= ids.numel() <= 40 + len(target_ck.config.eos_token_ids)
    draft_ck = load_draft(ranked_draft, target_ck)
    full = ModelRunner(draft_ck, None, "cpu", torch.float32, 1, 64).model
    subset = ModelRunner(draft_ck, None, "cpu", torch.float32, 1, 64, head_vocab=ids).model
    x = torch.randn(3, draft_ck.config.hidden_size)
    ref = reference_subset_logits(full.lm_head(x), ids)
    got = subset.lm_head(x)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    torch.testing.assert_close(got[:, ids], ref[:, ids])
    fdraft = load_feature_draft(ranked_feature_draft, target_ck, head_vocab=ids)
    fplain = load_feature_draft(ranked_feature_draft, target_ck)
    h = torch.randn(2, 5, fdraft.config.hidden_size)
    got, ref = fdraft.logits(h), reference_subset_logits(fplain.logits(h), ids)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    torch.testing.assert_close(got[..., ids], ref[..., ids])


@pytest.fixture(scope="module")
def ranked_target_copy(tiny_dirs, tmp_path_factory, without_favourites):
    """The target itself as its draft, ranking every token but its 3 favourites."""
    return _with_ranking(tiny_dirs["smol_heads"], tmp_path_factory.mktemp("tv") / "draft",
                         without_favourites)


def test_sd_with_a_draft_vocabulary_proposes_only_its_tokens(tiny_dirs, ar_reference,
                                                             ranked_target_copy,
                                                             without_favourites):
    """The target as its own draft is accepted everywhere, but not where its vocabulary lacks
    the token: the target's favourite tokens are never proposed."""
    rates = {}
    for vocab in ("full", len(without_favourites)):
        with Generator(target=tiny_dirs["smol_heads"], draft=ranked_target_copy, mode="sd", k=4,
                       max_batch=4, max_len=128, adaptive_k=False, draft_vocab=vocab) as g:
            outs = g.generate(PROMPTS, GREEDY)
            rates[vocab] = g.last_run_metrics["acceptance_rate"]
        check_equal(tiny_dirs, ar_reference, outs)
    favourite_share = 1 - sum(t in set(without_favourites) for r in ar_reference for t in r) / \
        sum(len(r) for r in ar_reference)
    assert rates["full"] == 1.0
    assert rates[len(without_favourites)] < 1.0 - favourite_share / 2, rates


@pytest.mark.parametrize("which", ["standalone", "feature"])
def test_sd_with_a_draft_vocabulary_equals_ar(tiny_dirs, ar_reference, ranked_draft,
                                              ranked_feature_draft, without_favourites, which,
                                              monkeypatch):
    import ssdlib.engine.leader.sd_loop as sd_loop

    heads = []
    for name in ("load_feature_draft", "ModelRunner"):  # what the draft's head is, in the run
        real = getattr(sd_loop, name)

        def spy(*args, _real=real, **kw):
            made = _real(*args, **kw)
            heads.append(made.lm_head if hasattr(made, "lm_head") else made.model.lm_head)
            return made
        monkeypatch.setattr(sd_loop, name, spy)
    draft = ranked_draft if which == "standalone" else ranked_feature_draft
    with Generator(target=tiny_dirs["smol_heads"], draft=draft, mode="sd", k=4, max_batch=4,
                   max_len=128, draft_vocab=len(without_favourites)) as g:
        outs = g.generate(PROMPTS, GREEDY)
    check_equal(tiny_dirs, ar_reference, outs)
    assert [type(h).__name__ for h in heads] == ["SubsetLMHead"]
    assert heads[0].size == len(set(without_favourites) |
                                set(load_checkpoint(draft).config.eos_token_ids))


def test_sd_with_the_draft_on_its_own_rank_and_a_draft_vocabulary_equals_ar(
        tiny_dirs, ar_reference, ranked_target_copy, without_favourites):
    """The separate draft rank builds its draft with the vocabulary too: the target as its own
    draft is no longer accepted everywhere."""
    with Generator(target=tiny_dirs["smol_heads"], draft=ranked_target_copy, mode="sd",
                   draft_placement="separate", k=4, max_batch=2, max_len=128, adaptive_k=False,
                   draft_vocab=len(without_favourites)) as g:
        outs = g.generate(PROMPTS, GREEDY)
        rate = g.last_run_metrics["acceptance_rate"]
    check_equal(tiny_dirs, ar_reference, outs)
    assert rate < 0.95, rate


@pytest.mark.parametrize("placement", ["stream", "rank"])
@pytest.mark.parametrize("which", ["standalone", "feature"])
def test_ssd_with_a_draft_vocabulary_equals_ar(tiny_dirs, ar_reference, ranked_draft,
                                               ranked_feature_draft, without_favourites,
                                               placement, which):
    draft = ranked_draft if which == "standalone" else ranked_feature_draft
    with Generator(target=tiny_dirs["smol_heads"], draft=draft, mode="ssd", k=3, max_batch=3,
                   max_len=128, fan_out="2,2,1,2", speculator_placement=placement,
                   draft_vocab=len(without_favourites)) as g:
        outs = g.generate(PROMPTS, GREEDY)
    check_equal(tiny_dirs, ar_reference, outs)


@pytest.fixture(scope="module")
def small_vocab_ranked(tmp_path_factory):
    """The distribution tests' 8-token pair, the draft ranking 5 tokens (not 0, 1 or 7)."""
    from tests.tiny import make_small_vocab_pair

    t, d = make_small_vocab_pair(str(tmp_path_factory.mktemp("small_dv")), 12.0, 0.15)
    eos = load_checkpoint(t).config.eos_token_ids
    ranked = [i for i in (2, 3, 4, 5, 6) if i not in eos] + [i for i in eos if i < 8]
    return t, _with_ranking(d, tmp_path_factory.mktemp("small_dv") / "ranked", ranked[:5])


@pytest.mark.parametrize("mode,extra", [("sd", {}),
                                        ("ssd", dict(fallback="jit", saguaro_c=0.5,
                                                     fan_out="2,1,1,2"))])
def test_sampling_with_a_draft_vocabulary_keeps_the_targets_distribution(small_vocab_ranked,
                                                                         mode, extra):
    t, d = small_vocab_ranked
    with Generator(target=t, draft=d, mode=mode, k=3, max_batch=1000, max_len=32,
                   draft_vocab=5, **extra) as g:
        counts = sample_pairs(g, 0.8, 0.9, seed=2)
    assert chi2_test(counts, exact_joint(t, 0.8, 0.9)) > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["sd", "ssd"])
@pytest.mark.parametrize("which", ["standalone", "feature"])
def test_cuda_draft_vocabulary_equals_ar(tiny_dirs, ar_reference, ranked_draft,
                                         ranked_feature_draft, without_favourites, mode, which):
    """fp32 on a GPU, the draft's steps (the subset head inside them) captured in CUDA graphs,
    SSD's in chained rounds: AR's tokens."""
    draft = ranked_draft if which == "standalone" else ranked_feature_draft
    with Generator(target=tiny_dirs["smol_heads"], draft=draft, mode=mode, k=3, max_batch=4,
                   max_len=128, device="cuda", dtype="float32",
                   draft_vocab=len(without_favourites)) as g:
        outs = g.generate(PROMPTS, GREEDY)
    check_equal(tiny_dirs, ar_reference, outs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sampled_chained_rounds_with_a_draft_vocabulary_follow_the_target(
        small_vocab_ranked):
    """Sampled SSD on a GPU (chained rounds, Saguaro sampling) with a draft of 5 tokens: the
    target's distribution."""
    t, d = small_vocab_ranked
    with Generator(target=t, draft=d, mode="ssd", k=3, max_batch=1000, max_len=32,
                   saguaro_c=0.5, fan_out="2,1,1,2", device="cuda", dtype="float32",
                   draft_vocab=5) as g:
        counts = sample_pairs(g, 0.8, 0.9, seed=3)
    assert chi2_test(counts, exact_joint(t, 0.8, 0.9)) > 1e-3
