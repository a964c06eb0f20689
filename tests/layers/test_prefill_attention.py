"""A prefill from position 0 attends causally over its own keys (no mask, no cache read):
the same outputs and cache as the masked path, taken only where every row starts at 0 and no
sliding window shorter than the forward hides keys."""

import pytest
import torch

from ssdlib.engine.batching import pack_rows
from ssdlib.engine.runner.model_runner import ModelRunner, from_position_zero
from ssdlib.layers.attention import AttentionMetadata, CachedAttention
from ssdlib.loading import load_checkpoint


def attend(attn, q, k, v, positions, slots, window, from_zero, max_len=32):
    torch.manual_seed(0)  # the same stale cache contents for both paths
    hkv, hd = k.shape[2], k.shape[3]
    k_cache = torch.randn(3, hkv, max_len, hd)
    v_cache = torch.randn(3, hkv, max_len, hd)
    meta = AttentionMetadata(positions, slots, max_len, kv_limit=positions + 1,
                             window=window, from_zero=from_zero)
    meta.prepare()
    out = attn(q, k, v, k_cache, v_cache, meta)
    return out, k_cache, v_cache, meta.causal


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("window,causal", [(None, True), (16, True), (5, False)])
def test_causal_prefill_equals_the_masked_path(hq, hkv, window, causal):
    b, s, hd = 2, 12, 8
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, s, hq, hd, generator=g)
    k = torch.randn(b, s, hkv, hd, generator=g)
    v = torch.randn(b, s, hkv, hd, generator=g)
    positions = torch.arange(s).expand(b, s).contiguous()
    slots = torch.tensor([2, 0])
    attn = CachedAttention(hq, hkv, hd)
    fast = attend(attn, q, k, v, positions, slots, window, True)
    ref = attend(attn, q, k, v, positions, slots, window, False)
    assert fast[3] is causal and ref[3] is False  # a window shorter than s keeps the mask
    torch.testing.assert_close(fast[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast[1], ref[1])  # the cache receives the same keys
    torch.testing.assert_close(fast[2], ref[2])


def test_tree_steps_and_training_never_take_the_causal_path():
    pos = torch.arange(4).view(1, 4)
    tree = AttentionMetadata(pos, torch.tensor([0]), 8, kv_limit=pos + 1, from_zero=True,
                             tree_index=pos, tree_mask=torch.ones(1, 4, 4, dtype=torch.bool),
                             tree_len=4)
    tree.prepare()
    cache_free = AttentionMetadata(pos, None, 4, from_zero=True)
    cache_free.prepare()
    assert not tree.causal and not cache_free.causal


def test_from_position_zero_reads_host_positions():
    _, zero = pack_rows([[5, 6, 7], [8, 9]], [0, 0])
    _, later = pack_rows([[5, 6, 7], [8, 9]], [0, 3])
    assert from_position_zero(zero)
    assert not from_position_zero(later)
    assert not from_position_zero(torch.tensor([[0]]))  # one query: a decode step
    assert not from_position_zero(torch.tensor([[0, 2, 3]]))


def count_causal(monkeypatch) -> list:
    calls = []
    real = CachedAttention._causal

    def spy(self, q, k, v):
        calls.append(q.shape[1])
        return real(self, q, k, v)
    monkeypatch.setattr(CachedAttention, "_causal", spy)
    return calls


def test_runner_prefill_from_zero_is_causal_and_equals_a_prefill_in_pieces(tiny_dirs,
                                                                            monkeypatch):
    """The eager path (prompts past the prefill graphs): a prompt fed at once (causal) leaves
    the logits and KV of the same prompt fed in two pieces (the second from position 7: the
    masked path over the cache)."""
    calls = count_causal(monkeypatch)
    ck = load_checkpoint(tiny_dirs["gqa"])
    prompt = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(2))
    whole = ModelRunner(ck, None, "cpu", torch.float32, n_slots=2, max_len=64)
    pieces = ModelRunner(ck, None, "cpu", torch.float32, n_slots=2, max_len=64)
    slot = torch.tensor([1])
    with torch.inference_mode():
        a = whole.forward(prompt, torch.arange(20).view(1, -1), slot)
        n_whole = len(calls)
        b1 = pieces.forward(prompt[:, :7], torch.arange(7).view(1, -1), slot)
        n_first = len(calls)
        b2 = pieces.forward(prompt[:, 7:], torch.arange(7, 20).view(1, -1), slot)
    assert n_whole > 0 and n_first > n_whole and len(calls) == n_first  # the second: masked
    torch.testing.assert_close(a, torch.cat([b1, b2], dim=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole.cache.k[:, 1, :, :20], pieces.cache.k[:, 1, :, :20],
                               atol=1e-5, rtol=1e-5)


def test_prefill_graphs_are_causal_only_from_zero(tiny_dirs, monkeypatch):
    """Prefill graphs (run by the eager pool here): a prompt from position 0 takes the causal
    path, a catch-up over a prompt's tail does not, and both equal the eager forward."""
    from ssdlib.engine.runner.step_graphs import StepGraphs
    from ssdlib.ops.graph_pool import EagerPool

    calls = count_causal(monkeypatch)
    ck = load_checkpoint(tiny_dirs["gqa"])
    ref = ModelRunner(ck, None, "cpu", torch.float32, n_slots=3, max_len=300)
    run = ModelRunner(ck, None, "cpu", torch.float32, n_slots=3, max_len=300)
    # one length bucket (128): a prompt from 0 reads keys [0, 128), a tail from 10 [0, 256)
    run.prefill_graphs = StepGraphs(run, EagerPool(warmup=2), 3, 128, 0, kind="prefill",
                                    use_kernel=False, model=run.model)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 90, (30,), generator=g).tolist(),
            torch.randint(3, 90, (21,), generator=g).tolist()]
    slots = torch.tensor([0, 2])
    with torch.inference_mode():
        for starts in ([0, 0], [0, 10]):
            ids, pos = pack_rows([r[st:] for r, st in zip(rows, starts)], starts)
            index = torch.tensor([[len(r) - st - 1] for r, st in zip(rows, starts)])
            before = len(calls)
            assert run.prefill_first(ids, pos, index)
            got = run.forward(ids, pos, slots, index)
            causal = len(calls) > before
            want = ref.forward(ids, pos, slots, index)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert causal is (starts == [0, 0])


def test_the_switch_turns_the_causal_prefill_off(tiny_dirs, monkeypatch):
    calls = count_causal(monkeypatch)
    monkeypatch.setenv("SSDLIB_CAUSAL_PREFILL", "0")
    ck = load_checkpoint(tiny_dirs["gqa"])
    runner = ModelRunner(ck, None, "cpu", torch.float32, n_slots=2, max_len=64)
    with torch.inference_mode():
        runner.forward(torch.tensor([[5, 6, 7, 8]]), torch.arange(4).view(1, -1),
                       torch.tensor([0]))
    assert calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_causal_prefill_equals_the_masked_path_on_cuda(dtype, tol):
    """On CUDA the causal path is SDPA's flash kernel (bf16) or the memory-efficient one (fp32),
    the masked path the memory-efficient kernel with a dense mask: the same attention."""
    b, s, hq, hkv, hd = 2, 300, 9, 3, 64
    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(b, s, hq, hd, generator=g, device="cuda", dtype=dtype)
    k = torch.randn(b, s, hkv, hd, generator=g, device="cuda", dtype=dtype)
    v = torch.randn(b, s, hkv, hd, generator=g, device="cuda", dtype=dtype)
    positions = torch.arange(s, device="cuda").expand(b, s).contiguous()
    slots = torch.tensor([1, 0], device="cuda")
    attn = CachedAttention(hq, hkv, hd)
    outs = []
    for from_zero in (True, False):
        k_cache = torch.zeros(3, hkv, 320, hd, device="cuda", dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        meta = AttentionMetadata(positions, slots, 320, kv_limit=positions + 1,
                                 from_zero=from_zero)
        meta.prepare()
        assert meta.causal is from_zero
        outs.append(attn(q, k, v, k_cache, v_cache, meta).float())
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
