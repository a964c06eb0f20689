"""The server's prompt encoder (ssdlib.serve.encoding, which encodes without holding the GIL)
gives the ids and the errors of the generator's own encoder, the reference, for text, chat and
token-id prompts: with the tiny character tokenizer, and with SmolLM2's (GGUF) when installed."""

import re

import pytest

from ssdlib.errors import SSDError
from ssdlib.prompts import PromptEncoder
from ssdlib.serve.encoding import releasing_encoder
from ssdlib.tokenizer import load_tokenizer_dir, tokenizer_from_gguf
from tests.tiny_chat import write_char_tokenizer

PROMPTS = [
    ("The sea is wide.", False),
    ("<|im_start|>user\nHi<|im_end|>", False),  # special tokens written in the text
    ("é ☃ unknown characters", False),
    ("Tell me about the sea.", True),  # a text prompt in chat mode: one user message
    ({"messages": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello"},
                   {"role": "user", "content": "And the sea?"}]}, True),
    ([5, 6, 7], False),
    ({"prompt": "The sea"}, False),
]
BAD = [("", False), ([], False), ([10 ** 9], False), ({"messages": []}, True)]


def _check(tokenizer, vocab_size: int) -> None:
    reference = PromptEncoder(tokenizer, vocab_size, max_context=1 << 20)
    server = releasing_encoder(reference)
    assert server is not reference  # the GIL-releasing path is the one under test
    for prompt, chat in PROMPTS:
        assert server.encode(prompt, chat) == reference.encode(prompt, chat), (prompt, chat)
    for prompt, chat in BAD:
        with pytest.raises(SSDError) as want:
            reference.encode(prompt, chat)
        with pytest.raises(type(want.value), match=re.escape(str(want.value))):
            server.encode(prompt, chat)


def test_char_tokenizer_ids_equal_the_generator_encoder(tmp_path):
    n = write_char_tokenizer(str(tmp_path))
    _check(load_tokenizer_dir(str(tmp_path)), n)


def test_smollm2_ids_equal_the_generator_encoder(smollm2_path):
    tok = tokenizer_from_gguf(smollm2_path)
    _check(tok, tok.vocab_size)
