"""Bad checkpoints fail with a CheckpointError that says what is wrong, never a numpy or Rust
traceback."""

from __future__ import annotations

import json
import os

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file
from tiny_llama_gguf import TINY

from ssdlib.errors import CheckpointError
from ssdlib.loading.checkpoint import load_checkpoint


def _load_and_read(path: str) -> None:
    ckpt = load_checkpoint(path)
    for name in ckpt.weights.names():
        ckpt.weights.get(name)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found.*nope.gguf.*smollm2-135m"):
        load_checkpoint(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a gguf")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_checkpoint(path)


@pytest.mark.parametrize("keep", [6, 40, 0.3, 0.9, -8])
def test_truncated_gguf(tiny_gguf, tmp_path, keep):
    data = open(tiny_gguf(Q.Q8_0).path, "rb").read()
    cut = keep if isinstance(keep, int) and keep > 0 else (
        len(data) + keep if isinstance(keep, int) else int(len(data) * keep))
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: (corrupt or )?truncated GGUF file"):
        _load_and_read(str(path))


def test_tensor_shape_mismatch(tiny_gguf):
    bad = tiny_gguf(shape_overrides={"blk.1.ffn_up.weight": (80, TINY["hidden"])})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(bad.path)
    message = str(err.value)
    assert "model.layers.1.mlp.up_proj.weight" in message and "blk.1.ffn_up.weight" in message
    assert "[80, 64]" in message and "[96, 64]" in message


def test_missing_and_extra_tensors(tiny_gguf):
    with pytest.raises(CheckpointError, match="missing tensors: model.layers.1.mlp.gate_proj.weight"):
        load_checkpoint(tiny_gguf(drop=("blk.1.ffn_gate.weight",)).path)
    extra = {"blk.7.attn_norm.weight": (TINY["hidden"],)}
    with pytest.raises(CheckpointError, match="not part of a Llama model.*blk.7.attn_norm.weight"):
        load_checkpoint(tiny_gguf(shape_overrides=extra).path)


def test_unsupported_quant_type(tiny_gguf):
    with pytest.raises(CheckpointError, match="stored as Q5_0.*Q8_0"):
        load_checkpoint(tiny_gguf(Q.Q5_0).path)


def test_unsupported_gguf_architecture(tiny_gguf):
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'gpt2'"):
        load_checkpoint(tiny_gguf(arch="gpt2").path)


def _tiny_hf_dir(directory, config: dict | None = None) -> str:
    os.makedirs(directory, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
           "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": True}
    cfg.update(config or {})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({"model.embed_tokens.weight": torch.randn(32, 16), "model.norm.weight": torch.ones(16)},
              os.path.join(directory, "model.safetensors"))
    return str(directory)


def test_unsupported_architecture_in_config_json(tmp_path):
    directory = _tiny_hf_dir(tmp_path / "gpt2", {"architectures": ["GPT2LMHeadModel"],
                                                  "model_type": "gpt2"})
    with pytest.raises(CheckpointError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_checkpoint(directory)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors(tmp_path, damage):
    directory = _tiny_hf_dir(tmp_path / "hf")
    path = os.path.join(directory, "model.safetensors")
    data = open(path, "rb").read()
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = (16).to_bytes(8, "little") + b"{not json at all" + data[24:]
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt or truncated safetensors"):
        _load_and_read(directory)
