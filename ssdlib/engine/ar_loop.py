"""Autoregressive decoding on the leader: prefill, then one target forward per token."""

from __future__ import annotations

import time

from ssdlib.engine.batching import pack_rows, prefill, slots_tensor
from ssdlib.engine.sampler import sample_rows


def admit_with_first_token(target, seqs, device) -> None:
    """Prefill new sequences on the target and commit the token each one samples first."""
    logits = prefill(target, seqs)
    for q, t in zip(seqs, sample_rows(logits, seqs)):
        q.commit([t])


def ar_step(target, seqs, device) -> None:
    """One decode step for every sequence: feed the last committed token, commit the next."""
    ids, pos = pack_rows([[q.tokens[-1]] for q in seqs], [len(q.tokens) - 1 for q in seqs])
    logits = target.forward(ids, pos, slots_tensor(seqs))[:, 0]
    for q, t in zip(seqs, sample_rows(logits, seqs)):
        q.commit([t])
        q.metrics["rounds"] += 1


class ARLoop:
    """Mode ``ar``: one target forward per token."""

    lookahead = 1  # positions a step may write past the committed length

    def __init__(self, target, device):
        self.target = target
        self.device = device

    def admit(self, seqs) -> None:
        admit_with_first_token(self.target, seqs, self.device)

    def step(self, seqs) -> None:
        t0 = time.perf_counter()
        ar_step(self.target, seqs, self.device)
        dt = time.perf_counter() - t0
        for q in seqs:
            q.metrics["verify_s"] = q.metrics.get("verify_s", 0.0) + dt
