"""The static inputs of captured steps: one int64 arena on the device, one copy a step.

A captured step reads its inputs from tensors that outlive it. ``StaticInputs`` holds them as
named segments of one flat int64 device tensor, each room for ``[max_rows, cols]`` (a row per
batch row), and a numpy mirror of it on the host. A step fills its rows on the host (numpy: a few µs; torch's
small CPU ops cost ~50 µs each), inputs already on the device are queued, and ``upload()``
sends the whole mirror in ONE host-to-device copy, then copies the queued device inputs device
to device.

Batches are padded to a bucket (1, 2, 4, 8, then steps of 8) with ghost rows past the real ones;
each segment has its ghost value (the scratch slot, position 0, limit 1, a greedy parameter row,
...), so a ghost row writes only what no real row reads. A step's view of a segment is its first
``rows * cols`` values, ``[rows, cols]`` row-major: the view of a smaller bucket is a prefix of a
larger one's, so one fill serves every bucket (``fill_rows``, ``capture_buckets``). A segment
marked ``float64`` holds a float64 table as its bits (both views come in float64).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

# Batch buckets (nano-vllm's habit): 1, 2, 4, 8, then steps of 8.
SMALL_BUCKETS = (1, 2, 4, 8)


def batch_bucket(b: int) -> int:
    """The captured batch size that serves ``b`` rows."""
    for size in SMALL_BUCKETS:
        if b <= size:
            return size
    return -(-b // 8) * 8


def batch_buckets(rows: int) -> list[int]:
    """Every captured batch size up to the one that serves ``rows`` rows, ascending."""
    out, b = [], 1
    while not out or out[-1] < batch_bucket(rows):
        out.append(batch_bucket(b))
        b = out[-1] + 1
    return out


class Segment(NamedTuple):
    """One named input: up to ``cols`` values a row; rows past the real ones take ``ghost`` (a
    scalar, or one row of ``cols`` values); ``float64``: a float64 table stored as its bits."""

    cols: int
    ghost: int | float | Sequence[float] = 0
    float64: bool = False


class StaticInputs:
    """Named segments over one int64 device tensor, a numpy host mirror, one copy a step.

    Args:
        device: where the captured steps run.
        max_batch: the most real rows a step has (the segments hold its bucket's rows).
        segments: name -> :class:`Segment`, laid out in this order.
        all_buckets: a step captured for one batch bucket is captured for every bucket up to
            ``max_rows`` at once, so every fill covers ``max_rows`` rows (ghosts past the real).
    """

    def __init__(self, device: torch.device | str, max_batch: int,
                 segments: Mapping[str, Segment], all_buckets: bool = False):
        self.max_rows = batch_bucket(max_batch)
        self.all_buckets = all_buckets
        self.segments = dict(segments)
        self.offsets: dict[str, int] = {}
        size = 0
        for name, seg in self.segments.items():
            if seg.cols < 1:
                raise ValueError(f"segment {name!r} needs cols >= 1, got {seg.cols}")
            self.offsets[name] = size
            size += self.max_rows * seg.cols
        self.size = size
        self.arena = torch.zeros(size, dtype=torch.int64, device=device)
        # reused for every step: a copy from pageable memory is staged before it returns, so
        # the next fill cannot race it
        self.host = np.zeros(size, dtype=np.int64)
        self._host_t = torch.from_numpy(self.host)
        self._device_inputs: list[tuple[str, int, int | None, torch.Tensor]] = []

    def fill_rows(self, rows: int) -> int:
        """Rows to fill for a step of batch bucket ``rows``: every bucket's with
        ``all_buckets``."""
        return self.max_rows if self.all_buckets else rows

    def capture_buckets(self, rows: int) -> list[int]:
        """The batch buckets to capture when ``rows`` is first needed (``rows`` last)."""
        if not self.all_buckets:
            return [rows]
        return [r for r in batch_buckets(self.max_rows) if r != rows] + [rows]

    def _span(self, name: str, rows: int, cols: int | None) -> tuple[int, int]:
        seg = self.segments[name]
        width = 1 if cols is None else cols
        if rows > self.max_rows or width > seg.cols:
            raise ValueError(f"segment {name!r} holds [{self.max_rows}, {seg.cols}], "
                             f"asked for [{rows}, {width}]")
        start = self.offsets[name]
        return start, start + rows * width

    def view(self, name: str, rows: int, cols: int | None = None) -> torch.Tensor:
        """The device view ``[rows, cols]`` of a segment (``cols`` None: ``[rows]``)."""
        start, end = self._span(name, rows, cols)
        out = self.arena[start:end]
        if cols is not None:
            out = out.view(rows, cols)
        return out.view(torch.float64) if self.segments[name].float64 else out

    def host_view(self, name: str, rows: int, cols: int | None = None) -> np.ndarray:
        """The host mirror's view ``[rows, cols]`` of a segment (``cols`` None: ``[rows]``)."""
        start, end = self._span(name, rows, cols)
        out = self.host[start:end]
        if cols is not None:
            out = out.reshape(rows, cols)
        return out.view(np.float64) if self.segments[name].float64 else out

    def put(self, name: str, rows: int, values, cols: int | None = None) -> None:
        """Rows ``[:b]`` of a segment from ``values`` (b = len(values)): nested lists [b, cols]
        (or [b] with ``cols`` None), or an array or tensor [b, ...] of b * cols values; a
        device tensor is copied device to device at :meth:`upload`. Rows ``[b:rows]`` take the
        segment's ghost value."""
        hv = self.host_view(name, rows, cols)
        if isinstance(values, torch.Tensor):
            if not values.is_cpu:
                b = values.shape[0]
                self._device_inputs.append((name, b, cols, values))
                if rows > b:
                    hv[b:] = self.segments[name].ghost
                return
            values = values.numpy()
        if isinstance(values, np.ndarray):
            b = values.shape[0]
            if values.ndim != hv.ndim:
                values = values.reshape(hv[:b].shape)
        else:
            b = len(values)
        hv[:b] = values
        if rows > b:
            hv[b:] = self.segments[name].ghost

    def upload(self) -> None:
        """The host mirror to the device in one copy, then the queued device inputs."""
        self.arena.copy_(self._host_t, non_blocking=True)
        for name, b, cols, src in self._device_inputs:
            dst = self.view(name, b, cols)
            dst.copy_(src.reshape(dst.shape))
        self._device_inputs.clear()
