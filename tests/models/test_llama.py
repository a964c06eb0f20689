"""Our Llama against HF transformers' LlamaForCausalLM (fp32), and cache paths against a full
forward."""

import pytest
import torch

from ssdlib.engine.runner.kv_cache import KVCache
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.loading import load_checkpoint
from ssdlib.models.llama import LlamaForCausalLM


def build(path, max_len=128):
    ck = load_checkpoint(path)
    m = LlamaForCausalLM(ck.config, None, max_len)
    m.load_weights(ck.weights)
    cache = KVCache(ck.config.num_hidden_layers, 4, m.kv_heads_local, max_len, ck.config.head_dim,
                    torch.float32, "cpu")
    return ck, m.eval(), cache


def fwd(m, cache, ids, start, slots):
    b, s = ids.shape
    pos = torch.as_tensor(start).view(-1, 1) + torch.arange(s).view(1, -1)
    with torch.no_grad():
        return m(ids, cache, AttentionMetadata.build(pos, torch.as_tensor(slots)))


@pytest.mark.parametrize("name", ["gqa", "llama3_tied", "smol_heads"])
def test_logits_match_hf(tiny_dirs, name):
    from transformers import AutoModelForCausalLM

    ck, m, cache = build(tiny_dirs[name])
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[name], dtype=torch.float32).eval()
    ids = torch.randint(0, ck.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    out = fwd(m, cache, ids, [0, 0], [0, 1])
    assert (out - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["gqa", "llama3_tied"])
def test_prefill_decode_and_verify_forward_agree_with_full(tiny_dirs, name):
    ck, m, cache = build(tiny_dirs[name])
    ids = torch.randint(0, ck.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    full = fwd(m, cache, ids, [0], [0])[0]
    # prefill 20 into another slot, then 1-token decode steps, then a K+1 = 6 token forward
    parts = [fwd(m, cache, ids[:, :20], [0], [2])[0]]
    for t in range(20, 24):
        parts.append(fwd(m, cache, ids[:, t:t + 1], [t], [2])[0])
    parts.append(fwd(m, cache, ids[:, 24:30], [24], [2])[0])
    assert (torch.cat(parts) - full).abs().max().item() <= 1e-4


def test_rollback_then_rewrite(tiny_dirs):
    """After a 'rejection' (length moved back), new tokens overwrite stale KV: no copy needed."""
    ck, m, cache = build(tiny_dirs["gqa"])
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, ck.config.vocab_size, (1, 16), generator=g)
    junk = torch.randint(0, ck.config.vocab_size, (1, 6), generator=g)
    full = fwd(m, cache, ids, [0], [0])[0]
    fwd(m, cache, ids[:, :10], [0], [1])
    fwd(m, cache, junk, [10], [1])  # rejected speculation written at 10..15
    out = fwd(m, cache, ids[:, 10:16], [10], [1])[0]  # length rolled back to 10
    assert (out - full[10:]).abs().max().item() <= 1e-4


def test_batch_rows_of_different_lengths(tiny_dirs):
    from ssdlib.engine.batching import pack_rows

    ck, m, cache = build(tiny_dirs["smol_heads"])
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, ck.config.vocab_size, (1, 12), generator=g)
    b = torch.randint(0, ck.config.vocab_size, (1, 7), generator=g)
    ref_a = fwd(m, cache, a, [0], [0])[0]
    ref_b = fwd(m, cache, b, [0], [1])[0]
    ids, pos = pack_rows([a[0].tolist(), b[0].tolist()], [0, 0])
    with torch.no_grad():
        out = m(ids, cache, AttentionMetadata.build(pos, torch.tensor([2, 3])))
    assert (out[0] - ref_a).abs().max() <= 1e-4
    assert (out[1, :7] - ref_b).abs().max() <= 1e-4


def test_head_layout_padding():
    """9/3 heads at TP 4 (and 2) pad to 12/4; that outputs are unchanged is checked by the TP
    tests (tests/distributed/test_tp.py) against TP 1."""
    from ssdlib.config import ModelConfig
    from ssdlib.models.llama import head_layout

    cfg = ModelConfig(vocab_size=10, hidden_size=72, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=8)
    assert head_layout(cfg, 4) == (12, 4)
    assert head_layout(cfg, 2) == (12, 4)
    assert head_layout(cfg, 3) == (9, 3)
    assert head_layout(cfg, 1) == (9, 3)


# ---- sliding window (Mistral's convention: a query sees itself and the window - 1 keys before) --
WINDOW = 128


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory):
    from tests.tiny import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("windowed")), "smol_heads", seed=3,
                           scale=2.0, sliding_window=WINDOW, max_position_embeddings=512)


def test_sliding_window_logits_match_hf_mistral(windowed_dir):
    from transformers import AutoModelForCausalLM

    ck, m, cache = build(windowed_dir, max_len=320)
    assert ck.config.sliding_window == WINDOW
    hf = AutoModelForCausalLM.from_pretrained(windowed_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    ids = torch.randint(0, ck.config.vocab_size, (2, 300), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
        full = m.forward_full(ids)
    out = fwd(m, cache, ids, [0, 0], [0, 1])
    assert (out - ref).abs().max().item() <= 1e-4
    assert (full - ref).abs().max().item() <= 1e-4  # the cache-free (training) forward too
    # the window matters past it: the same weights without one give other logits there
    ck.config.sliding_window = None
    plain = LlamaForCausalLM(ck.config, None, 320)
    plain.load_weights(ck.weights)
    with torch.no_grad():
        unwindowed = plain.forward_full(ids)
    assert (unwindowed[:, :WINDOW] - ref[:, :WINDOW]).abs().max().item() <= 1e-4
    assert (unwindowed[:, WINDOW + 20:] - ref[:, WINDOW + 20:]).abs().max().item() > 1e-2


def test_sliding_window_decode_verify_and_kernel_path_agree_with_full(windowed_dir):
    ck, m, cache = build(windowed_dir, max_len=320)
    ids = torch.randint(0, ck.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = m.forward_full(ids)[0]
    parts = [fwd(m, cache, ids[:, :200], [0], [2])[0]]  # prefill past the window
    for t in range(200, 230):
        parts.append(fwd(m, cache, ids[:, t:t + 1], [t], [2])[0])
    parts.append(fwd(m, cache, ids[:, 230:236], [230], [2])[0])  # a K + 1 = 6 verify
    assert (torch.cat(parts) - full[:236]).abs().max().item() <= 1e-4
    # the slot_attention path (what CUDA steps run; its reference on CPU) applies the window too
    pos = torch.arange(236, 242).view(1, -1)
    meta = AttentionMetadata(pos, torch.tensor([2]), 320, kv_limit=pos + 1, use_kernel=True,
                             kernel_backend="torch")
    with torch.no_grad():
        out = m(ids[:, 236:242], cache, meta)[0]
    assert (out - full[236:242]).abs().max().item() <= 1e-4


def test_sliding_window_config_round_trip_and_checks():
    from ssdlib.config import ModelConfig
    from ssdlib.errors import CheckpointError

    cfg = ModelConfig(vocab_size=10, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      sliding_window=512).validate()
    hf = cfg.to_hf_dict()
    assert hf["model_type"] == "mistral" and hf["sliding_window"] == 512
    assert ModelConfig.from_hf_dict(hf) == cfg
    plain = ModelConfig.from_hf_dict(dict(hf, sliding_window=None))
    assert plain.sliding_window is None and plain.to_hf_dict()["model_type"] == "llama"
    for bad in (0, 64, 127, 1.5, True, "512"):
        with pytest.raises(CheckpointError, match="sliding_window"):
            ModelConfig.from_hf_dict(dict(hf, sliding_window=bad))
