"""Draft/target compatibility: speculation is only meaningful over one shared vocabulary."""

from __future__ import annotations

from ssdlib.config import EMBEDDING_FROM_TARGET_KEY, TARGET_HIDDEN_SIZE_KEY, ModelConfig
from ssdlib.errors import CheckpointError
from ssdlib.loading.checkpoint import Checkpoint


def check_draft_vocab(target: ModelConfig, draft: ModelConfig, target_source: str = "target",
                      draft_source: str = "draft") -> None:
    """Raise CheckpointError unless the draft can read every token id the target can emit.

    The target samples from all of its embedding rows, and every committed token is fed to the
    draft, so the draft needs at least as many rows. (More is fine: the draft's extra logits are
    cut off.) Needs the configs only, so it runs before any weight is read.

    A draft that uses the target's embedding (``embedding_from_target``) must also have exactly
    the target's vocabulary size and hidden size (for a narrower one, ``target_hidden_size``):
    it reads the target's embedding matrix as is.
    """
    if draft.embedding_from_target:
        width = ("hidden_size" if draft.target_hidden_size is None
                 else f"{TARGET_HIDDEN_SIZE_KEY} (the width its projections read)")
        for what, t, d in ((width, target.hidden_size,
                            draft.target_hidden_size or draft.hidden_size),
                           ("vocab_size", target.vocab_size, draft.vocab_size)):
            if t != d:
                raise CheckpointError(
                    f"draft {draft_source!r} uses its target's embedding ("
                    f"{EMBEDDING_FROM_TARGET_KEY}) but its {what} is {d} and the target "
                    f"{target_source!r} has {t}: such a draft only runs with a target of "
                    f"hidden size {draft.target_hidden_size or draft.hidden_size} and "
                    f"vocab_size {draft.vocab_size}")
    if draft.vocab_size < target.vocab_size:
        raise CheckpointError(
            f"draft {draft_source!r} has {draft.vocab_size} embedding rows but the target "
            f"{target_source!r} can emit token ids up to {target.vocab_size - 1}: the draft could "
            "not read them; use a draft whose vocabulary covers the target's")


def check_draft_compatible(target: Checkpoint, draft: Checkpoint) -> None:
    """Raise CheckpointError unless draft and target tokenize identically and the draft reads
    every id the target can emit.

    Embedding-row counts may differ (checkpoints pad their vocab differently) when the tokenizers
    are identical, as long as the draft has at least the target's rows; without tokenizer files
    on either side the vocab sizes must match exactly.
    """
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None:
        if tt is not dt and tt.fingerprint() != dt.fingerprint():  # (one file: one object)
            diff = _first_difference(tt, dt)
            raise CheckpointError(
                f"draft {draft.source!r} and target {target.source!r} have different tokenizers"
                f"{diff}; speculative decoding needs a draft trained on the target's tokenizer")
        check_draft_vocab(target.config, draft.config, target.source, draft.source)
        return
    if target.config.vocab_size != draft.config.vocab_size:
        raise CheckpointError(
            f"draft vocab size {draft.config.vocab_size} != target vocab size "
            f"{target.config.vocab_size} ({draft.source!r} vs {target.source!r})")
    check_draft_vocab(target.config, draft.config, target.source, draft.source)


def _first_difference(a, b) -> str:
    va, vb = a.get_vocab(), b.get_vocab()
    if len(va) != len(vb):
        return f" ({len(vb)} vs {len(va)} tokens)"
    for tok, i in va.items():
        if vb.get(tok) != i:
            return f" (token {tok!r} is id {i} in the target, {vb.get(tok)} in the draft)"
    return " (special tokens differ)"
