"""Hugging Face checkpoint directories: config.json + one or many safetensors (+ index)."""

from __future__ import annotations

import json
import os
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from ssdlib.config import EMBEDDING_FROM_TARGET_KEY, TARGET_HIDDEN_SIZE_KEY, ModelConfig
from ssdlib.errors import CheckpointError
from ssdlib.loading.checkpoint_types import Checkpoint
from ssdlib.tokenizer import Tokenizer, load_tokenizer_dir

# The tensors a draft with ``embedding_from_target`` does not store: its target serves them.
TARGET_SHARED_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
# What a narrower such draft (``target_hidden_size``) stores instead, each [target hidden,
# hidden]: its embedding is the target's embedding times the first, its LM head the target's
# head times the second (loading/draft.py).
TARGET_PROJECTIONS = {"model.embed_tokens.weight": "model.embed_tokens.projection",
                      "lm_head.weight": "lm_head.projection"}


class SafetensorsWeights:
    """Tensors of one or many safetensors files, read lazily and by slice."""

    def __init__(self, directory: str, from_target: tuple[str, ...] = ()):
        self.directory = directory
        self.from_target = from_target  # names another checkpoint (the target) must serve
        self._handles: dict[str, object] = {}
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from None
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{directory}: no .safetensors files (ssdlib does not read "
                                      "pickle-based .bin/.pt checkpoints)")
            weight_map = {}
            for fname in files:
                for name in self._open(fname).keys():
                    weight_map[name] = fname
        self._map: dict[str, str] = weight_map

    def _open(self, fname: str):
        if fname not in self._handles:
            path = os.path.join(self.directory, fname)
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: listed in the index but missing")
            try:
                handle = safe_open(path, framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from None
            self._handles[fname] = handle
        return self._handles[fname]

    def names(self) -> list[str]:
        return list(self._map)

    def _slice(self, name: str):
        if name not in self._map:
            if name in self.from_target:
                raise CheckpointError(
                    f"{self.directory}: tensor {name!r} is not stored: this draft uses its "
                    f"target's embedding (config.json: {EMBEDDING_FROM_TARGET_KEY}), so it loads "
                    "only beside a target (ssdlib.loading.draft.load_draft, or --draft with "
                    "--target)")
            raise CheckpointError(f"{self.directory}: tensor {name!r} missing from the checkpoint")
        return self._open(self._map[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def get(self, name: str, dim: int | None = None, start: int = 0,
            stop: int | None = None) -> torch.Tensor:
        sl = self._slice(name)
        try:
            if dim is None:
                t = sl[:]
            else:
                index = [slice(None)] * len(sl.get_shape())
                index[dim] = slice(start, stop)
                t = sl[tuple(index)]
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{self.directory}: cannot read tensor {name!r} ({e})") from None
        return t


def load_hf_dir(directory: str, resolve: Callable[[str], Checkpoint]) -> Checkpoint:
    """An HF checkpoint directory as a :class:`Checkpoint`. ``resolve`` turns the name in a
    ``tokenizer_source.json`` into the checkpoint whose tokenizer this one shares
    (:func:`ssdlib.loading.checkpoint.load_checkpoint`)."""
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{directory}: no config.json (not an HF checkpoint directory)")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: unreadable JSON ({e})") from None
    config = ModelConfig.from_hf_dict(raw, source=cfg_path)
    gen_cfg = os.path.join(directory, "generation_config.json")
    if os.path.exists(gen_cfg):
        try:
            with open(gen_cfg) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        if eos is not None:
            config.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
    weights = SafetensorsWeights(
        directory, TARGET_SHARED_TENSORS if config.embedding_from_target else ())
    if config.embedding_from_target and TARGET_SHARED_TENSORS[0] in weights.names():
        raise CheckpointError(
            f"{directory}: config.json sets {EMBEDDING_FROM_TARGET_KEY} but model.safetensors "
            f"stores {TARGET_SHARED_TENSORS[0]!r}: remove the tensor or the flag")
    if config.projects_target_embedding:
        expected = (config.target_hidden_size, config.hidden_size)
        for name in TARGET_PROJECTIONS.values():
            found = tuple(weights.shape(name)) if name in weights.names() else None
            if found != expected:
                raise CheckpointError(
                    f"{directory}: config.json sets {TARGET_HIDDEN_SIZE_KEY}, so "
                    f"model.safetensors must store {name!r} of shape {expected}; "
                    + ("it is missing" if found is None else f"it has {found}"))

    def tokenizer_factory():
        own = load_tokenizer_dir(directory, config)
        if own is not None:
            return own
        return _shared_tokenizer(directory, resolve)

    return Checkpoint(source=directory, config=config, weights=weights,
                      tokenizer_factory=tokenizer_factory)


SHARED_TOKENIZER_FILE = "tokenizer_source.json"


def _shared_tokenizer(directory: str, resolve: Callable[[str], Checkpoint]) -> Tokenizer | None:
    """A draft may ship without tokenizer files and name its target's instead:
    ``tokenizer_source.json`` = {"same_as": NAME_OR_PATH, "fingerprint": sha256}. The fingerprint
    is checked, so a changed target tokenizer is an error, not a silent mismatch."""
    path = os.path.join(directory, SHARED_TOKENIZER_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            ref = json.load(f)
        source, fingerprint = ref["same_as"], ref["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    tok = resolve(source).tokenizer
    if tok is None or tok.fingerprint() != fingerprint:
        raise CheckpointError(f"{path}: the tokenizer of {source!r} is not the one this "
                              "checkpoint was trained with (fingerprint differs)")
    return tok
