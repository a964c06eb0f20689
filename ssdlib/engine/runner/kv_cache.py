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
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 tree_len: int = 0, features_dim: int = 0,
                 feature_layers: tuple[int, ...] = ()):
        shape = (num_layers, n_slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # The speculator's branch scratch: [layers, slots, kv_heads, B*K, head_dim], fixed size.
        tree_shape = (num_layers, n_slots, kv_heads, tree_len, head_dim)
        self.tree_k = torch.zeros(tree_shape, dtype=dtype, device=device) if tree_len else None
        self.tree_v = torch.zeros(tree_shape, dtype=dtype, device=device) if tree_len else None
        # with ``features_dim``: the outputs (before any final norm) of the model's decoder layers
        # ``feature_layers`` concatenated, at every fed position, per slot
        # [n_slots, max_len, features_dim] (a feature draft's input: ssdlib.models.feature_spec)
        if bool(features_dim) != bool(feature_layers):
            raise ValueError(f"a feature buffer needs both its width and its layers, got "
                             f"features_dim={features_dim}, feature_layers={feature_layers!r}")
        self.features = (torch.zeros((n_slots, max_len, features_dim), dtype=dtype, device=device)
                         if features_dim else None)
        self.feature_layers = tuple(feature_layers)
        self.n_slots = n_slots
        self.max_len = max_len

    def layer(self, i: int):
        """(k, v, tree_k, tree_v) of layer i; the tree pair is None without a tree region."""
        if self.tree_k is None:
            return self.k[i], self.v[i], None, None
        return self.k[i], self.v[i], self.tree_k[i], self.tree_v[i]
