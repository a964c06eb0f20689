"""Rank bodies for the rank-failure tests (spawned with ssdlib.distributed.launcher.RankGroup)."""

import os
import signal
import time


def scripted_rank(plan: dict) -> None:
    """``plan[rank] = (delay_s, action[, after_rank])``: after the delay the rank raises a
    CheckpointError ("checkpoint"), a RuntimeError ("runtime") or is SIGKILLed ("sigkill");
    unlisted ranks wait. With ``after_rank`` (and ``plan["markers"]``, a directory) the delay
    starts once that rank is about to act, whenever each rank started: the order of the two
    failures does not depend on how long spawning took."""
    from ssdlib.errors import CheckpointError

    rank = int(os.environ["RANK"])
    delay, action, *after = plan.get(rank, (60.0, None))
    markers = plan.get("markers")
    if after and markers:
        deadline = time.monotonic() + 60
        while (not os.path.exists(os.path.join(markers, f"acting{after[0]}"))
               and time.monotonic() < deadline):
            time.sleep(0.01)
    time.sleep(delay)
    if markers and action is not None:
        open(os.path.join(markers, f"acting{rank}"), "w").close()
    if action == "checkpoint":
        raise CheckpointError("model.safetensors: tensor 'lm_head.weight' missing")
    if action == "runtime":
        raise RuntimeError("Connection closed by peer (a consequence, not the cause)")
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)


def child_pids(pid: int, spawned_ranks_only: bool = False) -> list[int]:
    """Direct children of ``pid`` (from /proc); with ``spawned_ranks_only`` only the ranks that
    multiprocessing spawned (not its resource tracker)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != pid:
                    continue
            if spawned_ranks_only:
                with open(f"/proc/{d}/cmdline") as c:
                    cmd = c.read()
                if "multiprocessing" not in cmd or "resource_tracker" in cmd:
                    continue
            out.append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return sorted(out)


def teardown_abort_rank(results) -> None:
    """Puts its rank on ``results`` and returns, with an exit handler that aborts the process:
    a model of a crash in the interpreter's teardown after the rank's work is done (a CPU
    tensor-parallel follower sometimes aborted there, docs/ARCHITECTURE.md)."""
    import atexit

    atexit.register(os.abort)
    results.put(int(os.environ["RANK"]))
