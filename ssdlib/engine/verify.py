"""Target-side verification of one speculation per row (shared by SD and SSD).

One target forward over K+1 positions per row (the last committed token, then s_1..s_K), the
exact acceptance rule from :mod:`ssdlib.speculative.acceptance`, and the commit.
"""

from __future__ import annotations

import torch

from ssdlib.engine.batching import pack_rows, slots_tensor
from ssdlib.engine.sampler import row_distributions
from ssdlib.speculative.acceptance import DraftQ, VerifyOutcome, verify_greedy, verify_sampled


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
    p = row_distributions(logits, seqs)
    if draft_q is None:
        raise ValueError("sampling rows need the draft q")
    return verify_sampled(draft_tokens, draft_q, p, generators=[q.generator for q in seqs])


def commit_outcome(seqs, draft_tokens: torch.Tensor, outcome: VerifyOutcome) -> list[int]:
    """Commit s_1..s_k + t* per row (stop rules may cut it short); returns k per row."""
    ks = outcome.accepted.tolist()
    for q, toks in zip(seqs, outcome.tokens(draft_tokens.cpu())):
        q.commit(toks)
    return ks
