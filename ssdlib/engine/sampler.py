"""Choosing the next token from target logits, per row, under each row's SamplingParams."""

from __future__ import annotations

import torch

from ssdlib.sampling import sample_from, target_probs


def row_distributions(logits: torch.Tensor, seqs) -> torch.Tensor:
    """logits [b, ..., V] -> each row's exact AR distribution, same shape: one-hot on the argmax
    for greedy rows (so the sampled acceptance rule reduces to the greedy one), temperature /
    top-k / top-p otherwise."""
    p = torch.empty_like(logits)
    for i, seq in enumerate(seqs):
        sp = seq.params
        if sp.greedy:
            p[i].zero_().scatter_(-1, logits[i].argmax(-1, keepdim=True), 1.0)
        else:
            p[i] = target_probs(logits[i], sp.temperature, sp.top_k, sp.top_p)
    return p


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
