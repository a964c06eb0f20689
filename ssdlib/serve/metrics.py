"""Prometheus metrics of the server (one registry per server, text format at ``/metrics``)."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# the tokens/s gauge averages over this window
RATE_WINDOW_S = 10.0


class ServerMetrics:
    def __init__(self, engine_info: dict):
        r = self.registry = CollectorRegistry()
        Gauge("ssdlib_engine_info", "Engine configuration", list(engine_info),
              registry=r).labels(**engine_info).set(1)
        self.requests = Counter("ssdlib_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected_total = Counter("ssdlib_requests_rejected",
                                      "Requests refused because the queue was full", registry=r)
        self.prompt_tokens = Counter("ssdlib_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("ssdlib_generation_tokens", "Tokens generated",
                                         registry=r)
        self.ttft = Histogram("ssdlib_time_to_first_token_seconds",
                              "From submission to the first token", registry=r,
                              buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.tok_s = Gauge("ssdlib_generation_tokens_per_second",
                           f"Tokens generated per second over the last {RATE_WINDOW_S:.0f} s",
                           registry=r)
        self.tok_s.set_function(self._rate)
        self.acceptance = Gauge("ssdlib_acceptance_rate",
                                "Accepted / tried draft tokens (sd, ssd), finished requests",
                                registry=r)
        self.hit_rate = Gauge("ssdlib_ssd_cache_hit_rate",
                              "Speculation cache hits / lookups (ssd), finished requests",
                              registry=r)
        self.running = Gauge("ssdlib_requests_running", "Requests holding a batch slot",
                             registry=r)
        self.waiting = Gauge("ssdlib_requests_waiting",
                             "Requests queued for a slot (queue depth)", registry=r)
        self._recent: deque = deque()  # (time, tokens)
        self._sums = {"accepted": 0, "tried": 0, "hits": 0, "lookups": 0}

    def bind(self, engine) -> None:
        """Read the running / waiting counts from ``engine`` at each scrape."""
        self.running.set_function(lambda: engine.running)
        self.waiting.set_function(lambda: engine.waiting)

    def _rate(self) -> float:
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)
        self._recent.append((time.monotonic(), n))

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def rejected(self) -> None:
        self.rejected_total.inc()

    def finished(self, output) -> None:
        self.requests.labels(output.finish_reason).inc()
        self.prompt_tokens.inc(output.prompt_tokens)
        for key in self._sums:
            self._sums[key] += output.metrics.get(key, 0)
        s = self._sums
        if s["tried"]:
            self.acceptance.set(s["accepted"] / s["tried"])
        if s["lookups"]:
            self.hit_rate.set(s["hits"] / s["lookups"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
