"""Fan-out of the speculation cache: how many bonus-token guesses F_k to cache at each position.

Thm 12 (SSD paper, Sec. 4.1). A verification ends at outcome k in [0, K] with probability
P_k = a^k (1 - a) for k < K and P_K = a^K (a = a_p, the per-token acceptance rate). Caching the
top-F guesses at a position misses with probability ~ c F^(-r). Minimising the miss probability
sum_k P_k c F_k^(-r) subject to sum_k F_k = B (Lagrange: P_k r c F_k^(-r-1) = lambda) gives
F_k proportional to P_k^(1/(1+r)), i.e. after dividing out (1 - a)^(1/(1+r)):

    F_k = F_0 a^(k/(1+r))                           for k < K
    F_K = F_0 a^(K/(1+r)) (1 - a)^(-1/(1+r))

with F_0 set by the budget B; the constant c drops out. The real values are rounded to integers
>= 0 summing exactly to B (largest remainder), so the cache shape stays fixed when estimates move.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch

from ssdlib.errors import ConfigError, require_int

# a_p is clipped into this range: at a_p = 1 the all-accepted weight (1 - a)^(-1/(1+r)) is
# infinite, at a_p = 0 every later position gets nothing; either extreme is a poor basis for
# allocating the whole budget on a noisy estimate.
A_P_RANGE = (0.01, 0.99)


def _check_geometry(budget: int, K: int, a_p: float, r: float) -> float:
    require_int("fan-out budget B", budget, 1)
    require_int("K", K, 0)
    if not isinstance(a_p, (int, float)) or not 0.0 <= a_p <= 1.0:
        raise ConfigError(f"a_p must be in [0, 1], got {a_p!r}")
    if not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
        raise ConfigError(f"r must be a finite number > 0, got {r!r}")
    return min(max(float(a_p), A_P_RANGE[0]), A_P_RANGE[1])


def geometric_fanout_real(budget: int, K: int, a_p: float, r: float) -> list[float]:
    """The Thm 12 allocation before rounding: K+1 non-negative reals summing to ``budget``
    (a_p clipped to :data:`A_P_RANGE`)."""
    a = _check_geometry(budget, K, a_p, r)
    e = 1.0 / (1.0 + r)
    weights = [a ** (k * e) for k in range(K)]
    weights.append(a ** (K * e) * (1.0 - a) ** (-e))
    f0 = budget / sum(weights)
    return [f0 * w for w in weights]


def round_to_total(values: Sequence[float], total: int) -> list[int]:
    """Largest-remainder rounding: non-negative ints summing to ``total`` (ties: lower index first,
    so a non-increasing input stays non-increasing)."""
    floors = [int(math.floor(v)) for v in values]
    order = sorted(range(len(values)), key=lambda i: (-(values[i] - floors[i]), i))
    for i in order[:total - sum(floors)]:
        floors[i] += 1
    return floors


def geometric_fanout(budget: int, K: int, a_p: float, r: float) -> list[int]:
    """Thm 12 fan-out: K+1 integers >= 0 summing to ``budget``; non-increasing over k < K."""
    return round_to_total(geometric_fanout_real(budget, K, a_p, r), budget)


def parse_fanout(spec: str | Sequence[int], K: int) -> list[int] | Literal["auto"]:
    """Parse a ``--fan-out`` value: ``"auto"``, ``"8,5,3,2,1,4"`` or a list (K+1 entries >= 0,
    positive sum), or ``"all-accepted:N"`` (cache N guesses after an all-accepted outcome only)."""
    require_int("K", K, 0)
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "auto":
            return "auto"
        if text.startswith("all-accepted:"):
            n = text.split(":", 1)[1].strip()
            if not n.isdigit() or int(n) < 1:
                raise ConfigError(f"fan-out {spec!r}: all-accepted:N needs an integer N >= 1")
            return [0] * K + [int(n)]
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            raise ConfigError(f"fan-out {spec!r}: expected 'auto', 'all-accepted:N' or K+1 "
                              "comma-separated integers") from None
    else:
        try:
            values = list(spec)
        except TypeError:
            raise ConfigError(f"fan-out {spec!r}: expected a string or a list of integers") \
                from None
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise ConfigError(f"fan-out {spec!r}: entries must be integers")
    if len(values) != K + 1:
        raise ConfigError(f"fan-out {spec!r}: needs K+1 = {K + 1} entries (one per outcome "
                          f"position 0..K), got {len(values)}")
    if any(v < 0 for v in values) or sum(values) < 1:
        raise ConfigError(f"fan-out {spec!r}: entries must be >= 0 with a positive sum")
    return values


def cache_branches(spec: str | Sequence[int], budget: int, K: int) -> int:
    """Branches per row of the speculation cache for fan-out ``spec``: the budget under
    ``auto``, else the list's sum."""
    fan = parse_fanout(spec, K)
    return budget if fan == "auto" else sum(fan)


class FanoutEstimator:
    """Online estimates of a_p and r, and the Thm 12 allocation they imply (constant total B).

    a_p: maximum-likelihood estimate under the geometric model -- every accepted token is a
    success, every rejection a failure; tokens after a rejection were never tried, so they are not
    counted (accepted / drafted would be biased low). ``prior_strength`` pseudo-tries at
    ``a_p_prior`` keep early allocations sane.

    r: the observed miss rate m(F) of cache lookups, grouped by the fan-out F that the outcome's
    position had, is fitted by weighted least squares to log m = log c - r log F (delta-method
    weights n m / (1 - m); buckets with fewer than ``min_lookups`` lookups are skipped). The free
    intercept c matters: the top-1 guess usually hits, so forcing m(1) = 1 would bias r. With fewer
    than two usable buckets r stays at ``r_prior``; fits are clipped to ``r_range``.
    """

    def __init__(self, budget: int, K: int, *, a_p_prior: float = 0.7, r_prior: float = 1.0,
                 prior_strength: float = 10.0, min_lookups: int = 20,
                 r_range: tuple[float, float] = (0.1, 5.0)) -> None:
        _check_geometry(budget, K, a_p_prior, r_prior)
        if prior_strength < 0 or min_lookups < 1 or not 0 < r_range[0] <= r_range[1]:
            raise ConfigError("FanoutEstimator: prior_strength >= 0, min_lookups >= 1 and "
                              "0 < r_range[0] <= r_range[1] required")
        self.budget, self.K = budget, K
        self.a_p_prior, self.r_prior = float(a_p_prior), float(r_prior)
        self.prior_strength, self.min_lookups, self.r_range = prior_strength, min_lookups, r_range
        self.accepted = 0
        self.rejections = 0
        self.lookups: dict[int, list[int]] = {}  # F -> [lookups, misses]

    def observe_verify(self, accepted: torch.Tensor | Sequence[int],
                       num_draft: torch.Tensor | Sequence[int]) -> None:
        """Record one round's outcomes: accepted [b] tokens out of num_draft [b] per row."""
        acc, nd = _host_list(accepted), _host_list(num_draft)  # runs every round: no tensor ops
        self.accepted += sum(acc)
        self.rejections += sum(a < n for a, n in zip(acc, nd))

    def observe_lookups(self, fan_out: torch.Tensor | Sequence[int],
                        hit: torch.Tensor | Sequence[bool]) -> None:
        """Record cache lookups: fan_out [n] = F at the outcome's position, hit [n] bool."""
        fs, hits = _host_list(fan_out), _host_list(hit)
        for f, h in zip(fs, hits):
            bucket = self.lookups.setdefault(int(f), [0, 0])
            bucket[0] += 1
            bucket[1] += 0 if h else 1

    @property
    def a_p(self) -> float:
        tries = self.accepted + self.rejections + self.prior_strength
        return (self.accepted + self.prior_strength * self.a_p_prior) / tries

    @property
    def r(self) -> float:
        fit = self._miss_fit()
        return self.r_prior if fit is None else fit[1]  # (the prior too without a slope)

    def _miss_fit(self) -> tuple[float, float] | None:
        """(log c, r) of the miss model m(F) = c F^(-r) fitted to the lookups (class doc), the
        line through the buckets' weighted centroid at the clipped slope; with fewer than two
        usable buckets r's prior and c pooled over every lookup; None before any lookup."""
        xs, ys, ws = [], [], []
        for f, (n, misses) in self.lookups.items():
            if f < 1 or n < self.min_lookups:
                continue
            m = (misses + 0.5) / (n + 1.0)   # smoothed: a bucket with no misses stays finite
            xs.append(math.log(f))
            ys.append(math.log(m))
            ws.append(n * m / (1.0 - m))
        if len(set(xs)) < 2:
            # one F or too few lookups for a slope: r's prior, and c from every lookup so far
            # (the moment estimate: misses = c sum_F n_F F^(-r))
            pooled = [(f, n, misses) for f, (n, misses) in self.lookups.items() if f >= 1 and n]
            if not pooled:
                return None
            r = self.r_prior
            expected = sum(n * f ** -r for f, n, _ in pooled)
            return math.log((sum(m for _, _, m in pooled) + 0.5) / (expected + 1.0)), r
        sw = sum(ws)
        mx = sum(w * x for w, x in zip(ws, xs)) / sw
        my = sum(w * y for w, y in zip(ws, ys)) / sw
        sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
        sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys))
        r = min(max(-sxy / sxx, self.r_range[0]), self.r_range[1])
        return my + r * mx, r

    def hit_rate_after(self, a: float, limit: int | None = None) -> float | None:
        """The hit rate the model predicts for the lookup after a speculation whose tokens the
        target accepts at per-token rate ``a``: sum over outcomes k of P_k(a) (1 - m(F_k)),
        with P_k the geometric outcome law over the verified ``limit`` (default K) tokens, F_k
        the current allocation's guesses at k and m(F) = min(1, c F^(-r)) the fitted miss
        model (m(0) = 1). A random proposal (a = 0) always ends at k = 0, where the geometric
        fan-out puts the most guesses once the draft is often rejected; a backup whose tokens
        are accepted like the draft's leads to the cache's own hit rate. None before any
        lookup."""
        fit = self._miss_fit()
        if fit is None:
            return None
        log_c, r = fit
        if not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ConfigError(f"acceptance a must be in [0, 1], got {a!r}")
        fan = self.allocation(limit)
        k_max = self.K if limit is None else min(max(int(limit), 0), self.K)
        hit = 0.0
        for k in range(k_max + 1):
            p_k = a ** k * ((1.0 - a) if k < k_max else 1.0)
            if p_k and fan[k] > 0:
                hit += p_k * (1.0 - min(1.0, math.exp(log_c - r * math.log(fan[k]))))
        return min(hit, 1.0)  # the outcome law's sum may round past 1

    def allocation(self, limit: int | None = None, budget: int | None = None) -> list[int]:
        """The current Thm 12 fan-out: K+1 integers summing to the budget (``budget``: this
        build's, at most the estimator's; None: the estimator's). ``limit``: the
        verification checks only the first ``limit`` <= K tokens (adaptive K), so its outcomes
        are k = 0 .. limit, k = limit the all-accepted one; the budget goes to those and the
        positions after ``limit`` get 0."""
        k = self.K if limit is None else min(max(int(limit), 0), self.K)
        b = self.budget if budget is None else budget
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= self.budget:
            raise ConfigError(f"a build's fan-out budget must be an integer in [1, "
                              f"{self.budget}], got {budget!r}")
        return geometric_fanout(b, k, self.a_p, self.r) + [0] * (self.K - k)


def _host_list(values) -> list:
    """A tensor's or a sequence's values as a flat list."""
    if isinstance(values, torch.Tensor):
        return values.reshape(-1).tolist()
    return [int(v) for v in values]
