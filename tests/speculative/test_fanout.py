"""Thm 12 geometric fan-out, --fan-out parsing, online estimates of a_p and r."""

import itertools
import math
import random

import pytest

from ssdlib.errors import ConfigError
from ssdlib.speculative import (FanoutEstimator, geometric_fanout, geometric_fanout_real,
                                parse_fanout)
from ssdlib.speculative.fallback import batch_hit_rate, expected_tokens
from ssdlib.speculative.fanout import A_P_RANGE, round_to_total
from ssdlib.speculative.fanout_budget import budget_arms
from ssdlib.speculative.ngram import propose_ngram

def test_sums_to_budget_and_is_monotone():
    for B, K, a, r in itertools.product([1, 7, 23, 64, 257], [0, 1, 3, 5, 8],
                                        [0.0, 0.3, 0.7, 0.95, 1.0], [0.5, 1.0, 2.5]):
        f = geometric_fanout(B, K, a, r)
        assert len(f) == K + 1 and sum(f) == B and min(f) >= 0, (B, K, a, r)
        assert all(f[k] >= f[k + 1] for k in range(K - 1)), (B, K, a, r)
        real = geometric_fanout_real(B, K, a, r)
        assert all(abs(x - y) < 1 for x, y in zip(f, real)), (B, K, a, r)


@pytest.mark.parametrize("B, K, a, r", [(23, 5, 0.7, 1.0), (100, 4, 0.4, 0.5), (9, 2, 0.9, 3.0),
                                        (50, 6, 0.0, 1.0), (50, 6, 1.0, 1.0)])
def test_real_values_follow_the_formula(B, K, a, r):
    real = geometric_fanout_real(B, K, a, r)
    a = min(max(a, A_P_RANGE[0]), A_P_RANGE[1])
    f0 = real[0]
    for k in range(K):
        assert real[k] == pytest.approx(f0 * a ** (k / (1 + r)))
    assert real[K] == pytest.approx(f0 * a ** (K / (1 + r)) * (1 - a) ** (-1 / (1 + r)))
    assert sum(real) == pytest.approx(B)


def test_thm12_allocation_maximises_hit_probability():
    """Among integer allocations of B, the rounded Thm 12 one is (near) the best for its model."""
    B, K, a, r = 12, 2, 0.6, 1.0
    probs = [a ** k * (1 - a) for k in range(K)] + [a ** K]

    def hit(f):
        return sum(pk * (1 - f_k ** -r) for pk, f_k in zip(probs, f) if f_k > 0)

    best = max(hit(f) for f in itertools.product(range(B + 1), repeat=K + 1) if sum(f) == B)
    assert hit(geometric_fanout(B, K, a, r)) >= best - 1e-3


def test_round_to_total_largest_remainder():
    assert round_to_total([2.6, 1.2, 1.2], 5) == [3, 1, 1]
    assert round_to_total([1.5, 1.5, 1.0], 4) == [2, 1, 1]       # tie: lower index first
    assert round_to_total([0.4, 0.3, 0.3], 1) == [1, 0, 0]


@pytest.mark.parametrize("args", [(0, 3, 0.5, 1.0), (5, -1, 0.5, 1.0), (5, 3, 1.2, 1.0),
                                  (5, 3, -0.1, 1.0), (5, 3, 0.5, 0.0), (5, 3, 0.5, -1.0),
                                  (5, 3, 0.5, math.inf), (2.5, 3, 0.5, 1.0)])
def test_geometry_errors(args):
    with pytest.raises(ConfigError):
        geometric_fanout(*args)


def test_parse_fanout():
    assert parse_fanout("8,5,3,2,1,4", 5) == [8, 5, 3, 2, 1, 4]
    assert parse_fanout(" 8, 5 ,3,2,1,4 ", 5) == [8, 5, 3, 2, 1, 4]
    assert parse_fanout([1, 0, 2], 2) == [1, 0, 2]
    assert parse_fanout("auto", 5) == "auto"
    assert parse_fanout("AUTO", 5) == "auto"
    assert parse_fanout("all-accepted:4", 3) == [0, 0, 0, 4]
    assert parse_fanout("all-accepted:7", 0) == [7]


@pytest.mark.parametrize("spec, K", [("8,5,3,2,1,4", 4), ("8,5,3", 5), ("1,-2,3", 2),
                                     ("0,0,0", 2), ("a,b,c", 2), ("", 0), ("all-accepted:0", 3),
                                     ("all-accepted:x", 3), ("all-accepted:", 3), ([1, 2], 2),
                                     ([1, True, 2], 2), ([1.0, 2, 3], 2), ("auto", -1)])
def test_parse_fanout_errors(spec, K):
    with pytest.raises(ConfigError):
        parse_fanout(spec, K)


def synthetic_rounds(est, rounds, a, r, c, K, allocations, seed, c_fresh=None):
    """Rounds whose lookups miss at c F^(-r); with ``c_fresh`` the all-accepted ones (k = K)
    at c_fresh F^(-r) instead, and every lookup is observed with its kind."""
    rng = random.Random(seed)
    for i in range(rounds):
        k = 0
        while k < K and rng.random() < a:
            k += 1
        est.observe_verify([k], [K])
        fan_out = allocations[i % len(allocations)][k]
        c_k = c_fresh if c_fresh is not None and k == K else c
        if fan_out > 0:
            hit = [rng.random() >= min(1.0, c_k * fan_out ** -r)]
            est.observe_lookups([fan_out], hit, None if c_fresh is None else [k == K])


@pytest.mark.parametrize("a, r", [(0.65, 1.2), (0.85, 0.7), (0.4, 2.0)])
def test_estimator_recovers_a_p_and_r(a, r):
    K, B = 5, 40
    est = FanoutEstimator(B, K)
    allocations = [[12, 8, 6, 4, 2, 8], [4, 3, 2, 2, 1, 28], [16, 16, 2, 2, 2, 2]]
    synthetic_rounds(est, 30_000, a, r, 0.8, K, allocations, seed=1)
    assert est.a_p == pytest.approx(a, abs=0.015)
    assert est.r == pytest.approx(r, abs=0.15)
    alloc = est.allocation()
    assert sum(alloc) == B and alloc == geometric_fanout(B, K, est.a_p, est.r)


def test_estimator_priors_and_naive_bias():
    est = FanoutEstimator(23, 5, a_p_prior=0.6, r_prior=1.5)
    assert est.a_p == pytest.approx(0.6) and est.r == 1.5
    assert est.allocation() == geometric_fanout(23, 5, 0.6, 1.5)
    # one F value only: the slope is not identifiable, r stays at the prior
    est.observe_lookups([4] * 200, [True] * 150 + [False] * 50)
    assert est.r == 1.5
    # a_p counts tried tokens only: 3 accepted then a rejection, twice -> 6 / 8 (not 6 / 10)
    est = FanoutEstimator(23, 5, prior_strength=0)
    est.observe_verify([3, 3], [5, 5])
    assert est.a_p == pytest.approx(0.75)
    est.observe_verify([2], [2])                                    # all of a short draft
    assert est.a_p == pytest.approx(8 / 10)


def test_estimator_config_errors():
    with pytest.raises(ConfigError):
        FanoutEstimator(0, 5)
    with pytest.raises(ConfigError):
        FanoutEstimator(10, 5, r_prior=0)
    with pytest.raises(ConfigError):
        FanoutEstimator(10, 5, min_lookups=0)


@pytest.mark.parametrize("limit", [0, 1, 3, 5, 9])
def test_the_allocation_follows_the_verified_limit(limit):
    """Adaptive K verifies only the first ``limit`` tokens: outcomes k <= limit, k = limit the
    all-accepted one; the whole budget goes to them (Thm 12 with K = limit), none after."""
    est = FanoutEstimator(23, 5, a_p_prior=0.6, r_prior=1.5)
    alloc = est.allocation(limit)
    k = min(limit, 5)
    assert len(alloc) == 6 and sum(alloc) == 23
    assert alloc[:k + 1] == geometric_fanout(23, k, 0.6, 1.5) and not any(alloc[k + 1:])
    assert est.allocation(None) == est.allocation()


@pytest.mark.parametrize("call,name", [
    (lambda v: geometric_fanout(v, 3, 0.7, 1.0), "fan-out budget B"),
    (lambda v: budget_arms(v, 3), "fan-out budget"),
    (lambda v: propose_ngram([1, 2, 1, 2], v), "K"),
    (lambda v: expected_tokens(0.5, v), "K"),
    (lambda v: batch_hit_rate(0.5, v), "batch_size"),
])
@pytest.mark.parametrize("bad", [True, 2.0, "3", -1])
def test_integer_arguments_refuse_bools_floats_strings_and_negatives(call, name, bad):
    with pytest.raises(ConfigError, match=f"^{name} must be an integer >= "):
        call(bad)


def test_hit_rate_after_a_speculation_follows_the_miss_model():
    """The lookup after a speculation accepted at per-token rate a hits with probability
    sum_k P_k(a) (1 - c F_k^(-r)): the fitted model at the current allocation; a random
    proposal (a = 0) always lands at k = 0, a perfect one (a = 1) at k = K."""
    K, B, c, r = 5, 40, 0.8, 1.2
    est = FanoutEstimator(B, K)
    assert est.hit_rate_after(0.5) is None  # no lookup yet
    allocations = [[12, 8, 6, 4, 2, 8], [4, 3, 2, 2, 1, 28], [16, 16, 2, 2, 2, 2]]
    synthetic_rounds(est, 30_000, 0.65, r, c, K, allocations, seed=2)
    fan = est.allocation()
    log_c, r_fit = est._miss_fit()
    assert math.exp(log_c) == pytest.approx(c, rel=0.1) and r_fit == pytest.approx(r, abs=0.15)

    def miss(f):
        return 1.0 if f == 0 else min(1.0, math.exp(log_c) * f ** -r_fit)
    for a in (0.0, 0.3, 0.7, 1.0):
        law = [a ** k * (1 - a) for k in range(K)] + [a ** K]
        want = sum(p * (1 - miss(f)) for p, f in zip(law, fan))
        assert est.hit_rate_after(a) == pytest.approx(want)
    assert est.hit_rate_after(0.0) == pytest.approx(1 - miss(fan[0]))
    assert est.hit_rate_after(1.0) == pytest.approx(1 - miss(fan[K]))
    # a verification of the first 2 tokens only: outcomes k = 0..2, the budget on those
    short = est.allocation(limit=2)
    assert est.hit_rate_after(1.0, limit=2) == pytest.approx(1 - miss(short[2]))
    with pytest.raises(ConfigError, match="acceptance"):
        est.hit_rate_after(1.5)


def test_miss_model_before_a_slope_pools_the_lookups():
    """One F value (or too few lookups for a slope): r's prior, and c from every lookup."""
    est = FanoutEstimator(8, 3, r_prior=1.0)
    est.observe_lookups([2] * 30, [True] * 20 + [False] * 10)
    log_c, r = est._miss_fit()
    assert r == 1.0 and math.exp(log_c) == pytest.approx((10 + 0.5) / (30 * 2 ** -1.0 + 1))
    assert est.r == 1.0


def test_hit_rate_after_stays_a_probability_where_nothing_misses():
    """A draft as good as its target: no lookup misses, and the outcome law's sum of floats
    must not come out above 1 (it is weighed as a probability)."""
    for a in (0.3, 0.7, 0.9, 0.99):
        est = FanoutEstimator(16, 5)
        est.observe_lookups([1] * 40 + [3] * 40, [True] * 80)
        for _ in range(50):
            est.observe_verify([5], [5])
        assert 0.0 <= est.hit_rate_after(a) <= 1.0


def test_hit_rate_after_weighs_each_kind_of_lookup_by_its_own_misses():
    """Lookups observed with their kind keep an intercept each at the pooled slope: a backup's
    rejected token (and k = K) is looked up with the fresh kind's c, a jit draft's rejected
    token with the rejected kind's; without kinds both take the pooled c."""
    K, r = 3, 1.0
    est = FanoutEstimator(16, K, r_prior=r)
    # fresh lookups miss 1 in 10 at F = 4; lookups after the draft's own rejection 6 in 10
    est.observe_lookups([4] * 100, [i >= 10 for i in range(100)], [True] * 100)
    est.observe_lookups([4] * 100, [i >= 60 for i in range(100)], [False] * 100)
    assert sum(n for n, _ in est.lookups.values()) == 200  # pooled as before
    log_c, r_fit = est._miss_fit()
    assert r_fit == r  # one F: the prior
    fan = est.allocation()
    c_fresh = (10 + 0.5) / (100 * 4 ** -r + 1)
    c_rejected = (60 + 0.5) / (100 * 4 ** -r + 1)

    def hit(c, f):
        return 0.0 if f == 0 else 1 - min(1.0, c * f ** -r)
    for a in (0.0, 0.4, 0.8):
        law = [a ** k * (1 - a) for k in range(K)] + [a ** K]
        backup = sum(p * hit(c_fresh, f) for p, f in zip(law, fan))
        own = sum(p * hit(c_rejected if k < K else c_fresh, f)
                  for k, (p, f) in enumerate(zip(law, fan)))
        assert est.hit_rate_after(a, own=False) == pytest.approx(backup)
        assert est.hit_rate_after(a) == pytest.approx(own)
    assert est.hit_rate_after(0.0, own=False) > est.hit_rate_after(0.0) + 0.3
    # no kinds observed: the pooled c for both
    plain = FanoutEstimator(16, K, r_prior=r)
    plain.observe_lookups([4] * 200, [i >= 10 for i in range(100)] + [i >= 60 for i in range(100)])
    assert plain.hit_rate_after(0.4, own=False) == pytest.approx(plain.hit_rate_after(0.4))
    with pytest.raises(ValueError, match="one kind per lookup"):
        est.observe_lookups([4, 4], [True, False], [True])


def test_the_kind_of_a_lookup():
    from ssdlib.speculative.fanout import OWN_SOURCES, lookup_is_fresh
    assert lookup_is_fresh(3, 3, True) and lookup_is_fresh(2, 2, True)  # all verified accepted
    assert not lookup_is_fresh(1, 3, True)                              # the draft's own rejected
    assert lookup_is_fresh(1, 3, False)                                 # a backup's rejected
    assert {"cache", "jit", "first"} == OWN_SOURCES


def test_one_slope_and_an_intercept_per_kind(monkeypatch):
    """Lookups of two kinds at different F: the common-slope fit recovers r and both c; the
    pooled fit, which reads the kinds' difference as a slope, does not. The allocation weighs
    F_K by (c_K / c)^(1/(1+r)); SSDLIB_FANOUT_KINDS=0 pools them again."""
    K, B, a, r, c_fresh, c_rejected = 3, 16, 0.7, 1.0, 0.3, 0.9
    est = FanoutEstimator(B, K)
    # the all-accepted position always with many guesses, the rejections with few: pooled,
    # the kinds' different c reads as a steeper slope
    allocations = [[3, 2, 1, 10], [2, 2, 2, 10], [4, 2, 2, 8], [1, 1, 1, 13], [2, 1, 1, 12]]
    synthetic_rounds(est, 40_000, a, r, c_rejected, K, allocations, seed=4, c_fresh=c_fresh)
    fresh, rejected, r_fit = est._model()
    assert r_fit == pytest.approx(r, abs=0.12)
    assert math.exp(fresh) == pytest.approx(c_fresh, rel=0.15)
    assert math.exp(rejected) == pytest.approx(c_rejected, rel=0.15)
    pooled_r = est._miss_fit()[1]
    assert pooled_r > r + 0.1, pooled_r  # (1.13 here)
    weight = math.exp(fresh - rejected)
    assert est.allocation() == geometric_fanout(B, K, est.a_p, r_fit, weight)
    assert est.allocation()[K] < geometric_fanout(B, K, est.a_p, r_fit)[K]
    monkeypatch.setenv("SSDLIB_FANOUT_KINDS", "0")
    assert est.r == pooled_r
    assert est.allocation() == geometric_fanout(B, K, est.a_p, pooled_r)


def test_the_all_accepted_weight_waits_for_both_kinds():
    """Until each kind has min_lookups lookups the all-accepted position is weighed as the
    others; a kind not seen takes the other's c."""
    est = FanoutEstimator(16, 3, min_lookups=20)
    est.observe_lookups([4] * 30, [True] * 25 + [False] * 5, [True] * 30)
    fresh, rejected, _ = est._model()
    assert fresh == rejected
    est.observe_lookups([2] * 10, [False] * 10, [False] * 10)
    assert est.allocation() == geometric_fanout(16, 3, est.a_p, est.r)  # 10 < 20: weight 1
    est.observe_lookups([2] * 10, [False] * 10, [False] * 10)
    assert est.allocation() != geometric_fanout(16, 3, est.a_p, est.r)


def test_the_last_weight_scales_the_all_accepted_share():
    base = geometric_fanout_real(16, 3, 0.7, 1.0)
    half = geometric_fanout_real(16, 3, 0.7, 1.0, last_weight=0.25)
    assert sum(half) == pytest.approx(16)
    # F_K / F_0 shrinks by 0.25^(1/2) = 0.5
    assert half[3] / half[0] == pytest.approx(0.5 * base[3] / base[0])
    for bad in (0.0, -1.0, math.inf, "1"):
        with pytest.raises(ConfigError, match="last_weight"):
            geometric_fanout_real(16, 3, 0.7, 1.0, last_weight=bad)
