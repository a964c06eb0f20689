"""The build's branch outcomes order each position's candidates with s_{k+1} moved last
(``tree_build.kept_first``): the same order as a stable sort of the exclusion flags, which it
replaces on the device."""

import pytest
import torch

from ssdlib.engine.speculator.tree_build import branch_outcomes, kept_first


def _reference(cand, sent, limit=None):
    K = sent.shape[1]
    excluded = torch.zeros(cand.shape, dtype=torch.int8)
    for b in range(cand.shape[0]):
        for k in range(K if limit is None else int(limit[b])):
            excluded[b, k] = (cand[b, k] == sent[b, k]).to(torch.int8)
    return torch.argsort(excluded, dim=-1, stable=True)


@pytest.mark.parametrize("vocab", [3, 6, 50])  # small vocabularies repeat candidates
def test_kept_first_is_a_stable_sort_of_the_exclusions(vocab):
    g = torch.Generator().manual_seed(vocab)
    for C in range(1, 8):
        cand = torch.randint(0, vocab, (4, 4, C), generator=g)
        sent = torch.randint(0, vocab, (4, 3), generator=g)
        sent[0] = cand[0, :3, C - 1]  # the last candidate excluded
        sent[1] = cand[1, :3, 0]  # the first
        assert torch.equal(kept_first(cand, sent), _reference(cand, sent)), C


def test_kept_first_can_fail():
    """The reference tells a wrong order apart (moving nothing)."""
    cand = torch.tensor([[[5, 6, 7], [1, 2, 3], [4, 8, 9]]])
    sent = torch.tensor([[5, 9]])
    order = kept_first(cand, sent)
    assert order[0, 0].tolist() == [1, 2, 0] and order[0, 2].tolist() == [0, 1, 2]
    assert not torch.equal(torch.arange(3).expand(1, 3, 3), _reference(cand, sent))


def test_branch_first_tokens_skip_the_speculation():
    cand = torch.tensor([[[5, 6, 7], [1, 2, 3], [4, 8, 9]]])
    sent = torch.tensor([[5, 2]])
    pos = torch.tensor([0, 0, 1, 2])
    rank = torch.tensor([0, 1, 0, 0])
    fork, first = branch_outcomes(cand, sent, pos, rank)
    assert fork.tolist() == [[0, 0, 1, 2]]
    assert first.tolist() == [[6, 7, 1, 4]]  # 5 and 2 are the speculation's own tokens


def test_a_shorter_verification_keeps_the_next_token_at_its_all_accepted_position():
    """With only the first ``limit`` tokens verified (adaptive K), outcome k = limit is every
    verified token accepted: its bonus is the target's draw at s_{limit+1}'s position, which
    s_{limit+1} (the draft's best guess there) may be, so the build keeps it first."""
    cand = torch.tensor([[[5, 6, 7], [2, 1, 3], [9, 4, 8]]])
    sent = torch.tensor([[5, 2]])
    pos, rank = torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1])
    assert branch_outcomes(cand, sent, pos, rank)[1].tolist() == [[6, 1, 3]]
    limited = branch_outcomes(cand, sent, pos, rank, torch.tensor([1]))[1]
    assert limited.tolist() == [[6, 2, 1]]  # s_2 = 2 is position 1's first guess again
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        cand = torch.randint(0, 6, (5, 4, 4), generator=g)
        sent = cand[:, :3, 0].clone()
        limit = torch.randint(0, 4, (5,), generator=g)
        assert torch.equal(kept_first(cand, sent, limit), _reference(cand, sent, limit))
