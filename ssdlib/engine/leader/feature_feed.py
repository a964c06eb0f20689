"""The leader's side of a feature draft's speculator (SSD, ``engine/speculator/feature_build.py``):
with each OUTCOME, the target's features of the positions each row committed since its last
OUTCOME, gathered from the target's feature buffer (``KVCache.features``) on the device into a
``protocol.FeatureRows``. Nothing is read back to the host."""

from __future__ import annotations

import torch

from ssdlib.distributed.protocol import FeatureRows


class FeatureFeed:
    """Per slot, how many leading positions' features the speculator has been sent."""

    def __init__(self, features: torch.Tensor):
        self.features = features  # [slots, max_len, W], written by every target forward
        self.sent: dict[int, int] = {}

    def admit(self, slot: int) -> None:
        self.sent[slot] = 0

    def rows(self, seqs, alive: list[bool], extra: int = 0) -> FeatureRows:
        """The features of each live row of ``seqs`` (an OUTCOME's rows, in order; ``extra``
        rows after them, leaving, get none): positions [sent, L - 1) of a row with L committed
        tokens, every one the target has fed; one gather on the device."""
        starts, counts = [], []
        for q, a in zip(seqs, alive):
            start = self.sent.get(q.slot, 0)
            end = len(q.tokens) - 1 if a else start
            if end < start:
                raise RuntimeError(f"slot {q.slot}: {len(q.tokens)} committed tokens, but the "
                                   f"features of {start} positions were sent")
            starts.append(start)
            counts.append(end - start)
            if a:
                self.sent[q.slot] = end
        return FeatureRows.gather(self.features, [q.slot for q in seqs] + [0] * extra,
                                  starts + [0] * extra, counts + [0] * extra)
