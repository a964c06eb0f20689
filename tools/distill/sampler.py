"""A plain batched sampler over ssdlib's Llama with its slot KV cache (for making training data).

Rows of a batch are right-padded prompts: padded positions write junk KV beyond a row's length,
which is overwritten by that row's own decode steps before any query can see it (a query at
position p attends to keys <= p only). Finished rows keep stepping until the whole batch is done;
their extra tokens are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ssdlib.engine.kv_cache import KVCache
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.models.llama import LlamaForCausalLM


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                gen: torch.Generator | None) -> torch.Tensor:
    """logits [b, V] -> token ids [b]; temperature 0 is greedy; top-p keeps the smallest set of
    tokens whose probability reaches ``top_p``."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def generate(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float, top_p: float = 1.0, stop_ids: Sequence[int] = (),
             gen: torch.Generator | None = None, batch_size: int = 64,
             on_batch: Callable[[int], None] | None = None) -> list[tuple[list[int], bool]]:
    """Sample a continuation for every prompt.

    Returns, in prompt order, ``(new_token_ids, stopped)``: the new tokens include the stop token
    when one was sampled (``stopped`` is then True). ``on_batch(n)`` is called after each batch of
    ``n`` prompts (progress bars).
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cfg = model.config
    stops = torch.tensor(sorted(set(stop_ids)) or [-1], device=device)
    # batches of similar lengths pad less; results go back to prompt order
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        chunk = [list(prompts[i]) for i in rows]
        b = len(chunk)
        lens = torch.tensor([len(p) for p in chunk], device=device)
        longest = int(lens.max())
        cache = KVCache(cfg.num_hidden_layers, b, model.kv_heads_local,
                        longest + max_new_tokens + 1, cfg.head_dim, dtype, device)
        ids = torch.zeros(b, longest, dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, :len(p)] = torch.tensor(p)
        ids = ids.to(device)
        slots = torch.arange(b, device=device)
        positions = torch.arange(longest, device=device).expand(b, longest)
        logits = model(ids, cache, AttentionMetadata.build(positions, slots),
                       logits_index=(lens - 1).view(b, 1))[:, 0]  # [b, V]
        out = torch.zeros(b, max_new_tokens, dtype=torch.long, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        n_new = torch.full((b,), max_new_tokens, device=device)
        keys = torch.arange(longest + max_new_tokens, device=device).view(1, 1, 1, -1)
        for t in range(max_new_tokens):
            tok = sample_next(logits, temperature, top_p, gen)
            out[:, t] = tok
            hit = torch.isin(tok, stops) & ~done
            n_new = torch.where(hit, t + 1, n_new)
            done |= hit
            # reading `done` waits for the GPU: only every few steps, so launches run ahead
            if t + 1 == max_new_tokens or (t % 16 == 15 and bool(done.all())):
                break
            pos = (lens + t).view(b, 1)  # [b, 1]
            # Built here rather than by AttentionMetadata.build, which reads values back. Keys
            # span the whole cache at every step (the mask hides the future): one attention
            # shape for the whole loop, so GPU attention backends plan once.
            meta = AttentionMetadata(positions=pos, slots=slots, kv_len=keys.shape[-1],
                                     kv_limit=pos + 1, slot_start=0)
            logits = model(tok.view(b, 1), cache, meta)[:, 0]
        out, n_new, done = out.cpu(), n_new.cpu(), done.cpu()
        for i, row in enumerate(rows):
            results[row] = (out[i, :int(n_new[i])].tolist(), bool(done[i]))
        if on_batch is not None:
            on_batch(b)
    return results
