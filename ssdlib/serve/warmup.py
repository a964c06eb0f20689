"""The server's warm-up: the engine's, plus the batches a server meets that a batch job does not.

On a GPU the engine captures (and, compiled, compiles) each step shape the first time it is
needed. :meth:`Generator.warm_up` makes them for every batch bucket up to ``max_batch``, with
greedy rows (and, speculative, sampled rows). A server's batch also mixes clients: greedy and
sampled rows together make another key of the sampled steps (``SamplingFacts``), so the server
runs one such batch too, of ``max_batch`` rows for a few rounds. Left to the first real requests,
that work would land in their time to first token.

On a CPU off the captured-step path nothing is captured, and nothing runs.
"""

from __future__ import annotations

import time
from typing import Callable

from ssdlib.log import progress_logger
from ssdlib.sampling import SamplingParams

progress = progress_logger()

# rounds of the mixed batch (a round commits up to k + 1 tokens)
MIXED_ROUNDS = 4
# the sampled rows' parameters: the OpenAI API's defaults (temperature 1, no top-p / top-k),
# what a request that sets nothing gets
SAMPLED = dict(temperature=1.0, seed=0)


def mixed_batch(max_batch: int, k: int) -> list[SamplingParams]:
    """Per-row parameters of the mixed batch: greedy and sampled rows alternating (one row of
    each when ``max_batch`` allows two), ``ignore_eos`` for ``MIXED_ROUNDS`` rounds."""
    n = MIXED_ROUNDS * (k + 1)
    return [SamplingParams(max_new_tokens=n, ignore_eos=True, **(SAMPLED if i % 2 else {}))
            for i in range(max_batch)]


def run_warmup(generator, stop: Callable[[], bool] = lambda: False) -> float:
    """Warm ``generator`` (started with ``warm=False``, no serving session open) for serving;
    ``stop()`` is asked between the phases (a server told to stop does not finish its warm-up).
    Returns its seconds."""
    t0 = time.perf_counter()
    # the request path's own first use: the chat template compiled, the tokenizer's caches
    if generator.tokenizer.chat_template is not None:
        ids = generator.encode({"messages": [{"role": "user", "content": "Hello!"}]}, True)
        generator.tokenizer.decode(ids)
    generator.warm_up()
    cfg = generator.cfg
    # ar samples outside the captured steps: its rows' parameters make no step key
    if stop() or cfg.mode == "ar" or cfg.max_batch < 2 or not generator.captures_steps():
        return time.perf_counter() - t0
    params = mixed_batch(cfg.max_batch, cfg.k)
    prompt = [1 + i % 7 for i in range(16)]  # ids every vocabulary has
    if len(prompt) + params[0].max_new_tokens >= generator.max_context:
        return time.perf_counter() - t0
    t1 = time.perf_counter()
    generator.generate([prompt] * len(params), params)
    progress.info("warm-up for serving: greedy and sampled rows in one batch, %.1f s",
                  time.perf_counter() - t1)
    return time.perf_counter() - t0
