"""Intra-op threads per rank: the cores but one are shared out among a job's ranks on one host unless
--threads or OMP_NUM_THREADS says otherwise (``world.rank_threads``, against a plain table);
spawned ranks of a two-rank job get their share; ``--device auto`` resolves once."""

import os

import pytest
import torch

from ssdlib.distributed.launcher import RankGroup
from ssdlib.distributed.world import available_cores, rank_threads
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
