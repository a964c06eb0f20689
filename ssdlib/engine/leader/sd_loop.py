"""Mode ``sd``: plain speculative decoding, the draft on the leader rank (the paper's SD baseline).

Each round: every row gets its speculation length K_i (adaptive K,
:mod:`ssdlib.speculative.adaptive_k`); the draft proposes K = max K_i tokens per row, the target
verifies K+1 positions in one forward, the exact rule accepts a prefix k <= K_i of each row and
picks t*, both models keep only committed KV. A round with K = 0 is a plain AR step of the target
(the draft runs nothing, and catches up when a later round drafts); in a batch of greedy rows it is
AR's own step (one position, the argmax read back), with none of the verify's work.
"""

from __future__ import annotations

import torch

from ssdlib.engine.drafter import Drafter
from ssdlib.engine.feature_drafter import FeatureDrafter
from ssdlib.engine.leader.ar_loop import admit_with_first_token, next_token_logits
from ssdlib.engine.leader.metrics import record_acceptance
from ssdlib.engine.leader.verifier import build_link_verifier
from ssdlib.engine.leader.verify import RoundResult, commit_round, read_round, verify_round
from ssdlib.engine.runner.compiled import feature_compile_backend
from ssdlib.engine.runner.model_runner import (ModelRunner, captures_steps, eager_step_graphs,
                                               use_slot_kernel)
from ssdlib.engine.sampler import sample_rows
from ssdlib.engine.timing import RoundTimer
from ssdlib.loading.draft import load_draft
from ssdlib.loading.feature_draft import is_feature_draft, load_feature_draft
from ssdlib.ops.graph_pool import EagerPool, capture_count, make_graph_pool
from ssdlib.speculative.acceptance import DraftQ
from ssdlib.speculative.adaptive_k import AdaptiveK, StepCosts, k_schedule


class SDLoop:
    def __init__(self, target, drafter: Drafter, k: int, device, adaptive: bool = True,
                 sweep: bool = False, schedule: list[int] | None = None):
        self.target = target
        self.drafter = drafter
        self.k = k
        self.device = device
        self.lookahead = k + 1
        self.timer = RoundTimer(device)
        self.policy = AdaptiveK(k, StepCosts(k), enabled=adaptive, sweep=sweep,
                                schedule=schedule or ())
        # (K, whether its draft time measures k draft steps, whether a row probed) of the round
        # whose phases the timer still holds
        self._timed: tuple[int, bool, bool] | None = None

    def admit(self, seqs) -> None:
        admit_with_first_token(self.target, seqs, self.device)
        for q in seqs:
            self.drafter.reset(q.slot)
            self.policy.admit(q.slot)
        # the draft's prefill now, with the target's shapes (the prompts'), not at the first
        # proposal: that may come after rounds at K = 0, with a length no warm-up foresaw
        self.drafter.prefill(seqs)

    def _learn_costs(self, phases: dict, tag: tuple[int, bool, bool, int] | None) -> None:
        """A timed round's phases -> the policy's cost estimates at its batch size: a draft
        step (from a round whose proposal was its chain alone: no prompt, no catch-up), the rest
        of the round."""
        if not phases or tag is None:
            return
        k, plain, probed, rows = tag
        costs = self.policy.costs
        if k > 0 and plain:
            costs.observe_draft(phases.get("draft", 0.0), k, rows)
        costs.observe_round(k, phases.get("verify", 0.0) + phases.get("host", 0.0), rows)
        if probed:
            costs.observe_probe(sum(phases.get(p, 0.0) for p in ("draft", "verify", "host")))

    def step(self, seqs) -> None:
        timer = self.timer
        timer.start()
        captured = capture_count()
        sampled = [not s.params.greedy for s in seqs]
        limits = self.policy.choose([s.slot for s in seqs], sampled)
        k = max(limits)
        if k == 0 and not any(sampled):
            self._ar_round(seqs, limits, captured)
            return
        if k > 0:
            tokens, q = self.drafter.propose(seqs, k, want_q=any(sampled))
            draft_q = DraftQ.from_probs(q) if any(sampled) else None
        else:  # an AR step of the target: no draft work
            self.drafter.skip(seqs)
            tokens = torch.zeros(len(seqs), 0, dtype=torch.int64)
            draft_q = DraftQ.uniform(len(seqs))
        timer.mark("draft")
        self._learn_costs(timer.flush(), self._timed)  # the last round's, read while drafting
        outcome = verify_round(self.target, seqs, tokens, draft_q, self.device,
                               limits=limits, draws=self.k + 1)
        result = read_round(tokens, outcome)
        timer.mark("verify")
        commit_round(seqs, result)
        if k > 0:
            self.drafter.after_commit(seqs, result.accepted, k)
        self._end_round(seqs, limits, result, sampled, captured, k)

    def _ar_round(self, seqs, limits: list[int], captured: int) -> None:
        """A round of greedy rows at K = 0: AR's step (the last token's forward, its argmax
        read back) as the round's result (no drafts, the argmax as t*). The forward is launched
        first; while it runs, the draft's bookkeeping, the last round's times, the round's
        metrics (nothing in them waits for its token) and the next round's choice of K
        (``AdaptiveK.choose_ahead``: a round at K = 0 teaches the policy nothing) are done, so
        that between two forwards a round at K = 0 costs the host what an AR step does."""
        logits = next_token_logits(self.target, seqs)
        self.drafter.skip(seqs)
        self._learn_costs(self.timer.flush(), self._timed)
        keys = [s.slot for s in seqs]
        nothing = [[] for _ in seqs]  # no draft verified, none accepted
        record_acceptance(seqs, RoundResult([0] * len(seqs), [], nothing, []), limits, self.k,
                          [self.policy.alpha(i) for i in keys])
        self.policy.choose_ahead(keys, [False] * len(seqs))
        bonus = sample_rows(logits, seqs)  # the round's read-back
        self.timer.mark("verify")
        commit_round(seqs, RoundResult([0] * len(seqs), bonus, nothing, [[t] for t in bonus]))
        self._close_round(seqs, captured, 0)

    def _end_round(self, seqs, limits, result: RoundResult, sampled, captured: int,
                   k: int) -> None:
        """The policy learns the round's acceptance and, from its times, the costs."""
        keys = [s.slot for s in seqs]
        self.policy.observe(keys, limits, result.accepted, sampled)
        record_acceptance(seqs, result, limits, self.k, [self.policy.alpha(i) for i in keys])
        self._close_round(seqs, captured, k, greedy=not any(sampled))

    def _close_round(self, seqs, captured: int, k: int, greedy: bool = True) -> None:
        """The round's times: kept for the next round's flush, or read now and learnt."""
        timer = self.timer
        timer.mark("host")
        phases = timer.add_to(seqs, defer=True)  # {} when kept for the next round's flush
        # a round that captured a step (a sweep's, a new shape's) says nothing of the costs;
        # nor does one with sampling rows: only greedy rows decide on measured costs, and a
        # sampled round's steps may be others (adaptive_k's module doc, Costs)
        tag = None if self.policy.sweeping or capture_count() != captured or not greedy else \
            (k, k > 0 and self.drafter.plain, self.policy.probed, len(seqs))
        self._timed = tag if timer.timed and not phases else None
        self._learn_costs(phases, tag)

    def batch_metrics(self) -> dict:
        """The policy's cost estimates (ms), for the run's metrics."""
        return {"k_costs": self.policy.costs.snapshot()}


def build_sd_loop(cfg, world, target, target_ck):
    if cfg.draft_placement == "separate":
        # the draft on its own rank (a Speculator without a cache), speculations over the SSD link
        return build_link_verifier(cfg, world, target, target_ck)
    # the tokens the draft's head scores (None: all; EngineConfig.draft_vocab)
    head_vocab = cfg.draft_vocab_ids(target_ck.config.vocab_size, target_ck.config.eos_token_ids)
    if is_feature_draft(cfg.draft):
        # reads the target's features (its runner keeps them: runtime.build_rank); shares the
        # target's embedding and head where the target is unsharded
        model = target.runner.model if cfg.tp == 1 else None
        draft = load_feature_draft(cfg.draft, target_ck, model, world.device, cfg.torch_dtype,
                                   max_positions=target.runner.cache.max_len,
                                   head_vocab=head_vocab)
        pool = None  # the greedy chain's captured steps (CUDA; the eager path's on a CPU)
        if world.device.type == "cuda":
            pool = make_graph_pool(world.device, enabled=cfg.cuda_graphs)
        elif eager_step_graphs():
            pool = EagerPool(warmup=1)
        drafter = FeatureDrafter(draft, target.runner.cache.features, cfg.max_batch + 1,
                                 target.runner.cache.max_len, target_ck.config.vocab_size,
                                 draws=cfg.k, pool=pool, use_kernel=use_slot_kernel(world.device),
                                 compile_backend=feature_compile_backend(
                                     cfg.compile, world.device, cfg.cuda_graphs))
        loop = SDLoop(target, drafter, cfg.k, world.device, adaptive=cfg.adaptive_k,
                      sweep=captures_steps(world.device), schedule=k_schedule(cfg.k))
        return loop, (pool.clear if pool is not None else lambda: None)
    draft_ck = load_draft(cfg.draft, target_ck)  # checks compatibility
    runner = ModelRunner(draft_ck, None, world.device, cfg.torch_dtype, cfg.max_batch, cfg.max_len,
                         cuda_graphs=cfg.cuda_graphs, compile=cfg.compile, head_vocab=head_vocab)
    drafter = Drafter(runner, target_ck.config.vocab_size, draws=cfg.k)
    loop = SDLoop(target, drafter, cfg.k, world.device, adaptive=cfg.adaptive_k,
                  sweep=captures_steps(world.device), schedule=k_schedule(cfg.k))
    return loop, lambda: None
