"""Tokenizer files of a Hugging Face checkpoint directory, read into a :class:`Tokenizer`.

Read: ``tokenizer.json`` (the fast-tokenizer pipeline) or, failing that, a sentencepiece
``tokenizer.model``; ``tokenizer_config.json`` for BOS/EOS, ``add_bos_token`` and the chat
template (or ``chat_template.jinja`` / ``chat_template.json``, where transformers 5 saves it).
Writing them back is :meth:`Tokenizer.save_hf`, which needs nothing from here.
"""

from __future__ import annotations

import json
import os
from typing import Any

import tokenizers

from ssdlib.config import ModelConfig
from ssdlib.errors import CheckpointError
from ssdlib.tokenizer.builders import bos_post_processor, sentencepiece_bpe
from ssdlib.tokenizer.sentencepiece_model import MODEL_BPE, read_sentencepiece_model
from ssdlib.tokenizer.stop_tokens import stop_token_ids
from ssdlib.tokenizer.tokenizer import Tokenizer

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# What transformers' LlamaTokenizer assumes when a tokenizer.model comes without a config.
_LLAMA_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: str, tok_config: dict[str, Any]) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the default one is what a plain chat uses.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if isinstance(template, str):
        return template
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_path):
        try:
            with open(jinja_path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise CheckpointError(f"{jinja_path}: unreadable ({e})") from None
    json_path = os.path.join(directory, "chat_template.json")
    if os.path.exists(json_path):
        template = _read_json(json_path).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def _sentencepiece_backend(path: str) -> tokenizers.Tokenizer:
    model = read_sentencepiece_model(path)
    if model.model_type != MODEL_BPE:
        raise CheckpointError(f"{path}: only BPE sentencepiece models are supported (Llama "
                              f"family); this one has model type {model.model_type}")
    return sentencepiece_bpe(model.pieces, model.scores, model.types,
                             add_prefix_space=model.add_dummy_prefix)


def load_tokenizer_dir(directory: str, config: ModelConfig | None = None) -> Tokenizer | None:
    """The tokenizer of an HF checkpoint directory, or ``None`` if it has no tokenizer files.

    The stop set is the config's EOS ids (``generation_config.json`` wins there), the
    tokenizer_config EOS, and the chat template's end-of-turn markers.
    """
    json_path = os.path.join(directory, "tokenizer.json")
    sp_path = os.path.join(directory, "tokenizer.model")
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    tok_config = _read_json(cfg_path) if os.path.exists(cfg_path) else {}
    if os.path.exists(json_path):
        try:
            backend = tokenizers.Tokenizer.from_file(json_path)
        except Exception as e:  # the Rust parser raises a bare Exception on malformed files
            raise CheckpointError(f"{json_path}: not a valid tokenizer.json ({e})") from None
        # Without an explicit flag, tokenizer.json's own post-processor decides about BOS.
        default_add_bos = None
        default_specials = {}
    elif os.path.exists(sp_path):
        backend = _sentencepiece_backend(sp_path)
        default_add_bos = True  # sentencepiece Llama tokenizers prepend BOS unless told not to
        default_specials = _LLAMA_SPECIALS
    else:
        return None

    specials = {key: _token_text(tok_config.get(key)) or default_specials.get(key)
                for key in _SPECIAL_KEYS}
    bos_id = backend.token_to_id(specials["bos_token"]) if specials["bos_token"] else None
    if bos_id is None and config is not None:
        bos_id = config.bos_token_id
    add_bos = tok_config.get("add_bos_token", default_add_bos)
    if add_bos is not None:
        bos_text = backend.id_to_token(bos_id) if bos_id is not None else None
        # Same rebuild transformers does when add_bos_token is given explicitly.
        backend.post_processor = bos_post_processor(
            (bos_text, bos_id) if add_bos and bos_text is not None else None)
    template = _chat_template(directory, tok_config)
    eos_text_id = backend.token_to_id(specials["eos_token"]) if specials["eos_token"] else None
    declared = list(config.eos_token_ids) if config is not None else []
    eos_ids = stop_token_ids([*declared, eos_text_id], backend.token_to_id, template)
    max_len = tok_config.get("model_max_length")
    return Tokenizer(backend, bos_token_id=bos_id, eos_token_ids=eos_ids, chat_template=template,
                     add_bos_token=None if add_bos is None else bool(add_bos),
                     special_tokens=specials,
                     model_max_length=max_len if isinstance(max_len, int) else None)

