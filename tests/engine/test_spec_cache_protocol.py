"""Speculation cache keys/lookup against a plain reference, and the wire protocol: every message
through its pack/unpack (in process), then through SpecLink between two spawned ranks (gloo,
direct and ``staged``)."""

import pytest
import torch
import torch.multiprocessing as mp

from ssdlib.distributed.launcher import RankGroup
from ssdlib.engine.protocol import (SPEC_PHASES, Admit, AdmitRow, ControlFrame, Header, Op,
                                    Outcome, Speculation, SpeculatorStats)
from ssdlib.engine.spec_cache import SpeculationCache
from ssdlib.sampling import SamplingParams


def test_cache_lookup_matches_reference():
    g = torch.Generator().manual_seed(0)
    b, B, K, V = 5, 7, 3, 11
    cache = SpeculationCache(8, B, K, V, torch.device("cpu"))
    rows = torch.tensor([0, 2, 3, 5, 7])
    fork = torch.randint(0, K + 1, (b, B), generator=g)
    bonus = torch.randint(0, V, (b, B), generator=g)
    tokens = torch.randint(0, V, (b, B, K), generator=g)
    cache.tokens[rows] = tokens
    cache.store_keys(rows, fork, bonus)
    hit, _, _ = cache.lookup(rows.tolist(), fork[:, 0].tolist(), bonus[:, 0].tolist())
    assert not bool(hit.any())  # stored but not published: the host mirror is still empty
    cache.publish()
    for trial in range(200):
        k = torch.randint(0, K + 1, (b,), generator=g)
        t = torch.randint(0, V, (b,), generator=g)
        if trial % 3 == 0:  # make some lookups hit a stored branch
            pick = torch.randint(0, B, (b,), generator=g)
            k, t = fork[torch.arange(b), pick], bonus[torch.arange(b), pick]
        hit, branch, found = cache.lookup(rows.tolist(), k.tolist(), t.tolist())
        assert hit.device.type == branch.device.type == found.device.type == "cpu"
        for i in range(b):
            matches = [j for j in range(B) if fork[i, j] == k[i] and bonus[i, j] == t[i]]
            assert bool(hit[i]) == bool(matches)
            if matches:
                assert int(branch[i]) == matches[0]
                assert found[i].tolist() == tokens[i, matches[0]].tolist()
            else:
                assert found[i].tolist() == [0] * K
    # rows never stored never hit
    hit, _, _ = cache.lookup([1], [0], [0])
    assert not bool(hit[0])
    # a new sequence in a slot: its row misses at once, on the host mirror too
    cache.invalidate([2])
    hit, _, _ = cache.lookup([2, 3], [int(fork[1, 0]), int(fork[2, 0])],
                             [int(bonus[1, 0]), int(bonus[2, 0])])
    assert hit.tolist() == [False, True]
    cache.invalidate(rows.tolist())
    hit, _, _ = cache.lookup(rows.tolist(), fork[:, 0].tolist(), bonus[:, 0].tolist())
    assert not bool(hit.any())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cache_host_mirror_on_cuda():
    """The asynchronous path: keys stored on the GPU, published to pinned memory, looked up at
    once (the lookup waits for the copy), then a row invalidated on both sides."""
    dev = torch.device("cuda")
    B, K, V = 4, 3, 50
    cache = SpeculationCache(6, B, K, V, dev)
    assert cache.host_fork.is_pinned() and cache.host_tokens.is_pinned()
    rows = torch.tensor([0, 3], device=dev)
    fork = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], device=dev)
    bonus = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], device=dev)
    tokens = torch.arange(2 * B * K, device=dev).view(2, B, K)
    for _ in range(3):  # several rounds: every publish lands before its lookup
        torch.cuda._sleep(10_000_000)  # keep the stream busy so the copy is still queued
        cache.tokens[rows] = tokens
        cache.store_keys(rows, fork, bonus)
        cache.publish()
        hit, branch, found = cache.lookup([0, 3], [2, 0], [7, 12])
        assert hit.tolist() == [True, True] and branch.tolist() == [2, 3]
        assert found.tolist() == tokens[[0, 1], [2, 3]].cpu().tolist()
        tokens = tokens + 100
    cache.invalidate([3])
    hit, _, _ = cache.lookup([0, 3], [2, 0], [7, 12])
    assert hit.tolist() == [True, False]


# ---- messages -------------------------------------------------------------------------------
K, V = 3, 6


def _admit() -> Admit:
    return Admit([
        AdmitRow(0, [1, 2, 3], 10, SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=42)),
        AdmitRow(3, [4, 5], 11, SamplingParams()),
    ])


def _outcome() -> Outcome:
    return Outcome([0, 3, 1], [2, 0, 0], [5, 4, 0], [True, True, False], sampling=True)


def _spec() -> Speculation:
    q = torch.rand(3, K, V, generator=torch.Generator().manual_seed(1))
    return Speculation(torch.tensor([[1, 2, 3], [4, 5, 0], [0, 0, 0]]), torch.tensor([0, 2, 0]),
                       torch.tensor([True, False, False]), q)


def _same_admit(a: Admit, b: Admit) -> bool:
    key = lambda r: (r.slot, r.tokens, r.request_index, r.params.temperature, r.params.top_p,
                     r.params.top_k, r.params.seed)
    return [key(r) for r in a.rows] == [key(r) for r in b.rows]


def _same_spec(a: Speculation, b: Speculation) -> bool:
    return (torch.equal(a.tokens, b.tokens) and torch.equal(a.kinds, b.kinds)
            and torch.equal(a.hit, b.hit)
            and (a.q is None) == (b.q is None) and (a.q is None or torch.equal(a.q, b.q)))


def test_control_frame_carries_header_and_outcome_rows():
    frame = torch.full((ControlFrame.size(4),), -7, dtype=torch.int64)
    assert frame.shape == (8 + 4 * 4,)
    msg = _outcome()
    ControlFrame.pack(frame, msg.header(), msg)
    header, rows = ControlFrame.unpack(frame)
    assert header == msg.header() and Outcome.unpack(rows[:header.b], header) == msg
    assert rows[3].tolist() == [0, 0, 0, 0]  # rows beyond b are zeros, not stale data
    ControlFrame.pack(frame, Header(Op.SHUTDOWN))
    header, rows = ControlFrame.unpack(frame)
    assert header == Header(Op.SHUTDOWN) and not bool(rows.any())


def test_header_pack_unpack():
    buf = torch.zeros(Header.SIZE, dtype=torch.int64)
    h = Header(Op.OUTCOME, 3, 7, True)
    assert buf is h.pack(buf) and buf.tolist() == [2, 3, 7, 1, 0, 0, 0, 0]
    assert Header.unpack(buf) == h


def test_admit_pack_unpack():
    msg = _admit()
    assert msg.header() == Header(Op.ADMIT, 2, 5)
    rows, params, tokens = msg.pack()
    assert rows.dtype == tokens.dtype == torch.int64 and params.dtype == torch.float64
    assert rows.tolist() == [[0, 3, 10, 42], [3, 2, 11, -1]]
    assert params.tolist() == [[0.7, 0.9, 5.0], [0.0, 1.0, 0.0]]
    assert tokens.tolist() == [1, 2, 3, 4, 5]
    assert [t.shape for t in Admit.empty(msg.header(), "cpu")] == [rows.shape, params.shape,
                                                                  tokens.shape]
    back = Admit.unpack(rows, params, tokens)
    assert _same_admit(back, msg) and back.rows[1].params.greedy


def test_outcome_pack_unpack():
    msg = _outcome()
    assert msg.header() == Header(Op.OUTCOME, 3, 0, True)
    buf = torch.full((5, Outcome.WIDTH), -9, dtype=torch.int64)  # preallocated, max_batch rows
    rows = msg.pack(buf)
    assert rows.tolist() == [[0, 2, 5, 1], [3, 0, 4, 1], [1, 0, 0, 0]] and buf[3, 0] == -9
    assert Outcome.unpack(rows, msg.header()) == msg


def test_speculation_pack_unpack():
    msg = _spec()
    buf = torch.zeros(5, K + 2, dtype=torch.int64)
    q_buf = torch.zeros(5, K, V)
    parts = msg.pack(buf, q_buf)
    assert [p.shape for p in parts] == [(3, K + 2), (3, K, V)]
    assert parts[0].tolist() == [[1, 2, 3, 0, 1], [4, 5, 0, 2, 0], [0, 0, 0, 0, 0]]
    back = Speculation.unpack(*parts)
    buf.zero_()
    q_buf.zero_()  # the receive buffers are reused: unpack copies out of them
    assert _same_spec(back, msg)
    greedy = Speculation(msg.tokens, msg.kinds, msg.hit, None)
    parts = greedy.pack(buf, None)
    assert len(parts) == 1 and _same_spec(Speculation.unpack(parts[0], None), greedy)


def test_stats_pack_unpack():
    phases = {"commit": 0.01, "lookup": 0.02, "fallback": 0.5, "send": 0.03, "build": 1.25}
    msg = SpeculatorStats(1.5, 0.25, 7, 9, 6, 40, phases)
    t = msg.pack()
    assert SPEC_PHASES == ("commit", "lookup", "fallback", "send", "build")
    assert t.dtype == torch.float64 and t.shape == (SpeculatorStats.SIZE,) == (11,)
    # the layout of docs/PROTOCOL.md: counters, rounds, then seconds in SPEC_PHASES order
    assert t.tolist() == [1.5, 0.25, 7, 9, 6, 40, 0.01, 0.02, 0.5, 0.03, 1.25]
    back = SpeculatorStats.unpack(t)
    assert back == msg and back.rounds == 40 and back.phase_s == phases
    # a STATS without rounds (no OUTCOME answered since the last) has every phase at 0
    empty = SpeculatorStats(0.5, 0.0, 0, 0, 0)
    assert empty.phase_s == dict.fromkeys(SPEC_PHASES, 0.0)
    assert SpeculatorStats.unpack(empty.pack()) == empty
    with pytest.raises(ValueError, match="unknown phases"):
        SpeculatorStats(0.0, 0.0, 0, 0, 0, 1, {"verify": 1.0})


def test_stats_plus_sums_every_field():
    a = SpeculatorStats(1.0, 2.0, 3, 4, 1, 5, {"lookup": 0.5, "build": 1.0})
    b = SpeculatorStats(0.5, 1.0, 1, 2, 0, 3, {"build": 0.25, "send": 0.125})
    total = a.plus(b)
    assert total == SpeculatorStats(1.5, 3.0, 4, 6, 1, 8,
                                    {"lookup": 0.5, "build": 1.25, "send": 0.125})


def _protocol_rank(results) -> None:
    from ssdlib.distributed.world import init_world
    from ssdlib.engine.spec_link import SpecLink
    from ssdlib.engine_config import EngineConfig

    world = init_world(EngineConfig(target="unused", mode="ssd", draft="unused"))
    for staged in (False, True):
        link = SpecLink(world.spec_group, 1 - world.rank, world.device, 4, K, V, staged=staged)
        spec = _spec()
        stats = SpeculatorStats(0.5, 2.0, 3, 4, 1, 7, {"lookup": 0.25, "build": 1.5})
        if world.rank == 0:  # the leader
            link.send_admit(_admit())
            link.send_outcome(_outcome())
            assert _same_spec(link.recv_spec(3, sampling=True), spec)
            link.send_outcome(Outcome([0], [1], [2], [True], sampling=False))
            got = link.recv_spec(1, sampling=False)
            assert got.q is None and torch.equal(got.tokens, spec.tokens[:1])
            link.send_outcome(Outcome([0, 3], [0, 0], [0, 0], [False, False], sampling=False))
            assert link.recv_stats() == stats
            link.send_shutdown()
        else:  # the speculator
            header = link.recv_header()
            assert header == Header(Op.ADMIT, 2, 5)
            assert _same_admit(link.recv_admit(header), _admit())
            header = link.recv_header()
            assert header == _outcome().header() and link.recv_outcome(header) == _outcome()
            link.send_spec(spec)
            header = link.recv_header()
            assert link.recv_outcome(header) == Outcome([0], [1], [2], [True], sampling=False)
            link.send_spec(Speculation(spec.tokens[:1], spec.kinds[:1], spec.hit[:1], None))
            assert not any(link.recv_outcome(link.recv_header()).active)
            link.send_stats(stats)
            assert link.recv_header() == Header(Op.SHUTDOWN)
    if world.rank == 0:
        results.put("ok")


def test_protocol_round_trip():
    q = mp.get_context("spawn").Queue()
    ranks = RankGroup(2, _protocol_rank, (q,))
    assert ranks.wait(q, timeout_s=60) == "ok"
    ranks.join()
