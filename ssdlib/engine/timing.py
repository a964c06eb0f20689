"""Where a round's time goes: phase marks on the device's stream (CUDA events; host clocks on
CPU), read back once per round after the round's own synchronisation.

GPU work is asynchronous, so host clocks around a phase measure how long it took to *enqueue*;
events measure when the GPU reached each mark, which is what a per-round breakdown needs.

Every mark is a driver call (an event record), which costs host time on the critical path where
launches are slow. ``SSDLIB_TIME_EVERY=N`` (default 1) times one round in N: the others record
nothing, and a timed round's phases count N times in the sums (an unbiased estimate of the
totals over many rounds; per-round means stay comparable).
"""

from __future__ import annotations

import os
import time

import torch

from ssdlib.errors import ConfigError


def time_every() -> int:
    """The sampling period of the round timers: ``SSDLIB_TIME_EVERY`` (default 1, every round)."""
    raw = os.environ.get("SSDLIB_TIME_EVERY", "1").strip()
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"SSDLIB_TIME_EVERY must be an integer >= 1, got {raw!r}")
    return int(raw)


class RoundTimer:
    """``start()``, then ``mark(phase)`` at the end of each phase, then ``add_to(seqs)``: each
    sequence's ``metrics[phase + "_s"]`` grows by the phase's seconds (times ``every`` on the
    timed rounds, nothing on the others: see the module doc)."""

    def __init__(self, device: torch.device | str, every: int | None = None):
        self.cuda = torch.device(device).type == "cuda"
        self.every = time_every() if every is None else every
        if self.every < 1:
            raise ConfigError(f"every must be >= 1, got {self.every}")
        self._rounds = 0
        self.timed = False  # whether the round since the last start() is timed
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
        self.timed = self._rounds % self.every == 0
        self._rounds += 1
        self._marks = []  # first: _now picks its event by the number of marks so far
        if self.timed:
            self._marks = [("", self._now())]

    def mark(self, phase: str) -> None:
        if self.timed:
            self._marks.append((phase, self._now()))

    def phases(self) -> dict[str, float]:
        """Seconds per phase of this round since ``start`` (waits for the last mark on GPU);
        empty on a round that is not timed."""
        if len(self._marks) < 2:
            return {}
        if self.cuda:
            self._marks[-1][1].synchronize()
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self._marks, self._marks[1:]):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[name] = out.get(name, 0.0) + dt
        return out

    def totals(self) -> dict[str, float]:
        """This round's phases as its share of the sums: times ``every`` (empty when not
        timed)."""
        return {name: dt * self.every for name, dt in self.phases().items()}

    def add_to(self, seqs) -> dict[str, float]:
        """Add the round's :meth:`totals` to ``seqs``' metrics; returns this round's phases
        (seconds; empty when not timed)."""
        phases = self.phases()
        for name, dt in phases.items():
            key = name + "_s"
            for q in seqs:
                q.metrics[key] = q.metrics.get(key, 0.0) + dt * self.every
        return phases
