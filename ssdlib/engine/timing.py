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

import time

import torch

from ssdlib import env
from ssdlib.errors import ConfigError


def time_every() -> int:
    """The sampling period of the round timers: ``SSDLIB_TIME_EVERY`` (default 1, every round)."""
    return env.integer("SSDLIB_TIME_EVERY")


class RoundTimer:
    """``start()``, then ``mark(phase)`` at the end of each phase, then ``add_to(seqs)``: each
    sequence's ``metrics[phase + "_s"]`` grows by the phase's seconds (times ``every`` on the
    timed rounds, nothing on the others: see the module doc).

    Reading a round's events back waits for its last mark and costs a few driver calls, on the
    host, between two rounds. ``add_to(seqs, defer=True)`` keeps the round instead, and
    ``flush()`` reads it later: the loop calls it once its next step is launched, so the reads
    overlap that step on the device (two sets of events alternate). A round in which some
    sequence finished is read at once, so its output carries all of its rounds."""

    def __init__(self, device: torch.device | str, every: int | None = None):
        self.cuda = torch.device(device).type == "cuda"
        self.every = time_every() if every is None else every
        if self.every < 1:
            raise ConfigError(f"every must be >= 1, got {self.every}")
        self._rounds = 0
        self.timed = False  # whether the round since the last start() is timed
        self._marks: list[tuple[str, object]] = []
        # two sets of events, reused round after round (creating one costs a driver call): a
        # deferred round keeps its set until flush()
        self._events: tuple[list, list] = ([], [])
        self._set = 0
        self._pending: tuple[list, list] | None = None  # (marks, seqs) of a deferred round

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        events = self._events[self._set]
        i = len(self._marks)
        if i == len(events):
            events.append(torch.cuda.Event(enable_timing=True))
        ev = events[i]
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

    def _read(self, marks) -> dict[str, float]:
        if len(marks) < 2:
            return {}
        if self.cuda:
            marks[-1][1].synchronize()
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(marks, marks[1:]):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[name] = out.get(name, 0.0) + dt
        return out

    def phases(self) -> dict[str, float]:
        """Seconds per phase of this round since ``start`` (waits for the last mark on GPU);
        empty on a round that is not timed."""
        return self._read(self._marks)

    def totals(self) -> dict[str, float]:
        """This round's phases as its share of the sums: times ``every`` (empty when not
        timed)."""
        return {name: dt * self.every for name, dt in self.phases().items()}

    def add_to(self, seqs, defer: bool = False) -> dict[str, float]:
        """Add the round's :meth:`totals` to ``seqs``' metrics; returns this round's phases
        (seconds; empty when not timed). ``defer``: keep the round for :meth:`flush` (returns
        {}) unless a sequence of it finished; a round kept before is flushed first."""
        flushed = self.flush()
        if defer and len(self._marks) > 1 and not any(q.finished for q in seqs):
            self._pending = (self._marks, list(seqs))
            self._marks = []
            self._set ^= 1
            return {}
        phases = self.phases()
        self._add(phases, seqs)
        return phases or flushed

    def flush(self) -> dict[str, float]:
        """Read and add the round kept by ``add_to(..., defer=True)``; returns its phases ({}
        when none is kept)."""
        if self._pending is None:
            return {}
        marks, seqs = self._pending
        self._pending = None
        phases = self._read(marks)
        self._add(phases, seqs)
        return phases

    def _add(self, phases: dict[str, float], seqs) -> None:
        for name, dt in phases.items():
            _add_seconds(seqs, name + "_s", dt * self.every)


def _add_seconds(seqs, key: str, dt: float) -> None:
    """Each sequence's ``metrics[key]`` grows by ``dt``."""
    for q in seqs:
        q.metrics[key] = q.metrics.get(key, 0.0) + dt


HOST_PREFIX = "h_"  # host-clock segments' metric keys: h_<segment>_s (not device phases)


class HostClock:
    """``SSDLIB_HOST_TIMES=1``: where a loop's round spends host time, by the host clock (the
    device marks of :class:`RoundTimer` say when the GPU reached each point, not what the host
    was doing). ``start()``, ``tick(segment)`` after each segment, ``add_to(seqs)``: each
    sequence's ``metrics["h_<segment>_s"]`` grows by the segment's seconds; ``between`` is the
    time from the end of one round to the start of the next when nothing else came between
    them (``admitted()``: sequences joined, e.g. the next prompt's prefill at b = 1, or a new
    generate call). Off: one check a call."""

    def __init__(self, on: bool | None = None):
        self.on = env.flag("SSDLIB_HOST_TIMES") if on is None else on
        self._t = 0.0
        self._end: float | None = None
        self._segments: dict[str, float] = {}

    def start(self) -> None:
        if self.on:
            self._t = time.perf_counter()
            if self._end is not None:
                self._segments["between"] = self._t - self._end

    def tick(self, segment: str) -> None:
        if self.on:
            now = time.perf_counter()
            self._segments[segment] = self._segments.get(segment, 0.0) + now - self._t
            self._t = now

    def admitted(self) -> None:
        """Sequences joined since the last round: the next round's ``between`` is not timed
        (it would count the admission)."""
        self._end = None

    def take(self) -> dict[str, float]:
        """The segments since the last take / add_to (seconds), and a fresh start for the
        next round's ``between``."""
        segments, self._segments = self._segments, {}
        if self.on:
            self._end = time.perf_counter()
        return segments

    def add_to(self, seqs) -> None:
        if self.on:
            for name, dt in self.take().items():
                _add_seconds(seqs, f"{HOST_PREFIX}{name}_s", dt)
