"""GGUF metadata -> :class:`ModelConfig` for Llama-architecture files.

Keys follow llama.cpp (``llama.embedding_length``, ``llama.attention.head_count``, ...). Llama 3.x
RoPE scaling is not written as metadata by llama.cpp's converter: it stores the per-frequency
factors as a ``rope_freqs.weight`` tensor instead, from which the HF-style ``rope_scaling`` dict is
recovered here (and checked by recomputing the factors).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ssdlib.config import ModelConfig
from ssdlib.errors import CheckpointError
from ssdlib.tokenizer.gguf_vocab import gguf_stop_token_ids

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
# llama.cpp's converter uses this when a Llama 3 config does not say (all Llama 3.x models do).
_LLAMA3_ORIGINAL_CONTEXT = 8192


def llama3_rope_factors(head_dim: int, theta: float, scaling: Mapping[str, Any]) -> np.ndarray:
    """Per-frequency divisors of Llama 3 RoPE scaling, as llama.cpp writes ``rope_freqs``."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))


def _llama3_from_factors(path: str, factors: np.ndarray, head_dim: int, theta: float,
                         old_ctx: int) -> dict[str, Any] | None:
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' has shape {factors.shape}, "
                              f"expected ({head_dim // 2},)")
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    between = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    low, high = 1.0, 4.0  # Llama 3's values, kept when the factors cannot pin them down
    if between.sum() >= 2:
        # In the smooth band 1/f is linear in old_ctx/wavelen; its slope and intercept give
        # 1/(high-low) and -low/(high-low).
        smooth = (1.0 / factors[between] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(old_ctx / wavelen[between], smooth, 1)
        low = round(float(-intercept / slope), 4)
        high = round(low + float(1.0 / slope), 4)
    scaling = {"rope_type": "llama3", "factor": round(factor, 4), "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": old_ctx}
    rebuilt = llama3_rope_factors(head_dim, theta, scaling)
    if not np.allclose(rebuilt, factors, rtol=1e-3, atol=1e-4):
        raise CheckpointError(f"{path}: 'rope_freqs.weight' does not follow Llama 3 RoPE scaling; "
                              "this kind of RoPE scaling is not supported")
    return scaling


def config_from_gguf(path: str, metadata: Mapping[str, Any],
                     tensor_shapes: Mapping[str, tuple[int, ...]],
                     rope_freqs: np.ndarray | None = None) -> ModelConfig:
    """The validated config of a Llama GGUF file.

    ``tensor_shapes`` maps GGUF tensor names to their shapes in torch order (``[out, in]``);
    ``rope_freqs`` is the ``rope_freqs.weight`` tensor when the file has one.
    """
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported GGUF architecture {arch!r}; ssdlib runs "
                              "Llama-architecture models ('llama')")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None and required:
            raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    if (get("expert_count") or 0) > 0:
        raise CheckpointError(f"{path}: mixture-of-experts Llama files are not supported")
    try:
        hidden = int(get("embedding_length", required=True))
        heads = int(get("attention.head_count", required=True))
        rope_dims = get("rope.dimension_count")
        head_dim = int(get("attention.key_length") or rope_dims or hidden // heads)
        if rope_dims is not None and int(rope_dims) != head_dim:
            raise CheckpointError(f"{path}: partial rotary embedding (rope.dimension_count "
                                  f"{rope_dims} != head dim {head_dim}) is not supported")
        tokens = metadata.get("tokenizer.ggml.tokens")
        embed = tensor_shapes.get("token_embd.weight")
        vocab = get("vocab_size") or (len(tokens) if tokens else None) or (
            embed[0] if embed else None)
        theta = float(get("rope.freq_base", 10000.0))
        rope_scaling = None
        scaling_type = get("rope.scaling.type")
        if scaling_type not in (None, "none"):
            rope_scaling = {"rope_type": scaling_type,
                            "factor": float(get("rope.scaling.factor", 1.0))}
        elif rope_freqs is not None:
            old_ctx = int(get("rope.scaling.original_context_length", _LLAMA3_ORIGINAL_CONTEXT))
            rope_scaling = _llama3_from_factors(path, rope_freqs, head_dim, theta, old_ctx)
        eos_ids = gguf_stop_token_ids(metadata)
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        config = ModelConfig(
            vocab_size=int(vocab) if vocab is not None else 0,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", required=True)),
            num_hidden_layers=int(get("block_count", required=True)),
            num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid GGUF metadata ({e})") from None
    try:
        return config.validate()
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
