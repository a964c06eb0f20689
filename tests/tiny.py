"""Tiny random Llama checkpoints for tests (written with HF transformers, saved as safetensors)."""

from __future__ import annotations

import os

import torch

TINY_CONFIGS = {
    "gqa": dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                tie_word_embeddings=False, rope_theta=10000.0),
    "llama3_tied": dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=2, vocab_size=101,
                        tie_word_embeddings=True, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 16}),
    # SmolLM2's awkward head counts (9 query / 3 KV heads): TP 2 and 4 need padding.
    "smol_heads": dict(hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=9, num_key_value_heads=3, vocab_size=90,
                       tie_word_embeddings=True, rope_theta=100000.0),
}


def make_tiny_llama(directory: str, name: str = "gqa", seed: int = 0, scale: float = 1.0,
                    **overrides) -> str:
    """Write a random HF Llama checkpoint to ``directory`` and return it.

    ``scale`` multiplies the LM head / embedding so that distributions are sharp (useful for
    tests that want clear argmaxes). ``sliding_window=N`` among the overrides writes a Mistral
    checkpoint (Llama layers, attention limited to the last N positions).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    kw = dict(TINY_CONFIGS[name], **overrides)
    kw.setdefault("max_position_embeddings", 256)
    kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    # a sliding_window override writes a Mistral checkpoint (Llama with a window)
    windowed = kw.get("sliding_window") is not None
    config = (MistralConfig if windowed else LlamaConfig)(bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(seed)
    model = (MistralForCausalLM if windowed else LlamaForCausalLM)(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
        if scale != 1.0:
            model.lm_head.weight.mul_(scale)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def make_noisy_draft(target_dir: str, directory: str, noise: float, seed: int = 1) -> str:
    """A draft = the target with Gaussian noise on its matrices (agrees often for small noise)."""
    import shutil

    from safetensors.torch import load_file, save_file

    os.makedirs(directory, exist_ok=True)
    for f in os.listdir(target_dir):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(target_dir, f), directory)
    sd = load_file(os.path.join(target_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    sd = {k: (v + noise * torch.randn(v.shape, generator=g)) if v.dim() > 1 else v
          for k, v in sd.items()}
    save_file(sd, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return directory


def make_small_vocab_pair(root: str, scale: float, noise: float) -> tuple[str, str]:
    """A target of 8 tokens (``scale``: how peaked its distributions are) and a noisy draft of
    it, for the distribution tests: (target dir, draft dir) under ``root``."""
    t = make_tiny_llama(os.path.join(root, "t"), "gqa", scale=scale, vocab_size=8)
    return t, make_noisy_draft(t, os.path.join(root, "d"), noise)
