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
teacher-forced on s_1..s_K: step j feeds (h_{L-3+j}, s_j) at L-2+j, its output h_{L-2+j}
standing in for the feature the next step needs. That gives the draft's top-C candidates after
x_{L-1} and after each s_j (K + 1 positions, as a standalone draft's one forward over the
speculation does) and the hidden states H_k = h_{L-2+k}, k = 0..K. The outcome (k, t) (s_1..s_k
accepted, bonus t at position L+k) then starts a branch whose first pair (H_k, t) sits at draft
position L-1+k: the standalone tree build's layout with n = L - 1 (``tree_build.branch_setup``:
slot prefix n + k, the tree mask, the fan-out's outcomes), each later depth's pair (h of the
branch's previous depth, its token). The tree's KV goes to the scratch region, never into the
slot; the chain's KV (self-conditioned) sits past the committed positions until the next
OUTCOME's features rewrite the accepted ones.

A jit draft (a miss, a sequence's first speculation) starts from the slot's last output: d_1
from its logits, then (h, d_j) pairs as in SD. A hit's branch is drafted again by the next
build's chain rather than moved out of the tree scratch: its first pair then reads the target's
true feature f_{L-2}, which the branch could not.

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
from ssdlib.engine.speculator.cache_builder import fan_index
from ssdlib.engine.speculator.feature_spec_draft import FeatureSpecDraft
from ssdlib.engine.speculator.spec_cache import SpeculationCache, next_speculation
from ssdlib.engine.speculator.tree_build import branch_setup, sampled_pick
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.ops.row_top import row_argmax, top_indices
from ssdlib.sampling import SamplingFacts, SamplingTensors
from ssdlib.speculative.rng import RowStreams


class FeatureCacheBuilder:
    """The speculation cache's build for a feature draft (module doc), the interface of
    ``cache_builder.CacheBuilder``: ``build``, ``branch_index`` and ``budget_arms``."""

    def __init__(self, drafter: FeatureSpecDraft, cache: SpeculationCache, vocab_size: int,
                 saguaro_c: float, pool=None, target_features: torch.Tensor | None = None):
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
        self._static: dict[int, torch.Tensor] = {}  # per batch bucket: (slot, first, sent)
        self._index = torch.zeros(2, self.B, dtype=torch.int64, device=self.device)
        self._chain_slots: torch.Tensor | None = None  # the chain's rows' slots (static)
        # the target's feature buffer [slots, max_len, W], in process (stream placement):
        # chained builds read it in place (None on a speculator rank, which runs no chains)
        self.target_features = target_features
        self._chain_table: torch.Tensor | None = None  # the chain's rows' sampling parameters

    def budget_arms(self, budget: int) -> list[int]:
        """Its chained build always takes the cache's whole budget (its body is written for B
        branches): no other arm."""
        return [budget]

    def branch_index(self, fan: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        if fan not in self._index_cache:
            self._index_cache[fan] = fan_index(fan, self.K, self.V, self.device)
        return self._index_cache[fan]

    @torch.inference_mode()
    def build(self, rows, fan: list[int], sampling: bool) -> int:
        """Cache every likely outcome of the rows' sent speculations (module doc). Returns 0:
        no row moves a hit's branch KV (its branch is drafted again, on true features)."""
        d = self.drafter
        for r in rows:
            r.fed = True
        pos, rank = self.branch_index(tuple(fan))
        if not sampling and self.pool is not None:
            d._check_fed(rows)
            self._replay(rows, pos, rank)
            return 0
        slots, first, kv_len = d._start(rows)
        sent = to_device([r.sent for r in rows], self.device)  # [b, K]
        pick = self._sampled_pick(rows, slots, fan) if sampling else None
        self._body(slots, first, sent, pos, rank, min(kv_len + self.K, d.max_len), pick)
        return 0

    def _body(self, slots, first, sent, pos, rank, kv_len: int, pick=None,
              cache: SpeculationCache | None = None) -> None:
        """The build on device tensors: slots, first (L - 1) [b], sent [b, K], the fan-out's
        branch index pos, rank [B]; ``pick(depth, logits)`` draws a sampled build's tokens
        (None: the argmax); ``cache``: the speculation cache it stores into (default the
        speculator's)."""
        cand, H = self.chain(slots, first, sent, kv_len)
        self.tree(slots, first, sent, cand, H, pos, rank, kv_len, pick, cache)

    def chain(self, slots, first, sent, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The build's first part: the speculation as a teacher-forced chain of K draft steps
        (module doc) -> the top-C candidates [b, K+1, C] after x_{L-1} and after each s_j, and
        H_0..H_K [b, K+1, h]."""
        d = self.drafter
        logits, hidden = d.last_logits[slots], d.last_hidden[slots]
        tops, hs = [top_indices(logits, self.C)], [hidden]
        for j in range(self.K):
            logits, hidden = d.step(sent[:, j], hidden, first + j, slots, kv_len)
            tops.append(top_indices(logits, self.C))
            hs.append(hidden)
        return torch.stack(tops, dim=1), torch.stack(hs, dim=1)

    def tree(self, slots, first, sent, cand, H, pos, rank, kv_len: int, pick=None,
             cache: SpeculationCache | None = None) -> None:
        """The build's second part: the fan-out's branches from the chain's ``cand`` and ``H``
        (``chain``), K tree depths, their tokens stored in ``cache`` (default the
        speculator's)."""
        d, K, B = self.drafter, self.K, self.B
        cache = self.cache if cache is None else cache
        fork, start, kv_limit, full = branch_setup(cand, sent, first, pos, rank)
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
        _, _, sent, length, _ = next_speculation(caches[before], slots, state, before, rows)
        n, k = state.n[before, :rows], state.k[before, :rows]
        j = torch.arange(K + 1, device=self.device)
        positions = ((n - 1).clamp(min=0).view(-1, 1) + j).clamp(max=d.max_len - 1)
        history = state.history[:rows]
        ids = history.gather(1, (n.view(-1, 1) + j).clamp(max=history.shape[1] - 1))
        buf = self.target_features
        feats = buf[slots.view(-1, 1), positions.clamp(max=buf.shape[1] - 1)]
        d._commit_body(ids, positions, slots, k.view(-1, 1), feats, d.max_len, d.use_kernel)
        pick = None
        if sampling is not None:
            facts, fan, saguaro_c = sampling
            draws = state.draws[before, :rows, 1]
            params = SamplingTensors.from_table(self._chain_table[:rows], facts)
            streams = RowStreams(state.keys[:rows, 1], draws, K * B)
            state.draws[p, :rows, 1] = draws + K * B
            pick = sampled_pick(slots, caches[p], params, streams, fan, saguaro_c)
        self._body(slots, length - 1, sent, self._index[0], self._index[1], d.max_len, pick,
                   cache=caches[p])

    def _replay(self, rows, pos, rank) -> None:
        """A greedy build as one replay of its batch bucket's captured body (captured at the
        bucket's first use); one key length for every build (the slot kernel reads each row
        up to its limit)."""
        d, K, scratch = self.drafter, self.K, self.scratch_slot
        b = len(rows)
        bucket = batch_bucket(b)
        if bucket not in self._static:
            st = torch.zeros(bucket, 2 + K, dtype=torch.int64, device=self.device)
            st[:, 0], st[:, 1] = scratch, 1
            self._static[bucket] = st

            def body():
                self._body(st[:, 0], st[:, 1], st[:, 2:], self._index[0], self._index[1],
                           d.max_len)
            self.pool.capture(("feature_build", bucket), body)
        host = torch.zeros(bucket, 2 + K, dtype=torch.int64)
        host[:, 0], host[:, 1] = scratch, 1  # ghost rows: the scratch slot, position 1
        host[:b, 0] = torch.tensor([r.slot for r in rows])
        host[:b, 1] = torch.tensor([len(r.tokens) - 1 for r in rows])
        host[:b, 2:] = torch.tensor([r.sent for r in rows])
        self._static[bucket].copy_(host.to(self.device, non_blocking=True))
        self._index[0].copy_(pos)
        self._index[1].copy_(rank)
        self.pool.replay(("feature_build", bucket))

    def _sampled_pick(self, rows, slots: torch.Tensor, fan):
        """A host round's sampled build: the rows' parameters, K * B draws reserved on each
        row's stream (as the standalone build draws) -> ``tree_build.sampled_pick``."""
        K, B = self.K, self.B
        params = [r.params for r in rows]
        table = SamplingTensors.host_table(params).to(self.device, non_blocking=True)
        st = SamplingTensors.from_table(table, SamplingTensors.host_facts(params))
        keys = RowStreams.reserve_host([r.stream for r in rows], K * B).to(self.device)
        return sampled_pick(slots, self.cache, st, RowStreams(keys[:, 0], keys[:, 1], K * B),
                            fan, self.saguaro_c)
