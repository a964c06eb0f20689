"""Opt-in profile of the leader's generate calls, for finding where a round's wall time goes.

``SSDLIB_PROFILE=DIR`` (environment) makes the leader profile one ``generate`` call of each
engine (``SSDLIB_PROFILE_CALL``, default 2: the first timed call after a warm-up) with cProfile
(``DIR/<mode>-leader.pstats``: Python time per function) and torch.profiler (CPU ops and CUDA
kernels, ``DIR/<mode>-leader.trace.json.gz``, a Chrome trace). Off, it costs one check a call.
"""

from __future__ import annotations

import contextlib
import cProfile
import gzip
import os
import shutil

from ssdlib.log import get_logger

log = get_logger(__name__)


class CallProfiler:
    """``with profiler.call(): ...`` around each generate call; profiles the chosen one."""

    def __init__(self, mode: str):
        self.mode = mode
        self.dir = os.environ.get("SSDLIB_PROFILE") or None
        self.which = int(os.environ.get("SSDLIB_PROFILE_CALL", "2"))
        self.calls = 0

    @contextlib.contextmanager
    def call(self):
        self.calls += 1
        if self.dir is None or self.calls != self.which:
            yield
            return
        import torch

        os.makedirs(self.dir, exist_ok=True)
        stem = os.path.join(self.dir, f"{self.mode}-leader")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = cProfile.Profile()
        with torch.profiler.profile(activities=activities) as tprof:
            prof.enable()
            try:
                yield
            finally:
                prof.disable()
        prof.dump_stats(stem + ".pstats")
        tprof.export_chrome_trace(stem + ".trace.json")
        with open(stem + ".trace.json", "rb") as src, gzip.open(stem + ".trace.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(stem + ".trace.json")
        log.warning("profiled generate call %d: %s.{pstats,trace.json.gz}", self.calls, stem)
