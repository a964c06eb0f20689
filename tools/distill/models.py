"""Teacher and draft: both are ssdlib's Llama. The draft shares the target's vocabulary and special
ids, ties its embeddings (most of a small draft's size is the embedding) and is written out as an
HF checkpoint directory."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import replace

import torch
from safetensors.torch import save_file

from ssdlib.config import ModelConfig
from ssdlib.loading import Checkpoint
from ssdlib.models.llama import LlamaForCausalLM

STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")


def load_teacher(ck: Checkpoint, device: torch.device, dtype: torch.dtype,
                 max_positions: int) -> LlamaForCausalLM:
    """The target in ``dtype`` on ``device``, frozen (the RoPE tables stay float32)."""
    with torch.device(device):
        model = LlamaForCausalLM(ck.config, None, max_positions=max_positions)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.load_weights(ck.weights)
    return model.eval().requires_grad_(False)


def draft_config(target: ModelConfig, hidden: int, layers: int, heads: int, kv_heads: int,
                 ffn: int) -> ModelConfig:
    """A small Llama with the target's vocabulary, special ids and RoPE, embeddings tied."""
    if hidden % heads:
        raise ValueError(f"--hidden ({hidden}) must be a multiple of --heads ({heads})")
    return replace(target, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                   head_dim=hidden // heads, tie_word_embeddings=True,
                   eos_token_ids=list(target.eos_token_ids)).validate()


def count_params(cfg: ModelConfig) -> int:
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    layer = attn + 3 * h * cfg.intermediate_size + 2 * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return cfg.vocab_size * h + cfg.num_hidden_layers * layer + h + head


def build_draft(cfg: ModelConfig, device: torch.device, max_positions: int,
                seed: int) -> LlamaForCausalLM:
    """A randomly initialised draft (float32 master weights): N(0, 0.02) matrices, residual
    output projections scaled down by sqrt(2 * layers) as in GPT-2, unit norms."""
    with torch.device(device):
        model = LlamaForCausalLM(cfg, None, max_positions=max_positions)
    g = torch.Generator().manual_seed(seed)
    out_scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
                continue
            std = 0.02 * (out_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1)
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


@torch.no_grad()
def init_embeddings_from_target(draft: LlamaForCausalLM, ck: Checkpoint) -> None:
    """Draft embedding = the target embedding projected on its top principal directions (the
    leading right singular vectors of E [V, H]), so similar tokens start out similar."""
    emb = ck.weights.get("model.embed_tokens.weight").double()  # [V, H]
    d = draft.config.hidden_size
    # right singular vectors of E are the eigenvectors of E^T E ([H, H], cheap for any V)
    evals, evecs = torch.linalg.eigh(emb.T @ emb)
    top = evecs[:, evals.argsort(descending=True)[:d]]  # [H, min(d, H)]
    proj = emb @ top  # [V, min(d, H)]
    w = draft.model.embed_tokens.weight
    w[:, :proj.shape[1]] = proj.to(w.dtype).to(w.device)


def export_hf(draft: LlamaForCausalLM, ck: Checkpoint, out_dir: str, storage_dtype: str) -> int:
    """Write ``out_dir`` as an HF Llama checkpoint (config.json, model.safetensors, the target's
    tokenizer files) that ssdlib and transformers load. Returns the safetensors file size."""
    os.makedirs(out_dir, exist_ok=True)
    dtype = STORAGE_DTYPES[storage_dtype]
    tensors = {name: p.detach().to("cpu", dtype).contiguous()
               for name, p in draft.hf_state_dict().items()}
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, weights + ".tmp", metadata={"format": "pt"})
    os.chmod(weights + ".tmp", 0o644)
    os.replace(weights + ".tmp", weights)
    cfg = draft.config.to_hf_dict()
    cfg["torch_dtype"] = storage_dtype
    cfg["dtype"] = storage_dtype  # transformers 5 name
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    copy_tokenizer(ck, out_dir)
    return os.path.getsize(weights)


def copy_tokenizer(ck: Checkpoint, out_dir: str) -> bool:
    """Tokenizer files of the target into ``out_dir``: copied from an HF directory, else written
    by ssdlib's tokenizer (GGUF targets). False when the target has no tokenizer."""
    if os.path.isdir(ck.source):
        found = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(ck.source, f))]
        for f in found:
            shutil.copy(os.path.join(ck.source, f), os.path.join(out_dir, f))
        if any(f.startswith("tokenizer") for f in found):
            return True
    tok = ck.tokenizer
    if tok is None:
        return False
    tok.save_hf(out_dir)
    return True
