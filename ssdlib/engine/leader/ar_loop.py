"""Autoregressive decoding on the leader: prefill, then one target forward per token."""

from __future__ import annotations

from ssdlib.engine.batching import pack_rows, prefill, slots_tensor
from ssdlib.engine.sampler import sample_rows
from ssdlib.engine.timing import RoundTimer


def admit_with_first_token(target, seqs, device) -> None:
    """Prefill new sequences on the target and commit the token each one samples first."""
    logits = prefill(target, seqs)
    for q, t in zip(seqs, sample_rows(logits, seqs)):
        q.commit([t])


def next_token_logits(target, seqs):
    """AR's forward: each row's last committed token at its position -> logits [b, V] of the
    token after it."""
    ids, pos = pack_rows([[q.tokens[-1]] for q in seqs], [len(q.tokens) - 1 for q in seqs])
    return target.forward(ids, pos, slots_tensor(seqs))[:, 0]


def ar_step(target, seqs, timer: RoundTimer) -> None:
    """One decode step for every sequence: feed the last committed token, commit the next."""
    timer.start()
    logits = next_token_logits(target, seqs)
    timer.flush()  # the last round's phases, read while this forward runs
    tokens = sample_rows(logits, seqs)  # the step's read-back
    timer.mark("verify")
    for q, t in zip(seqs, tokens):
        q.commit([t])
        q.metrics["rounds"] += 1
    timer.mark("host")
    timer.add_to(seqs, defer=True)


class ARLoop:
    """Mode ``ar``: one target forward per token."""

    lookahead = 1  # positions a step may write past the committed length

    def __init__(self, target, device):
        self.target = target
        self.device = device
        self.timer = RoundTimer(device)

    def admit(self, seqs) -> None:
        admit_with_first_token(self.target, seqs, self.device)

    def step(self, seqs) -> None:
        ar_step(self.target, seqs, self.timer)
