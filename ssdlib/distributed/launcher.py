"""Spawning a job's ranks from a plain Python process, and tearing all of them down if one fails.

Used by ``Generator`` (and so by ``python -m ssdlib.generate`` without torchrun). Each child gets
the torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT). A child that
raises reports ``(rank, message)`` on the error queue and exits non-zero; the parent then kills
the others at once (a rank blocked in a recv would otherwise wait for its timeout) and raises
:class:`RankFailure` with the first error.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
import traceback

import torch.multiprocessing as mp

from ssdlib.errors import RankFailure, SSDError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_with_parent(parent: int) -> None:
    """A rank whose spawning process died (even by SIGKILL) exits instead of waiting forever."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _child(rank: int, world_size: int, port: int, fn, args, errors, parent: int) -> None:
    _exit_with_parent(parent)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        fn(*args)
    except BaseException as e:  # report any failure, then die so the parent can tear down
        if isinstance(e, SSDError):
            msg = str(e)
        else:
            msg = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        try:
            errors.put((time.time(), rank, msg))
            errors.close()
            errors.join_thread()  # flush before dying: os._exit skips the queue's feeder thread
        finally:
            os._exit(1)


class RankGroup:
    """The spawned ranks of one job."""

    def __init__(self, world_size: int, fn, args: tuple):
        self.ctx = mp.get_context("spawn")
        self.errors = self.ctx.Queue()
        port = free_port()
        self.procs = []
        for rank in range(world_size):
            p = self.ctx.Process(target=_child, daemon=True,
                                 args=(rank, world_size, port, fn, args, self.errors, os.getpid()))
            p.start()
            self.procs.append(p)

    def check(self) -> None:
        """Raise RankFailure if any rank reported an error or died.

        When one rank fails, its peers usually fail too (their collectives break); the report
        names the *earliest* error, the cause.
        """
        reports = []
        try:
            reports.append(self.errors.get_nowait())
        except queue.Empty:
            dead = [(i, p.exitcode) for i, p in enumerate(self.procs)
                    if p.exitcode not in (None, 0)]
            if not dead:
                return
            reports.append((float("inf"), dead[0][0],
                            f"rank {dead[0][0]} died (exit code {dead[0][1]})"))
        deadline = time.time() + 1.0  # let the other ranks' reports arrive
        while time.time() < deadline:
            try:
                reports.append(self.errors.get(timeout=0.1))
            except queue.Empty:
                if all(p.exitcode is not None for p in self.procs):
                    break
        self.kill()
        _, rank, msg = min(reports, key=lambda r: r[0])
        raise RankFailure(f"rank {rank} failed: {msg}")

    def wait(self, q, timeout_s: float | None = None):
        """Get one item from ``q`` while watching the ranks."""
        waited = 0.0
        while True:
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                self.check()
                waited += 0.1
                if timeout_s is not None and waited > timeout_s:
                    self.kill()
                    raise RankFailure(f"no answer from the ranks within {timeout_s:.0f} s")

    def join(self, timeout_s: float = 30.0) -> None:
        for p in self.procs:
            p.join(timeout_s)
        self.check()
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
