"""Encoding text with a ``tokenizers`` backend so that other threads keep running."""

from __future__ import annotations


def encode_releasing_gil(backend, text: str, add_special_tokens: bool) -> list[int]:
    """``backend.encode(text).ids`` (a ``tokenizers.Tokenizer``) through ``encode_batch``: the
    same ids. With ``encode``, a server encoding a 4 MB prompt on a worker thread left its event
    loop without the GIL for seconds (/health took 3.4 s, the character-level test tokenizer);
    with ``encode_batch`` it kept answering (tests/serve/test_hostile_requests.py)."""
    [encoding] = backend.encode_batch([text], add_special_tokens=add_special_tokens)
    return encoding.ids
