"""The tokenizer a GGUF file describes in its ``tokenizer.*`` metadata.

Supported: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: SmolLM2, Llama 3) and ``"llama"``
(sentencepiece BPE with byte fallback: Llama 2, Mistral). The result matches
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` id for id, with one deliberate exception:
a ``"llama"`` file with ``add_space_prefix = false`` gets no prefix space, as in llama.cpp
(transformers ignores that flag).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from ssdlib.errors import CheckpointError
from ssdlib.gguf_reader import open_gguf, read_metadata
from ssdlib.tokenizer.builders import byte_level_bpe, sentencepiece_bpe
from ssdlib.tokenizer.stop_tokens import stop_token_ids
from ssdlib.tokenizer.tokenizer import Tokenizer

_SPECIAL_IDS = {"bos_token": "tokenizer.ggml.bos_token_id",
                "eos_token": "tokenizer.ggml.eos_token_id",
                "unk_token": "tokenizer.ggml.unknown_token_id",
                "pad_token": "tokenizer.ggml.padding_token_id"}


def _token_index(tokens: list[str]) -> Callable[[str], int | None]:
    index: dict[str, int] = {}
    for i, t in enumerate(tokens):
        index.setdefault(t, i)
    return index.get


def gguf_stop_token_ids(metadata: Mapping[str, Any]) -> list[int]:
    """EOS id, llama.cpp's end-of-turn/message ids, and the chat template's end-of-turn markers
    (see :mod:`ssdlib.tokenizer.stop_tokens` for why)."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    declared = [metadata.get("tokenizer.ggml.eos_token_id"),
                metadata.get("tokenizer.ggml.eot_token_id"),
                metadata.get("tokenizer.ggml.eom_token_id")]
    declared = [i for i in declared if i is not None and 0 <= int(i) < len(tokens)]
    return stop_token_ids(declared, _token_index(tokens), metadata.get("tokenizer.chat_template"))


def tokenizer_from_gguf(source: str | os.PathLike | Mapping[str, Any]) -> Tokenizer | None:
    """The tokenizer of a GGUF file (a path, or its metadata as read by
    :func:`ssdlib.gguf_reader.read_metadata`); ``None`` if the file has no vocabulary."""
    if isinstance(source, Mapping):
        metadata, where = source, "GGUF metadata"
    else:
        where = os.fspath(source)
        metadata = read_metadata(where, open_gguf(where))
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        return None
    token_types = metadata.get("tokenizer.ggml.token_type")
    specials = {}
    for name, key in _SPECIAL_IDS.items():
        token_id = metadata.get(key)
        if token_id is not None and not 0 <= int(token_id) < len(tokens):
            raise CheckpointError(f"{where}: {key} = {token_id} is outside the vocabulary "
                                  f"({len(tokens)} tokens)")
        specials[name] = tokens[token_id] if token_id is not None else None
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if kind == "gpt2":
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        bos = (tokens[bos_id], bos_id) if add_bos and bos_id is not None else None
        merges = metadata.get("tokenizer.ggml.merges")
        if not merges:
            raise CheckpointError(
                f"{where}: byte-level BPE vocabulary without tokenizer.ggml.merges")
        backend = byte_level_bpe(tokens, merges, token_types, metadata.get("tokenizer.ggml.pre"),
                                 bos=bos)
    elif kind == "llama":
        # llama.cpp adds BOS to sentencepiece vocabularies unless the file says otherwise.
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
        bos = (tokens[bos_id], bos_id) if add_bos and bos_id is not None else None
        backend = sentencepiece_bpe(
            tokens, metadata.get("tokenizer.ggml.scores"), token_types,
            merges=metadata.get("tokenizer.ggml.merges"),
            add_prefix_space=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)), bos=bos)
    else:
        raise CheckpointError(f"{where}: unsupported tokenizer model {kind!r} "
                              "(ssdlib reads 'gpt2' byte-level BPE and 'llama' sentencepiece)")
    context = metadata.get(f"{metadata.get('general.architecture', 'llama')}.context_length")
    return Tokenizer(backend, bos_token_id=bos_id, eos_token_ids=gguf_stop_token_ids(metadata),
                     chat_template=metadata.get("tokenizer.chat_template"), add_bos_token=add_bos,
                     special_tokens=specials,
                     model_max_length=int(context) if context is not None else None)
