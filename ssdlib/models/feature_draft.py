"""A feature-conditioned draft (EAGLE-style): it reads its target's own hidden states.

Convention (positions are the target's): the target's feature f_t is its last decoder layer's
output at position t, before the final norm (``LlamaForCausalLM.forward_full_features``). The
draft's input at position t is fc([embed(x_{t+1}), f_t]) (x_{t+1}: the token after t); its
decoder layers (the target's width, causal attention over the draft's own earlier inputs) make
h_t, its estimate of f_{t+1}, and logits = lm_head(norm(h_t)) predict x_{t+2}. Where the target
has no feature (a token the draft drafted itself, or a position the target has not verified
yet), the draft's own h_{t-1} stands in for f_t.

The embedding and the LM head are the target's, frozen: they are passed in and not registered
as modules of the draft, so they are neither among its parameters nor in its state dict. What a
draft stores: ``fc`` [H, 2H], its decoder layers and ``norm`` (``stored_tensors``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ssdlib.config import ModelConfig
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.layers.linear import RowParallelLinear
from ssdlib.layers.norm import RMSNorm
from ssdlib.layers.rotary import RotaryEmbedding
from ssdlib.models.llama import (LlamaDecoderLayer, LlamaForCausalLM, hf_named_tensors,
                                 load_named_weights, run_layers)


def feature_draft_config(target: ModelConfig, layers: int) -> ModelConfig:
    """The config of a feature draft's layers for ``target``: the target's width, heads, FFN
    and RoPE, ``layers`` decoder layers, the target's embedding (and head) shared."""
    return replace(target, num_hidden_layers=layers, embedding_from_target=True,
                   target_hidden_size=None, eos_token_ids=list(target.eos_token_ids)).validate()


class FeatureDraft(nn.Module):
    def __init__(self, config: ModelConfig, embed_tokens: nn.Module, lm_head: nn.Module,
                 max_positions: int | None = None):
        super().__init__()
        h = config.hidden_size
        width = embed_tokens.weight.shape[-1]
        if width != h:
            raise ValueError(f"the target's embedding is {width} wide but the feature draft's "
                             f"hidden size is {h}: a feature draft has its target's width")
        self.config = config
        # a plain linear 2H -> H without bias (the draft runs unsharded: no TP group); an ssdlib
        # linear so that it loads by name like every other weight
        self.fc = RowParallelLinear(2 * h, h)
        self.rotary = RotaryEmbedding(config.head_dim,
                                      max_positions or config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, None)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self._target = (embed_tokens, lm_head)  # a tuple: not registered, not stored

    @classmethod
    def for_target(cls, target: LlamaForCausalLM, layers: int,
                   max_positions: int | None = None) -> "FeatureDraft":
        """A new (uninitialised) draft of ``layers`` layers reading ``target``'s features,
        sharing its embedding and LM head; RoPE tables as long as the target's by default."""
        return cls(feature_draft_config(target.config, layers), target.model.embed_tokens,
                   target.lm_head, max_positions or target.model.rotary.cos.shape[0])

    @property
    def embed_tokens(self) -> nn.Module:
        return self._target[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._target[1]

    @property
    def kv_heads_local(self) -> int:
        return self.layers[0].self_attn.kv_local

    def _inputs(self, next_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fc([embed(next_ids), features]): [b, s] and [b, s, H] -> [b, s, H]."""
        x = torch.cat([self.embed_tokens(next_ids).to(features.dtype), features], dim=-1)
        return self.fc(x.to(self.fc.weight.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head(norm(hidden)): [..., H] -> [..., V] (in the head's dtype)."""
        head_dtype = next(self.lm_head.parameters()).dtype
        return self.lm_head(self.norm(hidden).to(head_dtype))

    def forward_full(self, features: torch.Tensor,
                     next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache-free causal forward (training, scoring): the feature f_t [b, s, H] and the token
        x_{t+1} [b, s] of positions t = 0..s-1 -> (logits [b, s, V] predicting x_{t+2}, hidden
        h_t [b, s, H] estimating f_{t+1})."""
        b, s = next_ids.shape
        positions = torch.arange(s, device=next_ids.device).expand(b, s)
        hidden = run_layers(self.layers, self.rotary, self._inputs(next_ids, features), None,
                            AttentionMetadata(positions, None, s), self.config.sliding_window)
        return self.logits(hidden), hidden

    def forward(self, next_ids: torch.Tensor, features: torch.Tensor, kv_cache,
                meta: AttentionMetadata, logits_index: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Over the KV cache, as ``LlamaForCausalLM.forward``: next_ids [b, s] and features
        [b, s, H] at ``meta.positions`` -> (logits [b, s, V], hidden [b, s, H]), or both at
        ``logits_index`` [b, n] only ([b, n, V], [b, n, H])."""
        hidden = run_layers(self.layers, self.rotary, self._inputs(next_ids, features), kv_cache,
                            meta, self.config.sliding_window)
        if logits_index is not None:
            hidden = hidden.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        return self.logits(hidden), hidden

    def load_weights(self, weights) -> None:
        """fc, the layers and the norm from ``weights`` (names as in ``stored_tensors``), every
        shape checked first."""
        load_named_weights(self, weights)

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """What a saved draft holds, by name: ``fc.weight``, ``layers.N.*`` (Hugging Face
        names of a Llama layer) and ``norm.weight``."""
        return hf_named_tensors(self)
