"""A feature draft (EAGLE-style) as SSD's speculator holds it: its KV cache with the tree
scratch, the target's features committed from each OUTCOME, and its jit drafts. The cache build
that reads it is ``feature_build.py``, whose module doc gives the positions and the
self-conditioning."""

from __future__ import annotations

import torch

from ssdlib.engine.batching import pack_rows, slots_tensor, to_device
from ssdlib.engine.runner.compiled import checked_feature_step_draft
from ssdlib.engine.runner.kv_cache import KVCache
from ssdlib.engine.runner.static_inputs import batch_bucket
from ssdlib.engine.sampled_chain import draw_chain, fit_vocab
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.ops.row_top import row_argmax
from ssdlib.sampling import SamplingTensors, one_hot
from ssdlib.speculative.rng import RowStreams


class FeatureSpecDraft:
    """A feature draft as SSD's speculator holds it: its KV cache (slots and the tree scratch of
    ``tree_len`` branch positions), and per slot the output at the last position with a true
    feature (``last_logits`` [slots, V], ``last_hidden`` [slots, H]). The drafter interface the
    speculator's fallbacks call: ``prefill``, ``propose`` and ``valid``."""

    def __init__(self, draft, n_slots: int, max_len: int, vocab_size: int, tree_len: int,
                 device, dtype: torch.dtype, draws: int = 0, use_kernel: bool = False,
                 pool=None, compile_backend: str | None = None):
        self.draft = draft
        self.device = torch.device(device)
        cfg = draft.config
        self.cache = KVCache(cfg.num_hidden_layers, n_slots, draft.kv_heads_local, max_len,
                             cfg.head_dim, dtype, self.device, tree_len=tree_len)
        self.scratch_slot = n_slots - 1  # ghost rows of a captured step write here
        # the draft as the steps of fixed shape run it (a round's commit, chain steps, jit
        # drafts, tree depths): its layers under torch.compile with ``compile_backend``
        # (``compiled.checked_feature_step_draft``), else the plain draft, which an admission's
        # commit of a whole prompt always runs
        self.step_draft = draft if compile_backend is None else checked_feature_step_draft(
            draft, self.cache, self.scratch_slot, use_kernel, compile_backend)
        self.max_len = max_len
        self.vocab_size = vocab_size
        self.draws = draws  # draws a sampled row's stream gives up each jit draft (K)
        self.use_kernel = use_kernel
        self.pool = pool  # captured commits and greedy jit drafts (module doc); None: eager
        self._static: dict[tuple, dict[str, torch.Tensor]] = {}
        self.last_logits = torch.zeros(n_slots, vocab_size, dtype=torch.float32,
                                       device=self.device)
        self.last_hidden = torch.zeros(n_slots, cfg.hidden_size, dtype=dtype, device=self.device)
        # per slot: the hidden states a jit draft's steps left (its own features of the
        # positions of tokens 2 .. k, ``feature_build.py`` reads them) [slots, draws - 1, H]
        self.jit_hidden = torch.zeros(n_slots, max(draws - 1, 0), cfg.hidden_size, dtype=dtype,
                                      device=self.device)
        # per slot: the positions whose pairs hold the target's features (0 .. fed - 1)
        self.fed: dict[int, int] = {}
        # the speculator's fallbacks set it (a standalone drafter's lazily fed KV); the feature
        # draft's KV follows the OUTCOMEs' features instead
        self.valid: dict[int, int] = {}

    def prefill(self, rows) -> None:
        """A new sequence: nothing to feed before its first OUTCOME brings the prompt's
        features."""
        for r in rows:
            self.fed[r.slot] = 0

    @torch.inference_mode()
    def commit_features(self, rows, starts: list[int], counts: list[int],
                        values: torch.Tensor) -> None:
        """Feed the target's features of positions [start, start + count) of each row (row i's
        in ``values[i, :count]``, ``values`` [rows, P, W]): the pairs (f_t, x_{t+1}) into the
        slots' KV, and each row's output at its span's last position (L - 2) into
        ``last_logits`` / ``last_hidden``. Each span must continue the row's fed positions and
        end at L - 2. A round's spans (at most K + 1 positions) are one replay of a captured
        step with a graph pool; an admission's prompt goes eagerly."""
        if not rows:
            return
        for r, st, c in zip(rows, starts, counts):
            if c < 1 or st != self.fed.get(r.slot, 0) or st + c != len(r.tokens) - 1:
                raise RuntimeError(
                    f"features of positions [{st}, {st + c}) for slot {r.slot} with "
                    f"{len(r.tokens)} committed tokens and {self.fed.get(r.slot, 0)} fed: the "
                    f"leader and the speculator disagree on the row")
        ids, positions = pack_rows([r.tokens[st + 1:st + c + 1] for r, st, c in
                                    zip(rows, starts, counts)], starts)
        width = self.draws + 1
        if self.pool is not None and ids.shape[1] <= width and \
                int(positions[:, 0].max()) + width <= self.max_len:
            self._commit_captured(rows, ids, positions, counts, values, width)
        else:
            self._commit_eager(rows, ids, positions, counts, values)
        for r, st, c in zip(rows, starts, counts):
            self.fed[r.slot] = st + c

    def commit_body(self, ids, positions, slots, index, feats, kv_len: int,
                    use_kernel: bool, model=None) -> None:
        """The commit on device tensors: ids / positions [b, s], slots [b], index [b, 1] (each
        row's last real place), the target's features [b, s, W]; ``model``: the draft it runs
        (default ``step_draft``)."""
        model = self.step_draft if model is None else model
        meta = AttentionMetadata(positions, slots, kv_len, kv_limit=positions + 1,
                                 use_kernel=use_kernel)
        logits, hidden = model(ids, self.draft.condition(feats).to(self.cache.k.dtype),
                               self.cache, meta, index)
        self.last_logits[slots] = fit_vocab(logits[:, 0], self.vocab_size).float()
        self.last_hidden[slots] = hidden[:, 0].to(self.last_hidden.dtype)

    def _commit_eager(self, rows, ids, positions, counts, values) -> None:
        """An admission's prompt (or a span too long for the captured commit), eagerly: its
        attention through SDPA, never the slot kernel, whose launch parameters follow the query
        count, so that a new prompt length could compile a kernel variant in the middle of a
        run (one H200, SSD with the feature draft at T = 0.7 on HumanEval: 4 of 16 prompts
        waited 0.6-1.2 s in their first commit through the kernel, none in a second pass over
        them; through SDPA every first commit took 2-8 ms)."""
        dev = self.device
        positions = positions.clamp(max=self.max_len - 1)  # padding past the end: clamped
        s = ids.shape[1]
        feats = values[:, :s] if values.shape[1] >= s else \
            torch.nn.functional.pad(values, (0, 0, 0, s - values.shape[1]))
        self.commit_body(ids.to(dev, non_blocking=True), positions.to(dev, non_blocking=True),
                         slots_tensor(rows).to(dev, non_blocking=True),
                         to_device([[c - 1] for c in counts], dev), feats,
                         int(positions.max()) + 1, False, self.draft)

    def _commit_captured(self, rows, ids, positions, counts, values, width: int) -> None:
        """The commit as one replay of its batch bucket's step (rows padded to ``width``
        positions, whose KV lands past the row and is overwritten before it is read; ghost
        rows in the scratch slot)."""
        b, s = ids.shape
        bucket = batch_bucket(b)
        key = ("feature_commit", bucket, width)
        if key not in self._static:
            st = {"host": self._ghost_host(bucket, 2 * width + 2, width),
                  "feats": torch.zeros(bucket, width, values.shape[-1], dtype=values.dtype,
                                       device=self.device)}
            self._static[key] = st

            def body():
                h = st["host"]
                self.commit_body(h[:, :width], h[:, width:2 * width], h[:, 2 * width],
                                 h[:, 2 * width + 1:], st["feats"], self.max_len,
                                 self.use_kernel)
            self.pool.capture(key, body)
        st = self._static[key]
        host = self._ghost_host(bucket, 2 * width + 2, width, device="cpu")
        host[:b, :s] = ids
        host[:b, width:2 * width] = positions[:, :1] + torch.arange(width)
        host[:b, 2 * width] = slots_tensor(rows)
        host[:b, 2 * width + 1] = torch.tensor(counts) - 1
        st["host"].copy_(host.to(self.device, non_blocking=True))
        st["feats"][:b, :min(s, values.shape[1])].copy_(values[:, :s])
        self.pool.replay(key)

    def _ghost_host(self, bucket: int, width: int, positions: int, device=None) -> torch.Tensor:
        """A static input block [bucket, width] of ghost rows: ids 0, positions 0.., the
        scratch slot, index 0 (``positions`` ids, then as many positions, then slot, index)."""
        host = torch.zeros(bucket, width, dtype=torch.int64, device=device or self.device)
        host[:, positions:2 * positions] = torch.arange(positions, device=host.device)
        host[:, 2 * positions] = self.scratch_slot
        return host

    def step(self, tok: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
             slots: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One chain step: the pair (hidden [b, H], tok [b]) at ``pos`` [b] -> (logits [b, V]
        float32, hidden [b, H])."""
        p = pos.view(-1, 1)
        meta = AttentionMetadata(p, slots, kv_len, kv_limit=p + 1, use_kernel=self.use_kernel)
        logits, hidden = self.step_draft(tok.view(-1, 1), hidden.unsqueeze(1), self.cache, meta)
        return fit_vocab(logits[:, 0], self.vocab_size).float(), hidden[:, 0]

    def start_rows(self, rows) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(slots [b], position L - 1 of each row's first chain pair [b], key length) on the
        device, checking every row's features are committed up to L - 2."""
        self.check_committed(rows)
        slots = slots_tensor(rows).to(self.device, non_blocking=True)
        first = to_device([len(r.tokens) - 1 for r in rows], self.device)
        kv_len = min(max(len(r.tokens) for r in rows) + self.draws + 1, self.max_len)
        return slots, first, kv_len

    def check_committed(self, rows) -> None:
        """Every row's features are committed up to position L - 2."""
        for r in rows:
            if self.fed.get(r.slot, 0) != len(r.tokens) - 1:
                raise RuntimeError(f"slot {r.slot}: the target's features of its "
                                   f"{len(r.tokens)} committed tokens have not arrived")

    @torch.inference_mode()
    def propose(self, rows, k: int, want_q: bool = True):
        """A jit draft of k tokens a row from the slot's last output -> tokens [b, k] (device)
        and q [b, k, V] float32 (one-hot on greedy rows; None when every row is greedy and
        ``want_q`` is False). Sampled rows draw as SD's feature drafter does (draw j of the
        row's stream for token j, ``draws`` reserved); a greedy draft is one replay of a
        captured chain with a graph pool."""
        if k < 1:
            raise ValueError(f"a jit draft drafts at least one token, got k={k}")
        greedy = all(r.params.greedy for r in rows)
        if greedy and self.pool is not None:
            self.check_committed(rows)
            tokens = self._jit_captured(rows, k)
        else:
            tokens, qs = self._jit_eager(rows, k, greedy)
            if not greedy:
                return tokens, qs
        return tokens, (one_hot(tokens, self.vocab_size) if want_q else None)

    def _jit_body(self, slots, first, k: int, kv_len: int) -> torch.Tensor:
        """A greedy jit draft on device tensors -> tokens [b, k]."""
        logits, hidden = self.last_logits[slots], self.last_hidden[slots]
        tokens = []
        for j in range(k):
            tok = row_argmax(logits)
            tokens.append(tok)
            if j < k - 1:
                logits, hidden = self.jit_step(tok, hidden, first, j, slots, kv_len)
        return torch.stack(tokens, dim=1)

    def jit_step(self, tok, hidden, first, j: int, slots, kv_len: int):
        """Step j of a jit draft (its token j + 1 at position first + j): :meth:`step`, its
        hidden kept in ``jit_hidden`` (where the draws have room)."""
        logits, hidden = self.step(tok, hidden, first + j, slots, kv_len)
        if j < self.jit_hidden.shape[1]:
            self.jit_hidden[slots, j] = hidden.to(self.jit_hidden.dtype)
        return logits, hidden

    def _jit_captured(self, rows, k: int) -> torch.Tensor:
        b = len(rows)
        bucket = batch_bucket(b)
        key = ("feature_jit", bucket, k)
        if key not in self._static:
            host = torch.zeros(bucket, 2, dtype=torch.int64, device=self.device)
            host[:, 0], host[:, 1] = self.scratch_slot, 1
            st = {"host": host, "out": torch.zeros(bucket, k, dtype=torch.int64,
                                                   device=self.device)}
            self._static[key] = st
            self.pool.capture(key, lambda: st["out"].copy_(
                self._jit_body(st["host"][:, 0], st["host"][:, 1], k, self.max_len)))
        st = self._static[key]
        host = torch.zeros(bucket, 2, dtype=torch.int64)
        host[:, 0], host[:, 1] = self.scratch_slot, 1  # ghost rows: the scratch slot
        host[:b, 0] = slots_tensor(rows)
        host[:b, 1] = torch.tensor([len(r.tokens) - 1 for r in rows])
        st["host"].copy_(host.to(self.device, non_blocking=True))
        self.pool.replay(key)
        return st["out"][:b].clone()

    def _jit_eager(self, rows, k: int, greedy: bool):
        slots, first, kv_len = self.start_rows(rows)
        if greedy:
            return self._jit_body(slots, first, k, kv_len), None
        host = [r.params for r in rows]
        params = SamplingTensors.from_params(host, self.device)
        keys = RowStreams.reserve_host([r.stream for r in rows], max(k, self.draws))
        keys = keys.to(self.device, non_blocking=True)
        u = RowStreams(keys[:, 0], keys[:, 1], k).uniforms(k)
        state = [self.last_hidden[slots]]  # the chain's last h

        def step(tok: torch.Tensor, j: int) -> torch.Tensor:
            logits, state[0] = self.jit_step(tok, state[0], first, j, slots, kv_len)
            return logits
        return draw_chain(self.last_logits[slots], k, self.vocab_size, params, u, step)
