"""The adaptive speculation length policy on its own, with synthetic acceptance and costs: the
expected-tokens formula against a simulation, the argmax rule against brute force, a failing
draft reaching K = 0 and probing at growing intervals, a good draft keeping K_max, the cost
estimates (medians, fallbacks, priors for sampled rows) and the warm-up sweep."""

import random

import pytest

from ssdlib.speculative.adaptive_k import (COST_PROBE_GAP, COST_WINDOW, TIMINGS, FIRST_PROBE_INTERVAL, LONGER_K_MARGIN, PROBE_BUDGET,
                                           MAX_PROBE_INTERVAL, AdaptiveK, RowState,
                                           StepCosts, best_k, expected_tokens,
                                           k_choices)


def test_expected_tokens_matches_a_simulation():
    rng = random.Random(0)
    for k, alpha in [(0, 0.3), (1, 0.5), (3, 0.8), (5, 0.126), (4, 1.0)]:
        n = 5_000
        total = 0
        for _ in range(n):
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            total += accepted + 1  # the bonus token
        assert total / n == pytest.approx(expected_tokens(k, alpha), rel=0.04)


def test_best_k_is_the_brute_force_argmax():
    rng = random.Random(1)
    for _ in range(200):
        k_max = rng.randint(1, 6)
        alpha = rng.random()
        costs = sorted(rng.uniform(0.5, 3.0) for _ in range(k_max + 1))
        rates = [expected_tokens(k, alpha) / c for k, c in enumerate(costs)]
        assert rates[best_k(alpha, costs, margin=0.0)] == max(rates)
        # the default: the longest K within LONGER_K_MARGIN of the best rate
        # the default: K = 0 when it is the argmax, else the longest K within LONGER_K_MARGIN
        k = best_k(alpha, costs)
        if rates[0] == max(rates):
            assert k == 0
        else:
            assert k > 0 and rates[k] >= (1 - LONGER_K_MARGIN) * max(rates)
            assert all(r < (1 - LONGER_K_MARGIN) * max(rates) for r in rates[k + 1:])
        assert best_k(alpha, costs, least=1) >= 1


def test_the_rule_on_its_textbook_cases():
    cheap = [1.0 + 0.25 * k for k in range(6)]  # a draft step = 1/4 verify, verify flat in K
    assert best_k(1.0, cheap) == 5  # a draft equal to the target: K_max
    assert best_k(0.126, cheap) == 0  # the long-prompt draft: plain decoding wins
    assert best_k(0.8, cheap, margin=0.0) == 3  # a good draft need not take K_max ...
    assert best_k(0.8, cheap) == 5  # ... but K_max's rate is within 3 % of K = 3's
    assert best_k(0.5, [1.0, 1.25, 1.5], margin=0.0) == 1
    assert best_k(0.5, [1.0, 1.25, 1.5]) == 2  # 1.167 against 1.2
    assert best_k(0.5, [1.0, 1.25, 1.6]) == 1  # 1.094: more than 5 % below
    # a draft step as costly as a verify: speculation never pays (K = 0 is 2.5 % ahead of K = 1:
    # the margin favours a longer speculation, never speculation over plain decoding)
    assert best_k(0.95, [1.0 + k for k in range(6)]) == 0


def run_rounds(policy, key, alpha, rounds, rng, sampled=False):
    """Rounds of one row whose drafts are accepted with probability ``alpha`` each: the K
    chosen per round."""
    ks = []
    for _ in range(rounds):
        k = policy.choose([key], [sampled])[0]
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        policy.observe([key], [k], [accepted], [sampled])
        ks.append(k)
    return ks


def test_failing_draft_reaches_zero_and_probes_ever_less_often():
    policy = AdaptiveK(5)
    policy.admit(0)
    ks = run_rounds(policy, 0, 0.0, 400, random.Random(2))
    first_zero = ks.index(0)
    assert first_zero <= 6  # a few rounds of evidence are enough
    probes = [i for i in range(first_zero, len(ks)) if ks[i] > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    cheapest = min(k for k in policy.choices if k > 0)
    assert probes and all(ks[i] == cheapest for i in probes)  # the cheapest probe
    assert gaps == sorted(gaps) and gaps[-1] == MAX_PROBE_INTERVAL + 1
    assert probes[0] - first_zero == FIRST_PROBE_INTERVAL
    assert sum(k > 0 for k in ks[100:]) <= 300 // MAX_PROBE_INTERVAL + 1


def test_good_draft_keeps_k_max_and_a_recovered_draft_comes_back():
    policy = AdaptiveK(5)
    policy.admit(0)
    rng = random.Random(3)
    assert run_rounds(policy, 0, 1.0, 50, rng) == [5] * 50
    # the draft fails for a while (it stops drafting at least every other round), then agrees
    # again: the probes find it
    failing = run_rounds(policy, 0, 0.0, 40, rng)
    assert sum(k == 0 for k in failing[-20:]) >= 10
    back = run_rounds(policy, 0, 0.95, 200, rng)
    assert min(back[-50:]) >= 3 and sum(back[-50:]) / 50 > 4.5


def test_rows_are_independent_and_admission_resets():
    policy = AdaptiveK(4)
    rng = random.Random(4)
    for key in (0, 1):
        policy.admit(key)
    run_rounds(policy, 0, 0.0, 30, rng)
    assert policy.choose([0], [False]) == [0] and policy.choose([1], [False]) == [4]
    assert policy.alpha(0) < 0.3 < 0.8 < policy.alpha(1)  # (0: drifted toward its long run)
    policy.admit(0)  # a new sequence in the slot
    assert policy.choose([0], [False]) == [4]


def test_a_greedy_row_takes_the_longest_k_of_its_round():
    """A round drafts its longest row's K for every row and verifies K + 1 positions of each, so
    a shorter choice saves nothing: greedy rows are lifted to the round's longest K (a row lifted
    from K = 0 drafts: its count of K = 0 rounds restarts). Sampled rows are not lifted: a seeded
    request's tokens must not depend on its batch."""
    policy = AdaptiveK(4)
    rng = random.Random(6)
    for key in (0, 1, 2, 3):
        policy.admit(key)
    run_rounds(policy, 0, 0.0, 30, rng)  # row 0's draft fails: alone it decodes at K = 0
    run_rounds(policy, 2, 0.0, 30, rng)
    assert policy.choose([0], [False]) == [0] and policy.choose([2], [True]) == [0]
    assert policy._row(0).zeros > 0
    assert policy.choose([0, 1], [False, False]) == [4, 4]
    assert policy._row(0).zeros == 0
    assert policy.choose([0, 1, 2], [False, False, True]) == [4, 4, 0]  # sampled row 2: its own
    assert policy.choose([0, 2, 3], [False, True, True]) == [4, 0, 4]  # greedy row 0: lifted
    # every row at K = 0: none is lifted (the round is a plain decoding step)
    assert policy.choose([0, 2], [False, True]) == [0, 0]


def test_disabled_policy_always_takes_k_max():
    policy = AdaptiveK(3, enabled=False, sweep=True)
    policy.admit(0)
    assert run_rounds(policy, 0, 0.0, 20, random.Random(5)) == [3] * 20


def test_costs_medians_fallbacks_and_priors():
    costs = StepCosts(4, draft_prior=0.25)
    assert costs.table() == costs.table(measured=False) == [1.0, 1.25, 1.5, 1.75, 2.0]
    costs.observe_round(4, 2e-3)  # only K = 4 measured: every K's rest is its, the draft prior
    assert costs.table() == pytest.approx([2e-3 + k * 0.5e-3 for k in range(5)])
    for s in (1e-3, 1e-3, 1e-3, 50e-3):  # one outlier (a first call) does not decide
        costs.observe_draft(4 * s, 4)
    assert costs.draft == pytest.approx(1e-3)
    costs.observe_round(0, 1e-3)
    # K = 1, 2 take the nearest measured K's rest (ties: the lower K)
    assert costs.rest == [1e-3, None, None, None, 2e-3]
    assert costs.table() == pytest.approx([1e-3, 2e-3, 3e-3, 5e-3, 6e-3])
    assert costs.table(measured=False) == [1.0, 1.25, 1.5, 1.75, 2.0]
    snap = costs.snapshot()
    assert snap["draft_step_ms"] == pytest.approx(1.0)
    assert snap["round_ms_by_k"] == pytest.approx({"0": 1.0, "4": 2.0})
    with pytest.raises(ValueError):
        StepCosts(3, draft_prior=-1.0)


def test_a_shorter_verify_is_never_costed_above_a_longer_one():
    """K = 0 timed slow in a few rounds (as at a 6k context on one H200: 2.27 ms against K = 3's
    1.48, so K = 0 was never chosen again, and never retimed, at an acceptance of 0.16): each
    K's rest is capped by every longer K's, and the failing draft goes to K = 0."""
    costs = StepCosts(3)
    costs.observe_draft(0.39e-3, 1)
    costs.observe_round(0, 2.27e-3)
    costs.observe_round(2, 1.39e-3)
    costs.observe_round(3, 1.48e-3)
    assert costs.table() == pytest.approx([1.39e-3, 1.39e-3 + 0.39e-3, 1.39e-3 + 0.78e-3,
                                           1.48e-3 + 1.17e-3])
    assert best_k(0.16, costs.table(), choices=k_choices(3)) == 0


def test_sampled_rows_decide_on_the_priors():
    """Measured costs say a draft step costs as much as a verify (never speculate); a greedy row
    follows them, a sampled row keeps the priors (its K schedule must not depend on timing)."""
    costs = StepCosts(4)
    costs.observe_round(0, 1e-3)
    costs.observe_round(4, 1e-3)
    costs.observe_draft(4e-3, 4)
    policy = AdaptiveK(4, costs)
    for key in (0, 1):
        policy.admit(key)
    assert policy.choose([0], [False]) == [0] and policy.choose([1], [True]) == [4]
    # in one round the greedy row drafts the sampled row's K: the round runs it anyway
    assert policy.choose([0, 1], [False, True]) == [4, 4]


def test_choices_are_zero_a_middle_value_and_k_max():
    assert [k_choices(k) for k in (1, 2, 3, 4, 5, 8)] == [
        (0, 1), (0, 1, 2), (0, 2, 3), (0, 2, 4), (0, 3, 5), (0, 4, 8)]
    policy = AdaptiveK(5)
    for alpha in (0.0, 0.3, 0.6, 0.8, 1.0):
        policy.rows[0] = RowState()
        policy.rows[0].accepted, policy.rows[0].tried = alpha * 100, 100.0
        assert policy.choose([0], [False])[0] in (0, 3, 5)


def test_sweep_runs_every_choice_once_per_kind_then_decides():
    policy = AdaptiveK(3, sweep=True)
    for key in (0, 1):
        policy.admit(key)
    greedy = [policy.choose([0, 1], [False, False]) for _ in range(4)]
    assert greedy == [[3, 3], [2, 2], [0, 0], [0, 0]]
    # batches of sampled rows, and of both kinds, have sweeps of their own
    assert [policy.choose([0, 1], [True, True])[0] for _ in range(4)] == [3, 2, 0, 0]
    assert [policy.choose([0, 1], [False, True])[0] for _ in range(4)] == [3, 2, 0, 0]
    assert policy.choose([0, 1], [False, False]) == [3, 3]  # swept: the rule again
    assert policy.choose([0, 1], [True, False]) == [3, 3]


def test_schedule_fixes_each_rows_k(monkeypatch):
    from ssdlib.errors import ConfigError
    from ssdlib.speculative.adaptive_k import k_schedule

    monkeypatch.delenv("SSDLIB_K_SCHEDULE", raising=False)
    assert k_schedule(4) == []
    monkeypatch.setenv("SSDLIB_K_SCHEDULE", "4,0,2")
    policy = AdaptiveK(4, enabled=False, schedule=k_schedule(4))
    assert [policy.choose([0, 1, 2], [False] * 3) for _ in range(2)] == [[0, 2, 4], [2, 4, 0]]
    for bad in ("4,5", "x", ","):
        monkeypatch.setenv("SSDLIB_K_SCHEDULE", bad)
        with pytest.raises(ConfigError, match="SSDLIB_K_SCHEDULE"):
            k_schedule(4)


def test_probes_after_a_failed_one_cost_at_most_the_probe_budget():
    costs = StepCosts(3)
    assert costs.probe_gap() == 0  # nothing timed: the doubling intervals alone
    costs.observe_probe(0.004)
    assert costs.probe_extra is None  # no AR round timed yet to compare it with
    costs.observe_round(0, 0.001)
    costs.observe_probe(0.005)  # a probe round 4 ms dearer than a 1 ms AR round
    assert costs.probe_gap() == round(0.004 / (PROBE_BUDGET * 0.001))
    assert costs.snapshot()["probe_extra_ms"] == pytest.approx(4.0)
    policy = AdaptiveK(3, costs)
    policy.admit(0)
    ks, flags = [], []
    for _ in range(1000):
        k = policy.choose([0], [False])[0]
        flags.append(policy.probed)
        policy.observe([0], [k], [0], [False])  # the draft never agrees
        ks.append(k)
    first_zero = ks.index(0)
    probes = [i for i in range(first_zero, len(ks)) if ks[i] > 0]
    assert len(probes) >= 3 and flags == [i in probes for i in range(len(ks))]
    gap = costs.probe_gap()
    assert all(b - a > gap for a, b in zip(probes, probes[1:]))
    # the first probe after the drop comes after FIRST_PROBE_INTERVAL rounds at K = 0 whatever
    # the budget (a drop often ends a hard stretch); once one has failed, gap rounds between them
    assert gap > FIRST_PROBE_INTERVAL and probes[0] - first_zero == FIRST_PROBE_INTERVAL


def test_a_short_failing_stretch_shortens_speculation_and_a_lasting_one_stops_it():
    """A draft that the target agreed with fails for a few rounds (a hard stretch of text): the
    row keeps speculating, at a shorter K (its long run says the draft is good), and takes K_max
    back when the draft agrees again. A failure that lasts takes it to K = 0, and when the draft
    agrees again a probe finds it and the row speculates again."""
    policy = AdaptiveK(3)
    _h200_costs(policy)
    assert policy.costs.probe_gap() > 30
    policy.admit(0)
    rng = random.Random(7)
    assert run_rounds(policy, 0, 0.85, 60, rng)[-1] == 3
    stretch = run_rounds(policy, 0, 0.0, 12, rng)
    assert 0 not in stretch and stretch[-1] < 3
    back = run_rounds(policy, 0, 0.85, 30, rng)
    assert back[-1] == 3 and 0 not in back
    lasting = run_rounds(policy, 0, 0.0, 60, rng)
    assert lasting[:8] == stretch[:8]  # a hard stretch again: the same shorter speculation
    assert sum(k == 0 for k in lasting[-20:]) >= 12
    again = run_rounds(policy, 0, 0.85, 120, rng)
    assert again[-1] == 3


# one H200's step costs for SmolLM2 and the default draft at b = 1 (seconds): a draft step, a
# verify, an AR step, a probe's extra (its catch-up)
H200_DRAFT, H200_VERIFY, H200_AR, H200_PROBE = 0.26e-3, 1.10e-3, 1.17e-3, 0.9e-3


def _h200_costs(policy, rows=(1, 2)):
    """Every K timed at these batch sizes (a GPU: the same costs at each)."""
    for _ in range(COST_WINDOW):
        for n in rows:
            policy.costs.observe_draft(H200_DRAFT, 1, rows=n)
            for k in range(policy.k_max + 1):
                policy.costs.observe_round(k, H200_VERIFY if k else H200_AR, rows=n)
        policy.costs.observe_probe(H200_AR + H200_PROBE)


def _rate(policy, seed, stretches, tokens=3000):
    """Tokens per second of one row on a text of alternating stretches ((alpha, mean tokens)
    each), at one H200's step costs (``_h200_costs``). A round that drafts after rounds at
    K = 0 (a probe or not) also pays the draft's catch-up over the tokens it skipped (about a
    probe's measured extra: an eager forward of the draft)."""
    draft, rest, catch_up = H200_DRAFT, [H200_AR] + [H200_VERIFY] * policy.k_max, H200_PROBE
    _h200_costs(policy)
    policy.admit(0)
    rng = random.Random(seed)
    t, done, stretch, left = 0.0, 0, 0, rng.expovariate(1 / stretches[0][1])
    behind = False  # the last round ran at K = 0
    while done < tokens:
        k = policy.choose([0], [False])[0]
        a = 0
        while a < k and rng.random() < stretches[stretch][0]:
            a += 1
        t += k * draft + rest[k] + (catch_up if k and behind else 0.0)
        behind = k == 0
        policy.observe([0], [k], [a], [False])
        done, left = done + a + 1, left - a - 1
        if left <= 0:
            stretch = (stretch + 1) % len(stretches)
            left = rng.expovariate(1 / stretches[stretch][1])
    return done / t


@pytest.mark.parametrize("stretches", [((0.8, 40), (0.15, 12)), ((0.6, 40), (0.3, 20))],
                         ids=["easy-hard", "mid"])
def test_adaptive_k_keeps_up_with_fixed_k_where_acceptance_comes_in_stretches(stretches):
    """Text alternates easy and hard stretches (code, chat): adaptation must not lose to K_max
    (it did: a row stuck at K = 0 for its probe interval after each hard stretch, 0.91x fixed
    K on one H200, HumanEval chat prompts)."""
    adaptive = sum(_rate(AdaptiveK(3), s, stretches) for s in range(4))
    fixed = sum(_rate(AdaptiveK(3, enabled=False), s, stretches) for s in range(4))
    assert adaptive >= 0.97 * fixed


def test_short_failing_bursts_are_drafted_through():
    """Frequent short bursts the draft fails (a few tokens each, as 500-token prompts showed on
    one H200: stints of 1-8 rounds at K = 0, 0.91x a fixed K): a row whose draft does well in
    the long run drafts a shorter K through them instead of dropping to K = 0 and paying the
    draft's catch-up after each; with the long-run veto off (HARD_STRETCH = 0) the same rule
    falls behind it."""
    from ssdlib.speculative import adaptive_k

    bursts = ((0.7, 8), (0.0, 3))
    fixed = sum(_rate(AdaptiveK(3, enabled=False), s, bursts) for s in range(4))
    adaptive = sum(_rate(AdaptiveK(3), s, bursts) for s in range(4))
    saved = adaptive_k.HARD_STRETCH
    try:
        adaptive_k.HARD_STRETCH = 0
        without = sum(_rate(AdaptiveK(3), s, bursts) for s in range(4))
    finally:
        adaptive_k.HARD_STRETCH = saved
    assert adaptive >= 1.02 * fixed
    assert adaptive >= 1.02 * without


def test_a_sequence_starts_from_the_prior_whatever_came_before():
    """Drafts fare very differently from one prompt to the next: a new sequence starts from the
    prior (K_max at one H200's costs), not from what earlier sequences showed. (Started from the
    acceptance of earlier sequences of its length, a 500-token prompt whose draft did well sat at
    K = 0 for 42 of its first 44 rounds on one H200: SD at 0.85x a fixed K.)"""
    from ssdlib.speculative.adaptive_k import PRIOR_ALPHA

    policy = AdaptiveK(3)
    _h200_costs(policy)
    for key in range(4):  # sequences whose draft never agrees
        policy.admit(key)
        for _ in range(20):
            k = policy.choose([key], [False])[0]
            policy.observe([key], [k], [0], [False])
        assert policy.alpha(key) < 0.5
        policy.release(key)
    policy.admit(9)
    assert policy.alpha(9) == pytest.approx(PRIOR_ALPHA)
    assert policy.choose([9], [False]) == [3]


def test_a_hard_start_does_not_cost_the_rest_of_the_sequence():
    """Sequences of 128 tokens whose first dozen tokens the draft gets wrong and the rest mostly
    right (as a 500-token prompt's answer did on one H200), at that machine's step costs there
    (a probe ~1.2 ms more than an AR round: a probe budget of ~45 rounds): adaptive K keeps up
    with a fixed K. (With every probe waiting for the budget, a sequence sat at K = 0 for 40
    rounds after its hard start: 0.88x in this simulation, 0.89x measured.)"""
    draft, rest, probe = 0.30e-3, [1.25e-3, 1.25e-3, 1.25e-3, 1.27e-3], 1.2e-3

    def rate(policy, seed):
        for _ in range(COST_WINDOW):
            policy.costs.observe_draft(draft, 1)
            for k in range(4):
                policy.costs.observe_round(k, rest[k])
            policy.costs.observe_probe(rest[0] + probe)
        assert policy.costs.probe_gap() > 40
        rng = random.Random(seed)
        tokens = seconds = 0.0
        for key in range(8):
            policy.admit(key)
            done = 0
            while done < 128:
                alpha = 0.15 if done < 12 else 0.65
                k = policy.choose([key], [False])[0]
                a = 0
                while a < k and rng.random() < alpha:
                    a += 1
                seconds += k * draft + rest[k] + (probe if policy.probed else 0.0)
                policy.observe([key], [k], [a], [False])
                done += a + 1
            policy.release(key)
            tokens += done
        return tokens / seconds

    adaptive = sum(rate(AdaptiveK(3), s) for s in range(4))
    fixed = sum(rate(AdaptiveK(3, enabled=False), s) for s in range(4))
    assert adaptive >= 0.95 * fixed


def _drive(policy, keys, alphas, rounds, seed, ahead):
    """Rounds of a batch of greedy rows (each accepting with its alpha) -> the limits chosen;
    with ``ahead``, the next round's choice is made ahead of its ``choose`` after every round
    at K = 0, as the SD loop does while such a round's forward runs."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        limits = policy.choose(keys, [False] * len(keys))
        accepted = []
        for k, a in zip(limits, alphas):
            n = 0
            while n < k and rng.random() < a:
                n += 1
            accepted.append(n)
        if ahead and max(limits) == 0:
            policy.choose_ahead(keys, [False] * len(keys))
        policy.observe(keys, limits, accepted, [False] * len(keys))
        out.append((limits, policy.probed))
    return out


@pytest.mark.parametrize("alphas", [(0.0,), (0.0, 0.05), (0.3, 0.0)])
def test_choosing_ahead_after_a_round_at_k_0_changes_no_choice(alphas):
    """A round at K = 0 teaches nothing, so choosing the next round ahead (while its forward
    runs) gives the choices, probes included, that choosing at the round's start gives."""
    runs = []
    for ahead in (False, True):
        policy = AdaptiveK(3)
        _h200_costs(policy)
        keys = list(range(len(alphas)))
        for key in keys:
            policy.admit(key)
        runs.append(_drive(policy, keys, alphas, 400, 11, ahead))
    assert runs[0] == runs[1]
    assert sum(max(limits) == 0 for limits, _ in runs[0]) > 300  # mostly K = 0: ahead ran
    assert any(probed for _, probed in runs[0])


def test_a_choice_made_ahead_is_used_once_and_only_for_its_rows():
    policy = AdaptiveK(3)
    _h200_costs(policy)
    for key in (0, 1):
        policy.admit(key)
    for _ in range(20):  # both rows fail: K = 0 (but for probes)
        limits = policy.choose([0, 1], [False, False])
        policy.observe([0, 1], limits, [0, 0], [False, False])
    while limits != [0, 0]:
        limits = policy.choose([0, 1], [False, False])
        policy.observe([0, 1], limits, [0, 0], [False, False])
    policy.choose_ahead([0, 1], [False, False])
    assert set(policy._ahead) == {0, 1}  # the next round's choices are made
    policy.admit(1)  # slot 1 takes a new sequence: chosen afresh from the prior
    assert policy.choose([0, 1], [False, False]) == [3, 3]  # (row 0 lifted to row 1's K)
    policy.choose_ahead([0], [False])
    policy.choose([1], [False])  # a round without row 0 drops what was chosen for it
    assert policy._ahead == {}


def _ssd_like_policy(k_max: int = 5) -> AdaptiveK:
    """A policy whose drafting costs nothing (an SSD leader's) with only K_max timed."""
    policy = AdaptiveK(k_max, StepCosts(k_max, draft_prior=0.0))
    policy.admit(0)
    policy.costs.observe_round(k_max, 0.063)
    return policy


def test_a_timing_round_times_an_untimed_k():
    """Only K_max timed (a leader whose draft costs it nothing runs K_max from the prior on): one
    round in COST_PROBE_GAP runs the untimed K_max / 2; once that K is timed, no more; where it
    is cheaper than its rate's loss (a verify whose cost grows with K), the policy takes it."""
    policy = _ssd_like_policy()
    ks = []
    for _ in range(2 * COST_PROBE_GAP):
        ks.append(policy.choose([0], [False])[0])
        if policy.timing:
            assert ks[-1] == 3
        policy.observe([0], [ks[-1]], [ks[-1] * 6 // 10], [False])
    assert ks.count(3) == 2 and ks.count(5) == 2 * COST_PROBE_GAP - 2  # untimed: probed again
    policy.costs.observe_round(3, 0.050)  # 6 positions 63 ms, 4 positions 50 ms
    assert not policy.costs.timed(3)  # one timing may be an outlier: TIMINGS of them
    for _ in range(TIMINGS - 1):
        policy.costs.observe_round(3, 0.050)
    assert policy.costs.timed(3)
    ks = []
    for _ in range(COST_PROBE_GAP + 1):
        policy.rows[0].accepted, policy.rows[0].tried = 6.0, 10.0  # alpha 0.6
        ks.append(policy.choose([0], [False])[0])
        assert not policy.timing
    assert set(ks) == {3}  # E(3) / 50 ms beats E(5) / 63 ms at alpha ~0.6
    flat = _ssd_like_policy()
    flat.costs.observe_round(3, 0.063)  # a GPU: the verify's cost flat in K
    flat.rows[0].accepted, flat.rows[0].tried = 6.0, 10.0
    assert flat.choose([0], [False]) == [5]


def test_no_timing_round_with_sampled_rows_or_before_costs():
    policy = _ssd_like_policy()
    policy.admit(1)
    for _ in range(3 * COST_PROBE_GAP):
        assert policy.choose([0, 1], [False, True]) == [5, 5]  # a sampled row: never shortened
        assert not policy.timing
    fresh = AdaptiveK(5, StepCosts(5, draft_prior=0.0))
    fresh.admit(0)
    for _ in range(3 * COST_PROBE_GAP):  # nothing timed yet: the priors decide
        assert fresh.choose([0], [False]) == [5]


def test_costs_are_kept_per_batch_size():
    """A round's cost at each K is learnt per batch size; a batch size not timed takes the
    nearest timed one's (ties: the larger); the choice follows the batch it is made for."""
    costs = StepCosts(5, draft_prior=0.0)
    for _ in range(COST_WINDOW):
        costs.observe_round(5, 0.114, rows=4)
        costs.observe_round(3, 0.090, rows=4)
        costs.observe_round(5, 0.063, rows=1)
        costs.observe_round(3, 0.063, rows=1)
    costs.at_rows(4)
    assert costs.rest[3] == 0.090 and costs.rest[5] == 0.114 and costs.timed(3)
    costs.at_rows(1)
    assert costs.rest[3] == costs.rest[5] == 0.063
    costs.at_rows(3)  # not timed: the nearest, 4 rows
    assert costs.rest[5] == 0.114 and not costs.timed(5)
    costs.at_rows(2)  # 1 and 4 rows are not equally near: 1
    assert costs.rest[5] == 0.063
    snap = costs.snapshot()
    assert snap["round_ms_by_rows"]["4"] == pytest.approx({"3": 90.0, "5": 114.0})
    policy = AdaptiveK(5, costs)
    for key in range(4):
        policy.admit(key)
        policy.rows[key].accepted, policy.rows[key].tried = 6.0, 10.0
    assert policy.choose([0, 1, 2, 3], [False] * 4) == [3] * 4  # 4 rows: K = 3 pays
    assert policy.choose([0], [False]) == [5]  # one row: the verify's cost is flat in K
