"""The tuned fan-out budget (speculative/fanout_budget.py): its arms, its probes, and its choice
of the largest budget whose build the verify hides."""

import pytest

from ssdlib.errors import ConfigError
from ssdlib.speculative.fanout import FanoutEstimator
from ssdlib.speculative.fanout_budget import BudgetTuner, budget_arms


def test_arms_halve_down_to_one_branch_per_outcome():
    assert budget_arms(16, 3) == [16, 8, 4]
    assert budget_arms(16, 5) == [16, 8]       # 4 < K + 1 = 6
    assert budget_arms(9, 3) == [9, 5]         # halves round up; 3 < 4
    assert budget_arms(4, 3) == [4]            # nothing smaller keeps a branch per outcome
    assert budget_arms(64, 1, count=2) == [64, 32]
    with pytest.raises(ConfigError, match="integer >= 1"):
        budget_arms(0, 3)


def test_bad_arms_are_refused():
    for arms in ([], [4, 8], [8, 8], [0]):
        with pytest.raises(ConfigError, match="budget arms"):
            BudgetTuner(arms)
    with pytest.raises(ConfigError, match="first_hold"):
        BudgetTuner([8, 4], hold=8, first_hold=16)


def run(tuner: BudgetTuner, builds: int, times: dict | None = None) -> list[int]:
    """``builds`` budgets from ``tuner``, each build's (build, verify) ms from ``times``."""
    out = []
    for _ in range(builds):
        b = tuner.next_budget()
        out.append(b)
        if times is not None:
            tuner.observe(b, *times[b])
    return out


def test_probes_cycle_the_arms_then_hold_the_largest_hidden():
    tuner = BudgetTuner([16, 8, 4], probe=1, hold=5, first_hold=5)
    # the verify hides 8 and 4, not 16 (build, verify ms); each arm two builds in a row, one
    # into each of chained rounds' two caches
    times = {16: (1.5, 1.3), 8: (1.2, 1.3), 4: (1.1, 1.3)}
    assert run(tuner, 6, times) == [16, 16, 8, 8, 4, 4]
    assert run(tuner, 5, times) == [8] * 5
    assert tuner.held == 8
    # then it probes again, afresh: now 16 is hidden too
    times = {16: (1.2, 1.3), 8: (1.1, 1.3), 4: (1.0, 1.3)}
    assert run(tuner, 6, times) == [16, 16, 8, 8, 4, 4]
    assert run(tuner, 2, times) == [16, 16]
    assert tuner.take() == {"held": 16, "builds": {"16": 6, "8": 9, "4": 4}}
    assert tuner.take()["builds"] == {}


def test_when_no_build_is_hidden_the_smallest_is_held():
    tuner = BudgetTuner([16, 8, 4], probe=1, hold=3, first_hold=3)
    times = {16: (7.9, 5.7), 8: (7.7, 5.7), 4: (7.6, 5.8)}  # the 8B / 1B-cost pair's shape
    assert run(tuner, 9, times) == [16, 16, 8, 8, 4, 4, 4, 4, 4]


def test_without_timings_the_full_budget_is_held():
    tuner = BudgetTuner([16, 8], probe=1, hold=4, first_hold=4)
    assert run(tuner, 8) == [16, 16, 8, 8, 16, 16, 16, 16]


def test_the_median_round_decides_and_other_budgets_are_ignored():
    tuner = BudgetTuner([16, 8], probe=1, hold=4, first_hold=4)
    assert tuner.next_budget() == 16
    tuner.observe(16, 250.0, 1.2)  # the round that captured it: an outlier
    tuner.observe(16, 1.0, 1.2)
    tuner.observe(16, 1.1, 1.2)
    assert tuner.hidden(16) is True
    tuner.observe(16, 1.3, 1.2)
    tuner.observe(16, 1.4, 1.2)    # now most rounds were not hidden
    tuner.observe(32, 0.1, 9.0)    # not an arm
    assert tuner.hidden(16) is False and tuner.hidden(8) is None
    # 16 not hidden, 8 never timed: no arm is known hidden -> the smallest
    assert run(tuner, 4) == [16, 8, 8, 8]
    assert tuner.held == 8


def test_an_allocation_takes_a_smaller_budget():
    est = FanoutEstimator(16, 3)
    assert sum(est.allocation()) == 16
    for b in (8, 4, 1):
        fan = est.allocation(budget=b)
        assert len(fan) == 4 and sum(fan) == b
    assert sum(est.allocation(limit=1, budget=8)) == 8
    for bad in (0, 17, 2.0, True):
        with pytest.raises(ConfigError, match="budget"):
            est.allocation(budget=bad)


def test_the_holds_double_from_the_first():
    """A choice made early (the warm-up's captures and compiles in its probe) is checked again
    soon; the holds then double up to the longest."""
    tuner = BudgetTuner([16, 8], probe=1, hold=8, first_hold=2)
    times = {16: (1.0, 1.3), 8: (0.9, 1.3)}
    probe = [16, 16, 8, 8]
    held = run(tuner, 4 + 2 + 4 + 4 + 4 + 8 + 4 + 8 + 4, times)
    assert held == (probe + [16] * 2 + probe + [16] * 4 + probe + [16] * 8 + probe
                    + [16] * 8 + probe)


def test_tokens_a_round_follows_the_miss_model_and_the_two_state_chain():
    from ssdlib.speculative.fallback import expected_tokens, steady_hit_rate
    from ssdlib.speculative.fanout_budget import tokens_a_round

    est = FanoutEstimator(16, 3)
    assert tokens_a_round(est, 16, 0.7, 0.2) is None  # no lookup yet
    est.observe_lookups([1] * 50 + [4] * 50, [i % 2 == 0 for i in range(50)] + [True] * 40
                        + [False] * 10)
    for budget in (16, 8, 4):
        h = est.hit_rate_after(0.7, budget=budget)
        m = est.hit_rate_after(0.2, budget=budget, own=False)
        share = steady_hit_rate(h, m)
        want = share * expected_tokens(0.7, 3) + (1 - share) * expected_tokens(0.2, 3)
        assert tokens_a_round(est, budget, 0.7, 0.2) == pytest.approx(want)
    # more branches, more hits, more tokens
    assert tokens_a_round(est, 16, 0.7, 0.2) > tokens_a_round(est, 4, 0.7, 0.2)


def test_the_throughput_rule_weighs_the_verify_slowed_by_a_larger_build(monkeypatch):
    """Every build hidden, but the verify slows with the budget: the hidden rule holds the
    largest (SSDLIB_BUDGET_THROUGHPUT=0), the throughput rule (the default) the most tokens a
    millisecond; without a value for every arm it keeps the hidden rule."""
    times = {16: (1.3, 1.52), 8: (1.2, 1.39), 4: (1.1, 1.37)}  # (build, verify) ms
    tokens = {16: 2.30, 8: 2.24, 4: 2.10}   # 1.513, 1.612, 1.533 tokens a ms

    def held(value, throughput: bool):
        if throughput:
            monkeypatch.delenv("SSDLIB_BUDGET_THROUGHPUT", raising=False)  # the default
        else:
            monkeypatch.setenv("SSDLIB_BUDGET_THROUGHPUT", "0")
        tuner = BudgetTuner([16, 8, 4], probe=1, hold=4, first_hold=4, value=value)
        run(tuner, 6, times)
        return run(tuner, 1, times)[0]
    assert held(tokens.get, False) == 16
    assert held(tokens.get, True) == 8
    assert held(lambda b: None if b == 4 else tokens[b], True) == 16
    # a build that outlasts the verify makes the round: 16's round is its 1.9 ms build
    times[16] = (1.9, 1.52)
    tokens[16] = 2.9   # 1.526 a ms, below 8's 1.612
    assert held(tokens.get, True) == 8
    # equal rates: the largest
    times = {16: (1.0, 2.0), 8: (1.0, 1.0), 4: (1.0, 1.0)}
    assert held({16: 4.0, 8: 2.0, 4: 1.0}.get, True) == 16
