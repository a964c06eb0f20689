"""Opt-in profiles for finding where a round's wall time goes (``SSDLIB_PROFILE=DIR``).

- The leader profiles one ``generate`` call of each engine: the ``SSDLIB_PROFILE_CALL``-th
  after the engine's own warm-up (default 1; the warm-up's calls are never counted, however
  many batches it runs; ``tools/bench.py`` makes it 2, its first timed pass):
  ``DIR/<mode>-leader.trace.json.gz``.
- The speculator rank profiles a window of its OUTCOME rounds (``SSDLIB_PROFILE_ROUNDS=W:N``,
  default 200:100: rounds W .. W+N-1 since the rank started): ``DIR/<mode>-speculator...``.

Each is a torch.profiler Chrome trace (CPU ops, CUDA runtime calls and kernels on one
timeline). ``SSDLIB_PROFILE_PY=1`` adds a cProfile dump (``.pstats``: Python time per function;
it slows Python down, so the trace's host gaps grow with it). Off, each costs one check a call.
"""

from __future__ import annotations

import cProfile
import contextlib
import gzip
import os
import shutil

import torch

from ssdlib import env
from ssdlib.log import get_logger

log = get_logger(__name__)


class _Session:
    """One profiled span: torch.profiler (+ cProfile) from ``start`` to ``stop``."""

    def __init__(self, stem: str):
        self.stem = stem
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.torch_prof = torch.profiler.profile(activities=activities)
        self.py_prof = cProfile.Profile() if env.flag("SSDLIB_PROFILE_PY") else None

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.stem) or ".", exist_ok=True)
        self.torch_prof.start()
        if self.py_prof is not None:
            self.py_prof.enable()

    def stop(self) -> None:
        if self.py_prof is not None:
            self.py_prof.disable()
            self.py_prof.dump_stats(self.stem + ".pstats")
        self.torch_prof.stop()
        raw = self.stem + ".trace.json"
        self.torch_prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
        log.warning("profile written: %s.trace.json.gz", self.stem)


class CallProfiler:
    """``with profiler.call(): ...`` around each generate call; profiles the chosen one."""

    def __init__(self, mode: str):
        self.dir = env.text("SSDLIB_PROFILE")
        self.stem = None if self.dir is None else os.path.join(self.dir, f"{mode}-leader")
        self.which = env.integer("SSDLIB_PROFILE_CALL")
        self.calls = 0

    @contextlib.contextmanager
    def call(self, counted: bool = True):
        """Around one generate call; ``counted=False`` (the engine's warm-up) is never
        profiled and does not advance the count."""
        self.calls += counted
        if self.stem is None or not counted or self.calls != self.which:
            yield
            return
        session = _Session(self.stem)
        session.start()
        try:
            yield
        finally:
            session.stop()


class RoundProfiler:
    """``tick()`` once per round; profiles rounds W .. W+N-1 (``SSDLIB_PROFILE_ROUNDS``)."""

    def __init__(self, name: str):
        d = env.text("SSDLIB_PROFILE")
        self.stem = None if d is None else os.path.join(d, name)
        first, count = env.window("SSDLIB_PROFILE_ROUNDS")
        self.first, self.end = first, first + count
        self.rounds = 0
        self._session: _Session | None = None

    def tick(self) -> None:
        if self.stem is None:
            return
        if self.rounds == self.first:
            self._session = _Session(self.stem)
            self._session.start()
        self.rounds += 1
        if self.rounds == self.end and self._session is not None:
            self._session.stop()
            self._session = None

    def close(self) -> None:
        """Write a window cut short (the rank stops before its end)."""
        if self._session is not None:
            self._session.stop()
            self._session = None
