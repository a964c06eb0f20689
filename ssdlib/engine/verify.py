"""Target-side verification of one speculation per row (shared by SD and SSD).

One target forward over K+1 positions per row (the last committed token, then s_1..s_K), the
exact acceptance rule from :mod:`ssdlib.speculative.acceptance`, and the commit.
"""

from __future__ import annotations

import torch

from ssdlib.engine.batching import pack_rows, slots_tensor
from ssdlib.sampling import target_probs
from ssdlib.speculative.acceptance import DraftQ, VerifyOutcome, verify_greedy, verify_sampled


def target_distributions(logits: torch.Tensor, seqs) -> torch.Tensor:
    """logits [b, K+1, V] -> p [b, K+1, V]: each row's exact AR distribution (one-hot argmax for
    greedy rows, which makes the sampled rule reduce to the greedy one)."""
    p = torch.empty_like(logits)
    for i, seq in enumerate(seqs):
        sp = seq.params
        if sp.greedy:
            p[i].zero_().scatter_(-1, logits[i].argmax(-1, keepdim=True), 1.0)
        else:
            p[i] = target_probs(logits[i], sp.temperature, sp.top_k, sp.top_p)
    return p


def verify_round(target, seqs, draft_tokens: torch.Tensor, draft_q: DraftQ | None,
                 device) -> VerifyOutcome:
    """draft_tokens [b, K] -> outcome (k accepted, bonus t*) per row. Does not commit."""
    b, k = draft_tokens.shape
    rows = [[q.tokens[-1]] + d for q, d in zip(seqs, draft_tokens.tolist())]
    ids, pos = pack_rows(rows, [len(q.tokens) - 1 for q in seqs], device)
    logits = target.forward(ids, pos, slots_tensor(seqs, device))      # [b, K+1, V]
    draft_tokens = draft_tokens.to(logits.device)
    if all(q.params.greedy for q in seqs):
        return verify_greedy(draft_tokens, logits)
    p = target_distributions(logits, seqs)
    if draft_q is None:
        raise ValueError("sampling rows need the draft q")
    return verify_sampled(draft_tokens, draft_q, p, generators=[q.generator for q in seqs])


def commit_outcome(seqs, draft_tokens: torch.Tensor, outcome: VerifyOutcome) -> list[int]:
    """Commit s_1..s_k + t* per row (stop rules may cut it short); returns k per row."""
    ks = outcome.accepted.tolist()
    for q, toks in zip(seqs, outcome.tokens(draft_tokens.cpu())):
        q.commit(toks)
    return ks
