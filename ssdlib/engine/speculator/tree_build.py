"""The cache build after the fresh rows' candidates as captured steps: a hit's branch
continued, outcomes -> K tree depths -> the cache, greedy or sampled.

After the candidates of the rows that were not hits are known (``CacheBuilder._candidates``),
everything else a build does depends only on device data and a few host integers:

0. rows answered from the cache continue their branch (``continue_hits``, a step of its own):
   its KV moves from the tree scratch into the slot, its kept candidates become positions 1..K,
   s_K is fed for position K + 1;
1. the outcomes to cache: branch j forks after ``pos[j]`` speculation tokens and starts with the
   ``rank[j]``-th candidate at that position that is not the speculation's own token;
2. the branch-to-branch tree mask (same branch, earlier depth) and each branch's slot prefix;
3. the K tree-decode depths (``ModelRunner.tree_body``), argmax per branch, top-C kept per token
   (not in a chained build: nothing continues its branches);
4. the stores: cache tokens, outcome keys, ready flags, the kept candidates.

A sampled build (some row has temperature > 0) draws each branch token from Saguaro's
sigma_{F,C} of the row's distribution (``sample_branches``) with B draws per depth from the row's
stream, and stores the q it drew from; the rows' sampling parameters and stream positions are
static inputs too, and what the host knows about them (any greedy / sampled row, top-k, top-p)
is part of the graph's key.

On a GPU with graphs that is one or two graph replays per round (captured per batch bucket and
key length), instead of some forty small launches from the host; ghost rows of the bucket use
the scratch slot (the cache's last row) and are greedy. Step 0 is separate because step 3
overwrites the tree scratch and kept candidates it reads, and a captured body must give the
same result however often it runs (the pool's warm-up runs it first). Without a graph pool
(CPU) the same bodies run eagerly on the same inputs.

The inputs are one ``StaticInputs`` arena (``engine/runner/static_inputs.py``), with the
runner's ``StepGraphs`` bucket policy: per row the speculation, committed length, slot, reused
branch, the candidates (copied device to device), and for a sampled build the parameter table
and stream position; filled with numpy and sent in one copy a build.
"""

from __future__ import annotations

import torch

from ssdlib.distributed.protocol import chain_max_rows
from ssdlib.engine.runner.static_inputs import Segment, StaticInputs, batch_bucket
from ssdlib.engine.runner.step_graphs import GHOST_PARAMS, GHOST_ROW, any_bucket_facts
from ssdlib.engine.speculator.spec_cache import next_speculation
from ssdlib.engine.sampler import sample_branches
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.ops.row_top import top_indices
from ssdlib.ops.tree_mask import tree_mask_full
from ssdlib.sampling import SamplingFacts, SamplingTensors
from ssdlib.speculative.rng import RowStreams



def branch_outcomes(cand: torch.Tensor, sent: torch.Tensor, pos: torch.Tensor,
                    rank: torch.Tensor, limit: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """cand [b, K+1, C] candidates, sent [b, K] the speculation, pos/rank [B] the fan-out's
    branch index -> (fork [b, B], first token [b, B]). At position k < limit the candidates
    equal to s_{k+1} are skipped (a bonus after a rejection at k+1 cannot be s_{k+1}); ``limit``
    [b]: how many of each row's tokens the leader verifies (None: all K). At k = limit every
    token verified was accepted and the bonus is the target's own draw, which s_{k+1}, the
    draft's best guess, may well be: it is kept."""
    ranked = cand.gather(-1, kept_first(cand, sent, limit))
    first = ranked[:, pos, rank]  # [b, B]
    return pos.expand_as(first).contiguous(), first


def kept_first(cand: torch.Tensor, sent: torch.Tensor,
               limit: torch.Tensor | None = None) -> torch.Tensor:
    """The order [b, K+1, C] of each position's candidates that puts the ones equal to s_{k+1}
    last at positions k < ``limit`` [b] (None: K), each group in its own order: a stable sort
    of the exclusion flags, computed from a cumulative count (a few small kernels instead of a
    segmented device sort)."""
    K, C = sent.shape[1], cand.shape[-1]
    col = torch.arange(C, device=cand.device)
    kept = torch.ones(cand.shape, dtype=torch.bool, device=cand.device)
    kept[:, :K] = cand[:, :K] != sent.unsqueeze(-1)
    if limit is not None:  # positions past a row's verified tokens exclude nothing
        unverified = torch.arange(K, device=cand.device) >= limit.view(-1, 1)  # [b, K]
        kept[:, :K] |= unverified.unsqueeze(-1)
    ck = kept.long().cumsum(-1)                              # kept ones up to each column
    dest = torch.where(kept, ck - 1, ck[..., -1:] + col - ck)  # each column's place
    return torch.empty_like(dest).scatter_(-1, dest, col.expand_as(dest).contiguous())


def branch_setup(cand: torch.Tensor, sent: torch.Tensor, n: torch.Tensor, pos: torch.Tensor,
                 rank: torch.Tensor, limit: torch.Tensor | None = None):
    """What every tree build starts from: (fork, first token) per branch [b, B]
    (:func:`branch_outcomes`), each branch's slot prefix kv_limit [b, B] (committed n + the
    k speculation tokens it assumes), and the branch-to-branch mask of all depths
    [b, B*K, B*K] (tree-mask kernel on GPU; depth d's queries are rows d*B..(d+1)*B, over the
    first B*(d+1) branch keys). ``limit`` [b]: each row's verified tokens (None: K)."""
    K = sent.shape[1]
    fork, first = branch_outcomes(cand, sent, pos, rank, limit)
    kv_limit = n.view(-1, 1) + fork
    full = tree_mask_full(fork, K, K)[..., K:]
    return fork, first, kv_limit, full


def build_key(rows: int, kv_len: int, facts: SamplingFacts | None, fan: tuple,
              saguaro_c: float) -> tuple:
    """The graph key of a build (``facts`` None: greedy), its batch bucket second as in every
    step key (``StepGraphs.capture``). A sampled build's body reads the
    fan-out only through Saguaro's sigma_{F,C}, which is the identity at C = 1: the fan-out is
    part of the key only for C != 1, so that the estimator's allocation moving between rounds
    does not capture a new graph each time it takes a new value (4 allocations, 13 changes in
    239 builds of a two-prompt T = 0.7 run; a capture costs tens of ms)."""
    if facts is None:
        return ("tree_build", rows, kv_len)
    return ("tree_build_sampled", rows, kv_len, facts, saguaro_c,
            tuple(fan) if saguaro_c != 1.0 else None)


def sampled_pick(slots, cache, params: SamplingTensors, streams: RowStreams, fan: tuple,
                 saguaro_c: float):
    """A sampled build's ``pick(d, logits [b, n, v])``: depth d's branch tokens drawn from
    sigma_{F_d,C} of each row's distribution (``cache``'s B draws of its stream reserved per
    depth, the first n used, in branch order; n <= B the build's branches); the q each was drawn
    from goes to ``cache``."""
    B, K, V = cache.B, cache.K, cache.V
    # every depth's draws at once (one chain of hash kernels, not one per depth): the same
    # values, draw j of the call is j whichever way they are computed
    u_all = streams.uniforms(K * B)  # [b, K * B]

    def pick(d: int, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] < V:  # a draft with fewer rows than the target: never those
            logits = torch.nn.functional.pad(logits, (0, V - logits.shape[-1]),
                                             value=float("-inf"))
        n = logits.shape[1]  # the build's branches: the cache's B, or fewer (a smaller budget)
        u = u_all[:, d * B:d * B + n]  # [b, n]
        tok, q = sample_branches(logits, params, u, fan[d] if d < len(fan) else 0, saguaro_c)
        cache.q[slots, :n, d] = q
        return tok
    return pick


class TreeBuildStep:
    """Static inputs and the captured build steps of one speculator (see the module doc)."""

    def __init__(self, runner, cache, branch_top: torch.Tensor, top: int, vocab: int):
        self.runner, self.cache, self.branch_top = runner, cache, branch_top
        self.K, self.B = cache.K, cache.B
        self.top, self.vocab = top, vocab
        graphs = runner.graphs
        self.pool = graphs.pool if graphs is not None else None
        # captures go through the runner's steps (StepGraphs.capture), and the arena follows
        # their bucket policy: with all_buckets a build captured for one batch bucket is
        # captured for every bucket at once, so no compile falls mid-run. Without a pool the
        # rows are the batch's own (at most one a slot)
        self.graphs = graphs
        K, C = self.K, branch_top.shape[-1]
        self.C = C
        self.inputs = StaticInputs(runner.device, runner.scratch_slot, {
            "sent": Segment(K), "limit": Segment(1, ghost=K), "lengths": Segment(1, ghost=1),
            "slots": Segment(1, ghost=runner.scratch_slot), "reuse": Segment(1, ghost=-1),
            "cand": Segment((K + 1) * C),
            "params": Segment(4, ghost=GHOST_ROW, float64=True), "streams": Segment(2)},
            all_buckets=graphs is not None and graphs.all_buckets)
        self.index = torch.zeros(2, self.B, dtype=torch.int64, device=runner.device)  # pos, rank
        self._index_src: torch.Tensor | None = None

    def body(self, cand, sent, n, slots, pos, rank, kv_len: int, sampler=None,
             cache=None, keep_top: bool = True, limit=None) -> None:
        """The build after the candidates, on device tensors (the captured function's body);
        ``sampler`` = (SamplingTensors, RowStreams, fan-out, C) for a sampled build; ``cache``
        the speculation cache it stores into (default the speculator's); ``keep_top``: keep
        each branch token's top-C candidates for a hit's continuation (``continue_hits``);
        ``limit`` [rows]: the tokens of each row the leader verifies (None: K)."""
        cache = self.cache if cache is None else cache
        K = self.K
        fork, first, kv_limit, full = branch_setup(cand, sent, n, pos, rank, limit)
        r = self.runner
        pick = None if sampler is None else sampled_pick(slots, cache, *sampler)
        tokens, tops = r.tree_body(first, kv_limit, full, slots, K,
                                   self.top if keep_top else 0, self.vocab, kv_len,
                                   r.use_kernel, pick)
        n = pos.shape[0]  # branches: the cache's B, or fewer (a chained build's smaller budget)
        if keep_top:
            self.branch_top[slots, :n, :, :tops.shape[-1]] = tops
        cache.tokens[slots, :n] = tokens
        cache.store_keys(slots, fork, first)

    def continue_hits(self, cand, sent, n, slots, reuse, kv_len: int) -> None:
        """Rows answered from the cache (``reuse`` [rows]: their branch, -1 elsewhere) continue
        the branch they were answered with: its K tokens' KV moves from the tree scratch into
        the slot (t* sits at committed - 1), its kept top-C candidates become positions 1..K of
        ``cand`` (in place), and s_K is fed for position K + 1. Other rows keep their ``cand``
        (their writes go to the scratch slot and are never read). A step of its own, before
        the build: the build overwrites the tree scratch and the kept candidates this reads,
        and a captured body must give the same result however often it runs (warm-up)."""
        K, B, r = self.K, self.B, self.runner
        hit = reuse >= 0
        br = reuse.clamp(min=0)
        hslot = torch.where(hit, slots, torch.full_like(slots, r.scratch_slot))  # [rows]
        d = torch.arange(K, device=slots.device)
        dest = (n - 1).view(-1, 1) + d                                          # [rows, K]
        src = d * B + br.view(-1, 1)                                            # [rows, K]
        kv = r.cache
        si = hslot.view(-1, 1)
        kv.k[:, si, :, dest] = kv.tree_k[:, si, :, src]
        kv.v[:, si, :, dest] = kv.tree_v[:, si, :, src]
        at = (n + K - 1).view(-1, 1)
        meta = AttentionMetadata(at, hslot, kv_len, kv_limit=at + 1, use_kernel=r.use_kernel)
        logits = r.step_model(sent[:, K - 1:K], kv, meta)[:, 0, :self.vocab]   # [rows, v]
        last = self._top_c(logits)                                              # [rows, C]
        cont = torch.cat([self.branch_top[slots, br], last.unsqueeze(1)], dim=1)  # [rows, K+1, C]
        cand.copy_(torch.where(hit.view(-1, 1, 1), cont, cand))

    def chained_body(self, state, rows: int, p: int, caches, pos, rank, kv_len: int,
                     sampling: tuple | None = None) -> None:
        """Chained round r + 1's build (parity ``p``; ``state`` a ``protocol.ChainState``,
        ``caches`` the two caches by parity; ``sampling`` = (facts, fan-out, C) for a sampled
        build: the rows' parameters are the static table :meth:`start_chain` filled, their
        draws K * B of each row's stream from ``state.draws``, whose column 1 it advances):
        the speculation the leader verifies now, from
        round r's outcome and cache (``spec_cache.next_speculation``, the leader's own lookup
        repeated on this stream), then the candidates from one draft forward over t* and
        s_1..s_K (positions n - 1 .. n + K - 1; every committed token before t* is in the
        slot's draft KV), then :meth:`body` into the cache of parity ``p``. The draft's top
        candidates are what a missed row's build computes (``CacheBuilder._fed_candidates``); a
        hit's row computes them again instead of continuing its branch, so that one step
        serves hits and misses alike, with no host input."""
        r, before = self.runner, 1 - p
        slots = self.inputs.view("slots", rows)
        last = state.bonus[before, :rows]
        _, _, sent, n, _ = next_speculation(caches[before], slots, state, before, rows,
                                            r.compiles)
        logits = r.speculation_step(last, sent, n, slots, kv_len)[..., :self.vocab]
        sampler = None
        if sampling is not None:
            facts, fan, saguaro_c = sampling
            taken = self.K * self.B  # draws of a row's stream
            draws = state.draws[before, :rows, 1]
            sampler = (SamplingTensors.from_table(self.inputs.view("params", rows, 4), facts),
                       RowStreams(state.keys[:rows, 1], draws, taken), fan, saguaro_c)
            state.draws[p, :rows, 1] = draws + taken
        # no top-C kept per branch token: a chain's hits compute their candidates again above,
        # and a chain's end restarts its rows (no hit continues a chained build's branch)
        self.body(self._top_c(logits), sent, n, slots, pos, rank, kv_len, sampler,
                  cache=caches[p], keep_top=False)

    def _top_c(self, logits: torch.Tensor) -> torch.Tensor:
        """The C candidates after each position of ``logits`` [..., v]: its top tokens (a
        vocabulary smaller than C repeats the last kept candidate) -> [..., C]."""
        top = top_indices(logits, self.top)
        if self.top < self.C:
            top = torch.cat([top, top[..., -1:].expand(*top.shape[:-1], self.C - self.top)],
                            dim=-1)
        return top

    def start_chain(self, slots: list[int], params=None) -> SamplingFacts | None:
        """A chain starts for rows ``slots``: their slots in the static inputs (ghost rows: the
        scratch slot) for every chained build until it ends, and where some row samples its
        ``params`` (one per row; ghost rows greedy). Returns the sampled builds' facts (None:
        greedy builds)."""
        width = self.inputs.fill_rows(batch_bucket(len(slots)) if self.pool is not None
                                      else len(slots))
        self.inputs.put("slots", width, slots)
        facts = None
        if params is not None:
            self.inputs.put("params", width, SamplingTensors.host_table(params), 4)
            facts = any_bucket_facts(params)
        self.inputs.upload()
        return facts

    @torch.inference_mode()
    def run_chained(self, state, rows: int, p: int, caches, pos, rank, kv_len: int,
                    facts: SamplingFacts | None = None, fan: tuple = (),
                    saguaro_c: float = 1.0) -> None:
        """Chained round r + 1's build (:meth:`chained_body`) over ``rows`` rows (the batch
        bucket, ghost rows past the batch); pos, rank [n] the fan-out's branch index (n <= B:
        a smaller budget builds fewer branches, the cache's others hold no outcome);
        ``facts`` (those :meth:`start_chain` returned) for a sampled build, with the fan-out
        and Saguaro's C."""
        kv_len = self.runner.kv_bucket(kv_len)
        self._set_index(pos, rank)
        sampling = None if facts is None else (facts, tuple(fan), saguaro_c)
        n = pos.shape[0]
        if self.pool is None:
            self.chained_body(state, rows, p, caches, self.index[0, :n], self.index[1, :n],
                              kv_len, sampling)
            return
        key = ("tree_chain", rows, p, kv_len, n) + build_key(rows, kv_len, facts, fan,
                                                             saguaro_c)[3:]  # (its sampling)
        self.graphs.capture(key, lambda _, r: self.chained_body(
            state, r, p, caches, self.index[0, :n], self.index[1, :n], kv_len, sampling),
            max_rows=chain_max_rows())
        self.pool.replay(key)

    def _set_index(self, pos, rank) -> None:
        """The fan-out's branch index into the static ``index`` (its first len(pos) columns;
        kept while it holds)."""
        if self._index_src is not pos:
            n = pos.shape[0]
            self.index[0, :n].copy_(pos)
            self.index[1, :n].copy_(rank)
            self._index_src = pos

    def _fill(self, rows: int, cand, sent, limits, lengths, slots, reuse, sampled_rows):
        """The build's inputs for ``rows`` rows (ghosts past the real ones: the scratch slot, no
        reused branch, greedy), in one upload -> the sampled build's facts (None: greedy).
        A sampled build reserves K * B draws of each row's stream."""
        inputs = self.inputs
        inputs.put("sent", rows, sent, self.K)
        inputs.put("limit", rows, limits)
        inputs.put("lengths", rows, lengths)
        inputs.put("slots", rows, slots)
        inputs.put("reuse", rows, reuse)
        inputs.put("cand", rows, cand, (self.K + 1) * self.C)
        facts = None
        if sampled_rows is not None:
            params = [r.params for r in sampled_rows]
            inputs.put("params", rows, SamplingTensors.host_table(params), 4)
            inputs.put("streams", rows, RowStreams.reserve_host(
                [r.stream for r in sampled_rows], self.K * self.B), 2)
            facts = SamplingTensors.host_facts(params + [GHOST_PARAMS] * (rows - len(params)))
        inputs.upload()
        return facts

    def _views(self, rows: int):
        """(cand [rows, K+1, C], sent [rows, K], n [rows], slots [rows], reuse [rows]) on the
        device."""
        v, K = self.inputs.view, self.K
        return (v("cand", rows, (K + 1) * self.C).view(rows, K + 1, self.C), v("sent", rows, K),
                v("lengths", rows), v("slots", rows), v("reuse", rows))

    def run(self, cand: torch.Tensor, sent: list[list[int]], lengths: list[int],
            slots: list[int], pos: torch.Tensor, rank: torch.Tensor, kv_len: int,
            reuse: list[int] | None = None, sampled_rows=None, fan: tuple = (),
            saguaro_c: float = 1.0, limits: list[int] | None = None) -> None:
        """cand [b, K+1, C] on the device (rows that continue a hit: any values); sent /
        lengths / slots on the host; pos, rank [B]. ``reuse``: per row the cache branch a hit
        continues, or -1. ``sampled_rows`` (with ``params`` and ``stream``): a sampled build,
        which reserves K * B draws of each row's stream. ``limits``: per row the tokens of its
        speculation the leader verifies (None: all K)."""
        kv_len = self.runner.kv_bucket(kv_len)
        b = cand.shape[0]
        rows = batch_bucket(b) if self.pool is not None else b
        reuse = [-1] * b if reuse is None else reuse
        hits = any(x >= 0 for x in reuse)
        # the inputs' rows: every bucket's when all of them are captured at once
        width = self.inputs.fill_rows(rows)
        limits = [self.K] * b if limits is None else limits
        facts = self._fill(width, cand, sent, limits, lengths, slots, reuse, sampled_rows)
        if self.pool is None:
            sampler = None if facts is None else self._sampler(rows, facts, fan, saguaro_c)
            cand_v, sent_v, n_v, slots_v, reuse_v = self._views(rows)
            if hits:
                self.continue_hits(cand_v, sent_v, n_v, slots_v, reuse_v, kv_len)
            self.body(cand_v, sent_v, n_v, slots_v, pos, rank, kv_len, sampler,
                      limit=self.inputs.view("limit", rows))
            return
        self._run_captured(rows, pos, rank, kv_len, hits, facts, fan, saguaro_c)

    def _run_captured(self, rows: int, pos, rank, kv_len: int, hits: bool,
                      facts: SamplingFacts | None, fan: tuple, saguaro_c: float) -> None:
        """:meth:`run` with a graph pool, its inputs uploaded: the replays (captured on first
        use, for every batch bucket at once where the runner's steps are)."""
        self._set_index(pos, rank)
        if hits:  # every bucket's continuation before any build: the build overwrites its inputs
            key = ("tree_continue", rows, kv_len)
            self.graphs.capture(key, lambda _, r: self.continue_hits(*self._views(r), kv_len))
            self.pool.replay(key)
        key = build_key(rows, kv_len, facts, fan, saguaro_c)
        if facts is not None and not self.pool.has(key):
            self.cache.q  # allocated now: not inside a warm-up or a capture

        def step(_, r):
            # the sampler inside the body: its tensors are computed from the static tables at
            # every replay (a sampler built once would keep the first round's values)
            sampler = None if facts is None else self._sampler(r, facts, fan, saguaro_c)
            cand_v, sent_v, n_v, slots_v, _ = self._views(r)
            self.body(cand_v, sent_v, n_v, slots_v, self.index[0], self.index[1], kv_len,
                      sampler, limit=self.inputs.view("limit", r))
        self.graphs.capture(key, step)
        self.pool.replay(key)

    def _sampler(self, rows: int, facts: SamplingFacts, fan, saguaro_c: float):
        """(SamplingTensors, RowStreams, fan-out, C) over the first ``rows`` of the static
        parameter table [rows, 4] and streams [rows, 2]."""
        params, streams = self.inputs.view("params", rows, 4), self.inputs.view("streams", rows, 2)
        return (SamplingTensors.from_table(params, facts),
                RowStreams(streams[:, 0], streams[:, 1], self.K * self.B), tuple(fan), saguaro_c)
