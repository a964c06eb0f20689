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
