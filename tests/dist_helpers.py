"""Rank functions for multi-rank tests (ranks are spawned on CPU with gloo by the tests)."""

import torch


def tp_logits_rank(path: str, tp: int, ids: torch.Tensor, out_queue) -> None:
    """Every rank builds its TP shard; rank 0 returns the logits of a full forward of ``ids``."""
    from ssdlib.distributed.world import init_world
    from ssdlib.engine.runner.model_runner import ModelRunner
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


class _RecordingRunner:
    """Stands in for a ModelRunner: records what each forward is given, returns zeros."""

    def __init__(self):
        self.calls = []

    def forward(self, ids, positions, slots, logits_index=None, kv_len=None):
        args = (ids, positions, slots, logits_index)
        self.calls.append(([None if a is None else (a.device.type, a.tolist()) for a in args],
                           kv_len))
        return torch.zeros(ids.shape[0], 1, 4)


def tp_channel_rank(steps, out_queue) -> None:
    """Rank 0 sends ``steps`` through a TargetExecutor, rank 1 serves them; both report what
    their runner was called with."""
    from ssdlib.distributed.tp_channel import TargetExecutor, TPChannel
    from ssdlib.distributed.world import init_world
    from ssdlib.engine_config import EngineConfig

    world = init_world(EngineConfig(target="unused", tp=2))
    runner = _RecordingRunner()
    channel = TPChannel(world.tp_group, world.device)
    if world.rank == 0:
        executor = TargetExecutor(runner, channel)
        for ids, positions, slots, index in steps:
            executor.forward(ids, positions, slots, index)
        executor.shutdown()
    else:
        channel.serve(runner)
    out_queue.put((world.rank, runner.calls))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
