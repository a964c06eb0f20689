"""The speculator: drafts speculations for the verifier, over a link (``spec_link.py`` from a
rank of its own, ``local_link.py`` in the leader's process).

One class, :class:`Speculator`, serves ADMIT / OUTCOME: each round it commits the outcome the
leader sends, answers (the jit rows drafted now, q when sampling) and then does the work that
follows the answer. What it keeps decides the mode:
- with a :class:`CacheRole` (mode ``ssd``, Algorithm 1): the OUTCOME carries the next speculation
  the leader took from its copy of the cache (hit) or a fallback drawn there (miss), or asks for
  a jit draft; *while the verifier verifies*, the speculator builds the cache for the
  speculation's likely outcomes (``cache_builder.py``) and pushes its keys and tokens (CACHE).
  Answering: ``outcomes.py``; the leader's lookup: ``cache_mirror.py``;
- without (mode ``sd``, ``--draft-placement separate``): the draft on its own rank, no cache:
  every speculation is drafted just in time after its outcome.
"""

from __future__ import annotations

import time

import torch

from ssdlib.distributed.protocol import (SPEC_HOST_SEGMENTS, SPEC_PHASES, Admit, ChainEnd,
                                         ChainRegroup, ChainSeen, ChainStart, FeatureRows, Op,
                                         Outcome, SpeculatorStats)
from ssdlib.distributed.spec_link import SpecLink
from ssdlib.engine.batching import to_device
from ssdlib.engine.drafter import Drafter
from ssdlib.engine.runner.compiled import feature_compile_backend
from ssdlib.engine.runner.model_runner import ModelRunner, eager_step_graphs, use_slot_kernel
from ssdlib.engine.runner.step_graphs import GHOST_PARAMS
from ssdlib.engine.speculator.cache_builder import CacheBuilder
from ssdlib.engine.speculator.feature_build import FeatureCacheBuilder
from ssdlib.engine.speculator.feature_spec_draft import FeatureSpecDraft
from ssdlib.engine.speculator.outcomes import (NGRAM_ACCEPTANCE_PRIOR, Answer, Fallbacks,
                                              answer_jit, q_after_build, shrunk_acceptance)
from ssdlib.engine.speculator.spec_cache import SpeculationCache
from ssdlib.engine.speculator.spec_row import SpecRow
from ssdlib.engine.timing import HostClock, RoundTimer
from ssdlib.errors import ConfigError
from ssdlib.loading.draft import load_draft
from ssdlib.loading.feature_draft import feature_spec_for, is_feature_draft, load_feature_draft
from ssdlib.ops.graph_pool import EagerPool, make_graph_pool
from ssdlib.profiling import RoundProfiler
from ssdlib.speculative.fallback import FALLBACKS
from ssdlib.speculative.fanout import (OWN_SOURCES, FanoutEstimator, cache_branches,
                                       lookup_is_fresh, parse_fanout)
from ssdlib.speculative.fanout_budget import BudgetTuner, tokens_a_round
from ssdlib.speculative.rng import RowStreams


class Speculator:
    """Serve ADMIT / OUTCOME until SHUTDOWN; ``cache`` (SSD) keeps and rebuilds the speculation
    cache every round, without it every speculation is a jit draft."""

    def __init__(self, cfg, runner: ModelRunner | None, link: SpecLink, vocab_size: int,
                 drafter: "Drafter | FeatureSpecDraft", cache: "CacheRole | None" = None):
        self.cfg = cfg
        self.K = cfg.k
        self.runner = runner  # a standalone draft's (None: a feature draft keeps its own state)
        self.link = link
        self.V = vocab_size
        self.device = runner.device if runner is not None else drafter.device
        self.drafter = drafter
        self.rows: dict[int, SpecRow] = {}  # by KV slot; the cache is indexed by slot too
        self.sampling = False  # the current exchange's answer carries q
        self.stats = {"idle_s": 0.0, "busy_s": 0.0}
        # cache counters since the last STATS (zero without a cache)
        self.hits = self.lookups = self.reused = 0
        self.t_verify: float | None = None  # the leader's last verify forward, seconds
        # each OUTCOME round's phases (SPEC_PHASES), marked on this rank's device; seconds
        # and rounds since the last STATS
        self.timer = RoundTimer(self.device)
        self.rounds = 0
        self.phase_s = dict.fromkeys(SPEC_PHASES, 0.0)
        self.clock = HostClock()  # SSDLIB_HOST_TIMES=1: the same rounds by the host clock
        self.host_s = dict.fromkeys(SPEC_HOST_SEGMENTS, 0.0)
        self.profiler = RoundProfiler(f"{cfg.mode}-speculator")  # SSDLIB_PROFILE (off: no-op)
        self.cache = cache
        # send a sampling SPEC's q only once the cache build is launched (``finish_round``)
        self.hold_q = cache is not None and q_after_build()

    def run(self) -> None:
        """The rank placement's loop: serve the link's messages until SHUTDOWN."""
        while True:
            t0 = time.perf_counter()
            header = self.link.recv_header()
            t1 = time.perf_counter()
            self.stats["idle_s"] += t1 - t0
            if header.op == Op.SHUTDOWN:
                self.shutdown()
                return
            if header.op == Op.ADMIT:
                self.admit(self.link.recv_admit(header))
            elif header.op == Op.OUTCOME:
                if self.begin_round(header, self.link.recv_outcome(header)):
                    self.finish_round()
            else:
                raise RuntimeError(f"speculator: unknown op {header.op}")
            self.stats["busy_s"] += time.perf_counter() - t1

    # -- one round, in the order both placements run it ---------------------------------------
    def begin_round(self, header, outcome: Outcome) -> bool:
        """An OUTCOME arrived: commit it and answer (a SPEC when due). True when the round goes
        on to :meth:`finish_round` (a row is live); False when STATS were the answer."""
        if header.verify_us > 0:
            self.t_verify = header.verify_us / 1e6
        self.profiler.tick()
        self.clock.start()
        self.timer.start()
        self.sampling = outcome.sampling
        if self.respond(outcome):
            return True
        self.send_stats()
        return False

    def finish_round(self, read_times: bool = True) -> None:
        """The answer is out and the verifier verifies it: the role's work after the answer
        (SSD: build and push the cache). ``read_times``: add the round's phase times now (waits
        for the round's last mark); otherwise the caller calls :meth:`end_round` later."""
        self.after_answer()
        if read_times:
            self.end_round()

    def shutdown(self) -> None:
        self.profiler.close()
        if self.runner is not None:
            self.runner.release_graphs()
        if self.cache is not None:
            self.cache.release_graphs()

    def admit(self, msg: Admit) -> None:
        """New sequences join (their slots may have been used by finished ones)."""
        new = [SpecRow.admitted(a, self.device) for a in msg.rows]
        for row in new:
            self.rows[row.slot] = row
        if self.cache is not None:
            self.cache.invalidate([r.slot for r in new])
        # draft prefill (overlaps the target's prefill on the verifier)
        self.drafter.prefill(new)
        for r in new:
            r.valid = len(r.tokens)

    def respond(self, outcome: Outcome) -> bool:
        """Commit the listed rows' outcomes and take their next speculations: the jit rows'
        drafted now and sent (with q when sampling) in a SPEC, in the message's order of rows;
        False if no listed row is active (then the answer is STATS)."""
        live = []  # positions in the message
        verified = []  # k of the rows whose speculation was verified
        for i, (slot, k, t, active) in enumerate(zip(outcome.slots, outcome.accepted,
                                                     outcome.bonus, outcome.active)):
            row = self.rows.get(slot)
            if not active:
                if row is not None:
                    del self.rows[slot]
                continue
            limit = self.K if row.limit is None else row.limit  # of the speculation verified
            if row.commit(k, t):
                if self.cache is not None:
                    self.cache.observe(row, k, limit)
                verified.append((k, limit))
            row.limit = outcome.limit[i]  # of the next speculation
            live.append(i)
        if self.cache is not None:
            self.cache.observe_round(verified)
            self.cache.take_features(outcome, self.rows)
        if not live:
            return False
        self.timer.mark("commit")
        self.clock.tick("commit")
        slots = [outcome.slots[i] for i in live]
        answer = self.answer(outcome, live)
        self.timer.mark("fallback")
        self.clock.tick("answer")
        tokens, q = outcome.spec_parts()
        if tokens or q:
            self.link.send_spec(answer.in_order(slots, outcome.slots), tokens,
                                hold_q=self.hold_q)
        self.timer.mark("send")
        self.clock.tick("send")
        backup = self.cache.fallbacks.pushed if self.cache is not None else "jit"
        answer.record([self.rows[s_] for s_ in slots], backup)  # after the verifier has it
        return True

    def end_round(self) -> None:
        """Add the round's phases. Read back here, after the cache build, not before the answer
        is sent: the wait on the last mark costs nothing, the next step blocks on a receive."""
        for name, dt in self.timer.totals().items():
            self.phase_s[name] += dt
        self.clock.tick("end")
        for name, dt in self.clock.take().items():
            if name in self.host_s:  # not "between": the wait for the next OUTCOME is idle_s
                self.host_s[name] += dt
        self.rounds += 1

    # -- chained rounds (stream placement: engine/leader/chained_rounds.py) -------------------
    def start_chain(self, msg: ChainStart) -> None:
        """Chained rounds start for ``msg``'s rows: the builds read the chain's state from now
        on, and the rows' host state is not kept up to date until :meth:`end_chain`."""
        self.cache.start_chain(msg, [self.rows[s] for s in msg.slots])

    def regroup_chain(self, msg: ChainRegroup) -> None:
        """The running chain's rows change (``msg``): the builds from now on are for its
        rows, the joined ones read from the state like the others."""
        self.cache.regroup_chain(msg, [self.rows[s] if s >= 0 else None for s in msg.slots])

    def build_chained(self, parity: int, rows: int, kv_len: int) -> tuple:
        """A chained round's build (no answer, no push: the leader's next lookup reads the
        cache where it is). Returns its fan-out."""
        return self.cache.build_chained(parity, rows, kv_len)

    def end_chain(self, msg: ChainEnd) -> None:
        """The chain ended: each listed row's committed tokens but the last are ``msg``'s, and
        its draft KV holds them (every chained build fed the tokens before its speculation);
        nothing is in flight. The next OUTCOME commits the last token and asks for a jit
        draft, as after an admission."""
        for slot, tokens in zip(msg.slots, msg.tokens):
            self.rows[slot].restart(tokens)
        self.cache.chain_ended(msg.slots)

    def send_stats(self) -> None:
        """Answer to an outcome without active rows: the counters since the last STATS."""
        self.link.send_stats(SpeculatorStats(self.stats["idle_s"], self.stats["busy_s"],
                                             self.hits, self.lookups, self.reused, self.rounds,
                                             self.phase_s, self.host_s, len(self.rows)))
        self.stats = {"idle_s": 0.0, "busy_s": 0.0}
        self.hits = self.lookups = self.reused = self.rounds = 0
        self.phase_s = dict.fromkeys(SPEC_PHASES, 0.0)
        self.host_s = dict.fromkeys(SPEC_HOST_SEGMENTS, 0.0)

    def answer(self, outcome: Outcome, live: list[int]) -> Answer:
        """The next speculation of the rows at positions ``live`` of ``outcome``: as the leader
        chose it, the JIT rows drafted now (and q when the exchange samples)."""
        if self.cache is not None:
            self.cache.expect_push(outcome, self.device)
        ans, jit = Answer.from_outcome(outcome, live, self.V, self.device)
        if jit:
            rows = [self.rows[outcome.slots[live[j]]] for j in jit]
            if self.cache is not None:
                self.cache.fallbacks.jit(rows, ans, jit)  # timed: Thm 17 weighs jit's cost
            else:  # no cache to build: draft only what the leader will verify
                k = max(r.limit for r in rows)
                if k > 0:
                    answer_jit(self.drafter, rows, k, ans, torch.tensor(jit))
                else:
                    self.drafter.skip(rows)
        if self.cache is not None:
            lookups, hits = self.cache.answered(outcome, live, ans,
                                                [self.rows[outcome.slots[i]] for i in live])
            self.lookups += lookups
            self.hits += hits
        return ans

    def after_answer(self) -> None:
        """The answer is sent; the verifier is verifying it: with a cache, build it for the
        rows just answered and push it (the ``build`` and ``push`` phases)."""
        if self.cache is None:
            return
        # rows whose new speculation is not in the draft's KV yet (the ones just answered)
        rows = [r for r in self.rows.values() if r.sent is not None and not r.fed]
        self.reused += self.cache.build(rows, self.sampling)
        self.link.send_held_q()  # (with hold_q) the build is launched: q goes out beside it
        self.timer.mark("build")
        self.clock.tick("build")
        self.cache.push(self.link, len(self.rows), self.t_verify)
        self.timer.mark("push")
        self.clock.tick("push")


class CacheRole:
    """What an SSD speculator keeps besides its draft: the speculation cache, its builder, the
    fan-out (Thm 12, estimated online or fixed) and the backup for misses (Thm 17)."""

    def __init__(self, cfg, runner: ModelRunner | None, drafter, vocab_size: int,
                 builder=None):
        """``builder(cache)``: the cache's builder (default: a standalone draft's
        ``CacheBuilder`` over ``runner``)."""
        self.K = cfg.k
        fan = parse_fanout(cfg.fan_out, self.K)
        self.estimator = FanoutEstimator(cfg.fan_out_budget, self.K) if fan == "auto" else None
        self.fixed_fanout = None if fan == "auto" else fan
        self.B = cache_branches_of(cfg)
        # one row per KV slot, plus the scratch slot's (ghost rows of a captured build)
        device = runner.device if runner is not None else drafter.device
        self.cache = SpeculationCache(cfg.max_batch + 1, self.B, self.K, vocab_size, device)
        self.builder = builder(self.cache) if builder is not None else \
            CacheBuilder(runner, drafter, self.cache, vocab_size, cfg.saguaro_c)
        self.fallbacks = Fallbacks(drafter, cfg.fallback, self.K, vocab_size)
        # chained rounds' budget per build, by what the verify hides of it (fanout_budget.py):
        # with an estimated fan-out, where the builder's chained build takes smaller budgets
        arms = self.builder.budget_arms(self.B) if fan == "auto" and cfg.fan_out_tuning \
            else [self.B]
        # per-token acceptance of chained rounds' speculations: [accepted, rejections] of the
        # cache's (True) and of a miss's backup (False), for the tuner's expected tokens
        self.chain_acceptance = {True: [0, 0], False: [0, 0]}
        self.tuner = BudgetTuner(arms, value=self.tokens_a_round) if len(arms) > 1 else None
        if self.B != sum(self.fanout()):
            raise ConfigError(f"fan-out {self.fanout()} does not sum to the cache's "
                              f"{self.B} branches")
        self._fanout_used = self.fanout()
        self._push_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fresh: dict[int, bool] = {}  # per slot: the kind of its next lookup (observe)
        self._second: SpeculationCache | None = None  # chained rounds' second cache
        self._chain = None  # the running chain's ChainState
        self._chain_rows: list[SpecRow] | None = None  # its rows, when some samples
        self._chain_facts = None  # their sampled builds' facts (None: greedy builds)

    def fanout(self, limit: int | None = None, budget: int | None = None) -> list[int]:
        """The fan-out in use: a fixed --fan-out as given, else the estimate for a verification
        of the first ``limit`` tokens (``FanoutEstimator.allocation``; None: all K) with
        ``budget`` branches (None: the cache's B)."""
        if self.fixed_fanout is not None:
            return self.fixed_fanout
        return self.estimator.allocation(limit, budget)

    def invalidate(self, slots: list[int]) -> None:
        """New sequences in ``slots``: no cache (of chained rounds too) holds anything for
        them."""
        self.cache.invalidate(slots)
        if self._second is not None:
            self._second.invalidate(slots)

    def release_graphs(self) -> None:
        """A standalone draft's captured builds are its runner's (released with it)."""

    def chain_ended(self, slots: list[int]) -> None:
        """The chain of these rows ended (``Speculator.end_chain``): a standalone draft's KV
        holds their committed tokens but the last."""

    def take_features(self, outcome: Outcome, rows: dict[int, SpecRow]) -> None:
        """The target's features an OUTCOME carries (``rows``: the speculator's, by slot, their
        outcomes committed): a standalone draft reads none."""
        if outcome.features is not None:
            raise RuntimeError("an OUTCOME carried target features to a standalone draft")

    def observe(self, row: SpecRow, k: int, limit: int) -> None:
        """The row's speculation in flight had k of its first ``limit`` tokens accepted (and
        the kind of the lookup of its outcome is kept for :meth:`answered`)."""
        self._fresh[row.slot] = lookup_is_fresh(k, limit, row.source in OWN_SOURCES)
        if row.source == "ngram":  # an n-gram backup's (random where no suffix recurs)
            self.fallbacks.observe_ngram(k, limit)
            return
        if row.source == "jit":  # a jit draft: its a_p on misses
            self.fallbacks.observe_jit(k, limit)
        if row.source in ("jit", "random"):  # a miss another backup answered: what an n-gram
            self.fallbacks.shadow_ngram(row.tokens, k, limit)  # proposal would have kept

    def observe_round(self, verified: list[tuple[int, int]]) -> None:
        """The round's verified rows: (tokens accepted, tokens verified) each (one call a
        round)."""
        if self.estimator is not None and verified:
            self.estimator.observe_verify([k for k, _ in verified], [n for _, n in verified])

    def expect_push(self, outcome: Outcome, device) -> None:
        """The CACHE's rows for this OUTCOME, on the device now: the push after the build
        launches without a host copy that would wait for the build."""
        rows = torch.tensor([outcome.slots, outcome.active],  # one host-to-device copy
                            dtype=torch.int64).to(device, non_blocking=True)
        self._push_rows = (rows[0], rows[1].bool())

    def answered(self, outcome: Outcome, live: list[int], ans: Answer,
                 rows: list[SpecRow]) -> tuple[int, int]:
        """The leader's lookups this round (rows whose cache was built, not a sequence's
        first): fed to the estimators; a sampling exchange's hit rows get their q from the
        cache. Returns (lookups, hits)."""
        built = [r.fed for r in rows]
        hit = ans.hit.tolist()
        hs = []
        for row, h in zip(rows, hit):
            if row.fed:
                hs.append(h)
                self.fallbacks.observe_after(row.source, h)
        self.fallbacks.observe_lookups(len(hs), sum(hs))
        if self.estimator is not None and hs:
            fan = self._fanout_used
            fed = [i for i, f in zip(live, built) if f]
            self.estimator.observe_lookups(
                [fan[outcome.accepted[i]] for i in fed], hs,
                [self._fresh.get(outcome.slots[i], True) for i in fed])
        if ans.q is not None and any(hit):  # the hit rows' q, gathered here on the device
            branch = ans.branch.tolist()
            at = [j for j, h in enumerate(hit) if h]
            # (position in the answer, cache row, branch) in one asynchronous copy: a blocking
            # one (torch.tensor(..., device=cuda), .to(cuda)) waits for the stream to drain
            sel = to_device([at, [outcome.slots[live[j]] for j in at], [branch[j] for j in at]],
                            ans.q.device)
            ans.q[sel[0]] = self.cache.gather_q(sel[1], sel[2])
        return len(hs), sum(hs)

    def build(self, rows: list[SpecRow], sampling: bool) -> int:
        """Build the cache for ``rows``; returns how many continued a hit's branch KV. The
        estimated fan-out follows the leader's choice of K: outcomes past the longest verified
        limit of these rows cannot happen, so they get no branch (a fixed --fan-out is kept)."""
        fan = self.fanout(max((self.K if r.limit is None else r.limit for r in rows),
                              default=None))
        self._fanout_used = fan
        return self.builder.build(rows, fan, sampling)

    def chain_caches(self) -> list[SpeculationCache]:
        """The caches of chained rounds, by round parity: the main one and a second (allocated
        on the first chain)."""
        if self._second is None:
            c = self.cache
            self._second = SpeculationCache(c.ready.shape[0], c.B, c.K, c.V, c.device)
        return [self.cache, self._second]

    def start_chain(self, msg: ChainStart, rows: list[SpecRow]) -> None:
        """Chained builds for ``rows`` (``msg``'s) from now on; where some row samples, their
        parameters for the sampled builds, and in the state's column 1 their streams' keys and
        first draws (the chain's first build draws from there)."""
        self._chain = msg.state
        self._chain_rows = rows if msg.sampling else None
        params = [r.params for r in rows] if msg.sampling else None
        self._chain_facts = self.builder.chain_step.start_chain(msg.slots, params)
        if msg.sampling:
            msg.state.start_streams(1, RowStreams.reserve_host([r.stream for r in rows], 0))
            for cache in self.chain_caches():
                cache.q  # allocated now, not inside a capture

    def regroup_chain(self, msg: ChainRegroup, rows: list[SpecRow | None]) -> None:
        """The running chain's rows become ``rows`` (None: a ghost row, its slot the scratch
        slot); where it samples, each joined row's stream goes on from where its host stream
        is (column 1 of the state, at the index the next build reads). The rows' sampling
        kind is the chain's (the leader checks it), so the builds' graphs stay the same."""
        step = self.builder.chain_step
        slots = [s if s >= 0 else self.builder.scratch_slot for s in msg.slots]
        sampling = self._chain_rows is not None
        params = [r.params if r is not None else GHOST_PARAMS for r in rows] \
            if sampling else None
        step.start_chain(slots, params)
        if sampling:
            self._chain_rows = rows
            for i in msg.joined:
                key, draw = RowStreams.reserve_host([rows[i].stream], 0)[0].tolist()
                self._chain.set_stream(1, msg.parity, i, key, draw)

    def build_chained(self, parity: int, rows: int, kv_len: int) -> tuple:
        """A chained round's build into the cache of ``parity``, with the fan-out for a
        verification of all K (a chained round verifies them all) and the tuner's budget;
        sampled where the chain's rows sample (its draws reserved on the rows' host streams
        too). Returns the build's fan-out (its sum: the budget, branches a row)."""
        budget = self.tuner.next_budget() if self.tuner is not None else self.B
        fan = self.fanout(budget=budget)
        self._fanout_used = fan
        pos, rank = self.builder.branch_index(tuple(fan))
        if self._chain_rows is not None:
            for r in self._chain_rows:
                if r is not None:  # (None: a ghost row)
                    r.stream.reserve(self.K * self.B)
        self.builder.chain_step.run_chained(self._chain, rows, parity, self.chain_caches(), pos,
                                            rank, kv_len, self._chain_facts, tuple(fan),
                                            self.builder.saguaro_c)
        return tuple(fan)

    def observe_chain(self, msg: ChainSeen) -> None:
        """A chained round's outcomes and lookups (``protocol.ChainSeen``): into the fan-out's
        estimates and the fallbacks' hit rate, as a plain round's OUTCOME and answer are."""
        self.observe_round([(k, msg.k) for k in msg.accepted])
        for k, cached in zip(msg.accepted, msg.cached):
            counts = self.chain_acceptance[cached]
            counts[0] += k
            counts[1] += int(k < msg.k)
        if msg.fan is None or not msg.lookups:
            return
        hits = [h for _, h, _ in msg.lookups]
        self.fallbacks.observe_lookups(len(hits), sum(hits))
        if self.estimator is not None:
            self.estimator.observe_lookups([msg.fan[k] for k, _, _ in msg.lookups], hits,
                                           [fresh for _, _, fresh in msg.lookups])

    def tokens_a_round(self, budget: int) -> float | None:
        """The tokens a chained round is expected to commit a row with builds of ``budget``
        branches (``fanout_budget.tokens_a_round``), at the chained rounds' measured
        acceptance of the cache's speculations and of the misses' backups (shrunk towards the
        draft's a_p and the n-gram prior)."""
        (acc_hit, rej_hit), (acc_miss, rej_miss) = (self.chain_acceptance[True],
                                                    self.chain_acceptance[False])
        a_hit = shrunk_acceptance(acc_hit, acc_hit + rej_hit, self.estimator.a_p)
        a_miss = shrunk_acceptance(acc_miss, acc_miss + rej_miss, NGRAM_ACCEPTANCE_PRIOR)
        return tokens_a_round(self.estimator, budget, a_hit, a_miss)

    def observe_build(self, budget: int, build_ms: float, verify_ms: float) -> None:
        """A chained round's times, its build of ``budget`` branches (for the tuner)."""
        if self.tuner is not None:
            self.tuner.observe(budget, build_ms, verify_ms)

    def fanout_summary(self) -> dict | None:
        """The fan-out estimator's state (``FanoutEstimator.summary``; None: a fixed
        ``--fan-out``)."""
        return self.estimator.summary() if self.estimator is not None else None

    def budget_summary(self) -> dict | None:
        """The tuner's builds per budget since the last call and the budget it holds (None: no
        tuner)."""
        return self.tuner.take() if self.tuner is not None else None

    def push(self, link, live_rows: int, t_verify: float | None) -> None:
        """CACHE: the built rows' keys and tokens for the leader's lookup, in the answered
        OUTCOME's order of rows, with the backup for the next round's misses (Thm 17's
        choice)."""
        kind = self.fallbacks.choose(live_rows, t_verify, self.estimator)
        rows, live = self._push_rows
        link.send_cache(self.cache.pushed_rows(rows, live, FALLBACKS.index(kind)))


class FeatureCacheRole(CacheRole):
    """The cache role of a feature draft's speculator (``feature_build.py``): every OUTCOME's
    target features are committed into the draft's state before the answer; the build drafts
    the outcomes on self-conditioned features. Chained rounds (in the target's process) read
    the features from the target's buffer (``FeatureCacheBuilder.chained_body``)."""

    def __init__(self, cfg, drafter: FeatureSpecDraft, vocab_size: int, pool=None,
                 target_features: torch.Tensor | None = None):
        super().__init__(cfg, None, drafter, vocab_size, builder=lambda cache: FeatureCacheBuilder(
            drafter, cache, vocab_size, cfg.saguaro_c, pool, target_features))
        self.drafter = drafter
        self.pool = pool  # the captured greedy builds' (None: eager)

    def take_features(self, outcome: Outcome, rows: dict[int, SpecRow]) -> None:
        if outcome.features is None:
            raise RuntimeError("an OUTCOME to a feature draft's speculator carried no features")
        self._commit([rows[s] if a else None for s, a in zip(outcome.slots, outcome.active)],
                     outcome.features)

    def _commit(self, rows: list[SpecRow | None], f: FeatureRows) -> None:
        """Commit ``f``'s spans of ``rows`` (one per row of ``f``; None: an inactive row)."""
        if f.ready is not None:  # (on a GPU) gathered on another stream
            stream = torch.cuda.current_stream(self.drafter.device)
            stream.wait_event(f.ready)
            f.values.record_stream(stream)  # not reused by the leader's side before it is read
        live = [i for i, (r, c) in enumerate(zip(rows, f.counts)) if r is not None and c > 0]
        if not live:
            return
        values = f.values if len(live) == len(f.counts) else \
            f.values[torch.tensor(live, device=f.values.device)]
        self.drafter.commit_features([rows[i] for i in live], [f.starts[i] for i in live],
                                     [f.counts[i] for i in live], values)

    def regroup_chain(self, msg: ChainRegroup, rows: list[SpecRow | None]) -> None:
        """As a standalone draft's; a joined row's prompt (its positions before the last, whose
        features the target's prefill wrote) is committed now, the last by its first chained
        build."""
        super().regroup_chain(msg, rows)
        joined = [rows[i] for i in msg.joined]
        for r in joined:
            self.drafter.fed[r.slot] = 0
        if joined:
            self._commit(joined, FeatureRows.gather(
                self.builder.target_features, [r.slot for r in joined], [0] * len(joined),
                [len(r.tokens) - 1 for r in joined]))

    def chain_ended(self, slots: list[int]) -> None:
        """Where the chain left the draft's state is not tracked per row: their next OUTCOME
        (the leader resets its side too) brings every committed position's features again."""
        for s in slots:
            self.drafter.fed[s] = 0

    def release_graphs(self) -> None:
        if self.pool is not None:
            self.pool.clear()


def tree_len_of(cfg) -> int:
    """Branch positions the draft's KV cache keeps for tree decoding (SSD's cache build)."""
    return cache_branches_of(cfg) * cfg.k


def cache_branches_of(cfg) -> int:
    """Branches per row of the speculation cache (0: no cache, nothing pushed)."""
    if cfg.mode != "ssd":
        return 0
    return cache_branches(cfg.fan_out, cfg.fan_out_budget, cfg.k)


def build_speculator(cfg, device, target_ck, link, target_model=None,
                     target_features: torch.Tensor | None = None) -> Speculator:
    """The speculator of ``cfg`` on ``device``, speaking over ``link`` (a :class:`SpecLink`
    between ranks, or a :class:`~ssdlib.distributed.local_link.LocalLink` in the leader's process):
    its draft (checked against the target), its model runner, and in mode ssd its cache. A
    feature draft shares ``target_model``'s embedding and head where given (the stream
    placement), else loads them from the target's weights; ``target_features`` (the target's
    feature buffer, in process) lets its chained builds read the features in place."""
    if cfg.draft is None:
        raise ConfigError("--mode ssd needs --draft")
    vocab = target_ck.config.vocab_size
    # the tokens the draft's head scores (None: all; EngineConfig.draft_vocab)
    head_vocab = cfg.draft_vocab_ids(vocab, target_ck.config.eos_token_ids)
    if is_feature_draft(cfg.draft):
        # KV for the committed tokens and a speculation past them; RoPE also for the branches
        draft = load_feature_draft(cfg.draft, target_ck, target_model, device, cfg.torch_dtype,
                                   max_positions=cfg.max_len + 2 * cfg.k + 2,
                                   head_vocab=head_vocab)
        pool = None  # captured steps (CUDA; the eager path's on a CPU)
        if torch.device(device).type == "cuda":
            pool = make_graph_pool(device, enabled=cfg.cuda_graphs)
        elif eager_step_graphs():
            pool = EagerPool(warmup=1)
        drafter = FeatureSpecDraft(draft, cfg.max_batch + 1, cfg.max_len + cfg.k + 2, vocab,
                                   tree_len_of(cfg), device, cfg.torch_dtype, draws=cfg.k,
                                   use_kernel=use_slot_kernel(device), pool=pool,
                                   compile_backend=feature_compile_backend(
                                       cfg.compile, device, cfg.cuda_graphs))
        return Speculator(cfg, None, link, vocab, drafter,
                          FeatureCacheRole(cfg, drafter, vocab, pool, target_features))
    draft_ck = load_draft(cfg.draft, target_ck)  # checks compatibility
    runner = ModelRunner(draft_ck, None, device, cfg.torch_dtype, cfg.max_batch,
                         cfg.max_len + cfg.k + 2, tree_len=tree_len_of(cfg),
                         cuda_graphs=cfg.cuda_graphs, compile=cfg.compile, head_vocab=head_vocab)
    drafter = Drafter(runner, vocab, draws=cfg.k)
    cache = CacheRole(cfg, runner, drafter, vocab) if cfg.mode == "ssd" else None
    return Speculator(cfg, runner, link, vocab, drafter, cache)


def link_features(cfg, target_ck) -> tuple[int, torch.dtype] | None:
    """What a link's OUTCOMEs carry besides their rows: a feature draft's speculator reads the
    target's features (their width and dtype), a standalone draft's nothing."""
    if not (cfg.mode == "ssd" and is_feature_draft(cfg.draft)):
        return None
    spec = feature_spec_for(cfg.draft, target_ck)
    return spec.width(target_ck.config.hidden_size), cfg.torch_dtype


def serve_speculator(cfg, world, target_ck) -> None:
    """Body of the speculator rank (rank placement of mode ssd) or of the draft's own rank (mode
    sd, separate)."""
    link = SpecLink(world.spec_group, 0, world.device, cfg.max_batch, cfg.k,
                    target_ck.config.vocab_size, staged=world.spec_staged,
                    branches=cache_branches_of(cfg), features=link_features(cfg, target_ck))
    build_speculator(cfg, world.device, target_ck, link).run()
