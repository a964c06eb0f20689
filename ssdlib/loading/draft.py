"""Loading a draft beside its target, including drafts that use the target's embedding.

A draft whose config.json sets ``ssdlib_embedding_from_target`` stores only its transformer
layers and final norm: its token embedding (and, tied, its LM head) is the target's, so a draft
as wide as the target stays small on disk. A narrower one (``ssdlib_target_hidden_size``) also
stores two projections [target hidden, hidden]: its embedding is the target's embedding times
the first, its (untied) LM head the target's head times the second, so all of its stored bytes
go to its layers. :func:`load_draft` serves those tensors from the target's weights (folding the
projections in), so the model loads unchanged; :func:`materialize_hf` writes a standard HF
directory with them included, for tools (transformers) that cannot read the flags.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

from ssdlib.config import EMBEDDING_FROM_TARGET_KEY, TARGET_HIDDEN_SIZE_KEY
from ssdlib.errors import CheckpointError
from ssdlib.loading.checkpoint import Checkpoint, WeightSource, load_checkpoint
from ssdlib.loading.compat import check_draft_compatible
from ssdlib.loading.hf_dir import TARGET_PROJECTIONS, TARGET_SHARED_TENSORS

EMBED, HEAD = TARGET_SHARED_TENSORS


def target_tensor_for(name: str, target: WeightSource) -> str:
    """The target tensor that a draft using its target's embedding reads as ``name``: the
    embedding; for the LM head, the target's own head when it stores one, else its (tied)
    embedding."""
    return HEAD if name == HEAD and HEAD in set(target.names()) else EMBED


class TargetEmbeddingWeights:
    """A draft's own tensors plus the embedding (and LM head, when asked for and not stored)
    read from the target's weights, times the draft's projection of it when ``projected``;
    everything else is the draft's (the projections themselves are not listed)."""

    def __init__(self, draft: WeightSource, target: WeightSource, draft_tied: bool,
                 projected: bool = False):
        self.draft = draft
        self.target = target
        self.projected = projected
        self._own = set(draft.names())
        self._served = {EMBED: EMBED}
        if not draft_tied and HEAD not in self._own:
            self._served[HEAD] = target_tensor_for(HEAD, target)

    def names(self) -> list[str]:
        hidden = set(TARGET_PROJECTIONS.values()) if self.projected else set()
        return ([n for n in self.draft.names() if n not in hidden]
                + [n for n in self._served if n not in self._own])

    def _source(self, name: str) -> tuple[WeightSource, str]:
        if name in self._served and name not in self._own:
            return self.target, self._served[name]
        return self.draft, name

    def _projection(self, name: str) -> str | None:
        """The draft's projection of the served tensor ``name`` (None: served as is)."""
        if self.projected and name in self._served and name not in self._own:
            return TARGET_PROJECTIONS[name]
        return None

    def shape(self, name: str) -> tuple[int, ...]:
        source, real = self._source(name)
        shape = tuple(source.shape(real))
        proj = self._projection(name)
        if proj is not None:  # [V, target hidden] @ [target hidden, hidden]
            shape = (shape[0], tuple(self.draft.shape(proj))[1])
        return shape

    def get(self, name: str, dim: int | None = None, start: int = 0,
            stop: int | None = None) -> torch.Tensor:
        source, real = self._source(name)
        proj = self._projection(name)
        if proj is None:
            return source.get(real, dim=dim, start=start, stop=stop)
        # rows of the product are the projected rows of the target's matrix (vocab shards)
        rows = source.get(real, dim=0, start=start, stop=stop) if dim == 0 else source.get(real)
        out = rows.float() @ self.draft.get(proj).float()
        if dim is not None and dim != 0:
            out = out.narrow(dim, start, (out.shape[dim] if stop is None else stop) - start)
        return out


def load_draft(spec: str | os.PathLike, target_ck: Checkpoint) -> Checkpoint:
    """Load the draft ``spec`` for running beside ``target_ck``: checks their compatibility
    (tokenizer, vocabulary; hidden size for a shared embedding) and, for a draft that uses its
    target's embedding, serves that embedding from the target's weights (dequantised for GGUF
    targets)."""
    draft = load_checkpoint(spec)
    check_draft_compatible(target_ck, draft)
    if not draft.config.embedding_from_target:
        return draft
    weights = TargetEmbeddingWeights(draft.weights, target_ck.weights,
                                     draft.config.tie_word_embeddings,
                                     projected=draft.config.projects_target_embedding)
    return Checkpoint(source=draft.source, config=draft.config, weights=weights,
                      tokenizer_factory=lambda: draft.tokenizer)


def materialize_hf(draft_dir: str, target_ck: Checkpoint, out_dir: str,
                   dtype: torch.dtype | None = None) -> str:
    """Write ``out_dir``: the draft of ``draft_dir`` as a standard HF Llama directory (the
    target's embedding stored, the flag removed) that transformers loads. Tensors are written in
    ``dtype`` (default: the draft's stored dtype). Other files of ``draft_dir`` (tokenizer,
    generation config) are copied. Returns ``out_dir``."""
    ck = load_draft(draft_dir, target_ck)
    directory = ck.source
    if not os.path.isdir(directory):
        raise CheckpointError(f"{draft_dir!r}: not an HF checkpoint directory")
    weights = ck.weights
    names = weights.names()
    if dtype is None:  # the stored dtype of the draft's own tensors
        own = [n for n in names if n not in TARGET_SHARED_TENSORS]
        dtype = weights.get(own[0]).dtype if own else torch.float32
    tensors = {n: weights.get(n).to(dtype).contiguous() for n in names}
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(directory):
        path = os.path.join(directory, f)
        if os.path.isfile(path) and f != "config.json" and not f.endswith(
                (".safetensors", ".safetensors.index.json")):
            shutil.copy(path, os.path.join(out_dir, f))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        raw = json.load(f)
    raw.pop(EMBEDDING_FROM_TARGET_KEY, None)
    raw.pop(TARGET_HIDDEN_SIZE_KEY, None)
    dtype_name = str(dtype).removeprefix("torch.")
    raw["torch_dtype"] = dtype_name
    if "dtype" in raw:
        raw["dtype"] = dtype_name  # transformers 5 name
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    return out_dir

