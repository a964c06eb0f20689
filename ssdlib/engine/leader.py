"""The leader (verifier rank 0): owns the sequences, schedules them, streams and collects output.

The per-mode decoding logic lives in a *loop* object (``ARLoop``, ``SDLoop``, the SSD verifier)
with two methods: ``admit(new_seqs)`` (prefill, first token) and ``step(active_seqs)`` (one round).
Continuous batching: finished rows leave and free their KV slot, waiting requests are admitted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Callable

import torch

from ssdlib.engine.sequence import Output, Request, Sequence

# on_event(index, text_delta, new_token_ids)
EventFn = Callable[[int, str, list], None]


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

    def generate(self, requests: list[Request], on_event: EventFn | None = None) -> list[Output]:
        pending = deque(requests)
        free = list(range(self.n_slots))
        active: list[Sequence] = []
        outputs: dict[int, Output] = {}
        while pending or active:
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
                active = self._harvest(active, outputs, free)
            if active:
                before = [len(q.tokens) for q in active]
                self.loop.step(active)
                self._after(active, before, on_event)
                active = self._harvest(active, outputs, free)
        if hasattr(self.loop, "batch_metrics"):  # e.g. the speculator's idle fraction
            for o in outputs.values():
                o.metrics.update(self.loop.batch_metrics())
        return [outputs[r.index] for r in requests]

    def _within_limit(self, request: Request) -> Request:
        """The request with max_new_tokens cut to what fits before the limit, so a round that
        accepts several tokens commits none past it (the finish reason is "length" either way)."""
        room = max(1, self.limit - len(request.prompt_ids))
        if request.params.max_new_tokens <= room:
            return request
        return replace(request, params=replace(request.params, max_new_tokens=room))

    def _harvest(self, active, outputs, free) -> list[Sequence]:
        """Collect finished sequences (free their slots); return the ones still running."""
        for q in active:
            if q.finished:
                outputs[q.request.index] = q.to_output()
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
