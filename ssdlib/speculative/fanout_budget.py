"""The fan-out budget a build spends, chosen by what the verify hides of it.

On one GPU the speculator's build runs beside the verify (the stream placement). A round lasts
about as long as the longer of the two: a build the verify hides costs nothing, a build that
outlasts it lengthens every round. A larger budget B (branches a row) hits the cache more often
but builds longer and slows the verify more. Which budget wins depends on the pair and the batch:
on one H200 (K = 3, 16 HumanEval chat prompts, one invocation each, docs/BENCHMARKS.md of
2026-12-04) SmolLM2-135M at b = 1 was fastest with B = 16, at b = 8 with B = 8, and the 8B /
1B-cost pair with B = 4, whose build no budget lets the verify hide.

:class:`BudgetTuner` measures it. Its arms are the configured budget and its halves (down to
K + 1: one branch per outcome position). It probes them in turn, two rounds each in a cycle (one
into each of chained rounds' two caches), for ``probe`` cycles (the first cycle also captures
every arm's builds, during the warm-up), keeping
each arm's build and verify times (ms a round, from CUDA events, fed by the leader a round
late). Then it holds an arm: the one of the most expected tokens a millisecond (below), or,
until every arm has a value, the largest arm whose build the verify hides (build <= verify in
the median round: the rounds that captured a build are outliers), the smallest when none is
hidden; and it probes again after a hold that starts at ``first_hold`` builds and doubles up to
``hold``: the first choices, made while the warm-up captured and compiled, are checked again
soon, later ones rarely. Without timings (CPU) it probes and then holds the full budget.

Whether the verify hides a build does not weigh what a larger build costs the verify beside it:
on one H100 at b = 8 the verify of a round ran 1.28x AR's step beside builds of 16 branches a
row (128 rows), and a probe of the same shapes slowed a verify 1.17x beside 16 rows and 1.42x
beside 128 (docs/BENCHMARKS.md, 2026-12-05). So once every arm is timed and valued the tuner
holds the arm with the most tokens a millisecond: the tokens a round the fan-out's miss model
expects of builds of that budget (:func:`tokens_a_round`) over the arm's median round, the
longer of its build and its verify. On one H200 at b = 8 that held 4 branches a row where the
hidden rule held 16: the verify 1.20x AR's step instead of 1.27x, 2.42 tokens a round instead of
2.48, 1.05x the tokens a second; at b = 1 both held 16 (docs/BENCHMARKS.md, 2026-12-05).
``SSDLIB_BUDGET_THROUGHPUT=0`` keeps the hidden rule.

The arms stop at K + 1 (a branch per outcome position). Arms below it, down to one branch a
row (the fan-out then guessing only the likeliest outcomes), were tried on one H100 at commit
2190d14: the tuner held 8 branches a row at b = 8 and 16 at b = 1 with them too, and SSD ran at
0.97x and 0.99x its tokens a second without them (probing five arms instead of three), the
verify 1.24x AR's step at b = 8 against 1.21x (docs/BENCHMARKS.md, 2026-12-05, one H100,
2190d14).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from ssdlib import env
from ssdlib.errors import ConfigError, require_int
from ssdlib.speculative.fallback import expected_tokens, steady_hit_rate


def budget_arms(budget: int, K: int, count: int = 3) -> list[int]:
    """The budgets a tuner tries, largest first: ``budget``, then halved (rounded up) while
    the half is at least K + 1, at most ``count`` of them."""
    require_int("fan-out budget", budget, 1)
    arms = [budget]
    while len(arms) < count:
        half = (arms[-1] + 1) // 2
        if half < K + 1 or half == arms[-1]:  # (a budget of 1 halves to itself)
            break
        arms.append(half)
    return arms


def tokens_a_round(estimator, budget: int, a_hit: float, a_miss: float) -> float | None:
    """The tokens a chained round is expected to commit a row with builds of ``budget``
    branches: a row's speculation is the cache's after a hit (its tokens accepted at ``a_hit``
    a token) or the miss's backup (``a_miss``); its next lookup hits at the rate the fan-out's
    miss model predicts after each (``FanoutEstimator.hit_rate_after`` at that budget), a
    two-state chain whose long-run share of the cache's speculations is ``steady_hit_rate``; a
    speculation accepted at a commits (1 - a^(K+1)) / (1 - a) tokens. None before any lookup."""
    after_hit = estimator.hit_rate_after(a_hit, budget=budget)
    after_miss = estimator.hit_rate_after(a_miss, budget=budget, own=False)
    if after_hit is None or after_miss is None:
        return None
    share = steady_hit_rate(after_hit, after_miss)
    K = estimator.K
    return share * expected_tokens(a_hit, K) + (1.0 - share) * expected_tokens(a_miss, K)


class BudgetTuner:
    """Chooses each build's fan-out budget among ``arms`` (see the module doc). ``value``:
    the tokens a round expected of builds of a budget (None: not known yet), for
    the throughput rule (``SSDLIB_BUDGET_THROUGHPUT``, on by default)."""

    def __init__(self, arms: list[int], probe: int = 4, hold: int = 512,
                 first_hold: int = 32,
                 value: Callable[[int], float | None] | None = None) -> None:
        if not arms or any(a < 1 for a in arms) or sorted(set(arms), reverse=True) != list(arms):
            raise ConfigError(f"budget arms must be distinct positive integers, largest first, "
                              f"got {arms!r}")
        if probe < 1 or not 1 <= first_hold <= hold:
            raise ConfigError("BudgetTuner: probe >= 1 and 1 <= first_hold <= hold required")
        self.arms = list(arms)
        self.probe, self.hold = probe, hold
        self.value = value
        self._hold = first_hold  # the next hold's builds
        # per arm: each timed round's (build ms, verify ms)
        self._timed: dict[int, list[tuple[float, float]]] = {a: [] for a in self.arms}
        self._step = 0  # builds since the phase began
        self._probing = True
        self.held = self.arms[0]  # the arm held after the last probe
        self.rounds = dict.fromkeys(self.arms, 0)  # builds per arm since the last take

    def next_budget(self) -> int:
        """The budget of the next build (one call a build)."""
        if self._probing and self._step >= 2 * self.probe * len(self.arms):
            self._probing = False
            self._step = 0
            self.held = self.choose()
        elif not self._probing and self._step >= self._hold:
            self._probing = True
            self._step = 0
            self._hold = min(2 * self._hold, self.hold)
            self._timed = {a: [] for a in self.arms}
        # probing: each arm two builds in a row, so that it builds once into each of chained
        # rounds' two caches (their parities alternate): with an even number of arms, one
        # build each would pair every arm with one parity only, and the warm-up would capture
        # half of the steps the run later holds
        arm = self.arms[(self._step // 2) % len(self.arms)] if self._probing else self.held
        self._step += 1
        self.rounds[arm] += 1
        return arm

    def observe(self, budget: int, build_ms: float, verify_ms: float) -> None:
        """One round's times with a build of ``budget`` (another budget's: ignored)."""
        t = self._timed.get(budget)
        if t is not None:
            t.append((build_ms, verify_ms))

    def hidden(self, budget: int) -> bool | None:
        """Whether the verify hid the build of ``budget`` in most of its timed rounds (the
        median of build - verify <= 0: a round that captured the build, timed with the capture's
        eager runs, is an outlier that does not decide); None: no round timed."""
        t = self._timed[budget]
        return None if not t else statistics.median_low([b - v for b, v in t]) <= 0.0

    def round_ms(self, budget: int) -> float | None:
        """The median timed round of ``budget``: the longer of its build and its verify (None:
        no round timed)."""
        t = self._timed[budget]
        return None if not t else statistics.median_low([max(b, v) for b, v in t])

    def choose(self) -> int:
        """Every arm timed and valued: the arm of the most expected tokens a millisecond (the
        largest of equals; ``SSDLIB_BUDGET_THROUGHPUT=0`` skips this rule). Otherwise the
        largest arm the verify hides; the smallest when it hides none; the largest when no arm
        was timed."""
        seen = [(a, self.hidden(a)) for a in self.arms]
        if all(h is None for _, h in seen):
            return self.arms[0]
        if self.value is not None and env.flag("SSDLIB_BUDGET_THROUGHPUT") \
                and all(h is not None for _, h in seen):
            tokens = {a: self.value(a) for a in self.arms}
            if all(t is not None for t in tokens.values()):
                return max(self.arms, key=lambda a: tokens[a] / max(self.round_ms(a), 1e-9))
        for a, h in seen:
            if h:
                return a
        return self.arms[-1]

    def take(self) -> dict:
        """Builds per budget since the last take, and the budget held now."""
        out = {"held": self.held, "builds": {str(a): n for a, n in self.rounds.items() if n}}
        self.rounds = dict.fromkeys(self.arms, 0)
        return out
