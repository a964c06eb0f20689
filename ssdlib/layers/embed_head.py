"""Vocab-parallel embedding and LM head (vocab padded to a multiple of the TP size)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ssdlib.layers.linear import all_gather_last, all_reduce, load_padded_block, tp_size_rank


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


class _VocabShard(nn.Module):
    """This rank's block of vocabulary rows [vocab_start, vocab_start + local_vocab)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_group, own_weight: bool):
        super().__init__()
        tp, rank = tp_size_rank(tp_group)
        self.tp_group = tp_group
        self.vocab_size = vocab_size
        self.local_vocab = padded_vocab(vocab_size, tp) // tp
        self.vocab_start = rank * self.local_vocab
        self.checkpoint_shape = (vocab_size, hidden_size)
        if own_weight:
            self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden_size))

    def checkpoint_tensors(self, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(prefix + ".weight", self.checkpoint_shape)]

    def load(self, weights, prefix: str) -> None:
        w = self.weight
        w.data = load_padded_block(weights, prefix + ".weight", 0, self.vocab_start,
                                   self.vocab_start + self.local_vocab, self.vocab_size,
                                   tuple(w.shape), w.dtype, w.device)


class VocabParallelEmbedding(_VocabShard):
    def __init__(self, vocab_size: int, hidden_size: int, tp_group=None):
        super().__init__(vocab_size, hidden_size, tp_group, own_weight=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None or dist.get_world_size(self.tp_group) == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp_group)


class ParallelLMHead(_VocabShard):
    """Logits over the full vocab: each rank computes its vocab block, then an all-gather.

    With tied embeddings it reuses the embedding's (local) weight.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp_group=None,
                 tied: VocabParallelEmbedding | None = None):
        super().__init__(vocab_size, hidden_size, tp_group, own_weight=tied is None)
        self.tied = tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.tied.weight if self.tied is not None else self.weight
        logits = nn.functional.linear(x, weight)  # [..., V_local]
        logits = all_gather_last(logits, self.tp_group)  # each rank's vocab block, in order
        return logits[..., : self.vocab_size]

    def checkpoint_tensors(self, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        return [] if self.tied is not None else super().checkpoint_tensors(prefix)

    def load(self, weights, prefix: str) -> None:
        if self.tied is None:  # tied: the embedding loads the shared weight
            super().load(weights, prefix)
