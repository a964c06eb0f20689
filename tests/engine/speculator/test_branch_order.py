"""The build's branch outcomes order each position's candidates with s_{k+1} moved last
(``tree_build.kept_first``): the same order as a stable sort of the exclusion flags, which it
replaces on the device."""

import pytest
import torch

from ssdlib.engine.speculator.tree_build import branch_outcomes, kept_first


def _reference(cand, sent):
    K = sent.shape[1]
    excluded = torch.zeros(cand.shape, dtype=torch.int8)
    excluded[:, :K] = (cand[:, :K] == sent.unsqueeze(-1)).to(torch.int8)
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
