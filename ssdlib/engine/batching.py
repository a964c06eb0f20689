"""Packing ragged rows (different lengths, different start positions) into one forward."""

from __future__ import annotations

import numpy as np
import torch


def pack_rows(rows: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``rows`` into ids [b, s] and positions [b, s], on the host (model runners copy
    them to the device with the rest of a step's inputs).

    Row i's tokens go to positions starts[i], starts[i]+1, ...; padding continues the positions
    (its KV lands beyond the row's length, where it is never attended to and later overwritten).
    """
    s = max(len(r) for r in rows)
    # built in numpy: a few µs where torch's small CPU ops cost ~50 µs (every round, both models)
    ids = np.zeros((len(rows), s), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    positions = np.asarray(starts, dtype=np.int64).reshape(-1, 1) + np.arange(s, dtype=np.int64)
    return torch.from_numpy(ids), torch.from_numpy(positions)


def slots_tensor(seqs) -> torch.Tensor:
    return torch.tensor([q.slot for q in seqs], dtype=torch.int64)


def prefill(model, seqs, starts: list[int] | None = None) -> torch.Tensor:
    """Run the committed tokens of ``seqs`` through ``model`` (a target executor or a model
    runner), filling their KV slots: every one, or each row's from its ``starts`` position on.
    Returns logits [b, V] at each row's last position."""
    starts = [0] * len(seqs) if starts is None else starts
    rows = [q.tokens[st:] for q, st in zip(seqs, starts)]
    ids, pos = pack_rows(rows, starts)
    return model.forward(ids, pos, slots_tensor(seqs), last_index([len(r) for r in rows]))[:, 0]


def last_index(lengths: list[int]) -> torch.Tensor:
    """logits_index [b, 1] selecting each row's last real token."""
    return torch.tensor([[n - 1] for n in lengths], dtype=torch.int64)


def to_device(data, device) -> torch.Tensor:
    """Host data (nested lists of ints) -> an int64 tensor on ``device`` without a host sync:
    ``torch.tensor(data, device=cuda)`` waits for the stream to drain, an asynchronous copy from
    pageable memory does not (the data is staged before the call returns)."""
    return torch.tensor(data, dtype=torch.int64).to(device, non_blocking=True)
