"""An LM head over a subset of the vocabulary (a draft's vocabulary, EAGLE-3's reduced head).

A draft's LM head is most of its work: SmolLM2's 49,152 rows cost the standalone draft (six
layers 256 wide) about twice its layers' multiply-adds, and a feature draft (one layer 576 wide)
about five times. A draft that only ever proposes the tokens of a subset (the most frequent ones
of the target's own text) computes the logits of those rows and no others.

The result keeps the full vocabulary's layout: logits [..., V] with the subset's rows computed
and -inf everywhere else, so that everything downstream (temperature, top-k/top-p, Saguaro
sampling, fork candidates, rejection sampling) is unchanged. The draft's distribution q is then
exactly zero outside the subset, which rejection sampling handles exactly: a token the draft
cannot propose is only ever reached through the residual max(p - q, 0) = p there. The plain
reference, ``reference_subset_logits``, is the full head with the rows outside masked.
"""

from __future__ import annotations

import torch
from torch import nn

from ssdlib.errors import ConfigError
from ssdlib.layers.linear import tp_size_rank


def token_id_problem(token_ids: torch.Tensor, vocab_size: int) -> str | None:
    """What keeps ``token_ids`` from being a list of distinct ids of a vocabulary of
    ``vocab_size`` (a phrase to follow "a draft vocabulary"), or None."""
    if token_ids.dim() != 1 or token_ids.numel() == 0:
        return f"must be a non-empty list of token ids, got shape {tuple(token_ids.shape)}"
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        return f"holds integer token ids, got {token_ids.dtype}"
    ids = token_ids.to(torch.int64).sort().values
    low, high = int(ids[0]), int(ids[-1])
    if low < 0 or high >= vocab_size:
        return f"has token id {low if low < 0 else high} outside [0, {vocab_size})"
    repeated = ids[1:][ids[1:] == ids[:-1]]
    if repeated.numel():
        return f"lists token id {int(repeated[0])} twice"
    return None


def check_token_ids(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``token_ids`` as a sorted int64 vector of distinct ids in [0, vocab_size); ConfigError
    (one line) when it is not one."""
    problem = token_id_problem(token_ids, vocab_size)
    if problem is not None:
        raise ConfigError(f"a draft vocabulary {problem}")
    return token_ids.to(torch.int64).sort().values


class SubsetLMHead(nn.Module):
    """Logits [..., V] of the rows ``token_ids`` of a head weight [V, H]; -inf elsewhere.

    The rows are copied once (a [n, H] weight of the head's dtype and device); the head it was
    made from is not referenced afterwards.
    """

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        if weight.dim() != 2 or weight.shape[0] < vocab_size:
            raise ConfigError(f"an LM head weight of shape {tuple(weight.shape)} has no "
                              f"{vocab_size} rows")
        ids = check_token_ids(token_ids, vocab_size).to(weight.device)
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(weight.detach().index_select(0, ids).clone(),
                                   requires_grad=False)
        self.register_buffer("token_ids", ids, persistent=False)

    @classmethod
    def of(cls, head: nn.Module, token_ids: torch.Tensor) -> "SubsetLMHead":
        """The subset ``token_ids`` of an unsharded ``ParallelLMHead`` (tied or its own)."""
        if tp_size_rank(head.tp_group)[0] != 1:
            raise ConfigError("a draft vocabulary needs an unsharded LM head")
        weight = head.tied.weight if head.tied is not None else head.weight
        return cls(weight, token_ids, head.vocab_size)

    @property
    def size(self) -> int:
        """How many tokens the head scores."""
        return int(self.token_ids.numel())

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The subset's logits alone, [..., n] in ``token_ids`` order (training over the
        subset: tools/distill/feature_train.py)."""
        return nn.functional.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows(x)  # [..., n]
        logits = rows.new_full((*rows.shape[:-1], self.vocab_size), float("-inf"))
        return logits.index_copy_(-1, self.token_ids, rows)


def reference_subset_logits(full_logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The plain reference: the full head's logits [..., V] with every row outside
    ``token_ids`` set to -inf."""
    keep = torch.zeros(full_logits.shape[-1], dtype=torch.bool, device=full_logits.device)
    keep[token_ids.to(full_logits.device)] = True
    return full_logits.masked_fill(~keep, float("-inf"))
