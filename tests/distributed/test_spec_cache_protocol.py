"""Speculation cache keys pushed to the leader and looked up there, against a plain reference;
the leader's local fallbacks; and the wire protocol: every message through its pack/unpack (in
process), then through SpecLink between two spawned ranks (gloo, direct and ``staged``)."""

import pytest
import torch
import torch.multiprocessing as mp

from ssdlib.distributed.launcher import RankGroup
from ssdlib.distributed.protocol import (SPEC_HOST_SEGMENTS, SPEC_PHASES, Admit, AdmitRow,
                                         CacheRows, Choice, ControlFrame, Header, Op, Outcome,
                                         Speculation, SpeculatorStats)
from ssdlib.engine.leader.cache_mirror import CacheMirror, local_fallback
from ssdlib.engine.speculator.spec_cache import SpeculationCache
from ssdlib.sampling import SamplingParams
from ssdlib.speculative.acceptance import QKind
from ssdlib.speculative.ngram import random_tokens_host
from ssdlib.speculative.rng import RowStream


def _pushed(cache, rows, live, fallback=1):
    """The CACHE message for cache rows ``rows`` as the leader receives it."""
    dev = cache.device
    msg = cache.pushed_rows(torch.tensor(rows, device=dev), torch.tensor(live, device=dev),
                            fallback)
    return CacheRows.unpack(msg.cpu(), cache.B, cache.K)


def test_mirror_lookup_matches_reference():
    """Keys stored in the speculator's cache, pushed (CACHE), looked up on the leader's mirror:
    the first branch whose (k, t*) matches answers, with its tokens; anything else misses."""
    g = torch.Generator().manual_seed(0)
    b, B, K, V = 5, 7, 3, 11
    cache = SpeculationCache(8, B, K, V, torch.device("cpu"))
    rows = torch.tensor([0, 2, 3, 5, 7])
    fork = torch.randint(0, K + 1, (b, B), generator=g)
    bonus = torch.randint(0, V, (b, B), generator=g)
    tokens = torch.randint(0, V, (b, B, K), generator=g)
    cache.tokens[rows] = tokens
    cache.store_keys(rows, fork, bonus)
    mirror = CacheMirror()
    assert mirror.lookup(0, int(fork[0, 0]), int(bonus[0, 0])) == (None, None, "jit")  # no push
    mirror.update(rows.tolist(), _pushed(cache, rows.tolist(), [True] * b, fallback=1))
    for trial in range(200):
        k = torch.randint(0, K + 1, (b,), generator=g)
        t = torch.randint(0, V, (b,), generator=g)
        if trial % 3 == 0:  # make some lookups hit a stored branch
            pick = torch.randint(0, B, (b,), generator=g)
            k, t = fork[torch.arange(b), pick], bonus[torch.arange(b), pick]
        for i in range(b):
            branch, found, fallback = mirror.lookup(int(rows[i]), int(k[i]), int(t[i]))
            assert fallback == "ngram"  # FALLBACKS[1], as pushed
            matches = [j for j in range(B) if fork[i, j] == k[i] and bonus[i, j] == t[i]]
            if matches:
                assert branch == matches[0] and found == tokens[i, matches[0]].tolist()
            else:
                assert branch is None and found is None
    # a slot never pushed misses, with jit
    assert mirror.lookup(1, 0, 0) == (None, None, "jit")
    # a row pushed as not live, or invalidated and pushed again, misses
    cache.invalidate([2])
    mirror.update([2, 3], _pushed(cache, [2, 3], [True, False]))
    assert mirror.lookup(2, int(fork[1, 0]), int(bonus[1, 0]))[0] is None
    assert mirror.lookup(3, int(fork[2, 0]), int(bonus[2, 0]))[0] is None
    assert mirror.lookup(5, int(fork[3, 0]), int(bonus[3, 0]))[0] is not None
    mirror.forget(5)  # a new sequence in the slot
    assert mirror.lookup(5, int(fork[3, 0]), int(bonus[3, 0]))[0] is None


def test_local_fallbacks_draw_on_the_leader():
    """n-gram where a suffix recurs (one-hot q), random elsewhere (uniform q); K draws of the
    row's stream either way, so the same stream gives the same tokens."""
    K, V = 3, 50
    seq = [5, 6, 7, 8, 9, 5, 6]  # the suffix [5, 6] recurs: n-gram proposes 7, 8, 9
    toks, kind = local_fallback("ngram", seq, RowStream.from_seed(1), K, V)
    assert toks == [7, 8, 9] and kind == int(QKind.ONEHOT)
    toks, kind = local_fallback("ngram", [1, 2, 3], RowStream.from_seed(1), K, V)
    assert kind == int(QKind.UNIFORM) and toks == random_tokens_host([RowStream.from_seed(1)],
                                                                     K, V)[0]
    s1, s2 = RowStream.from_seed(3), RowStream.from_seed(3)
    a = local_fallback("random", seq, s1, K, V)
    assert a == local_fallback("random", seq, s2, K, V) and a[1] == int(QKind.UNIFORM)
    assert s1.counter == K and local_fallback("random", seq, s1, K, V) != a  # the stream moved
    with pytest.raises(ValueError, match="jit"):
        local_fallback("jit", seq, s1, K, V)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pushed_rows_on_cuda():
    """The CACHE built on the GPU (no read-back there) reaches the mirror intact, round after
    round, while the stream is still busy."""
    dev = torch.device("cuda")
    B, K, V = 4, 3, 50
    cache = SpeculationCache(6, B, K, V, dev)
    rows = torch.tensor([0, 3], device=dev)
    fork = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], device=dev)
    bonus = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], device=dev)
    tokens = torch.arange(2 * B * K, device=dev).view(2, B, K)
    mirror = CacheMirror()
    for _ in range(3):
        torch.cuda._sleep(10_000_000)  # keep the stream busy
        cache.tokens[rows] = tokens
        cache.store_keys(rows, fork, bonus)
        mirror.update([0, 3], _pushed(cache, [0, 3], [True, True], fallback=2))
        assert mirror.lookup(0, 2, 7)[:2] == (2, tokens[0, 2].tolist())
        assert mirror.lookup(3, 0, 12) == (3, tokens[1, 3].tolist(), "random")
        tokens = tokens + 100


# ---- messages -------------------------------------------------------------------------------
K, V = 3, 6


def _admit() -> Admit:
    return Admit([
        AdmitRow(0, [1, 2, 3], 10, SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=42)),
        AdmitRow(3, [4, 5], 11, SamplingParams()),
    ])


def _outcome() -> Outcome:
    return Outcome([0, 3, 1], [2, 0, 0], [5, 4, 0], [True, True, False], sampling=True, k=K,
                   choice=[int(Choice.CACHE), int(Choice.LOCAL), int(Choice.JIT)],
                   arg=[4, int(QKind.ONEHOT), 0], tokens=[[1, 2, 3], [3, 2, 1], [0, 0, 0]],
                   limit=[3, 1, 0])


def _spec() -> Speculation:
    q = torch.rand(3, K, V, generator=torch.Generator().manual_seed(1))
    return Speculation(torch.tensor([[1, 2, 3], [4, 5, 0], [0, 0, 0]]), torch.tensor([0, 2, 0]),
                       q)


def _cache_rows() -> torch.Tensor:
    """A CACHE of 2 rows, 2 branches: ready, fallback, forks, bonuses, tokens [2, K]."""
    return CacheRows.pack_device(torch.tensor([True, False]), 2,
                                 torch.tensor([[0, 3], [1, 1]]), torch.tensor([[4, 5], [1, 2]]),
                                 torch.arange(2 * 2 * K).view(2, 2, K))


def _same_admit(a: Admit, b: Admit) -> bool:
    key = lambda r: (r.slot, r.tokens, r.request_index, r.params.temperature, r.params.top_p,
                     r.params.top_k, r.params.seed)
    return [key(r) for r in a.rows] == [key(r) for r in b.rows]


def _same_spec(a: Speculation, b: Speculation) -> bool:
    """Equal parts, wherever each side's tensors are (a link's received q is on its device)."""
    same = lambda x, y: torch.equal(x.cpu(), y.cpu())
    return (same(a.tokens, b.tokens) and same(a.kinds, b.kinds)
            and (a.q is None) == (b.q is None) and (a.q is None or same(a.q, b.q)))


def test_control_frame_carries_header_and_outcome_rows():
    frame = torch.full((ControlFrame.size(4, K),), -7, dtype=torch.int64)
    assert frame.shape == (8 + (7 + K) * 4,)
    msg = _outcome()
    ControlFrame.pack(frame, msg.header(), msg)
    header, rows = ControlFrame.unpack(frame, K)
    assert header == msg.header() and Outcome.unpack(rows[:header.b], header, K) == msg
    assert rows[3].tolist() == [0] * (7 + K)  # rows beyond b are zeros, not stale data
    ControlFrame.pack(frame, Header(Op.SHUTDOWN))
    header, rows = ControlFrame.unpack(frame, K)
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
    buf = torch.full((5, Outcome.width(K)), -9, dtype=torch.int64)  # max_batch rows
    rows = msg.pack(buf)
    assert rows.tolist() == [[0, 2, 5, 1, 1, 4, 3, 1, 2, 3], [3, 0, 4, 1, 2, 1, 1, 3, 2, 1],
                             [1, 0, 0, 0, 0, 0, 0, 0, 0, 0]] and buf[3, 0] == -9
    assert Outcome.unpack(rows, msg.header(), K) == msg
    # defaults: every row asks for a jit draft, to be verified whole
    plain = Outcome([2], [1], [3], [True], sampling=False, k=K)
    assert plain.choice == [int(Choice.JIT)] and plain.tokens == [[0] * K]
    assert plain.limit == [K]
    with pytest.raises(ValueError, match="one entry per row"):
        Outcome([2, 4], [1], [3, 3], [True, True], sampling=False, k=K)


@pytest.mark.parametrize("choice,active,sampling,want", [
    (Choice.JIT, True, False, (True, False)), (Choice.CACHE, True, False, (False, False)),
    (Choice.LOCAL, True, False, (False, False)), (Choice.CACHE, True, True, (False, True)),
    (Choice.JIT, True, True, (True, True)),
    (Choice.JIT, False, False, (False, False)), (Choice.JIT, False, True, (False, True))])
def test_outcome_says_which_spec_parts_are_due(choice, active, sampling, want):
    """Row 0 as given next to a live cache hit: the tokens part is due for a live jit row, q
    whenever the exchange samples."""
    msg = Outcome([0, 1], [0, 2], [1, 2], [active, True], sampling=sampling, k=K,
                  choice=[int(choice), int(Choice.CACHE)])
    assert msg.spec_parts() == want
    gone = Outcome([0], [0], [0], [False], sampling=sampling, k=K)  # no live row: STATS
    assert gone.spec_parts() == (False, False)


def test_cache_rows_pack_unpack():
    rows = _cache_rows()
    assert rows.shape == (2, CacheRows.width(2, K)) == (2, 2 + 2 * (K + 2))
    msg = CacheRows.unpack(rows, 2, K)
    assert msg.ready == [True, False] and msg.fallback == [2, 2]
    assert msg.fork == [[0, 3], [1, 1]] and msg.bonus == [[4, 5], [1, 2]]
    assert msg.tokens == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]]]


def test_speculation_pack_unpack():
    msg = _spec()
    buf = torch.zeros(5, K + 1, dtype=torch.int64)
    q_buf = torch.zeros(5, K, V)
    parts = msg.pack(buf, q_buf)
    assert [p.shape for p in parts] == [(3, K + 1), (3, K, V)]
    assert parts[0].tolist() == [[1, 2, 3, 0], [4, 5, 0, 2], [0, 0, 0, 0]]
    back = Speculation.unpack(*parts)
    buf.zero_()
    q_buf.zero_()  # the receive buffers are reused: unpack copies out of them
    assert _same_spec(back, msg)
    greedy = Speculation(msg.tokens, msg.kinds, None)
    parts = greedy.pack(buf, None)
    assert len(parts) == 1 and _same_spec(Speculation.unpack(parts[0], None), greedy)


def test_stats_pack_unpack():
    phases = {"commit": 0.01, "fallback": 0.5, "send": 0.03, "build": 1.25, "push": 0.02}
    host = {"commit": 0.125, "answer": 0.25, "send": 0.0, "build": 0.5, "push": 0.0625,
            "end": 1.0}
    msg = SpeculatorStats(1.5, 0.25, 7, 9, 6, 40, phases, host, 3)
    t = msg.pack()
    assert SPEC_PHASES == ("commit", "fallback", "send", "build", "push")
    assert SPEC_HOST_SEGMENTS == ("commit", "answer", "send", "build", "push", "end")
    assert t.dtype == torch.float64 and t.shape == (SpeculatorStats.SIZE,) == (18,)
    # the layout of docs/PROTOCOL.md: counters, rounds, then seconds in SPEC_PHASES order, then
    # host seconds in SPEC_HOST_SEGMENTS order, then the rows held
    assert t.tolist() == [1.5, 0.25, 7, 9, 6, 40, 0.01, 0.5, 0.03, 1.25, 0.02,
                          0.125, 0.25, 0.0, 0.5, 0.0625, 1.0, 3]
    back = SpeculatorStats.unpack(t)
    assert back == msg and back.rounds == 40 and back.phase_s == phases and back.host_s == host
    assert back.held == 3
    # a STATS without rounds (no OUTCOME answered since the last) has every phase at 0
    empty = SpeculatorStats(0.5, 0.0, 0, 0, 0)
    assert empty.phase_s == dict.fromkeys(SPEC_PHASES, 0.0)
    assert empty.host_s == dict.fromkeys(SPEC_HOST_SEGMENTS, 0.0)
    assert SpeculatorStats.unpack(empty.pack()) == empty
    with pytest.raises(ValueError, match="unknown phases"):
        SpeculatorStats(0.0, 0.0, 0, 0, 0, 1, {"verify": 1.0})
    with pytest.raises(ValueError, match="unknown host segments"):
        SpeculatorStats(0.0, 0.0, 0, 0, 0, 1, {}, {"between": 1.0})


def test_stats_plus_sums_every_counter():
    a = SpeculatorStats(1.0, 2.0, 3, 4, 1, 5, {"push": 0.5, "build": 1.0}, held=2)
    b = SpeculatorStats(0.5, 1.0, 1, 2, 0, 3, {"build": 0.25, "send": 0.125})
    total = a.plus(b)  # (the rows held: the later STATS')
    assert total == SpeculatorStats(1.5, 3.0, 4, 6, 1, 8,
                                    {"push": 0.5, "build": 1.25, "send": 0.125}, held=0)
    c = SpeculatorStats(0.0, 0.0, 0, 0, 0, 1, {}, {"end": 0.5})
    assert c.plus(c).host_s["end"] == 1.0


def _protocol_rank(results) -> None:
    from ssdlib.distributed.spec_link import SpecLink
    from ssdlib.distributed.world import init_world
    from ssdlib.engine_config import EngineConfig

    world = init_world(EngineConfig(target="unused", mode="ssd", draft="unused"))
    # gloo on CPU carries either kind of link; on a GPU the world's own: staged where the two
    # ranks share one GPU (gloo cannot send CUDA tensors), direct over NCCL between two GPUs
    for staged in (False, True) if world.device.type == "cpu" else (world.spec_staged,):
        link = SpecLink(world.spec_group, 1 - world.rank, world.device, 4, K, V, staged=staged,
                        branches=2)
        # as the engine holds them: q and the cache's rows on the link's device
        spec = _spec()
        spec.q = spec.q.to(world.device)
        cache_rows = _cache_rows().to(world.device)
        stats = SpeculatorStats(0.5, 2.0, 3, 4, 1, 7, {"push": 0.25, "build": 1.5})
        if world.rank == 0:  # the leader
            link.send_admit(_admit())
            link.send_outcome(_outcome())
            got = link.recv_spec_tokens(3)
            got.q = link.recv_q(3)
            assert _same_spec(got, spec)
            assert link.recv_cache(2) == CacheRows.unpack(_cache_rows(), 2, K)
            link.send_outcome(Outcome([0], [1], [2], [True], sampling=False, k=K))
            got = link.recv_spec_tokens(1)
            assert got.q is None and torch.equal(got.tokens.cpu(), spec.tokens[:1])
            link.post_cache(2)  # posted early (as during a verify forward), completed later
            with pytest.raises(RuntimeError, match="already posted"):
                link.post_cache(2)
            assert link.recv_cache(2) == CacheRows.unpack(_cache_rows(), 2, K)
            link.send_outcome(Outcome([0], [1], [2], [True], sampling=True, k=K,
                                      choice=[int(Choice.CACHE)]))
            assert torch.equal(link.recv_q(1), spec.q[:1])  # q alone: no tokens part
            link.send_outcome(Outcome([0, 3], [0, 0], [0, 0], [False, False], sampling=False,
                                      k=K))
            assert link.recv_stats() == stats
            link.send_shutdown()
        else:  # the speculator
            header = link.recv_header()
            assert header == Header(Op.ADMIT, 2, 5)
            assert _same_admit(link.recv_admit(header), _admit())
            header = link.recv_header()
            assert header == _outcome().header() and link.recv_outcome(header) == _outcome()
            link.send_spec(spec)
            link.send_cache(cache_rows)
            header = link.recv_header()
            assert link.recv_outcome(header) == Outcome([0], [1], [2], [True], sampling=False,
                                                        k=K)
            link.send_spec(Speculation(spec.tokens[:1], spec.kinds[:1], None))
            link.send_cache(cache_rows)
            header = link.recv_header()
            assert link.recv_outcome(header).spec_parts() == (False, True)
            link.send_spec(Speculation(spec.tokens[:1], spec.kinds[:1], spec.q[:1]),
                           tokens=False)
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
