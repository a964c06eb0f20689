"""Rank bodies for the rank-failure tests (spawned with ssdlib.distributed.launcher.RankGroup)."""

import os
import signal
import time


def scripted_rank(plan: dict) -> None:
    """``plan[rank] = (delay_s, action)``: after the delay the rank raises a CheckpointError
    ("checkpoint"), a RuntimeError ("runtime") or is SIGKILLed ("sigkill"); unlisted ranks wait."""
    from ssdlib.errors import CheckpointError

    rank = int(os.environ["RANK"])
    delay, action = plan.get(rank, (60.0, None))
    time.sleep(delay)
    if action == "checkpoint":
        raise CheckpointError("model.safetensors: tensor 'lm_head.weight' missing")
    if action == "runtime":
        raise RuntimeError("Connection closed by peer (a consequence, not the cause)")
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
