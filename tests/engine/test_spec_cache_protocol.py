"""Speculation cache keys/lookup against a plain reference, and the wire protocol round trip."""

import torch
import torch.multiprocessing as mp

from ssdlib.distributed.launcher import RankGroup
from ssdlib.engine.spec_cache import SpeculationCache


def test_cache_lookup_matches_reference():
    g = torch.Generator().manual_seed(0)
    b, B, K, V = 5, 7, 3, 11
    cache = SpeculationCache(8, B, K, V, torch.device("cpu"))
    rows = torch.tensor([0, 2, 3, 5, 7])
    fork = torch.randint(0, K + 1, (b, B), generator=g)
    bonus = torch.randint(0, V, (b, B), generator=g)
    cache.store_keys(rows, fork, bonus)
    for trial in range(200):
        k = torch.randint(0, K + 1, (b,), generator=g)
        t = torch.randint(0, V, (b,), generator=g)
        if trial % 3 == 0:  # make some lookups hit a stored branch
            pick = torch.randint(0, B, (b,), generator=g)
            k, t = fork[torch.arange(b), pick], bonus[torch.arange(b), pick]
        hit, branch = cache.lookup(rows, k, t)
        for i in range(b):
            matches = [j for j in range(B) if fork[i, j] == k[i] and bonus[i, j] == t[i]]
            assert bool(hit[i]) == bool(matches)
            if matches:
                assert int(branch[i]) == matches[0]
    # rows never stored never hit
    hit, _ = cache.lookup(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))
    assert not bool(hit[0])
    cache.clear()
    hit, _ = cache.lookup(rows, fork[:, 0], bonus[:, 0])
    assert not bool(hit.any())


def _protocol_rank(results) -> None:
    from ssdlib.distributed.world import init_world
    from ssdlib.engine.protocol import OP_ADMIT, OP_OUTCOME, OP_SHUTDOWN, SpecLink
    from ssdlib.engine_config import EngineConfig

    world = init_world(EngineConfig(target="unused", mode="ssd", draft="unused"))
    K, V = 3, 6
    link = SpecLink(world.spec_group, 1 - world.rank, world.device, 4, K, V)
    rows = torch.tensor([[0, 3, 10, 42], [1, 2, 11, -1]])
    params = torch.tensor([[0.7, 0.9, 5.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    toks = torch.tensor([1, 2, 3, 4, 5])
    outcome = torch.tensor([[0, 2, 5, 1], [1, 0, 4, 0]])
    spec = torch.tensor([[1, 2, 3], [4, 5, 0]])
    q = torch.rand(2, K, V, generator=torch.Generator().manual_seed(1))
    if world.rank == 0:
        link.send_admit(rows, params, toks)
        link.send_outcome(outcome, sampling=True)
        got = link.recv_spec(2, sampling=True)
        assert torch.equal(got.tokens, spec) and torch.equal(got.q, q)
        assert got.kinds.tolist() == [0, 2] and got.hit.tolist() == [True, False]
        link.send_shutdown()
        results.put("ok")
    else:
        op, b, n, sampling = link.recv_header()
        assert (op, b, n) == (OP_ADMIT, 2, 5)
        r, p, t = link.recv_admit(b, n)
        assert torch.equal(r, rows) and torch.equal(p, params) and torch.equal(t, toks)
        op, b, _, sampling = link.recv_header()
        assert (op, sampling) == (OP_OUTCOME, 1) and torch.equal(link.recv_outcome(b), outcome)
        link.send_spec(spec, torch.tensor([0, 2]), torch.tensor([True, False]), q)
        assert link.recv_header()[0] == OP_SHUTDOWN


def test_protocol_round_trip():
    q = mp.get_context("spawn").Queue()
    ranks = RankGroup(2, _protocol_rank, (q,))
    assert ranks.wait(q, timeout_s=60) == "ok"
    ranks.join()
