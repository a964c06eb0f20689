"""The cache build after the candidates as ONE captured step: outcomes -> K tree depths -> the
cache, greedy or sampled.

After the candidates of each row's sent speculation are known (``CacheBuilder._candidates``),
everything else a greedy build does depends only on device data and a few host integers:

1. the outcomes to cache: branch j forks after ``pos[j]`` speculation tokens and starts with the
   ``rank[j]``-th candidate at that position that is not the speculation's own token;
2. the branch-to-branch tree mask (same branch, earlier depth) and each branch's slot prefix;
3. the K tree-decode depths (``ModelRunner.tree_body``), argmax per branch, top-C kept per token;
4. the stores: cache tokens, outcome keys, ready flags, the kept candidates.

A sampled build (some row has temperature > 0) draws each branch token from Saguaro's
sigma_{F,C} of the row's distribution (``sample_branches``) with B draws per depth from the row's
stream, and stores the q it drew from; the rows' sampling parameters and stream positions are
static inputs too, and what the host knows about them (any greedy / sampled row, top-k, top-p)
is part of the graph's key.

On a GPU with graphs that is one graph replay per round (captured per batch bucket and key
length), instead of some thirty small launches from the host; ghost rows of the bucket use the
scratch slot (the cache's last row) and are greedy. Without a graph pool (CPU) the same body runs
eagerly.
"""

from __future__ import annotations

import torch

from ssdlib.engine.batching import to_device
from ssdlib.engine.sampler import sample_branches
from ssdlib.engine.step_graphs import batch_bucket
from ssdlib.ops.tree_mask import tree_mask_full
from ssdlib.sampling import SamplingParams, SamplingTensors
from ssdlib.speculative.rng import RowStreams

GHOST_PARAMS = SamplingParams()  # ghost rows of a sampled build: greedy


def branch_outcomes(cand: torch.Tensor, sent: torch.Tensor, pos: torch.Tensor,
                    rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cand [b, K+1, C] candidates, sent [b, K] the speculation, pos/rank [B] the fan-out's
    branch index -> (fork [b, B], first token [b, B]). At position k < K the candidates equal to
    s_{k+1} are skipped (a bonus after a rejection at k+1 cannot be s_{k+1})."""
    K = sent.shape[1]
    excluded = torch.zeros(cand.shape, dtype=torch.int8, device=cand.device)
    excluded[:, :K] = (cand[:, :K] == sent.unsqueeze(-1)).to(torch.int8)   # [b, K, C]
    ranked = cand.gather(-1, torch.argsort(excluded, dim=-1, stable=True))  # kept first
    first = ranked[:, pos, rank]  # [b, B]
    return pos.expand_as(first).contiguous(), first


def branch_setup(cand: torch.Tensor, sent: torch.Tensor, n: torch.Tensor, pos: torch.Tensor,
                 rank: torch.Tensor):
    """What every tree build starts from: (fork, first token) per branch [b, B]
    (:func:`branch_outcomes`), each branch's slot prefix kv_limit [b, B] (committed n + the
    k speculation tokens it assumes), and the branch-to-branch mask of all depths
    [b, B*K, B*K] (tree-mask kernel on GPU; depth d's queries are rows d*B..(d+1)*B, over the
    first B*(d+1) branch keys)."""
    K = sent.shape[1]
    fork, first = branch_outcomes(cand, sent, pos, rank)
    kv_limit = n.view(-1, 1) + fork
    full = tree_mask_full(fork, K, K)[..., K:]
    return fork, first, kv_limit, full


class TreeBuildStep:
    """Static inputs and the captured greedy build of one speculator (see the module doc)."""

    def __init__(self, runner, cache, branch_top: torch.Tensor, top: int, vocab: int):
        self.runner, self.cache, self.branch_top = runner, cache, branch_top
        self.K, self.B = cache.K, cache.B
        self.top, self.vocab = top, vocab
        graphs = runner.graphs
        self.pool = graphs.pool if graphs is not None else None
        dev = runner.device
        rows = graphs.max_rows if graphs is not None else 0
        C = branch_top.shape[-1]
        self.cand = torch.zeros(rows, self.K + 1, C, dtype=torch.int64, device=dev)
        # host integers in one copy: sent [rows, K], committed length [rows], slot [rows]
        self.ints = torch.zeros(rows * (self.K + 2), dtype=torch.int64, device=dev)
        self.index = torch.zeros(2, self.B, dtype=torch.int64, device=dev)  # pos, rank
        self._index_src: torch.Tensor | None = None
        # sampled builds: per row (temperature, top_k, top_p, greedy) and (stream key, counter)
        self.params = torch.zeros(rows, 4, dtype=torch.float64, device=dev)
        self.streams = torch.zeros(rows, 2, dtype=torch.int64, device=dev)

    def body(self, cand, sent, n, slots, pos, rank, kv_len: int, sampler=None) -> None:
        """The build after the candidates, on device tensors (the captured function's body);
        ``sampler`` = (SamplingTensors, RowStreams, fan-out, C) for a sampled build."""
        K = self.K
        fork, first, kv_limit, full = branch_setup(cand, sent, n, pos, rank)
        r = self.runner
        pick = None if sampler is None else self._sampled_pick(slots, *sampler)
        tokens, tops = r.tree_body(first, kv_limit, full, slots, K, self.top, self.vocab,
                                   kv_len, r.use_kernel, pick)
        self.branch_top[slots, :, :, :tops.shape[-1]] = tops
        self.cache.tokens[slots] = tokens
        self.cache.store_keys(slots, fork, first)

    def _sampled_pick(self, slots, params: SamplingTensors, streams: RowStreams,
                      fan: tuple, saguaro_c: float):
        """Depth d's branch tokens drawn from sigma_{F_d,C} of each row's distribution (B draws
        of its stream per depth, in branch order); the q each was drawn from goes to the cache."""
        B, V = self.B, self.cache.V

        def pick(d: int, logits: torch.Tensor) -> torch.Tensor:
            if logits.shape[-1] < V:  # a draft with fewer rows than the target: never those
                logits = torch.nn.functional.pad(logits, (0, V - logits.shape[-1]),
                                                 value=float("-inf"))
            u = streams.uniforms(B, start=d * B)  # [b, B]
            tok, q = sample_branches(logits, params, u, fan[d] if d < len(fan) else 0,
                                     saguaro_c)
            self.cache.q[slots, :, d] = q
            return tok
        return pick

    def run(self, cand: torch.Tensor, sent: list[list[int]], lengths: list[int],
            slots: list[int], pos: torch.Tensor, rank: torch.Tensor, kv_len: int,
            sampled_rows=None, fan: tuple = (), saguaro_c: float = 1.0) -> None:
        """cand [b, K+1, C] on the device; sent / lengths / slots on the host; pos, rank [B].
        ``sampled_rows`` (the rows, with ``params`` and ``stream``): a sampled build, which
        reserves K * B draws of each row's stream."""
        kv_len = self.runner.kv_bucket(kv_len)
        dev = self.runner.device
        b, K = cand.shape[0], self.K
        rows = batch_bucket(b) if self.pool is not None else b
        host_params = host_streams = None
        if sampled_rows is not None:
            params = [r.params for r in sampled_rows] + [GHOST_PARAMS] * (rows - b)
            host_params = SamplingTensors.host_table(params)
            host_streams = torch.zeros(rows, 2, dtype=torch.int64)
            host_streams[:b] = torch.tensor([[r.stream.key, r.stream.reserve(K * self.B)]
                                             for r in sampled_rows], dtype=torch.int64)
            facts = SamplingTensors.host_facts(params)
        if self.pool is None:
            sampler = None
            if sampled_rows is not None:
                sampler = self._sampler(host_params.to(dev), host_streams.to(dev), facts, fan,
                                        saguaro_c)
            self.body(cand, to_device(sent, dev), to_device(lengths, dev), to_device(slots, dev),
                      pos, rank, kv_len, sampler)
            return
        host = torch.zeros(rows * (K + 2), dtype=torch.int64)
        host[:b * K] = torch.tensor(sent, dtype=torch.int64).view(-1)
        host[rows * K:rows * K + b] = torch.tensor(lengths, dtype=torch.int64)
        host[rows * (K + 1):rows * (K + 1) + b] = torch.tensor(slots, dtype=torch.int64)
        host[rows * (K + 1) + b:] = self.runner.scratch_slot  # ghost rows
        self.ints[:rows * (K + 2)].copy_(host, non_blocking=True)
        self.cand[:b].copy_(cand)
        self.cand[b:rows].zero_()
        if self._index_src is not pos:  # the fan-out's branch index (kept while it holds)
            self.index[0].copy_(pos)
            self.index[1].copy_(rank)
            self._index_src = pos
        key = ("tree_build", rows, kv_len)
        if sampled_rows is not None:
            self.params[:rows].copy_(host_params, non_blocking=True)
            self.streams[:rows].copy_(host_streams, non_blocking=True)
            key = ("tree_build_sampled", rows, kv_len, facts, tuple(fan), saguaro_c)
        if not self.pool.has(key):
            ints = self.ints
            sampler = None
            if sampled_rows is not None:
                sampler = self._sampler(self.params[:rows], self.streams[:rows], facts, fan,
                                        saguaro_c)
            self.pool.capture(key, lambda: self.body(
                self.cand[:rows], ints[:rows * K].view(rows, K), ints[rows * K:rows * (K + 1)],
                ints[rows * (K + 1):rows * (K + 2)], self.index[0], self.index[1], kv_len,
                sampler))
        self.pool.replay(key)

    def _sampler(self, params: torch.Tensor, streams: torch.Tensor, facts: tuple, fan,
                 saguaro_c: float):
        """(SamplingTensors, RowStreams, fan-out, C) over the device tables ``params`` [rows, 4]
        and ``streams`` [rows, 2] (static buffers when captured)."""
        return (SamplingTensors.from_table(params, facts),
                RowStreams(streams[:, 0], streams[:, 1], self.K * self.B), tuple(fan), saguaro_c)
