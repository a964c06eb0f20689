"""Llama, composed from ssdlib layers. One implementation for target and draft, TP or not.

The model calls no collectives itself: the parallel layers do, on the ``tp_group`` they are given.
Module names match Hugging Face checkpoints, so loading is a walk over names.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from ssdlib.config import ModelConfig
from ssdlib.errors import CheckpointError
from ssdlib.layers.activation import SiluAndMul
from ssdlib.layers.attention import AttentionMetadata, CachedAttention
from ssdlib.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ssdlib.layers.linear import MergedColumnParallelLinear, RowParallelLinear, tp_size_rank
from ssdlib.layers.norm import RMSNorm
from ssdlib.layers.rotary import RotaryEmbedding, apply_rotary


def head_layout(config: ModelConfig, tp: int) -> tuple[int, int]:
    """(padded query heads, padded KV heads) so that KV heads divide evenly over ``tp`` ranks.

    KV heads are padded up to a multiple of tp with zero heads; each padded KV head gets its own
    group of zero query heads, so GQA grouping of the real heads is unchanged.
    """
    kv = -(-config.num_key_value_heads // tp) * tp
    return kv * config.num_queries_per_kv, kv


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp_group):
        super().__init__()
        tp, _ = tp_size_rank(tp_group)
        hd = config.head_dim
        q_heads, kv_heads = head_layout(config, tp)
        self.q_local, self.kv_local, self.head_dim = q_heads // tp, kv_heads // tp, hd
        h = config.hidden_size
        real_kv = config.num_key_value_heads * hd
        self.qkv_proj = MergedColumnParallelLinear(h, [
            ("q_proj", q_heads * hd, config.num_attention_heads * hd),
            ("k_proj", kv_heads * hd, real_kv),
            ("v_proj", kv_heads * hd, real_kv)], tp_group)
        self.o_proj = RowParallelLinear(q_heads * hd, h, tp_group, config.num_attention_heads * hd)
        self.attn = CachedAttention(self.q_local, self.kv_local, hd)

    def forward(self, x, k_cache, v_cache, meta: AttentionMetadata, tree_k=None, tree_v=None):
        b, s, _ = x.shape
        q, k, v = self.qkv_proj(x)
        q = q.view(b, s, self.q_local, self.head_dim)
        k = k.view(b, s, self.kv_local, self.head_dim)
        v = v.view(b, s, self.kv_local, self.head_dim)
        q, k = apply_rotary(q, k, *meta.rope)
        return self.o_proj(self.attn(q, k, v, k_cache, v_cache, meta, tree_k, tree_v))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp_group):
        super().__init__()
        tp, _ = tp_size_rank(tp_group)
        h, inter = config.hidden_size, config.intermediate_size
        padded = -(-inter // tp) * tp
        self.gate_up_proj = MergedColumnParallelLinear(
            h, [("gate_proj", padded, inter), ("up_proj", padded, inter)], tp_group)
        self.down_proj = RowParallelLinear(padded, h, tp_group, inter)
        self.act = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act(*self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp_group):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp_group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp_group)

    def forward(self, x, k_cache, v_cache, meta, tree_k=None, tree_v=None):
        x = x + self.self_attn(self.input_layernorm(x), k_cache, v_cache, meta, tree_k, tree_v)
        return x + self.mlp(self.post_attention_layernorm(x))


def run_layers(layers, rotary: RotaryEmbedding, x: torch.Tensor, kv_cache,
               meta: AttentionMetadata, window: int | None = None) -> torch.Tensor:
    """Decoder ``layers`` over x [b, s, H] at ``meta.positions`` (with ``kv_cache``, or cache-free
    when it is None) -> the last layer's output [b, s, H], before any final norm. RoPE and the
    attention mask (a sliding ``window``, if the model has one) are computed once per forward,
    for all layers."""
    return run_layers_keeping(layers, rotary, x, kv_cache, meta, window)[0]


def run_layers_keeping(layers, rotary: RotaryEmbedding, x: torch.Tensor, kv_cache,
                       meta: AttentionMetadata, window: int | None = None,
                       keep: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``run_layers``, also returning the outputs [b, s, H] of the layers ``keep`` (indices, in
    that order)."""
    if any(not 0 <= i < len(layers) for i in keep):
        raise ValueError(f"layers {list(keep)} to keep: the model has layers 0..{len(layers) - 1}")
    cos, sin = rotary.cos_sin(meta.positions)
    meta.rope = (cos.to(x.dtype), sin.to(x.dtype))
    meta.window = window
    meta.prepare()
    kept: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        if kv_cache is None:
            x = layer(x, None, None, meta)
        else:
            k, v, tree_k, tree_v = kv_cache.layer(i)
            x = layer(x, k, v, meta, tree_k, tree_v)
        if i in keep:
            kept[i] = x
    return x, [kept[i] for i in keep]


def concat_features(parts: list[torch.Tensor]) -> torch.Tensor:
    """Layer outputs [b, s, H] each -> one feature [b, s, len(parts) * H] (one part: itself)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def load_named_weights(model: nn.Module, weights) -> None:
    """Each module of ``model`` that names its checkpoint tensors reads them (its own shard),
    after every tensor's shape is checked against the model: a mismatch is a CheckpointError."""
    loadable = [(name, m) for name, m in model.named_modules()
                if m is not model and hasattr(m, "checkpoint_tensors")]
    for name, module in loadable:
        for tensor, expected in module.checkpoint_tensors(name):
            found = tuple(weights.shape(tensor))
            if found != expected:
                raise CheckpointError(f"tensor {tensor}: shape {found} does not match the "
                                      f"config (expected {expected})")
    for name, module in loadable:
        module.load(weights, name)


def hf_named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters under Hugging Face names (merged projections split), for export.
    Only meaningful for an unsharded (tp = 1) model."""
    merged = {name: m for name, m in model.named_modules()
              if isinstance(m, MergedColumnParallelLinear)}
    out = {}
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        if owner in merged:
            out.update(merged[owner].hf_tensors(owner))
        else:
            out[name] = p
    return out


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp_group, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group)
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                      config.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp_group)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sliding_window = config.sliding_window

    def forward(self, input_ids, kv_cache, meta):
        keeps = kv_cache is not None and kv_cache.features is not None
        x, kept = self.run(input_ids, kv_cache, meta, kv_cache.feature_layers if keeps else ())
        if keeps:
            # the features of the fed positions, kept per slot like the KV (a feature draft
            # reads them: ``ssdlib.engine.feature_drafter``): the chosen layers' outputs,
            # concatenated in the forward that computes them anyway
            kv_cache.features[meta.slots.view(-1, 1), meta.positions] = concat_features(kept)
        return self.norm(x)

    def run(self, input_ids, kv_cache, meta,
            keep: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decoder layers over ``input_ids`` -> (the last layer's output [b, s, H], before the
        final norm, and the outputs [b, s, H] of the layers ``keep``, in that order)."""
        return run_layers_keeping(self.layers, self.rotary, self.embed_tokens(input_ids),
                                  kv_cache, meta, self.sliding_window, keep)

    def features(self, input_ids, kv_cache, meta) -> torch.Tensor:
        """The last decoder layer's output [b, s, H], before the final norm (what a
        ``last_prenorm`` feature draft reads: ``ssdlib.models.feature_draft``)."""
        return self.run(input_ids, kv_cache, meta)[0]


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

    def with_layers(self, layers) -> "LlamaForCausalLM":
        """A second view of this model whose decoder layers are ``layers`` (e.g. the same layers
        wrapped by torch.compile), sharing every other module and all weights: the plain model
        keeps its own layers."""
        view = copy.copy(self)
        view._modules = dict(self._modules)
        inner = copy.copy(self.model)
        inner._modules = dict(self.model._modules)
        inner._modules["layers"] = nn.ModuleList(layers)
        view._modules["model"] = inner
        return view

    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward (training, scoring): input_ids [b, s] -> logits [b, s, V]."""
        return self.forward_full_features(input_ids)[0]

    def forward_full_features(self, input_ids: torch.Tensor, layers: Sequence[int] | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache-free causal forward with the features: input_ids [b, s] -> (logits [b, s, V],
        features [b, s, n * H]), features = the outputs, before the final norm, of the decoder
        ``layers`` (n indices; default: the last layer alone) concatenated in that order
        (logits = lm_head(norm(the last layer's output)))."""
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).expand(b, s)
        keep = (len(self.model.layers) - 1,) if layers is None else tuple(layers)
        last, kept = self.model.run(input_ids, None, AttentionMetadata(positions, None, s), keep)
        return self.lm_head(self.model.norm(last)), concat_features(kept)

    def load_weights(self, weights) -> None:
        """Each parallel layer reads its own shard of its HF-named tensor(s), after checking
        every tensor's shape against the config."""
        load_named_weights(self, weights)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under Hugging Face names (merged projections split), for export.
        Only meaningful for an unsharded (tp = 1) model."""
        return hf_named_tensors(self)
