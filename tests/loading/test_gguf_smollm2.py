"""SmolLM2-135M-Instruct (Q4_1 GGUF): ssdlib's tensors equal transformers' load of the same file,
and tools/convert_gguf.py makes an HF directory that transformers and ssdlib both load."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from ssdlib.loading.checkpoint import load_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "convert_gguf.py")


def _convert_module():
    spec = importlib.util.spec_from_file_location("convert_gguf", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def converted_dir(smollm2_path, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("smollm2-hf"))
    assert _convert_module().main([smollm2_path, out]) == 0
    return out


def test_config(smollm2_ckpt, hf_gguf_model):
    cfg, hf = smollm2_ckpt.config, hf_gguf_model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (
        hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.head_dim)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]


def test_every_tensor_equals_transformers(smollm2_ckpt, hf_gguf_model):
    reference = hf_gguf_model.state_dict()
    names = smollm2_ckpt.weights.names()
    # transformers lists the tied lm_head too; ssdlib serves it only when untied.
    assert set(names) == set(reference) - {"lm_head.weight"}
    for name in names:
        ours = smollm2_ckpt.weights.get(name)
        assert ours.dtype == torch.float32
        assert tuple(ours.shape) == smollm2_ckpt.weights.shape(name)
        assert torch.equal(ours, reference[name]), name


def test_converted_dir_loads_in_transformers(converted_dir, hf_gguf_model, smollm2_ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 504, 3458, 314, 2, 17, 905, 28, 4093]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf_gguf_model(ids).logits, rtol=0, atol=1e-6)
    tok = AutoTokenizer.from_pretrained(converted_dir)
    text = "Hello <|im_start|>user\n  world 🤗   42"
    assert tok.encode(text) == smollm2_ckpt.tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        smollm2_ckpt.tokenizer.apply_chat_template(messages))
    assert model.generation_config.eos_token_id == 2


def test_converted_dir_loads_in_ssdlib(converted_dir, smollm2_ckpt):
    ckpt = load_checkpoint(converted_dir)
    assert ckpt.config == smollm2_ckpt.config
    assert sorted(ckpt.weights.names()) == sorted(smollm2_ckpt.weights.names())
    for name in ckpt.weights.names():
        assert torch.equal(ckpt.weights.get(name), smollm2_ckpt.weights.get(name)), name
    ours, theirs = ckpt.tokenizer, smollm2_ckpt.tokenizer
    assert ours.fingerprint() == theirs.fingerprint()
    assert ours.chat_template == theirs.chat_template
    assert ours.eos_token_ids == theirs.eos_token_ids and ours.bos_token_id == theirs.bos_token_id
    for text in ("plain text", "  x =   5\n\n\tdef f():", "<|im_start|>user\nhé 🤗<|im_end|>"):
        assert ours.encode(text) == theirs.encode(text)


def test_convert_refuses_to_overwrite(converted_dir, smollm2_path, capsys):
    assert _convert_module().main([smollm2_path, converted_dir]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--force" in err[0]


def test_convert_cli_error_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, TOOL, str(tmp_path / "missing.gguf"),
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "checkpoint not found" in lines[0], result.stderr
