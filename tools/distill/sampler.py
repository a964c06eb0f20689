"""A plain batched sampler over ssdlib's Llama with its slot KV cache (for making training data).

Rows of a batch are right-padded prompts: padded positions write junk KV beyond a row's length,
which is overwritten by that row's own decode steps before any query can see it (a query at
position p attends to keys <= p only). Finished rows keep stepping until the next check (every
``CHECK_EVERY`` steps, one host sync), where they leave the batch: later steps run only the rows
still going; their extra tokens are dropped.

Where the time goes, and what keeps it down (none of it changes what is sampled: each row's next
token is drawn from the target's own distribution at that row's temperature and top-p):

* prompts run in chunks of about ``PREFILL_TOKENS`` tokens (bounded prefill activations, so a
  large batch fits);
* decode steps read keys only up to the longest live length (rounded up to ``KV_BUCKET``), not
  the whole cache; on CUDA with Triton the engine's in-place slot-attention kernel reads each
  row's keys below its own limit (no per-step copy of the key span);
* rows that finished leave the batch at each check (the cache is not copied: the remaining rows
  keep their slots), and the batch stops when every row is done;
* an optional ``deadline`` (time.monotonic) stops sampling: rows keep what they have (a prefix
  of a target sample), batches not yet started return nothing;
* ``graphs=True`` (opt-in; not measured on a GPU yet) runs each decode forward as a captured
  CUDA graph (:class:`DecodeGraphs`; plain calls on a CPU), since an eager step of a small model
  costs its kernel launches, not its arithmetic. One KV cache then serves every batch, and the
  live rows are padded up to a few row counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ssdlib.engine.runner.kv_cache import KVCache
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.models.llama import LlamaForCausalLM
from ssdlib.ops.graph_pool import make_graph_pool

PREFILL_TOKENS = 1 << 17  # rows x padded prompt length per prefill forward
KV_BUCKET = 64  # decode key spans are rounded up to this (few distinct attention shapes)
CHECK_EVERY = 16  # steps between host syncs (finished rows leave, all-done stops)
GRAPH_ROWS_MIN = 8  # DecodeGraphs' smallest row count; then x4 up to the cache's slots


def sample_next(logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float,
                gen: torch.Generator | None) -> torch.Tensor:
    """logits [b, V] -> token ids [b]; temperature 0 is greedy; top-p keeps the smallest set of
    tokens whose probability reaches ``top_p``. ``temperature`` may be a tensor [b] (one per
    row; rows at <= 0 take the argmax)."""
    per_row = isinstance(temperature, torch.Tensor)
    if not per_row and temperature <= 0:
        return logits.argmax(-1)
    if per_row:
        greedy = temperature <= 0
        temp = torch.where(greedy, torch.ones_like(temperature), temperature).view(-1, 1)
    else:
        temp = temperature
    probs = torch.softmax(logits.float() / temp, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    sampled = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return torch.where(greedy, logits.argmax(-1), sampled) if per_row else sampled


def slot_kernel_available(device: torch.device) -> bool:
    """The engine's in-place attention kernel serves this device (CUDA with Triton)."""
    if device.type != "cuda":
        return False
    from ssdlib.engine.runner.model_runner import use_slot_kernel

    return use_slot_kernel(device)


class DecodeGraphs:
    """The sampler's decode forward as captured steps keyed by (rows, kv_len), over one KV cache
    for all batches (``make_graph_pool``: CUDA graphs, or plain calls on a CPU).

    Rows come in a few counts (GRAPH_ROWS_MIN, x4, ..., the cache's slots): the live rows go
    first and the rest are padding, which steps at position 0 of slots no live row uses (rows
    that finished, or slots this batch does not fill) and whose logits are dropped. A finished
    row's KV is never read again and an unused slot is written by the next batch's prefill, so
    the padding changes no sample.
    """

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, use_kernel: bool):
        self.model, self.cache, self.use_kernel = model, cache, use_kernel
        device = cache.k.device
        self.pool = make_graph_pool(device)
        self.counts = []
        n = GRAPH_ROWS_MIN
        while n < cache.n_slots:
            self.counts.append(n)
            n *= 4
        self.counts.append(cache.n_slots)
        self._bufs: dict[int, dict[str, torch.Tensor]] = {}
        self._logits: dict[tuple[int, int], torch.Tensor] = {}
        self.rows = 0  # the row count of the live set (set_live)
        self.n_live = 0

    def _buffers(self, rows: int) -> dict[str, torch.Tensor]:
        if rows not in self._bufs:
            z = dict(dtype=torch.long, device=self.cache.k.device)
            self._bufs[rows] = {"tok": torch.zeros(rows, 1, **z), "pos": torch.zeros(rows, 1, **z),
                                "slots": torch.zeros(rows, **z), "lim": torch.ones(rows, 1, **z)}
        return self._bufs[rows]

    def set_live(self, live: torch.Tensor) -> None:
        """The slots stepping from now on (a host sync when padding is needed: call it where the
        sampler reads back anyway)."""
        n = int(live.numel())
        rows = next(c for c in self.counts if c >= n)
        buf = self._buffers(rows)
        buf["slots"][:n] = live
        if rows > n:
            free = torch.ones(self.cache.n_slots, dtype=torch.bool, device=live.device)
            free[live] = False
            buf["slots"][n:] = free.nonzero().squeeze(-1)[:rows - n]
            buf["tok"][n:] = 0
            buf["pos"][n:] = 0
            buf["lim"][n:] = 1
        self.rows, self.n_live = rows, n

    def step(self, tok: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Next-token logits [n_live, V] for the live rows' tokens ``tok`` [n] at ``pos`` [n, 1]."""
        n, rows = self.n_live, self.rows
        buf = self._buffers(rows)
        buf["tok"][:n, 0] = tok
        buf["pos"][:n] = pos
        buf["lim"][:n] = pos + 1
        key = (rows, kv_len)
        if not self.pool.has(key):
            def run(key=key, buf=buf):
                meta = AttentionMetadata(positions=buf["pos"], slots=buf["slots"], kv_len=key[1],
                                         kv_limit=buf["lim"], use_kernel=self.use_kernel,
                                         kernel_backend="triton")
                self._logits[key] = self.model(buf["tok"], self.cache, meta)[:, 0]
            self.pool.capture(key, run)
        self.pool.replay(key)
        return self._logits[key][:n]


def _add(stats: dict | None, **kw) -> None:
    if stats is not None:
        for k, v in kw.items():
            stats[k] = stats.get(k, 0) + v


@torch.no_grad()
def generate(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float | Sequence[float], top_p: float = 1.0,
             stop_ids: Sequence[int] = (), gen: torch.Generator | None = None,
             batch_size: int = 64, on_batch: Callable[[int], None] | None = None,
             deadline: float | None = None, stats: dict | None = None,
             use_kernel: bool | None = None,
             graphs: bool = False) -> list[tuple[list[int], bool]]:
    """Sample a continuation for every prompt.

    Returns, in prompt order, ``(new_token_ids, stopped)``: the new tokens include the stop token
    when one was sampled (``stopped`` is then True). ``temperature`` is one value or one per
    prompt. ``on_batch(n)`` is called after each batch of ``n`` prompts (progress bars).
    ``deadline``: see the module doc. ``stats`` (a dict) accumulates batches, skipped prompts,
    decode forwards, row-steps, new tokens and seconds. ``use_kernel``: the slot-attention
    kernel for decode steps (default: where available). ``graphs``: decode forwards as captured
    steps (:class:`DecodeGraphs`; the samples are the same as without).
    """
    t_start = time.perf_counter()
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cfg = model.config
    if use_kernel is None:
        use_kernel = slot_kernel_available(device)
    per_row = not isinstance(temperature, (int, float))
    if per_row:
        temps_all = [float(t) for t in temperature]
        if len(temps_all) != len(prompts):
            raise ValueError(f"{len(temps_all)} temperatures for {len(prompts)} prompts")
    stops = torch.tensor(sorted(set(stop_ids)) or [-1], device=device)
    # batches of similar lengths pad less; results go back to prompt order
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
    steps = None
    if graphs and prompts:  # one cache for every batch: the captured steps read it
        longest_all = max(len(p) for p in prompts)
        shared_len = -(-(longest_all + max_new_tokens + 1) // KV_BUCKET) * KV_BUCKET
        shared = KVCache(cfg.num_hidden_layers, min(batch_size, len(prompts)),
                         model.kv_heads_local, shared_len, cfg.head_dim, dtype, device)
        steps = DecodeGraphs(model, shared, use_kernel)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        b = len(rows)
        if deadline is not None and time.monotonic() >= deadline:
            _add(stats, skipped=b)
            if on_batch is not None:
                on_batch(b)
            continue
        chunk = [list(prompts[i]) for i in rows]
        lens = torch.tensor([len(p) for p in chunk], device=device)
        longest = max(len(p) for p in chunk)
        if steps is not None:
            cache, cache_len = steps.cache, steps.cache.max_len
        else:
            cache_len = longest + max_new_tokens + 1
            cache = KVCache(cfg.num_hidden_layers, b, model.kv_heads_local, cache_len,
                            cfg.head_dim, dtype, device)
        ids = torch.zeros(b, longest, dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, :len(p)] = torch.tensor(p)
        ids = ids.to(device)
        slots = torch.arange(b, device=device)
        temps: float | torch.Tensor = temperature if not per_row else torch.tensor(
            [temps_all[i] for i in rows], device=device)
        # prefill in row chunks (each a view of its slots: slot_start)
        per = max(1, PREFILL_TOKENS // longest)
        parts = []
        for r0 in range(0, b, per):
            r1 = min(b, r0 + per)
            pos = torch.arange(longest, device=device).expand(r1 - r0, longest)
            meta = AttentionMetadata(positions=pos, slots=slots[r0:r1], kv_len=longest,
                                     kv_limit=pos + 1, slot_start=r0)
            parts.append(model(ids[r0:r1], cache, meta,
                               logits_index=(lens[r0:r1] - 1).view(-1, 1))[:, 0])
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]  # [b, V]
        del parts
        out = torch.zeros(b, max_new_tokens, dtype=torch.long, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        n_new = torch.full((b,), max_new_tokens, device=device)
        live = slots  # batch rows still stepping (their slots: row i owns slot i)
        n_live, forwards, row_steps = b, 0, 0
        if steps is not None:
            steps.set_live(live)
        for t in range(max_new_tokens):
            tok = sample_next(logits, temps, top_p, gen)
            out[live, t] = tok
            hit = torch.isin(tok, stops) & ~done[live]
            n_new[live] = torch.where(hit, t + 1, n_new[live])
            done[live] = done[live] | hit
            if t + 1 == max_new_tokens:
                break
            # reading `done` waits for the GPU: only every few steps, so launches run ahead
            if t % CHECK_EVERY == CHECK_EVERY - 1:
                keep = ~done[live]
                n_keep = int(keep.sum())
                if n_keep == 0:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    n_new = torch.where(done, n_new, t + 1)  # what they have is a prefix
                    break
                if n_keep < n_live:  # finished rows leave the batch
                    idx = keep.nonzero().squeeze(-1)
                    live, tok, n_live = live[idx], tok[idx], n_keep
                    if per_row:
                        temps = temps[idx]
                    if steps is not None:
                        steps.set_live(live)
            pos = (lens[live] + t).view(n_live, 1)  # [n, 1]
            # Built here rather than by AttentionMetadata.build, which reads values back. Keys
            # span up to the longest row (prompt + tokens so far), in buckets; the mask (or the
            # kernel's per-row limit) hides the rest.
            kv_len = min(cache_len, -(-(longest + t + 1) // KV_BUCKET) * KV_BUCKET)
            forwards += 1
            row_steps += n_live
            if steps is not None:
                logits = steps.step(tok, pos, kv_len)
            else:
                meta = AttentionMetadata(positions=pos, slots=live, kv_len=kv_len,
                                         kv_limit=pos + 1, slot_start=0 if n_live == b else None,
                                         use_kernel=use_kernel, kernel_backend="triton")
                logits = model(tok.view(n_live, 1), cache, meta)[:, 0]
        out, n_new, done = out.cpu(), n_new.cpu(), done.cpu()
        for i, row in enumerate(rows):
            results[row] = (out[i, :int(n_new[i])].tolist(), bool(done[i]))
        _add(stats, batches=1, forwards=forwards, row_steps=row_steps,
             new_tokens=int(n_new.sum()))
        del cache, logits
        if on_batch is not None:
            on_batch(b)
    _add(stats, seconds=time.perf_counter() - t_start)
    return results
