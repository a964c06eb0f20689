"""Chat prompts in which only the template writes control tokens.

Encoding a rendered chat prompt as one string would turn ``<|im_start|>system`` typed inside a
user message into the same control tokens the template writes, so a message could forge turns
(a system prompt, an assistant answer). Here the template's own text (its literal text, its
string constants and the ``bos_token``-style variables) has each special token written as one
private-use character, and a copy of the tokenizer has those characters, not the original
strings, as its special tokens. One ``encode`` of the rendered text then gives the template's
special tokens their ids, while the same strings coming from message contents are plain text:
split and merged exactly as the rest of the text, since nothing else about the tokenizer changes.

Only special tokens that look like markup (a character that is neither a letter, a digit nor a
space, as in ``<s>`` or ``[INST]``) are treated so; a special token spelled as a plain word would
also be rewritten in the template's comparisons (``role == 'assistant'``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import tokenizers

from ssdlib.errors import ConfigError
from ssdlib.tokenizer.chat_template import render_chat_template
from ssdlib.tokenizer.releasing import encode_releasing_gil

# Supplementary private use areas (planes 15 and 16): one character per special token is taken
# from the first of these that no message uses.
_PLANES = (0xF0000, 0x100000)
_PLANE_SIZE = 0xFFFE  # U+xFFFE and U+xFFFF are noncharacters


def _is_markup(token: str) -> bool:
    return any(not (c.isalnum() or c.isspace()) for c in token)


def _strings(value: Any) -> Iterator[str]:
    """Every string inside ``value`` (mappings, lists and tuples are walked)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


class ContentSafeEncoder:
    """Encodes chat prompts for one ``tokenizers.Tokenizer`` (see the module docstring)."""

    def __init__(self, backend: tokenizers.Tokenizer):
        self.backend = backend
        self._config = json.loads(backend.to_str())
        self.specials = [t["content"] for t in self._config.get("added_tokens", [])
                         if t.get("special") and _is_markup(t["content"])]
        if len(self.specials) > _PLANE_SIZE:
            raise ConfigError(f"this tokenizer has {len(self.specials)} special tokens, more than "
                              f"chat prompts can keep apart from message text ({_PLANE_SIZE})")
        self._copies: dict[int, tokenizers.Tokenizer] = {}
        self._pattern = re.compile("|".join(
            re.escape(s) for s in sorted(self.specials, key=len, reverse=True)))

    def _placeholders(self, plane: int) -> dict[str, str]:
        return {s: chr(plane + i) for i, s in enumerate(self.specials)}

    def _copy(self, plane: int) -> tokenizers.Tokenizer:
        """The tokenizer with the placeholders of ``plane`` as its special tokens."""
        if plane not in self._copies:
            placeholders = self._placeholders(plane)
            config = json.loads(json.dumps(self._config))
            for token in config["added_tokens"]:
                token["content"] = placeholders.get(token["content"], token["content"])
            # An added token takes the id the model's vocabulary gives its text, so the
            # placeholder must be in that vocabulary with the special token's id.
            vocab = config["model"].get("vocab")
            if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: an alias, same id
                for special, placeholder in placeholders.items():
                    if special in vocab:
                        vocab[placeholder] = vocab[special]
            elif isinstance(vocab, list):  # Unigram: [piece, score] by id; rename the piece
                for entry in vocab:
                    entry[0] = placeholders.get(entry[0], entry[0])
            self._copies[plane] = tokenizers.Tokenizer.from_str(json.dumps(config))
        return self._copies[plane]

    def _free_plane(self, untrusted: list) -> int:
        """The first plane whose placeholders appear in no message (those would be specials)."""
        for plane in _PLANES:
            used = re.compile(f"[{chr(plane)}-{chr(plane + max(len(self.specials), 1) - 1)}]")
            if not any(used.search(s) for s in _strings(untrusted)):
                return plane
        raise ConfigError("the messages contain characters of both Unicode private use planes "
                          "15 and 16, which chat prompts reserve; remove them from the messages")

    def encode_chat(self, template: str, messages: Any, add_generation_prompt: bool,
                    variables: Mapping[str, Any], trusted: Mapping[str, str]) -> list[int]:
        """Token ids of ``messages`` rendered with ``template``. ``variables`` are template
        variables; those equal to ``trusted`` (the tokenizer's own ``bos_token``, ...) are part
        of the template's text, the others (``tools``, ...) are content."""
        if not self.specials:
            text = render_chat_template(template, messages, add_generation_prompt, **variables)
            return encode_releasing_gil(self.backend, text, False)
        trusted_names = {k for k, v in trusted.items() if variables.get(k) is v}
        plane = self._free_plane([messages, [v for k, v in variables.items()
                                             if k not in trusted_names]])
        placeholders = self._placeholders(plane)
        marked = {k: self._pattern.sub(lambda m: placeholders[m.group(0)], v)
                  if k in trusted_names and isinstance(v, str) else v
                  for k, v in variables.items()}
        text = render_chat_template(template, messages, add_generation_prompt,
                                    template_literals=placeholders, **marked)
        return encode_releasing_gil(self._copy(plane), text, False)
