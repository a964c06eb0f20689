"""Captured small-query forwards of one model runner: static inputs, bucketed shapes, replay.

Decode (s = 1), verification (s = K + 1), the draft's steps and the speculator's tree steps have
few distinct shapes. Each shape is captured once, the first time it is needed, and replayed ever
after (``ssdlib.ops.graph_pool``: CUDA graphs from the compiled extension or torch, or plain
eager calls of the same code with ``cuda_graphs=False`` and on CPU).

A step's key is (mode, batch bucket, queries per row, logits rows, key-length bucket, tree
length). Inputs are copied into static device buffers: integer inputs given on the host travel
in ONE host-to-device copy (a flat int64 arena whose views are the buffers); inputs already on the
device are copied device to device. Batches are padded to their bucket with ghost rows that point
at a scratch KV slot, see one key (limit 1) and are never read back.

Outputs are the captured graph's own tensors: read them before the next replay of the same key.
"""

from __future__ import annotations

import numpy as np
import torch

from ssdlib.engine.sampled_chain import sampled_chain_body
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.sampling import SamplingParams, SamplingTensors

# A ghost row's sampling parameters: a greedy row of SamplingTensors.host_table.
GHOST_ROW = SamplingTensors.host_table([SamplingParams()])[0].numpy()

# Batch buckets (nano-vllm's habit): 1, 2, 4, 8, then steps of 8.
SMALL_BUCKETS = (1, 2, 4, 8)


def batch_bucket(b: int) -> int:
    for size in SMALL_BUCKETS:
        if b <= size:
            return size
    return -(-b // 8) * 8


class StepGraphs:
    """Static buffers and captured forwards for one :class:`ModelRunner`."""

    # arena segments, each [max_rows * max_queries] int64 (slots: [max_rows])
    SEGMENTS = ("ids", "pos", "limit", "index", "tree_index")

    def __init__(self, runner, pool, max_batch: int, max_queries: int, max_tree: int,
                 kind: str = "", use_kernel: bool | None = None, model=None,
                 all_buckets: bool = False):
        self.runner = runner
        self.pool = pool
        # a step captured for one batch bucket is captured for every bucket up to max_rows at
        # once (with torch.compile each bucket is a compile of seconds, a plain capture tens of
        # ms, which would otherwise fall in the middle of a run, whenever rows leave and the
        # batch shrinks to a new bucket); on CUDA always, so a warm-up captures them all
        self.all_buckets = all_buckets
        self.kind = kind  # prefixes the keys: several StepGraphs may share one pool
        # the model a forward step runs: the runner's step model (torch.compile'd with
        # compile=True) unless given (the prefill graphs run the plain one)
        self.model = runner.step_model if model is None else model
        # the in-place attention kernel (few queries per row) or SDPA (prefill graphs)
        self.use_kernel = runner.use_kernel if use_kernel is None else use_kernel
        self.max_rows = batch_bucket(max_batch)
        self.max_queries = max_queries
        self.max_tree = max_tree
        dev = runner.device
        n = self.max_rows * max_queries
        self.offsets = {name: i * n for i, name in enumerate(self.SEGMENTS)}
        self.offsets["slots"] = len(self.SEGMENTS) * n
        # a sampled chain's rows: parameter table [rows, 4] (float64 bits) and streams [rows, 2]
        self.offsets["table"] = self.offsets["slots"] + self.max_rows
        self.offsets["streams"] = self.offsets["table"] + 4 * self.max_rows
        self.arena_size = self.offsets["streams"] + 2 * self.max_rows
        self.arena = torch.zeros(self.arena_size, dtype=torch.int64, device=dev)
        # the host side of the one copy, filled with numpy (a few µs; torch's small CPU ops
        # cost ~50 µs a step) and reused: a copy from pageable memory is staged before it
        # returns, so the next fill cannot race it
        self._host = np.zeros(self.arena_size, dtype=np.int64)
        self._host_t = torch.from_numpy(self._host)
        self.tree_mask = torch.zeros(self.max_rows, max_queries, max(max_tree, 1),
                                     dtype=torch.bool, device=dev)
        self.outputs: dict[tuple, torch.Tensor] = {}

    def fits(self, b: int, s: int, tree_len: int = 0) -> bool:
        return b <= self.max_rows and s <= self.max_queries and tree_len <= self.max_tree

    def _view(self, name: str, rows: int, cols: int | None) -> torch.Tensor:
        start = self.offsets[name]
        if cols is None:
            return self.arena[start:start + rows]
        return self.arena[start:start + rows * cols].view(rows, cols)

    def forward(self, ids, positions, slots, kv_limit, logits_index, kv_len: int,
                tree_index=None, tree_mask=None, tree_len: int = 0) -> torch.Tensor:
        """Same arguments as the eager forward (host or device tensors); returns logits of the
        real rows, [b, s or n, V], a view of the graph's output."""
        b, s = ids.shape
        rows = batch_bucket(b)
        n = 0 if logits_index is None else logits_index.shape[1]
        tree = tree_index is not None
        key = (self.kind + ("tree" if tree else "fwd"), rows, s, n, kv_len, tree_len)
        self._fill(rows, b, s, n, ids, positions, slots, kv_limit, logits_index, tree_index,
                   tree_mask, tree_len)

        def run(key, rows):
            self._run(key, rows, s, n, kv_len, tree, tree_len)
        return self._replay(key, run)[:b]

    def chain(self, first, positions, slots, steps: int, vocab: int, kv_len: int) -> torch.Tensor:
        """Greedy chain of ``steps`` single-token steps in one graph (see
        ``ModelRunner.greedy_chain``): first [b] (device), positions [b], slots [b]."""
        b = first.shape[0]
        rows = batch_bucket(b)
        key = (self.kind + "chain", rows, steps, vocab, kv_len)
        self._fill(rows, b, 1, 0, first.view(-1, 1), positions.view(-1, 1), slots,
                   positions.view(-1, 1) + 1, None, None, None, 0)
        def run(key, rows):
            r = self.runner
            self.outputs[key] = r.chain_body(
                self._view("ids", rows, 1)[:, 0], self._view("pos", rows, 1)[:, 0],
                self._view("slots", rows, None), steps, vocab, kv_len, self.use_kernel)

        return self._replay(key, run)[:b]

    def prefix_chain(self, ids, positions, slots, logits_index, steps: int, vocab: int,
                     kv_len: int) -> torch.Tensor:
        """A forward over ``ids`` [b, s] (the committed tokens the draft has not seen), the
        argmax at ``logits_index`` [b, 1], then ``steps`` greedy single-token steps, in one
        graph (see ``ModelRunner.prefix_chain``) -> tokens [b, 1 + steps]."""
        b, s = ids.shape
        rows = batch_bucket(b)
        key = (self.kind + "pchain", rows, s, steps, vocab, kv_len)
        self._fill(rows, b, s, 1, ids, positions, slots, positions + 1, logits_index, None,
                   None, 0)

        def run(key, rows):
            self.outputs[key] = self.runner.prefix_chain_body(
                self._view("ids", rows, s), self._view("pos", rows, s),
                self._view("slots", rows, None), self._view("index", rows, 1), steps, vocab,
                kv_len, self.use_kernel)

        return self._replay(key, run)[:b]

    def sampled_chain(self, ids, positions, slots, logits_index, steps: int, vocab: int,
                      kv_len: int, table, streams, facts) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's sampled proposal in one graph (``sampled_chain.py``): ids [b, s],
        positions [b, s], slots [b], logits_index [b, 1], the rows' parameter ``table``
        [b, 4] float64 and ``streams`` [b, 2] on the host (they travel in the one copy; ghost
        rows are greedy) -> (tokens [b, steps + 1], q [b, steps + 1, vocab])."""
        b, s = ids.shape
        rows = batch_bucket(b)
        key = (self.kind + "schain", rows, s, steps, vocab, kv_len, facts)
        self._fill(rows, b, s, 1, ids, positions, slots, positions + 1, logits_index, None,
                   None, 0, table=table, streams=streams)

        def run(key, rows):
            self.outputs[key] = sampled_chain_body(
                self.runner, self._view("ids", rows, s), self._view("pos", rows, s),
                self._view("slots", rows, None), self._view("index", rows, 1), steps, vocab,
                kv_len, self.use_kernel, self._view("table", rows, 4).view(torch.float64),
                self._view("streams", rows, 2), facts)

        tokens, q = self._replay(key, run)
        return tokens[:b], q[:b]

    def _replay(self, key: tuple, run):
        """:meth:`capture` ``run`` under ``key`` the first time, replay it, return its output."""
        self.capture(key, run)
        self.pool.replay(key)
        return self.outputs[key]

    def capture(self, key: tuple, run) -> None:
        """Capture ``run(key, rows)`` under ``key`` (a step key: its batch bucket ``key[1]``)
        unless it is captured, with ``all_buckets`` under the same key for every other batch
        bucket too (the first rows of the inputs in hand, ghost rows past them)."""
        if self.pool.has(key):
            return
        for rows in self.capture_buckets(key[1]):
            other = key[:1] + (rows,) + key[2:]
            if not self.pool.has(other):
                self.pool.capture(other, lambda k=other, r=rows: run(k, r))

    def fill_rows(self, rows: int) -> int:
        """Rows of the static inputs to fill for a step of ``rows`` (ghosts past the real
        ones): every bucket's with ``all_buckets``."""
        return self.max_rows if self.all_buckets else rows

    def capture_buckets(self, rows: int) -> list[int]:
        """The batch buckets to capture when ``rows`` is first needed (``rows`` last)."""
        if not self.all_buckets:
            return [rows]
        out, b = [], 1
        while b <= self.max_rows:
            out.append(batch_bucket(b))
            b = out[-1] + 1
        return [r for r in out if r != rows] + [rows]

    def _fill(self, rows, b, s, n, ids, positions, slots, kv_limit, logits_index, tree_index,
              tree_mask, tree_len, table=None, streams=None) -> None:
        """Real rows first, ghost rows after: scratch slot, position 0, limit 1 (a greedy
        parameter row, stream 0)."""
        host = self._host
        host.fill(0)
        rows = self.fill_rows(rows)  # ghosts for every bucket's capture
        if table is not None:
            tv = self._view_of(host, "table", rows, 4).view(np.float64)
            tv[:b] = table.numpy()
            tv[b:] = GHOST_ROW
            self._view_of(host, "streams", rows, 2)[:b] = streams.numpy()
        device_inputs = []
        parts = [("ids", ids, 0), ("pos", positions, 0), ("limit", kv_limit, 1),
                 ("slots", slots, self.runner.scratch_slot)]
        if n:
            parts.append(("index", logits_index, 0))
        if tree_index is not None:
            parts.append(("tree_index", tree_index, 0))
        for name, src, ghost in parts:
            cols = None if name == "slots" else (n if name == "index" else s)
            hv = self._view_of(host, name, rows, cols)
            if ghost:
                hv[b:] = ghost
            if src.device.type == "cpu":
                hv[:b] = src.numpy()
            else:
                device_inputs.append((name, cols, src))
        self.arena[:self.arena_size].copy_(self._host_t, non_blocking=True)  # one copy
        for name, cols, src in device_inputs:
            self._view(name, rows, cols)[:b].copy_(src)
        if tree_mask is not None:
            self.tree_mask[:b, :s, :tree_len].copy_(tree_mask)
            self.tree_mask[b:rows].zero_()

    def _view_of(self, host: np.ndarray, name: str, rows: int, cols: int | None) -> np.ndarray:
        start = self.offsets[name]
        if cols is None:
            return host[start:start + rows]
        return host[start:start + rows * cols].reshape(rows, cols)

    def _run(self, key, rows, s, n, kv_len, tree, tree_len) -> None:
        r = self.runner
        meta = AttentionMetadata(
            self._view("pos", rows, s), self._view("slots", rows, None), kv_len,
            kv_limit=self._view("limit", rows, s),
            tree_index=self._view("tree_index", rows, s) if tree else None,
            tree_mask=self.tree_mask[:rows, :s, :tree_len] if tree else None,
            tree_len=tree_len, use_kernel=self.use_kernel)
        index = self._view("index", rows, n) if n else None
        self.outputs[key] = self.model(self._view("ids", rows, s), r.cache, meta, index)
