"""Tree-decode attention against a plain reference: every branch's logits at every depth equal a
cache-free forward over that branch written out as an ordinary sequence (its prefix in the slot,
then its own tokens). End-to-end exactness cannot catch a tree bug (outputs stay exact whatever
the speculation), so this compares the speculator's branch logits directly."""

import pytest
import torch

from ssdlib.engine.batching import last_index, pack_rows
from ssdlib.engine.runner.model_runner import ModelRunner
from ssdlib.loading import load_checkpoint
from ssdlib.models.llama import LlamaForCausalLM
from ssdlib.ops.tree_mask import tree_mask_full


@pytest.mark.parametrize("device", ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)]
                                            if torch.cuda.is_available() else []))
def test_branch_logits_equal_plain_forward(tiny_dirs, device):
    ck = load_checkpoint(tiny_dirs["smol_heads"])
    runner = ModelRunner(ck, None, device, torch.float32, n_slots=4, max_len=64, tree_len=20)
    ref = LlamaForCausalLM(ck.config, None, 128)
    ref.load_weights(ck.weights)
    V, K, B = ck.config.vocab_size, 4, 5
    g = torch.Generator().manual_seed(0)
    lens = [13, 9]
    slots = torch.tensor([2, 0])
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    ids, pos = pack_rows(seqs, [0, 0])
    runner.forward(ids, pos, slots, last_index(lens))
    # branch j of row i forks after prefix kv_limit[i, j] (prefixes of different lengths)
    kv_limit = torch.tensor([[13, 12, 10, 13, 9], [9, 9, 5, 7, 8]])
    fork = kv_limit - kv_limit.min(dim=1, keepdim=True).values
    fork = fork.clamp(max=K)
    kv_limit = kv_limit.min(dim=1, keepdim=True).values + fork
    full = tree_mask_full(fork, K, K)[..., K:]
    branch_tokens = torch.randint(0, V, (2, B, K), generator=g)
    for d in range(K):
        tree_index = (d * B + torch.arange(B)).expand(2, B)
        logits = runner.tree_forward(branch_tokens[:, :, d], kv_limit + d, slots, tree_index,
                                     kv_limit, full[:, d * B:(d + 1) * B, :B * (d + 1)],
                                     max(lens)).float().cpu()
        for i in range(2):
            for j in range(B):
                seq = seqs[i][:int(kv_limit[i, j])] + branch_tokens[i, j, :d + 1].tolist()
                with torch.no_grad():
                    want = ref.forward_full(torch.tensor([seq]))[0, -1]
                err = (logits[i, j] - want).abs().max().item()
                assert err <= 1e-4, (d, i, j, err)
