"""Thm 7 speedup and the Thm 17 choice of backup speculator."""

import math
from types import SimpleNamespace

import pytest

from ssdlib.errors import ConfigError
from ssdlib.speculative import (batch_hit_rate, choose_fallback, critical_batch_size,
                                expected_speedup, expected_tokens, fallback_speedups,
                                steady_hit_rate)
from ssdlib.speculative.fallback import FALLBACKS

# a typical pairing: good draft (a_p 0.8, K 5) costing half a verification, a weak free n-gram
BASE = dict(p_hit=0.9, a_p=0.8, K=5, t_jit=0.5, t_ngram=0.02, a_ngram=0.3)


def test_expected_tokens():
    assert expected_tokens(0.8, 5) == pytest.approx(sum(0.8 ** i for i in range(6)))
    assert expected_tokens(1.0, 5) == 6
    assert expected_tokens(0.0, 5) == 1
    assert expected_tokens(0.5, 0) == 1


def test_expected_speedup_known_values():
    assert expected_speedup(1.0, 4.0, 1.0, 0.5, 0.0) == pytest.approx(4.0)   # T_p hidden
    assert expected_speedup(1.0, 4.0, 1.0, 2.0, 0.0) == pytest.approx(2.0)   # T_p > 1 shows
    assert expected_speedup(0.5, 4.0, 2.0, 2.0, 1.0) == pytest.approx(3.0 / 2.0)
    assert expected_speedup(0.0, 4.0, 2.0, 0.5, 1.0) == pytest.approx(1.0)
    # p_round: tokens use the per-row rate, time the batch's
    assert expected_speedup(0.5, 4.0, 2.0, 1.0, 1.0, p_round=0.25) == \
        pytest.approx(3.0 / (0.25 + 0.75 * 2.0))


def test_batch_hit_rate():
    # 0.8^16 = 2.8% (the paper summary's "3.5%" is not what the formula gives)
    assert batch_hit_rate(0.8, 16) == pytest.approx(0.0281, abs=1e-4)
    assert batch_hit_rate(0.9, 1) == 0.9


def test_small_batch_prefers_jit_large_batch_a_fast_backup():
    assert choose_fallback(1, **BASE) == "jit"
    assert choose_fallback(64, **BASE) in ("ngram", "random")
    # a useful n-gram beats random once the batch misses often; a slow useless one does not
    assert choose_fallback(64, **{**BASE, "a_ngram": 0.6}) == "ngram"
    assert choose_fallback(64, **{**BASE, "a_ngram": 0.02, "t_ngram": 0.3}) == "random"
    # a jit draft slower than a verification never pays
    assert choose_fallback(1, **{**BASE, "t_jit": 2.0}) != "jit"


def test_speedups_of_each_backup():
    s = fallback_speedups(1, **BASE)
    x, e_hit = 0.9, expected_tokens(0.8, 5)
    assert s["jit"] == pytest.approx(e_hit / (x * 1.0 + (1 - x) * 1.5))
    e_ng = expected_tokens(0.3, 5)
    assert s["ngram"] == pytest.approx((x * e_hit + (1 - x) * e_ng) / (x + (1 - x) * 1.02))
    assert s["random"] == pytest.approx((x * e_hit + (1 - x)) / 1.0)
    # the paper's form puts p^b into the token term as well; the same at b = 1
    assert fallback_speedups(1, **BASE, per_row_fallback=False) == pytest.approx(s)
    big = fallback_speedups(32, **BASE, per_row_fallback=False)
    assert big["ngram"] < fallback_speedups(32, **BASE)["ngram"]


def test_critical_batch_size_is_a_switch_point():
    b_star = critical_batch_size(**{k: v for k, v in BASE.items()})
    assert b_star is not None and b_star > 1
    assert choose_fallback(b_star - 1, **BASE) == "jit"
    assert all(choose_fallback(b, **BASE) != "jit" for b in range(b_star, 200))
    assert critical_batch_size(**{**BASE, "t_jit": 0.0}) is None         # free jit always wins
    assert critical_batch_size(**{**BASE, "p_hit": 1.0}) is None         # never misses


def test_critical_batch_size_monotone():
    # a slower jit draft or a better n-gram makes switching pay earlier
    by_t = [critical_batch_size(**{**BASE, "t_jit": t}) for t in (0.1, 0.2, 0.3, 0.5, 0.8, 1.2)]
    by_t = [math.inf if b is None else b for b in by_t]
    assert by_t == sorted(by_t, reverse=True) and by_t[0] > by_t[-1]
    by_a = [critical_batch_size(**{**BASE, "t_jit": 0.2, "a_ngram": a})
            for a in (0.0, 0.2, 0.4, 0.6, 0.75)]
    by_a = [math.inf if b is None else b for b in by_a]
    assert by_a == sorted(by_a, reverse=True) and by_a[0] > by_a[-1]


@pytest.mark.parametrize("bad", [dict(batch_size=0), dict(batch_size=2.0), dict(p_hit=1.5),
                                 dict(a_p=-0.1), dict(K=-1), dict(t_jit=-1.0),
                                 dict(t_ngram=math.nan), dict(a_ngram=2.0), dict(t_p=-0.5)])
def test_inputs_validated(bad):
    with pytest.raises(ConfigError):
        choose_fallback(**{"batch_size": 4, **BASE, **bad})


def test_expected_speedup_validates():
    with pytest.raises(ConfigError):
        expected_speedup(0.5, 0.5, 1.0, 1.0, 1.0)                      # < 1 token per round
    with pytest.raises(ConfigError):
        expected_speedup(0.5, 2.0, 1.0, math.inf, 1.0)


def test_jit_weighs_its_own_acceptance_on_misses():
    """a_jit (the draft's acceptance on the rows that missed) replaces a_p in jit's miss term
    only; low enough, a free n-gram wins even at b = 1."""
    s = fallback_speedups(1, **BASE, a_jit=0.3)
    x, e_hit = 0.9, expected_tokens(0.8, 5)
    assert s["jit"] == pytest.approx((x * e_hit + (1 - x) * expected_tokens(0.3, 5))
                                     / (x * 1.0 + (1 - x) * 1.5))
    assert s["ngram"] == fallback_speedups(1, **BASE)["ngram"]
    assert fallback_speedups(1, **BASE, a_jit=0.8) == pytest.approx(fallback_speedups(1, **BASE))
    assert choose_fallback(1, **BASE) == "jit"
    assert choose_fallback(1, **BASE, a_jit=0.1) == "ngram"
    with pytest.raises(ConfigError, match="a_jit"):
        fallback_speedups(1, **BASE, a_jit=1.5)


def test_speculator_measures_jit_acceptance():
    from ssdlib.engine.speculator.outcomes import Fallbacks

    fb = Fallbacks(None, "auto", 3, 10)
    assert fb.jit_acceptance(0.6) == pytest.approx(0.6)  # the prior until measured
    for k in (0, 0, 1, 0):  # mostly rejected at once: 1 accepted of 5 + 4 tried
        fb.observe_jit(k)
    assert fb.jit_acceptance(0.6) == pytest.approx((1 + 6) / (5 + 10))
    fb.observe_jit(3)  # all K accepted: no rejected position to count
    assert fb.jit_acceptance(0.6) == pytest.approx((4 + 6) / (8 + 10))


def test_fallback_choice_keeps_its_lookups_across_batches():
    """Thm 17's p_hit counts every lookup of the rank's life: a batch that starts after STATS
    (whose counters restart) is not sent back to jit until re-measured."""
    from ssdlib.engine.speculator.outcomes import MIN_LOOKUPS_FOR_AUTO, Fallbacks

    fb = Fallbacks(None, "auto", 3, 1000)
    fb.t_jit = 1e-3
    assert fb.choose(1, 1e-3, None) == "jit"  # nothing measured yet
    fb.observe_lookups(MIN_LOOKUPS_FOR_AUTO, MIN_LOOKUPS_FOR_AUTO // 2)
    _measure_after(fb, {f: 0.5 for f in FALLBACKS})
    for k in (0,) * 20:  # jit drafts that were all rejected: any other backup is better
        fb.observe_jit(k)
    assert fb.choose(1, 1e-3, None) != "jit"
    assert (fb.lookups, fb.hits) == (MIN_LOOKUPS_FOR_AUTO, MIN_LOOKUPS_FOR_AUTO // 2)


def _measure_after(fb, rates: dict, n: int = 40) -> None:
    """n lookups after each source in ``rates`` hitting at that rate."""
    for source, rate in rates.items():
        hits = round(rate * n)
        for i in range(n):
            fb.observe_after(source, i < hits)


def test_steady_hit_rate():
    assert steady_hit_rate(0.6, 0.6) == pytest.approx(0.6)
    # after a hit 0.5, after a miss's backup 0.9: most rounds hit
    assert steady_hit_rate(0.5, 0.9) == pytest.approx(0.9 / 1.4)
    assert steady_hit_rate(0.9, 0.0) == 0.0  # a backup that never leads back to the cache
    assert steady_hit_rate(1.0, 0.0) == 1.0  # both absorbing; a row that starts on a hit stays
    assert steady_hit_rate(1.0, 0.3) == pytest.approx(1.0)
    # a cache that always hits: exactly 1 whatever the rate after the backup (it is weighed as
    # a probability; (p_m + 1) - p_h rounded 31 of the p_m in 0.01..0.99 above 1)
    assert all(steady_hit_rate(1.0, p / 100) == 1.0 for p in range(1, 100))
    with pytest.raises(ConfigError, match="p_after_miss"):
        steady_hit_rate(0.5, 1.5)


def test_hit_rate_after_each_backup():
    """Equal rates after every source give Thm 17's speedups; a backup after whose speculation
    the cache hits more often gains, enough to beat jit's acceptance; a misspelt name raises."""
    same = fallback_speedups(1, **BASE, p_after={f: BASE["p_hit"] for f in FALLBACKS})
    assert same == pytest.approx(fallback_speedups(1, **BASE))
    base = dict(BASE, p_hit=0.5, a_ngram=0.5)
    assert choose_fallback(1, **base) == "jit"
    s = fallback_speedups(1, **base, p_after={"ngram": 0.9})
    p = steady_hit_rate(0.5, 0.9)
    e_hit = expected_tokens(0.8, 5)
    assert s["ngram"] == pytest.approx((p * e_hit + (1 - p) * expected_tokens(0.5, 5))
                                       / (p * 1.0 + (1 - p) * 1.02))
    assert s["jit"] == fallback_speedups(1, **base)["jit"]  # left out: p_hit
    assert choose_fallback(1, **base, p_after={"ngram": 0.9}) == "ngram"
    with pytest.raises(ConfigError, match="p_after"):
        fallback_speedups(1, **BASE, p_after={"n-gram": 0.9})


def test_auto_measures_each_backup_then_weighs_them():
    """fallback=auto: jit until p_hit is measured, then each backup in turn (the least measured
    first) until the hit rate after it is, then the model's choice; ``pushed`` is the choice
    the leader answers misses with."""
    from ssdlib.engine.speculator.outcomes import (MIN_LOOKUPS_AFTER, MIN_LOOKUPS_FOR_AUTO,
                                                   Fallbacks)

    fb = Fallbacks(None, "auto", 5, 1000)
    fb.t_jit = 0.5e-3
    fb.observe_lookups(MIN_LOOKUPS_FOR_AUTO, MIN_LOOKUPS_FOR_AUTO // 2)
    tried = []
    for _ in range(3 * MIN_LOOKUPS_AFTER):
        choice = fb.choose(1, 1e-3, None)
        assert fb.pushed == choice
        tried.append(choice)
        fb.observe_after(choice, False)
    assert sorted(set(tried)) == sorted(FALLBACKS)
    assert all(fb.after[f][0] == MIN_LOOKUPS_AFTER for f in FALLBACKS)
    for k in (3, 4, 2, 5, 4, 3) * 4:  # jit drafts accept well
        fb.observe_jit(k)
    for k in (3, 1, 2, 2) * 4:  # n-gram proposals less well
        fb.observe_ngram(k)
    fb.after = {s: [0, 0] for s in fb.after}
    _measure_after(fb, {"cache": 0.5, "jit": 0.5, "ngram": 0.5, "random": 0.5})
    assert fb.choose(1, 1e-3, None) == "jit"
    _measure_after(fb, {"ngram": 1.0}, n=400)  # after an n-gram proposal the cache hits
    assert fb.hit_rate_after("ngram", 0.5) > 0.9
    assert fb.choose(1, 1e-3, None) == "ngram"
    # later, one choice in EXPLORE_EVERY goes to the least measured backup
    from ssdlib.engine.speculator.outcomes import EXPLORE_EVERY
    picks = [fb.choose(1, 1e-3, None) for _ in range(2 * EXPLORE_EVERY)]
    assert picks.count("ngram") == 2 * EXPLORE_EVERY - 2
    assert {p for p in picks if p != "ngram"} <= {"jit", "random"}
    fixed = Fallbacks(None, "random", 5, 1000)
    assert fixed.choose(1, 1e-3, None) == "random" and fixed.pushed == "random"


def test_speculation_sources():
    """A row's speculation is attributed to where it came from: the cache, the jit draft, or
    the backup the leader drew it with (n-gram's random tokens too)."""
    import torch

    from ssdlib.engine.speculator.outcomes import Answer
    from ssdlib.engine.speculator.spec_row import SpecRow
    from ssdlib.sampling import SamplingParams
    from ssdlib.speculative.acceptance import QKind

    rows = [SpecRow(i, [1, 2], SamplingParams(), i, torch.device("cpu")) for i in range(4)]
    kinds = [QKind.DENSE, QKind.DENSE, QKind.ONEHOT, QKind.UNIFORM]
    ans = Answer(torch.zeros(4, 3, dtype=torch.int64), torch.tensor([int(k) for k in kinds]),
                 torch.tensor([True, False, False, False]), torch.zeros(4, dtype=torch.int64),
                 None)
    ans.record(rows, "ngram")
    assert [r.source for r in rows] == ["cache", "jit", "ngram", "ngram"]
    ans.record(rows, "random")
    assert [r.source for r in rows] == ["cache", "jit", "random", "random"]


def test_jit_cost_is_the_median_of_its_drafts(monkeypatch):
    """One slow jit draft (a collector's pause, a first call) does not decide jit's cost."""
    import time

    from ssdlib.engine.speculator import outcomes

    durations = iter([0.002, 0.002, 0.050, 0.002])
    monkeypatch.setattr(outcomes, "answer_jit", lambda *a: time.sleep(next(durations)))
    fb = outcomes.Fallbacks(None, "auto", 3, 10)
    for _ in range(4):
        fb.jit([], None, [])
    assert 0.002 <= fb.t_jit < 0.02


def _fitted_estimator(rounds: list[tuple[int, int]], lookups: dict[int, tuple[int, int]]):
    """A FanoutEstimator (B = 8, K = 5) that saw ``rounds`` (accepted, verified) and, at each
    fan-out F, ``lookups[F]`` = (lookups, misses)."""
    from ssdlib.speculative import FanoutEstimator

    est = FanoutEstimator(8, 5)
    est.min_lookups = 10
    for k, n in rounds:
        est.observe_verify([k], [n])
    for f, (n, misses) in lookups.items():
        est.observe_lookups([f] * n, [i >= misses for i in range(n)])
    return est


@pytest.mark.parametrize("case", ["draft accepts well", "draft fails"])
def test_auto_chooses_from_the_miss_model_without_trying_every_backup(case, monkeypatch):
    """With a fitted miss model the hit rate after each backup is predicted before it is
    measured (FanoutEstimator.hit_rate_after), so auto
    chooses from its first decision: jit where the draft accepts well and costs little (a
    random proposal lands at k = 0, where this fan-out keeps one guess), a free backup where
    the draft fails and costs a verify (its outcomes land at k = 0, where half the guesses are).
    Without the prediction, each backup is tried first."""
    from ssdlib.engine.speculator.outcomes import MIN_LOOKUPS_FOR_AUTO, Fallbacks

    if case == "draft accepts well":
        est = _fitted_estimator([(5, 5)] * 20 + [(2, 5)] * 20, {1: (40, 20), 3: (40, 10)})
        t_jit, jit_k, want = 0.3e-3, (4, 5, 3, 5), {"jit"}
    else:
        est = _fitted_estimator([(0, 5)] * 30 + [(1, 5)] * 10, {2: (40, 8), 4: (40, 4)})
        t_jit, jit_k, want = 1.0e-3, (0, 1, 0, 0), {"ngram", "random"}
    assert est.allocation()[0] == (1 if case == "draft accepts well" else 4)

    def run(fb):
        fb.t_jit = t_jit
        fb.observe_lookups(MIN_LOOKUPS_FOR_AUTO, MIN_LOOKUPS_FOR_AUTO // 2)
        for k in jit_k * 5:
            fb.observe_jit(k)
        picks = []
        for _ in range(12):
            picks.append(fb.choose(1, 1e-3, est))
            fb.observe_after(picks[-1], True)
        return picks
    assert set(run(Fallbacks(None, "auto", 5, 1000))) <= want
    monkeypatch.setattr(Fallbacks, "after_priors", lambda *a, **k: None)
    assert set(run(Fallbacks(None, "auto", 5, 1000))) == set(FALLBACKS)  # each one tried


def test_ngram_acceptance_is_learned_from_misses_other_backups_answered():
    """A miss answered by jit or random tokens still shows what the leader's n-gram proposal
    would have kept: the tokens it shares with the target's outcome, up to the first that
    differs (tried one more) or the end of the known ones (censored); none where no suffix
    recurs (the leader then sends random tokens)."""
    from ssdlib.engine.speculator.outcomes import Fallbacks

    def shadow(context, outcome, k, limit=5):
        fb = Fallbacks(None, "auto", 5, 1000)
        fb.observe_ngram_shadow(list(context) + list(outcome), k, limit)
        return fb.ngram_accepted, fb.ngram_tried
    ctx = [5, 6, 7, 5, 6]  # the suffix (5, 6) recurs: the proposal is 7, 5, 6, 7, 5
    assert shadow(ctx, [7, 5, 9], k=2) == (2, 3)  # kept 7, 5; 9 is not 6
    assert shadow(ctx, [7, 5, 6], k=2) == (3, 3)  # all the known tokens kept: censored
    assert shadow(ctx, [8], k=0) == (0, 1)
    assert shadow(ctx, [7, 5, 9], k=2, limit=2) == (2, 2)  # all of a verified 2: 9 not read
    assert shadow([1, 2, 3], [4, 9], k=1) == (0, 1)  # no suffix recurs: random tokens
    assert shadow([], [4], k=0) == (0, 0)  # nothing before the outcome: no proposal


def test_the_speculator_shadows_ngram_on_rows_other_backups_answered():
    """The shadow is queued at the commit and counted at the next choice (the push), off the
    way to the answer; only auto keeps it."""
    from ssdlib.engine.speculator.outcomes import Fallbacks
    from ssdlib.engine.speculator.speculator import CacheRole

    role = CacheRole.__new__(CacheRole)
    role.fallbacks = Fallbacks(None, "auto", 5, 1000)
    role._fresh = {}

    def choose():
        return role.fallbacks.choose(1, None, None)
    row = SimpleNamespace(slot=0, tokens=[5, 6, 7, 5, 6, 7, 5, 9], source="jit")
    role.observe(row, 2, 5)  # jit: its own acceptance, and the shadow's
    assert (role.fallbacks.jit_accepted, role.fallbacks.ngram_accepted) == (2, 0)
    assert role._fresh == {0: False}  # its next lookup: after the draft's own rejection
    choose()
    assert (role.fallbacks.jit_accepted, role.fallbacks.ngram_accepted) == (2, 2)
    row.source = "random"
    role.observe(row, 2, 5)
    row.tokens.append(4)  # tokens committed after the shadow was queued are not its
    choose()
    assert role.fallbacks.ngram_accepted == 4 and role.fallbacks.ngram_tried == 6
    row.tokens.pop()
    row.source = "cache"  # a hit: no miss to learn from
    role.observe(row, 2, 5)
    choose()
    assert role.fallbacks.ngram_tried == 6
    row.source = "ngram"  # the n-gram's own proposal: counted once, as verified
    role.observe(row, 2, 5)
    choose()
    assert role.fallbacks.ngram_accepted == 6 and role.fallbacks.ngram_tried == 9
    role.fallbacks = Fallbacks(None, "jit", 5, 1000)  # a fixed backup weighs nothing
    row.source = "jit"
    role.observe(row, 2, 5)
    choose()
    assert role.fallbacks.ngram_tried == 0
