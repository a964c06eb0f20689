"""Batched target distributions and sampling against the per-row rule.

The reference is the per-row loop the engine used before batching: ``target_probs`` for each
sampled row, a one-hot on the argmax for each greedy row, ``torch.multinomial``-free sampling
with the row's own uniform. Seeded runs are reproducible and a row's tokens do not depend on the
other rows of its batch (AR and SD in this process).
"""

from types import SimpleNamespace

import pytest
import torch

from ssdlib import Generator
from ssdlib.engine.sampler import (row_distributions, sample_branches, sample_rows,
                                   sample_tokens, sampling_tensors)
from ssdlib.sampling import SamplingParams, one_hot, row_streams, target_probs
from ssdlib.speculative.rng import RowStreams, sample_categorical
from ssdlib.speculative.saguaro import saguaro_q
from tests.speculative.spec_stats import chi2_test

P = SamplingParams
PARAMS = [
    P(), P(temperature=1.0), P(temperature=0.7), P(temperature=0.05), P(temperature=3.0),
    P(temperature=0.8, top_k=1), P(temperature=0.8, top_k=3), P(temperature=1.2, top_k=40),
    P(temperature=1.0, top_k=10_000), P(temperature=0.9, top_p=0.9), P(temperature=1.0, top_p=1e-6),
    P(temperature=1.0, top_p=0.5), P(temperature=0.6, top_k=5, top_p=0.8), P(),
    P(temperature=1.0, top_p=0.999999),
]


def reference(logits, params):
    """The per-row rule: logits [b, ..., V] -> [b, ..., V] float32."""
    out = []
    for row, p in zip(logits, params):
        if p.greedy:
            out.append(torch.zeros(row.shape).scatter_(-1, row.argmax(-1, keepdim=True), 1.0))
        else:
            out.append(target_probs(row, p.temperature, p.top_k, p.top_p))
    return torch.stack(out)


def rows(params, seed=0):
    streams = row_streams(seed, len(params))
    return [SimpleNamespace(params=p, stream=s) for p, s in zip(params, streams)]


def random_logits(seed, shape, ties):
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: ties at the argmax, at the k-th value and at the top-p cut
        return torch.randint(-3, 3, shape, generator=g).float()
    return torch.randn(shape, generator=g) * 3


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("shape", [(40,), (3, 40), (2, 1000)])
@pytest.mark.parametrize("seed", range(3))
def test_distributions_equal_the_per_row_rule(seed, shape, ties):
    params = [PARAMS[(seed * 5 + i) % len(PARAMS)] for i in range(len(PARAMS))]
    logits = random_logits(seed, (len(params), *shape), ties)
    got = row_distributions(logits, rows(params))
    assert got.dtype == torch.float32
    assert torch.equal(got, reference(logits, params))


def test_top_p_edges():
    """Equal probabilities: cumulative mass lands exactly on top_p, ties break to the lower id."""
    logits = torch.zeros(6, 8)                                       # p = 1/8 each, exactly
    params = [P(temperature=1.0, top_p=t) for t in (0.125, 0.25, 0.5, 0.5000001, 1.0, 1e-9)]
    got = row_distributions(logits, rows(params))
    assert torch.equal(got, reference(logits, params))
    kept = (got > 0).sum(-1).tolist()
    assert kept == [1, 2, 4, 5, 8, 1]
    assert (got[:, 0] > 0).all()                                     # lowest ids kept first
    # a float32 top_p of 0.9 against a cumulative sum that reaches it through rounding
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    for t in (0.7, 0.9, 0.3, 0.4):
        prm = [P(temperature=1.0, top_p=t)]
        assert torch.equal(row_distributions(logits, rows(prm)), reference(logits, prm))


def test_greedy_rows_are_argmax_and_one_hot():
    logits = random_logits(1, (len(PARAMS), 50), ties=True)
    r = rows(PARAMS)
    tokens = sample_rows(logits, r)
    best = logits.argmax(-1).tolist()
    for i, p in enumerate(PARAMS):
        if p.greedy:
            assert tokens[i] == best[i]
        elif p.top_k == 1:  # top-1 keeps every token tied at the maximum
            assert logits[i, tokens[i]] == logits[i].max()
    # an all-greedy batch draws nothing
    g = rows([P(), P()])
    assert sample_rows(logits[:2], g) == best[:2] and g[0].stream.counter == 0


def test_one_hot_is_a_point_mass_on_each_token():
    tokens = torch.tensor([[3, 0, 7], [7, 7, 1]])
    q = one_hot(tokens, 9)
    assert q.shape == (2, 3, 9) and q.dtype == torch.float32
    assert torch.equal(q.argmax(-1), tokens) and torch.equal(q.sum(-1), torch.ones(2, 3))


def test_sample_rows_draws_one_uniform_per_row_by_inverse_cdf():
    logits = random_logits(2, (len(PARAMS), 30), ties=False)
    r = rows(PARAMS, seed=4)
    before = [x.stream.counter for x in r]
    tokens = sample_tokens(logits, r)
    assert [x.stream.counter for x in r] == [c + 1 for c in before]
    u = RowStreams.reserve(row_streams(4, len(PARAMS)), 1).uniforms(1)[:, 0]
    expect = sample_categorical(reference(logits, PARAMS), u)
    assert torch.equal(tokens, expect)


def test_sample_rows_has_the_target_distribution():
    """20k rows with the same logits and distinct streams: the tokens follow target_probs."""
    n = 20_000
    logits = torch.randn(12, generator=torch.Generator().manual_seed(0)) * 2
    p = P(temperature=0.8, top_k=8, top_p=0.9)
    tokens = sample_tokens(logits.expand(n, 12), rows([p] * n))
    expect = target_probs(logits, 0.8, 8, 0.9)
    assert chi2_test(torch.bincount(tokens, minlength=12), expect) > 1e-3


def test_a_row_is_independent_of_its_batch():
    logits = random_logits(3, (len(PARAMS), 30), ties=False)
    full = sample_rows(logits, rows(PARAMS, seed=8))
    streams = row_streams(8, len(PARAMS))
    for i, (p, s) in enumerate(zip(PARAMS, streams)):
        one = [SimpleNamespace(params=p, stream=s)]
        assert sample_rows(logits[i:i + 1], one) == [full[i]]


def test_sample_branches_matches_per_row_saguaro():
    """The speculator's branch sampling: per row, q = sigma_{F,C}(row distribution) on sampled
    rows (one-hot on greedy rows), token = inverse CDF with the row's B uniforms in order."""
    b, B, V, F, C = 4, 5, 20, 2, 0.4
    params = [P(temperature=0.9, top_p=0.9), P(), P(temperature=1.3, top_k=6), P()]
    logits = random_logits(5, (b, B, V), ties=False)
    r = rows(params, seed=2)
    st = sampling_tensors(r, "cpu")
    u = RowStreams.reserve([x.stream for x in r], B).uniforms(B)     # [b, B]
    tokens, q = sample_branches(logits, st, u, F, C)
    ref = reference(logits, params)
    for i, p in enumerate(params):
        if p.greedy:
            assert torch.equal(q[i], ref[i]) and torch.equal(tokens[i], logits[i].argmax(-1))
        else:
            qi = saguaro_q(ref[i], F, C)
            assert torch.allclose(q[i], qi)
            assert torch.equal(tokens[i], sample_categorical(q[i], u[i]))


# ---- end to end: reproducible, and a row's tokens do not depend on its batch ------------------
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23], [40, 41]]


def run(tiny_dirs, mode, prompts, params, max_batch):
    kw = dict(draft=tiny_dirs["smol_heads_draft"], k=3) if mode == "sd" else {}
    with Generator(target=tiny_dirs["smol_heads"], mode=mode, max_batch=max_batch, max_len=96,
                   **kw) as g:
        return [o.token_ids for o in g.generate(prompts, params)]


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_seeded_runs_reproducible_and_batch_independent(tiny_dirs, mode):
    params = [P(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=1, ignore_eos=True),
              P(max_new_tokens=16, ignore_eos=True),
              P(max_new_tokens=12, temperature=0.7, top_k=20, seed=2, ignore_eos=True),
              P(max_new_tokens=16, temperature=1.5, seed=3, ignore_eos=True)]
    full = run(tiny_dirs, mode, PROMPTS, params, max_batch=4)
    assert run(tiny_dirs, mode, PROMPTS, params, max_batch=4) == full
    # the first request alone, and all of them through one slot (a different batch each round)
    assert run(tiny_dirs, mode, PROMPTS[:1], params[:1], max_batch=1) == full[:1]
    assert run(tiny_dirs, mode, PROMPTS, params, max_batch=1) == full
    other = run(tiny_dirs, mode, PROMPTS[:1], [P(max_new_tokens=16, temperature=1.0, top_p=0.95,
                                                  seed=7, ignore_eos=True)], max_batch=1)
    assert other != full[:1]
