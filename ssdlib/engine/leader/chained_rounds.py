"""Chained rounds: SSD on one GPU with the host a round behind the device (stream placement,
greedy rows).

In a plain SSD round the host reads the verify's outcome (k, t*), waits for the cache build,
looks the next speculation up in its copy of the cache, sends the OUTCOME, the speculator
launches the next build, and only then does the next verify start: the host's work and the
build's tail sit between two verifies. A chained round is launched *before* the host has read
the round it follows, and everything between two verifies happens on the device:

1. the leader's stream waits for the speculator's build of the round in flight (its cache);
2. :meth:`~ssdlib.engine.speculator.spec_cache.SpeculationCache.lookup`: each row's outcome
   (k, t*), still on the device, against the cache: a hit's branch tokens are the next
   speculation; a miss takes placeholder tokens (zeros: a greedy verify is exact whatever it
   is given, and such a round still commits its bonus token); the committed length
   n + k + 1 and the verify's ids and positions follow on the device;
3. the speculator's build of the new speculation (``TreeBuildStep.run_chained``) is launched on
   its stream behind that lookup, and the verify forward and the acceptance on the leader's;
4. the round's outcome, speculation and lookup result are copied to pinned host memory.

The host then reads the round before (its outcome is ready or nearly so), commits it and
returns to the scheduler, which streams the tokens and calls the next step: by then the GPU is
busy with the chained round, and the host enqueues the one after it. Per step the host reads
round r and launches round r + 1, so the GPU never waits for the host's Python in steady
state; what bounds a round is the longer of the verify and the build, beside each other.

A chain runs while its rows stay the same and all of them are greedy. Any change (a row
finishes or is cancelled, a row joins, sampling) ends it: the round in flight is discarded
(read and dropped: a greedy verification repeated later gives the same tokens) and the
speculator's rows are reset to the committed tokens (``ChainEnd``); the next exchange asks it
for a just-in-time draft, as after an admission. Off with ``SSDLIB_CHAINED_ROUNDS=0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ssdlib import env
from ssdlib.distributed.protocol import ChainedRound, ChainEnd
from ssdlib.engine.batching import slots_tensor
from ssdlib.engine.leader.verify import RoundResult
from ssdlib.speculative.acceptance import verify_greedy

# A row of the chain's pinned read-back buffer: k, t*, hit, branch, then the speculation [K].
HEAD = 4


def chained_rounds_on() -> bool:
    """``SSDLIB_CHAINED_ROUNDS`` (default on)."""
    return env.flag("SSDLIB_CHAINED_ROUNDS")


@dataclass
class Flight:
    """A round launched and not read yet: its outcome on the device, where its read-back
    lands and when it is there."""

    seqs: list  # the rows (Sequence), in the round's order
    accepted: torch.Tensor  # [b] device
    bonus: torch.Tensor  # [b] device
    host: torch.Tensor | None  # [b, HEAD + K] pinned read-back (None: the chain's first round)
    ready: object  # torch.cuda.Event after the read-back's copy (None on CPU)
    spec: list[list[int]] | None = None  # a first round's speculation, on the host already
    meter: tuple | None = None  # ChainMeter events of the round


@dataclass
class ChainedResult:
    """A round read back: the verify's result, and where each row's speculation came from."""

    result: RoundResult
    hit: list[bool]  # the speculation came from the cache
    branch: list[int]  # its cache branch


class ChainMeter:
    """Per chained round, on the GPU: the leader's stream from the round's start (the build it
    waited for is done) to the end of its acceptance, and the speculator's build span; their
    intersection is the build time the verify hides. Read when the round is read."""

    def __init__(self):
        self._free: list[tuple] = []
        self.rounds = 0
        self.build_s = self.verify_s = self.hidden_s = 0.0

    def events(self) -> tuple:
        if self._free:
            return self._free.pop()
        return tuple(torch.cuda.Event(enable_timing=True) for _ in range(4))

    def read(self, events: tuple) -> None:
        v0, v1, b0, b1 = events
        b1.synchronize()
        v1.synchronize()
        ms = v0.elapsed_time
        verify, start, end = ms(v1), ms(b0), ms(b1)
        self.rounds += 1
        self.verify_s += verify / 1e3
        self.build_s += (end - start) / 1e3
        self.hidden_s += max(0.0, min(verify, end) - max(0.0, start)) / 1e3
        self._free.append(events)

    def take(self) -> dict:
        """Mean ms per measured round since the last take (as ``OverlapMeter.take``)."""
        n = self.rounds
        out = {"rounds": n, "verify_ms": 1e3 * self.verify_s / n if n else 0.0,
               "build_ms": 1e3 * self.build_s / n if n else 0.0,
               "hidden_ms": 1e3 * self.hidden_s / n if n else 0.0}
        self.rounds, self.build_s, self.verify_s, self.hidden_s = 0, 0.0, 0.0, 0.0
        return out


class ChainedRounds:
    """The leader's side of chained rounds (see the module doc) over a
    :class:`~ssdlib.distributed.local_link.LocalLink` whose speculator keeps a cache."""

    def __init__(self, target, link, k: int, device, max_batch: int, max_len: int):
        self.target, self.link, self.K = target, link, k
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.max_len = max_len  # positions a verify may write (the target's KV cache)
        self.flight: Flight | None = None
        # two read-back buffers: round r + 1's copy is queued before round r's is read
        self._host = [torch.zeros(max_batch, HEAD + k, dtype=torch.int64, pin_memory=self.cuda)
                      for _ in range(2)]
        self._turn = 0
        self._arange = torch.arange(k + 1, device=self.device)
        self.meter = ChainMeter() if self.cuda else None

    # -- when a chain runs -------------------------------------------------------------------
    def fits(self, seqs) -> bool:
        """Whether rows ``seqs`` may run chained rounds: all greedy, and two rounds' positions
        past each row's committed tokens fit its KV cache (a chained round is launched before
        the round it follows is read)."""
        return all(q.params.greedy and len(q.tokens) + 2 * self.K + 2 <= self.max_len
                   for q in seqs)

    def continues(self, seqs) -> bool:
        """Whether the round in flight is for exactly these rows."""
        return self.flight is not None and len(seqs) == len(self.flight.seqs) and all(
            a is b for a, b in zip(seqs, self.flight.seqs))

    # -- a round -----------------------------------------------------------------------------
    def first(self, seqs, outcome, spec: list[list[int]]) -> None:
        """The chain's first round, launched as a plain round (verify of the speculation in
        hand ``spec``, the speculator's build beside it): keep it as the round in flight."""
        self.flight = Flight(list(seqs), outcome.accepted, outcome.bonus, None, None, spec)

    def launch(self, seqs, timer) -> Flight:
        """Launch the round after the one in flight (module doc, steps 1-4); ``seqs``' committed
        tokens are those before the round in flight. Returns the new round (kept as the round
        in flight by :meth:`read_previous`)."""
        prev, link, K = self.flight, self.link, self.K
        b = len(seqs)
        n = np.array([len(q.tokens) for q in seqs], dtype=np.int64)
        kv_len = int(n.max()) + 2 * K + 2  # > every position of this round and its build
        lengths = torch.from_numpy(n).to(self.device, non_blocking=True)
        slots = [q.slot for q in seqs]
        slot_ids = slots_tensor(seqs)
        rows = slot_ids.to(self.device, non_blocking=True)
        timer.start()
        meter = self.meter.events() if self.meter is not None else None
        if self.cuda:  # the cache for the round in flight's outcomes
            torch.cuda.current_stream(self.device).wait_event(link.built)
            meter[0].record()
        timer.mark("cache")
        hit, branch, tokens = link.cache.lookup(rows, prev.accepted, prev.bonus)
        spec = torch.where(hit.view(-1, 1), tokens, torch.zeros_like(tokens))  # [b, K]
        lengths = lengths + prev.accepted + 1                                  # committed n
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()
        link.build_chained(ChainedRound(slots, prev.bonus, spec, lengths, kv_len, ready),
                           meter[2:] if meter is not None else None)
        timer.mark("lookup")
        ids = torch.cat([prev.bonus.view(-1, 1), spec], dim=1)                 # [b, K+1]
        pos = (lengths - 1).view(-1, 1) + self._arange                          # [b, K+1]
        logits = self.target.forward(ids, pos, slot_ids, kv_len=kv_len)
        outcome = verify_greedy(spec, logits)
        host = self._host[self._turn][:b]
        self._turn ^= 1
        packed = torch.cat([outcome.accepted.view(-1, 1), outcome.bonus.view(-1, 1),
                            hit.view(-1, 1).long(), branch.view(-1, 1).long(), spec], dim=1)
        host.copy_(packed, non_blocking=self.cuda)
        done = None
        if self.cuda:
            meter[1].record()
            done = torch.cuda.Event()
            done.record()
        timer.mark("verify")
        return Flight(list(seqs), outcome.accepted, outcome.bonus, host, done, meter=meter)

    def read_previous(self, new: Flight) -> ChainedResult | None:
        """Read the round in flight back (waits for it), and keep ``new`` in flight instead.
        None for the chain's first round (its result is the caller's: a plain round's)."""
        prev, self.flight = self.flight, new
        return self._read(prev)

    def _read(self, flight: Flight) -> ChainedResult | None:
        if flight.host is None:
            return None
        if flight.ready is not None:
            flight.ready.synchronize()
        rows = flight.host.tolist()
        K = self.K
        accepted = [r[0] for r in rows]
        bonus = [r[1] for r in rows]
        spec = [r[HEAD:HEAD + K] for r in rows]
        mask = [[1] * k + [0] * (K - k) for k in accepted]
        result = RoundResult(accepted, bonus, mask,
                             [s[:k] + [t] for s, k, t in zip(spec, accepted, bonus)])
        if flight.meter is not None:
            self.meter.read(flight.meter)
        return ChainedResult(result, [bool(r[2]) for r in rows], [r[3] for r in rows])

    def end(self, seqs) -> list:
        """End the chain: the round in flight is discarded (waited for, its tokens dropped),
        and the speculator's rows ``seqs`` (those still running) are reset to the committed
        tokens. Returns the rows that must ask for a fresh speculation (all of ``seqs``)."""
        flight, self.flight = self.flight, None
        if flight is None:
            return []
        if flight.ready is not None:
            flight.ready.synchronize()
        if flight.meter is not None:
            self.meter.read(flight.meter)
        live = list(seqs)
        self.link.end_chain(ChainEnd([q.slot for q in live], [list(q.tokens[:-1]) for q in live]))
        return live
