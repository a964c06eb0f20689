"""Checkpoint resolution: a path or a named default becomes a :class:`Checkpoint`.

A checkpoint is data, never code: only safetensors and GGUF are read (no pickle). Weights are
served by name in Hugging Face naming (``model.layers.0.self_attn.q_proj.weight``) and can be read
as a slice, so each tensor-parallel rank reads only its own part.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from ssdlib.config import ModelConfig
from ssdlib.errors import CheckpointError

if TYPE_CHECKING:
    from ssdlib.tokenizer import Tokenizer


class WeightSource(Protocol):
    """Read access to a checkpoint's tensors by HF name."""

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str, dim: int | None = None, start: int = 0,
            stop: int | None = None) -> torch.Tensor:
        """The tensor ``name`` (float), or its slice ``[start:stop]`` along ``dim``."""
        ...


@dataclass
class Checkpoint:
    """A loaded-on-demand checkpoint: validated config, weights by name, tokenizer factory."""

    source: str
    config: ModelConfig
    weights: WeightSource
    tokenizer_factory: Callable[[], "Tokenizer | None"] = field(default=lambda: None, repr=False)
    _tokenizer: "Tokenizer | None" = field(default=None, init=False, repr=False)
    _tokenizer_loaded: bool = field(default=False, init=False, repr=False)

    @property
    def tokenizer(self) -> "Tokenizer | None":
        if not self._tokenizer_loaded:
            self._tokenizer = self.tokenizer_factory()
            self._tokenizer_loaded = True
        return self._tokenizer


def load_checkpoint(spec: str | os.PathLike) -> Checkpoint:
    """Resolve ``spec``: a named default (``smollm2-135m``), a ``.gguf`` file or an HF directory."""
    from ssdlib.loading import registry

    spec = os.fspath(spec)
    named = registry.resolve_named(spec)
    path = named if named is not None else spec
    if not os.path.exists(path):
        raise CheckpointError(
            f"checkpoint not found: {spec!r} (give an HF directory, a .gguf file, or one of the "
            f"named defaults: {', '.join(registry.names())})")
    if os.path.isdir(path):
        from ssdlib.loading.hf_dir import load_hf_dir
        return load_hf_dir(path)
    if path.endswith(".gguf"):
        from ssdlib.loading.gguf_file import load_gguf
        return load_gguf(path)
    raise CheckpointError(f"{path}: not an HF checkpoint directory or a .gguf file")
