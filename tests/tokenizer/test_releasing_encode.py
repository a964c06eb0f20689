"""Tokenizer.encode goes through ``encode_batch`` (a server stays responsive while a worker thread
encodes a huge prompt: tests/serve/test_hostile_requests.py): the ids must equal the backend's
own ``encode``, the reference, with the tiny character tokenizer and with SmolLM2's."""

from ssdlib.tokenizer import load_tokenizer_dir, tokenizer_from_gguf
from tests.tiny_chat import write_char_tokenizer

TEXTS = ["The sea is wide.", "<|im_start|>user\nHi<|im_end|>", "é ☃ unknown characters", " ",
         "a\n\nb\tc"]


def _check(tok) -> None:
    for text in TEXTS:
        for special in (True, False):
            want = tok.backend.encode(text, add_special_tokens=special).ids
            assert tok.encode(text, add_special_tokens=special) == want, (text, special)


def test_char_tokenizer_ids_equal_the_backends(tmp_path):
    write_char_tokenizer(str(tmp_path))
    _check(load_tokenizer_dir(str(tmp_path)))


def test_smollm2_ids_equal_the_backends(smollm2_path):
    _check(tokenizer_from_gguf(smollm2_path))
