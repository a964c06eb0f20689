"""Autoregressive decoding on the leader: prefill, then one target forward per token."""

from __future__ import annotations

import time

from ssdlib.engine.batching import last_index, pack_rows, slots_tensor
from ssdlib.engine.sampler import sample_rows


def prefill(target, seqs, device):
    """Run every committed token of ``seqs`` through ``target`` (filling their KV slots).

    Returns logits [b, V] at each row's last position: the distribution of its next token.
    """
    rows = [q.tokens for q in seqs]
    ids, pos = pack_rows(rows, [0] * len(rows), device)
    logits = target.forward(ids, pos, slots_tensor(seqs, device),
                            last_index([len(r) for r in rows], device))
    return logits[:, 0]


def ar_step(target, seqs, device) -> None:
    """One decode step for every sequence: feed the last committed token, commit the next."""
    ids, pos = pack_rows([[q.tokens[-1]] for q in seqs], [len(q.tokens) - 1 for q in seqs], device)
    logits = target.forward(ids, pos, slots_tensor(seqs, device))[:, 0]
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
        logits = prefill(self.target, seqs, self.device)
        for q, t in zip(seqs, sample_rows(logits, seqs)):
            q.commit([t])

    def step(self, seqs) -> None:
        t0 = time.perf_counter()
        ar_step(self.target, seqs, self.device)
        dt = time.perf_counter() - t0
        for q in seqs:
            q.metrics["verify_s"] = q.metrics.get("verify_s", 0.0) + dt
