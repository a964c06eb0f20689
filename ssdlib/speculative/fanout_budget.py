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
late). Then it holds the largest arm whose build the verify hides (build <= verify in the median
round: the rounds that captured a build are outliers), or the smallest arm when none is
hidden, and probes again after a hold that starts at ``first_hold`` builds and doubles up to
``hold``: the first choices, made while the warm-up captured and compiled, are checked again
soon, later ones rarely. Without timings (CPU) it probes and then holds the full budget.
"""

from __future__ import annotations

import statistics

from ssdlib.errors import ConfigError, require_int


def budget_arms(budget: int, K: int, count: int = 3) -> list[int]:
    """The budgets a tuner tries, largest first: ``budget``, then halved (rounded up) while
    the half is at least K + 1, at most ``count`` of them."""
    require_int("fan-out budget", budget, 1)
    arms = [budget]
    while len(arms) < count and (arms[-1] + 1) // 2 >= K + 1 and (arms[-1] + 1) // 2 < arms[-1]:
        arms.append((arms[-1] + 1) // 2)
    return arms


class BudgetTuner:
    """Chooses each build's fan-out budget among ``arms`` (see the module doc)."""

    def __init__(self, arms: list[int], probe: int = 4, hold: int = 512,
                 first_hold: int = 32) -> None:
        if not arms or any(a < 1 for a in arms) or sorted(set(arms), reverse=True) != list(arms):
            raise ConfigError(f"budget arms must be distinct positive integers, largest first, "
                              f"got {arms!r}")
        if probe < 1 or not 1 <= first_hold <= hold:
            raise ConfigError("BudgetTuner: probe >= 1 and 1 <= first_hold <= hold required")
        self.arms = list(arms)
        self.probe, self.hold = probe, hold
        self._hold = first_hold  # the next hold's builds
        # per arm: each timed round's build ms minus its verify ms
        self._timed: dict[int, list[float]] = {a: [] for a in self.arms}
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
            t.append(build_ms - verify_ms)

    def hidden(self, budget: int) -> bool | None:
        """Whether the verify hid the build of ``budget`` in most of its timed rounds (the
        median of build - verify <= 0: a round that captured the build, timed with the capture's
        eager runs, is an outlier that does not decide); None: no round timed."""
        t = self._timed[budget]
        return None if not t else statistics.median_low(t) <= 0.0

    def choose(self) -> int:
        """The largest arm the verify hides; the smallest when it hides none; the largest when
        no arm was timed."""
        seen = [(a, self.hidden(a)) for a in self.arms]
        if all(h is None for _, h in seen):
            return self.arms[0]
        for a, h in seen:
            if h:
                return a
        return self.arms[-1]

    def take(self) -> dict:
        """Builds per budget since the last take, and the budget held now."""
        out = {"held": self.held, "builds": {str(a): n for a, n in self.rounds.items() if n}}
        self.rounds = dict.fromkeys(self.arms, 0)
        return out
