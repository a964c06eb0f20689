"""A draft's vocabulary from distillation data: the target's tokens ranked by how often the
target writes them (``ssdlib.loading.draft_vocab`` reads the ranking; ``--draft-vocab N`` keeps
its first N).

The counts are over the scored positions of the data's training documents (the target's own
output; held-out documents are not read), so the ranking follows what the draft will be asked to
propose. Tokens the data never holds are not ranked. The tokenizer's special tokens (chat
markup, end of sequence) lead the ranking whatever their counts, so that every N keeps them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from tools.distill.data import Docs


def leading_tokens(checkpoint) -> list[int]:
    """The ids a ranking puts first: the tokenizer's special tokens (where the checkpoint has a
    tokenizer) and the end-of-sequence tokens."""
    tokenizer = checkpoint.tokenizer
    added = tokenizer.backend.get_added_tokens_decoder() if tokenizer is not None else {}
    return sorted({*(i for i, t in added.items() if t.special),
                   *checkpoint.config.eos_token_ids})


def scored_counts(docs: Iterable[Docs], vocab_size: int) -> torch.Tensor:
    """Occurrences of every token id (int64 [vocab_size]) at the documents' scored positions
    (``Docs.score_from`` onwards)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for d in docs:
        for ids, start in zip(d.ids, d.score_from):
            scored = torch.tensor(ids[start:], dtype=torch.int64)
            if scored.numel():
                if int(scored.min()) < 0 or int(scored.max()) >= vocab_size:
                    raise ValueError(f"a document holds a token id outside the vocabulary of "
                                     f"{vocab_size}")
                counts += torch.bincount(scored, minlength=vocab_size)
    return counts


def rank_tokens(counts: torch.Tensor, leading: Sequence[int] = ()) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """(ranked ids, their counts): ``leading`` first (in their order), then every other id with
    a count > 0, most frequent first (ties: the lower id first)."""
    vocab_size = counts.numel()
    lead = list(dict.fromkeys(int(t) for t in leading if 0 <= int(t) < vocab_size))
    rest = torch.ones(vocab_size, dtype=torch.bool)
    rest[lead] = False
    rest &= counts > 0
    ids = rest.nonzero().flatten()
    # a stable sort by descending count keeps ascending ids among ties
    order = torch.sort(counts[ids], descending=True, stable=True).indices
    ranked = torch.cat([torch.tensor(lead, dtype=torch.int64), ids[order]])
    return ranked, counts[ranked]


def rank_training_tokens(checkpoint, docs: Iterable[Docs]) -> tuple[torch.Tensor, torch.Tensor,
                                                                  list[int]]:
    """The ranking of ``checkpoint``'s tokens over ``docs`` (training documents), as a draft's
    ranking file holds it: (ranked ids, their counts, the leading ids)."""
    leading = leading_tokens(checkpoint)
    ranked, counts = rank_tokens(scored_counts(docs, checkpoint.config.vocab_size), leading)
    return ranked, counts, leading


def coverage(counts: torch.Tensor, ranked: torch.Tensor, sizes: Sequence[int]) -> dict[int, float]:
    """The share of counted tokens that the first N of ``ranked`` hold, for each N of ``sizes``."""
    total = max(1, int(counts.sum()))
    cum = counts[ranked].cumsum(0)
    return {n: int(cum[min(n, ranked.numel()) - 1]) / total for n in sizes if n >= 1}
