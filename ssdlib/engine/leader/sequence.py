"""A running sequence on the leader: committed tokens, stop rules, streaming text."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ssdlib.engine.leader.metrics import finalize_acceptance_metrics
from ssdlib.sampling import SamplingParams
from ssdlib.speculative.rng import RowStream
from ssdlib.tokenizer.stop_strings import StopStrings


@dataclass
class Request:
    index: int  # position in the caller's list; outputs keep this order
    prompt_ids: list[int]
    params: SamplingParams
    # salts the request's random stream (default: its index); a server gives 0 so that a seeded
    # request samples what Generator.generate samples for one prompt with that seed
    salt: int | None = None

    @property
    def stream_salt(self) -> int:
        return self.index if self.salt is None else self.salt


@dataclass
class Output:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "stop" | "length" | "cancelled"
    metrics: dict = field(default_factory=dict)
    prompt_tokens: int = 0


class Sequence:
    def __init__(self, request: Request, slot: int, eos_ids: list[int], tokenizer,
                 device: torch.device):
        self.request = request
        self.params = request.params
        self.slot = slot
        self.tokens: list[int] = list(request.prompt_ids)  # committed (prompt + generated)
        self.num_prompt = len(request.prompt_ids)
        self.eos_ids = set() if request.params.ignore_eos else set(eos_ids)
        self.finish_reason: str | None = None
        self.stream = RowStream.from_seed(request.params.seed, request.stream_salt)  # random draws
        self._decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        self._flushed = False
        self.text = ""
        self._stops = StopStrings(request.params.stop)
        self._searched = 0  # text length at the last stop-string search
        self.stop_at: int | None = None  # text length where a stop string starts
        self._emitted = 0
        self.metrics: dict = {"rounds": 0}
        self.t_start = time.perf_counter()
        self.t_first: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    def commit(self, new_tokens: list[int]) -> list[int]:
        """Append tokens in order, stopping at EOS / stop string / max_new_tokens.

        Returns the tokens actually committed (a prefix of ``new_tokens``); text for streaming is
        available through :meth:`take_text_delta`.
        """
        taken = []
        for t in new_tokens:
            if self.finished:
                break
            self.tokens.append(t)
            taken.append(t)
            if self.t_first is None:
                self.t_first = time.perf_counter()
            if t in self.eos_ids:
                self.finish_reason = "eos"
            elif self._decoder is not None:
                self.text += self._decoder.push(t)
                pos = self._stops.find(self.text, self._searched)
                self._searched = len(self.text)
                if pos is not None:
                    self.stop_at = pos
                    self.finish_reason = "stop"
            if not self.finished and len(self.tokens) - self.num_prompt >= self.params.max_new_tokens:
                self.finish_reason = "length"
        return taken

    def take_text_delta(self) -> str:
        """Text committed since the last call: never past a stop string, and while the sequence
        runs, never the end that may still become one (it comes once later text decides it)."""
        if self.stop_at is not None:
            end = self.stop_at
        elif self.finished:
            self._flush()
            end = len(self.text)
        else:
            end = self._stops.safe_end(self.text)
        delta = self.text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta

    def _flush(self) -> None:
        """The decoder's last held-back bytes join the text (once, when no more tokens come)."""
        if self._decoder is not None and not self._flushed:
            self.text += self._decoder.flush()
            self._flushed = True

    def final_text(self) -> str:
        if self.finish_reason != "stop":
            self._flush()
        return self.text if self.stop_at is None else self.text[: self.stop_at]

    def to_output(self) -> Output:
        now = time.perf_counter()
        gen = self.generated
        if self.finish_reason == "eos" and gen and gen[-1] in self.eos_ids:
            body = gen[:-1]
        else:
            body = gen
        decode_s = now - (self.t_first or now)
        metrics = dict(self.metrics)
        finalize_acceptance_metrics(metrics)
        metrics.update(tokens=len(gen), total_s=now - self.t_start,
                       prefill_s=(self.t_first or now) - self.t_start, decode_s=decode_s,
                       decode_tok_s=(len(gen) - 1) / decode_s if decode_s > 0 and len(gen) > 1 else 0.0)
        return Output(self.request.index, body, self.final_text(), self.finish_reason or "length",
                      metrics, self.num_prompt)
