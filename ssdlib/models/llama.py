"""Llama, composed from ssdlib layers. One implementation for target and draft, TP or not.

The model calls no collectives itself: the parallel layers do, on the ``tp_group`` they are given.
Module names match Hugging Face checkpoints, so loading is a walk over names.
"""

from __future__ import annotations

import torch
from torch import nn

from ssdlib.config import ModelConfig
from ssdlib.errors import CheckpointError
from ssdlib.layers.activation import SiluAndMul
from ssdlib.layers.attention import AttentionMetadata, CachedAttention
from ssdlib.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ssdlib.layers.linear import ColumnParallelLinear, RowParallelLinear, tp_size_rank
from ssdlib.layers.norm import RMSNorm
from ssdlib.layers.rotary import RotaryEmbedding


def head_layout(config: ModelConfig, tp: int) -> tuple[int, int]:
    """(padded query heads, padded KV heads) so that KV heads divide evenly over ``tp`` ranks.

    KV heads are padded up to a multiple of tp with zero heads; each padded KV head gets its own
    group of zero query heads, so GQA grouping of the real heads is unchanged.
    """
    kv = -(-config.num_key_value_heads // tp) * tp
    return kv * config.num_queries_per_kv, kv


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp_group, rotary: RotaryEmbedding):
        super().__init__()
        tp, _ = tp_size_rank(tp_group)
        hd = config.head_dim
        q_heads, kv_heads = head_layout(config, tp)
        self.q_local, self.kv_local, self.head_dim = q_heads // tp, kv_heads // tp, hd
        h = config.hidden_size
        self.q_proj = ColumnParallelLinear(h, q_heads * hd, tp_group,
                                           config.num_attention_heads * hd)
        self.k_proj = ColumnParallelLinear(h, kv_heads * hd, tp_group,
                                           config.num_key_value_heads * hd)
        self.v_proj = ColumnParallelLinear(h, kv_heads * hd, tp_group,
                                           config.num_key_value_heads * hd)
        self.o_proj = RowParallelLinear(q_heads * hd, h, tp_group, config.num_attention_heads * hd)
        self.rotary = rotary
        self.attn = CachedAttention(self.q_local, self.kv_local, hd)

    def forward(self, x, k_cache, v_cache, meta: AttentionMetadata, tree_k=None, tree_v=None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.q_local, self.head_dim)
        k = self.k_proj(x).view(b, s, self.kv_local, self.head_dim)
        v = self.v_proj(x).view(b, s, self.kv_local, self.head_dim)
        q, k = self.rotary(meta.positions, q, k)
        return self.o_proj(self.attn(q, k, v, k_cache, v_cache, meta, tree_k, tree_v))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp_group):
        super().__init__()
        tp, _ = tp_size_rank(tp_group)
        h, inter = config.hidden_size, config.intermediate_size
        padded = -(-inter // tp) * tp
        self.gate_proj = ColumnParallelLinear(h, padded, tp_group, inter)
        self.up_proj = ColumnParallelLinear(h, padded, tp_group, inter)
        self.down_proj = RowParallelLinear(padded, h, tp_group, inter)
        self.act = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp_group, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp_group, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp_group)

    def forward(self, x, k_cache, v_cache, meta, tree_k=None, tree_v=None):
        x = x + self.self_attn(self.input_layernorm(x), k_cache, v_cache, meta, tree_k, tree_v)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp_group, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group)
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                 config.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp_group, rotary)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, kv_cache, meta):
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            if kv_cache is None:
                x = layer(x, None, None, meta)
            else:
                k, v, tree_k, tree_v = kv_cache.layer(i)
                x = layer(x, k, v, meta, tree_k, tree_v)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp_group=None, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.model = LlamaModel(config, tp_group, max_positions or config.max_position_embeddings)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_group, tied)

    @property
    def kv_heads_local(self) -> int:
        return self.model.layers[0].self_attn.kv_local

    def forward(self, input_ids: torch.Tensor, kv_cache, meta: AttentionMetadata,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [b, s] -> logits [b, s, V], or [b, n, V] at ``logits_index`` [b, n]."""
        hidden = self.model(input_ids, kv_cache, meta)
        if logits_index is not None:
            hidden = hidden.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        return self.lm_head(hidden)

    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward (training, scoring): input_ids [b, s] -> logits [b, s, V]."""
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).expand(b, s)
        meta = AttentionMetadata(positions, None, s, None)
        return self.lm_head(self.model(input_ids, None, meta))

    def load_weights(self, weights) -> None:
        """Each parallel layer reads its own shard of its HF-named tensor."""
        for name, module in self.named_modules():
            if module is self or not hasattr(module, "load"):
                continue
            if isinstance(module, ParallelLMHead) and module.tied is not None:
                continue
            tensor = name + ".weight"
            expected = module.checkpoint_shape
            found = tuple(weights.shape(tensor))
            if found != expected:
                raise CheckpointError(f"tensor {tensor}: shape {found} does not match the config "
                                      f"(expected {expected})")
            module.load(weights, tensor)
