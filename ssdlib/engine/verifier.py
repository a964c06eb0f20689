"""The verifier side (leader rank) of a leader <-> speculator link: verify the speculation in hand,
send the outcome, receive the next speculation.

Two roles share the loop (:class:`LinkVerifier`): :class:`SSDVerifier` (mode ``ssd``: the next
speculation comes at once on a cache hit) and :class:`SeparateDraftVerifier` (mode ``sd`` with
``--draft-placement separate``: plain SD, the draft drafts every speculation after the outcome).

Continuous batching: rows are identified by their KV slot; sequences join (ADMIT + a first
exchange) and leave (an inactive outcome) at any time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ssdlib.engine.ar_loop import admit_with_first_token
from ssdlib.engine.metrics import (record_acceptance, record_lookup, record_source,
                                   speculation_source)
from ssdlib.engine.protocol import Admit, AdmitRow, Outcome, SpeculatorStats
from ssdlib.engine.spec_link import SpecLink
from ssdlib.engine.timing import RoundTimer
from ssdlib.engine.verify import commit_round, read_round, verify_round
from ssdlib.loading import load_checkpoint
from ssdlib.loading.compat import check_draft_compatible
from ssdlib.speculative.acceptance import DraftQ, QKind


@dataclass
class SpecInHand:
    """A row's speculation received for the next verify."""

    tokens: torch.Tensor  # [K] int64, host
    kind: int  # QKind of q
    q: torch.Tensor | None  # [K, V] float32 on the device, when the exchange sampled
    source: str  # "cache", the fallback's name, or "first" (a sequence's first speculation)


class LinkVerifier:
    """The leader's loop for speculations drafted on another rank (the ``loop`` of a Leader)."""

    def __init__(self, target, link: SpecLink, k: int, device):
        self.target = target
        self.link = link
        self.k = k
        self.device = device
        self.lookahead = k + 1
        self.limit: int | None = None  # set by the Leader
        self.spec: dict[int, SpecInHand] = {}  # the speculation in hand per slot
        self._leaving: list[int] = []  # slots released without an inactive outcome yet
        # the STATS received since the batch metrics were last read, summed
        self._stats: SpeculatorStats | None = None
        self._stats_read = False
        self.timer = RoundTimer(device)

    def admit(self, seqs) -> None:
        # a slot that left and is taken again needs no leaving notice: ADMIT replaces its row
        taken = {q.slot for q in seqs}
        self._leaving = [s for s in self._leaving if s not in taken]
        # the speculator prefills the draft while the target prefills here
        self.link.send_admit(Admit([AdmitRow(q.slot, list(q.tokens), q.request.stream_salt,
                                             q.params) for q in seqs]))
        admit_with_first_token(self.target, seqs, self.device)
        self._exchange(seqs, [(0, q.tokens[-1]) for q in seqs], first=True)

    def _alive(self, q) -> bool:
        return not q.finished and (self.limit is None or len(q.tokens) < self.limit)

    def _record_lookup(self, q, k: int, hit: bool, kind: int) -> None:
        """A speculation answering outcome k arrived (not a sequence's first)."""

    def _exchange(self, seqs, outcomes, first: bool = False) -> None:
        """Send (slot, k, t*, active) per row and receive the next speculation of the live ones."""
        alive = [self._alive(q) for q in seqs]
        leaving, self._leaving = self._leaving, []
        gone = [0] * len(leaving)
        msg = Outcome([q.slot for q in seqs] + leaving, [k for k, _ in outcomes] + gone,
                      [t for _, t in outcomes] + gone, alive + [False] * len(leaving),
                      sampling=any(a and not q.params.greedy for q, a in zip(seqs, alive)))
        self.link.send_outcome(msg)
        for q, a in zip(seqs, alive):
            if not a:
                self.spec.pop(q.slot, None)
        if not any(alive):
            self._take_stats(self.link.recv_stats())
            return
        t0 = time.perf_counter()
        spec = self.link.recv_spec(len(msg.slots), msg.sampling)
        kinds, hits = spec.kinds.tolist(), spec.hit.tolist()  # on the host already
        if first:  # admission (a round's wait is timed by the round's timer)
            waited = time.perf_counter() - t0
            for q in seqs:
                q.metrics["wait_s"] = q.metrics.get("wait_s", 0.0) + waited
        for i, (q, (k, _), a) in enumerate(zip(seqs, outcomes, alive)):
            if not a:
                continue
            source = "first" if first else speculation_source(bool(hits[i]), kinds[i])
            self.spec[q.slot] = SpecInHand(spec.tokens[i], kinds[i],
                                           None if spec.q is None else spec.q[i], source)
            if not first:  # a first speculation cannot come from the cache
                self._record_lookup(q, k, bool(hits[i]), kinds[i])

    def _take_stats(self, stats: SpeculatorStats) -> None:
        """Keep the STATS since the batch metrics were last read (a call that empties the
        batch several times, e.g. one row at a time, gets STATS each time)."""
        if self._stats is not None and not self._stats_read:
            stats = self._stats.plus(stats)
        self._stats, self._stats_read = stats, False

    def _draft_q(self, active) -> DraftQ | None:
        """The q of the speculations in hand (None when every row is greedy)."""
        if all(q.params.greedy for q in active):
            return None
        kinds, probs = [], []
        for q in active:
            hand = self.spec[q.slot]
            kind, q_probs = hand.kind, hand.q
            if q_probs is None:
                # received in an exchange without sampling rows: a greedy row, whose draft
                # tokens are argmaxes, i.e. drawn from a one-hot q
                if kind == QKind.DENSE:
                    kind = int(QKind.ONEHOT)
                q_probs = torch.zeros(self.k, self.link.vocab_size, device=self.device)
            kinds.append(kind)
            probs.append(q_probs)
        return DraftQ.per_row(kinds, torch.stack(probs).to(self.device))

    def step(self, active) -> None:
        timer = self.timer
        timer.start()
        tokens = torch.stack([self.spec[q.slot].tokens for q in active])  # [b, K]
        outcome = verify_round(self.target, active, tokens, self._draft_q(active), self.device)
        result = read_round(tokens, outcome)
        timer.mark("verify")
        commit_round(active, result)
        record_acceptance(active, result, self.k)
        for q, accepted in zip(active, result.accepted):
            record_source(q.metrics, self.spec[q.slot].source, accepted)
        timer.mark("host")
        self._exchange(active, list(zip(result.accepted, result.bonus)))
        timer.mark("wait")  # the next speculation is in hand (at once on a cache hit)
        timer.add_to(active)

    def release(self, seq) -> None:
        if self.spec.pop(seq.slot, None) is not None:
            self._leaving.append(seq.slot)  # tell the speculator with the next outcome

    def settle(self) -> None:
        """No row is running: tell the speculator about the rows that left (cancelled), so it
        is idle too (it answers an outcome without active rows with STATS)."""
        if self._leaving:
            self._exchange([], [])

    def batch_metrics(self) -> dict:
        """The speculator's metrics over the STATS since the last read (the next STATS starts
        afresh); a copy per call, its dicts too."""
        self._stats_read = True
        stats = self._stats
        if stats is None:
            return {}
        idle, busy, hits, rounds = stats.idle_s, stats.busy_s, stats.hits, stats.rounds
        return {
            "speculator_idle_frac": idle / (idle + busy) if idle + busy else 0.0,
            "branch_kv_reused_frac": stats.reused / hits if hits else 0.0,
            # per OUTCOME round answered (a sequence's first included), phases of SPEC_PHASES
            "speculator_rounds": rounds,
            "speculator_ms_per_round": {p: 1e3 * t / rounds if rounds else 0.0
                                        for p, t in stats.phase_s.items()}}

    def close(self) -> None:
        self.link.send_shutdown()


class SSDVerifier(LinkVerifier):
    """Mode ``ssd``: each speculation comes from the speculation cache (hit) or a fallback."""

    def _record_lookup(self, q, k: int, hit: bool, kind: int) -> None:
        record_lookup(q.metrics, k, hit, kind)


class SeparateDraftVerifier(LinkVerifier):
    """Mode ``sd`` with the draft on its own rank: every speculation is drafted just in time after
    the outcome (no cache, so no lookups to record)."""


def _link(cfg, world, target_ck) -> SpecLink:
    check_draft_compatible(target_ck, load_checkpoint(cfg.draft))
    return SpecLink(world.spec_group, world.speculator_rank, world.device, cfg.max_batch, cfg.k,
                    target_ck.config.vocab_size, staged=world.spec_staged)


def build_ssd_verifier(cfg, world, target, target_ck):
    loop = SSDVerifier(target, _link(cfg, world, target_ck), cfg.k, world.device)
    return loop, loop.close


def build_separate_draft_verifier(cfg, world, target, target_ck):
    loop = SeparateDraftVerifier(target, _link(cfg, world, target_ck), cfg.k, world.device)
    return loop, loop.close
