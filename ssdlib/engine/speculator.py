"""The rank that drafts speculations for the verifier, over a :class:`SpecLink`.

Two roles share the loop (:class:`SpeculatorLoop`):
- :class:`Speculator` (mode ``ssd``, Algorithm 1): receive an outcome, which carries the next
  speculation the leader took from its copy of the cache (hit) or a fallback drawn there (miss),
  or asks for a jit draft -> answer the jit rows (and q when sampling) -> *while the verifier
  verifies*, build the cache for the speculation's likely outcomes (``cache_builder.py``) and
  push its keys and tokens to the leader (CACHE) -> receive the next outcome. Answering:
  ``outcomes.py``; the leader's lookup: ``cache_mirror.py``.
- :class:`JitSpeculator` (mode ``sd``, ``--draft-placement separate``): the draft on its own rank,
  no cache: every speculation is drafted just in time after its outcome.
"""

from __future__ import annotations

import time

import torch

from ssdlib.engine.batching import to_device
from ssdlib.engine.cache_builder import CacheBuilder
from ssdlib.engine.drafter import Drafter
from ssdlib.engine.model_runner import ModelRunner
from ssdlib.engine.outcomes import Answer, Fallbacks, answer_jit, q_after_build
from ssdlib.engine.protocol import (SPEC_HOST_SEGMENTS, SPEC_PHASES, Admit, Op, Outcome,
                                    SpeculatorStats)
from ssdlib.engine.spec_link import SpecLink
from ssdlib.engine.spec_cache import SpeculationCache
from ssdlib.engine.spec_row import SpecRow
from ssdlib.engine.timing import HostClock, RoundTimer
from ssdlib.errors import ConfigError
from ssdlib.loading.draft import load_draft
from ssdlib.profiling import RoundProfiler
from ssdlib.speculative.acceptance import QKind
from ssdlib.speculative.fallback import FALLBACKS
from ssdlib.speculative.fanout import FanoutEstimator, cache_branches, parse_fanout


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
        self.t_verify: float | None = None  # the leader's last verify forward, seconds
        # each OUTCOME round's phases (SPEC_PHASES), marked on this rank's device; seconds
        # and rounds since the last STATS
        self.timer = RoundTimer(self.device)
        self.rounds = 0
        self.phase_s = dict.fromkeys(SPEC_PHASES, 0.0)
        self.clock = HostClock()  # SSDLIB_HOST_TIMES=1: the same rounds by the host clock
        self.host_s = dict.fromkeys(SPEC_HOST_SEGMENTS, 0.0)
        self.profiler = RoundProfiler(f"{cfg.mode}-speculator")  # SSDLIB_PROFILE (off: no-op)
        # send a sampling SPEC's q only once the round's work that follows the answer (the
        # cache build) is launched (``after_answer``): a role with such work sets it
        self.hold_q = False

    @staticmethod
    def tree_len(cfg) -> int:
        """Branch positions the draft's KV cache keeps for tree decoding."""
        return 0

    @staticmethod
    def cache_branches(cfg) -> int:
        """Branches per row of the speculation cache (0: no cache, nothing pushed)."""
        return 0

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
        for the round's last mark); otherwise :meth:`read_round_times` does it later."""
        self.after_answer()
        if read_times:
            self.end_round()

    def shutdown(self) -> None:
        self.profiler.close()
        self.runner.release_graphs()

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
            if row.commit(k, t):
                self.observe(row, k)
                verified.append(k)
            live.append(i)
        self.observe_round(verified)
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
        answer.record([self.rows[s_] for s_ in slots])  # bookkeeping, after the verifier has it
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

    def send_stats(self) -> None:
        """Answer to an outcome without active rows: the counters since the last STATS."""
        self.link.send_stats(SpeculatorStats(self.stats["idle_s"], self.stats["busy_s"],
                                             self.hits, self.lookups, self.reused, self.rounds,
                                             self.phase_s, self.host_s))
        self.stats = {"idle_s": 0.0, "busy_s": 0.0}
        self.hits = self.lookups = self.reused = self.rounds = 0
        self.phase_s = dict.fromkeys(SPEC_PHASES, 0.0)
        self.host_s = dict.fromkeys(SPEC_HOST_SEGMENTS, 0.0)

    # -- what a role adds -----------------------------------------------------------------
    def answer(self, outcome: Outcome, live: list[int]) -> Answer:
        """The next speculation of the rows at positions ``live`` of ``outcome``: as the leader
        chose it, the JIT rows drafted now (and q when the exchange samples)."""
        ans, jit = Answer.from_outcome(outcome, live, self.V, self.device)
        if jit:
            self.draft_now([self.rows[outcome.slots[live[j]]] for j in jit], ans, jit)
        return ans

    def draft_now(self, rows: list[SpecRow], ans: Answer, loc: list[int]) -> None:
        """Draft ``rows`` (positions ``loc`` of ``ans``) just in time."""
        answer_jit(self.drafter, rows, self.K, ans, torch.tensor(loc))

    def on_admit(self, new: list[SpecRow]) -> None:
        """Rows joined (before their draft prefill)."""

    def observe(self, row: SpecRow, k: int) -> None:
        """The row's speculation in flight had k tokens accepted."""

    def observe_round(self, accepted: list[int]) -> None:
        """The round's verified rows had ``accepted`` tokens accepted (one call a round)."""

    def after_answer(self) -> None:
        """The answer is sent; the verifier is verifying it (a role with a cache builds and
        pushes it here, marking the ``build`` and ``push`` phases)."""


class Speculator(SpeculatorLoop):
    """SSD's speculator: answers from the speculation cache and rebuilds it every round."""

    def __init__(self, cfg, runner: ModelRunner, link: SpecLink, vocab_size: int):
        super().__init__(cfg, runner, link, vocab_size)
        fan = parse_fanout(cfg.fan_out, self.K)
        self.estimator = FanoutEstimator(cfg.fan_out_budget, self.K) if fan == "auto" else None
        self.fixed_fanout = None if fan == "auto" else fan
        self.B = self.cache_branches(cfg)
        # one row per KV slot, plus the scratch slot's (ghost rows of a captured build)
        self.cache = SpeculationCache(cfg.max_batch + 1, self.B, self.K, vocab_size, self.device)
        self.builder = CacheBuilder(runner, self.drafter, self.cache, vocab_size, cfg.saguaro_c)
        self.fallbacks = Fallbacks(self.drafter, cfg.fallback, self.K, vocab_size)
        if self.B != sum(self.fanout()):
            raise ConfigError(f"fan-out {self.fanout()} does not sum to the cache's "
                              f"{self.B} branches")
        self._fanout_used = self.fanout()
        self.hold_q = q_after_build()

    @staticmethod
    def tree_len(cfg) -> int:
        return Speculator.cache_branches(cfg) * cfg.k

    @staticmethod
    def cache_branches(cfg) -> int:
        return cache_branches(cfg.fan_out, cfg.fan_out_budget, cfg.k)

    def fanout(self) -> list[int]:
        return self.fixed_fanout if self.fixed_fanout is not None else self.estimator.allocation()

    def on_admit(self, new: list[SpecRow]) -> None:
        self.cache.invalidate([r.slot for r in new])

    def observe_round(self, accepted: list[int]) -> None:
        if self.estimator is not None and accepted:
            self.estimator.observe_verify(accepted, [self.K] * len(accepted))

    def observe(self, row: SpecRow, k: int) -> None:
        if row.kind == int(QKind.ONEHOT):  # an n-gram speculation: learn its a_p
            self.fallbacks.observe_ngram(k)
        elif row.kind == int(QKind.DENSE) and not row.hit:  # a jit draft: its a_p on misses
            self.fallbacks.observe_jit(k)

    def answer(self, outcome: Outcome, live: list[int]) -> Answer:
        # the CACHE's rows, on the device now: the push after the build launches without a
        # host copy that would wait for the build
        dev = self.device
        rows = torch.tensor([outcome.slots, outcome.active],  # one host-to-device copy
                            dtype=torch.int64).to(dev, non_blocking=True)
        self._push_rows = (rows[0], rows[1].bool())
        ans = super().answer(outcome, live)
        # rows whose cache was built (not a sequence's first round) count as lookups
        built = [self.rows[outcome.slots[i]].fed for i in live]
        hit = ans.hit.tolist()
        hs = [h for h, f in zip(hit, built) if f]
        self.lookups += len(hs)
        self.hits += sum(hs)
        self.fallbacks.observe_lookups(len(hs), sum(hs))
        if self.estimator is not None and hs:
            fan = self._fanout_used
            self.estimator.observe_lookups(
                [fan[outcome.accepted[i]] for i, f in zip(live, built) if f], hs)
        if ans.q is not None and any(hit):  # the hit rows' q, gathered here on the device
            branch = ans.branch.tolist()
            at = [j for j, h in enumerate(hit) if h]
            # (position in the answer, cache row, branch) in one asynchronous copy: a blocking
            # one (torch.tensor(..., device=cuda), .to(cuda)) waits for the stream to drain
            sel = to_device([at, [outcome.slots[live[j]] for j in at], [branch[j] for j in at]],
                            self.device)
            ans.q[sel[0]] = self.cache.gather_q(sel[1], sel[2])
        return ans

    def draft_now(self, rows: list[SpecRow], ans: Answer, loc: list[int]) -> None:
        self.fallbacks.jit(rows, ans, loc)  # timed: Thm 17 weighs jit's cost

    def after_answer(self) -> None:
        # rows whose new speculation is not in the draft's KV yet (the ones just answered)
        rows = [r for r in self.rows.values() if r.sent is not None and not r.fed]
        fan = self.fanout()
        self._fanout_used = fan
        self.reused += self.builder.build(rows, fan, self.sampling)
        self.link.send_held_q()  # (with hold_q) the build is launched: q goes out beside it
        self.timer.mark("build")
        self.clock.tick("build")
        self.push_cache()
        self.timer.mark("push")
        self.clock.tick("push")

    def push_cache(self) -> None:
        """CACHE: the built rows' keys and tokens for the leader's lookup, in the answered
        OUTCOME's order of rows, with the backup for the next round's misses (Thm 17's
        choice)."""
        kind = self.fallbacks.choose(len(self.rows), self.t_verify, self.estimator)
        rows, live = self._push_rows
        self.link.send_cache(self.cache.pushed_rows(rows, live, FALLBACKS.index(kind)))


class JitSpeculator(SpeculatorLoop):
    """Plain SD's draft on its own rank: no cache; every speculation is drafted just in time
    after its outcome (the verifier waits for it)."""


def speculator_role(cfg) -> type[SpeculatorLoop]:
    """The role a configuration's speculator plays: SSD's cache, or plain SD's separate draft."""
    return Speculator if cfg.mode == "ssd" else JitSpeculator


def build_speculator(cfg, device, target_ck, link) -> SpeculatorLoop:
    """The speculator of ``cfg`` on ``device``, speaking over ``link`` (a :class:`SpecLink`
    between ranks, or a :class:`~ssdlib.engine.local_link.LocalLink` in the leader's process):
    its draft (checked against the target) and its model runner."""
    if cfg.draft is None:
        raise ConfigError("--mode ssd needs --draft")
    draft_ck = load_draft(cfg.draft, target_ck)  # checks compatibility
    role = speculator_role(cfg)
    runner = ModelRunner(draft_ck, None, device, cfg.torch_dtype, cfg.max_batch,
                         cfg.max_len + cfg.k + 2, tree_len=role.tree_len(cfg),
                         cuda_graphs=cfg.cuda_graphs, compile=cfg.compile)
    return role(cfg, runner, link, target_ck.config.vocab_size)


def serve_speculator(cfg, world, target_ck) -> None:
    """Body of the speculator rank (rank placement of mode ssd) or of the draft's own rank (mode
    sd, separate)."""
    link = SpecLink(world.spec_group, 0, world.device, cfg.max_batch, cfg.k,
                    target_ck.config.vocab_size, staged=world.spec_staged,
                    branches=speculator_role(cfg).cache_branches(cfg))
    build_speculator(cfg, world.device, target_ck, link).run()
