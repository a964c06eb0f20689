"""The server's life, on its event loop: start-up (warm-up, then serving), and a graceful stop.

Phases, in order: ``starting`` (the warm-up runs: ``/health`` and every request answer 503),
``ready`` (requests are served), ``stopping`` (503 again: a stop was asked for; the requests in
flight may finish within ``shutdown_timeout_s``, then whatever still runs is cancelled, which
ends each stream cleanly with finish reason "abort"), ``stopped`` (``on_stopped`` was called: the
HTTP server exits, the engine closes).

The models are loaded before the HTTP server starts; this module takes a started
:class:`AsyncEngine`'s generator from its warm-up to its end.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from ssdlib.log import get_logger, progress_logger
from ssdlib.serve.async_engine import AsyncEngine

log = get_logger(__name__)
progress = progress_logger()  # the phases: shown at the default log level

STARTING, READY, STOPPING, STOPPED = "starting", "ready", "stopping", "stopped"
# after the grace period, how long the cancelled requests get to deliver their last delta
CANCEL_WAIT_S = 10.0
POLL_S = 0.05


class ServerLifecycle:
    """``warmup()`` (blocking, run on a worker thread, or None) runs before the engine serves;
    its argument is a callable that says whether a stop was asked for. ``on_stopped()`` is
    called once the requests in flight are done after :meth:`request_stop`."""

    def __init__(self, engine: AsyncEngine, warmup: Callable | None = None,
                 shutdown_timeout_s: float = 30.0, on_stopped: Callable[[], None] | None = None):
        if not isinstance(shutdown_timeout_s, (int, float)) or shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be a number >= 0, got "
                             f"{shutdown_timeout_s!r}")
        self.engine = engine
        self.warmup = warmup
        self.shutdown_timeout_s = float(shutdown_timeout_s)
        self.on_stopped = on_stopped
        self.phase = STARTING
        self.address: str | None = None  # "http://host:port", once the server listens
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bring_up: asyncio.Task | None = None
        self._stop: asyncio.Task | None = None
        self._announced = False

    @property
    def accepting(self) -> bool:
        """Whether a new request is taken (the engine may still have failed)."""
        return self.phase == READY

    # -- start-up ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the warm-up, then serving, in the background (the HTTP server listens
        meanwhile and answers 503)."""
        self._loop = asyncio.get_running_loop()
        if self.warmup is None:  # nothing slow: serving from the first request on
            await self._start()
        else:
            self._bring_up = asyncio.create_task(self._start())

    async def _start(self) -> None:
        try:
            if self.warmup is not None:
                await asyncio.to_thread(self.warmup, lambda: self.phase != STARTING)
            if self.phase != STARTING:
                return
            await self.engine.start()
        except BaseException as e:  # the engine cannot serve: the server must stop
            if not isinstance(e, asyncio.CancelledError):
                log.error("start-up failed: %s", e, exc_info=(type(e), e, e.__traceback__))
                self.engine.fail(e)
            raise
        self.phase = READY
        self._announce()

    def listening(self, address: str) -> None:
        """The HTTP server listens at ``address`` (the ready line names it)."""
        self.address = address
        self._announce()

    def _announce(self) -> None:
        if self.phase == READY and self.address is not None and not self._announced:
            self._announced = True
            progress.info("ssdlib server ready: listening on %s", self.address)

    # -- stop ----------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Begin the graceful stop (callable from a signal handler or any thread)."""
        if self._loop is None:
            if self.on_stopped is not None:
                self.on_stopped()
            return
        self._loop.call_soon_threadsafe(self._begin_stop)

    @property
    def stopping(self) -> bool:
        return self.phase in (STOPPING, STOPPED)

    def _begin_stop(self) -> None:
        if self._stop is None:
            self._stop = asyncio.create_task(self.drain())

    async def drain(self) -> None:
        """Refuse new requests, let those in flight finish within the grace period, cancel the
        rest, then call ``on_stopped``."""
        if self.stopping:
            return
        self.phase = STOPPING
        n = self.engine.in_flight
        progress.info("stopping: new requests are refused; %d in flight get up to %.0f s to "
                      "finish", n, self.shutdown_timeout_s)
        await self._wait_idle(self.shutdown_timeout_s)
        if self.engine.in_flight:
            log.warning("stopping: cancelling %d request(s) still running after %.0f s",
                        self.engine.in_flight, self.shutdown_timeout_s)
            self.engine.cancel_all()
            await self._wait_idle(CANCEL_WAIT_S)
        self.phase = STOPPED
        if self.on_stopped is not None:
            self.on_stopped()

    async def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.engine.in_flight and self.engine.failure is None \
                and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)

    async def close(self) -> None:
        """At the app's end: the warm-up (if it still runs) is told to stop and waited for,
        then the engine closes."""
        if not self.stopping:
            self.phase = STOPPED
        if self._bring_up is not None and not self._bring_up.done():
            try:
                await self._bring_up
            except BaseException:  # reported by the task itself
                pass
        if self._stop is not None and not self._stop.done():
            self._stop.cancel()
        await self.engine.close()
