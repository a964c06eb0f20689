"""Target-side verification of one speculation per row (shared by SD and SSD).

One target forward over K+1 positions per row (the last committed token, then s_1..s_K), the
exact acceptance rule from :mod:`ssdlib.speculative.acceptance`, and the commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ssdlib.engine.batching import slots_tensor
from ssdlib.engine.sampler import reserve_streams, row_distributions
from ssdlib.speculative.acceptance import DraftQ, VerifyOutcome, verify_greedy, verify_sampled


def verify_round(target, seqs, draft_tokens: torch.Tensor,
                 draft_q: DraftQ | Callable[[], DraftQ | None] | None, device,
                 after_launch: Callable[[], None] | None = None,
                 limits: list[int] | None = None, draws: int | None = None) -> VerifyOutcome:
    """draft_tokens [b, K] (host or device) -> outcome (k accepted, bonus t*) per row. Does not
    commit. ``draft_q`` may be a callable, called once the target forward is launched (so that
    receiving q overlaps the forward); ``after_launch`` likewise, in every round (e.g. to post
    a receive whose host cost then overlaps the forward). ``limits`` [b]: each row's K (its
    drafts past it are not verified: adaptive K; default K); ``draws``: the draws each sampled
    row's stream gives up (default K + 1; the loops reserve K_max + 1 whatever K is)."""
    b, k = draft_tokens.shape
    # host inputs in numpy (a few µs; torch's small CPU ops cost tens of µs each, every round)
    last = np.array([[q.tokens[-1]] for q in seqs], dtype=np.int64)     # [b, 1]
    pos = torch.from_numpy(np.array([[len(q.tokens) - 1] for q in seqs], dtype=np.int64)
                           + np.arange(k + 1, dtype=np.int64))          # [b, K+1]
    if draft_tokens.device.type == "cpu":  # travels with the step's other host inputs
        ids = torch.from_numpy(np.concatenate([last, draft_tokens.numpy()], axis=1))
    else:  # drafted on this device: no read-back of drafts
        ids = torch.cat([torch.from_numpy(last).to(device, non_blocking=True), draft_tokens],
                        dim=1)
    logits = target.forward(ids, pos, slots_tensor(seqs))               # [b, K+1, V]
    if after_launch is not None:
        after_launch()
    draft_tokens = draft_tokens.to(device, non_blocking=True)
    if limits is not None and all(n == k for n in limits):
        limits = None  # every row verifies all K: nothing to copy
    if all(q.params.greedy for q in seqs):
        return verify_greedy(draft_tokens, logits, limits)
    p = row_distributions(logits, seqs)
    if callable(draft_q):
        draft_q = draft_q()
    if draft_q is None:
        raise ValueError("sampling rows need the draft q")
    # K accept tests + the bonus draw (a row limited to n: n tests, then draw n)
    streams = reserve_streams(seqs, max(k + 1, draws or 0), logits.device)
    return verify_sampled(draft_tokens, draft_q, p, limits, generators=streams)


@dataclass
class RoundResult:
    """One verification round on the host (read back in one device-to-host copy)."""

    accepted: list[int]  # k per row
    bonus: list[int]  # t* per row
    accepted_mask: list[list[int]]  # [b][K] 1 on the accepted prefix
    tokens: list[list[int]]  # s_1..s_k + t* per row

    def rows(self, at: list[int]) -> "RoundResult":
        """The result of rows ``at`` only, in that order."""
        return RoundResult([self.accepted[j] for j in at], [self.bonus[j] for j in at],
                           [self.accepted_mask[j] for j in at], [self.tokens[j] for j in at])


def read_round(draft_tokens: torch.Tensor, outcome: VerifyOutcome) -> RoundResult:
    """The round's outcome on the host: its only device-to-host synchronisation."""
    b, k = draft_tokens.shape
    parts = [outcome.accepted[:, None], outcome.bonus[:, None], outcome.accepted_mask.long()]
    if draft_tokens.device.type == "cpu":  # already here
        host = torch.cat(parts, dim=1).tolist()  # [b, 2 + K]
        drafts = draft_tokens.tolist()
    else:
        host = torch.cat(parts + [draft_tokens.to(outcome.bonus.device)], dim=1).tolist()
        drafts = [r[2 + k:] for r in host]
    return RoundResult([r[0] for r in host], [r[1] for r in host], [r[2:2 + k] for r in host],
                       [d[:r[0]] + [r[1]] for r, d in zip(host, drafts)])


def commit_round(seqs, result: RoundResult) -> None:
    """Commit s_1..s_k + t* per row (stop rules may cut it short)."""
    for q, toks in zip(seqs, result.tokens):
        q.commit(toks)
