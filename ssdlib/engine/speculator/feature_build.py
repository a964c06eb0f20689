"""The cache build (SSD Algorithm 1) of a feature draft's speculator (EAGLE-style,
``ssdlib.models.feature_draft``; its draft state and jit drafts: ``feature_spec_draft.py``),
self-conditioned where the target's features do not exist yet.

Positions are the draft's: its KV position t holds the pair (f_t, x_{t+1}) (the feature at t,
the token after it; ``engine/feature_drafter.py`` has the convention). A row with L committed
tokens x_0 .. x_{L-1} has true features for positions 0 .. L-2: the target fed every committed
token but the last (the bonus). They reach the speculator with each OUTCOME
(``protocol.FeatureRows``: after an admission the prompt's, after a round the k + 1 positions it
verified and kept) and are committed at once (:meth:`FeatureSpecDraft.commit_features`): one
forward over the new pairs (f_t, x_{t+1}) rewrites their KV, so that every committed position
holds the target's own feature, and leaves per slot the output at position L - 2, whose logits
predict x_L (the speculation's first token) and whose h_{L-2} estimates f_{L-1}.

While the verifier verifies a speculation s_1..s_K (the positions L-1 .. L+K-2 of its pairs,
(·, s_j) at L-2+j), their features do not exist: the speculator conditions on its own. The build
(:meth:`FeatureCacheBuilder.build`) first runs the speculation through the draft as a chain,
teacher-forced on s_1..s_K, in ONE forward: the pair at L-2+j is (X_j, s_j), X_1 = h_{L-2} (the
slot's last output, conditioned on the target's true feature f_{L-2}) and X_2..X_K the draft's
own features that came with the speculation (:meth:`FeatureCacheBuilder.sent_features`): a hit's
branch kept the hidden states of its tree depths 1..K-1 (``branch_hidden``), a jit draft those
of its steps (``FeatureSpecDraft.jit_hidden``), and a speculation drafted elsewhere (n-gram,
random: no feature of its own) repeats X_1. Drafting a speculation step by step computes exactly
these features, so the one forward replaces K dependent steps (a jit draft's chain is the
step-by-step chain recomputed; a hit's differs only in that its branch's features were computed
before the target's feature f_{L-2} arrived). That gives the draft's top-C candidates after
x_{L-1} and after each s_j (K + 1 positions, as a standalone draft's one forward over the
speculation does) and the hidden states H_0 = h_{L-2} and H_k = h_{L-2+k}. The outcome (k, t)
(s_1..s_k accepted, bonus t at position L+k) then starts a branch whose first pair (H_k, t) sits
at draft position L-1+k: the standalone tree build's layout with n = L - 1
(``tree_build.branch_setup``: slot prefix n + k, the tree mask, the fan-out's outcomes), each
later depth's pair (h of the branch's previous depth, its token). The tree's KV goes to the
scratch region, never into the slot; the chain's KV (self-conditioned) sits past the committed
positions until the next OUTCOME's features rewrite the accepted ones. A round's build is K + 2
draft forwards: the commit, the chain, K tree depths.

A jit draft (a miss, a sequence's first speculation) starts from the slot's last output: d_1
from its logits, then (h, d_j) pairs as in SD. A hit's branch KV is not moved out of the tree
scratch: the chain writes the speculation's KV again, its first pair on the target's true
feature f_{L-2}, which the branch could not read.

Sampling: jit drafts and branch tokens are drawn as the standalone speculator draws them (the
row's target distribution of the draft's logits; Saguaro's sigma_{F,C} in the tree), with the
same stream reservations, so the q each token was drawn from is exact and the verifier exact.

Captured steps: with a graph pool (CUDA; ``SSDLIB_STEP_GRAPHS`` on a CPU, run eagerly) a
greedy build is one replay per batch bucket (the chain and the K tree depths; rows past the
batch are ghost rows in the scratch slot; the fan-out's branch index is a static input, so the
estimator moving it captures nothing new), as are a round's commit and a greedy jit draft;
sampled builds and jit drafts and an admission's commit run eagerly.

Chained rounds (stream placement; ``engine/leader/chained_rounds.py``): a chained build
(:meth:`FeatureCacheBuilder.chained_body`) reads round r's outcome from the chain state, commits
its kept positions from the target's feature buffer in place (no OUTCOME carries them) and
builds the next speculation's outcomes, all on the device; sampled rows draw from the chain
state's streams.
"""

from __future__ import annotations

import torch

from ssdlib.engine.batching import to_device
from ssdlib.engine.sampled_chain import fit_vocab
from ssdlib.engine.runner.static_inputs import batch_bucket
from ssdlib.engine.runner.step_graphs import GHOST_ROW, any_bucket_facts
from ssdlib.engine.speculator.cache_builder import fan_index, verified_limits
from ssdlib.engine.speculator.feature_spec_draft import FeatureSpecDraft
from ssdlib.engine.speculator.spec_cache import SpeculationCache, next_speculation
from ssdlib.engine.speculator.tree_build import branch_setup, sampled_pick
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.ops.row_top import row_argmax, top_indices
from ssdlib.sampling import SamplingFacts, SamplingTensors
from ssdlib.speculative.rng import RowStreams


# a row's feature source (FeatureCacheBuilder.source) other than a cache branch
JIT, NONE = -1, -2


class FeatureCacheBuilder:
    """The speculation cache's build for a feature draft (module doc), the interface of
    ``cache_builder.CacheBuilder``: ``build``, ``branch_index`` and ``budget_arms``."""

    def __init__(self, drafter: FeatureSpecDraft, cache: SpeculationCache, vocab_size: int,
                 saguaro_c: float, pool=None, target_features: torch.Tensor | None = None):
        if drafter.draws < cache.K:
            raise ValueError(f"a feature draft's cache build of K = {cache.K} needs its jit "
                             f"drafts' {cache.K - 1} hidden states; the draft keeps "
                             f"{max(drafter.draws - 1, 0)} (draws={drafter.draws})")
        self.drafter = drafter
        self.pool = pool  # captured greedy builds (module doc); None: eager
        self.scratch_slot = drafter.scratch_slot  # ghost rows of a captured step write here
        self.chain_step = self  # chained rounds' builds (``start_chain``, ``run_chained``)
        self.cache = cache
        self.K, self.B, self.V = cache.K, cache.B, vocab_size
        self.device = drafter.device
        self.saguaro_c = saguaro_c
        self.C = min(self.B + 1, vocab_size)  # candidates per position (max fan-out + 1)
        self._index_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # per batch bucket [bucket, 4 + K]: slot, first position, source, verified limit, sent[K]
        self._static: dict[int, torch.Tensor] = {}
        self._index = torch.zeros(2, self.B, dtype=torch.int64, device=self.device)
        self._chain_slots: torch.Tensor | None = None  # the chain's rows' slots (static)
        # the target's feature buffer [slots, max_len, W], in process (stream placement):
        # chained builds read it in place (None on a speculator rank, which runs no chains)
        self.target_features = target_features
        self._chain_table: torch.Tensor | None = None  # the chain's rows' sampling parameters
        # per speculation cache (by identity): the branches' hidden states (``branch_hidden``)
        self._branch_hidden: dict[int, tuple[SpeculationCache, torch.Tensor]] = {}
        self.branch_hidden(cache)

    def budget_arms(self, budget: int) -> list[int]:
        """Its chained build always takes the cache's whole budget (its body is written for B
        branches): no other arm."""
        return [budget]

    def branch_index(self, fan: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        if fan not in self._index_cache:
            self._index_cache[fan] = fan_index(fan, self.K, self.V, self.device)
        return self._index_cache[fan]

    def branch_hidden(self, cache: SpeculationCache) -> torch.Tensor:
        """The draft's own hidden states along each branch ``cache`` holds, kept for a hit's
        next chain (module doc): [cache rows, B, K - 1, H], depths 1 .. K - 1 of the tree
        (allocated on first use, never inside a capture: ``__init__`` and ``run_chained``
        call it first)."""
        key = id(cache)
        if key not in self._branch_hidden:
            d = self.drafter
            self._branch_hidden[key] = (cache, torch.zeros(
                cache.ready.shape[0], self.B, self.K - 1, d.last_hidden.shape[-1],
                dtype=d.last_hidden.dtype, device=self.device))
        return self._branch_hidden[key][1]

    @staticmethod
    def source(row) -> int:
        """Where the features of a row's sent speculation come from (module doc): the cache
        branch it was answered with (a hit), ``JIT`` (this draft's jit draft) or ``NONE``."""
        if row.reuse is not None:
            return row.reuse
        return JIT if row.is_jit else NONE

    @torch.inference_mode()
    def build(self, rows, fan: list[int], sampling: bool) -> int:
        """Cache every likely outcome of the rows' sent speculations (module doc). Returns 0:
        no row moves a hit's branch KV (its chain runs again, on the target's feature)."""
        d = self.drafter
        src = [self.source(r) for r in rows]
        for r in rows:
            r.fed = True
        pos, rank = self.branch_index(tuple(fan))
        if not sampling and self.pool is not None:
            d.check_committed(rows)
            self._replay(rows, src, pos, rank)
            return 0
        slots, first, kv_len = d.start_rows(rows)
        sent = to_device([r.sent for r in rows], self.device)  # [b, K]
        limit = to_device(verified_limits(rows, self.K), self.device)  # [b]
        pick = self._sampled_pick(rows, slots, fan) if sampling else None
        self._body(slots, first, sent, to_device(src, self.device), pos, rank,
                   min(kv_len + self.K, d.max_len), pick, limit=limit)
        return 0

    def _body(self, slots, first, sent, src, pos, rank, kv_len: int, pick=None,
              cache: SpeculationCache | None = None,
              answered: SpeculationCache | None = None, limit=None) -> None:
        """The build on device tensors: slots, first (L - 1) [b], sent [b, K], each row's
        feature source src [b] (:meth:`source`), the fan-out's branch index pos, rank [B];
        ``pick(depth, logits)`` draws a sampled build's tokens (None: the argmax); ``cache``:
        the speculation cache it stores into (default the speculator's), ``answered``: the one
        a hit's branch came from (default the same); ``limit`` [b]: each row's verified tokens
        (None: K)."""
        cache = self.cache if cache is None else cache
        answered = cache if answered is None else answered
        feats = self.sent_features(slots, src, answered)
        cand, H = self.chain(slots, first, sent, feats, kv_len)
        self.tree(slots, first, sent, cand, H, pos, rank, kv_len, pick, cache, limit)

    def sent_features(self, slots, src, answered: SpeculationCache) -> torch.Tensor:
        """The features paired with s_1..s_K in the chain [b, K, H]: the slot's last output
        for s_1, then per row (``src``, :meth:`source`) the hit branch's hidden states in
        ``answered``, the jit draft's, or the slot's last output again."""
        d = self.drafter
        h0 = d.last_hidden[slots].unsqueeze(1)                           # [b, 1, H]
        rest = self.K - 1
        branch = self.branch_hidden(answered)[slots, src.clamp(min=0)]   # [b, K - 1, H]
        own = torch.where((src == JIT).view(-1, 1, 1), d.jit_hidden[slots, :rest],
                          h0.expand(-1, rest, -1))
        return torch.cat([h0, torch.where((src >= 0).view(-1, 1, 1), branch, own)], dim=1)

    def chain(self, slots, first, sent, feats, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The build's first part: the speculation's pairs (feats[:, j], s_{j+1}) at
        positions L - 1 .. L + K - 2 in one forward (module doc) -> the top-C candidates
        [b, K+1, C] after x_{L-1} and after each s_j, and H_0..H_K [b, K+1, H]."""
        d = self.drafter
        positions = first.view(-1, 1) + torch.arange(self.K, device=first.device)
        meta = AttentionMetadata(positions, slots, kv_len, kv_limit=positions + 1,
                                 use_kernel=d.use_kernel)
        logits, hidden = d.step_draft(sent, feats.to(d.cache.k.dtype), d.cache, meta)
        logits = fit_vocab(logits, self.V).float()                      # [b, K, V]
        tops = torch.cat([top_indices(d.last_logits[slots], self.C).unsqueeze(1),
                          top_indices(logits, self.C)], dim=1)
        return tops, torch.cat([feats[:, :1], hidden.to(feats.dtype)], dim=1)

    def tree(self, slots, first, sent, cand, H, pos, rank, kv_len: int, pick=None,
             cache: SpeculationCache | None = None, limit=None) -> None:
        """The build's second part: the fan-out's branches from the chain's ``cand`` and ``H``
        (``chain``), K tree depths, their tokens stored in ``cache`` (default the
        speculator's) and their hidden states past the first depth in its
        :meth:`branch_hidden`."""
        d, K, B = self.drafter, self.K, self.B
        cache = self.cache if cache is None else cache
        kept = self.branch_hidden(cache)
        fork, start, kv_limit, full = branch_setup(cand, sent, first, pos, rank, limit)
        feat = H.gather(1, fork.unsqueeze(-1).expand(-1, -1, H.shape[-1]))  # [b, B, h]
        b = slots.shape[0]
        lane = torch.arange(B, device=slots.device).expand(b, B)
        tokens, tok = [], start
        for depth in range(K):
            meta = AttentionMetadata(kv_limit + depth, slots, kv_len, kv_limit=kv_limit,
                                     tree_index=lane + depth * B,
                                     tree_mask=full[:, depth * B:(depth + 1) * B,
                                                    :B * (depth + 1)],
                                     tree_len=B * (depth + 1), use_kernel=d.use_kernel)
            logits, feat = d.step_draft(tok, feat, d.cache, meta)
            if depth > 0:
                kept[slots, :, depth - 1] = feat.to(kept.dtype)
            logits = fit_vocab(logits, self.V)  # [b, B, V]
            tok = row_argmax(logits) if pick is None else pick(depth, logits)
            tokens.append(tok)
        cache.tokens[slots] = torch.stack(tokens, dim=2)
        cache.store_keys(slots, fork, start)

    # -- chained rounds (stream placement: engine/leader/chained_rounds.py) -------------------
    # (the interface of ``tree_build.TreeBuildStep``'s: ``start_chain``, ``run_chained``)
    def start_chain(self, slots: list[int], params=None) -> SamplingFacts | None:
        """Chained builds for rows ``slots`` from now on (ghost rows: the scratch slot), and
        where some row samples its ``params`` (one per row; ghost rows greedy) in a static
        table. Returns the sampled builds' facts (None: greedy builds)."""
        if self.target_features is None:
            raise RuntimeError("chained builds read the target's features in its process")
        rows = batch_bucket(self.scratch_slot)  # the largest batch's bucket (max_batch rows)
        if self._chain_slots is None:
            self._chain_slots = torch.zeros(rows, dtype=torch.int64, device=self.device)
            self._chain_table = torch.tensor(GHOST_ROW, dtype=torch.float64,
                                             device=self.device).repeat(rows, 1)
        host = torch.full((rows,), self.scratch_slot, dtype=torch.int64)
        host[:len(slots)] = torch.tensor(slots, dtype=torch.int64)
        self._chain_slots.copy_(host.to(self.device, non_blocking=True))
        if params is None:
            return None
        table = torch.tensor(GHOST_ROW, dtype=torch.float64).repeat(rows, 1)
        table[:len(params)] = SamplingTensors.host_table(params)
        self._chain_table.copy_(table.to(self.device, non_blocking=True))
        return any_bucket_facts(params)

    @torch.inference_mode()
    def run_chained(self, state, rows: int, p: int, caches, pos, rank, kv_len: int = 0,
                    facts: SamplingFacts | None = None, fan: tuple = (),
                    saguaro_c: float = 1.0) -> None:
        """Chained round r + 1's build (parity ``p``, ``rows`` the batch bucket;
        :meth:`chained_body`), sampled with ``facts`` (those :meth:`start_chain` returned):
        a captured step per bucket, parity and sampling kind with a graph pool. The key length
        is the draft's whole cache (``kv_len`` unused: the slot kernel reads each row up to its
        limit)."""
        self._index[0].copy_(pos)
        self._index[1].copy_(rank)
        for cache in caches:
            self.branch_hidden(cache)  # allocated now, not inside a capture
        sampling = None if facts is None else (facts, tuple(fan), saguaro_c)
        if self.pool is None:
            self.chained_body(state, rows, p, caches, sampling)
            return
        key = ("feature_chain", rows, p, facts, saguaro_c,
               tuple(fan) if facts is not None and saguaro_c != 1.0 else None)
        if not self.pool.has(key):
            if facts is not None:
                for cache in caches:
                    cache.q  # allocated now, not inside a capture
            self.pool.capture(key, lambda: self.chained_body(state, rows, p, caches, sampling))
        self.pool.replay(key)

    def chained_body(self, state, rows: int, p: int, caches, sampling=None) -> None:
        """On device tensors only: the speculation the leader verifies now, from round r's
        outcome and cache (``spec_cache.next_speculation``, the leader's lookup repeated);
        the commit of round r's kept positions [n - 1, n + k) with the target's features read
        from its buffer (the padded commit of K + 1 positions; the padding's KV lands past the
        row and the chain overwrites it) and its tokens from the state's history; then the
        build of :meth:`_body` into the cache of parity ``p``. ``sampling`` = (facts, fan-out,
        C): the rows' parameters from the static table, their K * B draws from column 1 of
        ``state.draws``, which it advances, as the standalone chained build does."""
        d, K, B, before = self.drafter, self.K, self.B, 1 - p
        slots = self._chain_slots[:rows]
        hit, branch, sent, length, _ = next_speculation(caches[before], slots, state, before,
                                                        rows)
        n, k = state.n[before, :rows], state.k[before, :rows]
        j = torch.arange(K + 1, device=self.device)
        positions = ((n - 1).clamp(min=0).view(-1, 1) + j).clamp(max=d.max_len - 1)
        history = state.history[:rows]
        ids = history.gather(1, (n.view(-1, 1) + j).clamp(max=history.shape[1] - 1))
        buf = self.target_features
        feats = buf[slots.view(-1, 1), positions.clamp(max=buf.shape[1] - 1)]
        d.commit_body(ids, positions, slots, k.view(-1, 1), feats, d.max_len, d.use_kernel)
        pick = None
        if sampling is not None:
            facts, fan, saguaro_c = sampling
            draws = state.draws[before, :rows, 1]
            params = SamplingTensors.from_table(self._chain_table[:rows], facts)
            streams = RowStreams(state.keys[:rows, 1], draws, K * B)
            state.draws[p, :rows, 1] = draws + K * B
            pick = sampled_pick(slots, caches[p], params, streams, fan, saguaro_c)
        src = torch.where(hit, branch, torch.full_like(branch, NONE))  # a miss: no features
        self._body(slots, length - 1, sent, src, self._index[0], self._index[1], d.max_len,
                   pick, cache=caches[p], answered=caches[before])

    def _replay(self, rows, src: list[int], pos, rank) -> None:
        """A greedy build as one replay of its batch bucket's captured body (captured at the
        bucket's first use); one key length for every build (the slot kernel reads each row
        up to its limit). Static inputs a row: slot, first, source, verified limit, sent."""
        d, K, scratch = self.drafter, self.K, self.scratch_slot
        b = len(rows)
        bucket = batch_bucket(b)
        if bucket not in self._static:
            st = torch.zeros(bucket, 4 + K, dtype=torch.int64, device=self.device)
            st[:, 0], st[:, 1], st[:, 2], st[:, 3] = scratch, 1, NONE, K
            self._static[bucket] = st

            def body():
                self._body(st[:, 0], st[:, 1], st[:, 4:], st[:, 2], self._index[0],
                           self._index[1], d.max_len, limit=st[:, 3])
            self.pool.capture(("feature_build", bucket), body)
        host = torch.zeros(bucket, 4 + K, dtype=torch.int64)
        # ghost rows: the scratch slot
        host[:, 0], host[:, 1], host[:, 2], host[:, 3] = scratch, 1, NONE, K
        host[:b, 0] = torch.tensor([r.slot for r in rows])
        host[:b, 1] = torch.tensor([len(r.tokens) - 1 for r in rows])
        host[:b, 2] = torch.tensor(src)
        host[:b, 3] = torch.tensor(verified_limits(rows, K))
        host[:b, 4:] = torch.tensor([r.sent for r in rows])
        self._static[bucket].copy_(host.to(self.device, non_blocking=True))
        self._index[0].copy_(pos)
        self._index[1].copy_(rank)
        self.pool.replay(("feature_build", bucket))

    def _sampled_pick(self, rows, slots: torch.Tensor, fan):
        """A host round's sampled build: the rows' parameters, K * B draws reserved on each
        row's stream (as the standalone build draws) -> ``tree_build.sampled_pick``."""
        K, B = self.K, self.B
        params = [r.params for r in rows]
        st = SamplingTensors.from_params(params, self.device)
        keys = RowStreams.reserve_host([r.stream for r in rows], K * B).to(self.device)
        return sampled_pick(slots, self.cache, st, RowStreams(keys[:, 0], keys[:, 1], K * B),
                            fan, self.saguaro_c)
