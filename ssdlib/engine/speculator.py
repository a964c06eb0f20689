"""The speculator rank of SSD (Algorithm 1): the draft model, the speculation cache, fallbacks.
(Also the separate draft rank of plain SD, ``--draft-placement separate``: no cache, jit only.)

Loop: receive an outcome -> answer at once from the cache (hit) or from a fallback (miss) ->
send the speculation -> *while the verifier verifies it*, build the cache for its likely outcomes
-> receive the next outcome.

Building the cache for a speculation s_1..s_K of a row with n committed tokens:
1. one draft forward over the tokens the draft has not committed yet plus s_1..s_K gives the
   draft's distributions at the K+1 positions (and leaves their KV in the row's slot);
2. outcomes: at position k < K the top-F_k draft tokens other than s_{k+1} (the bonus after a
   rejection at k+1 cannot be s_{k+1}), at k = K the top-F_K; B = sum F_k branches per row;
3. K tree-decode steps draft every branch at once: branch (k, t) holds t at position n+k, then its
   own tokens; it attends to the slot's first n+k keys and to its own earlier branch tokens
   (tree mask), its KV goes to the tree scratch region, never to the slot.
Draft tokens are sampled from Saguaro's sigma_{F,C} of the draft distribution (F = the fan-out
of the position being drafted); that exact q goes to the verifier with the tokens.
"""

from __future__ import annotations

import time

import torch

from ssdlib.engine.batching import pack_rows
from ssdlib.engine.drafter import Drafter
from ssdlib.engine.model_runner import ModelRunner
from ssdlib.engine.protocol import OP_ADMIT, OP_OUTCOME, OP_SHUTDOWN, SpecLink
from ssdlib.engine.sampler import row_distributions
from ssdlib.engine.spec_cache import SpeculationCache
from ssdlib.errors import ConfigError
from ssdlib.loading import load_checkpoint
from ssdlib.loading.compat import check_draft_compatible
from ssdlib.log import get_logger
from ssdlib.ops.tree_mask import tree_mask_full
from ssdlib.sampling import SamplingParams, row_generators
from ssdlib.speculative.acceptance import QKind
from ssdlib.speculative.fallback import choose_fallback
from ssdlib.speculative.fanout import FanoutEstimator, parse_fanout
from ssdlib.speculative.ngram import ngram_or_random, random_tokens
from ssdlib.speculative.rng import sample_token
from ssdlib.speculative.saguaro import saguaro_q

log = get_logger(__name__)

# Salt that separates the speculator's random streams from the verifier's for the same seed.
SPEC_STREAM = 7_777_777
# fallback="auto" (Thm 17): lookups observed before deciding; n-gram cost in verify rounds
# (a suffix search, ~0) and the prior of its per-token acceptance (then measured online); a_p
# prior for an explicit fan-out list (no estimator).
MIN_LOOKUPS_FOR_AUTO = 8
NGRAM_COST = 0.0
NGRAM_ACCEPTANCE_PRIOR = 0.2
A_P_PRIOR = 0.7


class SpecRow:
    """The speculator's mirror of one sequence of the static batch."""

    def __init__(self, slot: int, tokens: list[int], params: SamplingParams, index: int,
                 device: torch.device):
        self.slot = slot
        self.tokens = tokens  # committed
        self.params = params
        self.generator = row_generators(params.seed, 1, device, offset=SPEC_STREAM + index)[0]
        self.valid = 0  # leading committed tokens whose draft KV in the slot is correct
        self.sent: list[int] | None = None  # the speculation in flight
        self.fed = False  # the speculation's tokens are in the slot (cache was built)
        self.reuse: int | None = None  # cache branch that answered the last outcome (a hit)
        self.kind = int(QKind.DENSE)


class Speculator:
    def __init__(self, cfg, runner: ModelRunner, link: SpecLink, vocab_size: int):
        self.cfg = cfg
        self.K = cfg.k
        self.runner = runner
        self.link = link
        self.V = vocab_size
        self.device = runner.device
        # mode "sd" with --draft-placement separate: the same rank and protocol, but no
        # speculation cache: every speculation is drafted just in time after its outcome
        self.use_cache = cfg.mode == "ssd"
        fan = parse_fanout(cfg.fan_out, self.K) if self.use_cache else [0] * (self.K + 1)
        self.estimator = FanoutEstimator(cfg.fan_out_budget, self.K) if fan == "auto" else None
        self.fixed_fanout = None if fan == "auto" else fan
        self.B = sum(self.fanout())
        self.cache = SpeculationCache(cfg.max_batch, self.B, self.K, vocab_size, self.device)
        # Candidates kept from drafting each branch, so a hit needs no recomputation: the draft's
        # top-C tokens after each branch token [rows, B, K, C] (C = max fan-out + 1).
        self.C = min(self.B + 1, vocab_size)
        self.branch_top = torch.zeros(cfg.max_batch, self.B, self.K, self.C, dtype=torch.int64,
                                      device=self.device)
        self.drafter = Drafter(runner, vocab_size)
        self.rows: dict[int, SpecRow] = {}  # by KV slot; the cache is indexed by slot too
        self.sampling = False
        self.stats = {"idle_s": 0.0, "busy_s": 0.0}
        # measured costs for the fallback policy, in seconds
        self.t_jit: float | None = None
        self.t_round: float | None = None
        self.hits = 0
        self.lookups = 0
        self.reused = 0  # hits whose branch KV and candidates were reused
        self.ngram_accepted = self.ngram_tried = 0  # per-token acceptance of n-gram proposals
        self._fanout_used = self.fanout()

    def fanout(self) -> list[int]:
        return self.fixed_fanout if self.fixed_fanout is not None else self.estimator.allocation()

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> None:
        t_sent = None
        while True:
            t0 = time.perf_counter()
            op, b, n, sampling = self.link.recv_header()
            t1 = time.perf_counter()
            self.stats["idle_s"] += t1 - t0
            if t_sent is not None:
                self.t_round = t1 - t_sent  # a verify round as seen from here
            if op == OP_SHUTDOWN:
                return
            if op == OP_ADMIT:
                self.admit(b, n)
                t_sent = None
            elif op == OP_OUTCOME:
                outcome = self.link.recv_outcome(b)
                self.sampling = bool(sampling)
                if self.apply_outcome(outcome):
                    t_sent = time.perf_counter()
                    if self.use_cache:
                        self.build_cache()
                else:
                    self.send_final()
                    t_sent = None
            else:
                raise RuntimeError(f"speculator: unknown op {op}")
            self.stats["busy_s"] += time.perf_counter() - t1

    def admit(self, b: int, n_tokens: int) -> None:
        """New sequences join (their slots may have been used by finished ones)."""
        rows, params, tokens = self.link.recv_admit(b, n_tokens)
        new = []
        offset = 0
        for (slot, length, index, seed), (temp, top_p, top_k) in zip(rows.tolist(),
                                                                     params.tolist()):
            sp = SamplingParams(temperature=temp, top_p=top_p, top_k=int(top_k),
                                seed=None if seed < 0 else seed)
            row = SpecRow(slot, tokens[offset:offset + length].tolist(), sp, index, self.device)
            self.rows[slot] = row
            new.append(row)
            offset += length
        self.cache.ready[torch.tensor([r.slot for r in new], device=self.device)] = False
        # draft prefill (overlaps the target's prefill on the verifier)
        self.drafter.prefill(new)
        for r in new:
            r.valid = len(r.tokens)

    # -- answering an outcome -------------------------------------------------------------
    def apply_outcome(self, outcome: torch.Tensor) -> bool:
        """Commit the listed rows' outcomes and answer with their next speculations (rows in the
        message's order); False if no listed row is active (then the answer is STATS)."""
        order = outcome[:, 0].tolist()
        live, ks, bonus = [], [], []
        for slot, k, t, active in outcome.tolist():
            row = self.rows.get(slot)
            if not active:
                if row is not None:
                    del self.rows[slot]
                continue
            n = len(row.tokens)
            if row.sent is not None:
                row.tokens += row.sent[:k] + [t]
                if row.fed:
                    row.valid = n + k
                if self.estimator is not None:
                    self.estimator.observe_verify([k], [self.K])
                if row.kind == int(QKind.ONEHOT):  # an n-gram speculation: learn its a_p
                    self.ngram_accepted += k
                    self.ngram_tried += k + (1 if k < self.K else 0)
            else:
                row.tokens.append(t)
            live.append(slot)
            ks.append(k)
            bonus.append(t)
        if not live:
            return False
        slots_t = torch.tensor(live, dtype=torch.int64)
        hit, branch = self.cache.lookup(slots_t, torch.tensor(ks), torch.tensor(bonus))
        hit = hit.cpu()
        # rows whose cache was built (not a sequence's first round) count as lookups
        built = [self.rows[s_].fed for s_ in live]
        hs = [bool(h) for h, f in zip(hit.tolist(), built) if f]
        self.lookups += len(hs)
        self.hits += sum(hs)
        if self.estimator is not None and hs:
            fan = self._fanout_used
            self.estimator.observe_lookups([fan[k] for k, f in zip(ks, built) if f], hs)
        tokens = torch.zeros(len(live), self.K, dtype=torch.int64)
        kinds = torch.full((len(live),), int(QKind.DENSE), dtype=torch.int64)
        q = torch.zeros(len(live), self.K, self.V, device=self.device) if self.sampling else None
        if bool(hit.any()):
            idx = hit.nonzero().squeeze(-1)
            rows_h, br = slots_t[idx].to(self.device), branch[idx.to(branch.device)]
            tokens[idx] = self.cache.tokens[rows_h, br].cpu()
            if q is not None:
                q[idx.to(self.device)] = self.cache.q[rows_h, br]
        missed = [j for j in range(len(live)) if not hit[j]]
        if missed:
            self._fallback([live[j] for j in missed], missed, tokens, kinds, q)
        for j, slot in enumerate(live):
            row = self.rows[slot]
            row.reuse = int(branch[j]) if bool(hit[j]) and row.fed else None
            row.sent = tokens[j].tolist()
            row.fed = False
            row.kind = int(kinds[j])
        # answer in the message's order (inactive rows: zeros, ignored by the leader)
        pos = torch.tensor([order.index(s_) for s_ in live])
        full_tokens = torch.zeros(len(order), self.K, dtype=torch.int64)
        full_kinds = torch.zeros(len(order), dtype=torch.int64)
        full_hit = torch.zeros(len(order), dtype=torch.bool)
        full_tokens[pos], full_kinds[pos], full_hit[pos] = tokens, kinds, hit
        full_q = None
        if q is not None:
            full_q = torch.zeros(len(order), self.K, self.V, device=self.device)
            full_q[pos.to(self.device)] = q
        self.link.send_spec(full_tokens.to(self.device), full_kinds.to(self.device),
                            full_hit.to(self.device), full_q)
        return True

    def choose_fallback(self) -> str:
        """The configured backup, or Thm 17's choice from measured p_hit, jit cost (in verify
        rounds) and the batch size; jit until there are measurements."""
        if not self.use_cache:
            return "jit"
        if self.cfg.fallback != "auto":
            return self.cfg.fallback
        if self.t_jit is None or not self.t_round or self.lookups < MIN_LOOKUPS_FOR_AUTO:
            return "jit"
        p_hit = self.hits / self.lookups
        a_p = self.estimator.a_p if self.estimator is not None else A_P_PRIOR
        return choose_fallback(len(self.rows), p_hit, a_p, self.K, self.t_jit / self.t_round,
                               NGRAM_COST, self.ngram_acceptance())

    def ngram_acceptance(self) -> float:
        """Measured per-token acceptance of n-gram speculations, shrunk towards the prior."""
        prior_tries = 10
        return ((self.ngram_accepted + NGRAM_ACCEPTANCE_PRIOR * prior_tries)
                / (self.ngram_tried + prior_tries))

    def _fallback(self, slots, local, tokens, kinds, q) -> None:
        rows = [self.rows[s_] for s_ in slots]
        kind = self.choose_fallback()
        loc = torch.tensor(local)
        if kind == "jit":
            t0 = time.perf_counter()
            for r in rows:
                self.drafter.valid[r.slot] = r.valid
            toks, qs = self.drafter.propose(rows, self.K, want_q=q is not None)
            for r in rows:
                r.valid = len(r.tokens)  # the drafted tokens' KV is speculative
            self.t_jit = time.perf_counter() - t0
            tokens[loc] = toks.cpu()
            kinds[loc] = int(QKind.DENSE)
            if q is not None:
                q[loc.to(self.device)] = qs.to(q.dtype)
        else:
            gens = [r.generator for r in rows]
            if kind == "ngram":
                toks, dq = ngram_or_random([r.tokens for r in rows], self.K, self.V, gens)
            else:
                toks = random_tokens(gens, len(rows), self.K, self.V).cpu()
                dq = None
            tokens[loc] = toks
            kinds[loc] = (dq.kinds.cpu() if dq is not None
                          else torch.full((len(rows),), int(QKind.UNIFORM)))

    def send_final(self) -> None:
        """Answer to an outcome without active rows: the counters since the last STATS."""
        self.link.send_stats(torch.tensor([self.stats["idle_s"], self.stats["busy_s"],
                                           float(self.hits), float(self.lookups),
                                           float(self.reused)], dtype=torch.float64))
        self.stats = {"idle_s": 0.0, "busy_s": 0.0}
        self.hits = self.lookups = self.reused = 0

    # -- building the cache ---------------------------------------------------------------
    @torch.inference_mode()
    def build_cache(self) -> None:
        # rows whose new speculation is not in the draft's KV yet (the ones just answered)
        rows = [r for r in self.rows.values() if r.sent is not None and not r.fed]
        live = [r.slot for r in rows]  # cache rows are slots
        K, B, dev = self.K, self.B, self.device
        fan = self.fanout()
        self._fanout_used = fan
        # 1. the draft's top candidates at the speculation's K+1 positions [b, K+1, C]
        cand = self._candidates(live, rows)
        slots = torch.tensor([r.slot for r in rows], device=dev)
        for r in rows:
            r.fed = True
        # 2. outcomes to cache: (fork k, bonus t) per branch
        sent = torch.tensor([r.sent for r in rows], device=dev)  # [b, K]
        forks, bonus = [], []
        for k, f in enumerate(fan):
            if f == 0:
                continue
            f_eff = min(f, self.V - (1 if k < K else 0))
            top = cand[:, k, :min(f_eff + 1, self.C)]  # [b, f+1]
            if k < K:
                keep = top != sent[:, k:k + 1]
                # drop s_{k+1} if present, else the last candidate: f tokens per row
                order = torch.argsort((~keep).int(), dim=-1, stable=True)[:, :f_eff]
                top = top.gather(1, order)
            else:
                top = top[:, :f_eff]
            if f_eff < f:  # tiny vocabularies: repeat the last candidate (a duplicate never hits twice)
                top = torch.cat([top, top[:, -1:].expand(-1, f - f_eff)], dim=1)
            forks.append(torch.full_like(top, k))
            bonus.append(top)
        fork = torch.cat(forks, 1)  # [b, B]
        first = torch.cat(bonus, 1)  # [b, B]
        # 3. K tree-decode steps over all branches of all rows
        lengths = [len(r.tokens) for r in rows]  # committed
        n = torch.tensor(lengths, device=dev)
        kv_len = max(lengths) + K  # > every slot key a branch sees
        kv_limit = n.view(-1, 1) + fork  # [b, B]: branch (k, t) sees the prefix + s_1..s_k
        # branch-to-branch visibility of all depths at once (tree-mask kernel on GPU); depth
        # d's queries are rows d*B..(d+1)*B, over the first B*(d+1) branch keys
        full = tree_mask_full(fork, K, K)[..., K:]  # [b, B*K, B*K]
        rows_t = torch.tensor(live, device=dev)
        if not self.sampling:  # greedy branches: all depths in one captured chain
            v = min(self.V, self.runner.config.vocab_size)
            out_tokens, tops = self.runner.greedy_tree(first, kv_limit, full, slots, K,
                                                       min(self.C, v), v, kv_len)
            self.branch_top[rows_t, :, :, :tops.shape[-1]] = tops
            self.cache.tokens[rows_t] = out_tokens
            self.cache.store_keys(rows_t, fork, first)
            return
        fan_t = torch.tensor(fan, device=dev)
        tok = first
        out_tokens = torch.empty(len(rows), B, K, dtype=torch.int64, device=dev)
        for d in range(K):
            positions = kv_limit + d
            tree_index = (d * B + torch.arange(B, device=dev)).expand(len(rows), B)
            lg = self.drafter._logits(self.runner.tree_forward(
                tok, positions, slots, tree_index, kv_limit,
                full[:, d * B:(d + 1) * B, :B * (d + 1)], kv_len))  # [b, B, V]
            self.branch_top[rows_t, :, d] = lg.topk(self.C, dim=-1).indices
            tok = self._sample_branches(lg, rows, fan_t[d] if d < len(fan) else 0,
                                        rows_t, d)
            out_tokens[:, :, d] = tok
        self.cache.tokens[rows_t] = out_tokens
        self.cache.store_keys(rows_t, fork, first)

    def _candidates(self, live: list[int], rows: list[SpecRow]) -> torch.Tensor:
        """Top-C draft tokens at positions 1..K+1 of each row's sent speculation: [b, K+1, C].

        A row whose speculation came from the cache (a hit) reuses what drafting its branch
        computed: the branch KV is copied from the tree scratch into the slot and the stored
        candidates give positions 1..K; only s_K is fed (for position K+1). Other rows (first
        round, fallbacks) run one forward over their unseen committed tokens + s_1..s_K.
        """
        K, B, dev = self.K, self.B, self.device
        cand = torch.empty(len(rows), K + 1, self.C, dtype=torch.int64, device=dev)
        reuse = [j for j, r in enumerate(rows) if r.reuse is not None]
        full = [j for j, r in enumerate(rows) if r.reuse is None]
        cache = self.runner.cache
        if reuse:
            self.reused += len(reuse)
            for j in reuse:
                r = rows[j]
                start = len(r.tokens) - 1  # the branch's first token t* sits here
                idx = torch.arange(K, device=dev) * B + r.reuse
                cache.k[:, r.slot, :, start:start + K] = cache.tree_k[:, r.slot, :, idx]
                cache.v[:, r.slot, :, start:start + K] = cache.tree_v[:, r.slot, :, idx]
                r.valid = len(r.tokens)
            sel = torch.tensor([live[j] for j in reuse], device=dev)
            br = torch.tensor([rows[j].reuse for j in reuse], device=dev)
            jj = torch.tensor(reuse, device=dev)
            cand[jj, :K] = self.branch_top[sel, br]
            ids = torch.tensor([[rows[j].sent[-1]] for j in reuse])
            pos = torch.tensor([[len(rows[j].tokens) + K - 1] for j in reuse])
            slots = torch.tensor([rows[j].slot for j in reuse])
            logits = self.drafter._logits(self.runner.forward(ids, pos, slots))[:, 0]
            cand[jj, K] = logits.topk(self.C, dim=-1).indices
        if full:
            sub = [rows[j] for j in full]
            # at least the last committed token is fed: its output is the dist at position 1
            starts = [min(r.valid, len(r.tokens) - 1) for r in sub]
            inputs = [r.tokens[st:] + r.sent for r, st in zip(sub, starts)]
            ids, pos = pack_rows(inputs, starts)
            index = torch.tensor([[len(x) - K - 1 + i for i in range(K + 1)] for x in inputs])
            slots = torch.tensor([r.slot for r in sub])
            logits = self.drafter._logits(self.runner.forward(ids, pos, slots, index))
            cand[torch.tensor(full, device=dev)] = logits.topk(self.C, dim=-1).indices
        return cand

    def _sample_branches(self, logits, rows, f, rows_t, depth) -> torch.Tensor:
        """logits [b, B, V] -> next token per branch; records q in the cache when sampling."""
        out = logits.argmax(-1)
        if not self.sampling:
            return out
        q_all = row_distributions(logits, rows)  # [b, B, V]; one-hot for greedy rows
        for i, r in enumerate(rows):
            if not r.params.greedy:
                q_all[i] = saguaro_q(q_all[i], int(f), self.cfg.saguaro_c)
                out[i] = sample_token(q_all[i], [r.generator] * q_all.shape[1])
        self.cache.q[rows_t, :, depth] = q_all
        return out


def serve_speculator(cfg, world, target_ck) -> None:
    """Body of the speculator rank."""
    if cfg.draft is None:
        raise ConfigError("--mode ssd needs --draft")
    draft_ck = load_checkpoint(cfg.draft)
    check_draft_compatible(target_ck, draft_ck)
    fan = parse_fanout(cfg.fan_out, cfg.k) if cfg.mode == "ssd" else [0]
    budget = cfg.fan_out_budget if fan == "auto" else sum(fan)
    runner = ModelRunner(draft_ck, None, world.device, cfg.torch_dtype, cfg.max_batch,
                         cfg.max_len + cfg.k + 2, tree_len=budget * cfg.k,
                         cuda_graphs=cfg.cuda_graphs)
    link = SpecLink(world.spec_group, 0, world.device, cfg.max_batch, cfg.k,
                    target_ck.config.vocab_size, staged=world.spec_staged)
    Speculator(cfg, runner, link, target_ck.config.vocab_size).run()
