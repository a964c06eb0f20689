"""Choosing the next token from target logits, per row, under each row's SamplingParams."""

from __future__ import annotations

import torch

from ssdlib.sampling import sample_from, target_probs


def sample_rows(logits: torch.Tensor, seqs) -> list[int]:
    """logits: [b, V] (row i belongs to seqs[i]) -> one token per row."""
    out = []
    greedy = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            out.append(greedy[i])
        else:
            probs = target_probs(logits[i], p.temperature, p.top_k, p.top_p)
            out.append(sample_from(probs, seq.generator))
    return out
