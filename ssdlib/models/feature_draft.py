"""A feature-conditioned draft (EAGLE-style): it reads its target's own hidden states.

Convention (positions are the target's): the target's feature F_t at position t is what its
``FeatureSpec`` says (``ssdlib.models.feature_spec``): the last decoder layer's output before
the final norm (``last_prenorm``, width H), or three layers' outputs concatenated (``fused``,
width 3H; ``LlamaForCausalLM.forward_full_features``). The draft first conditions it to its own
width: f_t = ``condition(F_t)``, F_t itself for ``last_prenorm``, fuse(F_t) (a learned linear
3H -> H) for ``fused``. The draft's input at position t is fc([embed(x_{t+1}), f_t]) (x_{t+1}:
the token after t); its decoder layers (the target's width, causal attention over the draft's
own earlier inputs) make h_t, its estimate of f_{t+1}, and logits = lm_head(norm(h_t)) predict
x_{t+2}. Where the target has no feature (a token the draft drafted itself, or a position the
target has not verified yet), the draft's own h_{t-1} stands in for f_t: the conditioned
feature, so it is never conditioned again.

The embedding and the LM head are the target's, frozen: they are passed in and not registered
as modules of the draft, so they are neither among its parameters nor in its state dict. What a
draft stores: ``fc`` [H, 2H], with fused features ``fuse`` [H, 3H], its decoder layers and
``norm`` (``stored_tensors``).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn

from ssdlib.config import ModelConfig
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.layers.linear import RowParallelLinear
from ssdlib.layers.norm import RMSNorm
from ssdlib.layers.rotary import RotaryEmbedding
from ssdlib.models.feature_spec import FUSED, FeatureSpec
from ssdlib.models.llama import (LlamaDecoderLayer, LlamaForCausalLM, hf_named_tensors,
                                 load_named_weights, run_layers)


def feature_draft_config(target: ModelConfig, layers: int) -> ModelConfig:
    """The config of a feature draft's layers for ``target``: the target's width, heads, FFN
    and RoPE, ``layers`` decoder layers, the target's embedding (and head) shared."""
    return replace(target, num_hidden_layers=layers, embedding_from_target=True,
                   target_hidden_size=None, eos_token_ids=list(target.eos_token_ids)).validate()


class FeatureDraft(nn.Module):
    def __init__(self, config: ModelConfig, embed_tokens: nn.Module, lm_head: nn.Module,
                 max_positions: int | None = None, feature: FeatureSpec | None = None):
        super().__init__()
        h = config.hidden_size
        width = embed_tokens.weight.shape[-1]
        if width != h:
            raise ValueError(f"the target's embedding is {width} wide but the feature draft's "
                             f"hidden size is {h}: a feature draft has its target's width")
        self.config = config
        self.feature = feature or FeatureSpec()
        # fused features: their map to the draft's width, a plain linear 3H -> H without bias
        self.fuse = (RowParallelLinear(self.feature.width(h), h) if self.feature.kind == FUSED
                     else None)
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
                   max_positions: int | None = None,
                   feature: FeatureSpec | None = None) -> "FeatureDraft":
        """A new (uninitialised) draft of ``layers`` layers reading ``target``'s features of
        kind ``feature`` (default: ``last_prenorm``; checked against the target), sharing its
        embedding and LM head; RoPE tables as long as the target's by default."""
        if feature is not None:
            feature.target_layers(target.config.num_hidden_layers)
        return cls(feature_draft_config(target.config, layers), target.model.embed_tokens,
                   target.lm_head, max_positions or target.model.rotary.cos.shape[0], feature)

    def with_layers(self, layers) -> "FeatureDraft":
        """A second view of this draft whose decoder layers are ``layers`` (e.g. the same layers
        under torch.compile), sharing every other module and all weights: this draft keeps its
        own layers (``LlamaForCausalLM.with_layers``)."""
        view = copy.copy(self)
        view._modules = dict(self._modules)
        view._modules["layers"] = nn.ModuleList(layers)
        return view

    def with_head(self, lm_head: nn.Module) -> "FeatureDraft":
        """A second view of this draft whose logits come from ``lm_head`` (e.g. a draft
        vocabulary's head in training), sharing every module and all weights."""
        view = copy.copy(self)
        view._target = (self._target[0], lm_head)
        return view

    @property
    def embed_tokens(self) -> nn.Module:
        return self._target[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._target[1]

    @property
    def kv_heads_local(self) -> int:
        return self.layers[0].self_attn.kv_local

    @property
    def feature_width(self) -> int:
        """The width of the target features the draft reads (H, or 3H fused)."""
        return self.feature.width(self.config.hidden_size)

    def condition(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., feature_width] -> the draft's feature [..., H]: as they
        are (``last_prenorm``), or through ``fuse`` (``fused``). Only the target's: the draft's
        own h already is such a feature."""
        width = target_features.shape[-1]
        if width != self.feature_width:
            raise ValueError(f"the draft reads {self.feature.kind} features of width "
                             f"{self.feature_width}, got width {width}")
        if self.fuse is None:
            return target_features
        return self.fuse(target_features.to(self.fuse.weight.dtype))

    def pair_inputs(self, next_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fc([embed(next_ids), features]): [b, s] and [b, s, H] -> [b, s, H]."""
        x = torch.cat([self.embed_tokens(next_ids).to(features.dtype), features], dim=-1)
        return self.fc(x.to(self.fc.weight.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head(norm(hidden)): [..., H] -> [..., V] (in the head's dtype)."""
        head_dtype = next(self.lm_head.parameters()).dtype
        return self.lm_head(self.norm(hidden).to(head_dtype))

    def forward_full(self, features: torch.Tensor,
                     next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache-free causal forward (training, scoring): the feature f_t [b, s, H] (conditioned:
        ``condition``, or the draft's own h) and the token x_{t+1} [b, s] of positions
        t = 0..s-1 -> (logits [b, s, V] predicting x_{t+2}, hidden h_t [b, s, H] estimating
        f_{t+1})."""
        b, s = next_ids.shape
        positions = torch.arange(s, device=next_ids.device).expand(b, s)
        hidden = run_layers(self.layers, self.rotary, self.pair_inputs(next_ids, features), None,
                            AttentionMetadata(positions, None, s), self.config.sliding_window)
        return self.logits(hidden), hidden

    def forward(self, next_ids: torch.Tensor, features: torch.Tensor, kv_cache,
                meta: AttentionMetadata, logits_index: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Over the KV cache, as ``LlamaForCausalLM.forward``: next_ids [b, s] and features
        [b, s, H] (conditioned, as in ``forward_full``) at ``meta.positions`` -> (logits
        [b, s, V], hidden [b, s, H]), or both at ``logits_index`` [b, n] only ([b, n, V],
        [b, n, H])."""
        hidden = run_layers(self.layers, self.rotary, self.pair_inputs(next_ids, features),
                            kv_cache, meta, self.config.sliding_window)
        if logits_index is not None:
            hidden = hidden.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        return self.logits(hidden), hidden

    def load_weights(self, weights) -> None:
        """fc (and fuse), the layers and the norm from ``weights`` (names as in
        ``stored_tensors``), every shape checked first."""
        load_named_weights(self, weights)

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """What a saved draft holds, by name: ``fc.weight``, ``fuse.weight`` (fused features),
        ``layers.N.*`` (Hugging Face names of a Llama layer) and ``norm.weight``."""
        return hf_named_tensors(self)
