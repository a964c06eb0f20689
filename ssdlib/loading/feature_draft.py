"""A feature draft on disk (``ssdlib.models.feature_draft``): writing it, and loading it beside
its target.

The directory is HF-style. ``config.json`` holds the Llama fields of the draft's layers (the
target's width and heads, ``num_hidden_layers`` = the draft's), ``ssdlib_embedding_from_target``
(the embedding and LM head are the target's, not stored) and

    "ssdlib_feature_draft": {"target_hidden_size": H, "feature": "last_prenorm"}

(the target's hidden size, and which of its hidden states the draft reads: its last decoder
layer's output before the final norm), or, for EAGLE-3's fused features (three target layers'
outputs concatenated: ``ssdlib.models.feature_spec``),

    "ssdlib_feature_draft": {"target_hidden_size": H, "feature": "fused", "layers": [i, j, k]}

``model.safetensors`` holds only ``fc.weight`` (and ``fuse.weight`` for fused features),
``layers.N.*`` and ``norm.weight``: names no plain Llama has, so the directory is never
mistaken for a Llama draft. The tokenizer is the target's: its files, or
``tokenizer_source.json`` naming the target (as the shipped draft does), whose fingerprint is
checked at load.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from ssdlib.config import EMBEDDING_FROM_TARGET_KEY
from ssdlib.errors import CheckpointError
from ssdlib.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ssdlib.layers.subset_head import SubsetLMHead
from ssdlib.loading import registry
from ssdlib.loading.checkpoint import Checkpoint, load_checkpoint
from ssdlib.loading.compat import check_draft_compatible
from ssdlib.loading.hf_dir import SHARED_TOKENIZER_FILE
from ssdlib.models.feature_draft import FeatureDraft
from ssdlib.models.feature_spec import FeatureSpec
from ssdlib.models.llama import LlamaForCausalLM

FEATURE_DRAFT_KEY = "ssdlib_feature_draft"


def stored_mb(draft: FeatureDraft, storage_dtype: torch.dtype) -> float:
    """The stored tensors' size in MB (1e6 bytes) as ``storage_dtype`` (the safetensors header,
    a few kB, aside)."""
    itemsize = torch.empty((), dtype=storage_dtype).element_size()
    return sum(t.numel() for t in draft.stored_tensors().values()) * itemsize / 1e6


def check_max_mb(draft: FeatureDraft, storage_dtype: torch.dtype, max_mb: float | None) -> float:
    """``stored_mb``, after raising CheckpointError when it exceeds ``max_mb`` (None: no
    limit)."""
    mb = stored_mb(draft, storage_dtype)
    if max_mb is not None and mb > max_mb:
        raise CheckpointError(f"the feature draft needs {mb:.2f} MB as "
                              f"{str(storage_dtype).removeprefix('torch.')}, more than the "
                              f"limit of {max_mb:g} MB: use fewer layers")
    return mb


def tokenizer_source(same_as: str, target: Checkpoint) -> dict:
    """``tokenizer_source.json``'s content: the target's name (or path) and its tokenizer's
    fingerprint."""
    tok = target.tokenizer
    if tok is None:
        raise CheckpointError(f"target {target.source!r} has no tokenizer to name")
    return {"same_as": same_as, "fingerprint": tok.fingerprint()}


def save_feature_draft(draft: FeatureDraft, directory: str,
                       storage_dtype: torch.dtype = torch.float16,
                       tokenizer_ref: dict | None = None, max_mb: float | None = None) -> int:
    """Write ``directory``: model.safetensors (the stored tensors in ``storage_dtype``, written
    atomically, refused when larger than ``max_mb`` MB), config.json and, with
    ``tokenizer_ref`` (:func:`tokenizer_source`), tokenizer_source.json. Returns the
    safetensors file's size in bytes."""
    os.makedirs(directory, exist_ok=True)
    tensors = {name: t.detach().to("cpu", storage_dtype).contiguous()
               for name, t in draft.stored_tensors().items()}
    path = os.path.join(directory, "model.safetensors")
    save_file(tensors, path + ".tmp", metadata={"format": "pt"})
    size = os.path.getsize(path + ".tmp")
    if max_mb is not None and size > max_mb * 1e6:
        os.remove(path + ".tmp")
        raise CheckpointError(f"{path}: {size / 1e6:.2f} MB exceeds the limit of {max_mb:g} MB")
    os.chmod(path + ".tmp", 0o644)
    os.replace(path + ".tmp", path)
    dtype_name = str(storage_dtype).removeprefix("torch.")
    config = dict(draft.config.to_hf_dict(), torch_dtype=dtype_name, dtype=dtype_name)
    config[FEATURE_DRAFT_KEY] = {"target_hidden_size": draft.config.hidden_size,
                                 **draft.feature.to_config()}
    files = {"config.json": config}
    if tokenizer_ref is not None:
        files[SHARED_TOKENIZER_FILE] = tokenizer_ref
    for name, content in files.items():
        with open(os.path.join(directory, name), "w") as f:
            json.dump(content, f, indent=2)
    return size


def is_feature_draft(spec: str | os.PathLike | None) -> bool:
    """Whether ``spec`` (a named checkpoint, a directory or a file) is a feature draft: a
    directory whose config.json has the ``ssdlib_feature_draft`` entry."""
    return isinstance(registry.config_value(spec, FEATURE_DRAFT_KEY), dict)


def _feature_spec(directory: str) -> dict:
    """config.json's ``ssdlib_feature_draft`` entry (CheckpointError when there is none)."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            spec = json.load(f).get(FEATURE_DRAFT_KEY)
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if not isinstance(spec, dict):
        raise CheckpointError(f"{directory}: not a feature draft (config.json has no "
                              f"{FEATURE_DRAFT_KEY!r} entry)")
    return spec


def _parsed_spec(directory: str, entry: dict) -> FeatureSpec:
    """The FeatureSpec of a draft's config entry (CheckpointError, one line, when it is none)."""
    try:
        return FeatureSpec.from_config(entry)
    except ValueError as e:
        raise CheckpointError(f"feature draft {directory!r}: {e} (config.json "
                              f"{FEATURE_DRAFT_KEY})") from None


def _check_target_layers(directory: str, spec: FeatureSpec, target: Checkpoint) -> None:
    """CheckpointError unless ``target`` has the layers whose outputs ``spec`` reads."""
    n = target.config.num_hidden_layers
    try:
        spec.target_layers(n)
    except ValueError:
        raise CheckpointError(
            f"feature draft {directory!r} reads {spec.kind} features of layers "
            f"{list(spec.layers or ())} but the target {target.source!r} has {n} decoder layers "
            f"(0..{n - 1}): it runs only beside the target it was trained for") from None


def feature_spec_for(spec: str | os.PathLike, target: Checkpoint) -> FeatureSpec:
    """Which features of ``target`` the feature draft ``spec`` (a named checkpoint or a
    directory) reads, from its config.json: what the target's runner keeps for it. A
    CheckpointError (one line) when the entry is not a valid spec or the target lacks its
    layers; the rest of the pair is checked when the draft loads (``check_feature_pair``)."""
    directory = os.fspath(spec)
    directory = registry.resolve_named(directory) or directory
    parsed = _parsed_spec(directory, _feature_spec(directory))
    _check_target_layers(directory, parsed, target)
    return parsed


def check_feature_pair(directory: str, draft: Checkpoint, target: Checkpoint) -> FeatureSpec:
    """Raise CheckpointError (one line) unless the feature draft in ``directory`` runs beside
    ``target``: the features it reads are a kind ssdlib serves, of the target's width and, fused,
    of layers the target has; it shares the target's embedding, and tokenizer and vocabulary
    agree (``check_draft_compatible``). Returns the draft's FeatureSpec."""
    entry = _feature_spec(directory)
    spec = _parsed_spec(directory, entry)
    width = entry.get("target_hidden_size")
    if not draft.config.embedding_from_target:
        raise CheckpointError(f"feature draft {directory!r}: config.json must set "
                              f"{EMBEDDING_FROM_TARGET_KEY} (its embedding is the target's)")
    if width != draft.config.hidden_size:
        raise CheckpointError(
            f"feature draft {directory!r}: config.json says it reads features of width {width} "
            f"but its hidden_size is {draft.config.hidden_size} (a feature draft has its "
            "target's width)")
    if width != target.config.hidden_size:
        raise CheckpointError(
            f"feature draft {directory!r} reads features of width {width} but the target "
            f"{target.source!r} has hidden size {target.config.hidden_size}: it runs only beside "
            "the target it was trained for")
    _check_target_layers(directory, spec, target)
    check_draft_compatible(target, draft)
    return spec


def load_feature_draft(directory: str, target_ck: Checkpoint,
                       target_model: LlamaForCausalLM | None = None,
                       device: torch.device | str | None = None,
                       dtype: torch.dtype | None = None,
                       max_positions: int | None = None,
                       head_vocab: torch.Tensor | None = None) -> FeatureDraft:
    """The feature draft in ``directory``, its weights loaded, beside the target ``target_ck``
    (refused with a CheckpointError when the pair does not fit: ``check_feature_pair``). Its
    embedding and LM head are ``target_model``'s (shared) when given, else read from the
    target's weights (frozen); with ``head_vocab`` (token ids) its head scores those rows only
    (a copy of them, ``SubsetLMHead``). Parameters in ``dtype`` (default float32) on
    ``device``."""
    directory = os.fspath(directory)
    directory = registry.resolve_named(directory) or directory
    draft_ck = load_checkpoint(directory)
    spec = check_feature_pair(directory, draft_ck, target_ck)
    dtype = dtype or torch.float32
    with torch.device(device or "cpu"):
        if target_model is None:
            embed, head = _target_embedding_and_head(target_ck, dtype)
        else:
            embed, head = target_model.model.embed_tokens, target_model.lm_head
        if head_vocab is not None:
            head = SubsetLMHead.of(head, head_vocab)
        draft = FeatureDraft(draft_ck.config, embed, head, max_positions, spec)
    for p in draft.parameters():
        p.data = p.data.to(dtype)
    draft.load_weights(draft_ck.weights)
    return draft.requires_grad_(False).eval()


def _target_embedding_and_head(target: Checkpoint,
                               dtype: torch.dtype) -> tuple[VocabParallelEmbedding, ParallelLMHead]:
    """The target's embedding and LM head (tied or its own), loaded and frozen."""
    cfg = target.config
    embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
    head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, None,
                          embed if cfg.tie_word_embeddings else None)
    for module, name in ((embed, "model.embed_tokens"), (head, "lm_head")):
        for p in module.parameters(recurse=False):
            p.data = p.data.to(dtype)
        module.load(target.weights, name)
        module.requires_grad_(False)
    return embed, head
