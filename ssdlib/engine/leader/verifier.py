"""The verifier side (leader rank) of a leader <-> speculator link: verify the speculation in
hand, take the next one, send the outcome (with where the next speculation came from).

:class:`LinkVerifier` is the loop, one class for every link mode: its ``source``
(``speculation_source.py``) says where a row's next speculation comes from (the cache mirror in
mode ``ssd``; the speculator's jit draft for plain SD with ``--draft-placement separate``), and
its link is a transport (``spec_link.py`` between ranks, ``local_link.py`` in process). What the
speculator still owes after an OUTCOME is one record, :class:`~ssdlib.distributed.protocol.Replies`.

Continuous batching: rows are identified by their KV slot; sequences join (ADMIT + a first
exchange) and leave (an inactive outcome) at any time.

Adaptive K (:mod:`ssdlib.speculative.adaptive_k`): when the leader takes a row's next speculation
it also picks how many of its K tokens it will verify (the row's limit K_i, sent in the OUTCOME);
the verify then runs max K_i + 1 positions and each row accepts at most its K_i. An SSD speculator
drafts and builds K tokens whatever the limits (its cache and its tree have one shape; drafting
costs the leader's choice nothing, so the choice weighs the verify alone); a cacheless
speculator (sd, separate draft) drafts only as many as the largest limit of its jit rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ssdlib import env
from ssdlib.distributed.local_link import LocalLink
from ssdlib.distributed.protocol import (Admit, AdmitRow, ChainSeen, Choice, Outcome, Replies,
                                         SpeculatorStats)
from ssdlib.distributed.spec_link import SpecLink
from ssdlib.engine.leader.ar_loop import admit_with_first_token
from ssdlib.engine.leader.chained_rounds import ChainedRounds, chained_rounds_on
from ssdlib.engine.leader.feature_feed import FeatureFeed
from ssdlib.engine.leader.metrics import (PLACEHOLDER, record_acceptance, record_lookup,
                                          record_source, speculation_source)
from ssdlib.engine.leader.speculation_source import CacheSource, JitSource, ask_jit
from ssdlib.engine.leader.verify import commit_round, read_round, verify_round
from ssdlib.engine.runner.model_runner import captures_steps
from ssdlib.engine.speculator.speculator import (build_speculator, cache_branches_of,
                                                 link_features)
from ssdlib.engine.timing import HostClock, RoundTimer
from ssdlib.loading import load_checkpoint
from ssdlib.loading.compat import check_draft_compatible
from ssdlib.loading.feature_draft import is_feature_draft
from ssdlib.ops.graph_pool import capture_count
from ssdlib.speculative.acceptance import DraftQ, QKind
from ssdlib.speculative.adaptive_k import DRAFT_PRIOR, AdaptiveK, StepCosts, k_schedule
from ssdlib.speculative.fanout import OWN_SOURCES, lookup_is_fresh


@dataclass
class SpecInHand:
    """A row's speculation received for the next verify."""

    tokens: list[int]  # [K]
    kind: int  # QKind of q
    q: torch.Tensor | None  # [K, V] float32 on the device, when the exchange sampled (it
    # arrives after the tokens: ``LinkVerifier._take_q``)
    source: str  # "cache", the fallback's name, or "first" (a sequence's first speculation)


class LinkVerifier:
    """The leader's loop for speculations drafted by a speculator over ``link`` (the ``loop`` of
    a Leader); ``source`` says where each row's next speculation comes from."""

    def __init__(self, target, link: SpecLink | LocalLink, k: int, device,
                 source: JitSource | CacheSource, adaptive: bool = True, sweep: bool = False,
                 schedule: list[int] | None = None, features: FeatureFeed | None = None):
        self.target = target
        # a feature draft's speculator: the target's features travel with each OUTCOME
        self.features = features
        self.link = link
        self.k = k
        self.device = device
        self.source = source
        self.lookahead = k + 1
        self.limit: int | None = None  # set by the Leader
        self.spec: dict[int, SpecInHand] = {}  # the speculation in hand per slot
        self.replies = Replies()  # what the speculator owes after the last OUTCOME
        self._verify_us = 0  # the last round's verify forward (told to the speculator)
        self._leaving: list[int] = []  # slots released without an inactive outcome yet
        # the STATS received since the batch metrics were last read, summed
        self._stats: SpeculatorStats | None = None
        self._stats_read = False
        self.timer = RoundTimer(device)
        self.clock = HostClock()  # SSDLIB_HOST_TIMES=1: host-clock segments of a round
        # an SSD speculator drafts K whatever the limits: a draft step costs the choice nothing
        costs = StepCosts(k, 0.0 if source.pushes_cache else DRAFT_PRIOR)
        self.policy = AdaptiveK(k, costs, enabled=adaptive, sweep=sweep, schedule=schedule or ())
        self.limits: dict[int, int] = {}  # per slot: K_i of the speculation in hand
        self._drafted = 0  # tokens a row the speculator drafts for the next round (jit source)
        # (K verified, K drafted for the next round, rows) of the round whose phases the timer
        # holds
        self._timed: tuple[int, int, int] | None = None
        # chained rounds (stream placement, small batches: chained_rounds.py)
        self.chain = ChainedRounds(target, link, k, device, link.max_batch) \
            if isinstance(link, LocalLink) and source.pushes_cache and chained_rounds_on() \
            and getattr(target, "channel", None) is None else None
        self._restart: list = []  # rows of an ended chain: their next speculation is a jit draft
        self._joining: list = []  # admitted into a running chain, not launched in it yet
        # per slot: the last chained round read, (k, its speculation was the draft's own: the
        # cache's or a jit draft)
        self._chain_last: dict[int, tuple[int, bool]] = {}
        self._chain_estimates = env.flag("SSDLIB_CHAIN_ESTIMATES")  # chained rounds teach them

    def admit(self, seqs) -> None:
        self.clock.admitted()
        # new rows join a running chain where it has room (no jit draft, no restart: their
        # first speculation is the n-gram's over the prompt); otherwise it ends here
        join = self.chain is not None and self.chain.may_join(seqs, self._joining)
        if join:
            self.chain.settle_flight()  # nothing of the chain runs beside the prefills
        else:
            self._end_chain()
        self._take_replies()  # the link's order: what is owed before a new message
        # a slot that left and is taken again needs no leaving notice: ADMIT replaces its row
        taken = {q.slot for q in seqs}
        self._leaving = [s for s in self._leaving if s not in taken]
        for q in seqs:
            self.source.admit_row(q)
            self.policy.admit(q.slot)
            if self.features is not None:
                self.features.admit(q.slot)
        # the speculator prefills the draft while the target prefills here
        self.link.send_admit(Admit([AdmitRow(q.slot, list(q.tokens), q.request.stream_salt,
                                             q.params) for q in seqs]))
        admit_with_first_token(self.target, seqs, self.device)
        if join:
            self._joining += list(seqs)
            return
        # (the rows of a chain that ended ask for a new speculation too)
        restart, self._restart = [q for q in self._restart if self._alive(q)], []
        both = list(seqs) + restart
        self._exchange(both, [(0, q.tokens[-1]) for q in both], first=True)

    # -- chained rounds ----------------------------------------------------------------------
    def _end_chain(self) -> None:
        """End a running chain (``chained_rounds.py``): its round in flight is dropped, its
        rows still running ask for a jit draft at the next exchange."""
        if self.chain is not None and self.chain.flight is not None:
            live = [q for q in self.chain.flight.seqs if q is not None and not q.finished]
            # rows admitted to join it ask for their first speculation, as after an admission
            restart = self.chain.end(live) + self._joining
            self._restart += restart
            self._joining = []
            if self.features is not None:  # their next OUTCOME carries all their features
                for q in restart:
                    self.features.admit(q.slot)

    def _restart_rows(self, active) -> None:
        """Rows of an ended chain take a fresh speculation (a jit draft) before their round."""
        restart, self._restart = [q for q in self._restart if self._alive(q)], []
        if restart:
            self._exchange(restart, [(0, q.tokens[-1]) for q in restart], first=True)

    def _chain_step(self, active, rows_of: list | None) -> None:
        """One step of chained rounds: launch the round after the one in flight (for the
        chain's rows ``rows_of``: :meth:`ChainedRounds.regroup`'s; None: the chain starts), read
        that one back and commit it (the chain's first step verifies the speculation in hand as
        a plain round first). Rows that joined since get their first tokens at the next step;
        rows that end stay in the round in flight and leave the chain at the next launch."""
        chain, timer, clock, K = self.chain, self.timer, self.clock, self.k
        clock.start()
        if rows_of is None:
            spec = [self.spec[q.slot].tokens[:K] for q in active]
            tokens = torch.tensor(spec, dtype=torch.int64).view(len(active), K)
            # (sampling rows: the speculation's q, and each row's K: a jit draft may be shorter)
            limits = [self.limits.get(q.slot, K) for q in active]
            outcome = verify_round(self.target, active, tokens,
                                   lambda: self._draft_q(active, K), self.device,
                                   after_launch=self._after_launch, limits=limits)
            # the next lookups are the device's: the CACHE of this build is not received
            self.replies = Replies()
            sources = [self.spec[q.slot].source for q in active]
            chain.first(active, outcome, tokens)
            chain.read_previous(chain.launch(active, timer))
            clock.tick("launch")
            result = read_round(tokens, outcome)
            done = list(active)
        else:
            before = chain.flight.seqs
            self._joining = [q for q in self._joining if not any(q is r for r in rows_of)]
            flight = chain.launch(rows_of, timer)
            clock.tick("launch")
            self.timer.flush()
            got = chain.read_previous(flight)
            # the rows of the round read back that still run (not those that ended in an
            # earlier round; rows that join now are in the next one only)
            live = {id(q) for q in active}
            at = [j for j, q in enumerate(before) if q is not None and id(q) in live]
            done = [before[j] for j in at]
            result = got.result.rows(at)
            # a miss's speculation: an n-gram proposal, or placeholder tokens ("none")
            kinds = [int(QKind.ONEHOT) if got.ngram[j] else PLACEHOLDER for j in at]
            hits = [got.hit[j] for j in at]
            sources = [speculation_source(h, kind) for h, kind in zip(hits, kinds)]
            for q, h, kind in zip(done, hits, kinds):
                record_lookup(q.metrics, self._chain_last.get(q.slot, (0, True))[0], h, kind)
                q.metrics["chained_rounds"] = q.metrics.get("chained_rounds", 0) + 1
            # the speculator's estimates (Thm 12's a_p and r): its outcomes, and the lookups of
            # rows whose last round was chained too (a joined row's first found an empty cache)
            if self._chain_estimates:
                last = [(self._chain_last[q.slot], h) for q, h in zip(done, hits)
                        if q.slot in self._chain_last]
                self.link.observe_chain(ChainSeen(
                    list(result.accepted), K,
                    [(k, h, lookup_is_fresh(k, K, own)) for (k, own), h in last],
                    got.looked_up, list(hits)))
        clock.tick("read")
        commit_round(done, result)
        keys = [q.slot for q in done]
        limits = [K] * len(done)
        greedy = [False] * len(done)
        self.policy.observe(keys, limits, result.accepted, greedy)
        record_acceptance(done, result, limits, K, [self.policy.alpha(i) for i in keys])
        for q, source, accepted in zip(done, sources, result.accepted):
            record_source(q.metrics, source, accepted)
            self._chain_last[q.slot] = (accepted, source in OWN_SOURCES)
        clock.tick("commit")
        if not any(self._alive(q) for q in active):
            # the batch has ended: so does the chain (the round in flight dropped), and the
            # rows leave the speculator, which answers with its STATS
            timer.add_to(active)
            self._end_chain()
            self._restart = []
            self._exchange(active, [(0, q.tokens[-1]) for q in active], first=True)
        else:
            # (a row that ended stays in the round in flight: the next launch makes it a ghost)
            timer.add_to(active, defer=True)
        clock.add_to(active)

    def _alive(self, q) -> bool:
        return not q.finished and (self.limit is None or len(q.tokens) < self.limit)

    def _after_launch(self) -> None:
        """Once the verify forward is launched: receives whose host cost overlaps it (a due q,
        then the CACHE's receive posted: the link's order), and the last round's phase times
        (read back while the forward runs)."""
        self._take_q()
        if self.replies.cache_slots is not None and not self.replies.cache_posted:
            self.link.post_cache(len(self.replies.cache_slots))
            self.replies.cache_posted = True
        self._read_phases(self.timer.flush(), self._timed)

    def _read_phases(self, phases: dict, ks: tuple[int, int] | None) -> None:
        """A timed round's phases: the verify time told to the speculator, the policy's costs
        (``ks``: the K it verified, the K the speculator drafted for the next round)."""
        if "verify" not in phases:
            return
        self._verify_us = int(1e6 * phases["verify"])  # (the speculator keeps the last value)
        if ks is None:
            return
        verified, drafted, rows = ks
        wait = phases.get("wait", 0.0)
        if not self.source.pushes_cache and drafted > 0:
            # a cacheless speculator's jit draft is the wait for the next speculation
            self.policy.costs.observe_draft(wait, drafted, rows)
        # K's cost is the round without the wait for the speculator: a cache-pushing one
        # drafts and builds K_max whatever K the round verifies, so the wait (a miss's jit
        # draft, a build the verify did not hide) is not K's; counted in, it went to the K of
        # the rounds where misses were frequent (on 2 cores K = 3's rounds cost 107 ms
        # against 59 without the jit waits, and K = 3 was never chosen again)
        self.policy.costs.observe_round(verified, sum(phases.values()) - wait, rows)

    # -- the loop -------------------------------------------------------------------------

    def _take_q(self) -> None:
        """Receive the q of the last sampling exchange's speculations (the SPEC's q part; on
        GPU the receive is queued on the stream, after the verify forward launched before)."""
        if self.replies.q_slots is not None:
            slots, self.replies.q_slots = self.replies.q_slots, None
            q = self.link.recv_q(len(slots))
            for i, slot in enumerate(slots):
                if slot in self.spec:
                    self.spec[slot].q = q[i]

    def _take_replies(self) -> bool:
        """Receive what the speculator owes for the last OUTCOME (a due q, then the CACHE: waits
        for the build's end if it outlasted the verify). Returns whether a CACHE was due."""
        self._take_q()
        slots = self.replies.cache_slots
        self.replies = Replies()
        if slots is None:
            return False
        self.source.take_cache(slots, self.link.recv_cache(len(slots)))
        return True

    def _exchange(self, seqs, outcomes, first: bool = False) -> None:
        """Take each live row's next speculation (cache, local fallback, or the speculator's jit
        draft), send (slot, k, t*, active, choice) per row, receive the SPEC if one is due."""
        self._take_replies()
        alive = [self._alive(q) for q in seqs]
        leaving, self._leaving = self._leaving, []
        gone = [0] * len(leaving)
        chosen = [self.source.choose(q, k, t) if a and not first else ask_jit(self.k)
                  for q, (k, t), a in zip(seqs, outcomes, alive)]
        chosen += [ask_jit(self.k)] * len(leaving)
        live = [q for q, a in zip(seqs, alive) if a]
        # each live row's K for its next verify
        chosen_k = iter(self.policy.choose([q.slot for q in live],
                                           [not q.params.greedy for q in live]))
        limits = [next(chosen_k) if a else 0 for a in alive]
        for q, n, a in zip(seqs, limits, alive):
            if a:
                self.limits[q.slot] = n
        self._drafted = max(limits, default=0)
        msg = Outcome([q.slot for q in seqs] + leaving, [k for k, _ in outcomes] + gone,
                      [t for _, t in outcomes] + gone, alive + [False] * len(leaving),
                      sampling=any(a and not q.params.greedy for q, a in zip(seqs, alive)),
                      k=self.k, choice=[c for c, _, _ in chosen], arg=[g for _, g, _ in chosen],
                      tokens=[t for _, _, t in chosen], verify_us=self._verify_us,
                      limit=limits + gone,
                      features=None if self.features is None
                      else self.features.rows(seqs, alive, extra=len(leaving)))
        self.link.send_outcome(msg)
        for q, a in zip(seqs, alive):
            if not a:
                self.spec.pop(q.slot, None)
                self.limits.pop(q.slot, None)
        if not any(alive):
            self._take_stats(self.link.recv_stats())
            return
        # q and the CACHE are received once the next verify forward is launched
        self.replies = Replies.after(msg, self.source.pushes_cache)
        want_tokens, _ = msg.spec_parts()
        t0 = time.perf_counter()
        spec = self.link.recv_spec_tokens(len(msg.slots)) if want_tokens else None
        jit = spec.tokens.tolist() if spec is not None else None
        if first:  # admission (a round's wait is timed by the round's timer)
            waited = time.perf_counter() - t0
            for q in seqs:
                q.metrics["wait_s"] = q.metrics.get("wait_s", 0.0) + waited
        for i, (q, (k, _), a) in enumerate(zip(seqs, outcomes, alive)):
            if not a:
                continue
            choice, arg, tokens = chosen[i]
            if choice == Choice.JIT:
                hand = SpecInHand(jit[i], int(spec.kinds[i]), None, "first" if first else "jit")
            else:
                kind = int(QKind.DENSE) if choice == Choice.CACHE else arg
                hand = SpecInHand(tokens, kind, None,
                                  speculation_source(choice == Choice.CACHE, kind))
            self.spec[q.slot] = hand
            if not first:  # a first speculation cannot come from the cache
                self.source.record_lookup(q, k, choice == Choice.CACHE, hand.kind)

    def _take_stats(self, stats: SpeculatorStats) -> None:
        """Keep the STATS since the batch metrics were last read (a call that empties the
        batch several times, e.g. one row at a time, gets STATS each time)."""
        if self._stats is not None and not self._stats_read:
            stats = self._stats.plus(stats)
        self._stats, self._stats_read = stats, False

    def _draft_q(self, active, k: int) -> DraftQ | None:
        """The q of the speculations in hand, their first ``k`` positions (None when every row
        is greedy)."""
        if all(q.params.greedy for q in active):
            return None
        self._take_q()
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
            probs.append(q_probs[:k])
        return DraftQ.per_row(kinds, torch.stack(probs).to(self.device))

    def step(self, active) -> None:
        if self.chain is not None:
            chained = self.chain.fits(active) and not self.policy.schedule  # (a schedule: tests)
            rows_of = self.chain.regroup(active, self._joining) if chained else None
            if self.chain.flight is not None and rows_of is None:
                self._end_chain()
            self._restart_rows(active)
            if chained:
                self._chain_step(active, rows_of)
                return
        timer, clock = self.timer, self.clock
        clock.start()
        timer.start()
        captured = capture_count()
        sweeping = self.policy.sweeping  # this round's K is a sweep's (chosen last round)
        limits = [self.limits.get(q.slot, self.k) for q in active]
        k = max(limits)  # the round verifies k drafts a row; row i accepts at most limits[i]
        tokens = torch.tensor([self.spec[q.slot].tokens[:k] for q in active],
                              dtype=torch.int64).view(len(active), k)  # [b, k], host
        # q (and an SSD speculator's CACHE) are received once the forward is launched
        outcome = verify_round(self.target, active, tokens, lambda: self._draft_q(active, k),
                               self.device, after_launch=self._after_launch, limits=limits,
                               draws=self.k + 1)
        clock.tick("launch")
        result = read_round(tokens, outcome)
        clock.tick("read")
        timer.mark("verify")
        commit_round(active, result)
        keys = [q.slot for q in active]
        sampled = [not q.params.greedy for q in active]
        self.policy.observe(keys, limits, result.accepted, sampled)
        record_acceptance(active, result, limits, self.k, [self.policy.alpha(i) for i in keys])
        for q, accepted in zip(active, result.accepted):
            record_source(q.metrics, self.spec[q.slot].source, accepted)
        timer.mark("host")
        clock.tick("commit")
        if self._take_replies():
            timer.mark("cache")  # the speculator's build outlasting the verify shows here
        clock.tick("cache")
        self._exchange(active, list(zip(result.accepted, result.bonus)))
        timer.mark("wait")  # the next speculation is in hand (at once on a cache hit)
        clock.tick("exchange")
        # read back after the next forward is launched (``_after_launch``), unless a row ended
        phases = timer.add_to(active, defer=True)
        # a round that captured a step (a sweep's, a new shape's; the next round's is drafted
        # during this one's wait) says nothing of the costs; nor does one with sampling rows
        # (only greedy rows decide on measured costs, as in SDLoop)
        swept = sweeping or self.policy.sweeping
        ks = None if swept or capture_count() != captured or any(sampled) else \
            (k, self._drafted, len(active))
        self._timed = ks if timer.timed and not phases else None
        self._read_phases(phases, ks)
        clock.tick("timer")
        clock.add_to(active)

    def release(self, seq) -> None:
        # (a running chain goes on: the row's place in it becomes a ghost row at the next
        # launch, and its slot is not taken again before that launch or the chain's end)
        chained = self.chain is not None and (
            any(q is seq for q in self._joining)
            or (self.chain.flight is not None and any(q is seq for q in self.chain.flight.seqs)))
        self._restart = [q for q in self._restart if q is not seq]
        self._joining = [q for q in self._joining if q is not seq]
        self._chain_last.pop(seq.slot, None)
        self.source.release_row(seq.slot)
        self.policy.release(seq.slot)
        # tell the speculator with the next outcome (a chain's row may have no speculation in
        # hand here: it joined the chain, or its speculations came from the device)
        if self.spec.pop(seq.slot, None) is not None or chained:
            self._leaving.append(seq.slot)

    def settle(self) -> None:
        """No row is running: tell the speculator about the rows that left (cancelled), so it
        is idle too (it answers an outcome without active rows with STATS)."""
        self._end_chain()
        if self._leaving:
            self._exchange([], [])
        self._take_replies()

    def batch_metrics(self) -> dict:
        """The speculator's metrics over the STATS since the last read (the next STATS starts
        afresh); a copy per call, its dicts too."""
        self._stats_read = True
        stats = self._stats
        chain = {}  # chained rounds' counts and (GPU) overlap, whether STATS came or not
        if self.chain is not None and any(self.chain.counts.values()):
            chain["chain_counts"] = dict(self.chain.counts)
            self.chain.counts = dict.fromkeys(self.chain.counts, 0)
        meter = self.chain.meter if self.chain is not None else None
        if meter is not None and meter.rounds:
            chain["chain_overlap"] = meter.take()
        budgets = self.link.budget_summary() if self.chain is not None else None
        if budgets is not None and budgets["builds"]:
            chain["chain_budgets"] = budgets
        if isinstance(self.link, LocalLink):  # in process: the speculator's fan-out estimates
            model = self.link.fanout_summary()
            if model is not None:
                chain["fanout_model"] = model
        if stats is None:
            return {"k_costs": self.policy.costs.snapshot(), **chain}
        idle, busy, hits, rounds = stats.idle_s, stats.busy_s, stats.hits, stats.rounds

        def ms_per_round(seconds: dict) -> dict:
            return {p: 1e3 * t / rounds if rounds else 0.0 for p, t in seconds.items()}
        out = {
            "speculator_idle_frac": idle / (idle + busy) if idle + busy else 0.0,
            "branch_kv_reused_frac": stats.reused / hits if hits else 0.0,
            # per OUTCOME round answered (a sequence's first included), phases of SPEC_PHASES
            "speculator_rounds": rounds,
            "speculator_ms_per_round": ms_per_round(stats.phase_s),
            "k_costs": self.policy.costs.snapshot(),
            "speculator_rows_held": stats.held,  # once every row has left: none
            **chain}
        if any(stats.host_s.values()):  # SSDLIB_HOST_TIMES=1 on the speculator rank
            out["speculator_host_ms_per_round"] = ms_per_round(stats.host_s)
        overlap = self.link.overlap  # the stream placement on a GPU
        if overlap is not None and overlap.rounds:
            out["stream_overlap"] = overlap.take()
        return out

    def close(self) -> None:
        if self.link.failed is None:  # a failed speculator has nothing more to send
            self._end_chain()
            self._take_replies()
        self.link.send_shutdown()


def link_for(cfg, world, target_ck, branches: int = 0) -> SpecLink:
    """The leader's end of the link to the speculator rank (the draft checked first)."""
    if not is_feature_draft(cfg.draft):  # (a feature draft is checked where it loads)
        check_draft_compatible(target_ck, load_checkpoint(cfg.draft))
    return SpecLink(world.spec_group, world.speculator_rank, world.device, cfg.max_batch, cfg.k,
                    target_ck.config.vocab_size, staged=world.spec_staged, branches=branches,
                    features=link_features(cfg, target_ck))


def build_link_verifier(cfg, world, target, target_ck):
    """The leader's loop of a mode with a speculator: ``ssd`` (a cache source; the speculator on
    its own rank, or built here on a stream of its own: ``cfg.placement``) or ``sd`` with the
    draft on its own rank (a jit source). Returns (loop, close)."""
    vocab = target_ck.config.vocab_size
    features = None
    if cfg.mode != "ssd":
        link, source = link_for(cfg, world, target_ck), JitSource(cfg.k, vocab)
    else:
        branches = cache_branches_of(cfg)
        source = CacheSource(cfg.k, vocab)
        if cfg.placement == "rank":
            link = link_for(cfg, world, target_ck, branches)
        else:
            link = LocalLink(world.device, cfg.max_batch, cfg.k, vocab, branches)
            # a feature draft shares the target's embedding and head where it is unsharded
            model = target.runner.model if cfg.tp == 1 else None
            with link.on_stream():
                link.attach(build_speculator(cfg, world.device, target_ck, link, model,
                                             target.runner.cache.features))
            if link.cuda:  # what was set up on other streams is done before either side runs
                torch.cuda.synchronize(world.device)
        if cfg.feature_draft:  # its speculator reads the features the target keeps
            features = FeatureFeed(target.runner.cache.features)
    loop = LinkVerifier(target, link, cfg.k, world.device, source, adaptive=cfg.adaptive_k,
                        sweep=captures_steps(world.device), schedule=k_schedule(cfg.k),
                        features=features)
    return loop, loop.close
