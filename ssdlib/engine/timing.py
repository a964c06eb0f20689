"""Where a round's time goes: phase marks on the device's stream (CUDA events; host clocks on
CPU), read back once per round after the round's own synchronisation.

GPU work is asynchronous, so host clocks around a phase measure how long it took to *enqueue*;
events measure when the GPU reached each mark, which is what a per-round breakdown needs.
"""

from __future__ import annotations

import time

import torch


class RoundTimer:
    """``start()``, then ``mark(phase)`` at the end of each phase, then ``add_to(seqs)``: each
    sequence's ``metrics[phase + "_s"]`` grows by the phase's seconds."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list[tuple[str, object]] = []
        self._events: list = []  # reused round after round (creating one costs a driver call)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        i = len(self._marks)
        if i == len(self._events):
            self._events.append(torch.cuda.Event(enable_timing=True))
        ev = self._events[i]
        ev.record()
        return ev

    def start(self) -> None:
        self._marks = []  # first: _now picks its event by the number of marks so far
        self._marks = [("", self._now())]

    def mark(self, phase: str) -> None:
        self._marks.append((phase, self._now()))

    def phases(self) -> dict[str, float]:
        """Seconds per phase since ``start`` (waits for the last mark on GPU)."""
        if len(self._marks) < 2:
            return {}
        if self.cuda:
            self._marks[-1][1].synchronize()
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self._marks, self._marks[1:]):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[name] = out.get(name, 0.0) + dt
        return out

    def add_to(self, seqs) -> dict[str, float]:
        """Add the round's phases to ``seqs``' metrics; returns them (seconds)."""
        phases = self.phases()
        for name, dt in phases.items():
            key = name + "_s"
            for q in seqs:
                q.metrics[key] = q.metrics.get(key, 0.0) + dt
        return phases
