"""The rank that drafts speculations for the verifier, over a :class:`SpecLink`.

Two roles share the loop (:class:`SpeculatorLoop`):
- :class:`Speculator` (mode ``ssd``, Algorithm 1): receive an outcome -> answer at once from the
  speculation cache (hit) or a fallback (miss) -> send the speculation -> *while the verifier
  verifies it*, build the cache for its likely outcomes (``cache_builder.py``) -> receive the next
  outcome. Answering: ``outcomes.py``.
- :class:`JitSpeculator` (mode ``sd``, ``--draft-placement separate``): the draft on its own rank,
  no cache: every speculation is drafted just in time after its outcome.
"""

from __future__ import annotations

import time

import torch

from ssdlib.engine.cache_builder import CacheBuilder
from ssdlib.engine.drafter import Drafter
from ssdlib.engine.model_runner import ModelRunner
from ssdlib.engine.outcomes import Answer, Fallbacks, answer_jit, lookup
from ssdlib.engine.protocol import SPEC_PHASES, Admit, Op, Outcome, SpeculatorStats
from ssdlib.engine.spec_link import SpecLink
from ssdlib.engine.spec_cache import SpeculationCache
from ssdlib.engine.spec_row import SpecRow
from ssdlib.engine.timing import RoundTimer
from ssdlib.errors import ConfigError
from ssdlib.loading.draft import load_draft
from ssdlib.speculative.acceptance import QKind
from ssdlib.speculative.fanout import FanoutEstimator, parse_fanout


class SpeculatorLoop:
    """Serve ADMIT / OUTCOME until SHUTDOWN; subclasses say how an outcome is answered."""

    def __init__(self, cfg, runner: ModelRunner, link: SpecLink, vocab_size: int):
        self.cfg = cfg
        self.K = cfg.k
        self.runner = runner
        self.link = link
        self.V = vocab_size
        self.device = runner.device
        self.drafter = Drafter(runner, vocab_size)
        self.rows: dict[int, SpecRow] = {}  # by KV slot; the cache is indexed by slot too
        self.sampling = False  # the current exchange's answer carries q
        self.stats = {"idle_s": 0.0, "busy_s": 0.0}
        # cache counters since the last STATS (zero without a cache)
        self.hits = self.lookups = self.reused = 0
        self.t_round: float | None = None  # a verify round as seen from here, seconds
        # each OUTCOME round's phases (SPEC_PHASES), marked on this rank's device; seconds
        # and rounds since the last STATS
        self.timer = RoundTimer(self.device)
        self.rounds = 0
        self.phase_s = dict.fromkeys(SPEC_PHASES, 0.0)

    @staticmethod
    def tree_len(cfg) -> int:
        """Branch positions the draft's KV cache keeps for tree decoding."""
        return 0

    def run(self) -> None:
        t_sent = None
        while True:
            t0 = time.perf_counter()
            header = self.link.recv_header()
            t1 = time.perf_counter()
            self.stats["idle_s"] += t1 - t0
            if t_sent is not None:
                self.t_round = t1 - t_sent
            if header.op == Op.SHUTDOWN:
                return
            if header.op == Op.ADMIT:
                self.admit(self.link.recv_admit(header))
                t_sent = None
            elif header.op == Op.OUTCOME:
                self.timer.start()
                outcome = self.link.recv_outcome(header)
                self.sampling = outcome.sampling
                if self.respond(outcome):
                    t_sent = time.perf_counter()
                    self.after_answer()
                    self.timer.mark("build")
                    self.end_round()
                else:
                    self.send_stats()
                    t_sent = None
            else:
                raise RuntimeError(f"speculator: unknown op {header.op}")
            self.stats["busy_s"] += time.perf_counter() - t1

    def admit(self, msg: Admit) -> None:
        """New sequences join (their slots may have been used by finished ones)."""
        new = [SpecRow.admitted(a, self.device) for a in msg.rows]
        for row in new:
            self.rows[row.slot] = row
        self.on_admit(new)
        # draft prefill (overlaps the target's prefill on the verifier)
        self.drafter.prefill(new)
        for r in new:
            r.valid = len(r.tokens)

    def respond(self, outcome: Outcome) -> bool:
        """Commit the listed rows' outcomes and answer with their next speculations (rows in the
        message's order); False if no listed row is active (then the answer is STATS)."""
        live, ks, bonus = [], [], []
        for slot, k, t, active in zip(outcome.slots, outcome.accepted, outcome.bonus,
                                      outcome.active):
            row = self.rows.get(slot)
            if not active:
                if row is not None:
                    del self.rows[slot]
                continue
            if row.commit(k, t):
                self.observe(row, k)
            live.append(slot)
            ks.append(k)
            bonus.append(t)
        if not live:
            return False
        self.timer.mark("commit")
        answer = self.answer(live, ks, bonus)  # marks "lookup" (with a cache), "fallback"
        self.link.send_spec(answer.in_order(live, outcome.slots))
        self.timer.mark("send")
        answer.record([self.rows[s_] for s_ in live])  # bookkeeping, after the verifier has it
        return True

    def end_round(self) -> None:
        """Add the round's phases. Read back here, after the cache build, not before the answer
        is sent: the wait on the last mark costs nothing, the next step blocks on a receive."""
        for name, dt in self.timer.phases().items():
            self.phase_s[name] += dt
        self.rounds += 1

    def send_stats(self) -> None:
        """Answer to an outcome without active rows: the counters since the last STATS."""
        self.link.send_stats(SpeculatorStats(self.stats["idle_s"], self.stats["busy_s"],
                                             self.hits, self.lookups, self.reused, self.rounds,
                                             self.phase_s))
        self.stats = {"idle_s": 0.0, "busy_s": 0.0}
        self.hits = self.lookups = self.reused = self.rounds = 0
        self.phase_s = dict.fromkeys(SPEC_PHASES, 0.0)

    # -- what a role adds -----------------------------------------------------------------
    def answer(self, live: list[int], ks: list[int], bonus: list[int]) -> Answer:
        """The next speculation of rows ``live`` (slots) after their outcomes (k, t*); marks the
        timer's ``fallback`` phase at its end (and ``lookup`` before it, with a cache)."""
        raise NotImplementedError

    def on_admit(self, new: list[SpecRow]) -> None:
        """Rows joined (before their draft prefill)."""

    def observe(self, row: SpecRow, k: int) -> None:
        """The row's speculation in flight had k tokens accepted."""

    def after_answer(self) -> None:
        """The answer is sent; the verifier is verifying it."""


class Speculator(SpeculatorLoop):
    """SSD's speculator: answers from the speculation cache and rebuilds it every round."""

    def __init__(self, cfg, runner: ModelRunner, link: SpecLink, vocab_size: int):
        super().__init__(cfg, runner, link, vocab_size)
        fan = parse_fanout(cfg.fan_out, self.K)
        self.estimator = FanoutEstimator(cfg.fan_out_budget, self.K) if fan == "auto" else None
        self.fixed_fanout = None if fan == "auto" else fan
        self.B = sum(self.fanout())
        # one row per KV slot, plus the scratch slot's (ghost rows of a captured build)
        self.cache = SpeculationCache(cfg.max_batch + 1, self.B, self.K, vocab_size, self.device)
        self.builder = CacheBuilder(runner, self.drafter, self.cache, vocab_size, cfg.saguaro_c)
        self.fallbacks = Fallbacks(self.drafter, cfg.fallback, self.K, vocab_size)
        self._fanout_used = self.fanout()

    @staticmethod
    def tree_len(cfg) -> int:
        fan = parse_fanout(cfg.fan_out, cfg.k)
        budget = cfg.fan_out_budget if fan == "auto" else sum(fan)
        return budget * cfg.k

    def fanout(self) -> list[int]:
        return self.fixed_fanout if self.fixed_fanout is not None else self.estimator.allocation()

    def on_admit(self, new: list[SpecRow]) -> None:
        self.cache.invalidate([r.slot for r in new])

    def observe(self, row: SpecRow, k: int) -> None:
        if self.estimator is not None:
            self.estimator.observe_verify([k], [self.K])
        if row.kind == int(QKind.ONEHOT):  # an n-gram speculation: learn its a_p
            self.fallbacks.observe_ngram(k)

    def answer(self, live: list[int], ks: list[int], bonus: list[int]) -> Answer:
        ans = lookup(self.cache, live, ks, bonus, self.sampling)
        # rows whose cache was built (not a sequence's first round) count as lookups
        built = [self.rows[s_].fed for s_ in live]
        hit = ans.hit.tolist()
        hs = [h for h, f in zip(hit, built) if f]
        self.lookups += len(hs)
        self.hits += sum(hs)
        if self.estimator is not None and hs:
            fan = self._fanout_used
            self.estimator.observe_lookups([fan[k] for k, f in zip(ks, built) if f], hs)
        missed = [j for j, h in enumerate(hit) if not h]
        self.timer.mark("lookup")
        if missed:
            kind = self.fallbacks.choose(len(self.rows), self.hits, self.lookups, self.t_round,
                                         self.estimator)
            self.fallbacks.fill(kind, [self.rows[live[j]] for j in missed], missed, ans)
        self.timer.mark("fallback")
        return ans

    def after_answer(self) -> None:
        # rows whose new speculation is not in the draft's KV yet (the ones just answered)
        rows = [r for r in self.rows.values() if r.sent is not None and not r.fed]
        fan = self.fanout()
        self._fanout_used = fan
        self.reused += self.builder.build(rows, fan, self.sampling)
        self.cache.publish()  # lands in the host mirror while the verifier verifies


class JitSpeculator(SpeculatorLoop):
    """Plain SD's draft on its own rank: no cache; every speculation is drafted just in time
    after its outcome (the verifier waits for it)."""

    def answer(self, live: list[int], ks: list[int], bonus: list[int]) -> Answer:
        ans = Answer.blank(len(live), self.K, self.V, self.device, self.sampling)
        answer_jit(self.drafter, [self.rows[s_] for s_ in live], self.K, ans,
                   torch.arange(len(live)))
        self.timer.mark("fallback")  # no cache: the whole drafting is the fallback's
        return ans


def serve_speculator(cfg, world, target_ck) -> None:
    """Body of the speculator rank (mode ssd) or of the draft's own rank (mode sd, separate)."""
    if cfg.draft is None:
        raise ConfigError("--mode ssd needs --draft")
    draft_ck = load_draft(cfg.draft, target_ck)  # checks compatibility
    role = Speculator if cfg.mode == "ssd" else JitSpeculator
    runner = ModelRunner(draft_ck, None, world.device, cfg.torch_dtype, cfg.max_batch,
                         cfg.max_len + cfg.k + 2, tree_len=role.tree_len(cfg),
                         cuda_graphs=cfg.cuda_graphs, compile=cfg.compile)
    link = SpecLink(world.spec_group, 0, world.device, cfg.max_batch, cfg.k,
                    target_ck.config.vocab_size, staged=world.spec_staged)
    role(cfg, runner, link, target_ck.config.vocab_size).run()
