"""Rotary position embedding (rotate-half form, as HF Llama) with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], Llama-3 scaled when ``scaling`` says so.

    Computed in float32 exactly as HF transformers does, so positions match it bit for bit.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, hd/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, s] -> (cos, sin), each [b, s, 1, hd]: cos repeated over both halves,
        sin signed (-sin on the first half) so that rotation is x*cos + swap_halves(x)*sin;
        computed once per forward."""
        cos, sin = self.cos[positions], self.sin[positions]
        return (torch.cat([cos, cos], dim=-1).unsqueeze(2),
                torch.cat([-sin, sin], dim=-1).unsqueeze(2))


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [b, s, hq, hd]; k: [b, s, hkv, hd]; cos/sin from ``cos_sin`` -> rotated (q, k).

    When q and k are adjacent views of one projection (the merged qkv output) both are rotated
    in one pass, in their own dtype (as HF Llama does)."""
    hq = q.shape[2]
    # under torch.compile the fuser does this (and storage offsets are not traceable)
    qk = None if torch.compiler.is_compiling() else _adjacent(q, k)
    if qk is not None:
        out = _rotate(qk, cos, sin)
        return out[:, :, :hq], out[:, :, hq:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[b, s, hq + hkv, hd] view over q then k when k's storage directly follows q's heads."""
    b, s, hq, hd = q.shape
    if (q.stride(3) != 1 or q.stride(2) != hd or k.stride() != q.stride()
            or k.storage_offset() != q.storage_offset() + hq * hd):
        return None
    return q.as_strided((b, s, hq + k.shape[2], hd), q.stride())


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # [x1, x2] -> [x1*c - x2*s, x2*c + x1*s] in three kernels (cat, mul, addcmul)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)
