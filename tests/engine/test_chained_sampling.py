"""Sampled chained rounds (``engine/leader/chained_rounds.py``): whole sequences drawn by SSD
in chained rounds follow the target's distribution.

The first tokens' joint (``test_speculative_exact``) mostly comes from a chain's first round,
a plain one; the chained rounds commit the tokens after it. So the test here is over every
token of longer sequences: the randomized probability integral transform of token t_i,
u_i = F_i(t_i - 1) + U * p_i(t_i) (F_i the CDF of the exact AR distribution given the prefix,
U uniform), is uniform on [0, 1) and independent across positions and sequences exactly when the
sequences are drawn from the AR distribution (Rosenblatt's transform). A chi-square test of the
pooled values' histogram against the uniform is then an exact test of the sequences' law.
"""

from __future__ import annotations

import pytest
import torch

from ssdlib import Generator, SamplingParams
from ssdlib.sampling import target_probs
from tests.speculative.spec_stats import chi2_test

PROMPT = [3, 1, 4]
N_SEQS, NEW, BINS = 320, 10, 16
TEMPERATURE, TOP_P = 0.9, 0.95


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    from tests.tiny import make_small_vocab_pair

    # spread-out distributions and a draft that differs: a wrong q shows (the power test)
    return make_small_vocab_pair(str(tmp_path_factory.mktemp("chained_sampling")), 4.0, 0.5)


def pit_values(target_dir, sequences: list[list[int]], top_k: int = 0,
               seed: int = 0) -> torch.Tensor:
    """The randomized PIT of every generated token under the exact AR distribution."""
    from ssdlib.loading import load_checkpoint
    from ssdlib.models.llama import LlamaForCausalLM

    ck = load_checkpoint(target_dir)
    m = LlamaForCausalLM(ck.config, None, 64)
    m.load_weights(ck.weights)
    ids = torch.tensor([PROMPT + s for s in sequences])                       # [N, P + NEW]
    with torch.no_grad():
        logits = m.forward_full(ids)[:, len(PROMPT) - 1:-1]                   # [N, NEW, V]
    p = target_probs(logits.reshape(-1, logits.shape[-1]), TEMPERATURE, top_k, TOP_P).double()
    tok = ids[:, len(PROMPT):].reshape(-1, 1)
    below = (p.cumsum(-1) - p).gather(1, tok).squeeze(1)                      # F(t - 1)
    at = p.gather(1, tok).squeeze(1)
    u = torch.rand(at.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return below + u * at


def uniform_p_value(u: torch.Tensor) -> float:
    counts = torch.histc(u.float(), bins=BINS, min=0.0, max=1.0)
    return chi2_test(counts, torch.full((BINS,), 1.0 / BINS))


def sample_chained(target, draft, device="cpu", top_k: int = 0, fan_out="2,1,1,2", **kw):
    params = SamplingParams(max_new_tokens=NEW, temperature=TEMPERATURE, top_p=TOP_P, top_k=top_k,
                            seed=5, ignore_eos=True)
    with Generator(target=target, draft=draft, mode="ssd", k=3, max_batch=4, max_len=64,
                   fan_out=fan_out, speculator_placement="stream", device=device,
                   dtype="float32", **kw) as g:
        outs = g.generate([PROMPT] * N_SEQS, params)
    chained = sum(o.metrics.get("chained_rounds", 0) for o in outs)
    rounds = sum(o.metrics["rounds"] for o in outs)
    return [o.token_ids for o in outs], chained / rounds


@pytest.mark.parametrize("saguaro_c,top_k", [(1.0, 0), (0.5, 5)])
def test_sampled_chained_rounds_follow_the_target(small_vocab, saguaro_c, top_k):
    t, d = small_vocab
    seqs, share = sample_chained(t, d, top_k=top_k, saguaro_c=saguaro_c)
    assert share > 0.4  # most rounds were chained
    assert uniform_p_value(pit_values(t, seqs, top_k)) > 1e-3


def test_sampled_chained_builds_of_a_smaller_budget_follow_the_target(small_vocab, monkeypatch):
    """Chained builds of fewer branches than the cache holds (the tuned budget's smallest arm,
    every chained build here: ``speculative/fanout_budget.py``): each branch token's q is the
    one it was drawn from, and the cache's other branches are never hits."""
    from ssdlib.speculative.fanout_budget import BudgetTuner

    taken = []

    def smallest(self):
        taken.append(self.arms[-1])
        return self.arms[-1]

    monkeypatch.setattr(BudgetTuner, "next_budget", smallest)
    t, d = small_vocab
    seqs, share = sample_chained(t, d, fan_out="auto", fan_out_budget=8, saguaro_c=0.5)
    assert share > 0.4 and taken and set(taken) == {4}
    assert uniform_p_value(pit_values(t, seqs)) > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sampled_chained_rounds_follow_the_target(small_vocab):
    """The same on a GPU: the chained verify and build as captured steps on two streams."""
    t, d = small_vocab
    seqs, share = sample_chained(t, d, device="cuda", saguaro_c=0.5)
    assert share > 0.4
    assert uniform_p_value(pit_values(t, seqs)) > 1e-3


def test_a_chained_verify_that_ignores_the_cached_q_is_detected(small_vocab, monkeypatch):
    """Verifying a hit's tokens against a flat q instead of the one they were drawn from (the
    cache's) must fail the same test (the test has power)."""
    import ssdlib.engine.leader.chained_rounds as chained

    real = chained.verify_chained

    def flat_q(spec, logits, hit, q_cached, table, facts, streams):
        return real(spec, logits, hit, torch.ones_like(q_cached), table, facts, streams)

    monkeypatch.setattr(chained, "verify_chained", flat_q)
    t, d = small_vocab
    seqs, share = sample_chained(t, d)
    assert share > 0.4
    assert uniform_p_value(pit_values(t, seqs)) < 1e-3


def test_hostile_sampling_values_in_chained_rounds(tiny_dirs):
    """Extreme parameters through the chained steps: a top_p of 1e-300 keeps only the most
    likely token (the output is greedy AR's), a huge temperature and top_k run and give tokens
    of the vocabulary."""
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41]]
    kw = dict(target=tiny_dirs["smol_heads"], max_batch=4, max_len=128)
    greedy = SamplingParams(max_new_tokens=16, ignore_eos=True)
    with Generator(**kw) as g:
        ar = [o.token_ids for o in g.generate(prompts, greedy)]
        vocab = g.model_config.vocab_size
    nucleus = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=1e-300, seed=1,
                             ignore_eos=True)
    wild = SamplingParams(max_new_tokens=16, temperature=1e4, top_k=2**40, seed=2,
                          ignore_eos=True)
    with Generator(draft=tiny_dirs["smol_heads_draft"], mode="ssd", k=3,
                   speculator_placement="stream", **kw) as g:
        outs = g.generate(prompts, nucleus)
        assert sum(o.metrics.get("chained_rounds", 0) for o in outs) > 0
        assert [o.token_ids for o in outs] == ar
        outs = g.generate(prompts, wild)
    assert all(len(o.token_ids) == 16 and all(0 <= t < vocab for t in o.token_ids)
               for o in outs)
