"""How the ranks of one job share a CPU host: the cores this process may run on, each rank's
intra-op threads, where an SSD speculator runs when the job is left to choose
(``EngineConfig.placement``), and whether the CPU computes in bfloat16 natively (``--dtype
auto``). No GPU concern lives here: GPU ranks do little host compute."""

from __future__ import annotations

import functools
import os

# CPU flags (Linux /proc/cpuinfo) of native bfloat16 arithmetic: AVX512-BF16, AMX-BF16
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=None)
def native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has native bfloat16 arithmetic (a flag of :data:`NATIVE_BF16_FLAGS`):
    there a bfloat16 model reads half the bytes of a float32 one at about the same arithmetic
    rate. False where the flags cannot be read (not Linux): float32 is never the slower choice
    there."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return not set(NATIVE_BF16_FLAGS).isdisjoint(line.split())
    except OSError:
        pass
    return False


def available_cores() -> int:
    """CPU cores this process may run on (its affinity: a container's or taskset's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rank_threads(threads: int | None, device: str, local_ranks: int, current: int, cores: int,
                 omp_env: str | None) -> int | None:
    """The torch intra-op threads a rank should use, or None to leave torch's setting alone.

    ``threads`` (the --threads flag) wins; then an OMP_NUM_THREADS in the environment (torch
    has already read it; torchrun sets it to 1 for multi-rank jobs). Otherwise, on CPU, the
    ``cores`` are shared out among the ``local_ranks`` ranks of this job on this host: each
    rank's own default (``current``, torch's: one thread per physical core) would make N ranks
    run N times as many threads as there are cores, and their OpenMP teams then spin against
    each other (a rank's decode step is many small ops, each a barrier). Never more than
    ``current``: a caller's process that runs the job's only rank keeps a lower setting of its
    own. GPU ranks do little host compute and are left alone.

    One core is left out of the share (where there are two or more) for the rest of the
    machine: the leader's host work, a server's event loop, other processes. A decode step's
    team of threads waits at a barrier after each small op, so one thread that loses its core
    stalls the others: on a 2-core machine with other work running, the quick-start SD command
    decoded at 5.8 tok/s with 2 threads and 33.6 with 1 (AR: 4.4 and 22.4); idle, 1 and 2
    threads decode about equally fast."""
    if threads is not None:
        return threads
    if omp_env or device != "cpu":
        return None
    usable = max(1, cores - 1)
    return min(current, max(1, usable // max(1, local_ranks)))


def cpu_speculator_placement(tp: int, threads: int | None, cores: int,
                             omp_env: str | None) -> str:
    """An "auto" SSD speculator placement on a CPU: "rank" (a process of its own) when the host
    has ``cores`` for the threads of all tp + 1 ranks (each ``threads``, the --threads flag;
    else OMP_NUM_THREADS; else one, the least :func:`rank_threads` gives a rank), "stream"
    otherwise. In its own process the speculator builds the cache on its own cores while the
    verifier verifies; in the leader's process (the stream placement, no concurrency on a CPU)
    the build runs after each verify on the same cores.

    Measured on a 2-core machine (fp32, SmolLM2-135M with the default draft, the held-out chat
    prompts, one `tools/bench.py` invocation, docs/BENCHMARKS.md, 2026-12-04): the rank
    placement decoded 1.64x as fast as the stream placement at b = 1 (26.6 against 16.2 tok/s)
    and 1.70x at b = 4 (34.6 against 20.4)."""
    per_rank = threads
    if per_rank is None and omp_env:
        try:
            per_rank = int(omp_env)
        except ValueError:
            per_rank = None
    return "rank" if cores >= (tp + 1) * max(1, per_rank or 1) else "stream"
