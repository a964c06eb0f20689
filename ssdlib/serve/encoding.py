"""Prompt encoding for the server, which runs it on worker threads while the event loop serves
every stream.

A worker thread only helps if the work lets go of the GIL. ``tokenizers``' ``encode`` holds it
for the whole call (a 4 MB prompt held it for seconds, and every client waited), while its
``encode_batch`` releases it. :func:`releasing_encoder` gives a :class:`PromptEncoder` with the
same checks and the same ids as the generator's own, whose tokenizer's ``encode`` goes through
``encode_batch``. Only that call is replaced: the tokenizer's other calls (its chat encoding
included) run as they are. Chat templates render in Python, which hands the GIL over every few
milliseconds.
"""

from __future__ import annotations

import copy

from ssdlib.prompts import PromptEncoder


class _ReleasingTokenizer:
    """A tokenizer whose ``encode`` goes through ``encode_batch``; everything else is the
    wrapped tokenizer's own."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        [encoding] = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def releasing_encoder(prompts: PromptEncoder) -> PromptEncoder:
    """A copy of ``prompts`` (a generator's encoder, its options kept) whose tokenizer encodes
    text without holding the GIL; ``prompts`` itself when its tokenizer has no ``tokenizers``
    backend (or there is no tokenizer)."""
    backend = getattr(prompts.tokenizer, "backend", None)
    if not hasattr(backend, "encode_batch"):
        return prompts
    encoder = copy.copy(prompts)
    encoder.tokenizer = _ReleasingTokenizer(prompts.tokenizer)
    return encoder
