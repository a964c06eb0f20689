"""Building the speculation cache (SSD Algorithm 1), while the verifier verifies.

For a sent speculation s_1..s_K of a row with n committed tokens:
1. candidates: the draft's top-C tokens at the K+1 positions of the speculation. On a hit they are
   reused from drafting its branch (the branch KV is copied from the tree scratch into the slot
   and only s_K is fed: a captured step before the build, tree_build.py); otherwise one draft
   forward over the tokens the draft has not committed yet plus s_1..s_K (which leaves their KV
   in the slot);
2. outcomes (fan-out): at position k < K the top-F_k draft tokens other than s_{k+1} (the bonus
   after a rejection at k+1 cannot be s_{k+1}), at k = K the top-F_K; B = sum F_k branches per row;
3. K tree-decode steps draft every branch at once: branch (k, t) holds t at position n+k, then its
   own tokens; it attends to the slot's first n+k keys and to its own earlier branch tokens
   (tree mask), its KV goes to the tree scratch region, never to the slot.
Draft tokens are sampled from Saguaro's sigma_{F,C} of the draft distribution (F = the fan-out
of the position being drafted); that exact q goes to the verifier with the tokens.
"""

from __future__ import annotations

import torch

from ssdlib.engine.batching import pack_rows, to_device
from ssdlib.engine.speculator.spec_cache import SpeculationCache
from ssdlib.engine.speculator.spec_row import SpecRow
from ssdlib.engine.speculator.tree_build import TreeBuildStep
from ssdlib.ops.row_top import top_indices
from ssdlib.speculative.fanout_budget import budget_arms


class CacheBuilder:
    def __init__(self, runner, drafter, cache: SpeculationCache, vocab_size: int,
                 saguaro_c: float):
        self.runner = runner
        self.drafter = drafter
        self.cache = cache
        self.K, self.B, self.V = cache.K, cache.B, vocab_size
        self.device = runner.device
        self.saguaro_c = saguaro_c
        # Candidates kept from drafting each branch, so a hit needs no recomputation: the draft's
        # top-C tokens after each branch token [rows, B, K, C] (C = max fan-out + 1).
        self.C = min(self.B + 1, vocab_size)
        self.branch_top = torch.zeros(cache.ready.shape[0], self.B, self.K, self.C,
                                      dtype=torch.int64, device=self.device)
        self._index_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        v = min(vocab_size, runner.config.vocab_size)
        self.tree_step = TreeBuildStep(runner, cache, self.branch_top, min(self.C, v), v)
        # chained rounds' builds (``start_chain``, ``run_chained``) and their ghost rows' slot
        self.chain_step = self.tree_step
        self.scratch_slot = runner.scratch_slot

    @torch.inference_mode()
    def build(self, rows: list[SpecRow], fan: list[int], sampling: bool) -> int:
        """Cache every likely outcome of the rows' sent speculations (their KV enters the
        slots). Returns how many rows reused their branch KV (speculations that were hits)."""
        live = [r.slot for r in rows]  # cache rows are slots
        K = self.K
        cand, reuse = self._candidates(rows)  # [b, K+1, C]; the branch each hit continues
        for r in rows:
            r.fed = True
        lengths = [len(r.tokens) for r in rows]  # committed
        kv_len = max(lengths) + K  # > every slot key a branch sees
        pos, rank = self.branch_index(tuple(fan))  # [B] each
        # captured steps on GPU (tree_build.py): hit rows' continuation, then outcomes, K tree
        # depths (greedy or sampled) and the cache stores
        self.tree_step.run(cand, [r.sent for r in rows], lengths, live, pos, rank, kv_len,
                           reuse, rows if sampling else None, tuple(fan), self.saguaro_c,
                           verified_limits(rows, K))
        return sum(x >= 0 for x in reuse)

    def budget_arms(self, budget: int) -> list[int]:
        """The budgets a chained build may take (``fanout_budget.budget_arms``): its captured
        build is keyed by its branches."""
        return budget_arms(budget, self.K)

    def branch_index(self, fan: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`fan_index` of ``fan``, kept per fan-out."""
        if fan not in self._index_cache:
            self._index_cache[fan] = fan_index(fan, self.K, self.V, self.device)
        return self._index_cache[fan]

    def _candidates(self, rows: list[SpecRow]) -> tuple[torch.Tensor, list[int]]:
        """Top-C draft tokens at positions 1..K+1 of each row's sent speculation [b, K+1, C]
        for the rows that were not hits (first round, fallbacks); a hit row (its branch is in
        ``reuse``, else -1) continues its drafted branch in tree_build's continuation step."""
        cand = torch.zeros(len(rows), self.K + 1, self.C, dtype=torch.int64, device=self.device)
        reuse = [-1 if r.reuse is None else r.reuse for r in rows]
        for r in rows:
            if r.reuse is not None:
                r.valid = len(r.tokens)  # the branch's KV is moved into the slot
        fresh = [j for j, r in enumerate(rows) if r.reuse is None]
        if fresh:
            self._fed_candidates(cand, rows, fresh)
        return cand, reuse

    def _fed_candidates(self, cand, rows, fresh: list[int]) -> None:
        """Rows that were not hits: one forward over their unseen committed tokens +
        s_1..s_K."""
        K = self.K
        sub = [rows[j] for j in fresh]
        # at least the last committed token is fed: its output is the dist at position 1
        starts = [min(r.valid, len(r.tokens) - 1) for r in sub]
        inputs = [r.tokens[st:] + r.sent for r, st in zip(sub, starts)]
        ids, pos = pack_rows(inputs, starts)
        index = torch.tensor([[len(x) - K - 1 + i for i in range(K + 1)] for x in inputs])
        slots = torch.tensor([r.slot for r in sub])
        logits = self.drafter._logits(self.runner.forward(ids, pos, slots, index))
        cand[to_device(fresh, self.device)] = top_indices(logits, self.C)


def verified_limits(rows: list[SpecRow], K: int) -> list[int]:
    """Per row, how many tokens of its sent speculation the leader verifies (adaptive K): the
    build excludes s_{k+1} from the guesses at k only below that (``tree_build.kept_first``)."""
    return [K if r.limit is None else r.limit for r in rows]


def fan_index(fan: tuple, K: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch j of the fan-out -> (its position k, its rank among the kept candidates) [B] each,
    on ``device``. Tiny vocabularies (fewer kept candidates than F_k) repeat the last one (a
    duplicate branch never hits twice)."""
    pos, rank = [], []
    for k, f in enumerate(fan):
        f_eff = min(f, vocab - (1 if k < K else 0))
        pos += [k] * f
        rank += [min(j, f_eff - 1) for j in range(f)]
    return to_device(pos, device), to_device(rank, device)
