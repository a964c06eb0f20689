"""Memory a configuration needs (weights and KV cache of every rank), checked before anything is
allocated, so ``--max-batch 1000`` is refused with what fits instead of dying in an allocation.

The KV cache of one model on one rank holds, per layer, K and V for every slot (``max_batch``
plus one scratch slot), its KV heads (padded to a multiple of ``tp``, split over the ranks) and
``max_len + POSITION_SLACK`` positions: ``layers * 2 * slots * kv_heads * positions * head_dim``
elements. The speculator's draft keeps ``k + 2`` more positions and a branch region of
``fan-out budget * k``. Activations are not counted: the check refuses what cannot fit at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ssdlib.config import ModelConfig
from ssdlib.engine.runner.model_runner import POSITION_SLACK
from ssdlib.engine_config import EngineConfig
from ssdlib.errors import ConfigError
from ssdlib.speculative.fanout import parse_fanout


def weight_bytes(config: ModelConfig, tp: int, dtype_bytes: int) -> int:
    """Bytes of one rank's weights (tensor-parallel matrices split ``tp`` ways).

    A draft that uses its target's embedding (``embedding_from_target``) holds its own copy of it
    at run time, so it counts here like any draft's embedding; a narrower one
    (``target_hidden_size``) holds its folded embedding and head [vocab, hidden], untied."""
    h, hd = config.hidden_size, config.head_dim
    attn = h * hd * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    mlp = 3 * h * config.intermediate_size
    vocab = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    sharded = config.num_hidden_layers * (attn + mlp) + vocab
    norms = (2 * config.num_hidden_layers + 1) * h
    return (-(-sharded // tp) + norms) * dtype_bytes


def kv_bytes_per_slot(config: ModelConfig, tp: int, positions: int, dtype_bytes: int) -> int:
    """Bytes of one slot's KV cache on one rank, over ``positions`` positions."""
    kv_heads = -(-config.num_key_value_heads // tp)
    return config.num_hidden_layers * 2 * kv_heads * positions * config.head_dim * dtype_bytes


@dataclass
class RankMemory:
    """One rank's model: ``weights`` bytes plus ``slot_bytes(max_len)`` per KV slot."""

    rank: int
    device: str
    config: ModelConfig
    tp: int
    extra_positions: int  # beyond max_len (slack, the speculator's lookahead and branches)
    dtype_bytes: int

    @property
    def weights(self) -> int:
        return weight_bytes(self.config, self.tp, self.dtype_bytes)

    def slot_bytes(self, max_len: int) -> int:
        return kv_bytes_per_slot(self.config, self.tp, max_len + self.extra_positions,
                                 self.dtype_bytes)


def rank_memory(cfg: EngineConfig, target: ModelConfig, draft: ModelConfig | None,
                local_rank: dict[int, int] | None = None) -> list[RankMemory]:
    """Every model the job allocates, with the device it lands on (rank r on GPU
    ``local_rank.get(r, r) % GPUs``, as ``init_world`` places it)."""
    nbytes = cfg.torch_dtype.itemsize
    n_gpus = torch.cuda.device_count() if cfg.device == "cuda" else 0

    def device(rank: int) -> str:
        return f"cuda:{(local_rank or {}).get(rank, rank) % n_gpus}" if n_gpus else "cpu"

    out = [RankMemory(r, device(r), target, cfg.tp, POSITION_SLACK, nbytes)
           for r in range(cfg.tp)]
    if draft is not None and cfg.mode != "ar":
        if cfg.world_size > cfg.tp:  # the speculator / separate draft rank
            branches = 0
            if cfg.mode == "ssd":
                fan = parse_fanout(cfg.fan_out, cfg.k)
                branches = (cfg.fan_out_budget if fan == "auto" else sum(fan)) * cfg.k
            out.append(RankMemory(cfg.tp, device(cfg.tp), draft, 1,
                                  cfg.k + 2 + POSITION_SLACK + branches, nbytes))
        else:  # sd with the draft on the leader
            out.append(RankMemory(0, device(0), draft, 1, POSITION_SLACK, nbytes))
    return out


def free_memory(device: str, cuda_context: bool = False) -> int | None:
    """Bytes available on ``device`` ("cpu" or "cuda:i"), or None if unknown.

    ``cuda_context``: this process will use the GPU anyway (the engine runs in it), so ask CUDA
    directly; otherwise NVML answers without creating a CUDA context (about 1 s to load pynvml)."""
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        if cuda_context or torch.cuda.is_initialized():
            return torch.cuda.mem_get_info(index)[0]
        try:  # through NVML: no CUDA context in this process, which may only spawn the ranks
            used = torch.cuda.device_memory_used(index)
            return torch.cuda.get_device_properties(index).total_memory - used
        except Exception:  # NVML (pynvml) not available
            return torch.cuda.mem_get_info(index)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n < 1e10 else f"{n / 1e9:.1f} GB"


def check_memory(cfg: EngineConfig, target: ModelConfig, draft: ModelConfig | None,
                 rank: int | None = None, local_rank: int | None = None,
                 cuda_context: bool = False) -> None:
    """Raise ConfigError if the weights and KV cache of ``cfg`` cannot fit in the free memory of
    the devices they land on; the message says which --max-batch / --max-len would fit.
    ``cuda_context``: the engine runs in this process (see :func:`free_memory`).

    ``rank`` (and its ``local_rank``): check only that rank's models, on its own device (what a
    torchrun rank does); by default every rank's, as spawned on this host."""
    slots = cfg.max_batch + 1  # + the scratch slot padded rows write to
    by_device: dict[str, list[RankMemory]] = {}
    local = {rank: rank if local_rank is None else local_rank} if rank is not None else None
    for r in rank_memory(cfg, target, draft, local):
        if rank is None or r.rank == rank:
            by_device.setdefault(r.device, []).append(r)
    for dev, ranks in by_device.items():
        free = free_memory(dev, cuda_context)
        if free is None:
            continue
        weights = sum(r.weights for r in ranks)
        per_slot = sum(r.slot_bytes(cfg.max_len) for r in ranks)
        kv = slots * per_slot
        if weights + kv <= free:
            continue
        fit_batch = (free - weights) // per_slot - 1 if free > weights else 0
        # per-slot bytes are affine in max_len: per_slot(L) = a * L + b
        a = sum(r.slot_bytes(1) - r.slot_bytes(0) for r in ranks)
        b = sum(r.slot_bytes(0) for r in ranks)
        fit_len = int(((free - weights) / slots - b) // a) if free > weights else 0
        hints = []
        if fit_batch >= 1:
            hints.append(f"--max-batch {fit_batch} fits at this --max-len")
        if fit_len >= 8:
            hints.append(f"--max-len {fit_len} fits at this --max-batch")
        advice = " or ".join(hints) if hints else \
            "the weights alone do not fit; use a smaller model, --tp or another device"
        raise ConfigError(
            f"--max-batch {cfg.max_batch} with --max-len {cfg.max_len} needs {_gb(kv)} of KV "
            f"cache plus {_gb(weights)} of weights on {dev}, but only {_gb(free)} is free: "
            f"{advice}")
