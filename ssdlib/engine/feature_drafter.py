"""A feature draft (EAGLE-style, :mod:`ssdlib.models.feature_draft`) proposing K tokens a row in
SD, beside the target whose features it reads.

Where the features come from: the target's runner keeps a per-slot feature buffer
(``KVCache.features`` [slots, max_len, W]) that every target forward writes, like its KV: at
each fed position the features the draft's spec names (``ssdlib.models.feature_spec``), the last
decoder layer's output before the final norm (W = H) or three layers' outputs concatenated
(fused, W = 3H). Every feed conditions what it gathers there (``FeatureDraft.condition``: fused
features through the draft's ``fuse``, to width H); the draft's own h, which stands in for them
in the chain, is already conditioned. A verify of K + 1
positions therefore leaves f_t for the last committed token and the K drafts; after the
acceptance the buffer holds the true f_t of every committed position but the last (whose token,
the bonus, the target has not fed yet). Nothing is read back to the host and no target forward is
added.

The draft's KV position t holds the pair (f_t, x_{t+1}). ``valid[slot]`` counts the leading
positions fed with the target's own features; a proposal feeds positions valid .. L-2 (L
committed tokens; at least the last one again, whose output starts the chain), then drafts: token
d_1 from h_{L-2}, and each later d_{j+1} from the pair (h, d_j) with the draft's own h standing in
for the feature the target has not computed. Those chain positions hold draft features, so
``valid`` stays at L - 1 and the next proposal feeds them again with the target's. A round that
drafts nothing (adaptive K = 0) leaves the draft behind; the next proposal's first forward covers
the gap.

Captured steps: with a graph pool (CUDA; ``SSDLIB_STEP_GRAPHS`` on a CPU, run eagerly) a greedy
proposal is one graph replay per batch bucket and k (every bucket captured at k's first use):
the feed of each row's unfed positions padded to K_max + 1 (the usual round; the padding's KV
lands past the row and is overwritten before it is read), d_1 at each row's last real position,
then the k - 1 chain steps (the pair (h, d_j) forward, its argmax). Its host inputs go up in one
copy; rows past the batch are ghost rows writing to the scratch slot. A row further behind
(after rounds at K = 0) is first fed eagerly up to its last position but one, which the captured
step then feeds. A sampled proposal is one replay too, keyed also by what the host knows of the
rows' parameters: the same feed, then k draws, each from the row's target distribution q_j with
draw j of its stream (positions reserved on the host, inputs like the token ids; greedy ghost
rows), and the chain steps between them; where it does not fit it runs eagerly (the same
body). A capture that fails is logged once and proposals run eagerly from then on.
"""

from __future__ import annotations

import torch

from ssdlib.engine.batching import pack_rows, slots_tensor, to_device
from ssdlib.engine.runner.compiled import checked_feature_step_draft
from ssdlib.engine.runner.kv_cache import KVCache
from ssdlib.engine.runner.static_inputs import batch_bucket, batch_buckets
from ssdlib.engine.runner.step_graphs import GHOST_ROW, any_bucket_facts
from ssdlib.engine.sampled_chain import draw_chain, fit_vocab
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.log import get_logger
from ssdlib.ops.row_top import row_argmax
from ssdlib.sampling import SamplingTensors, one_hot
from ssdlib.speculative.rng import RowStreams

log = get_logger(__name__)


class FeatureDrafter:
    """The SD loop's proposer (the interface of :class:`~ssdlib.engine.drafter.Drafter`:
    ``reset``, ``prefill``, ``propose``, ``skip``, ``after_commit``, ``plain``) for a feature
    draft. ``features``: the target runner's feature buffer [slots, max_len, W], W the draft's
    ``feature_width``."""

    def __init__(self, draft, features: torch.Tensor, n_slots: int, max_len: int,
                 vocab_size: int, draws: int = 0, pool=None, use_kernel: bool = False,
                 compile_backend: str | None = None):
        if features.shape[-1] != draft.feature_width:
            raise ValueError(f"the target keeps features of width {features.shape[-1]} but the "
                             f"draft reads {draft.feature.kind} features of width "
                             f"{draft.feature_width}")
        self.draft = draft
        # captured greedy chains (module doc): a GraphPool, or None for eager chains
        self.pool = pool
        self.use_kernel = use_kernel  # the chain's attention reads the KV cache in place
        self.scratch_slot = n_slots - 1  # ghost rows of a captured chain write here
        self._static: dict[tuple, dict[str, torch.Tensor]] = {}
        self.features = features
        self.device = features.device
        cfg = draft.config
        self.cache = KVCache(cfg.num_hidden_layers, n_slots, draft.kv_heads_local, max_len,
                             cfg.head_dim, features.dtype, self.device)
        # the draft as the proposal's steps of fixed shape run it (the feed of a round's
        # positions, the chain): its layers under torch.compile with ``compile_backend``
        # (``compiled.checked_feature_step_draft``), else the plain draft, which an admission's
        # feed of a whole prompt always runs
        self.step_draft = draft if compile_backend is None else checked_feature_step_draft(
            draft, self.cache, self.scratch_slot, use_kernel, compile_backend)
        self.max_len = max_len
        self.vocab_size = vocab_size
        self.draws = draws  # draws a sampled row's stream gives up each proposal (K_max)
        self.valid: dict[int, int] = {}
        self.plain = True  # the last proposal fed no more than a round's tokens (no catch-up)

    def reset(self, slot: int) -> None:
        self.valid[slot] = 0

    def skip(self, seqs) -> None:
        """A round drafts nothing for ``seqs``: their streams still give up a proposal's draws
        (the next proposal's first forward catches the draft up)."""
        for s in seqs:
            s.stream.reserve(self.draws)

    def after_commit(self, seqs, accepted: list[int], k: int) -> None:
        """Nothing to move: ``valid`` never counts the chain's positions (module doc)."""

    @torch.inference_mode()
    def prefill(self, seqs) -> None:
        """Feed every committed position whose feature the target has computed (the prompt's,
        at admission)."""
        self._feed(seqs)

    def _rows(self, seqs) -> tuple[list[int], list[list[int]]]:
        """Each row's first unfed position (at most L-2) and its tokens x_{t+1} for t = that ..
        L-2."""
        starts, rows = [], []
        for s in seqs:
            last = len(s.tokens) - 2
            if last < 0:
                raise ValueError("a feature draft needs two committed tokens (a prompt token and "
                                 "the target's first)")
            start = min(self.valid.get(s.slot, 0), last)
            starts.append(start)
            rows.append(s.tokens[start + 1:last + 2])
        return starts, rows

    def _feed(self, seqs, leave: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed positions valid .. L-2 of every row (at least L-2) with the target's features ->
        (logits [b, V], hidden [b, H]) at each row's position L-2. ``leave``: the last
        ``leave`` of those positions stay unfed (every row must have more unfed than that);
        the output is then at the last position fed."""
        starts, rows = self._rows(seqs)
        if leave:
            if min(map(len, rows)) <= leave:
                raise ValueError(f"a feed leaving {leave} positions unfed needs more unfed")
            rows = [r[:-leave] for r in rows]
        ids, positions = pack_rows(rows, starts)
        positions = positions.clamp(max=self.max_len - 1)  # padding past the end: clamped
        slots = slots_tensor(seqs)
        dev = self.device
        positions_d = positions.to(dev, non_blocking=True)
        slots_d = slots.to(dev, non_blocking=True)
        feats = self.draft.condition(self.features[slots_d.view(-1, 1), positions_d])  # [b, s, H]
        meta = AttentionMetadata(positions_d, slots_d, int(positions.max()) + 1,
                                 kv_limit=positions_d + 1)
        index = to_device([[len(r) - 1] for r in rows], dev)
        logits, hidden = self.draft(ids.to(dev, non_blocking=True), feats, self.cache, meta, index)
        for s in seqs:
            self.valid[s.slot] = len(s.tokens) - 1 - leave
        return logits[:, 0], hidden[:, 0]

    def _catch_up(self, seqs, width: int) -> None:
        """Rows further behind than a captured proposal's feed of ``width`` positions (after
        rounds at K = 0) are fed eagerly up to the last position but one, so that the
        proposal's captured step, which feeds that one, fits them."""
        behind = [s for r, s in zip(self._rows(seqs)[1], seqs) if len(r) > width]
        if behind:
            self._feed(behind, leave=1)

    def _feed_body(self, h: torch.Tensor, width: int, kv_len: int):
        """A captured proposal's feed, from its inputs ``h`` (:meth:`_ghost_inputs`' layout, on
        the device): the target's features gathered and conditioned, each row's unfed pairs
        forwarded -> (d_1's logits [b, V], h [b, H], d_1's position [b], slots [b])."""
        ids, positions = h[:, :width], h[:, width:2 * width]
        slots, index = h[:, 2 * width], h[:, 2 * width + 1:2 * width + 2]
        feats = self.draft.condition(self.features[slots.view(-1, 1), positions])
        meta = AttentionMetadata(positions, slots, kv_len, kv_limit=positions + 1,
                                 use_kernel=self.use_kernel)
        logits, hidden = self.step_draft(ids, feats, self.cache, meta, index)
        first = positions.gather(1, index)[:, 0] + 1
        return logits[:, 0], hidden[:, 0], first, slots

    def _ghost_inputs(self, bucket: int, width: int, device) -> torch.Tensor:
        """A captured proposal's inputs [bucket, 2 * width + 4] int64, every row a ghost row:
        ids (0) | positions 0 .. width - 1 | the scratch slot | d_1's index (0) | a sampled
        row's stream key and first counter (0, 0)."""
        host = torch.zeros(bucket, 2 * width + 4, dtype=torch.int64, device=device)
        host[:, width:2 * width] = torch.arange(width, device=device)
        host[:, 2 * width] = self.scratch_slot
        return host

    def _feed_inputs(self, seqs, k: int):
        """(width, bucket, inputs on the host) of a captured proposal of k drafts for ``seqs``,
        or None where a row's unfed tokens do not fit the feed's width (K_max + 1: the usual
        round) or its padding would pass the cache's end (the caller goes the eager way)."""
        width = max(self.draws, k) + 1
        starts, rows = self._rows(seqs)
        if max(map(len, rows)) > width or max(starts) + width > self.max_len:
            return None
        b = len(seqs)
        bucket = batch_bucket(b)
        ids, _ = pack_rows(rows, starts)
        host = self._ghost_inputs(bucket, width, "cpu")
        host[:b, :width] = torch.nn.functional.pad(ids, (0, width - ids.shape[1]))
        host[:b, width:2 * width] = (torch.as_tensor(starts, dtype=torch.int64).view(-1, 1)
                                     + torch.arange(width))
        host[:b, 2 * width] = slots_tensor(seqs)
        host[:b, 2 * width + 1] = torch.tensor([len(r) - 1 for r in rows])
        return width, bucket, host

    def _replay(self, key, seqs, host: torch.Tensor, table: torch.Tensor | None = None) -> dict:
        """Upload a captured proposal's inputs (one copy each), replay it, mark the rows fed;
        -> its static tensors (outputs read before the next replay of ``key``)."""
        st = self._static[key]
        st["host"].copy_(host.to(self.device, non_blocking=True))
        if table is not None:
            st["table"].copy_(table.to(self.device, non_blocking=True))
        self.pool.replay(key)
        for s in seqs:
            self.valid[s.slot] = len(s.tokens) - 1
        return st

    def _captured_proposal(self, seqs, k: int) -> torch.Tensor | None:
        """A greedy proposal as one replay (feed and chain); None where it does not fit
        (:meth:`_feed_inputs`)."""
        laid = self._feed_inputs(seqs, k)
        if laid is None:
            return None
        width, bucket, host = laid
        kv_len = self.max_len
        key = self._captured_key(
            "feature_proposal", bucket, (width, k, kv_len),
            lambda key, size: self._capture_proposal(key, size, width, k, kv_len))
        if key is None:
            return None
        return self._replay(key, seqs, host)["out"][:len(seqs)].clone()

    def _capture_proposal(self, key, bucket: int, width: int, k: int, kv_len: int) -> None:
        dev = self.device
        st = {"host": self._ghost_inputs(bucket, width, dev),
              "out": torch.zeros(bucket, k, dtype=torch.int64, device=dev)}

        def run():
            logits, hidden, first, slots = self._feed_body(st["host"], width, kv_len)
            tok = row_argmax(fit_vocab(logits, self.vocab_size))
            out = [tok.view(-1, 1)]
            if k > 1:
                out.append(self._chain_body(tok, hidden, first, slots, k - 1, kv_len))
            st["out"].copy_(torch.cat(out, dim=1))
        self._register(key, st, run)

    def _sampled_body(self, logits, hidden, first, slots, k: int, kv_len: int, params,
                      u: torch.Tensor, use_kernel: bool):
        """k sampled drafts from d_1's logits [b, V] and h [b, H] at positions ``first`` [b]:
        draft j from the row's target distribution q_j with draw ``u[:, j]`` (one-hot on greedy
        rows), then the pair (h, d_j) forward (not after the last) -> (tokens [b, k], q
        [b, k, V] float32). The eager and the captured proposal both run it."""
        state = [hidden]  # the chain's last h

        def step(tok: torch.Tensor, j: int) -> torch.Tensor:
            logits, state[0] = self._step(tok, state[0], first + j, slots, kv_len, use_kernel)
            return logits
        return draw_chain(logits, k, self.vocab_size, params, u, step)

    def _captured_sampled_proposal(self, seqs, k: int, host_params, keys: torch.Tensor):
        """A sampled proposal as one replay (feed, draws and chain), where it fits as the
        greedy one does; ``keys`` [b, 2] the rows' stream positions reserved on the host. The
        key holds what the host knows of the rows' parameters (a greedy ghost row counted);
        ghost rows are greedy. None: eager."""
        laid = self._feed_inputs(seqs, k)
        if laid is None:
            return None
        width, bucket, host = laid
        kv_len = self.max_len
        facts = any_bucket_facts(host_params)
        key = self._captured_key(
            "feature_sampled_proposal", bucket, (width, k, kv_len, facts),
            lambda key, size: self._capture_sampled(key, size, width, k, kv_len, facts))
        if key is None:
            return None
        b = len(seqs)
        host[:b, 2 * width + 2:] = keys
        table = torch.as_tensor(GHOST_ROW).expand(bucket, -1).clone()
        table[:b] = SamplingTensors.host_table(host_params)
        st = self._replay(key, seqs, host, table)
        return st["out"][:b].clone(), st["q"][:b].clone()

    def _capture_sampled(self, key, bucket: int, width: int, k: int, kv_len: int,
                         facts) -> None:
        dev = self.device
        st = {"host": self._ghost_inputs(bucket, width, dev),
              "table": torch.as_tensor(GHOST_ROW).to(dev).expand(bucket, -1).clone(),
              "out": torch.zeros(bucket, k, dtype=torch.int64, device=dev),
              "q": torch.zeros(bucket, k, self.vocab_size, dtype=torch.float32, device=dev)}

        def run():
            h = st["host"]
            logits, hidden, first, slots = self._feed_body(h, width, kv_len)
            params = SamplingTensors.from_table(st["table"], facts)
            u = RowStreams(h[:, 2 * width + 2], h[:, 2 * width + 3], k).uniforms(k)
            tokens, q = self._sampled_body(logits, hidden, first, slots, k, kv_len, params, u,
                                           self.use_kernel)
            st["out"].copy_(tokens)
            st["q"].copy_(q)
        self._register(key, st, run)

    def _step(self, tok: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
              slots: torch.Tensor, kv_len: int,
              use_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One chain step: the pair (hidden, tok) at ``pos`` [b] -> (logits [b, V], hidden
        [b, H])."""
        p = pos.view(-1, 1)
        meta = AttentionMetadata(p, slots, kv_len, kv_limit=p + 1, use_kernel=use_kernel)
        logits, hidden = self.step_draft(tok.view(-1, 1), hidden.unsqueeze(1), self.cache, meta)
        return logits[:, 0], hidden[:, 0]

    def _chain_body(self, tok, hidden, first, slots, steps: int, kv_len: int) -> torch.Tensor:
        """``steps`` greedy chain steps from d_1 = ``tok`` [b] and h [b, H] at positions
        ``first`` [b] -> tokens [b, steps]."""
        out = []
        for j in range(steps):
            logits, hidden = self._step(tok, hidden, first + j, slots, kv_len, self.use_kernel)
            tok = row_argmax(fit_vocab(logits, self.vocab_size))
            out.append(tok)
        return torch.stack(out, dim=1)

    def _captured_key(self, kind: str, bucket: int, rest: tuple, capture) -> tuple | None:
        """The key of the captured step ``kind`` for ``bucket`` (``rest``: the rest of its
        key), every bucket of it captured at its first use by ``capture(key, size)`` (a
        shrinking batch then finds its graph); None without a pool, or once a capture failed
        (logged once: the drafter runs eagerly from then on)."""
        if self.pool is not None and not self.pool.has((kind, bucket, *rest)):
            try:
                for size in self._buckets():
                    if not self.pool.has((kind, size, *rest)):
                        capture((kind, size, *rest), size)
            except Exception as e:  # noqa: BLE001 - any capture failure: eager from now on
                log.warning("capturing the feature draft's %s failed (%s: %s); it runs eagerly",
                            kind, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self.pool = None
        return None if self.pool is None else (kind, bucket, *rest)

    def _register(self, key, st: dict[str, torch.Tensor], body) -> None:
        """Capture ``body`` (it reads and writes the static tensors ``st``) under ``key``."""
        self._static[key] = st
        with torch.inference_mode():
            self.pool.capture(key, body)

    def _captured_chain(self, tok, hidden, first, slots, k: int) -> torch.Tensor:
        """The greedy chain's k - 1 steps after d_1 as one replay (module doc) -> [b, k-1];
        eagerly where capturing failed."""
        b = tok.shape[0]
        bucket = batch_bucket(b)
        # one key length for every step (the in-place kernel reads each row up to its limit)
        kv_len = self.max_len
        key = self._captured_key("feature_chain", bucket, (k, kv_len),
                                 lambda key, size: self._capture(key, size, k, kv_len, hidden))
        if key is None:
            return self._chain_body(tok, hidden, first, slots, k - 1, kv_len)
        st = self._static[key]
        st["tok"][:b].copy_(tok)
        st["hidden"][:b].copy_(hidden)
        st["first"][:b].copy_(first)
        st["slots"][:b].copy_(slots)
        if b < bucket:  # ghost rows: the scratch slot, position 0
            st["tok"][b:].zero_()
            st["hidden"][b:].zero_()
            st["first"][b:].zero_()
            st["slots"][b:].fill_(self.scratch_slot)
        self.pool.replay(key)
        return st["out"][:b].clone()

    def _buckets(self) -> list[int]:
        """The batch buckets of a captured step: every one up to the largest batch's."""
        return batch_buckets(self.scratch_slot)

    def _capture(self, key, bucket: int, k: int, kv_len: int, like: torch.Tensor) -> None:
        dev = self.device
        st = {"tok": torch.zeros(bucket, dtype=torch.int64, device=dev),
              "hidden": torch.zeros(bucket, like.shape[-1], dtype=like.dtype, device=dev),
              "first": torch.zeros(bucket, dtype=torch.int64, device=dev),
              "slots": torch.full((bucket,), self.scratch_slot, dtype=torch.int64, device=dev),
              "out": torch.zeros(bucket, k - 1, dtype=torch.int64, device=dev)}

        self._register(key, st, lambda: st["out"].copy_(self._chain_body(
            st["tok"], st["hidden"], st["first"], st["slots"], k - 1, kv_len)))

    @torch.inference_mode()
    def propose(self, seqs, k: int, want_q: bool = True):
        """Draft k tokens per row -> tokens [b, k] (device) and q [b, k, V] float32 (one-hot
        on greedy rows), or None for q when every row is greedy and ``want_q`` is False."""
        if k < 1:
            raise ValueError(f"a proposal drafts at least one token, got k={k}")
        greedy = all(s.params.greedy for s in seqs)
        # a proposal's time measures k draft steps unless a row was far behind (a catch-up)
        self.plain = max(map(len, self._rows(seqs)[1])) <= max(self.draws, k) + 1
        if not self.plain and self.pool is not None:
            self._catch_up(seqs, max(self.draws, k) + 1)
        if greedy and self.pool is not None:
            tokens = self._captured_proposal(seqs, k)
            if tokens is not None:
                return tokens, (one_hot(tokens, self.vocab_size) if want_q else None)
        if not greedy:
            host = [s.params for s in seqs]
            keys = RowStreams.reserve_host([s.stream for s in seqs], max(k, self.draws))
            if self.pool is not None:
                out = self._captured_sampled_proposal(seqs, k, host, keys)
                if out is not None:
                    return out
            params = SamplingTensors.from_params(host, self.device)
            keys = keys.to(self.device, non_blocking=True)
            u = RowStreams(keys[:, 0], keys[:, 1], k).uniforms(k)
        logits, hidden = self._feed(seqs)
        slots = slots_tensor(seqs).to(self.device, non_blocking=True)
        # d_1's pair sits at position L - 1 (copied without a host sync)
        first = to_device([len(s.tokens) - 1 for s in seqs], self.device)
        kv_len = min(max(len(s.tokens) for s in seqs) + k, self.max_len)
        if not greedy:
            return self._sampled_body(logits, hidden, first, slots, k, kv_len, params, u, False)
        tokens = []
        for j in range(k):
            tok = row_argmax(fit_vocab(logits, self.vocab_size))
            tokens.append(tok)
            if j == 0 and k > 1 and self.pool is not None:
                tokens.append(self._captured_chain(tok, hidden, first, slots, k))
                break
            if j < k - 1:
                logits, hidden = self._step(tok, hidden, first + j, slots, kv_len)
        tokens = torch.cat([t.view(len(seqs), -1) for t in tokens], dim=1)
        return tokens, (one_hot(tokens, self.vocab_size) if want_q else None)
