"""A draft's vocabulary: the target's tokens ranked by how often the target writes them.

A draft directory may hold ``draft_vocab.safetensors``: ``ranked`` (int32 [n], token ids, most
frequent first; the tokenizer's special tokens lead) and ``counts`` (int64 [n], their counts in
the text it was ranked on). ``tools/distill_data.py vocab`` writes it from a distillation data
file (the target's own samples). The engine's ``draft_vocab`` setting takes the first N of the
ranking (plus the target's end-of-sequence tokens) as the only tokens the draft proposes, and
computes its LM head over those rows only (``ssdlib.layers.subset_head``). A draft trained
over such a vocabulary (``tools/distill_feature_draft.py --draft-vocab N``) says so in its
config.json (``ssdlib_draft_vocab``: N), and the engine runs it with that vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ssdlib.errors import CheckpointError, ConfigError
from ssdlib.layers.subset_head import token_id_problem
from ssdlib.loading import registry

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
# config.json key of a draft trained over the first N tokens of its ranking: N (the engine's
# --draft-vocab auto then takes N, on every device)
TRAINED_VOCAB_KEY = "ssdlib_draft_vocab"


def ranking_path(spec: str | os.PathLike | None) -> str | None:
    """The ranking file of the draft ``spec`` (a named checkpoint or a directory), or None
    when it has none (a GGUF file, a directory without one, a named draft not found)."""
    path = registry.path_of(spec)
    candidate = None if path is None else os.path.join(path, DRAFT_VOCAB_FILE)
    return candidate if candidate is not None and os.path.isfile(candidate) else None


def read_ranking(path: str, vocab_size: int) -> torch.Tensor:
    """The ranked token ids (int64 [n]) of the ranking file ``path``; CheckpointError (one
    line) when the file is not a ranking of distinct ids in [0, vocab_size)."""
    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{path}: not a readable draft vocabulary ({e})") from None
    ranked = tensors.get("ranked")
    if ranked is None or ranked.dtype not in (torch.int32, torch.int64):
        raise CheckpointError(f"{path}: a draft vocabulary holds 'ranked', a non-empty vector "
                              "of integer token ids")
    problem = token_id_problem(ranked, vocab_size)
    if problem is not None:
        raise CheckpointError(f"{path}: a draft vocabulary {problem} (the target's vocabulary)")
    return ranked.to(torch.int64)


def write_ranking(directory: str, ranked: torch.Tensor, counts: torch.Tensor) -> str:
    """Write ``directory``/draft_vocab.safetensors; returns its path."""
    if ranked.shape != counts.shape or ranked.dim() != 1:
        raise ValueError("ranked and counts must be vectors of one length")
    path = os.path.join(directory, DRAFT_VOCAB_FILE)
    save_file({"ranked": ranked.to(torch.int32).contiguous(),
               "counts": counts.to(torch.int64).contiguous()}, path,
              metadata={"format": "pt"})
    return path


def first_tokens(ranked: torch.Tensor, size: int, vocab_size: int,
                 always: Iterable[int] = ()) -> torch.Tensor:
    """The first ``size`` ids of ``ranked`` plus the ids ``always`` (those inside the
    vocabulary), sorted and distinct (int64)."""
    extra = torch.tensor(sorted({int(t) for t in always if 0 <= int(t) < vocab_size}),
                         dtype=torch.int64)
    return torch.cat([ranked[:size].to(torch.int64), extra]).unique()


def trained_size(spec: str | os.PathLike | None) -> int | None:
    """The vocabulary a draft was trained over (config.json's ``ssdlib_draft_vocab``: the first
    N of its ranking), or None (trained over the full vocabulary, or not a directory)."""
    value = registry.config_value(spec, TRAINED_VOCAB_KEY)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{os.fspath(spec)}: config.json's {TRAINED_VOCAB_KEY} must be a "
                              f"number of tokens >= 1, got {value!r:.40}")
    return value


def draft_token_ids(spec: str | os.PathLike, size: int, vocab_size: int,
                    always: Iterable[int] = ()) -> torch.Tensor:
    """The draft vocabulary of ``size`` tokens: the first ``size`` of the draft ``spec``'s
    ranking, plus the ids ``always`` (the target's end-of-sequence tokens), sorted (int64).
    ConfigError when the draft has no ranking or ranks fewer than ``size`` tokens."""
    path = ranking_path(spec)
    if path is None:
        raise ConfigError(f"--draft-vocab {size}: the draft {os.fspath(spec)!r} has no "
                          f"{DRAFT_VOCAB_FILE} (tools/distill_data.py vocab writes one)")
    ranked = read_ranking(path, vocab_size)
    if size > ranked.numel():
        raise ConfigError(f"--draft-vocab {size}: the draft {os.fspath(spec)!r} ranks "
                          f"{ranked.numel():,} tokens")
    return first_tokens(ranked, size, vocab_size, always)
