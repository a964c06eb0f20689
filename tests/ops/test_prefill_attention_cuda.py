"""The masked (prefill) attention path on CUDA -- SDPA restricted to flash / memory-efficient /
math, GQA heads expanded for the memory-efficient kernel -- against the CPU path (math, GQA by
SDPA's own enable_gqa), for rows of different lengths in a slot cache."""

import pytest
import torch

from ssdlib.layers.attention import AttentionMetadata, CachedAttention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_matches_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    hq, hkv, hd, slots, L = 9, 3, 64, 4, 160
    b, s = 2, 37
    attn = CachedAttention(hq, hkv, hd)
    q = torch.randn(b, s, hq, hd, generator=g)
    k = torch.randn(b, s, hkv, hd, generator=g)
    v = torch.randn(b, s, hkv, hd, generator=g)
    cache_k = torch.randn(slots, hkv, L, hd, generator=g)
    cache_v = torch.randn(slots, hkv, L, hd, generator=g)
    starts = torch.tensor([0, 50])  # the second row continues a cached prefix
    pos = starts[:, None] + torch.arange(s)
    out = {}
    for dev in ("cpu", "cuda"):
        dt = torch.float32 if dev == "cpu" else dtype
        kc, vc = cache_k.to(dev, dt), cache_v.to(dev, dt)
        meta = AttentionMetadata(pos.to(dev), torch.tensor([3, 1], device=dev), 96,
                                 kv_limit=(pos + 1).to(dev))
        meta.prepare()
        out[dev] = attn(q.to(dev, dt), k.to(dev, dt), v.to(dev, dt), kc, vc, meta).float().cpu()
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out["cuda"], out["cpu"], atol=tol, rtol=tol)
