"""Which backup speculator to run on a cache miss (SSD paper Sec. 4.3, Thm 7, Cor 16, Thm 17).

Round model (Thm 7; times in units of one verifier forward). Every round costs one verification.
On a hit the next speculation is already cached -- it was drafted during the verification, taking
T_p -- so the round lasts max(1, T_p). On a miss a backup must first produce a speculation:
1 + T_b. A round commits the accepted tokens plus the bonus token; with per-token acceptance a
over K draft tokens, P(at least i accepted) = a^i, so

    E[tokens] = sum_{i=0..K} a^i = (1 - a^(K+1)) / (1 - a)        (K + 1 at a = 1).

AR makes one token per forward, so  speedup = E[tokens per round] / E[time per round]:

    speedup = [p E_hit + (1 - p) E_miss] / [p max(1, T_p) + (1 - p) (1 + T_b)].

Batch b (Cor 16, Thm 17): the whole batch waits for the backup as soon as one row misses, so with
independent rows the round is miss-free with probability p^b, which replaces p in the time term.
Backups: the primary draft just in time ("jit": T_b = t_jit, acceptance a_p), an n-gram / suffix
speculator (t_ngram ~ 0, a_ngram), random tokens (t_random ~ 0, acceptance ~ 0: the bonus only).
The accurate backup wins at small b, a fast one above a critical batch size b*.

The hit rate need not be one number: a row's next lookup hits more or less often according to
where its speculation came from (a backup's proposal that the target rejects at once leaves an
outcome the cache foresaw more often than a draft's continuation). With p_c the hit rate after a
hit and p_f after backup f's speculation, a row's rounds form a two-state Markov chain whose
long-run share of hits is p_f / (p_f + 1 - p_c) (``steady_hit_rate``); ``p_after`` puts that in
place of p for each backup (equal rates give p back).

The paper also puts p^b into the token term, as if every row of a missed round were redrafted by
the backup; ssdlib runs the backup only on the rows that missed, so the rows that hit still commit
E_hit and the token term keeps the per-row p. ``per_row_fallback=False`` gives the paper's form.
With x = p^b the comparison of two backups is then linear in x, and at x = 1 the backup with the
higher acceptance wins, so the preferred backup switches at most once as b grows and b* is well
defined. (In the paper's form the comparison is quadratic in x and can switch back; b* is then
the first switch.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from ssdlib.errors import ConfigError, require_int

Fallback = Literal["jit", "ngram", "random"]
FALLBACKS: tuple[Fallback, ...] = ("jit", "ngram", "random")  # also the tie-break order


def _check_prob(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name} must be a probability in [0, 1], got {value!r}")
    return float(value)


def _check_time(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be a finite time >= 0 (in verifier forwards), "
                          f"got {value!r}")
    return float(value)


def expected_tokens(a: float, K: int) -> float:
    """Expected tokens committed per round, (1 - a^(K+1)) / (1 - a), acceptance a over K tokens."""
    a, K = _check_prob("acceptance", a), require_int("K", K, 0)
    return K + 1.0 if a == 1.0 else (1.0 - a ** (K + 1)) / (1.0 - a)


def batch_hit_rate(p_hit: float, batch_size: int) -> float:
    """Probability that no row of a batch misses, p_hit^b (Cor 16)."""
    return _check_prob("p_hit", p_hit) ** require_int("batch_size", batch_size, 1)


def expected_speedup(p_hit: float, e_hit: float, e_miss: float, t_p: float, t_b: float,
                     p_round: float | None = None) -> float:
    """Thm 7: [p E_hit + (1 - p) E_miss] / [p' max(1, T_p) + (1 - p') (1 + T_b)], speedup over AR.

    p' = ``p_round``, the probability that the round needs no backup (default p_hit, i.e. b = 1).
    """
    p = _check_prob("p_hit", p_hit)
    pr = p if p_round is None else _check_prob("p_round", p_round)
    for name, e in (("e_hit", e_hit), ("e_miss", e_miss)):
        if not isinstance(e, (int, float)) or not math.isfinite(e) or e < 1:
            raise ConfigError(f"{name} must be >= 1 token per round, got {e!r}")
    t_p, t_b = _check_time("t_p", t_p), _check_time("t_b", t_b)
    tokens = p * e_hit + (1.0 - p) * e_miss
    time = pr * max(1.0, t_p) + (1.0 - pr) * (1.0 + t_b)
    return tokens / time


def steady_hit_rate(p_after_hit: float, p_after_miss: float) -> float:
    """A row's long-run share of rounds served from the cache when its lookup hits with
    probability ``p_after_hit`` after a hit and ``p_after_miss`` after a backup's speculation
    (a two-state Markov chain): p_m / (p_m + 1 - p_h); p when both are p. (p_h = 1, p_m = 0:
    either state is absorbing; the row that starts on a hit stays there, so 1.)"""
    p_h = _check_prob("p_after_hit", p_after_hit)
    p_m = _check_prob("p_after_miss", p_after_miss)
    denom = p_m + (1.0 - p_h)  # (p_m + 1.0) - p_h rounds: at p_h = 1 it gave p_m / p_m > 1
    return 1.0 if denom == 0.0 else min(p_m / denom, 1.0)


def fallback_speedups(batch_size: int, p_hit: float, a_p: float, K: int, t_jit: float,
                      t_ngram: float, a_ngram: float, *, t_p: float | None = None,
                      t_random: float = 0.0, a_random: float = 0.0,
                      a_jit: float | None = None,
                      p_after: Mapping[str, float] | None = None,
                      per_row_fallback: bool = True) -> dict[Fallback, float]:
    """Expected speedup over AR with each backup at this batch size (Thm 17).

    t_p: the primary draft's time for K tokens on the hit path (default t_jit). a_jit: the
    draft's acceptance when it drafts a row that missed (default a_p; measured, it is lower:
    misses are the outcomes the draft did not foresee). p_after: the hit rate of a lookup after
    each backup's speculation (a backup left out: p_hit); p_hit is then the rate after a hit,
    and each backup is weighed at its :func:`steady_hit_rate`.
    """
    t_p = t_jit if t_p is None else t_p
    e_hit = expected_tokens(a_p, K)
    a_jit = a_p if a_jit is None else _check_prob("a_jit", a_jit)
    _check_prob("p_hit", p_hit)
    if p_after is not None and set(p_after) - set(FALLBACKS):
        raise ConfigError(f"p_after names backups {sorted(set(p_after) - set(FALLBACKS))}; "
                          f"they are {', '.join(FALLBACKS)}")
    backups = {"jit": (t_jit, a_jit), "ngram": (t_ngram, a_ngram), "random": (t_random, a_random)}
    out: dict[Fallback, float] = {}
    for name, (t_b, a_b) in backups.items():
        p = p_hit if p_after is None or name not in p_after else \
            steady_hit_rate(p_hit, p_after[name])
        x = batch_hit_rate(p, batch_size)
        p_tokens = p if per_row_fallback else x
        out[name] = expected_speedup(p_tokens, e_hit, expected_tokens(a_b, K), t_p, t_b,
                                     p_round=x)
    return out


def choose_fallback(batch_size: int, p_hit: float, a_p: float, K: int, t_jit: float,
                    t_ngram: float, a_ngram: float, **kwargs: float | bool) -> Fallback:
    """The backup with the highest expected speedup (ties: jit, then ngram, then random).
    Keyword arguments as in :func:`fallback_speedups`."""
    speedups = fallback_speedups(batch_size, p_hit, a_p, K, t_jit, t_ngram, a_ngram, **kwargs)
    return max(FALLBACKS, key=lambda name: (speedups[name], -FALLBACKS.index(name)))


def critical_batch_size(p_hit: float, a_p: float, K: int, t_jit: float, t_ngram: float,
                        a_ngram: float, *, max_batch: int = 4096,
                        **kwargs: float | bool) -> int | None:
    """b*: the smallest batch size at which a fast backup beats just-in-time drafting, or None if
    jit stays best up to ``max_batch``. Arguments as in :func:`choose_fallback`."""
    require_int("max_batch", max_batch, 1)
    for b in range(1, max_batch + 1):
        if choose_fallback(b, p_hit, a_p, K, t_jit, t_ngram, a_ngram, **kwargs) != "jit":
            return b
        if batch_hit_rate(p_hit, b) in (0.0, 1.0):
            break  # p^b no longer changes with b, so neither does the choice
    return None
