"""The single-device layers against plain float64 references: RMSNorm, SwiGLU, rotary embedding
(both the merged-qkv path and separate q/k), over dtypes and shapes. The parallel linears and the
vocabulary-parallel embedding/head are checked through the model, TP > 1 against TP 1, in
tests/distributed/test_tp.py; the whole model against HF transformers in tests/models/test_llama.py."""

import math

import pytest
import torch

from ssdlib.layers.activation import SiluAndMul
from ssdlib.layers.norm import RMSNorm
from ssdlib.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (3, 5, 72)])
def test_rms_norm_matches_reference(dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    norm = RMSNorm(shape[-1], eps=1e-5)
    norm.weight.data = torch.randn(shape[-1], generator=g)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    _close(norm.to(dtype)(x.to(dtype)), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(4, 6, 96, generator=g, dtype=torch.float64) for _ in range(2))
    ref = gate / (1 + torch.exp(-gate)) * up
    _close(SiluAndMul()(gate.to(dtype), up.to(dtype)), ref, dtype)


def test_inverse_frequencies_follow_the_formula():
    hd, theta = 64, 10000.0
    ref = [1.0 / theta ** (2 * i / hd) for i in range(hd // 2)]
    torch.testing.assert_close(rope_inv_freq(hd, theta, None).double(),
                               torch.tensor(ref, dtype=torch.float64), rtol=1e-6, atol=0)


def test_llama3_scaling_keeps_short_and_slows_long_wavelengths():
    hd, theta = 64, 500000.0
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    plain, scaled = rope_inv_freq(hd, theta, None), rope_inv_freq(hd, theta, scaling)
    wavelen = 2 * math.pi / plain
    short, long = wavelen < 8192 / 4.0, wavelen > 8192 / 1.0
    assert short.any() and long.any()
    assert torch.equal(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8.0)
    between = ~short & ~long
    assert ((scaled[between] <= plain[between]) & (scaled[between] >= plain[between] / 8)).all()


def _rotate_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """x [b, s, h, hd] float64, rotated pair (i, i + hd/2) by angle position * inv_freq[i]."""
    angle = positions.double()[..., None] * inv_freq.double()  # [b, s, hd/2]
    cos, sin = angle.cos()[:, :, None], angle.sin()[:, :, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("merged", [True, False], ids=["qkv-view", "separate"])
@pytest.mark.parametrize("b,s,hq,hkv,hd", [(1, 1, 4, 4, 16), (2, 7, 9, 3, 8)])
def test_rotary_matches_reference(dtype, merged, b, s, hq, hkv, hd):
    g = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(hd, max_positions=64, theta=10000.0, scaling=None)
    positions = torch.randint(0, 64, (b, s), generator=g)
    qkv = torch.randn(b, s, hq + 2 * hkv, hd, generator=g, dtype=torch.float64)
    ours_in = qkv.to(dtype)
    if merged:  # q and k adjacent views of one projection, as the attention layer makes them
        q, k = ours_in[:, :, :hq], ours_in[:, :, hq:hq + hkv]
    else:
        q, k = ours_in[:, :, :hq].clone(), ours_in[:, :, hq:hq + hkv].clone()
    cos, sin = rope.cos_sin(positions)
    rq, rk = apply_rotary(q, k, cos.to(dtype), sin.to(dtype))
    inv_freq = rope_inv_freq(hd, 10000.0, None)
    ref = _rotate_reference(ours_in.double(), positions, inv_freq)
    _close(rq, ref[:, :, :hq], dtype)
    _close(rk, ref[:, :, hq:hq + hkv], dtype)
