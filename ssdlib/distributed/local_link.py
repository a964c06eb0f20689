"""The in-process transport of the stream placement: the speculator lives in the leader's process
on a CUDA stream of its own, and :class:`LocalLink` hands it protocol.py's messages as they are
(dataclasses and device tensors, nothing serialised, no collective).

One host thread drives both sides. The leader's calls (the same as :class:`SpecLink`'s leader
side) run the speculator's round at the point where the rank placement's speculator would be
working:

- ``send_outcome``: the speculator commits the outcome and answers at once only when the leader
  waits for the answer (a SPEC with jit rows or q, or STATS); otherwise the answer waits for the
  next point, so that a greedy round that hits adds no speculator work before the verify launch;
- ``post_cache`` (called once the verify forward is launched): the speculator answers if it has
  not, then launches the cache build on its stream; the GPU runs it beside the verify while the
  host goes on to read the verify back;
- ``recv_cache``: waits (on the host) for the pushed rows' copy, which follows the build.

Why one thread and not a speculator thread of its own: a thread would let the speculator's host
work (its answer and the build's launch) start at the OUTCOME instead of after the verify's
launch, but CUDA-graph capture is not safe beside another thread's work: on one H200 the
speculator thread's first captures failed with ``cudaErrorStreamCaptureInvalidated`` while the
leader ran (docs/ARCHITECTURE.md, "Where the speculator runs"). One thread also keeps the order
of every launch fixed, so a run is reproducible and CPU runs take the GPU's path.

Streams: device tensors cross with an event: the SPEC's q is recorded on the speculator's stream
and the leader's stream waits for it; the CACHE is copied to a pinned host buffer on the
speculator's stream and the leader waits for that copy's event. The speculator's stream has the
lowest priority and the leader's (:func:`leader_stream`) the highest, so the verify keeps the GPU
when both have work queued (``SSDLIB_STREAM_PRIORITY`` reverses or evens them: on one H200 neither
moved SSD by more than the noise between machine starts, docs/BENCHMARKS.md).
Answering and launching the build at the OUTCOME instead of after the verify's launch (measured
at 21e017b, removed since) hid all of the build, but the verify waited for the speculator's host
work (0.91x SD against 0.97x). (Confining the speculator to a CUDA green context of 32 or 66 of the
H200's 132 SMs was tried: the verify slowed more, 2.11 and 2.16 ms a round against 1.70 with the
SMs shared; docs/BENCHMARKS.md.) On CPU the same code runs with no streams (nothing overlaps).

Chained rounds (``engine/leader/chained_rounds.py``) use the link differently: no
OUTCOME, SPEC or CACHE while a chain runs; the leader hands the speculator the chain's device
state once (``start_chain``), then each round launches its captured build behind an event of the
leader's (``build_chained``), ``regroup_chain`` tells it of rows that ended or joined
between two rounds, and ``end_chain`` sets the speculator's rows back to the committed
tokens.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ssdlib import env
from ssdlib.distributed.protocol import (Admit, CacheRows, ChainEnd, ChainRegroup, ChainSeen,
                                         ChainStart, Outcome, Speculation, SpeculatorStats)
from ssdlib.errors import SSDError


def leader_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The verifier's stream under the stream placement (its priority: :func:`priorities`)."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.Stream(device=device, priority=priorities()[0])


def priorities(order: str | None = None) -> tuple[int, int]:
    """(verifier's, speculator's) stream priority for ``order`` (default
    ``SSDLIB_STREAM_PRIORITY``): 'verifier' first (the default), 'speculator' first, or
    'equal'. CUDA counts down: lower numbers run first."""
    order = order or env.choice("SSDLIB_STREAM_PRIORITY")
    low, high = torch.cuda.Stream.priority_range()
    if order == "speculator":
        return low, high
    if order == "equal":
        return low, low
    return high, low


class LocalLink:
    """Leader and speculator in one process, one host thread driving both (see the module
    doc). ``attach`` gives it the speculator (a
    :class:`~ssdlib.engine.speculator.speculator.Speculator`) after both are built."""

    def __init__(self, device: torch.device, max_batch: int, k: int, vocab_size: int,
                 branches: int = 0):
        self.device = torch.device(device)
        self.k, self.vocab_size, self.max_batch, self.branches = k, vocab_size, max_batch, branches
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device, priority=priorities()[1]) \
            if self.cuda else None
        self.speculator = None
        self.failed: BaseException | None = None  # the speculator's error, if one was raised
        self._pending: tuple | None = None  # (header, outcome) answered at the next point
        self._build_due = False  # answered; the build (finish_round) not launched yet
        self._times_due = False  # a finished round whose phase times are not read yet
        # the speculator's answers, as it sent them
        self._spec: Speculation | None = None
        self._stats: SpeculatorStats | None = None
        self._cache_rows = 0
        width = CacheRows.width(branches, k)
        self._cache_host = torch.zeros(max_batch, width, dtype=torch.int64, pin_memory=self.cuda)
        self._spec_ready = torch.cuda.Event() if self.cuda else None
        self._cache_ready = torch.cuda.Event() if self.cuda else None
        # recorded on the speculator's stream after each build (plain or chained): the cache
        # holds the speculation in flight's likely outcomes once it has run
        self.built = torch.cuda.Event() if self.cuda else None
        # how much of the build the verify hides (GPU): per round, the leader's stream from the
        # OUTCOME to the verify's end against the speculator's build; read a round later
        self.overlap = OverlapMeter() if self.cuda else None

    def attach(self, speculator) -> None:
        self.speculator = speculator

    def on_stream(self):
        """Context: the speculator's work goes to its stream."""
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _run(self, fn, *args):
        """Run a speculator step on its stream, its host time counted as the speculator's. An
        exception is the job's error (it reaches the leader's caller as it is); the link is
        broken from then on."""
        if self.failed is not None:
            raise SSDError(f"the speculator failed: {self.failed}") from self.failed
        t0 = time.perf_counter()
        try:
            with self.on_stream():
                out = fn(*args)
        except BaseException as e:
            self.failed = e
            raise
        self.speculator.stats["busy_s"] += time.perf_counter() - t0
        return out

    # -- driving the speculator's round, at the leader's calls -------------------------------
    def _answer(self) -> None:
        """The speculator answers the OUTCOME in hand, if it has not yet."""
        if self._pending is None:
            return
        header, outcome = self._pending
        self._pending = None
        self._build_due = self._run(self.speculator.begin_round, header, outcome)

    def _build(self) -> None:
        """The speculator launches its work after the answer (the cache build and push)."""
        self._answer()
        if self._build_due:
            self._build_due = False
            if self.overlap is not None:
                self.overlap.build_starts(self.stream)
            self._run(self.speculator.finish_round, False)
            if self.overlap is not None:
                self.overlap.build_ends(self.stream)
            if self.built is not None:
                self.built.record(self.stream)
            self._times_due = True

    def _read_times(self) -> None:
        """The last finished round's phase times (its build is done: the leader took its CACHE
        before sending anything new, so this does not wait)."""
        if self._times_due:
            self._times_due = False
            self._run(self.speculator.end_round)

    # -- leader side (SpecLink's interface) ---------------------------------------------------
    def send_admit(self, msg: Admit) -> None:
        self._read_times()
        self._run(self.speculator.admit, msg)

    def send_outcome(self, msg: Outcome) -> None:
        if len(msg.slots) > self.max_batch:
            raise ValueError(f"OUTCOME of {len(msg.slots)} rows > max_batch {self.max_batch}")
        self._read_times()
        if self.overlap is not None:
            self.overlap.read()  # the last round's: its build is done
            self.overlap.verify_may_start()
        self._spec = self._stats = None
        self._pending = (msg.header(), msg)
        tokens, q = msg.spec_parts()
        if tokens or q or not any(msg.active):  # the leader waits for this answer: SPEC or STATS
            self._answer()

    def recv_spec_tokens(self, b: int) -> Speculation:
        self._answer()
        spec = self._spec
        if spec is None or spec.tokens.shape[0] != b:
            raise RuntimeError(f"no SPEC of {b} rows was sent")
        return Speculation(spec.tokens.clone(), spec.kinds.clone(), None)

    def recv_q(self, b: int) -> torch.Tensor:
        """The SPEC's q [b, K, V] on the device, usable on the caller's stream."""
        self._answer()
        q = self._spec.q if self._spec is not None else None
        if q is None or q.shape[0] != b:
            raise RuntimeError(f"no q of {b} rows was sent")
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self._spec_ready)
            q.record_stream(stream)  # freed by the leader's side: reused after its last use
        return q

    def post_cache(self, b: int) -> None:
        """The verify forward is launched: the speculator builds beside it now."""
        if self.overlap is not None:
            self.overlap.verify_launched()
        self._build()

    def recv_cache(self, b: int) -> CacheRows:
        self._build()
        if self._cache_rows != b:
            raise RuntimeError(f"CACHE of {self._cache_rows} rows pushed, {b} expected")
        if self._cache_ready is not None:
            self._cache_ready.synchronize()
        return CacheRows.unpack(self._cache_host[:b].clone(), self.branches, self.k)

    def recv_stats(self) -> SpeculatorStats:
        self._answer()
        if self._stats is None:
            raise RuntimeError("no STATS were sent")
        return self._stats

    def send_shutdown(self) -> None:
        if self.failed is None:
            self._read_times()
        self.failed = None  # what is left to do is to let go of the graphs
        self._run(self.speculator.shutdown)

    # -- chained rounds (leader side; engine/leader/chained_rounds.py) -------------------------
    def chain_caches(self) -> list:
        """The speculator's two caches of chained rounds (by round parity): device tensors,
        read on the leader's stream after the build's event."""
        return self.speculator.cache.chain_caches()

    def start_chain(self, msg: ChainStart) -> None:
        self._run(self.speculator.start_chain, msg)

    def regroup_chain(self, msg: ChainRegroup) -> None:
        """The running chain's rows change; the speculator's updates go to its stream, before
        the next build, after what the leader's stream did so far (the joined rows' prefills
        and state)."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._run(self.speculator.regroup_chain, msg)

    def build_chained(self, parity: int, rows: int, kv_len: int, after, done,
                      marks: tuple | None = None) -> tuple:
        """Launch chained round's build of ``parity`` on the speculator's stream once the event
        ``after`` (the verify whose outcome it reads) has run; ``done`` is recorded after it,
        ``marks``: two timing events around it (None on CPU). Returns the build's fan-out (its
        sum: the budget, branches a row)."""
        if self.cuda:
            self.stream.wait_event(after)
            if marks is not None:
                marks[0].record(self.stream)
        fan = self._run(self.speculator.build_chained, parity, rows, kv_len)
        if self.cuda:
            if marks is not None:
                marks[1].record(self.stream)
            done.record(self.stream)
        return fan

    def observe_chain(self, msg: ChainSeen) -> None:
        """A chained round read back, for the speculator's estimates (host data only)."""
        self._run(self.speculator.cache.observe_chain, msg)

    def observe_build(self, budget: int, build_ms: float, verify_ms: float) -> None:
        """A chained round's measured build and verify (ms), its build of ``budget`` branches:
        for the speculator's choice of budget (``speculative/fanout_budget.py``)."""
        self.speculator.cache.observe_build(budget, build_ms, verify_ms)

    def budget_summary(self) -> dict | None:
        """The chained builds per fan-out budget and the budget held (None: not tuned)."""
        return self.speculator.cache.budget_summary()

    def fanout_summary(self) -> dict | None:
        """The speculator's fan-out estimates (None: a fixed fan-out or no cache)."""
        cache = self.speculator.cache
        return cache.fanout_summary() if cache is not None else None

    def end_chain(self, msg: ChainEnd) -> None:
        self._run(self.speculator.end_chain, msg)

    # -- speculator side ----------------------------------------------------------------------
    def send_spec(self, spec: Speculation, tokens: bool = True, hold_q: bool = False) -> None:
        self._spec = spec
        if self._spec_ready is not None:
            self._spec_ready.record(self.stream)

    def send_held_q(self) -> None:
        """q is never held back here: it is the answer's own tensor, handed over with an
        event."""

    def send_cache(self, rows: torch.Tensor) -> None:
        b = rows.shape[0]
        self._cache_host[:b].copy_(rows, non_blocking=self.cuda)
        self._cache_rows = b
        if self._cache_ready is not None:
            self._cache_ready.record(self.stream)

    def send_stats(self, stats: SpeculatorStats) -> None:
        self._stats = stats


class OverlapMeter:
    """Per round, on the GPU: the leader's verify span (from the OUTCOME, when the leader's
    stream is idle, to the end of the verify forward launched after it) and the speculator's
    build span (its first kernel's queue point to the CACHE's copy); their intersection is the
    build time the verify hides. Events are read a round later, when both spans are done."""

    def __init__(self):
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        self._verify = self._build = False  # this round's spans are marked
        self.rounds = 0
        self.build_s = self.verify_s = self.hidden_s = 0.0

    def verify_may_start(self) -> None:
        self._events[0].record()  # the leader's stream: the next verify is launched after this
        self._verify = self._build = False

    def verify_launched(self) -> None:
        self._events[1].record()  # the leader's stream: the verify forward's end
        self._verify = True

    def build_starts(self, stream) -> None:
        self._events[2].record(stream)

    def build_ends(self, stream) -> None:
        self._events[3].record(stream)
        self._build = True

    def read(self) -> None:
        if not (self._verify and self._build):
            return
        self._verify = self._build = False
        self.add(self._events)

    def add(self, events) -> tuple[float, float]:
        """One round's four events (verify start and end, build start and end), done or not.
        Returns the round's (verify span, build span) in ms."""
        v0, v1, b0, b1 = events
        b1.synchronize()
        v1.synchronize()
        ms = v0.elapsed_time  # ms from v0 to the argument (CUDA events of one device)
        verify, start, end = ms(v1), ms(b0), ms(b1)
        self.rounds += 1
        self.verify_s += verify / 1e3
        self.build_s += (end - start) / 1e3
        self.hidden_s += max(0.0, min(verify, end) - max(0.0, start)) / 1e3
        return verify, end - start

    def take(self) -> dict:
        """Mean ms per measured round (verify span, build span, hidden) since the last take."""
        n = self.rounds
        out = {"rounds": n, "verify_ms": 1e3 * self.verify_s / n if n else 0.0,
               "build_ms": 1e3 * self.build_s / n if n else 0.0,
               "hidden_ms": 1e3 * self.hidden_s / n if n else 0.0}
        self.rounds, self.build_s, self.verify_s, self.hidden_s = 0, 0.0, 0.0, 0.0
        return out
