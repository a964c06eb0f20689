"""Process groups of one ssdlib job.

World = ``tp`` verifier ranks (rank 0 is the leader) + 1 speculator rank in mode ``ssd``.
Groups, created in the same order on every rank:
- ``tp_group``: ranks [0, tp), for the tensor-parallel target (None when tp == 1);
- ``spec_group``: {0, tp}, leader <-> speculator point-to-point (its own group so its sends do
  not serialise with the TP collectives).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ssdlib.engine_config import EngineConfig


@dataclass
class World:
    rank: int
    world_size: int
    tp: int
    device: torch.device
    tp_group: object | None = None
    spec_group: object | None = None
    speculator_rank: int | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def is_verifier(self) -> bool:
        return self.rank < self.tp

    @property
    def is_speculator(self) -> bool:
        return self.speculator_rank is not None and self.rank == self.speculator_rank


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def init_world(cfg: EngineConfig) -> World:
    """Join the process group described by the environment (torchrun or our own spawner)."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.check_world_size(world_size)
    if cfg.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    world = World(rank, world_size, cfg.tp, device)
    if world_size == 1:
        return world
    if not dist.is_initialized():
        # leader<->speculator p2p has its own group on purpose; NCCL's serialisation warning
        # about unbatched p2p is expected there
        os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
        kwargs = {}
        if cfg.device == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(cfg.dist_backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=cfg.timeout_s), **kwargs)
    if cfg.tp > 1:
        world.tp_group = dist.new_group(list(range(cfg.tp)))
    if world_size > cfg.tp:
        world.speculator_rank = cfg.tp
        world.spec_group = dist.new_group([0, cfg.tp])
    return world


def destroy_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
