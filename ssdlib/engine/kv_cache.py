"""Slot-based KV cache: one slot per running sequence, preallocated once.

Layout per layer: [n_slots, kv_heads_local, max_len, head_dim]. A sequence's length is owned by
the engine (it is just a number): rollback after a rejection moves that number and copies nothing;
positions beyond it hold stale KV that is overwritten before it can be attended to, because a query
at position p only sees keys at positions <= p.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, n_slots: int, kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, n_slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_slots = n_slots
        self.max_len = max_len

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]
