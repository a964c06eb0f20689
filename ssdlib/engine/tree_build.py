"""The greedy part of a cache build as ONE captured step: outcomes -> K tree depths -> the cache.

After the candidates of each row's sent speculation are known (``CacheBuilder._candidates``),
everything else a greedy build does depends only on device data and a few host integers:

1. the outcomes to cache: branch j forks after ``pos[j]`` speculation tokens and starts with the
   ``rank[j]``-th candidate at that position that is not the speculation's own token;
2. the branch-to-branch tree mask (same branch, earlier depth) and each branch's slot prefix;
3. the K tree-decode depths (``ModelRunner.tree_body``), argmax per branch, top-C kept per token;
4. the stores: cache tokens, outcome keys, ready flags, the kept candidates.

On a GPU with graphs that is one graph replay per round (captured per batch bucket and key
length), instead of some thirty small launches from the host; ghost rows of the bucket use the
scratch slot (the cache's last row). Without a graph pool (CPU) the same body runs eagerly.
"""

from __future__ import annotations

import torch

from ssdlib.engine.batching import to_device
from ssdlib.engine.step_graphs import batch_bucket
from ssdlib.ops.tree_mask import tree_mask_full


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

    def body(self, cand, sent, n, slots, pos, rank, kv_len: int) -> None:
        """The build after the candidates, on device tensors (the captured function's body)."""
        K = self.K
        fork, first, kv_limit, full = branch_setup(cand, sent, n, pos, rank)
        r = self.runner
        tokens, tops = r.tree_body(first, kv_limit, full, slots, K, self.top, self.vocab,
                                   kv_len, r.use_kernel)
        self.branch_top[slots, :, :, :tops.shape[-1]] = tops
        self.cache.tokens[slots] = tokens
        self.cache.store_keys(slots, fork, first)

    def run(self, cand: torch.Tensor, sent: list[list[int]], lengths: list[int],
            slots: list[int], pos: torch.Tensor, rank: torch.Tensor, kv_len: int) -> None:
        """cand [b, K+1, C] on the device; sent / lengths / slots on the host; pos, rank [B]."""
        kv_len = self.runner.kv_bucket(kv_len)
        dev = self.runner.device
        if self.pool is None:
            self.body(cand, to_device(sent, dev), to_device(lengths, dev), to_device(slots, dev),
                      pos, rank, kv_len)
            return
        b, K = cand.shape[0], self.K
        rows = batch_bucket(b)
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
        if not self.pool.has(key):
            ints = self.ints
            self.pool.capture(key, lambda: self.body(
                self.cand[:rows], ints[:rows * K].view(rows, K), ints[rows * K:rows * (K + 1)],
                ints[rows * (K + 1):rows * (K + 2)], self.index[0], self.index[1], kv_len))
        self.pool.replay(key)
