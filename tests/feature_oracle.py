"""An exactly predictable target for feature drafts, and the feature draft that predicts it:
a check that features, tokens and the draft's own features meet at the right positions."""

from __future__ import annotations

import torch
from torch import nn

from ssdlib.config import ModelConfig
from ssdlib.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ssdlib.layers.norm import RMSNorm
from ssdlib.models.feature_draft import FeatureDraft

V, H = 50, 16


class PreviousTokenTarget(nn.Module):
    """f_t = e(x_t) + P e(x_{t-1}) (e(x_{-1}) = 0), logits_t = head(norm(f_t)): embeddings live
    in the first half of the width, P maps that half to the second, so f_t carries both tokens
    and its first half is e(x_t) alone."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed_tokens = VocabParallelEmbedding(V, H)
        self.lm_head = ParallelLMHead(V, H)
        self.norm = RMSNorm(H, 1e-5)  # the draft config's eps
        with torch.no_grad():
            self.embed_tokens.weight.zero_()
            self.embed_tokens.weight[:, :H // 2] = torch.randn(V, H // 2, generator=g)
            self.lm_head.weight.copy_(torch.randn(V, H, generator=g) * 3)
        self.register_buffer("P", torch.randn(H // 2, H // 2, generator=g))
        self.requires_grad_(False)

    def forward_full_features(self, ids):
        e = self.embed_tokens(ids)
        previous = nn.functional.pad(e[:, :-1, :H // 2], (0, 0, 1, 0))  # e(x_{t-1})
        features = e + nn.functional.pad(previous @ self.P.T, (H // 2, 0))
        return self.lm_head(self.norm(features)), features


def oracle_draft(target: PreviousTokenTarget, with_feature: bool = True) -> FeatureDraft:
    """fc([e(x_{t+1}), f_t]) = e(x_{t+1}) + P (first half of f_t) = f_{t+1} exactly; identity
    layers; the target's norm (all ones)."""
    cfg = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      embedding_from_target=True)
    draft = FeatureDraft(cfg, target.embed_tokens, target.lm_head, max_positions=128)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.ones(p.shape) if p.dim() == 1 else torch.zeros(p.shape))
        draft.fc.weight[:, :H] = torch.eye(H)  # the token's embedding
        if with_feature:
            draft.fc.weight[H // 2:, H:H + H // 2] = target.P
        for layer in draft.layers:  # q/k/v/gate/up are random: the zero outputs make it identity
            nn.init.normal_(layer.self_attn.qkv_proj.weight)
            nn.init.normal_(layer.mlp.gate_up_proj.weight)
    return draft.eval()
