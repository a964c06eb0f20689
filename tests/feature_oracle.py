"""An exactly predictable target for feature drafts, and the feature draft that predicts it:
a check that features, tokens and the draft's own features meet at the right positions. Asked
for fused features (three layers' outputs), the target gives [f_t + u_t, u_t, 2 u_t] (u_t: a
second embedding of x_t), which the fused oracle's fuse [I, -I, 0] maps back to f_t exactly."""

from __future__ import annotations

import torch
from torch import nn

from ssdlib.config import ModelConfig
from ssdlib.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ssdlib.layers.norm import RMSNorm
from ssdlib.models.feature_draft import FeatureDraft
from ssdlib.models.feature_spec import FUSED, FeatureSpec

V, H = 50, 16
FUSED_LAYERS = (0, 1, 2)  # what a fused oracle asks for (the target has no real layers)


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
        self.register_buffer("U", torch.randn(V, H, generator=g))  # u(x): fused features' part
        self.requires_grad_(False)

    def forward_full_features(self, ids, layers=None):
        e = self.embed_tokens(ids)
        previous = nn.functional.pad(e[:, :-1, :H // 2], (0, 0, 1, 0))  # e(x_{t-1})
        features = e + nn.functional.pad(previous @ self.P.T, (H // 2, 0))
        logits = self.lm_head(self.norm(features))
        if layers is None:
            return logits, features
        u = self.U[ids]
        return logits, torch.cat([features + u, u, 2 * u], dim=-1)


def oracle_draft(target: PreviousTokenTarget, with_feature: bool = True,
                 fused: bool = False) -> FeatureDraft:
    """fc([e(x_{t+1}), f_t]) = e(x_{t+1}) + P (first half of f_t) = f_{t+1} exactly; identity
    layers; the target's norm (all ones). ``fused``: it reads the fused features, and its fuse
    [I, -I, 0] recovers f_t from them."""
    cfg = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      embedding_from_target=True)
    spec = FeatureSpec(FUSED, FUSED_LAYERS) if fused else None
    draft = FeatureDraft(cfg, target.embed_tokens, target.lm_head, max_positions=128,
                         feature=spec)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.ones(p.shape) if p.dim() == 1 else torch.zeros(p.shape))
        if fused:
            draft.fuse.weight[:, :H] = torch.eye(H)
            draft.fuse.weight[:, H:2 * H] = -torch.eye(H)
        draft.fc.weight[:, :H] = torch.eye(H)  # the token's embedding
        if with_feature:
            draft.fc.weight[H // 2:, H:H + H // 2] = target.P
        for layer in draft.layers:  # q/k/v/gate/up are random: the zero outputs make it identity
            nn.init.normal_(layer.self_attn.qkv_proj.weight)
            nn.init.normal_(layer.mlp.gate_up_proj.weight)
    return draft.eval()
