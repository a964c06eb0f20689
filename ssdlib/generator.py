"""``Generator``: the embeddable entry point.

Owns the job's ranks: runs in-process when the job needs one rank, spawns and watches its ranks
otherwise (CPU gloo / GPU NCCL, free port chosen), or joins the current torchrun world. Prompts are
strings or token-id lists; each output has ``token_ids``, ``text`` and ``metrics``.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterable, Sequence

import torch.multiprocessing as mp

from ssdlib.distributed.launcher import RankGroup
from ssdlib.distributed.world import under_torchrun
from ssdlib.engine.sequence import Output, Request
from ssdlib.engine_config import EngineConfig
from ssdlib.errors import ConfigError, RankFailure, SSDError
from ssdlib.loading import load_checkpoint
from ssdlib.log import get_logger
from ssdlib.runtime import build_rank, rank_entry
from ssdlib.sampling import SamplingParams

log = get_logger(__name__)

Prompt = str | list[int] | dict


class Generator:
    """Generate text with a target model, alone (``ar``) or speculatively (``sd``, ``ssd``).

    Keyword names match the CLI flags. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, target: str = "smollm2-135m", draft: str | None = None, mode: str = "ar",
                 tp: int = 1, device: str = "cpu", dtype: str | None = None, k: int = 5,
                 fan_out: str = "auto", saguaro_c: float = 1.0, fallback: str = "auto",
                 max_batch: int = 8, max_len: int = 2048, log_level: str = "WARNING",
                 **kwargs):
        self.cfg = EngineConfig(target=target, draft=draft, mode=mode, tp=tp, device=device,
                                dtype=dtype, k=k, fan_out=fan_out, saguaro_c=saguaro_c,
                                fallback=fallback, max_batch=max_batch, max_len=max_len, **kwargs)
        ck = load_checkpoint(self.cfg.target)
        self.tokenizer = ck.tokenizer
        self.model_config = ck.config
        self.max_context = min(self.cfg.max_len, ck.config.max_position_embeddings)
        self._runtime = None
        self._ranks: RankGroup | None = None
        self._closed = False
        if under_torchrun() or self.cfg.world_size == 1:
            if not under_torchrun():
                os.environ.setdefault("RANK", "0")
            self._runtime = build_rank(self.cfg)
            if self._runtime is None:  # a non-leader torchrun rank: its serving has ended
                self._closed = True
        else:
            ctx = mp.get_context("spawn")
            self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
            self._ranks = RankGroup(self.cfg.world_size, rank_entry,
                                    (self.cfg, self._inbox, self._outbox, log_level))
            kind, _ = self._ranks.wait(self._outbox, timeout_s=self.cfg.timeout_s)
            if kind != "ready":
                raise RankFailure(f"unexpected first message from the leader: {kind!r}")

    @property
    def is_leader(self) -> bool:
        return self._runtime is not None or self._ranks is not None

    # -- prompts ---------------------------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """A prompt (text, token ids, or {"messages": [...]}) -> token ids."""
        if isinstance(prompt, dict):
            if "messages" in prompt:
                return self._encode_chat(prompt["messages"])
            if "prompt_ids" in prompt:
                return self.encode(prompt["prompt_ids"])
            return self.encode(prompt.get("prompt"), chat=chat)
        if isinstance(prompt, (list, tuple)):
            if not prompt or not all(isinstance(t, int) for t in prompt):
                raise ConfigError("a token-id prompt must be a non-empty list of integers")
            bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ConfigError(f"token id {bad[0]} is outside the vocabulary "
                                  f"(size {self.model_config.vocab_size})")
            return list(prompt)
        if not isinstance(prompt, str):
            raise ConfigError(f"a prompt must be a string, a token-id list or a dict, got "
                              f"{type(prompt).__name__}")
        if self.tokenizer is None:
            raise ConfigError("this checkpoint has no tokenizer: give prompts as token-id lists")
        if chat:
            return self._encode_chat([{"role": "user", "content": prompt}])
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ConfigError("the prompt is empty")
        return ids

    def _encode_chat(self, messages) -> list[int]:
        if self.tokenizer is None:
            raise ConfigError("this checkpoint has no tokenizer: chat prompts need one")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _requests(self, prompts, params, chat) -> list[Request]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            raise ConfigError("generate() takes a list of prompts")
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError("give one SamplingParams, or one per prompt")
        reqs = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            p = (p or SamplingParams()).validate()
            ids = self.encode(prompt, chat)
            if len(ids) >= self.max_context - 1:
                raise ConfigError(f"prompt {i} has {len(ids)} tokens, longer than the context "
                                  f"({self.max_context} tokens incl. the answer; see --max-len)")
            reqs.append(Request(i, ids, p))
        return reqs

    # -- generation ------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | list | None = None,
                 chat: bool = False,
                 on_text: Callable[[int, str], None] | None = None) -> list[Output]:
        """Generate for every prompt; outputs come back in input order.

        ``on_text(index, text_delta)`` is called as text is produced (streaming).
        """
        if self._closed or not self.is_leader:
            raise SSDError("this Generator is closed (or is not the leader rank)")
        reqs = self._requests(list(prompts), params, chat)
        t0 = time.perf_counter()
        on_event = (lambda i, d, ids: on_text(i, d) if d else None) if on_text else None
        if self._runtime is not None:
            outputs = self._runtime.generate(reqs, on_event)
        else:
            self._inbox.put(("generate", reqs, on_text is not None))
            while True:
                kind, payload = self._ranks.wait(self._outbox)
                if kind == "event":
                    on_event(*payload)
                elif kind == "result":
                    outputs = payload
                    break
        self.last_run_metrics = run_metrics(outputs, time.perf_counter() - t0)
        return outputs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               chat: bool = False) -> Iterable[str]:
        """Yield text pieces of one prompt's answer as they come (runs in the caller's thread)."""
        import queue
        import threading
        q: queue.Queue = queue.Queue()
        result: dict = {}

        def work():
            try:
                result["out"] = self.generate([prompt], params, chat,
                                              on_text=lambda i, d: q.put(d))
            except BaseException as e:  # surfaced in the caller below
                result["error"] = e
            q.put(None)

        threading.Thread(target=work, daemon=True).start()
        while (piece := q.get()) is not None:
            yield piece
        if "error" in result:
            raise result["error"]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._runtime is not None:
            self._runtime.close()
        elif self._ranks is not None:
            try:
                self._inbox.put(("close",))
                self._ranks.wait(self._outbox, timeout_s=60)
                self._ranks.join()
            finally:
                self._ranks.kill()

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if self._ranks is not None and not self._closed:
                self._ranks.kill()
        except Exception:
            pass


# seconds keys that are spans (of the run or of one sequence), not phases of the rounds
SPAN_KEYS = ("wall_s", "ttft_s", "total_s", "prefill_s", "decode_s")


def is_phase_key(key: str) -> bool:
    """A metrics key holding seconds spent in one phase of the rounds (``draft_s``, ``wait_s``)."""
    return key.endswith("_s") and not key.endswith("tok_s") and key not in SPAN_KEYS


def run_metrics(outputs: list[Output], wall_s: float) -> dict:
    """Aggregate per-output metrics into the run's (same names as per output).

    ``decode_tok_s`` is wall-clock decode throughput: the tokens produced by decode rounds (all
    generated tokens less each sequence's first, which its prefill produces) divided by the
    wall time from the first sequence's first token to the end of the call,
    ``wall_s - ttft_s``. With continuous batching that window also holds later sequences'
    prefills and the rounds where few slots are busy: it is what a caller waits, not the
    decode time of any single sequence. ``ttft_s`` is the first sequence's (lowest index:
    requests are admitted in order) time to first token.

    Phase times (every per-output key ending in ``_s`` other than the spans in ``SPAN_KEYS`` and
    the ``*tok_s`` rates, e.g. ``draft_s``, ``verify_s``, ``wait_s``) are summed over outputs.
    Each sequence adds a batched round's phase time once per round it takes part in, and
    ``rounds`` is summed the same way, so ``key / rounds`` is the mean phase time per round
    (rounds weighted by how many sequences they carried).
    """
    tokens = sum(o.metrics.get("tokens", 0) for o in outputs)
    out = {"tokens": tokens, "wall_s": wall_s, "tok_s": tokens / wall_s if wall_s > 0 else 0.0,
           "requests": len(outputs)}
    first = min(outputs, key=lambda o: o.index, default=None)
    out["ttft_s"] = first.metrics.get("prefill_s", 0.0) if first is not None else 0.0
    window = wall_s - out["ttft_s"]
    out["decode_tok_s"] = (tokens - len(outputs)) / window if window > 0 else 0.0
    out["rounds"] = sum(o.metrics.get("rounds", 0) for o in outputs)
    out["prefill_s"] = max((o.metrics.get("prefill_s", 0.0) for o in outputs), default=0.0)
    for o in outputs:
        for key, value in o.metrics.items():
            if is_phase_key(key) and isinstance(value, (int, float)):
                out[key] = out.get(key, 0.0) + value
    drafted = sum(o.metrics.get("drafted", 0) for o in outputs)
    if drafted:
        accepted = sum(o.metrics.get("accepted", 0) for o in outputs)
        tried = sum(o.metrics.get("tried", 0) for o in outputs)
        out["acceptance_rate"] = accepted / tried if tried else 0.0
        out["mean_accepted"] = accepted / out["rounds"]
        out["tokens_per_round"] = (accepted + out["rounds"]) / out["rounds"]
    lookups = sum(o.metrics.get("lookups", 0) for o in outputs)
    if lookups:
        out["hit_rate"] = sum(o.metrics.get("hits", 0) for o in outputs) / lookups
        fallbacks: dict = {}
        for o in outputs:
            for kind, n in o.metrics.get("fallbacks", {}).items():
                fallbacks[kind] = fallbacks.get(kind, 0) + n
        out["fallbacks"] = fallbacks
    for key in ("verifier_idle_frac", "speculator_idle_frac"):
        vals = [o.metrics[key] for o in outputs if key in o.metrics]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out
