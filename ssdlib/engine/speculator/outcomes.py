"""Answering an outcome on the speculator: the leader chose each row's next speculation (a
cache hit, a fallback drawn on its host, or a jit request, ``cache_mirror.py``); here the jit rows
are drafted now, a sampling exchange's q is gathered, and the rows' speculations in flight are
recorded. :class:`Fallbacks` holds the choice of backup for misses (Thm 17) that each CACHE
tells the leader.

Every answer declares the q its tokens were drawn from (QKind), so the verifier stays exact.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch

from ssdlib import env
from ssdlib.distributed.protocol import Choice, Outcome, Speculation
from ssdlib.engine.speculator.spec_row import SpecRow
from ssdlib.speculative.acceptance import QKind
from ssdlib.speculative.fallback import FALLBACKS, choose_fallback
from ssdlib.speculative.ngram import kept_prefix, propose_ngram

# fallback="auto" (Thm 17): lookups observed before deciding; n-gram cost in verify rounds
# (a suffix search, ~0) and the prior of its per-token acceptance (then measured online); a_p
# prior for an explicit fan-out list (no estimator).
MIN_LOOKUPS_FOR_AUTO = 8
# without a fitted miss model (no fan-out estimator, or too few lookups), lookups after each
# backup's speculations before the choice trusts its hit rate: until then "auto" answers misses
# with the backup least measured (jit, n-gram and random each a few times)
MIN_LOOKUPS_AFTER = 8
# then one choice in this many goes to the backup least measured, so that the estimates of the
# backups not chosen keep learning (a choice made on a few lookups is not final)
EXPLORE_EVERY = 32
JIT_TIMES = 15  # jit drafts whose median time is jit's cost
NGRAM_COST = 0.0
NGRAM_ACCEPTANCE_PRIOR = 0.2
A_P_PRIOR = 0.7


@dataclass
class Answer:
    """The next speculation of an outcome's live rows, in the order of the live rows."""

    tokens: torch.Tensor  # [n, K] int64, host
    kinds: torch.Tensor  # [n] int64 QKind, host
    hit: torch.Tensor  # [n] bool, host: served from the cache
    branch: torch.Tensor  # [n] int64, host: the cache branch of a hit
    q: torch.Tensor | None  # [n, K, V] float32 on the device, when the exchange samples

    def record(self, rows: list[SpecRow], backup: str) -> None:
        """The rows' speculations in flight are now these; ``backup``: the one the leader
        answered misses with (the speculator's last CACHE named it), the source of the rows
        the leader drew (n-gram or random tokens)."""
        hit, branch, tokens = self.hit.tolist(), self.branch.tolist(), self.tokens.tolist()
        for row, h, br, toks, kind in zip(rows, hit, branch, tokens, self.kinds.tolist()):
            row.reuse = br if h and row.fed else None
            row.sent = toks
            row.fed = False
            row.kind = kind
            row.source = "cache" if h else "jit" if kind == int(QKind.DENSE) else backup

    @classmethod
    def from_outcome(cls, outcome: Outcome, live: list[int], vocab_size: int,
                     device) -> tuple["Answer", list[int]]:
        """The speculations the leader chose for rows ``live`` (positions in ``outcome``):
        CACHE and LOCAL rows filled in (q of a hit not yet); -> (answer, the positions in the
        answer of the JIT rows, to draft)."""
        n, k = len(live), outcome.k
        hit, branch, tokens, kinds, jit = [], [], [], [], []
        for j, i in enumerate(live):  # lists first, then one tensor each (this runs per round)
            choice = outcome.choice[i]
            hit.append(choice == Choice.CACHE)
            branch.append(outcome.arg[i] if choice == Choice.CACHE else 0)
            tokens.append(outcome.tokens[i] if choice != Choice.JIT else [0] * k)
            kinds.append(outcome.arg[i] if choice == Choice.LOCAL else int(QKind.DENSE))
            if choice == Choice.JIT:
                jit.append(j)
        ans = cls(torch.tensor(tokens, dtype=torch.int64).reshape(n, k),
                  torch.tensor(kinds, dtype=torch.int64), torch.tensor(hit, dtype=torch.bool),
                  torch.tensor(branch, dtype=torch.int64),
                  torch.zeros(n, k, vocab_size, device=device) if outcome.sampling else None)
        return ans, jit

    def in_order(self, live: list[int], order: list[int]) -> Speculation:
        """The SPEC message: rows in the outcome's ``order`` of slots (inactive rows: zeros);
        tokens and kinds on the host, q on the device."""
        if live == order:
            return Speculation(self.tokens, self.kinds, self.q)
        pos = torch.tensor([order.index(s_) for s_ in live])
        n, k = len(order), self.tokens.shape[1]
        tokens = torch.zeros(n, k, dtype=torch.int64)
        kinds = torch.zeros(n, dtype=torch.int64)
        tokens[pos], kinds[pos] = self.tokens, self.kinds
        q = None
        if self.q is not None:
            q = torch.zeros(n, k, self.q.shape[-1], device=self.q.device)
            q[pos.to(self.q.device, non_blocking=True)] = self.q
        return Speculation(tokens, kinds, q)


def draft_jit(drafter, rows: list[SpecRow], k: int, want_q: bool):
    """The draft proposes k tokens per row now: tokens [n, k] and q [n, k, V] (or None)."""
    for r in rows:
        drafter.valid[r.slot] = r.valid
    toks, qs = drafter.propose(rows, k, want_q=want_q)
    for r in rows:
        r.valid = len(r.tokens)  # the drafted tokens' KV is speculative
    return toks, qs


def answer_jit(drafter, rows: list[SpecRow], k: int, ans: Answer, loc: torch.Tensor) -> None:
    """Draft the rows' next speculations now into positions ``loc`` of ``ans`` (their dense q
    too when the exchange samples): k tokens (<= the answer's K; the rest stay zeros, never
    verified); returns once the tokens are on the host."""
    toks, qs = draft_jit(drafter, rows, k, want_q=ans.q is not None)
    ans.tokens[loc, :k] = toks.cpu()
    ans.kinds[loc] = int(QKind.DENSE)
    if ans.q is not None:
        ans.q[loc.to(ans.q.device, non_blocking=True), :k] = qs.to(ans.q.dtype)


def _tries(k: int, K: int) -> int:
    """Tokens a speculation of K put to the test when k were accepted (the first rejected one
    too, if any)."""
    return k + (1 if k < K else 0)


def shrunk_acceptance(accepted: int, tried: int, prior: float, prior_tries: int = 10) -> float:
    """Per-token acceptance accepted / tried, shrunk towards ``prior`` as ``prior_tries``."""
    return (accepted + prior * prior_tries) / (tried + prior_tries)


class Fallbacks:
    """The backups for rows whose outcome missed the cache, and the choice among them."""

    def __init__(self, drafter, configured: str, k: int, vocab_size: int):
        self.drafter = drafter
        self.configured = configured  # "jit" | "ngram" | "random" | "auto"
        self.K, self.V = k, vocab_size
        self.t_jit: float | None = None  # measured cost of a jit draft, seconds (median)
        self._jit_times: deque[float] = deque(maxlen=JIT_TIMES)
        self._choices = 0  # choices the model made (one in EXPLORE_EVERY explores)
        # (tokens, committed then, k, limit) of misses to shadow at the next choice
        self._shadows: list[tuple[list[int], int, int, int | None]] = []
        self.ngram_accepted = self.ngram_tried = 0  # per-token acceptance of n-gram proposals
        self.jit_accepted = self.jit_tried = 0  # and of jit drafts (rows that missed, firsts)
        # cache lookups and hits over the rank's life (the STATS counters restart with every
        # batch: with those, each new batch's first rounds fell back to jit until measured)
        self.hits = self.lookups = 0
        # the same by the source of the speculation looked up after: [lookups, hits]
        self.after = {source: [0, 0] for source in ("cache",) + FALLBACKS}
        self.pushed = "jit"  # the backup named in the last CACHE: the leader's for misses

    def observe_ngram(self, k: int, limit: int | None = None) -> None:
        """An n-gram speculation had k of its first ``limit`` tokens (default K) accepted: learn
        its per-token acceptance."""
        self.ngram_accepted += k
        self.ngram_tried += _tries(k, self.K if limit is None else limit)

    def shadow_ngram(self, tokens: list[int], k: int, limit: int | None = None) -> None:
        """:meth:`observe_ngram_shadow` for a row whose miss another backup answered, ``tokens``
        its committed tokens now, run at the next :meth:`choose` (at the push, after the build's
        launch: not on the way to an answer the leader may be waiting for). Only ``auto`` weighs
        the n-gram's acceptance."""
        if self.configured == "auto":
            self._shadows.append((tokens, len(tokens), k, limit))

    def observe_ngram_shadow(self, tokens: list[int], k: int, limit: int | None = None,
                             end: int | None = None) -> None:
        """A row whose miss another backup answered committed ``tokens``, the last k + 1 of
        them the verified outcome (k accepted, then the target's token): learn the n-gram
        proposal's acceptance from what it would have kept there, without spending misses on
        it. The leader's rule (``cache_mirror.local_fallback``): the n-gram proposal over the
        tokens before the outcome, random tokens (none kept) where no suffix recurs. It keeps
        the tokens it shares with the target's, up to the first that differs (a rejection) or
        the end of the known ones (censored: tokens past them are not counted). A one-hot
        proposal token x is accepted with probability p(x), the chance that the target's own
        draw is x, so the count holds for sampling rows too. ``end``: the tokens committed
        then (default all of ``tokens``)."""
        limit = self.K if limit is None else limit
        start = (len(tokens) if end is None else end) - k - 1
        if start < 1 or limit < 1:
            return
        known = tokens[start:start + min(k + 1, limit)]
        kept = kept_prefix(propose_ngram(tokens[:start], limit), known)
        self.ngram_accepted += kept
        self.ngram_tried += kept + (1 if kept < len(known) else 0)

    def observe_jit(self, k: int, limit: int | None = None) -> None:
        """A jit speculation had k of its first ``limit`` tokens (default K) accepted."""
        self.jit_accepted += k
        self.jit_tried += _tries(k, self.K if limit is None else limit)

    def observe_lookups(self, lookups: int, hits: int) -> None:
        self.lookups += lookups
        self.hits += hits

    def observe_after(self, source: str, hit: bool) -> None:
        """A lookup after a speculation from ``source`` ("cache", or a backup) hit or missed."""
        counts = self.after[source]
        counts[0] += 1
        counts[1] += int(hit)

    def hit_rate_after(self, source: str, prior: float) -> float:
        """The hit rate of lookups after ``source``'s speculations, shrunk towards ``prior``."""
        lookups, hits = self.after[source]
        return shrunk_acceptance(hits, lookups, prior)

    def jit_acceptance(self, prior: float) -> float:
        """Measured per-token acceptance of jit drafts, shrunk towards ``prior``: the draft
        accepts less on the rows that missed the cache than on average."""
        return shrunk_acceptance(self.jit_accepted, self.jit_tried, prior)

    def ngram_acceptance(self) -> float:
        """Measured per-token acceptance of n-gram speculations, shrunk towards the prior."""
        return shrunk_acceptance(self.ngram_accepted, self.ngram_tried, NGRAM_ACCEPTANCE_PRIOR)

    def choose(self, n_rows: int, t_verify: float | None, estimator) -> str:
        """The backup the next CACHE names (:attr:`pushed`): the configured one, or Thm 17's
        choice from the hit rates after a hit and after each backup (:meth:`observe_after`;
        ``fallback.steady_hit_rate``), jit's cost (in verify forwards of the leader,
        ``t_verify`` seconds each), the backups' measured acceptance and the batch size. jit
        until there are measurements. Each backup's hit rate after is its measured rate shrunk
        towards the rate the fan-out's miss model predicts for it (:meth:`after_priors`), so
        the model chooses from the first lookups on; one choice in EXPLORE_EVERY is the least
        measured backup's, so that the estimates of the backups not chosen keep learning.
        Without a fitted miss model each backup is first tried until measured, the least
        measured first."""
        for tokens, end, k, limit in self._shadows:
            self.observe_ngram_shadow(tokens, k, limit, end)
        self._shadows.clear()
        self.pushed = self._choose(n_rows, t_verify, estimator)
        return self.pushed

    def after_priors(self, accepted: dict[str, float], estimator) -> dict[str, float] | None:
        """Each backup's prior hit rate after its speculation: the rate the fan-out's miss model
        predicts at the backup's per-token acceptance (``accepted``;
        ``FanoutEstimator.hit_rate_after``). None without an estimator or a lookup. (On 2 cores,
        24 chat prompts, one backup forced in each run: random predicted 0.62, measured 0.69;
        n-gram 0.50 and 0.59; jit 0.37 and 0.35. Scaling the predictions by the cache's measured
        rate over its predicted one put random at 0.41 and n-gram at 0.42: the model's error is
        not common to the sources: it pooled the lookups of every position, where a draft's
        token rejected at k makes its other guesses there likelier to miss, a random one not.
        Hence the miss model's two kinds of lookup, ``FanoutEstimator``'s class doc.)"""
        if estimator is None:
            return None
        # a jit draft's rejected tokens are the draft's own guesses; a backup's are not
        predicted = {f: estimator.hit_rate_after(a, own=f == "jit") for f, a in accepted.items()}
        return None if None in predicted.values() else predicted

    def _choose(self, n_rows: int, t_verify: float | None, estimator) -> str:
        if self.configured != "auto":
            return self.configured
        if self.t_jit is None or not t_verify or self.lookups < MIN_LOOKUPS_FOR_AUTO:
            return "jit"
        p = self.hits / self.lookups
        a_p = estimator.a_p if estimator is not None else A_P_PRIOR
        a_jit, a_ngram = self.jit_acceptance(a_p), self.ngram_acceptance()
        priors = self.after_priors({"jit": a_jit, "ngram": a_ngram, "random": 0.0}, estimator)
        if priors is None:
            unmeasured = [f for f in FALLBACKS if self.after[f][0] < MIN_LOOKUPS_AFTER]
            if unmeasured:
                return min(unmeasured, key=lambda f: self.after[f][0])
            priors = dict.fromkeys(FALLBACKS, p)
        self._choices += 1
        if self._choices % EXPLORE_EVERY == 0:
            return min(FALLBACKS, key=lambda f: self.after[f][0])
        return choose_fallback(n_rows, self.hit_rate_after("cache", p), a_p, self.K,
                               self.t_jit / t_verify, NGRAM_COST, a_ngram, a_jit=a_jit,
                               p_after={f: self.hit_rate_after(f, priors[f]) for f in FALLBACKS})

    def jit(self, rows: list[SpecRow], ans: Answer, loc: list[int]) -> None:
        """Draft ``rows`` (positions ``loc`` of ``ans``) now, timing it for :meth:`choose`."""
        t0 = time.perf_counter()
        answer_jit(self.drafter, rows, self.K, ans, torch.tensor(loc))
        # after the read-back, so the cost includes the drafting on the device
        self._jit_times.append(time.perf_counter() - t0)
        self.t_jit = statistics.median(self._jit_times)


def q_after_build() -> bool:
    """``SSDLIB_Q_AFTER_BUILD=1`` (experimental, default 0): a sampling SPEC's q is sent once
    the cache build is launched (on GPU from a side stream) instead of before it, which takes
    the send's host cost off the path to the build. Not yet measured on a GPU."""
    return env.flag("SSDLIB_Q_AFTER_BUILD")
