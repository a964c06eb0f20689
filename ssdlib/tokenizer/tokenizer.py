"""The tokenizer ssdlib uses everywhere: a ``tokenizers.Tokenizer`` plus the model's special ids
and chat template, whatever file it came from (``tokenizer.json``, ``tokenizer.model``, GGUF)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers

from ssdlib.errors import ConfigError
from ssdlib.tokenizer.chat_template import render_chat_template
from ssdlib.tokenizer.content_specials import ContentSafeEncoder
from ssdlib.tokenizer.releasing import encode_releasing_gil
from ssdlib.tokenizer.stream import StreamDecoder
from ssdlib.tokenizer.unicode_text import check_unicode


class Tokenizer:
    """Text <-> token ids for one model.

    ``backend`` already carries the whole pipeline, BOS insertion included (its post-processor);
    ``add_bos_token`` only records that choice (``None``: whatever ``tokenizer.json`` says) so
    :meth:`save_hf` can write it out. ``eos_token_ids`` is the full stop set (see
    :mod:`ssdlib.tokenizer.stop_tokens`). ``special_tokens`` maps ``bos_token``/``eos_token``/
    ``unk_token``/``pad_token`` to their strings, as chat templates expect.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], chat_template: str | None = None,
                 add_bos_token: bool | None = None,
                 special_tokens: Mapping[str, str | None] | None = None,
                 model_max_length: int | None = None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.special_tokens: dict[str, str] = {k: v for k, v in (special_tokens or {}).items()
                                               if v is not None}
        if "bos_token" not in self.special_tokens and bos_token_id is not None:
            self.special_tokens["bos_token"] = backend.id_to_token(bos_token_id)
        if "eos_token" not in self.special_tokens and self.eos_token_ids:
            self.special_tokens["eos_token"] = backend.id_to_token(self.eos_token_ids[0])
        self.model_max_length = model_max_length
        self._content_safe: ContentSafeEncoder | None = None

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_ids}, chat_template={self.chat_template is not None})")

    @property
    def vocab_size(self) -> int:
        """Tokens this tokenizer can produce (added tokens included). A model's embedding may be
        larger (padded rows); it is never smaller for a consistent checkpoint."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are always
        recognised; ``add_special_tokens`` only controls the BOS the tokenizer itself adds. Chat
        prompts go through :meth:`encode_chat`, which keeps message contents plain text."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return encode_releasing_gil(self.backend, check_unicode(text), add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A decoder fed one token at a time (``.push(id) -> str``, ``.flush() -> str``)."""
        return StreamDecoder(lambda ids: self.backend.decode(
            list(ids), skip_special_tokens=skip_special_tokens))

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text for ``messages``, rendered in a sandbox as transformers renders it."""
        return render_chat_template(self._template(), messages,
                                    add_generation_prompt=add_generation_prompt,
                                    **{**self.special_tokens, **variables})

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    allow_special_tokens_in_content: bool = False, **variables: Any) -> list[int]:
        """Token ids of the chat prompt for ``messages``.

        Special tokens the template writes (``<|im_start|>``, ``bos_token``) become their control
        ids; the same strings inside message contents (or ``variables``) are tokenized as plain
        text, so a message cannot forge a turn. ``allow_special_tokens_in_content=True``
        recognises them everywhere, as encoding the rendered text would.
        """
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                check_unicode(content, f"message {i}'s content")
        if allow_special_tokens_in_content:
            text = self.apply_chat_template(messages, add_generation_prompt, **variables)
            return self.encode(text, add_special_tokens=False)
        template = self._template()
        if self._content_safe is None:
            self._content_safe = ContentSafeEncoder(self.backend)
        return self._content_safe.encode_chat(
            template, messages, add_generation_prompt, {**self.special_tokens, **variables},
            trusted=self.special_tokens)

    def _template(self) -> str:
        if self.chat_template is None:
            raise ConfigError("this model has no chat template; give a plain prompt instead of "
                              "chat messages")
        return self.chat_template

    def fingerprint(self) -> str:
        """sha256 over (token, id) pairs and the BOS/EOS ids.

        Two tokenizers with the same fingerprint give token ids the same meaning, which is what a
        draft and a target model must share; how text is split into tokens does not enter it.
        """
        vocab = sorted(self.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
        payload = json.dumps({"vocab": vocab, "bos": self.bos_token_id,
                              "eos": sorted(self.eos_token_ids)},
                             ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def save_hf(self, directory: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` that ``AutoTokenizer`` loads
        (and :func:`ssdlib.tokenizer.load_tokenizer_dir` reads back)."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        self.backend.save(os.path.join(directory, "tokenizer.json"))
        config: dict[str, Any] = {
            # The generic fast tokenizer: a model-specific class would rebuild its own pipeline.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            **self.special_tokens,
        }
        if self.add_bos_token is not None:
            config["add_bos_token"] = self.add_bos_token
            config["add_eos_token"] = False
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")
