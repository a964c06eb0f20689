"""Spawning a job's ranks from a plain Python process, and tearing all of them down if one fails.

Used by ``Generator`` (and so by ``python -m ssdlib.generate`` without torchrun). Each child gets
the torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT). A child that
raises reports ``(time, rank, message, error kind)`` on the error queue and exits non-zero; the
parent then kills the others at once (a rank blocked in a recv would otherwise wait for its
timeout) and raises :class:`RankFailure` with the *first* failure: its rank, role and message.

Children ignore SIGINT: a terminal's Ctrl-C reaches the whole process group, and it is the
parent's to handle (it stops the ranks); a child must not report it as its own failure.

A child whose work returned cleanly finishes what multiprocessing's bootstrap does after it
(queue feeder threads flushed, finalizers run, streams and log handlers flushed) and leaves
with ``os._exit(0)``, as a forked child does, without the interpreter's teardown: there a CPU
tensor-parallel follower sometimes aborted ("terminate called without an active exception",
4 of 65, 1 of 70 and 1 of 80 runs of a TP 2 loop with ``SSDLIB_STEP_GRAPHS=eager``
in three series), which the parent then reported as that rank's death after a job that had succeeded.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback

import torch.multiprocessing as mp

from ssdlib.errors import RankFailure, SSDError, error_kind, rebuild_error

# how long a failing job's other ranks get to report their errors before they are killed
REPORT_GRACE_S = 1.0

# Ranks are spawned: each child imports the parent's main module again before it runs. A script
# that creates a Generator at import time would start it again inside every child.
UNGUARDED_MAIN = ("ranks are spawned processes that import the main script again, and this "
                  "script starts ssdlib ranks when imported: put its use of ssdlib (e.g. "
                  "creating a Generator) under `if __name__ == \"__main__\":`")


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


def _child(rank: int, world_size: int, port: int, fn, args, errors, parent: int,
           started) -> None:
    started.set()  # past the import of the main module (see UNGUARDED_MAIN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
            errors.put((time.time(), rank, msg, error_kind(e)))
            errors.close()
            errors.join_thread()  # flush before dying: os._exit skips the queue's feeder thread
        finally:
            os._exit(1)
    _leave_cleanly()


def _leave_cleanly() -> None:
    """A child's clean end (see the module doc): flush what the bootstrap would, then exit 0
    without the interpreter's teardown."""
    try:
        multiprocessing.util._exit_function()  # queue feeder threads joined, finalizers run
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(0)


def _death(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}"
    return f"exited with code {exitcode} without reporting an error"


class RankGroup:
    """The spawned ranks of one job. ``roles`` names each rank in failure reports."""

    def __init__(self, world_size: int, fn, args: tuple, roles: list[str] | None = None):
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # a spawned child importing an unguarded main script: one line, no traceback
            # (multiprocessing's own check would print a traceback here, then the parent would
            # see this rank die without a word)
            raise SystemExit(f"ssdlib: {UNGUARDED_MAIN}")
        self.ctx = mp.get_context("spawn")
        self.errors = self.ctx.Queue()
        self.roles = roles
        self.failure: RankFailure | None = None
        port = free_port()
        self.procs = []
        self.started = [self.ctx.Event() for _ in range(world_size)]
        # the children start with SIGINT ignored (an ignored signal survives exec), so a Ctrl-C
        # while they are still importing cannot kill them with a traceback
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            for rank in range(world_size):
                p = self.ctx.Process(target=_child, daemon=True,
                                     args=(rank, world_size, port, fn, args, self.errors,
                                           os.getpid(), self.started[rank]))
                p.start()
                self.procs.append(p)
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)

    def _name(self, rank: int) -> str:
        role = self.roles[rank] if self.roles and rank < len(self.roles) else None
        return f"rank {rank}" + (f" ({role})" if role else "")

    def _drain(self, reports: dict) -> None:
        while True:
            try:
                t, rank, msg, kind = self.errors.get_nowait()
            except queue.Empty:
                return
            reports.setdefault(rank, (t, msg, kind))

    def check(self) -> None:
        """Raise RankFailure if any rank reported an error or died.

        When one rank fails its peers usually fail too (their collectives break), so the report
        names the cause: a rank that died without reporting (killed, crashed in C) comes first,
        since its peers' errors are the consequence; otherwise the earliest reported error.
        Once failed, every later call raises the same failure.
        """
        if self.failure is not None:
            raise self.failure
        reports: dict = {}
        self._drain(reports)
        if not reports and all(p.exitcode in (None, 0) for p in self.procs):
            return
        silent: dict[int, tuple[float, int]] = {}  # rank -> (when noticed, exit code)
        deadline = time.time() + REPORT_GRACE_S  # let the other ranks' reports arrive
        while True:
            codes = [p.exitcode for p in self.procs]
            self._drain(reports)  # after reading exit codes: a reporting rank flushed first
            for rank, code in enumerate(codes):
                if code not in (None, 0) and rank not in reports and rank not in silent:
                    silent[rank] = (time.time(), code)
            if time.time() >= deadline or all(c is not None for c in codes):
                break
            time.sleep(0.05)
        self._drain(reports)
        silent = {r: v for r, v in silent.items() if r not in reports}
        self.kill()
        if silent:
            rank = min(silent, key=lambda r: silent[r])
            death = _death(silent[rank][1])
            if not self.started[rank].is_set():  # it never got past importing the main module
                msg = f"{self._name(rank)} died while starting ({death}); {UNGUARDED_MAIN}"
            else:
                msg = f"{self._name(rank)} died: {death}"
            self.failure = RankFailure(msg, rank=rank)
        else:
            rank = min(reports, key=lambda r: reports[r][0])
            _, msg, kind = reports[rank]
            self.failure = RankFailure(f"{self._name(rank)} failed: {msg}", rank=rank,
                                       cause=rebuild_error(kind, msg))
        raise self.failure

    def wait(self, q, timeout_s: float | None = None):
        """Get one item from ``q`` while watching the ranks."""
        waited = 0.0
        while True:
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                pass
            self.check()  # outside the except: a failure is reported without queue.Empty
            waited += 0.1
            if timeout_s is not None and waited > timeout_s:
                self.kill()
                self.failure = RankFailure(f"no answer from the ranks within {timeout_s:.0f} s")
                raise self.failure

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
