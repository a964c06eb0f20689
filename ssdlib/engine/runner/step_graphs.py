"""Captured small-query forwards of one model runner: static inputs, bucketed shapes, replay.

Decode (s = 1), verification (s = K + 1), the draft's steps and the speculator's tree steps have
few distinct shapes. Each shape is captured once, the first time it is needed, and replayed ever
after (``ssdlib.ops.graph_pool``: CUDA graphs from the compiled extension or torch, or plain
eager calls of the same code with ``cuda_graphs=False`` and on CPU).

A step's key is (mode, batch bucket, queries per row, logits rows, key-length bucket, tree
length). Inputs live in one ``StaticInputs`` arena (``static_inputs.py``): integer inputs given
on the host travel in ONE host-to-device copy, inputs already on the device are copied device to
device. Batches are padded to their bucket with ghost rows that point at a scratch KV slot, see
one key (limit 1), sample greedily and are never read back.

Outputs are the captured graph's own tensors: read them before the next replay of the same key.
"""

from __future__ import annotations

import torch

from ssdlib.engine.runner.static_inputs import Segment, StaticInputs, batch_bucket
from ssdlib.engine.sampled_chain import sampled_chain_body
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.sampling import SamplingFacts, SamplingParams, SamplingTensors

# A ghost row's sampling parameters (greedy), and its row of SamplingTensors.host_table.
GHOST_PARAMS = SamplingParams()
GHOST_ROW = SamplingTensors.host_table([GHOST_PARAMS])[0].numpy()


def any_bucket_facts(params) -> SamplingFacts:
    """What the host knows of rows ``params`` for a step captured for every batch bucket at
    once: a greedy ghost row always counted, so that one key serves every bucket."""
    return SamplingTensors.host_facts(list(params) + [GHOST_PARAMS])


class StepGraphs:
    """Static buffers and captured forwards for one :class:`ModelRunner`."""

    def __init__(self, runner, pool, max_batch: int, max_queries: int, max_tree: int,
                 kind: str = "", use_kernel: bool | None = None, model=None,
                 all_buckets: bool = False):
        self.runner = runner
        self.pool = pool
        self.kind = kind  # prefixes the keys: several StepGraphs may share one pool
        # the model a forward step runs: the runner's step model (torch.compile'd with
        # compile=True) unless given (the prefill graphs run the plain one)
        self.model = runner.step_model if model is None else model
        # the in-place attention kernel (few queries per row) or SDPA (prefill graphs)
        self.use_kernel = runner.use_kernel if use_kernel is None else use_kernel
        self.max_queries = max_queries
        self.max_tree = max_tree
        # a step captured for one batch bucket is captured for every bucket up to max_rows at
        # once with all_buckets (with torch.compile each bucket is a compile of seconds, a plain
        # capture tens of ms, which would otherwise fall in the middle of a run, whenever rows
        # leave and the batch shrinks to a new bucket); on CUDA always, so a warm-up captures
        # them all. Per row: ids, positions, key limits, logits index, tree index [queries],
        # the slot, a sampled chain's parameter table (float64) and stream (key, counter)
        q = max_queries
        self.inputs = StaticInputs(runner.device, max_batch, {
            "ids": Segment(q), "pos": Segment(q), "limit": Segment(q, ghost=1),
            "index": Segment(q), "tree_index": Segment(q),
            "slots": Segment(1, ghost=runner.scratch_slot),
            "table": Segment(4, ghost=GHOST_ROW, float64=True), "streams": Segment(2)},
            all_buckets=all_buckets)
        self.max_rows = self.inputs.max_rows
        dev = runner.device
        self.tree_mask = torch.zeros(self.max_rows, max_queries, max(max_tree, 1),
                                     dtype=torch.bool, device=dev)
        self.outputs: dict[tuple, torch.Tensor] = {}

    @property
    def all_buckets(self) -> bool:
        return self.inputs.all_buckets

    def fits(self, b: int, s: int, tree_len: int = 0) -> bool:
        return b <= self.max_rows and s <= self.max_queries and tree_len <= self.max_tree

    def _view(self, name: str, rows: int, cols: int | None) -> torch.Tensor:
        return self.inputs.view(name, rows, cols)

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
                kv_len, self.use_kernel, self._view("table", rows, 4),
                self._view("streams", rows, 2), facts)

        tokens, q = self._replay(key, run)
        return tokens[:b], q[:b]

    def _replay(self, key: tuple, run):
        """:meth:`capture` ``run`` under ``key`` the first time, replay it, return its output."""
        self.capture(key, run)
        self.pool.replay(key)
        return self.outputs[key]

    def capture(self, key: tuple, run, max_rows: int | None = None) -> None:
        """Capture ``run(key, rows)`` under ``key`` (a step key: its batch bucket ``key[1]``)
        unless it is captured, with ``all_buckets`` under the same key for every other batch
        bucket too (the first rows of the inputs in hand, ghost rows past them), up to
        ``max_rows`` rows where given (a step that never runs larger batches)."""
        if self.pool.has(key):
            return
        for rows in self.inputs.capture_buckets(key[1]):
            if max_rows is not None and rows > batch_bucket(max_rows) and rows != key[1]:
                continue
            other = key[:1] + (rows,) + key[2:]
            if not self.pool.has(other):
                self.pool.capture(other, lambda k=other, r=rows: run(k, r))

    def _fill(self, rows, b, s, n, ids, positions, slots, kv_limit, logits_index, tree_index,
              tree_mask, tree_len, table=None, streams=None) -> None:
        """Real rows first, ghost rows after (every bucket's with ``all_buckets``): scratch
        slot, position 0, limit 1 (a greedy parameter row, stream 0); one upload."""
        inputs = self.inputs
        rows = inputs.fill_rows(rows)
        if table is not None:
            inputs.put("table", rows, table, 4)
            inputs.put("streams", rows, streams, 2)
        inputs.put("ids", rows, ids, s)
        inputs.put("pos", rows, positions, s)
        inputs.put("limit", rows, kv_limit, s)
        inputs.put("slots", rows, slots)
        if n:
            inputs.put("index", rows, logits_index, n)
        if tree_index is not None:
            inputs.put("tree_index", rows, tree_index, s)
        inputs.upload()
        if tree_mask is not None:
            self.tree_mask[:b, :s, :tree_len].copy_(tree_mask)
            self.tree_mask[b:rows].zero_()

    def _run(self, key, rows, s, n, kv_len, tree, tree_len) -> None:
        r = self.runner
        # a prefill graph's rows are start + 0 .. s - 1 (ModelRunner._prefill_step) with keys up
        # to the bucket of the last position: kv_len == s exactly when every start is 0, and
        # such a prefill attends causally over its own keys (the key decides it, every replay)
        from_zero = r.causal_prefill and self.kind == "prefill" and not tree and kv_len == s
        meta = AttentionMetadata(
            self._view("pos", rows, s), self._view("slots", rows, None), kv_len,
            kv_limit=self._view("limit", rows, s),
            tree_index=self._view("tree_index", rows, s) if tree else None,
            tree_mask=self.tree_mask[:rows, :s, :tree_len] if tree else None,
            tree_len=tree_len, use_kernel=self.use_kernel, from_zero=from_zero)
        index = self._view("index", rows, n) if n else None
        self.outputs[key] = self.model(self._view("ids", rows, s), r.cache, meta, index)
