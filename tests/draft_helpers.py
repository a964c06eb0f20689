"""Helpers for tests of drafts: a checkpoint's logits, and the in-memory draft that
tools/distill_draft.py exports."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ssdlib.models.llama import LlamaForCausalLM


def checkpoint_logits(ck, ids: torch.Tensor, max_positions: int = 64) -> torch.Tensor:
    """forward_full logits [b, s, V] of the model that checkpoint ``ck`` loads."""
    model = LlamaForCausalLM(ck.config, max_positions=max_positions)
    model.load_weights(ck.weights)
    with torch.no_grad():
        return model.forward_full(ids)


@contextmanager
def captured_export():
    """Within it, tools.distill.models.export_hf also records the draft module it writes:
    the yielded dict's "draft" is the last one (the trained draft, in memory)."""
    import tools.distill.models as models

    captured: dict = {}
    real_export = models.export_hf

    def export(draft, ck, out_dir, storage_dtype):
        captured["draft"] = draft
        return real_export(draft, ck, out_dir, storage_dtype)

    models.export_hf = export
    try:
        yield captured
    finally:
        models.export_hf = real_export
