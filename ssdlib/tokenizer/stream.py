"""Incremental detokenization: text as tokens arrive, never half a character.

Decoding token by token is wrong twice over: one UTF-8 character can span several byte-level
tokens (emoji, CJK), and decoders that strip or merge across tokens (sentencepiece's leading
space) give a different string for a token alone than in context. So each step decodes a small
window that starts at an already-emitted token and emits only the text past that token, and holds
the text back while it ends in an incomplete character (``U+FFFD``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_INCOMPLETE = "\ufffd"


class StreamDecoder:
    """Turns a stream of token ids into text; ``"".join(pushes) + flush() == decode(all ids)``."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        # ids[_prefix:_read] were already emitted; they give the window its context.
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes (may be ``""``)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(prefix_text) and not text.endswith(_INCOMPLETE):
            new = text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            return new
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes as ``U+FFFD``)."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text):]
