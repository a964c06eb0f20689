"""Intra-op threads per rank: the cores but one are shared out among a job's ranks on one host unless
--threads or OMP_NUM_THREADS says otherwise (``host_cpu.rank_threads``, against a plain table);
spawned ranks of a two-rank job get their share; ``--device auto`` resolves once; on a CPU an
"auto" SSD speculator gets a process of its own where the host has cores for every rank's
threads (``host_cpu.cpu_speculator_placement``)."""

import os

import pytest
import torch

from ssdlib.distributed.launcher import RankGroup
from ssdlib.distributed.host_cpu import available_cores, cpu_speculator_placement, rank_threads
from ssdlib.engine_config import EngineConfig
from ssdlib.errors import ConfigError


def report_threads(cfg, results) -> None:
    """A rank's body: sets its intra-op threads as ``init_world`` does and reports them."""
    from ssdlib.distributed.world import _set_threads

    _set_threads(cfg, int(os.environ["WORLD_SIZE"]))
    results.put((int(os.environ["RANK"]), torch.get_num_threads()))


@pytest.mark.parametrize("threads,device,ranks,current,cores,omp,want", [
    (None, "cpu", 1, 8, 8, None, 7),      # one rank: every core but one
    (None, "cpu", 2, 8, 8, None, 3),      # two ranks share them
    (None, "cpu", 3, 8, 8, None, 2),      # rounded down: never more threads than cores
    (None, "cpu", 16, 8, 8, None, 1),     # more ranks than cores: one each
    (None, "cpu", 1, 2, 2, None, 1),      # two cores: one thread (a busy core stalls a team)
    (None, "cpu", 1, 1, 1, None, 1),      # one core: one thread
    (None, "cpu", 1, 2, 8, None, 2),      # a caller's lower setting is kept
    (None, "cpu", 1, 16, 4, None, 3),     # torch counted more cores than this process may use
    (None, "cpu", 2, 8, 8, "3", None),    # OMP_NUM_THREADS: torch has it already
    (5, "cpu", 2, 8, 8, "3", 5),          # --threads wins over everything
    (None, "cuda", 2, 8, 8, None, None),  # GPU ranks: left alone
    (2, "cuda", 2, 8, 8, None, 2),
])
def test_rank_threads(threads, device, ranks, current, cores, omp, want):
    assert rank_threads(threads, device, ranks, current, cores, omp) == want


@pytest.mark.parametrize("tp,threads,cores,omp,want", [
    (1, None, 2, None, "rank"),     # two cores: one each for the verifier and the speculator
    (1, None, 1, None, "stream"),   # one core: the speculator would take turns with the verifier
    (2, None, 2, None, "stream"),   # TP 2 + speculator: three ranks on two cores
    (2, None, 3, None, "rank"),
    (1, 2, 3, None, "stream"),      # --threads 2: two ranks want four cores
    (1, 2, 4, None, "rank"),
    (1, None, 4, "2", "rank"),      # OMP_NUM_THREADS counts as each rank's threads
    (1, None, 3, "2", "stream"),
    (1, None, 2, "many", "rank"),   # (an OMP_NUM_THREADS that is not a number: one thread)
])
def test_cpu_speculator_placement(tp, threads, cores, omp, want):
    assert cpu_speculator_placement(tp, threads, cores, omp) == want


def test_auto_placement_on_a_cpu_follows_the_cores(monkeypatch):
    """``EngineConfig.placement`` on a CPU asks the host's cores (the rule above); an explicit
    placement is kept whatever the cores."""
    import ssdlib.engine_config as engine_config

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for cores, want in ((2, "rank"), (1, "stream")):
        monkeypatch.setattr(engine_config, "available_cores", lambda c=cores: c)
        cfg = EngineConfig(device="cpu", mode="ssd")
        assert (cfg.placement, cfg.world_size) == (want, 1 + (want == "rank"))
        assert EngineConfig(device="cpu", mode="ssd", speculator_placement="stream").placement \
            == "stream"


def _spawned_threads(cfg) -> list[int]:
    results = torch.multiprocessing.get_context("spawn").Queue()
    ranks = RankGroup(2, report_threads, (cfg, results))
    got = sorted(ranks.wait(results, timeout_s=120)[1] for _ in range(2))
    ranks.join()
    return got


def test_spawned_ranks_share_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the children inherit it
    cfg = EngineConfig(device="cpu")
    want = max(1, (available_cores() - 1) // 2)
    got = _spawned_threads(cfg)
    # torch's own default may be lower (physical cores): never raised above it
    assert all(1 <= n <= want for n in got) and got[0] == got[1], got
    assert _spawned_threads(EngineConfig(device="cpu", threads=3)) == [3, 3]


def test_spawned_ranks_keep_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _spawned_threads(EngineConfig(device="cpu")) == [1, 1]


def test_device_auto_resolves_once():
    cfg = EngineConfig(device="auto")
    assert cfg.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert EngineConfig().device == cfg.device  # the default
    assert EngineConfig(device="cpu").device == "cpu"
    with pytest.raises(ConfigError, match="auto, cpu, cuda"):
        EngineConfig(device="gpu")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="--threads"):
            EngineConfig(threads=bad)


@pytest.mark.parametrize("flags,want", [
    ("fpu sse avx2 avx512f avx512_bf16 avx512_vnni", True),
    ("fpu sse avx2 amx_bf16 amx_tile", True),
    ("fpu sse avx2 avx512f avx512bw", False),   # AVX512 without bfloat16 arithmetic
    ("fpu sse avx2 avx512_bf16x", False),       # a flag is a whole word
])
def test_native_bf16_reads_the_cpu_flags(tmp_path, flags, want):
    from ssdlib.distributed.host_cpu import native_bf16

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\n")
    assert native_bf16(str(info)) is want
    assert native_bf16(str(tmp_path / "absent")) is False


def test_dtype_auto_resolves_by_device_and_cpu(monkeypatch):
    """--dtype auto (the command line's default): bfloat16 on a CPU with native bfloat16
    arithmetic, else float32; None (the Python API's default) stays float32 on a CPU."""
    import ssdlib.engine_config as engine_config

    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(engine_config, "native_bf16", lambda: native)
        cfg = EngineConfig(device="cpu", dtype="auto")
        assert cfg.dtype == want and cfg.torch_dtype == getattr(torch, want)
        assert EngineConfig(device="cpu").torch_dtype == torch.float32
        assert EngineConfig(device="cpu", dtype="float32").dtype == "float32"
    with pytest.raises(ConfigError, match="--dtype must be auto, float32"):
        EngineConfig(device="cpu", dtype="double")
