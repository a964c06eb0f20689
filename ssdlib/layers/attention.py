"""Attention over the slot KV cache (torch SDPA: plain math on CPU, fused kernels on GPU).

Each forward writes the new K/V at their positions, then attends over keys [0, kv_len) of the
sequence's slot with a per-position causal mask (a query at position p sees keys <= p). The same
mask handles prefill, one-token decode and the K+1-position verification forward, with rows of
different lengths in one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """Per-forward attention inputs, shared by all layers."""

    positions: torch.Tensor  # [b, s] int64, logical position of each new token
    slots: torch.Tensor  # [b] int64, KV slot of each row
    kv_len: int  # keys [0, kv_len) are read; >= max(positions) + 1
    mask: torch.Tensor  # [b, 1, s, kv_len] bool, True = may attend
    slot_start: int | None = None  # rows use slots slot_start.. contiguously (no gather needed)
    # Tree-decode mode (speculator branches): new K/V go to the tree scratch region at
    # tree_index [b, s] instead of the slot; keys = slot [0, kv_len) ++ tree [0, tree_len);
    # mask is then [b, 1, s, kv_len + tree_len].
    tree_index: torch.Tensor | None = None
    tree_len: int = 0
    rope: tuple | None = None  # (cos, sin) for ``positions``, set by the model once per forward

    @classmethod
    def build(cls, positions: torch.Tensor, slots: torch.Tensor, kv_bucket: int = 1,
              kv_limit: int | None = None) -> "AttentionMetadata":
        """Causal-by-position metadata. The key length is rounded up to a multiple of
        ``kv_bucket`` (capped at ``kv_limit``) so attention sees few distinct shapes: fused GPU
        attention backends plan per shape, and a new length every step is slow."""
        kv_len = int(positions.max().item()) + 1
        if kv_bucket > 1:
            kv_len = -(-kv_len // kv_bucket) * kv_bucket
            if kv_limit is not None:
                kv_len = min(kv_len, kv_limit)
        keys = torch.arange(kv_len, device=positions.device)
        mask = (keys.view(1, 1, 1, -1) <= positions.view(positions.shape[0], 1, -1, 1))
        slot_list = slots.tolist()
        contiguous = slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list)))
        return cls(positions, slots, kv_len, mask, slot_list[0] if contiguous else None)


class CachedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, tree_k: torch.Tensor | None = None,
                tree_v: torch.Tensor | None = None) -> torch.Tensor:
        """q: [b, s, hq, hd]; k, v: [b, s, hkv, hd]; caches [slots, hkv, L, hd] -> [b, s, hq*hd].

        In tree mode the slot is read-only; tree_k/tree_v [slots, hkv, T, hd] receive the new K/V.
        """
        b, s = q.shape[:2]
        if k_cache is None:  # training / scoring: plain causal attention over these tokens
            out = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
            return out.transpose(1, 2).reshape(b, s, -1)
        rows = meta.slots.view(-1, 1)
        if meta.tree_index is not None:
            return self._tree(q, k, v, k_cache, v_cache, tree_k, tree_v, meta)
        k_cache[rows, :, meta.positions] = k
        v_cache[rows, :, meta.positions] = v
        if meta.slot_start is not None:
            keys = k_cache[meta.slot_start:meta.slot_start + b, :, :meta.kv_len]
            values = v_cache[meta.slot_start:meta.slot_start + b, :, :meta.kv_len]
        else:
            keys = k_cache[meta.slots, :, :meta.kv_len]
            values = v_cache[meta.slots, :, :meta.kv_len]
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=meta.mask, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)  # [b, hq, s, hd]
        return out.transpose(1, 2).reshape(b, s, -1)

    def _tree(self, q, k, v, k_cache, v_cache, tree_k, tree_v, meta):
        b, s = q.shape[:2]
        rows = meta.slots.view(-1, 1)
        tree_k[rows, :, meta.tree_index] = k
        tree_v[rows, :, meta.tree_index] = v
        # shared prefix and the row's branch tokens, one softmax over both (concatenated keys)
        keys = torch.cat([k_cache[meta.slots, :, :meta.kv_len],
                          tree_k[meta.slots, :, :meta.tree_len]], dim=2)
        values = torch.cat([v_cache[meta.slots, :, :meta.kv_len],
                            tree_v[meta.slots, :, :meta.tree_len]], dim=2)
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=meta.mask, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).reshape(b, s, -1)
