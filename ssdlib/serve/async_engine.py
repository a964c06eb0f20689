"""``AsyncEngine``: an asyncio front end on a :class:`Generator` whose batch requests join while
it runs.

``submit(prompt_ids, params)`` returns a :class:`RequestStream`, an async iterator of
:class:`Delta` (text and token ids as they are committed; the last one carries the finish reason
and the :class:`Output`). ``cancel(id)`` (or leaving the iteration early) takes the request out
of the batch before the next round. At most ``max_batch + max_queue`` requests are in flight;
beyond that ``submit`` raises :class:`QueueFull` instead of queueing without bound.

A stuck engine (a rank alive but blocked, e.g. in a collective its peer never joins) sends
nothing; :meth:`AsyncEngine.check_progress` turns ``stall_timeout_s`` without a token or an
answer, while requests are in flight, into a failure (:class:`EngineStalled`), as a rank's
crash is one.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from dataclasses import dataclass, field

from ssdlib.engine.leader.sequence import Output, Request
from ssdlib.errors import SSDError
from ssdlib.sampling import SamplingParams


# how long closing waits for the engine's session to end: after a clean run, after a failure
STOP_WAIT_S, FAILED_STOP_WAIT_S = 60.0, 1.0


class QueueFull(SSDError):
    """More requests are in flight than the engine's batch and queue hold."""


class EngineFailed(SSDError):
    """The engine stopped (a rank failed, or it was closed); no request can be served."""


class EngineStalled(SSDError):
    """Requests were in flight and the engine delivered nothing for its stall timeout."""


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # on the last delta: "eos" | "stop" | "length" | "cancelled"
    output: Output | None = None  # on the last delta


@dataclass
class _Flight:
    stream: "RequestStream"
    prompt_tokens: int
    t_submit: float = field(default_factory=time.perf_counter)
    started: bool = False  # a first token came back: the request holds a slot
    streamed: int = 0  # characters of text delivered


class RequestStream:
    """The deltas of one request (async iterator); :meth:`cancel` stops it."""

    def __init__(self, engine: "AsyncEngine", request_id: int):
        self.id = request_id
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self.done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Delta:
        if self.done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finish_reason is not None:
            self.done = True
        return item

    def cancel(self) -> None:
        if not self.done:
            self._engine.cancel(self.id)

    async def collect(self) -> Output:
        """Wait for the end; the request's :class:`Output`."""
        output = None
        async for delta in self:
            output = delta.output or output
        return output


class AsyncEngine:
    """Owns a started :class:`Generator` while serving; use :meth:`start` inside the event loop,
    :meth:`close` at the end. ``metrics`` (optional) is told about every request."""

    def __init__(self, generator, max_queue: int = 64, metrics=None,
                 stall_timeout_s: float | None = None):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        if stall_timeout_s is not None and not (isinstance(stall_timeout_s, (int, float))
                                                and stall_timeout_s > 0):
            raise ValueError(f"stall_timeout_s must be a number > 0 (or None: never), got "
                             f"{stall_timeout_s!r}")
        # no token nor answer for this long with requests in flight: the engine is stuck
        self.stall_timeout_s = stall_timeout_s
        self._progress_at = time.monotonic()  # the last delivery, or the start of a busy spell
        self.generator = generator
        self.capacity = generator.cfg.max_batch + max_queue
        self.metrics = metrics
        self.failure: BaseException | None = None
        self._flights: dict[int, _Flight] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        call = self._loop.call_soon_threadsafe
        self._session = self.generator.open_session(
            lambda i, d, ids: call(self._on_event, i, d, ids),
            lambda o: call(self._on_output, o),
            lambda e: call(self._on_failure, e))

    @property
    def healthy(self) -> bool:
        return self.failure is None and self._session is not None and self._session.alive

    @property
    def in_flight(self) -> int:
        """Requests accepted and not yet ended (running or waiting for a slot)."""
        return len(self._flights)

    @property
    def running(self) -> int:
        return sum(f.started for f in self._flights.values())

    @property
    def waiting(self) -> int:
        return sum(not f.started for f in self._flights.values())

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request (prompt already encoded and checked); raises :class:`QueueFull` or
        :class:`EngineFailed` instead of accepting what cannot be served."""
        if not self.healthy:
            raise EngineFailed(f"the engine is not serving: {self.failure or 'not started'}")
        if len(self._flights) >= self.capacity:
            if self.metrics is not None:
                self.metrics.rejected()
            raise QueueFull(f"the server is at capacity ({self.capacity} requests in flight); "
                            f"retry later")
        if not self._flights:  # a busy spell starts: the wait for progress counts from now
            self._progress_at = time.monotonic()
        rid = next(self._ids)
        stream = RequestStream(self, rid)
        self._flights[rid] = _Flight(stream, len(prompt_ids))
        # salt 0: a seeded request samples what Generator.generate([prompt]) samples
        self._session.submit(Request(rid, list(prompt_ids), params.validate(), salt=0))
        return stream

    def cancel(self, request_id: int) -> None:
        """Take a request out of the batch (its slot is free before the next round)."""
        if request_id in self._flights and self._session is not None:
            self._session.cancel(request_id)

    def cancel_all(self) -> None:
        """Cancel every request in flight (each ends with finish reason "cancelled")."""
        for request_id in list(self._flights):
            self.cancel(request_id)

    def fail(self, error: BaseException) -> None:
        """The engine cannot serve (e.g. its warm-up failed): every request ends with
        :class:`EngineFailed` and none is accepted."""
        self._on_failure(error)

    def check_progress(self, now: float | None = None) -> bool:
        """Fail the engine (:class:`EngineStalled`, every request ends with EngineFailed) when
        requests are in flight and nothing was delivered for ``stall_timeout_s``; whether it
        did. ``now``: a ``time.monotonic()`` reading (default: now)."""
        if self.stall_timeout_s is None or not self._flights or self.failure is not None:
            return False
        idle = (time.monotonic() if now is None else now) - self._progress_at
        if idle < self.stall_timeout_s:
            return False
        self._on_failure(EngineStalled(
            f"no token for {idle:.0f} s with {len(self._flights)} request(s) in flight (stall "
            f"timeout {self.stall_timeout_s:g} s): a rank is stuck"))
        return True

    async def close(self) -> None:
        if self._session is not None:
            # a failed engine (a stuck rank above all) is not waited for: the caller aborts
            # its ranks
            wait_s = FAILED_STOP_WAIT_S if self.failure is not None else STOP_WAIT_S
            await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(self._session.stop, timeout_s=wait_s))
        self._fail_all(EngineFailed("the engine was closed"))

    # -- callbacks, on the event loop --------------------------------------------------------
    def _on_event(self, index: int, text: str, token_ids: list) -> None:
        f = self._flights.get(index)
        if f is None:
            return
        self._progress_at = time.monotonic()
        if not f.started and self.metrics is not None:
            self.metrics.first_token(time.perf_counter() - f.t_submit)
        f.started = True
        f.streamed += len(text)
        if self.metrics is not None:
            self.metrics.tokens(len(token_ids))
        f.stream._queue.put_nowait(Delta(text, list(token_ids)))

    def _on_output(self, out: Output) -> None:
        f = self._flights.pop(out.index, None)
        if f is None:
            return
        self._progress_at = time.monotonic()
        if self.metrics is not None:
            self.metrics.finished(out)
        # the end of the text may only be known now (a decoder flushing its last bytes)
        tail = out.text[f.streamed:] if len(out.text) > f.streamed else ""
        f.stream._queue.put_nowait(Delta(tail, [], out.finish_reason, out))

    def _on_failure(self, error: BaseException) -> None:
        self.failure = error
        self._fail_all(EngineFailed(f"the engine failed: {error}"))

    def _fail_all(self, error: EngineFailed) -> None:
        for f in self._flights.values():
            f.stream._queue.put_nowait(error)
        self._flights.clear()
