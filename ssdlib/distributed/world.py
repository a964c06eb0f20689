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

from ssdlib.distributed.host_cpu import available_cores, rank_threads
from ssdlib.engine_config import EngineConfig
from ssdlib.errors import ConfigError
from ssdlib.log import get_logger

log = get_logger(__name__)


@dataclass
class World:
    rank: int
    world_size: int
    tp: int
    device: torch.device
    tp_group: object | None = None
    spec_group: object | None = None
    speculator_rank: int | None = None
    # the speculator shares the leader's GPU (fewer GPUs than ranks): NCCL cannot join two ranks
    # on one device, so the leader <-> speculator link runs on gloo through host memory
    spec_staged: bool = False

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


def _set_threads(cfg: EngineConfig, world_size: int) -> int:
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    n = rank_threads(cfg.threads, cfg.device, local_ranks, torch.get_num_threads(),
                     available_cores(), os.environ.get("OMP_NUM_THREADS"))
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    return torch.get_num_threads()


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
    threads = _set_threads(cfg, world_size)
    log.info("rank %d of %d runs on %s (%s), %d intra-op thread(s)", rank, world_size, device,
             torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU", threads)
    world = World(rank, world_size, cfg.tp, device)
    if world_size == 1:
        return world
    shared = cfg.device == "cuda" and torch.cuda.device_count() < world_size
    if shared and cfg.tp > torch.cuda.device_count():
        raise ConfigError(f"--tp {cfg.tp} needs {cfg.tp} GPUs, {torch.cuda.device_count()} visible")
    if not dist.is_initialized():
        # leader<->speculator p2p has its own group on purpose; NCCL's serialisation warning
        # about unbatched p2p is expected there
        os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
        kwargs = {}
        if cfg.device == "cuda" and not shared:
            kwargs["device_id"] = device
        dist.init_process_group("gloo" if shared else cfg.dist_backend, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=cfg.timeout_s),
                                **kwargs)
    if cfg.tp > 1:
        world.tp_group = dist.new_group(list(range(cfg.tp)),
                                        backend=cfg.dist_backend if shared else None)
    if world_size > cfg.tp:
        world.speculator_rank = cfg.tp
        world.spec_group = dist.new_group([0, cfg.tp])
        world.spec_staged = shared
        if shared and rank == 0:
            log.warning("the speculator shares GPU %d with the verifier (%d GPU(s) for %d ranks): "
                        "its link runs on gloo through host memory, and SSD's speed-up needs "
                        "the draft on its own GPU", device.index, torch.cuda.device_count(),
                        world_size)
    return world


def destroy_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
