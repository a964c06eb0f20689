"""Verifier rule: greedy against a plain Python loop, DraftQ, and deterministic sampled cases."""

import pytest
import torch

from ssdlib.sampling import row_streams
from ssdlib.speculative import DraftQ, QKind, verify_greedy, verify_sampled
from ssdlib.speculative.rng import RowStreams, sample_categorical, sample_token


def greedy_reference(draft, logits, num_draft):
    """One row at a time, exactly as the rule is stated."""
    accepted, bonus = [], []
    for row in range(len(draft)):
        k = 0
        while k < num_draft[row] and draft[row][k] == int(logits[row, k].argmax()):
            k += 1
        accepted.append(k)
        bonus.append(int(logits[row, k].argmax()))
    return accepted, bonus


@pytest.mark.parametrize("seed", range(20))
def test_greedy_matches_python_loop(seed):
    g = torch.Generator().manual_seed(seed)
    b, K, V = 1 + seed % 7, seed % 6, 5
    logits = torch.randn(b, K + 1, V, generator=g, dtype=torch.float64)
    best = logits.argmax(-1)[:, :K]
    # mostly the argmax so that long accepted prefixes happen, sometimes a random token
    draft = torch.where(torch.rand(b, K, generator=g) < 0.75, best,
                        torch.randint(V, (b, K), generator=g))
    num_draft = torch.randint(K + 1, (b,), generator=g)
    out = verify_greedy(draft, logits, num_draft)
    ref_k, ref_bonus = greedy_reference(draft.tolist(), logits, num_draft.tolist())
    assert out.accepted.tolist() == ref_k
    assert out.bonus.tolist() == ref_bonus
    assert out.accepted_mask.sum(-1).tolist() == ref_k
    assert (out.accepted <= out.num_draft).all()
    for row, toks in enumerate(out.tokens(draft)):
        assert toks == draft[row, :ref_k[row]].tolist() + [ref_bonus[row]]


def test_greedy_ignores_positions_past_num_draft():
    logits = torch.zeros(2, 4, 6)
    logits[:, torch.arange(4), torch.tensor([1, 2, 3, 4])] = 1.0   # argmax 1, 2, 3, 4
    draft = torch.tensor([[1, 2, -1], [1, 2, 3]])
    out = verify_greedy(draft, logits, [2, 3])
    assert out.accepted.tolist() == [2, 3]
    assert out.bonus.tolist() == [3, 4]
    assert out.rejected.tolist() == [False, False]


def test_greedy_shape_errors():
    with pytest.raises(ValueError):
        verify_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError):
        verify_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, 5), [1, 4])


def test_draftq_kinds_and_dense_view():
    V = 5
    probs = torch.softmax(torch.randn(3, 2, V, dtype=torch.float64), -1)
    tokens = torch.tensor([[0, 1], [2, 3], [4, 0]])
    q = DraftQ.per_row([QKind.DENSE, QKind.ONEHOT, QKind.UNIFORM], probs)
    dense = q.to_dense(tokens, V)                                   # [3, 2, V]
    assert torch.allclose(dense[0], probs[0])
    assert torch.equal(dense[1], torch.nn.functional.one_hot(tokens[1], V).double())
    assert torch.allclose(dense[2], torch.full((2, V), 1 / V, dtype=torch.float64))
    expected = dense.gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(q.prob_of(tokens, V), expected)
    with pytest.raises(ValueError):
        DraftQ.per_row([QKind.DENSE, QKind.ONEHOT])                 # dense row without probs


def test_unnormalised_q_is_normalised():
    probs = torch.tensor([[[2.0, 2.0]]], dtype=torch.float64)       # the row sums to 4
    q = DraftQ.from_probs(probs)
    assert q.prob_of(torch.tensor([[0]]), 2).item() == pytest.approx(0.5)


def test_sampled_deterministic_cases():
    V = 4
    p = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    target = p.expand(6, 3, V).clone()                              # [b=6, K+1=3, V]
    draft = torch.tensor([[1, 1]] * 3 + [[0, 1]] * 3)
    q = DraftQ.onehot(6)
    out = verify_sampled(draft, q, target, generators=torch.Generator().manual_seed(0))
    # p(1) = 1: always accepted; p(0) = 0: always rejected, and the residual is p without token 0
    assert out.accepted.tolist() == [2, 2, 2, 0, 0, 0]
    assert out.bonus.tolist() == [1] * 6
    # p == q (dense): everything accepted whatever the uniforms
    dq = DraftQ.from_probs(torch.softmax(torch.randn(5, 3, V, dtype=torch.float64), -1))
    target = torch.cat([dq.probs, dq.probs[:, :1]], 1)
    draft = sample_token(dq.probs, torch.Generator().manual_seed(1))
    out = verify_sampled(draft, dq, target, generators=torch.Generator().manual_seed(2))
    assert out.accepted.tolist() == [3] * 5


def test_sampled_K0_samples_from_target():
    target = torch.tensor([[[0.0, 0.0, 1.0]]])
    out = verify_sampled(torch.zeros(1, 0, dtype=torch.long), DraftQ.uniform(1), target)
    assert out.accepted.tolist() == [0] and out.bonus.tolist() == [2]


def test_row_streams_make_rows_independent_of_the_batch():
    g = torch.Generator().manual_seed(0)
    b, K, V = 6, 3, 7
    q = torch.softmax(torch.randn(b, K, V, generator=g), -1)
    p = torch.softmax(torch.randn(b, K + 1, V, generator=g), -1)
    draft = torch.randint(V, (b, K), generator=g)
    full = verify_sampled(draft, DraftQ.from_probs(q), p,
                          generators=RowStreams.reserve(row_streams(7, b), K + 1))
    streams = row_streams(7, b)
    for row in range(b):
        sl = slice(row, row + 1)
        one = verify_sampled(draft[sl], DraftQ.from_probs(q[sl]), p[sl],
                             generators=RowStreams.reserve(streams[row:row + 1], K + 1))
        assert one.accepted.item() == full.accepted[row].item()
        assert one.bonus.item() == full.bonus[row].item()
    with pytest.raises(ValueError):
        verify_sampled(draft, DraftQ.from_probs(q), p,
                       generators=RowStreams.reserve(row_streams(7, b - 1), K + 1))
    with pytest.raises(ValueError):  # fewer draws reserved than the rule uses (K+1)
        verify_sampled(draft, DraftQ.from_probs(q), p,
                       generators=RowStreams.reserve(row_streams(7, b), K))


def test_sampled_rule_matches_a_per_row_loop():
    """The batched rule against the rule stated one row at a time with the row's uniforms: a
    row limited to n drafts takes its accept tests from draws 0 .. n-1 and t* from draw n."""
    g = torch.Generator().manual_seed(3)
    b, K, V = 40, 3, 6
    q = torch.softmax(2 * torch.randn(b, K, V, generator=g, dtype=torch.float64), -1)
    p = torch.softmax(2 * torch.randn(b, K + 1, V, generator=g, dtype=torch.float64), -1)
    draft = sample_token(q, g)
    nd = torch.randint(K + 1, (b,), generator=g)
    streams = RowStreams.reserve(row_streams(1, b), K + 1)
    out = verify_sampled(draft, DraftQ.from_probs(q), p, nd, streams)
    u = streams.uniforms(K + 1)
    for i in range(b):
        k = 0
        while k < nd[i] and u[i, k] * q[i, k, draft[i, k]] < p[i, k, draft[i, k]]:
            k += 1
        dist = p[i, k]
        if k < nd[i]:
            dist = (p[i, k] - q[i, k]).clamp_min(0)
        assert out.accepted[i].item() == k
        bonus_u = u[i, nd[i]:nd[i] + 1]
        assert out.bonus[i].item() == sample_categorical(dist[None], bonus_u).item()


def test_sample_categorical_never_returns_zero_mass_tokens():
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0], [0.0, 0.3, 0.7, 0.0]], dtype=torch.float32)
    u = torch.tensor([0.0, 1.0 - 2.0 ** -53], dtype=torch.float64)
    assert sample_categorical(probs, u).tolist() == [1, 2]
    # u = 1 is outside the contract; it exercises the guard for u * total rounding up to total
    u = torch.tensor([1.0, 0.2], dtype=torch.float64)
    assert sample_categorical(probs, u).tolist() == [2, 1]


def test_mixed_precision_inputs():
    """float32 target, bfloat16 q as sent over the wire: runs, and only valid ids come out."""
    g = torch.Generator().manual_seed(0)
    b, K, V = 4, 3, 50
    q = torch.softmax(torch.randn(b, K, V, generator=g), -1).bfloat16()
    p = torch.softmax(torch.randn(b, K + 1, V, generator=g), -1)
    draft = sample_token(q.float(), g)
    out = verify_sampled(draft, DraftQ.from_probs(q), p, [3, 2, 1, 0], g)
    assert ((out.bonus >= 0) & (out.bonus < V)).all()
    assert (out.accepted <= torch.tensor([3, 2, 1, 0])).all()


@pytest.mark.parametrize("vocab", [3, 256, 300, 49152])
def test_blocked_cdf_is_the_running_sum(vocab):
    """blocked_cdf (the sampler's CDF, summed per block) == cumsum up to rounding; it keeps the
    properties inverse-CDF sampling needs: non-decreasing, and a zero-probability token's value
    equal to its predecessor's, also where a block starts."""
    from ssdlib.speculative.rng import CDF_BLOCK, blocked_cdf

    g = torch.Generator().manual_seed(3)
    probs = torch.rand(4, vocab, dtype=torch.float64, generator=g) ** 6
    probs[:, ::5] = 0.0
    probs[:, CDF_BLOCK::CDF_BLOCK] = 0.0  # block starts
    cdf = blocked_cdf(probs)
    assert cdf.shape == probs.shape and cdf.is_contiguous()
    assert torch.allclose(cdf, probs.cumsum(-1), rtol=1e-12, atol=0)
    assert (cdf[:, 1:] >= cdf[:, :-1]).all()
    zero = probs[:, 1:] == 0
    assert torch.equal(cdf[:, 1:][zero], cdf[:, :-1][zero])


def test_sample_categorical_blocks_never_return_zero_mass_tokens():
    """Over a vocabulary of several CDF blocks: every boundary between the kept tokens' CDF
    intervals is drawn exactly, and each lands on a token with mass."""
    from ssdlib.speculative.rng import blocked_cdf

    vocab = 1000
    probs = torch.zeros(1, vocab, dtype=torch.float64)
    keep = torch.tensor([5, 255, 257, 511, 999])
    probs[0, keep] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=torch.float64)
    cdf = blocked_cdf(probs)[0]
    total = cdf[-1]
    u = torch.cat([torch.zeros(1, dtype=torch.float64), cdf[keep[:-1]] / total,
                   torch.tensor([1.0 - 2.0 ** -53], dtype=torch.float64)])
    out = sample_categorical(probs.expand(len(u), vocab), u)
    assert set(out.tolist()) <= set(keep.tolist())
    assert out.tolist() == [5, 255, 257, 511, 999, 999]


@pytest.mark.parametrize("sampled", [False, True])
def test_limits_verify_each_row_as_if_only_its_drafts_were_proposed(sampled):
    """Adaptive K: a batch verifies max K_i drafts a row, row i limited to K_i; each row's
    outcome equals the outcome of verifying its first K_i drafts alone (one row, K = K_i), on
    the same draws of its stream (greedy: the same argmaxes)."""
    g = torch.Generator().manual_seed(4)
    b, K, V = 24, 4, 5
    q = torch.softmax(2 * torch.randn(b, K, V, generator=g, dtype=torch.float64), -1)
    p = torch.softmax(2 * torch.randn(b, K + 1, V, generator=g, dtype=torch.float64), -1)
    p[:b // 2, :K] = q[:b // 2]  # rows where drafts are often accepted, so limits bind
    draft = sample_token(q, g)
    limits = torch.randint(K + 1, (b,), generator=g).tolist()
    if sampled:
        out = verify_sampled(draft, DraftQ.from_probs(q), p, limits,
                             RowStreams.reserve(row_streams(5, b), K + 1))
    else:
        out = verify_greedy(draft, p, limits)
    streams = row_streams(5, b)
    for i, n in enumerate(limits):
        row = slice(i, i + 1)
        if sampled:  # the row alone reserves n + 1 draws: the first of the batch call's
            one = verify_sampled(draft[row, :n], DraftQ.from_probs(q[row, :n]), p[row, :n + 1],
                                 generators=RowStreams.reserve(streams[i:i + 1], n + 1))
        else:
            one = verify_greedy(draft[row, :n], p[row, :n + 1])
        assert (out.accepted[i].item(), out.bonus[i].item()) == \
            (one.accepted.item(), one.bonus.item()), i
        assert out.accepted_mask[i, n:].sum() == 0
    assert (out.accepted == torch.tensor(limits)).any()  # some row used all of its drafts
    assert (out.accepted < torch.tensor(limits)).any()


def test_limits_from_a_host_list_are_checked():
    draft, logits = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, 5)
    with pytest.raises(ValueError, match="num_draft"):
        verify_greedy(draft, logits, [1, 4])
    with pytest.raises(ValueError, match="num_draft"):
        verify_greedy(draft, logits, [1])
    assert verify_greedy(draft, logits, [0, 3]).num_draft.tolist() == [0, 3]
