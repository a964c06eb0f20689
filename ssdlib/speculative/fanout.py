"""Fan-out of the speculation cache: how many bonus-token guesses F_k to cache at each position.

Thm 12 (SSD paper, Sec. 4.1). A verification ends at outcome k in [0, K] with probability
P_k = a^k (1 - a) for k < K and P_K = a^K (a = a_p, the per-token acceptance rate). Caching the
top-F guesses at a position misses with probability ~ c F^(-r). Minimising the miss probability
sum_k P_k c F_k^(-r) subject to sum_k F_k = B (Lagrange: P_k r c F_k^(-r-1) = lambda) gives
F_k proportional to P_k^(1/(1+r)), i.e. after dividing out (1 - a)^(1/(1+r)):

    F_k = F_0 a^(k/(1+r))                           for k < K
    F_K = F_0 a^(K/(1+r)) (1 - a)^(-1/(1+r))

with F_0 set by the budget B; a constant c common to the positions drops out. It is not quite
common: after a rejection at k < K the draft's own token there is excluded from the guesses, its
next ones miss more than its first choices do at k = K (``FanoutEstimator``'s kinds of lookup).
With c_K / c = w the all-accepted position's F_K gains a factor w^(1/(1+r)) (w < 1: fewer
guesses there, more for the rejections). The real values are rounded to integers >= 0 summing
exactly to B (largest remainder), so the cache shape stays fixed when estimates move.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch

from ssdlib import env
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


def geometric_fanout_real(budget: int, K: int, a_p: float, r: float,
                          last_weight: float = 1.0) -> list[float]:
    """The Thm 12 allocation before rounding: K+1 non-negative reals summing to ``budget``
    (a_p clipped to :data:`A_P_RANGE`). ``last_weight``: c_K / c, the all-accepted position's
    miss constant over the others' (module doc)."""
    a = _check_geometry(budget, K, a_p, r)
    if not isinstance(last_weight, (int, float)) or not 0.0 < last_weight < math.inf:
        raise ConfigError(f"last_weight must be a finite number > 0, got {last_weight!r}")
    e = 1.0 / (1.0 + r)
    weights = [a ** (k * e) for k in range(K)]
    weights.append(a ** (K * e) * (1.0 - a) ** (-e) * last_weight ** e)
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


def geometric_fanout(budget: int, K: int, a_p: float, r: float,
                     last_weight: float = 1.0) -> list[int]:
    """Thm 12 fan-out: K+1 integers >= 0 summing to ``budget``; non-increasing over k < K."""
    return round_to_total(geometric_fanout_real(budget, K, a_p, r, last_weight), budget)


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


# where a speculation came from when its tokens are the draft's own guesses: the cache, a jit
# draft (a sequence's "first" speculation is one too); the others are a backup's tokens
OWN_SOURCES = frozenset({"cache", "jit", "first"})


def lookup_is_fresh(k: int, limit: int, own: bool) -> bool:
    """The kind of the lookup after outcome k of a speculation verified to ``limit`` tokens
    (:class:`FanoutEstimator`): fresh where the build's guesses at k start at the draft's first
    choice -- every verified token accepted (k = limit), or the token rejected at k was a
    backup's, not the draft's own (``own``: the speculation came from ``OWN_SOURCES``)."""
    return k >= limit or not own


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

    Two kinds of lookup miss differently at the same F. The build's guesses at outcome position
    k < K are the draft's best candidates there except the speculation's own token (a bonus
    after a rejection at k cannot be it): where that token was the draft's own guess (a cached
    or jit speculation), the draft's first choice was just rejected and its next ones are
    weaker guesses; where it was a backup's (n-gram, random) token, or k = K (every token
    accepted, the bonus at a fresh position), the guesses start at the draft's first choice.
    Lookups observed with their kind are fitted with one slope r and an intercept c per kind
    (``_fit``); the allocation weighs the all-accepted position by its kind's c against the
    rejections' (module doc) and :meth:`hit_rate_after` looks each outcome up with its kind's
    c. ``SSDLIB_FANOUT_KINDS=0``: every lookup pooled, one c.
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
        # the same by kind (class doc): fresh (True: the guesses start at the draft's first
        # choice) -> F -> [lookups, misses]
        self.kind_lookups: dict[bool, dict[int, list[int]]] = {True: {}, False: {}}

    def observe_verify(self, accepted: torch.Tensor | Sequence[int],
                       num_draft: torch.Tensor | Sequence[int]) -> None:
        """Record one round's outcomes: accepted [b] tokens out of num_draft [b] per row."""
        acc, nd = _host_list(accepted), _host_list(num_draft)  # runs every round: no tensor ops
        self.accepted += sum(acc)
        self.rejections += sum(a < n for a, n in zip(acc, nd))

    def observe_lookups(self, fan_out: torch.Tensor | Sequence[int],
                        hit: torch.Tensor | Sequence[bool],
                        fresh: Sequence[bool] | None = None) -> None:
        """Record cache lookups: fan_out [n] = F at the outcome's position, hit [n] bool;
        ``fresh`` [n] (optional): each lookup's kind (class doc), True where the guesses at
        its position start at the draft's first choice."""
        fs, hits = _host_list(fan_out), _host_list(hit)
        kinds = [None] * len(fs) if fresh is None else [bool(f) for f in fresh]
        if len(kinds) != len(fs):
            raise ValueError("observe_lookups: one kind per lookup")
        for f, h, kind in zip(fs, hits, kinds):
            tables = [self.lookups] if kind is None else [self.lookups, self.kind_lookups[kind]]
            for table in tables:
                bucket = table.setdefault(int(f), [0, 0])
                bucket[0] += 1
                bucket[1] += 0 if h else 1

    @property
    def a_p(self) -> float:
        tries = self.accepted + self.rejections + self.prior_strength
        return (self.accepted + self.prior_strength * self.a_p_prior) / tries

    @property
    def r(self) -> float:
        return self._model()[2]

    def summary(self) -> dict:
        """The estimates now: the allocation of the whole budget, a_p, r, the miss constants c
        of fresh lookups and of lookups after the draft's own rejection (class doc; None before
        a lookup) and how many lookups of each kind were observed."""
        fresh, rejected, r = self._model()
        return {"allocation": self.allocation(), "a_p": self.a_p, "r": r,
                "c_fresh": None if fresh is None else math.exp(fresh),
                "c_rejected": None if rejected is None else math.exp(rejected),
                "lookups": {"fresh": self._kind_count(True),
                            "rejected": self._kind_count(False)}}

    def _kind_count(self, fresh: bool) -> int:
        """Lookups observed of one kind (class doc)."""
        return sum(n for n, _ in self.kind_lookups[fresh].values())

    def _fit(self, tables: list[dict[int, list[int]]]
             ) -> tuple[list[float | None], float] | None:
        """The miss model m(F) = c F^(-r) fitted with one slope r and an intercept c per table
        of lookups (F -> [lookups, misses]): the slope from every table's usable buckets, each
        table centred on its own weighted centroid (class doc; clipped; r's prior where no
        table has two usable buckets); a table's log c is the line through its centroid where
        it has two, else the moment estimate at r (misses = c sum_F n_F F^(-r)), None where it
        holds no lookup. None before any lookup."""
        groups = []
        sxx = sxy = 0.0
        for table in tables:
            xs, ys, ws = [], [], []
            for f, (n, misses) in table.items():
                if f < 1 or n < self.min_lookups:
                    continue
                m = (misses + 0.5) / (n + 1.0)  # smoothed: a bucket with no misses stays finite
                xs.append(math.log(f))
                ys.append(math.log(m))
                ws.append(n * m / (1.0 - m))
            centroid = None
            if len(set(xs)) >= 2:
                sw = sum(ws)
                mx = sum(w * x for w, x in zip(ws, xs)) / sw
                my = sum(w * y for w, y in zip(ws, ys)) / sw
                sxx += sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
                sxy += sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys))
                centroid = (mx, my)
            groups.append(centroid)
        r = self.r_prior if sxx <= 0.0 else min(max(-sxy / sxx, self.r_range[0]),
                                                  self.r_range[1])
        logs: list[float | None] = []
        for table, centroid in zip(tables, groups):
            if centroid is not None:
                logs.append(centroid[1] + r * centroid[0])
                continue
            seen = [(f, n, misses) for f, (n, misses) in table.items() if f >= 1 and n]
            expected = sum(n * f ** -r for f, n, _ in seen)
            logs.append(math.log((sum(m for _, _, m in seen) + 0.5) / (expected + 1.0))
                        if seen else None)
        return None if all(c is None for c in logs) else (logs, r)

    def _miss_fit(self) -> tuple[float, float] | None:
        """(log c, r) of the miss model fitted to every lookup pooled (:meth:`_fit` of one
        table); None before any lookup."""
        fit = self._fit([self.lookups])
        return None if fit is None else (fit[0][0], fit[1])

    def _model(self) -> tuple[float | None, float | None, float]:
        """(log c of fresh lookups, log c after the draft's own rejection, r): with the
        lookups' kinds (class doc) one slope and an intercept each (a kind not seen yet takes
        the other's); without them, or with ``SSDLIB_FANOUT_KINDS=0``, the pooled fit for
        both. (None, None, r's prior) before any lookup."""
        if env.flag("SSDLIB_FANOUT_KINDS") and any(self.kind_lookups.values()):
            fit = self._fit([self.kind_lookups[True], self.kind_lookups[False]])
            if fit is not None:
                (fresh, rejected), r = fit
                return (rejected if fresh is None else fresh,
                        fresh if rejected is None else rejected, r)
        fit = self._miss_fit()
        return (None, None, self.r_prior) if fit is None else (fit[0], fit[0], fit[1])

    def _last_weight(self, model) -> float:
        """c of the all-accepted position over c of the others (the allocation's weight on
        F_K, ``geometric_fanout``): 1 until both kinds have ``min_lookups`` lookups."""
        fresh, rejected, _ = model
        if fresh is None or min(self._kind_count(True), self._kind_count(False)) \
                < self.min_lookups:
            return 1.0
        return math.exp(fresh - rejected)

    def hit_rate_after(self, a: float, limit: int | None = None,
                       budget: int | None = None, own: bool = True) -> float | None:
        """The hit rate the model predicts for the lookup after a speculation whose tokens the
        target accepts at per-token rate ``a``: sum over outcomes k of P_k(a) (1 - m(F_k)),
        with P_k the geometric outcome law over the verified ``limit`` (default K) tokens, F_k
        the current allocation's guesses at k and m(F) = min(1, c F^(-r)) the fitted miss
        model (m(0) = 1). A random proposal (a = 0) always ends at k = 0, where the geometric
        fan-out puts the most guesses once the draft is often rejected; a backup whose tokens
        are accepted like the draft's leads to the cache's own hit rate. ``budget``: a build
        of that many branches (None: the estimator's). ``own``: the speculation's tokens are
        the draft's own guesses (a jit draft), so a rejection at k < K is looked up with the
        misses of that kind; else (a backup's tokens) with the fresh kind's, as k = K always is
        (class doc). None before any lookup."""
        if not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ConfigError(f"acceptance a must be in [0, 1], got {a!r}")
        model = self._model()
        fresh_c, rejected_c, r = model
        if fresh_c is None:
            return None
        fan = self._allocate(limit, budget, model)
        k_max = self.K if limit is None else min(max(int(limit), 0), self.K)
        hit = 0.0
        for k in range(k_max + 1):
            p_k = a ** k * ((1.0 - a) if k < k_max else 1.0)
            if p_k and fan[k] > 0:
                c = rejected_c if own and k < k_max else fresh_c
                hit += p_k * (1.0 - min(1.0, math.exp(c - r * math.log(fan[k]))))
        return min(hit, 1.0)  # the outcome law's sum may round past 1

    def allocation(self, limit: int | None = None, budget: int | None = None) -> list[int]:
        """The current Thm 12 fan-out: K+1 integers summing to the budget (``budget``: this
        build's, at most the estimator's; None: the estimator's). ``limit``: the
        verification checks only the first ``limit`` <= K tokens (adaptive K), so its outcomes
        are k = 0 .. limit, k = limit the all-accepted one; the budget goes to those and the
        positions after ``limit`` get 0. With the lookups' kinds (class doc) the all-accepted
        position's miss constant is its own (``geometric_fanout``'s ``last_weight``)."""
        return self._allocate(limit, budget, self._model())

    def _allocate(self, limit: int | None, budget: int | None, model) -> list[int]:
        """:meth:`allocation` at the miss model ``model`` (:meth:`_model`)."""
        k = self.K if limit is None else min(max(int(limit), 0), self.K)
        b = self.budget if budget is None else budget
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= self.budget:
            raise ConfigError(f"a build's fan-out budget must be an integer in [1, "
                              f"{self.budget}], got {budget!r}")
        return geometric_fanout(b, k, self.a_p, model[2], self._last_weight(model)) \
            + [0] * (self.K - k)


def _host_list(values) -> list:
    """A tensor's or a sequence's values as a flat list."""
    if isinstance(values, torch.Tensor):
        return values.reshape(-1).tolist()
    return [int(v) for v in values]
