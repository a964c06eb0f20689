"""tools/distill/feature_eval.py against an oracle: a target whose next feature an exact feature
draft computes from (token, feature), so a correctly aligned evaluator accepts every draft token
in both views; the same draft without the feature path is not."""

import pytest
import torch

from tests.feature_oracle import V, PreviousTokenTarget, oracle_draft
from tools.distill.data import Docs
from tools.distill.feature_eval import acceptance_rows, sample_points, table

K = 4


@pytest.fixture(scope="module")
def docs():
    g = torch.Generator().manual_seed(1)
    out = Docs()
    for n in (40, 25, 33):
        out.add(torch.randint(0, V, (n,), generator=g).tolist(), 1, "random-target-samples")
    return out


def test_the_oracle_is_exact(docs):
    target = PreviousTokenTarget()
    draft = oracle_draft(target)
    ids = torch.tensor([docs.ids[0]])
    with torch.no_grad():
        t_logits, features = target.forward_full_features(ids)
        logits, hidden = draft.forward_full(features[:, :-1], ids[:, 1:])
    assert torch.allclose(hidden, features[:, 1:], atol=1e-5)
    assert torch.equal(logits.argmax(-1), t_logits[:, 1:].argmax(-1))


def test_an_exact_draft_is_accepted_everywhere_in_both_views(docs):
    target = PreviousTokenTarget()
    rows = acceptance_rows(oracle_draft(target), target, docs, k=K, positions=30, seed=0)
    assert [r["view"] for r in rows] == ["true features", "self-conditioned"]
    assert [r["self_conditioned"] for r in rows] == [0, K + 1]
    for r in rows:
        assert r["positions"] == 30
        assert r["accepted"] == r["tried"] == 30 * K
        assert r["a_p"] == 1.0 and r["mean_accepted"] == K
    assert "| true features | 0 | 30 |" in table(rows)


def test_without_the_feature_the_oracle_fails(docs):
    """The control: the target's argmax depends on the previous token, which only the feature
    carries; a draft that ignores it is often wrong (and tried counts stop at a mismatch)."""
    target = PreviousTokenTarget()
    rows = acceptance_rows(oracle_draft(target, with_feature=False), target, docs, k=K,
                           positions=30, seed=0)
    for r in rows:
        assert r["a_p"] < 0.5
        assert r["positions"] <= r["tried"] < r["positions"] * K


def test_sampled_positions_leave_room(docs):
    points = sample_points(docs, 1000, k=K, m=K + 1, max_len=30, seed=0)
    flat = [(d, p) for d, ps in points.items() for p in ps]
    assert flat and len(flat) == len(set(flat))
    for d, p in flat:
        assert K + 2 <= p <= len(docs.ids[d]) - 1 and p + K < 30


@pytest.mark.parametrize("k", [1, 4])
def test_the_tree_verify_equals_whole_rows(tmp_path, k):
    """accepted_lengths' tree forward (one prefill, the rows' drafts as branches) gives the
    target's greedy tokens of the cache-free reference at every drafted position; drafts that
    follow the target for a random number of tokens are accepted for exactly that many."""
    from ssdlib.loading import load_checkpoint
    from ssdlib.models.llama import LlamaForCausalLM
    from tests.tiny import make_tiny_llama
    from tools.distill.feature_eval import (TargetPrefix, accepted_lengths,
                                             accepted_lengths_full)

    ck = load_checkpoint(make_tiny_llama(str(tmp_path / "t"), "gqa", scale=2.0))
    target = LlamaForCausalLM(ck.config, max_positions=128).eval()
    target.load_weights(ck.weights)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, ck.config.vocab_size, (70,), generator=g)
    points = [5, 9, 9, 30, 47, 60]
    with torch.no_grad():   # each row: the target's own greedy tokens, one of them changed
        drafted = torch.stack([greedy(target, ids[:p + 1], k) for p in points])
    keep = torch.randint(0, k + 1, (len(points),), generator=g)
    for j, c in enumerate(keep.tolist()):
        if c < k:
            drafted[j, c] = (drafted[j, c] + 1) % ck.config.vocab_size
    with torch.no_grad():
        ref = target.forward_full_features(torch.cat([ids[:61], drafted[-1]]).view(1, -1))[0]
    prefix = TargetPrefix(target, ids[:61])
    assert prefix.greedy(points, drafted)[-1].tolist() == \
        ref[0, 60:60 + k].argmax(-1).tolist()
    assert accepted_lengths(target, ids, points, drafted) == keep.tolist() == \
        accepted_lengths_full(target, ids, points, drafted)
    # the prefix's features: the last layer's output before the norm, as the full forward's
    with torch.no_grad():
        full = target.forward_full_features(ids[:61].view(1, -1))[1][0]
    assert torch.allclose(prefix.features, full, atol=1e-4)
    # and a fused draft's: the chosen layers' outputs concatenated
    with torch.no_grad():
        fused = target.forward_full_features(ids[:61].view(1, -1), (0, 1))[1][0]
    assert torch.allclose(TargetPrefix(target, ids[:61], (0, 1)).features, fused, atol=1e-4)


def greedy(model, prefix: torch.Tensor, n: int) -> torch.Tensor:
    out = prefix.tolist()
    for _ in range(n):
        out.append(int(model.forward_full_features(torch.tensor([out]))[0][0, -1].argmax()))
    return torch.tensor(out[len(prefix):])


def test_several_self_conditioned_counts_share_their_positions(docs):
    """One view per count, all on the positions sampled for the largest: the exact draft is
    accepted everywhere in each, the featureless one equally in the true view of both calls;
    a bad count is refused (the command line's parser too)."""
    import argparse

    from tools.distill.feature_eval import self_conditioned_counts
    target = PreviousTokenTarget()
    rows = acceptance_rows(oracle_draft(target), target, docs, k=K, positions=20, m=[3, 1, 3],
                           seed=0)
    assert [(r["view"], r["self_conditioned"]) for r in rows] == \
        [("true features", 0), ("self-conditioned", 1), ("self-conditioned", 3)]
    assert all(r["positions"] == 20 and r["accepted"] == 20 * K for r in rows)
    blind = oracle_draft(target, with_feature=False)
    both = acceptance_rows(blind, target, docs, k=K, positions=20, m=[1, 3], seed=0)
    alone = acceptance_rows(blind, target, docs, k=K, positions=20, m=3, seed=0)
    assert both[0] == alone[0] and both[2] == alone[1]   # the same positions as m = 3 alone
    with pytest.raises(ValueError, match="counts >= 0"):
        acceptance_rows(blind, target, docs, k=K, positions=5, m=[2, -1])
    assert self_conditioned_counts("1,3,6") == [1, 3, 6]
    for bad in ("", "1,x", "-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            self_conditioned_counts(bad)
