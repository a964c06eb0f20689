"""One model shard plus its KV cache on one rank, and the forwards the engine needs."""

from __future__ import annotations

import torch

from ssdlib.engine.kv_cache import KVCache
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.loading.checkpoint import Checkpoint
from ssdlib.models.llama import LlamaForCausalLM

# Positions past max_len that padded rows of a batched forward may write to (never read).
POSITION_SLACK = 64
# Attention key lengths are rounded up to this many positions (see AttentionMetadata.build).
KV_BUCKET = 128


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint, tp_group, device: torch.device,
                 dtype: torch.dtype, n_slots: int, max_len: int, tree_len: int = 0):
        config = checkpoint.config
        self.config = config
        self.device = device
        self.max_len = max_len
        alloc = max_len + POSITION_SLACK
        with torch.device(device):
            model = LlamaForCausalLM(config, tp_group, max_positions=alloc)
        for p in model.parameters():
            p.data = p.data.to(dtype)
        model.load_weights(checkpoint.weights)
        self.model = model.eval().requires_grad_(False)
        self.cache = KVCache(config.num_hidden_layers, n_slots, model.kv_heads_local, alloc,
                             config.head_dim, dtype, device, tree_len)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids/positions: [b, s]; slots: [b] -> logits [b, s or n, V] (float32)."""
        meta = AttentionMetadata.build(positions, slots, KV_BUCKET, self.cache.max_len)
        return self.model(input_ids, self.cache, meta, logits_index).float()

    @torch.inference_mode()
    def tree_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     tree_index: torch.Tensor, kv_len: int, tree_len: int,
                     mask: torch.Tensor) -> torch.Tensor:
        """One tree-decode step: input_ids/positions/tree_index [b, s] (s = branches),
        mask [b, 1, s, kv_len + tree_len] -> logits [b, s, V] (float32)."""
        meta = AttentionMetadata(positions, slots, kv_len, mask, None, tree_index, tree_len)
        return self.model(input_ids, self.cache, meta).float()
