"""What each rank of a job runs, by role.

- leader (rank 0): target shard + sequences + the mode's loop; serves generate requests;
- TP follower (ranks 1..tp-1): target shard; executes the leader's forwards;
- speculator (rank tp, rank placement): mode ssd: draft + speculation cache (``Speculator``);
  mode sd with the draft on its own rank: the draft alone (a ``Speculator`` without a cache), both in
  ``ssdlib.engine.speculator.speculator``. Under the stream placement the leader builds the
  speculator in its own process (``verifier.build_link_verifier``) and there is no such rank.
"""

from __future__ import annotations

import contextlib
import queue

import torch

from ssdlib.distributed.local_link import leader_stream
from ssdlib.distributed.tp_channel import TargetExecutor, TPChannel
from ssdlib.distributed.world import World, destroy_world, init_world
from ssdlib.engine.leader.ar_loop import ARLoop
from ssdlib.engine.leader.leader import Leader
from ssdlib.engine.leader.sd_loop import build_sd_loop
from ssdlib.engine.leader.verifier import build_link_verifier
from ssdlib.engine.runner.model_runner import ModelRunner
from ssdlib.engine.speculator.speculator import serve_speculator
from ssdlib.engine_config import EngineConfig
from ssdlib.errors import ConfigError
from ssdlib.loading import load_checkpoint
from ssdlib.loading.feature_draft import feature_spec_for
from ssdlib.log import get_logger, setup_logging
from ssdlib.profiling import CallProfiler

log = get_logger(__name__)


class LeaderRuntime:
    """Everything rank 0 holds; ``generate`` runs one batch of requests."""

    def __init__(self, cfg: EngineConfig, world: World, leader: Leader, shutdown,
                 stream: torch.cuda.Stream | None = None):
        self.cfg = cfg
        self.world = world
        self.leader = leader
        self._shutdown = shutdown
        self._profiler = CallProfiler(cfg.mode)
        # the leader's own stream (the stream placement's: the verify's priority over the
        # speculator's), current in whichever thread generates or serves
        self._stream = stream

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None \
            else contextlib.nullcontext()

    def generate(self, requests, on_event=None, interrupted=None, warm_up: bool = False):
        """One batch of requests; ``warm_up``: the engine's own warm-up call (not counted by
        the profiler, whose ``SSDLIB_PROFILE_CALL`` counts the calls after it)."""
        with self._profiler.call(counted=not warm_up), self._on_stream():
            return self.leader.generate(requests, on_event, interrupted)

    def serve(self, commands, on_event, on_output) -> None:
        """Serve ``("submit", Request)`` / ``("cancel", index)`` messages from ``commands`` (a
        queue) until ``("stop",)``; see :meth:`Leader.serve`."""
        with self._on_stream():
            self.leader.serve(lambda idle: poll_commands(commands, idle), on_event, on_output)

    def close(self) -> None:
        self._shutdown()


def build_rank(cfg: EngineConfig) -> LeaderRuntime | None:
    """Join the world and build this rank's role. Non-leader ranks serve until shutdown and
    return None; the leader returns its runtime."""
    world = init_world(cfg)
    target_ck = load_checkpoint(cfg.target)
    dtype = cfg.torch_dtype
    if world.is_speculator:
        serve_speculator(cfg, world, target_ck)
        destroy_world()
        return None
    # a feature draft's features (which layers, how wide: its config.json), kept by the target
    # on every rank, each running the same forward
    features = feature_spec_for(cfg.draft, target_ck) if cfg.feature_draft else False
    runner = ModelRunner(target_ck, world.tp_group, world.device, dtype, cfg.max_batch, cfg.max_len,
                         cuda_graphs=cfg.cuda_graphs, compile=cfg.compile, features=features)
    channel = TPChannel(world.tp_group, world.device) if cfg.tp > 1 else None
    if not world.is_leader:
        channel.serve(runner)
        runner.release_graphs()
        destroy_world()
        return None
    target = TargetExecutor(runner, channel)
    tokenizer = target_ck.tokenizer
    # the config's EOS ids plus the tokenizer's (which adds a chat template's end-of-turn)
    eos_ids = sorted(set(target_ck.config.eos_token_ids)
                     | set([] if tokenizer is None else tokenizer.eos_token_ids))
    loop, loop_close = _build_loop(cfg, world, target, target_ck)
    leader = Leader(loop, tokenizer, eos_ids, cfg.max_batch, cfg.max_len, world.device)
    stream = leader_stream(world.device) if cfg.mode == "ssd" and cfg.placement == "stream" \
        else None

    def shutdown():
        loop_close()
        target.shutdown()
        runner.release_graphs()
        destroy_world()

    return LeaderRuntime(cfg, world, leader, shutdown, stream)


def _build_loop(cfg, world, target, target_ck):
    if cfg.mode == "ar":
        return ARLoop(target, world.device), lambda: None
    if cfg.mode == "sd":
        return build_sd_loop(cfg, world, target, target_ck)
    if cfg.mode == "ssd":
        return build_link_verifier(cfg, world, target, target_ck)
    raise ConfigError(f"unknown mode {cfg.mode!r}")


def poll_commands(commands, idle: bool):
    """Everything waiting in ``commands``: (new requests, indices to cancel), or None on "stop".
    Waits for the first message only when ``idle`` (nothing runs: the ranks have nothing to do);
    otherwise returns at once so the running batch goes on."""
    new, cancel = [], []
    while True:
        try:
            msg = commands.get() if idle and not new and not cancel else commands.get_nowait()
        except queue.Empty:
            return new, cancel
        if msg[0] == "submit":
            new.append(msg[1])
        elif msg[0] == "cancel":
            cancel.append(msg[1])
        elif msg[0] == "stop":
            return None
        else:
            raise ValueError(f"unknown serving command {msg[0]!r}")


def rank_entry(cfg: EngineConfig, inbox, outbox, log_level: str) -> None:
    """Body of a spawned rank: the leader serves requests from ``inbox`` until 'close'.

    ``("generate", requests, stream, warm_up)`` runs a fixed batch (answer: events, then
    "result"; ``warm_up``: the engine's warm-up call);
    ``("serve",)`` serves submit/cancel messages from the inbox until ``("stop",)`` (answer:
    "event" and "output" messages as they come, then "served")."""
    setup_logging(log_level)
    runtime = build_rank(cfg)
    if runtime is None:
        return
    outbox.put(("ready", None))
    while True:
        msg = inbox.get()
        if msg[0] == "close":
            runtime.close()
            outbox.put(("closed", None))
            return
        if msg[0] == "interrupt":  # it came after its call had finished anyway
            continue
        if msg[0] == "serve":
            runtime.serve(inbox, lambda i, d, ids: outbox.put(("event", (i, d, ids))),
                          lambda o: outbox.put(("output", o)))
            outbox.put(("served", None))
            continue
        _, requests, stream, warm_up = msg
        on_event = (lambda i, d, ids: outbox.put(("event", (i, d, ids)))) if stream else None
        outputs = runtime.generate(requests, on_event, lambda: _interrupt_requested(inbox),
                                   warm_up=warm_up)
        outbox.put(("result", outputs))


def _interrupt_requested(inbox) -> bool:
    """Whether the caller interrupted the running generate call (Ctrl-C in the main process):
    an ``("interrupt",)`` message; nothing else arrives while a call runs."""
    try:
        msg = inbox.get_nowait()
    except queue.Empty:
        return False
    if msg[0] != "interrupt":
        raise ValueError(f"unexpected message {msg[0]!r} while generating")
    return True

