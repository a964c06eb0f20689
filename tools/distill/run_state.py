"""A training run's state on disk, and the parts of it every trainer keeps alike.

A run state is a flat dict of tensors and plain values that ``torch.load(weights_only=True)``
reads back. Every trainer's holds the same shared part, under the same keys (``SHARED_KEYS``):
the step, the optimizer's state, the batcher's place, the evaluations so far and the random
number generators' states (the CPU's, and each CUDA device's where CUDA is available). Each
trainer adds what is its own (its trained tensors, its counters) under keys of its own.

:func:`write_state` writes a state atomically (to ``path + ".tmp"``, then renamed over
``path``), so a run killed while writing leaves the previous state whole. :func:`read_state`
reads one on the CPU and raises :class:`RunStateError`, naming the file, when it is missing,
unreadable or lacks a key. :func:`capture_shared` and :func:`restore_shared` take and put back
the shared part; :func:`capture_rng` and :func:`restore_rng` the generators' states alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch

from ssdlib.errors import SSDError

RNG_KEYS = ("rng_cpu", "rng_cuda")
# the keys of the part of a run state every trainer shares
SHARED_KEYS = ("step", "optimizer", "batcher", "history", *RNG_KEYS)
TMP_SUFFIX = ".tmp"  # where write_state writes before the rename


class RunStateError(SSDError, ValueError):
    """A run state that is missing, unreadable, or lacks what restoring it needs."""


class Resumable(Protocol):
    """What keeps its place in a run as a small state (a batcher: ``tools.distill.data``)."""

    def state(self) -> dict: ...

    def restore(self, state: dict) -> None: ...


def write_state(state: Mapping[str, Any], path: str) -> None:
    """Write ``state`` to ``path`` atomically: ``torch.save`` to ``path + ".tmp"``, then
    ``os.replace`` over ``path`` (its directory is made when missing). A failed write leaves
    ``path`` as it was and no ``.tmp`` file."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = path + TMP_SUFFIX
    try:
        torch.save(dict(state), tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_state(path: str, keys: Iterable[str] = SHARED_KEYS) -> dict[str, Any]:
    """The run state in ``path``, its tensors on the CPU (``weights_only=True``: plain tensors,
    containers and numbers only). RunStateError naming ``path`` when the file is missing,
    unreadable, not a state dict, or lacks one of ``keys``."""
    if not os.path.isfile(path):
        raise RunStateError(f"{path}: no run state there (the file is missing)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises pickle's, zipfile's and its own errors
        raise RunStateError(f"{path}: not a readable run state ({type(e).__name__}: "
                            f"{e})") from e
    if not isinstance(state, dict):
        raise RunStateError(f"{path}: not a run state (it holds a {type(state).__name__}, "
                            "not a dict)")
    require_keys(state, keys, path)
    return state


def require_keys(state: Mapping[str, Any], keys: Iterable[str], source: str) -> None:
    """RunStateError naming ``source`` (a file, or what the state is) and the missing keys when
    ``state`` lacks any of ``keys``."""
    missing = [k for k in keys if k not in state]
    if missing:
        raise RunStateError(f"{source}: not a run state of this trainer (it lacks "
                            f"{', '.join(missing)})")


def capture_rng() -> dict[str, Any]:
    """The random number generators' states: ``rng_cpu`` (a tensor) and ``rng_cuda`` (one
    tensor per CUDA device; empty where CUDA is not available)."""
    return {"rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set the generators to :func:`capture_rng`'s ``state``: the CPU's, and the CUDA devices'
    where the state has them and CUDA is available."""
    require_keys(state, RNG_KEYS, "the RNG state")
    torch.set_rng_state(state["rng_cpu"])
    if len(state["rng_cuda"]) and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])


def capture_shared(step: int, optimizer: torch.optim.Optimizer, batcher: Resumable,
                   history: list[dict]) -> dict[str, Any]:
    """The shared part of a run state (``SHARED_KEYS``): the step, the optimizer's state, the
    batcher's place, a copy of the evaluations so far and the generators' states."""
    return {"step": int(step), "optimizer": optimizer.state_dict(), "batcher": batcher.state(),
            "history": list(history), **capture_rng()}


def restore_shared(state: Mapping[str, Any], optimizer: torch.optim.Optimizer,
                   batcher: Resumable) -> tuple[int, list[dict]]:
    """Put :func:`capture_shared`'s ``state`` back: the optimizer's state, the batcher's place
    and the generators' states. Returns the step and the evaluations, which the trainer keeps.
    RunStateError, before anything changes, when ``state`` lacks a shared key."""
    require_keys(state, SHARED_KEYS, "the run state")
    optimizer.load_state_dict(state["optimizer"])
    batcher.restore(state["batcher"])
    restore_rng(state)
    return int(state["step"]), list(state["history"])
