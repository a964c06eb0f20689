"""SubsetLMHead (a draft vocabulary's LM head) against its plain reference, the full head with
the rows outside the subset masked, and its checks of the token ids."""

import pytest
import torch

from ssdlib.errors import ConfigError
from ssdlib.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ssdlib.layers.subset_head import SubsetLMHead, check_token_ids, reference_subset_logits

V, H = 40, 8


def _heads():
    torch.manual_seed(0)
    own = ParallelLMHead(V, H)
    own.weight.data.normal_()
    embed = VocabParallelEmbedding(V, H)
    embed.weight.data.normal_()
    return own, ParallelLMHead(V, H, None, embed)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("shape", [(3, H), (2, 5, H)])
def test_subset_logits_equal_the_masked_full_head(tied, shape):
    head = _heads()[tied]
    ids = torch.tensor([31, 0, 7, 8, 39, 20])
    sub = SubsetLMHead.of(head, ids)
    x = torch.randn(*shape)
    got, ref = sub(x), reference_subset_logits(head(x), ids)
    assert got.shape == ref.shape == (*shape[:-1], V)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert int(torch.isfinite(got).sum()) == got.numel() // V * ids.numel()
    kept = ids.sort().values
    torch.testing.assert_close(got[..., kept], ref[..., kept], rtol=1e-6, atol=1e-6)
    assert sub.size == ids.numel() and sub.weight.shape == (ids.numel(), H)


def test_the_subset_is_a_copy_of_the_rows():
    head = _heads()[0]
    sub = SubsetLMHead.of(head, torch.tensor([1, 2]))
    head.weight.data.zero_()  # the head it came from changes afterwards
    assert bool(sub.weight.abs().sum() > 0)
    assert not sub.weight.requires_grad


@pytest.mark.parametrize("ids,match", [
    (torch.tensor([3, 3]), "token id 3 twice"),
    (torch.tensor([0, V]), r"\[0, 40\)"),
    (torch.tensor([-1, 2]), r"\[0, 40\)"),
    (torch.tensor([], dtype=torch.int64), "non-empty"),
    (torch.tensor([[1, 2]]), "non-empty list"),
    (torch.tensor([1.0, 2.0]), "integer"),
])
def test_bad_token_ids_are_refused(ids, match):
    with pytest.raises(ConfigError, match=match):
        check_token_ids(ids, V)


def test_token_ids_come_back_sorted():
    assert check_token_ids(torch.tensor([9, 1, 4], dtype=torch.int32), V).tolist() == [1, 4, 9]
