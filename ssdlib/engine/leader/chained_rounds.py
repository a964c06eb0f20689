"""Chained rounds: SSD on one GPU with the host a round behind the device (stream placement,
at most ``protocol.chain_max_rows()`` rows).

In a plain SSD round the host reads the verify's outcome (k, t*), waits for the cache build,
looks the next speculation up in its copy of the cache, sends the OUTCOME, the speculator
launches the next build, and only then does the next verify start: the host's work and the
build's tail sit between two verifies. A chained round is launched *before* the host has read
the round it follows, and everything between two verifies happens on the device:

1. the leader's stream waits for the speculator's build of the round in flight (its cache),
   then replays one captured step: :func:`~ssdlib.engine.speculator.spec_cache.next_speculation`
   (each row's outcome (k, t*), still on the device, against the cache: a hit's branch tokens
   are the next speculation; a miss takes placeholder tokens, zeros: a greedy verify is exact
   whatever it is given, and such a round still commits its bonus token; the committed length
   n + k + 1), the verify forward over t* and the speculation, the acceptance, and the
   outcome written to the chain's state (``protocol.ChainState``);
2. the speculator's stream waits for the round in flight's verify (its outcome) and replays
   its captured build (``TreeBuildStep.run_chained``): the same lookup from the same inputs,
   then the build of the new speculation's likely outcomes;
3. the round's outcome, speculation and lookup result are copied to pinned host memory.

Both captured steps read round r's state and cache and write round r + 1's: the state and the
cache are double-buffered by the round's parity (the speculator's main cache and a second one),
so the build of round r + 1 never overwrites what the verify of round r + 1 still reads. Per
round the host makes a few driver calls (two replays, four events, one copy).

The host then reads the round before (its outcome is ready or nearly so), commits it and
returns to the scheduler, which streams the tokens and calls the next step: by then the GPU is
busy with the chained round, and the host enqueues the one after it. Per step the host reads
round r and launches round r + 1, so the GPU never waits for the host's Python in steady
state; what bounds a round is the longer of the verify and the build, beside each other.

A chain runs for at most ``protocol.chain_max_rows()`` rows, all greedy or, with
``SSDLIB_CHAIN_SAMPLED`` (default on), some sampling: their acceptance is then
exact speculative sampling on the device, a hit's q read from the cache (the build stores the
q each branch token was drawn from), a miss's proposal deterministic (ONEHOT), the draws taken
from each row's stream at a position kept in the state (``ChainState.draws``; the host reserves
the same draws, so that the streams go on where the chain leaves them).

Rows come and go between two rounds without ending it (:meth:`ChainedRounds.regroup`): a row
that ends stays in the round in flight (the host drops its tokens past the end) and becomes a
ghost row at the next launch; a new sequence, prefilled after the host has waited for the round
in flight, joins at the next launch in a ghost row's place or after the last row, its state
written on the leader's stream as if its last round had accepted nothing and ended with its
first token (its caches empty: its first speculation is the n-gram proposal over its prompt),
and the speculator takes the new rows before its next build (``ChainRegroup``). The chain ends
when its batch has ended, outgrows the bound, or a joining row's sampling kind (greedy or not)
differs from the chain's, whose captured steps are of one kind: the round in flight is then
discarded (read and dropped: the decision to end never depends on that round's draws, so
verifying its rows again later is exact; a greedy one gives the same tokens) and the
speculator's rows are reset to the committed tokens (``ChainEnd``); the next exchange asks it
for a just-in-time draft, as after an admission. Off with ``SSDLIB_CHAINED_ROUNDS=0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssdlib import env
from ssdlib.distributed import protocol
from ssdlib.distributed.local_link import OverlapMeter
from ssdlib.distributed.protocol import (ChainEnd, ChainRegroup, ChainStart, ChainState,
                                         commit_history)
from ssdlib.engine.batching import slots_tensor
from ssdlib.engine.leader.verify import RoundResult
from ssdlib.engine.runner.static_inputs import batch_bucket
from ssdlib.engine.runner.step_graphs import GHOST_ROW, any_bucket_facts
from ssdlib.engine.speculator.spec_cache import next_speculation
from ssdlib.ops.row_top import row_argmax
from ssdlib.sampling import SamplingTensors, target_distributions
from ssdlib.speculative.acceptance import DraftQ, QKind, accept_greedy, verify_sampled
from ssdlib.speculative.rng import RowStreams

# A row of the chain's read-back: k, t*, hit, branch, n-gram, then the speculation [K].
HEAD = 5


def chained_rounds_on() -> bool:
    """``SSDLIB_CHAINED_ROUNDS`` (default on)."""
    return env.flag("SSDLIB_CHAINED_ROUNDS")


def verify_chained(spec: torch.Tensor, logits: torch.Tensor, hit: torch.Tensor,
                   q_cached: torch.Tensor, table: torch.Tensor, facts, streams: RowStreams):
    """A chained round's acceptance on the device where some row samples (a greedy chain
    takes ``greedy_tail``): exact speculative sampling of speculation ``spec`` [rows, K]
    against ``logits`` [rows, K+1, V]:
    a hit's tokens were drawn from the cache's q (``q_cached`` [rows, K, V], DENSE), a miss's
    are a deterministic proposal (the n-gram's or placeholder zeros: ONEHOT); the rows'
    parameters from ``table`` [rows, 4] (``SamplingTensors.host_table``), the draws from
    ``streams`` (K + 1 a row)."""
    p = target_distributions(logits, SamplingTensors.from_table(table, facts))
    kinds = torch.where(hit, int(QKind.DENSE), int(QKind.ONEHOT))
    return verify_sampled(spec, DraftQ.computed(kinds, q_cached), p, generators=streams)


def record_round(k_into, bonus_into, n_into, spec_into, history, pack, accepted, bonus, n,
                 spec, hit, branch, ngram) -> None:
    """A chained round's outcome written on the device: into its index of the chain's state
    (``k_into`` .. ``spec_into``: ``ChainState``'s k, bonus, n, spec at the round's parity,
    the batch's rows), its committed tokens into the rows' ``history`` (the next round's
    n-gram fallback reads them), and its read-back row ``pack`` [rows, HEAD + K]: k, t*, hit,
    branch, n-gram, the speculation."""
    k_into.copy_(accepted)
    bonus_into.copy_(bonus)
    n_into.copy_(n)
    spec_into.copy_(spec)
    commit_history(history, n, accepted, spec, bonus)
    pack.copy_(torch.cat([accepted.view(-1, 1), bonus.view(-1, 1), hit.view(-1, 1).long(),
                          branch.view(-1, 1).long(), ngram.view(-1, 1).long(), spec], dim=1))


def greedy_tail(k_into, bonus_into, n_into, spec_into, history, pack, spec, best, n, hit, branch,
                ngram) -> None:
    """A greedy chained round after the target's argmax ``best`` [rows, K+1]: the acceptance
    (``accept_greedy``, every row drafted K) and :func:`record_round`."""
    limit = torch.full_like(n, spec.shape[1])
    out = accept_greedy(spec, best, limit)
    record_round(k_into, bonus_into, n_into, spec_into, history, pack, out.accepted, out.bonus,
                 n, spec, hit, branch, ngram)


_compiled: dict = {}  # torch.compile of a round's tail, by function, made on first use


def maybe_compiled(fn, compiled: bool):
    """``fn`` through ``torch.compile`` where the steps compile (``compiled``) and
    ``SSDLIB_CHAIN_COMPILE`` is on, else ``fn``: a greedy round's acceptance and records are
    some thirty small kernels eagerly, a few fused ones compiled."""
    if not (compiled and env.flag("SSDLIB_CHAIN_COMPILE")):
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


@dataclass
class Flight:
    """A round launched and not read yet."""

    seqs: list  # the chain's rows (Sequence; None: a ghost row), in the round's order
    parity: int  # where its state, cache and read-back are
    chained: bool  # False: the chain's first round (a plain round; the caller reads it)
    meter: tuple | None = None  # ChainMeter events of the round
    fan: tuple | None = None  # its build's fan-out (the next round's lookups read that cache)
    looked_up: tuple | None = None  # the fan-out of the cache its lookups read (None: unknown)


@dataclass
class ChainedResult:
    """A round read back: the verify's result, and where each row's speculation came from."""

    result: RoundResult
    hit: list[bool]  # the speculation came from the cache
    branch: list[int]  # its cache branch
    ngram: list[bool]  # a miss's speculation was an n-gram proposal (else placeholder zeros)
    looked_up: tuple | None = None  # the fan-out of the cache its lookups read (None: unknown)


class ChainMeter(OverlapMeter):
    """Per chained round, on the GPU: the leader's stream from the round's start (the build it
    waited for is done) to the end of its acceptance, and the speculator's build span; their
    intersection is the build time the verify hides (``OverlapMeter``'s sums, one set of
    events per round in flight). Read when the round is read."""

    def __init__(self):
        super().__init__()
        self._free: list[tuple] = []

    def events(self) -> tuple:
        if self._free:
            return self._free.pop()
        return tuple(torch.cuda.Event(enable_timing=True) for _ in range(4))

    def read_round(self, events: tuple) -> tuple[float, float]:
        """The round's (verify span, build span) in ms, added to the sums."""
        times = self.add(events)
        self._free.append(events)
        return times


class ChainedRounds:
    """The leader's side of chained rounds (see the module doc) over a
    :class:`~ssdlib.distributed.local_link.LocalLink` whose speculator keeps a cache; the
    target runs on this rank alone (TP 1)."""

    def __init__(self, target, link, k: int, device, max_batch: int):
        self.target, self.link, self.K = target, link, k
        self.runner = target.runner
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.max_len = self.runner.cache.max_len  # positions a verify may write
        self.graphs = self.runner.graphs  # None: every step eager (CPU)
        rows = batch_bucket(max_batch)
        self.state = ChainState.empty(rows, k, self.max_len, self.device)
        self.slots = torch.full((rows,), self.runner.scratch_slot, dtype=torch.int64,
                                device=self.device)
        # sampling rows' parameters (greedy ghost rows past the batch) and what the host knows
        # of them (None: a greedy chain)
        self.table = torch.tensor(GHOST_ROW, device=self.device).repeat(rows, 1)
        self.facts = None
        self.pack = torch.zeros(2, rows, HEAD + k, dtype=torch.int64, device=self.device)
        self.host = torch.zeros(2, rows, HEAD + k, dtype=torch.int64, pin_memory=self.cuda)
        self.flight: Flight | None = None
        events = (lambda: [torch.cuda.Event(), torch.cuda.Event()]) if self.cuda else \
            (lambda: [None, None])
        # per parity: the verify's outcome written, its read-back copied, the build done
        self.verified, self.copied, self.built = events(), events(), events()
        self.meter = ChainMeter() if self.cuda else None
        # since the last read: chains started (each after a jit draft and a plain round), rows
        # that joined a running chain
        self.counts = {"chains": 0, "joins": 0}

    # -- when a chain runs -------------------------------------------------------------------
    def fits(self, seqs) -> bool:
        """Whether rows ``seqs`` may run chained rounds: at most ``protocol.chain_max_rows()``,
        all greedy unless ``SSDLIB_CHAIN_SAMPLED`` (default on), and two rounds' positions past
        each row's committed tokens fit its KV cache (a chained round is launched before the
        round it follows is read)."""
        sampled = env.flag("SSDLIB_CHAIN_SAMPLED")
        return len(seqs) <= protocol.chain_max_rows() and all(
            (sampled or s.params.greedy) and len(s.tokens) + 2 * self.K + 2 <= self.max_len
            for s in seqs)

    def _facts_of(self, params) -> object:
        """The chain's sampling kind for rows of ``params``: None when every row is greedy."""
        return None if all(p.greedy for p in params) else any_bucket_facts(params)

    def may_join(self, seqs, joining) -> bool:
        """Whether new sequences ``seqs`` (admitted, not yet stepped) may join the running
        chain, beside the rows ``joining`` already waiting to: the chain's rows still running
        and those fit its largest batch, every row's sampling kind is the chain's, and their
        positions fit the KV cache."""
        if self.flight is None:
            return False
        rows = [s for s in self.flight.seqs if s is not None and not s.finished]
        rows += list(joining) + list(seqs)
        return self.fits(rows) and self._facts_of([s.params for s in rows]) == self.facts

    def regroup(self, active, joining) -> list | None:
        """The chain's rows for its next round when the batch ``active`` differs from the
        round in flight's rows only by rows that ended (their places become ghost rows) and
        rows of ``joining`` (new sequences: they take the ghost places first, then places
        after the last). None when the chain cannot go on with them."""
        if self.flight is None:
            return None
        live = {id(s) for s in active}
        rows = [s if s is not None and id(s) in live else None for s in self.flight.seqs]
        kept = {id(s) for s in rows if s is not None}
        waiting = {id(s) for s in joining}
        for s in active:
            if id(s) in kept:
                continue
            if id(s) not in waiting:
                return None
            if None in rows:
                rows[rows.index(None)] = s
            else:
                rows.append(s)
        while rows and rows[-1] is None:
            rows.pop()
        if not rows or len(rows) > protocol.chain_max_rows():
            return None
        if self._facts_of([s.params for s in rows if s is not None]) != self.facts:
            return None
        return rows

    def settle_flight(self) -> None:
        """Wait (on the host) until the round in flight and its build have run (before an
        admission's prefill while the chain goes on)."""
        if self.cuda and self.flight is not None:
            self.copied[self.flight.parity].synchronize()
            self.built[self.flight.parity].synchronize()

    # -- a round -----------------------------------------------------------------------------
    def first(self, seqs, outcome, spec: torch.Tensor) -> None:
        """The chain's first round was launched as a plain round (the speculation in hand
        verified, the speculator's build into its main cache beside it): its outcome becomes
        the state at parity 0, and the speculator starts reading the state. Sampling rows:
        their parameters, and their streams where the first round left them."""
        b = len(seqs)
        st = self.state
        params = [s.params for s in seqs]
        self.facts = self._facts_of(params)
        sampling = self.facts is not None
        if sampling:
            self.table[b:] = torch.tensor(GHOST_ROW, device=self.device)
            self.table[:b].copy_(SamplingTensors.host_table(params), non_blocking=True)
            st.start_streams(0, RowStreams.reserve_host([s.stream for s in seqs], 0))
            # (the speculator allocates the caches' q at the chain's start, before any capture)
        self.slots.fill_(self.runner.scratch_slot)
        self.slots[:b].copy_(slots_tensor(seqs), non_blocking=True)
        st.real.zero_()
        st.real[:b] = True
        st.n[0].fill_(1)
        st.n[0, :b].copy_(torch.tensor([len(s.tokens) for s in seqs]), non_blocking=True)
        st.k[0].zero_()
        st.k[0, :b] = outcome.accepted
        st.bonus[0].zero_()
        st.bonus[0, :b] = outcome.bonus
        st.spec[0].zero_()
        st.spec[0, :b].copy_(spec, non_blocking=True)
        width = max(len(s.tokens) for s in seqs)
        history = torch.zeros(b, width, dtype=torch.int64)
        for i, s in enumerate(seqs):
            history[i, :len(s.tokens)] = torch.tensor(s.tokens)
        st.history[:b, :width].copy_(history, non_blocking=True)
        st.commit(0, b)  # the first round's tokens, as a chained round writes its own
        if self.cuda:
            self.verified[0].record()
        self.built[0] = self.link.built  # the plain build's end
        self.link.start_chain(ChainStart([s.slot for s in seqs], st, sampling))
        self.flight = Flight(list(seqs), 0, False)
        self.counts["chains"] += 1

    def _verify_body(self, rows: int, p: int, kv_len: int) -> None:
        """Round r + 1's verify (parity p) from round r's state and cache (the captured
        step's body)."""
        before, st, r, K = 1 - p, self.state, self.runner, self.K
        slots = self.slots[:rows]
        cache = self.link.chain_caches()[before]
        hit, branch, spec, n, ngram = next_speculation(cache, slots, st, before, rows,
                                                       r.compiles)
        logits = r.speculation_step(st.bonus[before, :rows], spec, n, slots, kv_len)
        into = (st.k[p, :rows], st.bonus[p, :rows], st.n[p, :rows], st.spec[p, :rows],
                st.history[:rows], self.pack[p, :rows])
        if self.facts is None:  # [rows, K+1, V]
            tail = maybe_compiled(greedy_tail, r.compiles)
            tail(*into, spec, row_argmax(logits), n, hit, branch, ngram)
            return
        draws = st.draws[before, :rows, 0]
        streams = RowStreams(st.keys[:rows, 0], draws, K + 1)
        out = verify_chained(spec, logits, hit, cache.q[slots, branch], self.table[:rows],
                             self.facts, streams)
        st.draws[p, :rows, 0] = draws + K + 1
        maybe_compiled(record_round, r.compiles)(*into, out.accepted, out.bonus, n, spec, hit,
                                                 branch, ngram)

    def _regroup_state(self, old: list, rows_of: list, before: int) -> bool:
        """Between two rounds (on the leader's stream, after the round in flight and its
        build): rows of ``old`` not in ``rows_of`` become ghost rows, new sequences in it join
        at index ``before`` of the state as if their last round had accepted nothing and
        ended with their first token (committed length = prompt + 1; their caches hold
        nothing, so their first speculation is the n-gram proposal over the prompt). Tells the
        speculator. Returns whether anything changed."""
        st, scratch = self.state, self.runner.scratch_slot
        width = max(len(old), len(rows_of))
        old = old + [None] * (width - len(old))
        new = rows_of + [None] * (width - len(rows_of))
        gone = [i for i in range(width) if old[i] is not None and new[i] is not old[i]]
        joined = [i for i in range(width) if new[i] is not None and new[i] is not old[i]]
        if not gone and not joined:
            return False
        for i in gone:
            st.real[i] = False
            self.slots[i] = scratch
            self.table[i] = torch.tensor(GHOST_ROW, device=self.device)
        caches = self.link.chain_caches()
        for i in joined:
            s = new[i]
            n = len(s.tokens) - 1
            st.real[i] = True
            self.slots[i] = s.slot
            st.n[before, i] = n
            st.k[before, i] = 0
            st.bonus[before, i] = s.tokens[-1]
            st.history[i, :n + 1].copy_(torch.tensor(s.tokens), non_blocking=True)
            for cache in caches:  # (the speculator's admission cleared them on its stream)
                cache.ready[s.slot] = False
            if self.facts is not None:
                self.table[i].copy_(SamplingTensors.host_table([s.params])[0],
                                    non_blocking=True)
                key, draw = RowStreams.reserve_host([s.stream], 0)[0].tolist()
                st.set_stream(0, before, i, key, draw)
        self.link.regroup_chain(ChainRegroup([s.slot if s is not None else -1 for s in rows_of],
                                             joined, before))
        self.counts["joins"] += len(joined)
        return True

    def launch(self, rows_of: list, timer) -> Flight:
        """Launch the round after the one in flight (module doc) for the chain's rows
        ``rows_of`` (the flight's, or :meth:`regroup`'s); their committed tokens are those
        before the round in flight. Returns the new round (kept in flight by
        :meth:`read_previous`)."""
        prev, link = self.flight, self.link
        before = prev.parity
        p = 1 - before
        seqs = [s for s in rows_of if s is not None]
        b = len(rows_of)
        rows = batch_bucket(b) if self.graphs is not None else b  # a captured step's bucket
        # > every position of this round and its build (a host bound: the lengths are the
        # device's); the in-place attention kernel reads the whole cache's length anyway
        kv_len = self.runner.kv_bucket(max(len(s.tokens) for s in seqs) + 2 * self.K + 2)
        timer.start()
        meter = self.meter.events() if self.meter is not None else None
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.built[before])
            meter[0].record()
        if self._regroup_state(prev.seqs, list(rows_of), before) and self.cuda:
            self.verified[before].record()  # the build reads the rows' new state after it
        timer.mark("cache")
        if self.graphs is None:
            self._verify_body(rows, p, kv_len)
        else:
            key = ("chain_verify", rows, p, kv_len, self.facts)
            self.graphs.capture(key, lambda _, r: self._verify_body(r, p, kv_len),
                                max_rows=protocol.chain_max_rows())
            self.graphs.pool.replay(key)
        if self.cuda:
            self.verified[p].record()
            meter[1].record()
        self.host[p, :b].copy_(self.pack[p, :b], non_blocking=self.cuda)
        if self.cuda:
            self.copied[p].record()
        timer.mark("verify")
        if self.facts is not None:  # the draws the verify took: the host's streams go on after
            for s in seqs:
                s.stream.reserve(self.K + 1)
        fan = link.build_chained(p, rows, kv_len, self.verified[before], self.built[p],
                                 meter[2:] if meter is not None else None)
        # this round's lookups read the cache the round in flight's build filled
        return Flight(list(rows_of), p, True, meter, fan, prev.fan)

    def read_previous(self, new: Flight) -> ChainedResult | None:
        """Read the round in flight back (waits for it), and keep ``new`` in flight instead.
        None for the chain's first round (its result is the caller's: a plain round's)."""
        prev, self.flight = self.flight, new
        return self._read(prev)

    def _read(self, flight: Flight) -> ChainedResult | None:
        if not flight.chained:
            return None
        p, b, K = flight.parity, len(flight.seqs), self.K
        if self.cuda:
            self.copied[p].synchronize()
        rows = self.host[p, :b].tolist()
        accepted = [r[0] for r in rows]
        bonus = [r[1] for r in rows]
        spec = [r[HEAD:HEAD + K] for r in rows]
        mask = [[1] * k + [0] * (K - k) for k in accepted]
        result = RoundResult(accepted, bonus, mask,
                             [s[:k] + [t] for s, k, t in zip(spec, accepted, bonus)])
        self._time_round(flight)
        return ChainedResult(result, [bool(r[2]) for r in rows], [r[3] for r in rows],
                             [bool(r[4]) for r in rows], flight.looked_up)

    def _time_round(self, flight: Flight) -> None:
        """A round read back (GPU): its verify and build spans into the meter's sums, and to the
        speculator's fan-out budget tuner with the budget its build took."""
        if flight.meter is not None:
            verify_ms, build_ms = self.meter.read_round(flight.meter)
            self.link.observe_build(sum(flight.fan), build_ms, verify_ms)

    def end(self, seqs) -> list:
        """End the chain: the round in flight is discarded (waited for, its tokens dropped),
        and the speculator's rows ``seqs`` (those still running) are reset to the committed
        tokens. Returns the rows that must ask for a fresh speculation (all of ``seqs``)."""
        flight, self.flight = self.flight, None
        if flight is None:
            return []
        if self.cuda:
            self.copied[flight.parity].synchronize()
            self.built[flight.parity].synchronize()
        self._time_round(flight)
        live = [s for s in seqs if s is not None]
        self.link.end_chain(ChainEnd([s.slot for s in live], [list(s.tokens[:-1]) for s in live]))
        return live
