"""``Generator``: the embeddable entry point.

Owns the job's ranks: runs in-process when the job needs one rank, spawns and watches its ranks
otherwise (CPU gloo / GPU NCCL, free port chosen), or joins the current torchrun world. Prompts are
strings, token-id lists or dicts (see :mod:`ssdlib.prompts`); each output has ``token_ids``,
``text`` and ``metrics``.

Everything that can be checked without the models is checked when the ``Generator`` is built,
before any rank starts: the flags, the target's config and tokenizer, the draft's vocabulary, and
whether the weights and KV cache fit in memory. With ``start=False`` the ranks start at the first
:meth:`generate` (or :meth:`start`), so a caller can :meth:`validate` its prompts first.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections import abc
from dataclasses import replace
from typing import Callable, Iterable, Sequence

import torch
import torch.multiprocessing as mp

from ssdlib.capacity import check_memory
from ssdlib.distributed.launcher import RankGroup
from ssdlib.distributed.world import under_torchrun
from ssdlib.engine.leader.metrics import k_totals, mean_accepted_by_source
from ssdlib.engine.leader.sequence import Output, Request
from ssdlib.engine.runner.compile_cache import use_compile_cache
from ssdlib.engine.runner.compiled import resolve_compile
from ssdlib.engine.runner.compiled import wants_compile
from ssdlib.engine.runner.model_runner import eager_step_graphs
from ssdlib.engine_config import EngineConfig
from ssdlib.errors import ConfigError, RankFailure, SSDError
from ssdlib.interrupts import held_interrupt
from ssdlib.loading import load_checkpoint
from ssdlib.loading.compat import check_draft_vocab
from ssdlib.log import get_logger, progress_logger
from ssdlib.ops.graph_pool import capture_count
from ssdlib.prompts import Prompt, PromptEncoder, is_single_prompt
from ssdlib.runtime import build_rank, rank_entry
from ssdlib.sampling import SamplingParams

log = get_logger(__name__)
progress = progress_logger()

# a warm-up request decodes this many rounds (at most; each round commits at least one token):
# enough for every step of a round to run, and for a speculative mode's steps after its first
# round (SSD's cache builds and hits)
WARM_UP_ROUNDS = 4
# the synthetic warm-up prompt's length (tokens) where the work to come is not given
WARM_UP_PROMPT = 16


class Generator:
    """Generate text with a target model, alone (``ar``) or speculatively (``sd``, ``ssd``).

    Keyword names match the CLI flags (``dtype``: None, float32 on a CPU and bfloat16 on CUDA,
    where the command line's default is ``"auto"``, bfloat16 also on a CPU with native bfloat16
    arithmetic). Use as a context manager or call :meth:`close`; leaving
    the ``with`` block on an exception stops the ranks at once and never replaces that exception.
    Raises :class:`ConfigError` / :class:`CheckpointError` for anything checkable before the models
    load; ``start=False`` defers loading them to :meth:`start` or the first :meth:`generate`.
    """

    def __init__(self, target: str = "smollm2-135m", draft: str | None = None, mode: str = "ar",
                 tp: int = 1, device: str = "auto", dtype: str | None = None, k: int = 5,
                 fan_out: str = "auto", saguaro_c: float = 1.0, fallback: str = "auto",
                 max_batch: int = 8, max_len: int = 2048, log_level: str = "WARNING",
                 start: bool = True, **kwargs):
        self._closed = True  # until the checks pass: nothing to release
        self._runtime = None
        self._ranks: RankGroup | None = None
        self.cfg = EngineConfig(target=target, draft=draft, mode=mode, tp=tp, device=device,
                                dtype=dtype, k=k, fan_out=fan_out, saguaro_c=saguaro_c,
                                fallback=fallback, max_batch=max_batch, max_len=max_len, **kwargs)
        if under_torchrun():
            self.cfg.check_world_size(int(os.environ.get("WORLD_SIZE", "1")))
        ck = load_checkpoint(self.cfg.target)
        self.tokenizer = ck.tokenizer
        self.model_config = ck.config
        draft_config = None
        if self.cfg.mode != "ar":
            draft_config = load_checkpoint(self.cfg.draft).config
            check_draft_vocab(ck.config, draft_config, self.cfg.target, self.cfg.draft)
        if under_torchrun():  # each rank checks its own device
            rank = int(os.environ.get("RANK", "0"))
            check_memory(self.cfg, ck.config, draft_config, rank,
                         int(os.environ.get("LOCAL_RANK", rank)), cuda_context=True)
        else:  # a world of one runs in this process, which will use the GPU anyway
            check_memory(self.cfg, ck.config, draft_config,
                         cuda_context=self.cfg.world_size == 1)
        self.max_context = min(self.cfg.max_len, ck.config.max_position_embeddings)
        self.prompts = PromptEncoder(self.tokenizer, ck.config.vocab_size, self.max_context)
        self._log_level = log_level
        self._leader = not under_torchrun() or int(os.environ.get("RANK", "0")) == 0
        self._started = False
        self._pending = 0  # results of interrupted generate calls still to come from the leader
        self._session: ServeSession | None = None
        # seconds of start-up: loading (ranks, models, KV cache, prefill graphs), the warm-up
        # (capturing and compiling the steps), both (ready_s); None until started
        self.load_s: float | None = None
        self.warm_up_s: float | None = None
        self.ready_s: float | None = None
        self.last_run_metrics: dict = {}
        self._closed = False
        if start:
            self.start()

    def start(self, prompts: Sequence[Prompt] | Prompt | None = None,
              params: SamplingParams | list | None = None, chat: bool = False,
              warm: bool = True) -> None:
        """Start the ranks (load the models), then :meth:`warm_up`, so that the first
        :meth:`generate` neither captures nor compiles; :meth:`generate` calls it when needed.

        ``prompts`` and ``params`` (optional) describe the work to come (the CLI passes its own):
        with ``compile="auto"`` they decide whether to compile
        (:func:`~ssdlib.engine.runner.compiled.resolve_compile`: one short answer does not, a long
        batch does; without them the engine is taken to serve for long and compiles), and the
        warm-up runs the first ``max_batch`` of them. ``warm=False`` skips the warm-up (steps
        are then captured, and compiled, at first use)."""
        if self._started or self._closed:
            return
        t0 = time.perf_counter()
        work = None if prompts is None else self._requests(prompts, params, chat)
        if work:
            self.cfg.compile = resolve_compile(
                self.cfg.compile, len(work), max(r.params.max_new_tokens for r in work),
                self.cfg.max_batch)
        if self.cfg.device == "cuda" and self.cfg.compile is not False:
            # before anything compiles, here or in the ranks this process spawns
            use_compile_cache(self.cfg.cache_dir)
        progress.info("loading %s (mode %s on %s, max batch %d, compile %s)", self.cfg.target,
                      self.cfg.mode, self.cfg.device, self.cfg.max_batch,
                      {None: "auto", True: "on", False: "off"}[self.cfg.compile])
        self._start_ranks()
        self.load_s = time.perf_counter() - t0
        if self._closed:  # a non-leader torchrun rank: its serving has ended
            return
        progress.info("loaded in %.1f s", self.load_s)
        self.ready_s = self.load_s
        if warm and self.is_leader:
            self.warm_up(work)

    def _start_ranks(self) -> None:
        self._started = True
        if under_torchrun() or self.cfg.world_size == 1:
            if not under_torchrun():
                os.environ.setdefault("RANK", "0")
            self._runtime = build_rank(self.cfg)
            if self._runtime is None:  # a non-leader torchrun rank: its serving has ended
                self._leader = False
                self._closed = True
            return
        ctx = mp.get_context("spawn")
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        self._ranks = RankGroup(self.cfg.world_size, rank_entry,
                                (self.cfg, self._inbox, self._outbox, self._log_level),
                                roles=self._roles())
        try:
            kind, _ = self._ranks.wait(self._outbox, timeout_s=self.cfg.timeout_s)
            if kind != "ready":
                raise RankFailure(f"unexpected first message from the leader: {kind!r}")
        except BaseException:
            self._closed = True
            self._ranks.kill()
            raise

    def captures_steps(self) -> bool:
        """Whether the engine captures its steps, so that a warm-up has work to do: on CUDA,
        and on CPU on the captured-step path (``SSDLIB_STEP_GRAPHS``)."""
        return self.cfg.device == "cuda" or bool(eager_step_graphs())

    def warm_up(self, work: list[Request] | None = None) -> float:
        """Capture (and compile) the engine's steps before anything is timed: run up to
        ``max_batch`` requests shaped like the work to come (``work``, from :meth:`start`'s
        prompts; otherwise a synthetic prompt of WARM_UP_PROMPT tokens in every row, greedy and,
        in a speculative mode, sampled too) for at most WARM_UP_ROUNDS rounds each; their
        outputs are dropped. On CUDA a step is captured for every batch bucket up to
        ``max_batch`` at its first use, so the run's shrinking batches find their graphs.

        What it cannot foresee is still captured when first needed, and counted in
        ``last_run_metrics["captured_in_run"]``: a prompt length, a set of sampling options
        (top-k, top-p) or a group of prompts admitted together that no warm-up request had.
        Returns its seconds (0.0 where no step is captured: CPU off the captured-step path)."""
        if self._closed or not self.is_leader:
            raise SSDError("this Generator is closed (or is not the leader rank)")
        self.start(warm=False)
        if not self.captures_steps():
            self.warm_up_s = 0.0
            return 0.0
        self.ready_s = None  # until this warm-up is done
        rows = self.cfg.max_batch
        per_round = 1 if self.cfg.mode == "ar" else self.cfg.k + 1
        warm = SamplingParams(max_new_tokens=WARM_UP_ROUNDS * per_round, ignore_eos=True)
        if work:
            batches = [[replace(r, params=replace(r.params, stop=[], ignore_eos=True,
                                                  max_new_tokens=warm.max_new_tokens))
                        for r in work[:rows]]]
        else:
            prompt = [1 + i % 7 for i in range(WARM_UP_PROMPT)]  # ids every vocabulary has
            kinds = [warm] + ([replace(warm, temperature=1.0)] if self.cfg.mode != "ar" else [])
            batches = [self._requests([prompt] * rows, p, False) for p in kinds]
        progress.info("warm-up: capturing%s the steps for batch buckets up to %d (%d request(s)"
                      "%s)", " and compiling" if self._compiles() else "", rows,
                      sum(map(len, batches)), "" if work else ", synthetic")
        t0, captured, compiled = time.perf_counter(), capture_count(), _compile_count()
        for reqs in batches:
            self._run(reqs, None, warm_up=True)
        self.warm_up_s = time.perf_counter() - t0
        self.ready_s = (self.load_s or 0.0) + self.warm_up_s
        if self._runtime is not None:  # the engine runs in this process: its counts are here
            progress.info("warm-up done in %.1f s: %d steps captured, %d compiled",
                          self.warm_up_s, capture_count() - captured,
                          _compile_count() - compiled)
        else:
            progress.info("warm-up done in %.1f s", self.warm_up_s)
        return self.warm_up_s

    def _compiles(self) -> bool:
        """Whether the target's captured steps run compiled layers (as the ranks decide)."""
        if self.cfg.device != "cuda":
            return False
        return wants_compile(self.cfg.compile, torch.device("cuda"), self.cfg.cuda_graphs,
                             self.cfg.tp)

    def _roles(self) -> list[str]:
        roles = ["leader"] + ["tensor-parallel rank"] * (self.cfg.tp - 1)
        if self.cfg.world_size > self.cfg.tp:
            roles.append("speculator" if self.cfg.mode == "ssd" else "draft")
        return roles

    @property
    def is_leader(self) -> bool:
        """Whether this process serves :meth:`generate` (False on torchrun ranks other than 0)."""
        return self._leader

    # -- prompts ---------------------------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """A prompt (text, token ids, or a dict: see :mod:`ssdlib.prompts`) -> token ids."""
        return self.prompts.encode(prompt, chat)

    def validate(self, prompts: Sequence[Prompt] | Prompt,
                 params: SamplingParams | list | None = None, chat: bool = False) -> None:
        """Raise :class:`ConfigError` for any prompt or parameter :meth:`generate` would refuse
        (needs no rank: call it before :meth:`start` to fail before the models load)."""
        self._requests(prompts, params, chat)

    def _requests(self, prompts, params, chat) -> list[Request]:
        if isinstance(prompts, (bytes, bytearray, memoryview)) or \
                not isinstance(prompts, abc.Iterable):
            # bytes would be read as a list of token ids (one per byte); None and other
            # non-iterables would fail as a bare TypeError
            hint = ": decode it to a str first" if isinstance(prompts, (bytes, bytearray)) \
                else ""
            raise ConfigError("prompts must be one prompt (a string, a token-id list or a dict) "
                              f"or a list of prompts, got {type(prompts).__name__}{hint}")
        prompts = [prompts] if is_single_prompt(prompts) else list(prompts)
        return self.prompts.requests(prompts, params, chat)

    # -- generation ------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 params: SamplingParams | list | None = None, chat: bool = False,
                 on_text: Callable[[int, str], None] | None = None) -> list[Output]:
        """Generate for every prompt; outputs come back in input order.

        ``prompts`` is a list of prompts, or one prompt (a string, a dict or a token-id list),
        which gives a list of one output. ``on_text(index, text_delta)`` is called as text is
        produced (streaming). A ``KeyboardInterrupt`` stops waiting for this call's outputs;
        the Generator stays usable.
        """
        if self._closed or not self.is_leader:
            raise SSDError("this Generator is closed (or is not the leader rank)")
        if self._session is not None:
            raise SSDError("this Generator is serving (open_session): submit requests there")
        reqs = self._requests(prompts, params, chat)
        self.start()
        if self._closed:
            raise SSDError("this Generator is closed (or is not the leader rank)")
        t0, captured = time.perf_counter(), capture_count()
        on_event = (lambda i, d, ids: on_text(i, d) if d else None) if on_text else None
        outputs = self._run(reqs, on_event)
        m = run_metrics(outputs, time.perf_counter() - t0)
        # start-up apart from the run: decode_tok_s is decoding only, ready_s what came before
        m.update({key: getattr(self, key) for key in ("ready_s", "load_s", "warm_up_s")
                  if getattr(self, key) is not None})
        if self._runtime is not None:  # steps captured (and compiled) inside the timed call
            m["captured_in_run"] = capture_count() - captured
            if m["captured_in_run"]:
                log.info("%d step(s) captured during the run: shapes the warm-up did not see",
                         m["captured_in_run"])
        self.last_run_metrics = m
        return outputs

    def _run(self, reqs: list[Request], on_event, warm_up: bool = False) -> list[Output]:
        if self._runtime is not None:
            return self._runtime.generate(reqs, on_event, warm_up=warm_up)
        return self._generate_spawned(reqs, on_event, warm_up)

    def _generate_spawned(self, reqs: list[Request], on_event,
                          warm_up: bool = False) -> list[Output]:
        """One generate call on the spawned leader. ``_pending`` counts the calls whose result
        is still to come; a Ctrl-C may land anywhere here, so the steps that must go together
        (queue a request and count it, take a result and count it) run with it held back, and
        every call that was queued gets an interrupt message."""
        self._drain_interrupted()
        queued = False
        try:
            with held_interrupt():
                self._inbox.put(("generate", reqs, on_event is not None, warm_up))
                self._pending += 1
                queued = True
            while True:
                kind, payload = self._receive()
                if kind == "event":
                    on_event(*payload)
                elif kind == "result":
                    return payload
        except KeyboardInterrupt:
            if queued:
                # the leader cancels the call's sequences before its next round (the next
                # call drops their result); after the result it is ignored
                with held_interrupt():
                    self._inbox.put(("interrupt",))
            raise

    def _receive(self) -> tuple[str, object]:
        """The leader's next message, watching the ranks. A result is taken off the queue and
        counted with Ctrl-C held back, so an interrupt never loses one; a Ctrl-C waits at most
        one poll (0.1 s) to be raised."""
        while True:
            with held_interrupt():
                try:
                    kind, payload = self._outbox.get(timeout=0.1)
                except queue.Empty:
                    kind = None
                else:
                    if kind == "result":
                        self._pending -= 1
            if kind is not None:
                return kind, payload
            self._ranks.check()

    def _drain_interrupted(self) -> None:
        """Wait out the calls a KeyboardInterrupt left running on the leader (their output is
        dropped), so the next answer is not mixed with theirs."""
        while self._pending:
            self._receive()

    def open_session(self, on_event: Callable[[int, str, list], None],
                     on_output: Callable[[Output], None],
                     on_failure: Callable[[BaseException], None]) -> "ServeSession":
        """Serve requests that join the running batch (see :class:`ServeSession`); the
        Generator's :meth:`generate` is refused until the session stops."""
        if self._closed or not self.is_leader:
            raise SSDError("this Generator is closed (or is not the leader rank)")
        if self._session is not None:
            raise SSDError("this Generator already has a serving session")
        self.start()
        self._session = ServeSession(self, on_event, on_output, on_failure)
        return self._session

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               chat: bool = False) -> Iterable[str]:
        """Yield text pieces of one prompt's answer as they come (runs in the caller's thread)."""
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
        """Shut the ranks down (gracefully unless they failed or are busy with an interrupted
        call, which is cut short: its output was never going to be read)."""
        if self._closed:
            return
        if self._session is not None:
            self._session.stop()
        self._closed = True
        if self._runtime is not None:
            self._runtime.close()
        elif self._ranks is not None:
            if self._ranks.failure is not None or self._pending:
                self._ranks.kill()
                return
            try:
                self._inbox.put(("close",))
                self._ranks.wait(self._outbox, timeout_s=60)
                self._ranks.join()
            finally:
                self._ranks.kill()

    def abort(self) -> None:
        """Stop at once: spawned ranks are killed, not asked to finish."""
        if self._closed:
            return
        if self._ranks is not None:
            self._closed = True
            self._ranks.kill()
        else:
            self.close()

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # an error is on its way out: stop the ranks at once and never replace that error
        try:
            self.abort()
        except Exception as e:
            log.warning("while stopping after %s: %s", exc_type.__name__, e)

    def __del__(self):
        try:
            if self._ranks is not None and not self._closed:
                self._ranks.kill()
        except Exception:
            pass


class ServeSession:
    """Requests joining a running batch (the leader's :meth:`Leader.serve`).

    :meth:`submit` and :meth:`cancel` may be called from any thread. The callbacks run on the
    session's own thread: ``on_event(index, text_delta, token_ids)`` per committed token(s),
    ``on_output(Output)`` per finished (or cancelled) request, ``on_failure(error)`` once if the
    engine fails (a rank died: the session is then over). Request indices must be unique among
    the requests in flight.
    """

    def __init__(self, gen: Generator, on_event, on_output, on_failure):
        self._gen = gen
        self._on_event, self._on_output, self._on_failure = on_event, on_output, on_failure
        if gen._runtime is not None:  # one rank, in this process: serve on a thread
            self._commands = queue.Queue()
            body = self._serve_here
        else:  # spawned ranks: rank 0 reads the commands from its inbox
            gen._drain_interrupted()
            self._commands = gen._inbox
            self._commands.put(("serve",))
            body = self._relay
        self._thread = threading.Thread(target=body, name="ssdlib-serve", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> None:
        self._commands.put(("submit", request))

    def cancel(self, index: int) -> None:
        self._commands.put(("cancel", index))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Cancel what runs and end the session (the Generator can generate again)."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout_s)
        self._gen._session = None

    def _serve_here(self) -> None:
        try:
            self._gen._runtime.serve(self._commands, self._on_event, self._on_output)
        except BaseException as e:  # the engine is unusable now: the front end must know
            self._on_failure(e)

    def _relay(self) -> None:
        ranks, outbox = self._gen._ranks, self._gen._outbox
        try:
            while True:
                kind, payload = ranks.wait(outbox)
                if kind == "event":
                    self._on_event(*payload)
                elif kind == "output":
                    self._on_output(payload)
                elif kind == "served":
                    return
        except BaseException as e:
            self._on_failure(e)


def _compile_count() -> int:
    """Graphs torch.compile has compiled in this process so far (0 before its first use)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])


# seconds keys that are spans (of the run or of one sequence) or of the start-up, not phases of
# the rounds
SPAN_KEYS = ("wall_s", "ttft_s", "total_s", "prefill_s", "decode_s", "ready_s", "load_s",
             "warm_up_s")


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

    ``mean_k`` and ``k0_rounds``: the speculation length chosen per round (adaptive K) and the
    rounds at K = 0; ``k_costs`` the cost estimates it chose on (ms: a draft step, the rest of a
    round by K), per call like the speculator's keys below.

    ``speculator_rounds`` and ``speculator_ms_per_round`` ({phase: mean ms per OUTCOME round},
    phases ``protocol.SPEC_PHASES``) are the speculator rank's, per call: taken from any output;
    so is ``speculator_host_ms_per_round`` (its host-clock segments, ``SSDLIB_HOST_TIMES=1``),
    and ``stream_overlap`` (the stream placement on a GPU: mean ms per round of the verify's
    span, the build's span and the part of the build the verify hides; ``chain_overlap`` the
    same over chained rounds, ``chained_rounds`` how many rounds were chained, ``chain_counts``
    how many chains started and how many rows joined a running one, ``chain_budgets`` the
    chained builds per fan-out budget and the budget held at the end, where the budget is
    tuned: ``speculative/fanout_budget.py``; ``fanout_model`` the fan-out estimator's state at
    the end, ``FanoutEstimator.summary``, with the speculator in the process).
    """
    tokens = sum(o.metrics.get("tokens", 0) for o in outputs)
    out = {"tokens": tokens, "wall_s": wall_s, "tok_s": tokens / wall_s if wall_s > 0 else 0.0,
           "requests": len(outputs)}
    first = min(outputs, key=lambda o: o.index, default=None)
    out["ttft_s"] = first.metrics.get("prefill_s", 0.0) if first is not None else 0.0
    window = wall_s - out["ttft_s"]
    out["decode_tok_s"] = (tokens - len(outputs)) / window if window > 0 else 0.0
    out["rounds"] = sum(o.metrics.get("rounds", 0) for o in outputs)
    chained = sum(o.metrics.get("chained_rounds", 0) for o in outputs)
    if chained:
        out["chained_rounds"] = chained
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
    out.update(k_totals(o.metrics for o in outputs))  # adaptive K: mean K, rounds at K = 0
    lookups = sum(o.metrics.get("lookups", 0) for o in outputs)
    if lookups:
        out["hit_rate"] = sum(o.metrics.get("hits", 0) for o in outputs) / lookups
        fallbacks: dict = {}
        for o in outputs:
            for kind, n in o.metrics.get("fallbacks", {}).items():
                fallbacks[kind] = fallbacks.get(kind, 0) + n
        out["fallbacks"] = fallbacks
        out["accepted_by_source"] = mean_accepted_by_source(o.metrics for o in outputs)
    for key in ("verifier_idle_frac", "speculator_idle_frac"):
        vals = [o.metrics[key] for o in outputs if key in o.metrics]
        if vals:
            out[key] = sum(vals) / len(vals)
    # the speculator's own rounds: per batch (every output of a call holds the same), not summed
    for key in ("speculator_rounds", "speculator_rows_held", "speculator_ms_per_round",
                "speculator_host_ms_per_round",
                "stream_overlap", "chain_overlap", "chain_counts", "chain_budgets",
                "fanout_model", "k_costs"):
        value = next((o.metrics[key] for o in outputs if key in o.metrics), None)
        if value is not None:
            out[key] = dict(value) if isinstance(value, dict) else value
    return out
