"""The leader (verifier rank 0): owns the sequences, schedules them, streams and collects output.

The per-mode decoding logic lives in a *loop* object (``ARLoop``, ``SDLoop``, the SSD verifier)
with two methods: ``admit(new_seqs)`` (prefill, first token) and ``step(active_seqs)`` (one round).
Continuous batching: finished rows leave and free their KV slot, waiting requests are admitted.
:meth:`Leader.serve` takes requests and cancellations between rounds (the serving front end);
:meth:`Leader.generate` runs a fixed list on the same loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Callable

import torch

from ssdlib.engine.leader.sequence import Output, Request, Sequence

# on_event(index, text_delta, new_token_ids)
EventFn = Callable[[int, str, list], None]
# poll(idle) -> (new requests, request indices to cancel), or None to stop serving
PollFn = Callable[[bool], "tuple[list[Request], list[int]] | None"]


class Leader:
    def __init__(self, loop, tokenizer, eos_ids: list[int], n_slots: int, max_len: int,
                 device: torch.device):
        self.loop = loop
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.n_slots = n_slots
        # Every mode stops a sequence at max_len - 1 committed tokens, so SD/SSD produce as
        # many tokens as AR before "length". A round that starts below the limit writes up to
        # lookahead positions past it; the model runners keep POSITION_SLACK positions past
        # max_len for that (EngineConfig checks k + 1 fits).
        self.limit = max_len - 1
        if hasattr(loop, "limit"):
            loop.limit = self.limit
        self.device = device

    def generate(self, requests: list[Request], on_event: EventFn | None = None,
                 interrupted: Callable[[], bool] | None = None) -> list[Output]:
        """Run a fixed list of requests to completion; outputs in the list's order. When
        ``interrupted()`` (asked before every round) says so, what still runs is cancelled."""
        outputs: dict[int, Output] = {}
        todo = [list(requests)]

        def poll(idle: bool):
            if todo:
                return todo.pop(), []
            if idle or (interrupted is not None and interrupted()):
                return None
            return [], []

        self.serve(poll, on_event, lambda o: outputs.__setitem__(o.index, o))
        if hasattr(self.loop, "batch_metrics"):  # e.g. the speculator's idle fraction
            for o in outputs.values():
                o.metrics.update(self.loop.batch_metrics())
        return [outputs[r.index] for r in requests]

    def serve(self, poll: PollFn, on_event: EventFn | None = None,
              on_output: Callable[[Output], None] | None = None) -> None:
        """Serve requests that arrive while the batch runs, until ``poll`` returns None.

        ``poll(idle)`` is called before every round and returns ``(new_requests, cancel_ids)``
        (request indices, unique while served) or None to stop; ``idle`` says that nothing is
        running or waiting, so it may block until something arrives. A cancelled sequence
        leaves the batch before the next round (finish reason "cancelled") and frees its slot;
        stopping cancels whatever still runs. ``on_output`` gets each finished request.
        """
        pending: deque[Request] = deque()
        free = list(range(self.n_slots))
        active: list[Sequence] = []
        emit = on_output or (lambda o: None)
        while True:
            got = poll(not pending and not active)
            if got is None:
                cancel = [r.index for r in pending] + [q.request.index for q in active]
            else:
                new_requests, cancel = got
                pending.extend(new_requests)
            if cancel:
                active = self._cancel(set(cancel), pending, active, free, emit)
            if got is None:
                return
            new = []
            while pending and free and getattr(self.loop, "can_admit", lambda a: True)(active):
                new.append(Sequence(self._within_limit(pending.popleft()), free.pop(0),
                                    self.eos_ids, self.tokenizer, self.device))
            if new:
                before = [len(q.tokens) for q in new]
                self.loop.admit(new)
                self._after(new, before, on_event)
                active += new
                # a sequence may end on its first token (EOS, max_new_tokens=1): it leaves
                # before any round, never stepped with rows that are still decoding
                active = self._harvest(active, emit, free)
            if active:
                before = [len(q.tokens) for q in active]
                self.loop.step(active)
                self._after(active, before, on_event)
                active = self._harvest(active, emit, free)

    def _cancel(self, ids: set, pending: deque, active: list, free: list, emit) -> list:
        """Drop cancelled requests: waiting ones at once, running ones leave the batch."""
        for r in [r for r in pending if r.index in ids]:
            pending.remove(r)
            emit(Output(r.index, [], "", "cancelled", {"tokens": 0}, len(r.prompt_ids)))
        for q in active:
            if q.request.index in ids and not q.finished:
                q.finish_reason = "cancelled"
        active = self._harvest(active, emit, free)
        if not active and hasattr(self.loop, "settle"):
            self.loop.settle()  # e.g. tell the speculator its rows left
        return active

    def _within_limit(self, request: Request) -> Request:
        """The request with max_new_tokens cut to what fits before the limit, so a round that
        accepts several tokens commits none past it (the finish reason is "length" either way)."""
        room = max(1, self.limit - len(request.prompt_ids))
        if request.params.max_new_tokens <= room:
            return request
        return replace(request, params=replace(request.params, max_new_tokens=room))

    def _harvest(self, active, emit, free) -> list[Sequence]:
        """Emit finished sequences (free their slots); return the ones still running."""
        for q in active:
            if q.finished:
                emit(q.to_output())
                free.append(q.slot)
                if hasattr(self.loop, "release"):
                    self.loop.release(q)
        return [q for q in active if not q.finished]

    def _after(self, seqs, before, on_event) -> None:
        for q, n in zip(seqs, before):
            if not q.finished and len(q.tokens) >= self.limit:
                q.finish_reason = "length"
            if on_event is not None and len(q.tokens) > n:
                on_event(q.request.index, q.take_text_delta(), q.tokens[n:])
