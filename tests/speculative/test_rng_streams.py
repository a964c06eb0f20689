"""Counter-based row streams: bit-exact against a plain Python splitmix64, statistics of the
uniforms (uniformity, independence across rows, counters and seeds), reproducibility, and the
whole sampled path running without a host read (on meta tensors)."""

import pytest
import torch

from ssdlib.sampling import SamplingParams, SamplingTensors, row_generators, row_streams
from ssdlib.speculative.acceptance import DraftQ, verify_sampled
from ssdlib.speculative.ngram import random_tokens, random_tokens_host
from ssdlib.speculative.rng import (RowStream, RowStreams, counter_uniforms,
                                    counter_uniforms_host, mix64, mix64_int, sample_categorical,
                                    sample_token, stream_key)

from .spec_stats import chi2_test

MASK = (1 << 64) - 1
PASS = 1e-3


def splitmix64_reference(key: int, counter: int) -> float:
    """Draw ``counter`` of stream ``key`` with Python's unbounded ints, as the algorithm reads."""
    x = (key + (counter + 1) * 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    x ^= x >> 31
    return (x >> 11) / 2.0 ** 53


def draws(seed, rows, n, offset=0):
    return RowStreams.reserve(row_streams(seed, rows, offset), n).uniforms(n)   # [rows, n]


def test_bit_exact_against_python_splitmix64():
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(-2**63, 2**63 - 1, (16,), generator=g, dtype=torch.int64)
    keys[:3] = torch.tensor([0, -1, -2**63])
    counters = torch.randint(0, 2**62, (16,), generator=g, dtype=torch.int64)
    counters[:2] = 0
    u = counter_uniforms(keys, counters, 5)
    assert u.dtype == torch.float64 and u.shape == (16, 5)
    for i in range(16):
        for j in range(5):
            assert u[i, j].item() == splitmix64_reference(int(keys[i]), int(counters[i]) + j)
    x = torch.randint(-2**63, 2**63 - 1, (64,), generator=g, dtype=torch.int64)
    assert mix64(x).tolist() == [mix64_int(v) for v in x.tolist()]
    # the host version (Python ints, for a few draws) gives the same numbers
    for i in range(16):
        assert counter_uniforms_host(int(keys[i]), int(counters[i]), 5) == u[i].tolist()


def test_host_draws_equal_device_draws_and_advance_the_stream():
    streams = [RowStream.from_seed(7, i) for i in range(5)]
    twins = [RowStream(s.key, s.counter) for s in streams]
    V, K = 1000, 4
    dev = random_tokens(RowStreams.reserve(streams, K), 5, K, V).tolist()
    host = random_tokens_host(twins, K, V)
    assert host == dev and all(0 <= t < V for row in host for t in row)
    assert [s.counter for s in twins] == [s.counter for s in streams] == [K] * 5
    # the next draws differ (the counters moved on)
    assert random_tokens_host(twins, K, V) != host


def test_uniform_on_coarse_and_fine_bits():
    u = draws(0, 64, 4096).reshape(-1)                               # 262k draws
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    flat = torch.full((256,), 1 / 256)
    assert chi2_test(torch.bincount((u * 256).long(), minlength=256), flat) > PASS
    low = (u * 2.0 ** 53).long() % 256                                # the lowest 8 bits
    assert chi2_test(torch.bincount(low, minlength=256), flat) > PASS
    assert abs(float(u.mean()) - 0.5) < 4 * (1 / 12 / u.numel()) ** 0.5


def pair_p_value(a: torch.Tensor, b: torch.Tensor, bins: int = 16) -> float:
    """Chi-square of the joint histogram of (a, b) against independence of two uniforms."""
    cells = (a * bins).long() * bins + (b * bins).long()
    return chi2_test(torch.bincount(cells, minlength=bins * bins),
                     torch.full((bins * bins,), 1.0 / bins ** 2))


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_independent_across_rows_counters_and_seeds():
    u = draws(3, 256, 512)                                           # [rows, draws]
    n = u[:-1].numel()
    limit = 4 / n ** 0.5
    # neighbouring rows (consecutive request indices), same counter
    assert pair_p_value(u[:-1].reshape(-1), u[1:].reshape(-1)) > PASS
    assert abs(corr(u[:-1].reshape(-1), u[1:].reshape(-1))) < limit
    # consecutive draws of one row
    assert pair_p_value(u[:, :-1].reshape(-1), u[:, 1:].reshape(-1)) > PASS
    assert abs(corr(u[:, :-1].reshape(-1), u[:, 1:].reshape(-1))) < limit
    # the same request under neighbouring seeds
    v = draws(4, 256, 512)
    assert pair_p_value(u.reshape(-1), v.reshape(-1)) > PASS
    assert abs(corr(u.reshape(-1), v.reshape(-1))) < limit


def test_reproducible_and_split_invariant():
    assert torch.equal(draws(11, 4, 8), draws(11, 4, 8))
    # reserving 3 then 5 draws gives the first 8 of the stream: the count per call only moves
    # the counter, never changes the draws
    s = row_streams(11, 4)
    first = RowStreams.reserve(s, 3).uniforms(3)
    second = RowStreams.reserve(s, 5).uniforms(5)
    assert torch.equal(torch.cat([first, second], 1), draws(11, 4, 8))
    assert [x.counter for x in s] == [8] * 4
    # a slice of a reservation
    r = RowStreams.reserve(row_streams(11, 4), 8)
    assert torch.equal(r.uniforms(3, start=5), draws(11, 4, 8)[:, 5:])
    with pytest.raises(ValueError):
        r.uniforms(4, start=5)


def test_different_seeds_and_requests_differ():
    a, b, c = draws(1, 1, 1000), draws(2, 1, 1000), draws(1, 1, 1000, offset=1)
    assert not bool((a == b).any()) and not bool((a == c).any())
    assert RowStream.from_seed(1, 0).key != RowStream.from_seed(2, 0).key
    # unseeded streams come from torch's global generator
    torch.manual_seed(5)
    x = RowStream.from_seed(None, 0).key
    torch.manual_seed(5)
    assert RowStream.from_seed(None, 0).key == x
    assert RowStream.from_seed(None, 0).key != x


def test_a_row_does_not_depend_on_the_batch():
    streams = row_streams(9, 6)
    for s in streams:
        s.counter = 17 * s.key % 1000                                  # rows at different counters
    batch = RowStreams.reserve([RowStream(s.key, s.counter) for s in streams], 4).uniforms(4)
    for i, s in enumerate(streams):
        alone = RowStreams.reserve([RowStream(s.key, s.counter)], 4).uniforms(4)
        assert torch.equal(alone[0], batch[i])


def test_generator_seed_gives_the_stream_key():
    """Rows still seeded by row_generators map to the same stream as RowStream.from_seed."""
    for seed, index in [(0, 0), (5, 3), (2**40, 7_777_790)]:
        g = row_generators(seed, 1, offset=index)[0]
        assert stream_key(g.initial_seed()) == RowStream.from_seed(seed, index).key


def test_sample_token_on_streams_has_the_distribution():
    """[b, B, V] with streams over b rows: B draws per row; the law of the tokens is probs."""
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3])
    b, B = 500, 40
    streams = RowStreams.reserve(row_streams(0, b), B)
    tokens = sample_token(probs.expand(b, B, 4), streams)            # [b, B]
    assert tokens.shape == (b, B)
    assert chi2_test(torch.bincount(tokens.reshape(-1), minlength=4), probs) > PASS
    # the same draws as sampling each row's B distributions with its B uniforms
    u = streams.uniforms(B)
    assert torch.equal(tokens, sample_categorical(probs.expand(b * B, 4), u.reshape(-1)).view(b, B))
    with pytest.raises(ValueError):
        sample_token(probs.expand(b + 1, 4), streams)


def test_sampled_path_reads_nothing_back():
    """Uniforms, distributions, sampling and the acceptance rule on meta tensors: any .item(),
    .tolist() or bool() of device data would raise, so the path is free of host syncs."""
    with pytest.raises(Exception):
        torch.zeros(1, device="meta").item()
    from ssdlib.engine.sampler import draw_tokens, sample_branches
    from ssdlib.sampling import target_distributions

    b, K, V = 3, 4, 50
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9), SamplingParams(),
              SamplingParams(temperature=1.0, top_p=0.5)]
    st = SamplingTensors.from_params(params, "meta")
    streams = RowStreams(torch.zeros(b, dtype=torch.int64, device="meta"),
                         torch.zeros(b, dtype=torch.int64, device="meta"), K + 1)
    logits = torch.empty(b, K + 1, V, device="meta")
    p = target_distributions(logits, st)
    u = streams.uniforms(K + 1)
    assert draw_tokens(p, logits, st, u).shape == (b, K + 1)
    tokens, q = sample_branches(logits, st, u, 2, 0.5)
    assert tokens.shape == (b, K + 1) and q.shape == (b, K + 1, V)
    dq = DraftQ.per_row([0, 1, 2], torch.empty(b, K, V, device="meta"))
    out = verify_sampled(torch.zeros(b, K, dtype=torch.int64, device="meta"), dq, p, None, streams)
    assert out.bonus.shape == (b,) and out.bonus.device.type == "meta"
