"""Statistical exactness: speculate + verify must reproduce the target's distribution.

A tiny "model" is a pair of tables p(x | previous token) and q(x | previous token) over a small
vocabulary. Each of N rows (all in one batch, one shared generator -- the vectorised form of the
rng convention -- or each row's own stream) drafts K tokens, verifies them, and starts a second
round from its last committed token, until it holds at least two tokens. The empirical law of the
first two output tokens must equal p(x1 | x0) p(x2 | x1), computed exactly; deliberately wrong
verifiers must fail the same test.
"""

import pytest
import torch

from ssdlib.sampling import row_streams, target_probs
from ssdlib.speculative import DraftQ, QKind, saguaro_q, verify_sampled
from ssdlib.speculative.rng import RowStreams, sample_token

from .spec_stats import chi2_test

V, X0, N = 10, 3, 40_000
PASS, FAIL = 1e-3, 1e-6


def tables(seed, sharpness=2.0):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(V, V, generator=g, dtype=torch.float64) * sharpness
    draft_logits = target_logits + torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5
    return target_logits, torch.softmax(draft_logits, -1)


def dense_proposer(q_table, fan_out=0, c=1.0, declare_raw=False):
    """Autoregressive draft from q_table (Saguaro-scaled when c < 1). declare_raw: hand the
    verifier the unscaled q -- the bug of wrong verifier (a)."""
    def propose(last, K, gen):
        prev, tokens, qs = last, [], []
        for _ in range(K):
            q = saguaro_q(q_table[prev], fan_out, c)                # [n, V]
            prev = sample_token(q, gen)
            tokens.append(prev)
            qs.append(q)
        tokens = torch.stack(tokens, 1)                             # [n, K]
        if declare_raw:
            prevs = torch.cat([last[:, None], tokens[:, :-1]], 1)
            return tokens, DraftQ.from_probs(q_table[prevs])
        return tokens, DraftQ.from_probs(torch.stack(qs, 1))
    return propose


def onehot_proposer(mapping):
    """Deterministic proposer (like n-gram lookup): next = mapping[prev]."""
    def propose(last, K, gen):
        prev, tokens = last, []
        for _ in range(K):
            prev = mapping[prev]
            tokens.append(prev)
        return torch.stack(tokens, 1), DraftQ.onehot(len(last))
    return propose


def uniform_proposer(last, K, gen):
    return torch.randint(V, (len(last), K), generator=gen), DraftQ.uniform(len(last))


def mixed_proposer(q_table, mapping):
    """Rows 0 mod 3 dense, 1 mod 3 one-hot, 2 mod 3 uniform -- one DraftQ for the whole batch."""
    dense, onehot = dense_proposer(q_table), onehot_proposer(mapping)

    def propose(last, K, gen):
        n = len(last)
        kind = torch.arange(n) % 3
        t_dense, q_dense = dense(last, K, gen)
        t_onehot, _ = onehot(last, K, gen)
        t_unif, _ = uniform_proposer(last, K, gen)
        tokens = torch.where((kind == 0)[:, None], t_dense,
                             torch.where((kind == 1)[:, None], t_onehot, t_unif))
        kinds = torch.tensor([QKind.DENSE, QKind.ONEHOT, QKind.UNIFORM])[kind]
        return tokens, DraftQ.per_row(kinds, q_dense.probs)
    return propose


def first_two_tokens(p_table, propose, K, n=N, seed=0, ragged=False, verify_table=None,
                     per_row=False, verify=verify_sampled):
    """Counts [V, V] of the first two committed tokens over n rows.

    ragged: each row verifies a random number 0..K of its draft tokens (num_draft < K).
    verify_table: the p handed to the verifier if it differs from the true target (wrong verifier).
    """
    gen = torch.Generator().manual_seed(seed)
    streams = row_streams(seed, n) if per_row else None
    verify_table = p_table if verify_table is None else verify_table
    last = torch.full((n,), X0)
    out = torch.full((n, 2), -1)
    have = torch.zeros(n, dtype=torch.long)
    rows = torch.arange(n)
    while bool((have < 2).any()):
        tokens, q = propose(last, K, gen)                           # [n, K]
        contexts = torch.cat([last[:, None], tokens], 1)            # [n, K+1]: token before each
        num_draft = torch.randint(K + 1, (n,), generator=gen) if ragged else None
        gens = RowStreams.reserve(streams, K + 1) if per_row else gen  # K+1 draws per row
        o = verify(tokens, q, verify_table[contexts], num_draft, gens)
        committed = torch.cat([tokens, tokens[:, :1]], 1)           # [n, K+1]
        committed[rows, o.accepted] = o.bonus
        for j in range(K + 1):
            take = (j <= o.accepted) & (have < 2)
            out[rows[take], have[take]] = committed[take, j]
            have += take.long()
        last = o.bonus
    return torch.bincount(out[:, 0] * V + out[:, 1], minlength=V * V).reshape(V, V)


def exact_first_two(p_table):
    return p_table[X0][:, None] * p_table                           # [V, V]


def p_value(p_table, propose, K, **kw):
    return chi2_test(first_two_tokens(p_table, propose, K, **kw), exact_first_two(p_table))


@pytest.mark.parametrize("K", [2, 3])
def test_dense_q(K):
    target_logits, q_table = tables(K)
    p_table = torch.softmax(target_logits, -1)
    assert p_value(p_table, dense_proposer(q_table), K) > PASS


def test_dense_q_ragged_num_draft():
    target_logits, q_table = tables(11)
    p_table = torch.softmax(target_logits, -1)
    assert p_value(p_table, dense_proposer(q_table), 3, ragged=True) > PASS


def test_per_row_streams():
    target_logits, q_table = tables(12)
    p_table = torch.softmax(target_logits, -1)
    assert p_value(p_table, dense_proposer(q_table), 2, n=20_000, per_row=True) > PASS


def test_saguaro_q_and_wrong_verifier_a():
    target_logits, q_table = tables(5)
    p_table = torch.softmax(target_logits, -1)
    right = dense_proposer(q_table, fan_out=2, c=0.3)
    assert p_value(p_table, right, 3) > PASS
    # (a) tokens drawn from the Saguaro q, verified against the unscaled draft probs
    wrong = dense_proposer(q_table, fan_out=2, c=0.3, declare_raw=True)
    assert p_value(p_table, wrong, 3) < FAIL


def test_onehot_declared_q():
    target_logits, q_table = tables(6)
    p_table = torch.softmax(target_logits, -1)
    assert p_value(p_table, onehot_proposer(q_table.argmax(-1)), 3) > PASS


def test_uniform_declared_q():
    target_logits, _ = tables(7)
    p_table = torch.softmax(target_logits, -1)
    assert p_value(p_table, uniform_proposer, 2) > PASS


def test_mixed_kinds_in_one_batch():
    target_logits, q_table = tables(8)
    p_table = torch.softmax(target_logits, -1)
    assert p_value(p_table, mixed_proposer(q_table, q_table.argmax(-1)), 3) > PASS


def test_temperature_top_p_target_and_wrong_verifier_b():
    target_logits, q_table = tables(9, sharpness=1.0)
    p_table = target_probs(target_logits, 0.8, top_p=0.9).double()
    assert bool((p_table == 0).any())                               # top-p really cuts tokens
    assert p_value(p_table, dense_proposer(q_table), 3) > PASS
    # (b) the verifier forgets top-p: right temperature, whole vocabulary
    no_top_p = target_probs(target_logits, 0.8).double()
    counts = first_two_tokens(p_table, dense_proposer(q_table), 3, verify_table=no_top_p)
    assert chi2_test(counts, exact_first_two(p_table)) < FAIL


def test_wrong_verifier_accepting_everything_fails():
    """Control: ignoring the target altogether must be caught too (the test has power)."""
    target_logits, q_table = tables(10)
    p_table = torch.softmax(target_logits, -1)
    counts = first_two_tokens(p_table, dense_proposer(q_table), 3, verify_table=q_table)
    assert chi2_test(counts, exact_first_two(p_table)) < FAIL


def test_wrong_verifier_resampling_from_p_after_rejection_fails():
    """Control: the classic bug -- after a rejection draw t* from p instead of the residual."""
    def resample_from_p(tokens, q, target_p, num_draft, gens):
        o = verify_sampled(tokens, q, target_p, num_draft, gens)
        from_p = sample_token(target_p[torch.arange(len(tokens)), o.accepted], gens)
        return type(o)(o.accepted, torch.where(o.rejected, from_p, o.bonus), o.accepted_mask,
                       o.num_draft)

    target_logits, q_table = tables(10)
    p_table = torch.softmax(target_logits, -1)
    counts = first_two_tokens(p_table, dense_proposer(q_table), 3, verify=resample_from_p)
    assert chi2_test(counts, exact_first_two(p_table)) < FAIL
