"""The leader's side of a feature draft's speculator (SSD, ``engine/speculator/feature_build.py``):
with each OUTCOME, the target's features of the positions each row committed since its last
OUTCOME, gathered from the target's feature buffer (``KVCache.features``) on the device into a
``protocol.FeatureRows``. Nothing is read back to the host."""

from __future__ import annotations

import numpy as np
import torch

from ssdlib.distributed.protocol import FeatureRows


class FeatureFeed:
    """Per slot, how many leading positions' features the speculator has been sent."""

    def __init__(self, features: torch.Tensor):
        self.features = features  # [slots, max_len, W], written by every target forward
        self.device = features.device
        self.sent: dict[int, int] = {}

    def admit(self, slot: int) -> None:
        self.sent[slot] = 0

    def release(self, slot: int) -> None:
        self.sent.pop(slot, None)

    def rows(self, seqs, alive: list[bool], extra: int = 0) -> FeatureRows:
        """The features of each live row of ``seqs`` (an OUTCOME's rows, in order; ``extra``
        rows after them, leaving, get none): positions [sent, L - 1) of a row with L committed
        tokens, every one the target has fed; one gather on the device."""
        starts, counts, slots = [], [], []
        for q, a in zip(seqs, alive):
            start = self.sent.get(q.slot, 0)
            end = len(q.tokens) - 1 if a else start
            if end < start:
                raise RuntimeError(f"slot {q.slot}: {len(q.tokens)} committed tokens, but the "
                                   f"features of {start} positions were sent")
            starts.append(start)
            counts.append(end - start)
            slots.append(q.slot)
            if a:
                self.sent[q.slot] = end
        starts += [0] * extra
        counts += [0] * extra
        slots += [0] * extra
        width = max(max(counts, default=0), 1)
        # [rows, 1 + width]: the slot, then the span's positions (padding clamped in the buffer)
        index = np.empty((len(slots), 1 + width), dtype=np.int64)
        index[:, 0] = slots
        index[:, 1:] = np.minimum(np.asarray(starts).reshape(-1, 1) + np.arange(width),
                                  self.features.shape[1] - 1)
        index = torch.from_numpy(index).to(self.device, non_blocking=True)
        values = self.features[index[:, :1], index[:, 1:]]
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return FeatureRows(starts, counts, values, ready)
