"""Rank functions for multi-rank tests (ranks are spawned on CPU with gloo by the tests)."""

import torch


def tp_logits_rank(path: str, tp: int, ids: torch.Tensor, out_queue) -> None:
    """Every rank builds its TP shard; rank 0 returns the logits of a full forward of ``ids``."""
    from ssdlib.distributed.world import init_world
    from ssdlib.engine.model_runner import ModelRunner
    from ssdlib.engine_config import EngineConfig
    from ssdlib.loading import load_checkpoint

    cfg = EngineConfig(target=path, tp=tp)
    world = init_world(cfg)
    runner = ModelRunner(load_checkpoint(path), world.tp_group, world.device, torch.float32,
                         ids.shape[0], 64)
    b, s = ids.shape
    logits = runner.forward(ids, torch.arange(s).expand(b, s), torch.arange(b))
    if world.rank == 0:
        out_queue.put(logits)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def failing_rank(fail_rank: int) -> None:
    """All ranks join; ``fail_rank`` raises while the others block in a collective."""
    import torch.distributed as dist

    from ssdlib.distributed.world import init_world
    from ssdlib.engine_config import EngineConfig

    world = init_world(EngineConfig(target="unused", tp=3, timeout_s=600))
    if world.rank == fail_rank:
        raise RuntimeError("boom on purpose")
    dist.barrier()
