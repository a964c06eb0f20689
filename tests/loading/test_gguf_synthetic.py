"""GGUF loading on tiny synthetic files: config from metadata, dequantization per type, the q/k
un-permutation, slicing, Llama 3 RoPE scaling recovered from ``rope_freqs``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from tiny_llama_gguf import TINY, llama_cpp_permute

from ssdlib.errors import CheckpointError
from ssdlib.loading.checkpoint import load_checkpoint
from ssdlib.loading.gguf_config import _llama3_from_factors, llama3_rope_factors
from ssdlib.loading.gguf_file import unpermute_rope_rows

# Worst-case |dequantized - original| relative to the largest |original| in a row, per type.
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1}


def test_tiny_config(tiny_gguf):
    ckpt = load_checkpoint(tiny_gguf().path)
    cfg = ckpt.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (
        TINY["vocab"], TINY["hidden"], TINY["inter"], TINY["layers"])
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        TINY["heads"], TINY["kv_heads"], TINY["head_dim"])
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 256 and not cfg.tie_word_embeddings
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.bos_token_id == 1
    # EOS 0 from the file, plus <|im_end|> (id 2) because the ChatML template ends turns with it.
    assert cfg.eos_token_ids == [0, 2]
    assert ckpt.tokenizer.eos_token_ids == [0, 2]
    assert "lm_head.weight" in ckpt.weights.names()


def test_tied_embeddings_have_no_lm_head(tiny_gguf):
    ckpt = load_checkpoint(tiny_gguf(tied=True).path)
    assert ckpt.config.tie_word_embeddings
    assert "lm_head.weight" not in ckpt.weights.names()


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_dequantize_each_type(tiny_gguf, qtype):
    tiny = tiny_gguf(qtype)
    weights = load_checkpoint(tiny.path).weights
    assert sorted(weights.names()) == sorted(tiny.weights)
    for name, original in tiny.weights.items():
        got = weights.get(name)
        assert got.dtype == torch.float32 and tuple(got.shape) == original.shape
        assert weights.shape(name) == original.shape
        t = qtype if original.ndim == 2 else Q.F32
        # Exactly what the gguf reference quantize -> dequantize round trip gives...
        reference = dequantize(quantize(original, t), t)
        np.testing.assert_array_equal(got.numpy(), reference, err_msg=name)
        # ...which is close to the original (exact for F32).
        scale = np.abs(original).max(axis=-1, keepdims=True)
        assert np.all(np.abs(got.numpy() - original) <= TOLERANCE[t] * scale), name


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(1)
    for heads, kv in ((4, 4), (4, 2), (8, 1)):
        q = rng.standard_normal((heads * 16, 32)).astype(np.float32)
        k = rng.standard_normal((kv * 16, 32)).astype(np.float32)
        np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(q, heads, heads), heads), q)
        np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(k, heads, kv), kv), k)


def test_slices_match_full_tensor(tiny_gguf):
    tiny = tiny_gguf(Q.Q8_0)
    weights = load_checkpoint(tiny.path).weights
    hd = TINY["head_dim"]
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.norm.weight"):
        full = weights.get(name)
        rows = full.shape[0]
        for start, stop in ((0, rows), (hd, 2 * hd), (3, rows - 5), (0, None)):
            torch.testing.assert_close(weights.get(name, 0, start, stop), full[start:stop],
                                       rtol=0, atol=0)
        if full.ndim == 2:
            for start, stop in ((0, 32), (32, 64), (5, 40)):
                part = weights.get(name, 1, start, stop)
                torch.testing.assert_close(part, full[:, start:stop], rtol=0, atol=0)
                part.zero_()  # the caller owns its tensor: the cached copy must not change
            torch.testing.assert_close(weights.get(name, -1, 0, 32), full[:, :32], rtol=0, atol=0)


def test_llama3_rope_scaling_from_rope_freqs(tiny_gguf):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    factors = llama3_rope_factors(TINY["head_dim"], 500000.0, scaling)
    ckpt = load_checkpoint(tiny_gguf(rope_freqs=factors).path)
    assert ckpt.config.rope_scaling == scaling
    assert "rope_freqs.weight" not in ckpt.weights.names()


@pytest.mark.parametrize("factor,low,high", [(8.0, 1.0, 4.0), (32.0, 1.0, 4.0), (16.0, 2.0, 8.0)])
def test_llama3_rope_parameters_are_recovered(factor, low, high):
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": 8192}
    factors = llama3_rope_factors(128, 500000.0, scaling).astype(np.float32)
    assert _llama3_from_factors("x.gguf", factors, 128, 500000.0, 8192) == scaling


def test_unknown_rope_freqs_rejected(tiny_gguf):
    odd = np.linspace(1.0, 3.0, TINY["head_dim"] // 2) ** 2
    with pytest.raises(CheckpointError, match="rope_freqs.weight.*not supported"):
        load_checkpoint(tiny_gguf(rope_freqs=odd).path)


def test_tokenizer_from_tiny_gguf(tiny_gguf):
    tok = load_checkpoint(tiny_gguf().path).tokenizer
    assert tok.vocab_size == TINY["vocab"]
    ids = tok.encode("<|im_start|>a t\u00e9")
    assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=False) == "<|im_start|>a t\u00e9"
    assert tok.token_to_id("\u0120t") in ids  # the one merge applied
