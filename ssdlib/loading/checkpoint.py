"""Checkpoint resolution: a path or a named default becomes a :class:`Checkpoint`.

A checkpoint is data, never code: only safetensors and GGUF are read (no pickle). Weights are
served by name in Hugging Face naming (``model.layers.0.self_attn.q_proj.weight``) and can be read
as a slice, so each tensor-parallel rank reads only its own part.
"""

from __future__ import annotations

import os

from ssdlib.errors import CheckpointError
from ssdlib.loading import registry
from ssdlib.loading.checkpoint_types import Checkpoint, WeightSource
from ssdlib.loading.gguf_file import load_gguf
from ssdlib.loading.hf_dir import load_hf_dir

__all__ = ["Checkpoint", "WeightSource", "load_checkpoint"]


def load_checkpoint(spec: str | os.PathLike) -> Checkpoint:
    """Resolve ``spec``: a named default (``smollm2-135m``), a ``.gguf`` file or an HF directory."""
    spec = os.fspath(spec)
    named = registry.resolve_named(spec)
    path = named if named is not None else spec
    if not os.path.exists(path):
        raise CheckpointError(
            f"checkpoint not found: {spec!r} (give an HF directory, a .gguf file, or one of the "
            f"named defaults: {', '.join(registry.names())})")
    if os.path.isdir(path):
        # A draft may name its target's tokenizer; that name is resolved like any other spec.
        return load_hf_dir(path, resolve=load_checkpoint)
    if path.endswith(".gguf"):
        return load_gguf(path)
    raise CheckpointError(f"{path}: not an HF checkpoint directory or a .gguf file")
