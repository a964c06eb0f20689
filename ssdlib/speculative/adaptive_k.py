"""Adaptive speculation length: per sequence, each round, the K among ``k_choices(K_max)`` (0, a
middle value and K_max) that maximises the expected committed tokens per unit of time.

Choices. Every K a round can run is a set of captured steps (the verify of K + 1 positions, the
draft's chain of K steps, greedy and sampled, for every batch bucket), each a compile at start-up
where the steps are compiled; the choices are kept to three, 0, ceil(K_max / 2) and K_max, so that
the warm-up grows by a few shapes, not by K_max + 1 of them. Near the optimum E / cost is flat in
K (it changes by a few percent between neighbouring K at the acceptances a working draft has), so
little is lost; K = 0 (plain decoding) and K_max are always among them.

Rule. With a per-token acceptance alpha (every token is accepted with probability alpha given the
ones before it were), a round that proposes K drafts commits in expectation

    E(K, alpha) = 1 + alpha + ... + alpha^K = (1 - alpha^(K+1)) / (1 - alpha)   (alpha = 1: K + 1)

tokens (the bonus token included) and costs cost(K) = K * c_draft + c_verify(K), where c_verify(0)
is a plain AR step of the target. The policy takes the K of the best rate E(K, alpha) / cost(K);
when that K drafts, a longer one whose rate is within LONGER_K_MARGIN of it. A draft that fails
ends at K = 0 (plain decoding); one that the target agrees with keeps K_max as long as a draft
step is cheaper than a verify.

alpha, per sequence: exponentially decayed counts of accepted and tried draft tokens (a token is
tried when every token before it was accepted, so tokens past a rejection count for nothing),
started at PRIOR_ALPHA with the weight of PRIOR_TRIES tries: alpha = accepted / tried. Every
sequence starts from the prior, whatever sequences before it showed: drafts fare very differently
from one prompt to the next, and a sequence started from its predecessors' acceptance (tried: the
acceptance of earlier sequences of about its length) sat at K = 0 for 42 of its first 44 rounds
where its own draft did well (SD at 0.85x a fixed K on one H200 at 7a0a61a, 500-token prompts).
A sequence whose draft fails spends its first few rounds learning it; its draft was prefilled at
admission, so those rounds pay no catch-up.

Hard stretches. Acceptance comes in stretches: a hard stretch of text (a new name, a number) drives
the short estimate down in a row whose draft does well, and a round at K = 0 observes nothing that
would take it back. So each row also keeps long-run counts (decayed by LONG_DECAY per observed
round, a memory of ~33 rounds): while the long-run estimate still chooses to draft, a row whose
short estimate chooses K = 0 drafts the shorter K that estimate gives among K >= 1, for up to
HARD_STRETCH such rounds until a draft token is accepted again, and takes K_max back when the draft
agrees again. A draft that fails throughout (its long run low too, within a few rounds: the prior
weighs two tries) goes to K = 0 at once and is probed; one that fails after doing well drops after
HARD_STRETCH rounds or once its long run says so, whichever comes first (long-run counts of many
accepted tokens fall slowly). A round at K = 0 also moves the short estimate toward the long-run
one (the gap shrinks by RECOVERY). Without the long run, on one H200 (SmolLM2 and the default
draft, 16 HumanEval chat prompts, b = 1) adaptive K ran half its rounds at K = 0 and decoded 0.91x
the speed of a fixed K = 3 (1116 against 1224 tok/s, one bench invocation at 3e7e4c0); with it
moving a dropped row back, 500-token prompts still spent 23 of 129 rounds at K = 0 in stints of 1-8
rounds (0.91x a fixed K, median of three passes, 21e017b): each stint's tokens come at the AR rate
and the next drafting round catches the draft up. tests/speculative/test_adaptive_k.py simulates
such text at that machine's step costs.

Probes. A round at K = 0 teaches nothing about the draft, so a sequence that has chosen K = 0 for
``interval`` rounds in a row runs one round at its best K >= 1 (a probe). If after it the sequence
still chooses K = 0, the interval doubles (up to MAX_PROBE_INTERVAL); otherwise it restarts at
FIRST_PROBE_INTERVAL. A probe is dear where the draft is far behind (its catch-up over every token
it skipped, then a chain and a wider verify: ~1.2 ms more than a ~1.2 ms AR step for SmolLM2 at
0.5-2k tokens of context on one H200), so once a probe has failed, the intervals are also kept
long enough that probes cost at most PROBE_BUDGET of the decoding time: at least (a probe's
measured extra time) / (PROBE_BUDGET x an AR round's time) rounds (:meth:`StepCosts.observe_probe`,
fed by the loop). The first probe after a drop comes after FIRST_PROBE_INTERVAL rounds whatever the
budget: a drop often ends a hard stretch of text that the draft does well after (on one H200 a
500-token prompt's sequence waited 40 rounds for its first probe under the budget, then drafted
well: SD at 0.89x a fixed K), and one probe a drop is cheap next to a stretch at K = 0 that the
draft would have sped up by a third.

Batches. A round drafts as many steps as its longest row's K and verifies K + 1 positions of
every row, so a row whose own choice is shorter would save the batch nothing: every greedy row
of a round takes the round's longest K, and a row lifted from K = 0 drafts, and is observed, for
free (its count of rounds at K = 0 restarts). Greedy tokens do not depend on K; sampled rows are
not lifted, so that a seeded request's tokens do not depend on the requests batched with it.
Without the lift, on one H200 (16 prompts of 2k tokens, b = 8, the default draft) adaptive K ran
107 of its 910 rounds with rows at K = 0 and decoded at 0.88x AR, against a fixed K's 1.02x
(b77ccd7); with it, 1.10x against 0.99x (0af9a57).

Costs (:class:`StepCosts`): running medians (of the last COST_WINDOW measurements: a round that
also ran something once, a first call's set-up, a collector's pause, must not decide many rounds
after it) of the seconds of one draft step and of the rest of a round at each K, fed by the
loop's round timer. Before a measurement, and always for rows that sample, the priors stand in:
a verify of any K costs 1, a draft step ``draft_prior`` of it. Sampled rows decide on the priors
so that a seeded sequence's K schedule, and with it its tokens, depends on its own tokens only
(measured times differ from run to run; a greedy row's tokens are the target's argmaxes whatever
K it runs). The loops therefore measure costs in rounds of greedy rows only (a greedy row in a
mixed batch decides on what the all-greedy rounds, the warm-up's among them, measured): a round
with sampling rows may run other steps (a proposal that does not fit its captured step runs
eagerly; before a feature draft's sampled proposals were captured, its steps, timed in a
warm-up's sampled batch on one H200, were taken for 2.2 ms each, against 0.26 ms for the
default draft's captured steps in the same invocation, and greedy SD with that draft stopped
drafting).

Sweep (``sweep=True``, for engines that capture their steps): the loop's first rounds run every
choice once, K_max down to 0 and 0 again (a second K = 0 round leaves the draft behind by more than a
round, so the round after it runs the draft's catch-up), for batches of greedy rows, of sampled rows
and of both apart (each kind samples through steps of its own): the warm-up (the server's mixed
batch for the third kind) then meets every step shape the policy can pick.
Those rounds capture their steps, so their times say nothing of the costs: the loops feed
:class:`StepCosts` neither from a sweep's round (``AdaptiveK.sweeping``) nor from any round in
which a step was captured.

Timing rounds. A K the policy never runs is never timed: it takes the nearest timed K's cost,
so where the verify's cost grows with K (a CPU, or a large batch) and only K_max was ever run,
K_max / 2 looks as dear as K_max and is never chosen. SSD's leader met this on a CPU: its
speculator's drafting costs the choice nothing, so from the prior on every round ran K_max (2
cores, b = 1: 63 ms a verify of 6 positions against 40 for an AR step). So once costs are
measured, every COST_PROBE_GAP rounds an all-greedy round whose longest K is above an untimed
choice >= 1 runs at the longest such choice instead (greedy tokens do not depend on K; sampled
rows are never shortened), until every choice >= 1 below K_max has TIMINGS timings at that batch
size (one timing may be an outlier that would keep the K from ever being chosen)
(costs are kept per batch size: on 2 cores, SD at b = 4 ended a run with K = 3 timed at 51 ms
and K = 5 at 114 when each median mixed rounds of 1 to 4 rows, and an SSD leader with K = 3 at
131 and K = 5 at 63, which then never chose K = 3); K = 0 is left to the rows' own probes.

Ahead of time (:meth:`AdaptiveK.choose_ahead`): a round at K = 0 teaches the policy nothing (its
rows observe nothing), so the next round's choices can be made while its forward runs on the
device, and the next :meth:`AdaptiveK.choose` takes them as they are (rows that joined since are
chosen then). Such a round then costs the host between two forwards what an AR step does.

Everything here is host arithmetic on Python numbers, a few operations per row and round.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Sequence

from ssdlib import env
from ssdlib.errors import ConfigError

PRIOR_ALPHA = 0.9  # a fresh sequence's acceptance before it has tried a draft token (K_max at the
# prior costs)
PRIOR_TRIES = 2.0  # ... with the weight of this many tried tokens
DECAY = 0.8  # per observed round: the counts' memory is ~1 / (1 - DECAY) = 5 rounds
LONG_DECAY = 0.97  # per observed round, the row's long-run counts: a memory of ~33 rounds
RECOVERY = 0.8  # per round at K = 0: the share of the gap to the long-run alpha that is left
FIRST_PROBE_INTERVAL = 8  # rounds at K = 0 before the first probe
HARD_STRETCH = 8  # rounds a row whose long run favours drafting drafts against its short estimate
MAX_PROBE_INTERVAL = 128
LONGER_K_MARGIN = 0.05  # a longer K is kept while its rate is within this share of the best
PROBE_BUDGET = 0.02  # probes' share of the decoding time at most, once a probe has been timed
COST_WINDOW = 15  # measurements a cost estimate is the median of
DRAFT_PRIOR = 0.25  # a draft step, in verifies, before it is measured (a draft ~1/4 the target)
COST_PROBE_GAP = 16  # rounds between two timing rounds of a K not yet timed (module doc)
TIMINGS = 3  # timings of a K at a batch size before it counts as timed (one may be an outlier)


def expected_tokens(k: int, alpha: float) -> float:
    """E(K, alpha): committed tokens of a round of ``k`` drafts, the bonus token included."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def k_choices(k_max: int) -> tuple[int, ...]:
    """The K a round may run: 0, ceil(K_max / 2) and K_max (module doc), ascending."""
    return tuple(sorted({0, (k_max + 1) // 2, k_max}))


def best_k(alpha: float, costs: Sequence[float], least: int = 0,
           choices: Sequence[int] | None = None, margin: float = LONGER_K_MARGIN) -> int:
    """The K in ``choices`` (default: 0 .. len(costs) - 1) from ``least`` up with the best rate
    E(K, alpha) / costs[K]; when that K drafts, the longest K whose rate is within ``margin`` of
    it (acceptance comes in runs, so the geometric E undervalues a longer K a little, and a K that
    follows every wobble of alpha costs more than the few percent it would gain). K = 0 is taken
    only on its own merit: plain decoding must never lose to a speculation by the margin."""
    ks = [k for k in (range(len(costs)) if choices is None else choices) if k >= least]
    rates = {k: expected_tokens(k, alpha) / costs[k] for k in ks}
    best = max(ks, key=lambda k: (rates[k], k))
    if best == 0:
        return 0
    return max(k for k in ks if k > 0 and rates[k] >= (1.0 - margin) * rates[best])


class _Timings:
    """The running medians of one batch size: a draft step, and the rest of a round per K."""

    def __init__(self, k_max: int, window: int):
        self._draft: deque[float] = deque(maxlen=window)  # seconds per draft step
        self._rest = [deque(maxlen=window) for _ in range(k_max + 1)]  # seconds, per K
        # their medians, each recomputed when its window changes (a few µs, once a round)
        self.draft: float | None = None
        self.rest: list[float | None] = [None] * (k_max + 1)

    def add_draft(self, seconds: float) -> None:
        self._draft.append(seconds)
        self.draft = median(self._draft)

    def add_rest(self, k: int, seconds: float) -> None:
        self._rest[k].append(seconds)
        self.rest[k] = median(self._rest[k])

    def count(self, k: int) -> int:
        return len(self._rest[k])

    @property
    def measured(self) -> bool:
        return any(r is not None for r in self.rest)


class StepCosts:
    """Running estimates of a round's cost at each K (seconds once measured), per batch size.

    ``observe_draft(seconds, steps, rows)``: a proposal of ``steps`` tokens for ``rows`` rows
    took ``seconds``; ``observe_round(k, seconds, rows)``: the rest of a round of ``rows`` rows
    that verified ``k`` drafts (the verify forward, acceptance, commit; for k = 0 an AR step).
    :meth:`at_rows` sets the batch size the next choices are for (a round's cost grows with its
    rows where the device is busy: a CPU, a large batch; a median over rounds of other sizes
    would judge a K by the rows its last rounds happened to have). :meth:`table` gives cost(K)
    for every K: K * draft + rest(K), from that batch size's timings, else the nearest timed
    batch size's. A K not measured yet takes the nearest measured one's rest; a draft not
    measured ``draft_prior`` times the mean rest. Before any measurement, and with
    ``measured=False``, the priors: rest = 1, draft = ``draft_prior``."""

    def __init__(self, k_max: int, draft_prior: float = DRAFT_PRIOR, window: int = COST_WINDOW):
        if k_max < 0 or draft_prior < 0 or window < 1:
            raise ValueError("StepCosts: k_max >= 0, draft_prior >= 0 and window >= 1 needed")
        self.k_max = k_max
        self.draft_prior = draft_prior
        self.window = window
        self.rows = 1  # the batch size of the next choices (:meth:`at_rows`)
        self._by_rows: dict[int, _Timings] = {}
        self._cache: dict[int, list[float]] = {}  # measured tables by batch size, until a sample
        self._prior = [1.0 + k * draft_prior for k in range(k_max + 1)]
        self._probe: deque[float] = deque(maxlen=window)  # a probe round's extra seconds
        self.probe_extra: float | None = None  # their median (None: no probe timed yet)

    def at_rows(self, rows: int) -> None:
        """The next choices are for rounds of ``rows`` rows."""
        self.rows = max(1, int(rows))

    def _timings(self, rows: int | None) -> _Timings:
        rows = self.rows if rows is None else max(1, int(rows))
        t = self._by_rows.get(rows)
        if t is None:
            t = self._by_rows[rows] = _Timings(self.k_max, self.window)
        return t

    def _nearest(self, usable) -> _Timings | None:
        """The timings of the batch size nearest this one (itself first; ties: the larger)
        among those ``usable(timings)`` accepts, else None."""
        sizes = [r for r, t in self._by_rows.items() if usable(t)]
        if not sizes:
            return None
        return self._by_rows[min(sizes, key=lambda r: (abs(r - self.rows), -r))]

    def _here(self) -> _Timings | None:
        """This batch size's timings, else the nearest timed batch size's, else None."""
        return self._nearest(lambda t: t.measured)

    @property
    def draft(self) -> float | None:
        """Seconds a draft step at this batch size (None: not measured): the nearest timed
        batch size's, else the nearest one's with a draft step timed."""
        here = self._here()
        if here is not None and here.draft is not None:
            return here.draft
        timed = self._nearest(lambda t: t.draft is not None)
        return None if timed is None else timed.draft

    @property
    def rest(self) -> list[float | None]:
        """Seconds of the rest of a round per K at this batch size (or the nearest timed)."""
        here = self._here()
        return list(here.rest) if here is not None else [None] * (self.k_max + 1)

    def timed(self, k: int, times: int = TIMINGS) -> bool:
        """Whether rounds of this very batch size have timed K = ``k`` ``times`` times."""
        t = self._by_rows.get(self.rows)
        return t is not None and t.count(k) >= times

    def observe_draft(self, seconds: float, steps: int, rows: int | None = None) -> None:
        if steps > 0 and seconds >= 0:
            self._timings(rows).add_draft(seconds / steps)
            self._cache.clear()

    def observe_round(self, k: int, seconds: float, rows: int | None = None) -> None:
        if 0 <= k <= self.k_max and seconds > 0:
            self._timings(rows).add_rest(k, seconds)
            self._cache.clear()

    def observe_probe(self, seconds: float) -> None:
        """A round in which a row probed took ``seconds`` (every phase, catch-up included)."""
        ar = self.rest[0]
        if ar is not None and seconds > 0:
            self._probe.append(max(0.0, seconds - ar))
            self.probe_extra = median(self._probe)

    def probe_gap(self, budget: float = PROBE_BUDGET) -> int:
        """Rounds at K = 0 between probes so that probes take at most ``budget`` of the time
        (0 until a probe and an AR round are timed)."""
        ar = self.rest[0]
        if self.probe_extra is None or not ar:
            return 0
        return math.ceil(self.probe_extra / (budget * ar))

    @property
    def measured(self) -> bool:
        return any(t.measured for t in self._by_rows.values())

    def table(self, measured: bool = True) -> list[float]:
        """cost(K) for K = 0 .. k_max at this batch size (prior units without measurements or
        with ``measured=False``)."""
        if not measured or not self.measured:
            return self._prior
        table = self._cache.get(self.rows)
        if table is None:
            table = self._cache[self.rows] = self._measured_table()
        return table

    def _measured_table(self) -> list[float]:
        rest = self.rest  # this batch size's (or the nearest timed one's), a copy
        known = [(k, r) for k, r in enumerate(rest) if r is not None]
        rest = [r if r is not None else min(known, key=lambda kr: abs(kr[0] - k))[1]
                for k, r in enumerate(rest)]
        # a verify of more positions never costs less than one of fewer: each K's rest is at
        # most every longer K's (so a K whose few timings ran slow, e.g. beside a first call's
        # work, is not judged dearer than a longer one, and thereby never run and retimed)
        for k in range(self.k_max - 1, -1, -1):
            rest[k] = min(rest[k], rest[k + 1])
        draft = self.draft
        if draft is None:
            draft = self.draft_prior * sum(r for _, r in known) / len(known)
        return [k * draft + rest[k] for k in range(self.k_max + 1)]

    def snapshot(self) -> dict:
        """The estimates in ms, for the run's metrics: at the last batch size chosen for, a
        draft step and the rest per K; and the rest per K of every batch size timed."""
        draft = self.draft
        return {"draft_step_ms": None if draft is None else 1e3 * draft,
                "round_ms_by_k": {str(k): 1e3 * r for k, r in enumerate(self.rest)
                                  if r is not None},
                "round_ms_by_rows": {str(rows): {str(k): 1e3 * r for k, r in enumerate(t.rest)
                                                 if r is not None}
                                     for rows, t in sorted(self._by_rows.items())
                                     if t.measured},
                "probe_extra_ms": None if self.probe_extra is None else 1e3 * self.probe_extra}


@dataclass
class RowState:
    """One sequence's acceptance estimate and probe schedule."""

    accepted: float = PRIOR_ALPHA * PRIOR_TRIES  # decayed counts
    tried: float = PRIOR_TRIES
    long_accepted: float = PRIOR_ALPHA * PRIOR_TRIES  # the same, with the long memory
    long_tried: float = PRIOR_TRIES
    zeros: int = 0  # rounds in a row it chose K = 0
    stretch: int = 0  # rounds drafted against its short estimate since a token was accepted
    interval: int = FIRST_PROBE_INTERVAL
    probing: bool = False  # its current round is a probe

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else PRIOR_ALPHA

    @property
    def probe_failed(self) -> bool:
        """Its last probe failed (a failure doubles the interval, a success resets it): the next
        probe also waits for the probe budget."""
        return self.interval > FIRST_PROBE_INTERVAL

    @property
    def long_alpha(self) -> float:
        return self.long_accepted / self.long_tried if self.long_tried > 0 else PRIOR_ALPHA

    def recover(self) -> None:
        """A round at K = 0: the short estimate moves toward the long-run one (module doc)."""
        if self.tried > 0:
            long = self.long_alpha
            self.accepted = self.tried * (long + RECOVERY * (self.alpha - long))


# kinds of batch, (any greedy row, any sampled row): each samples through steps of its own
BATCH_KINDS = ((True, False), (False, True), (True, True))


@dataclass
class _Sweep:
    """The K values still to run once each, per kind of batch (:data:`BATCH_KINDS`)."""

    todo: dict[tuple[bool, bool], list[int]] = field(default_factory=dict)

    def next(self, kind: tuple[bool, bool]) -> int | None:
        values = self.todo.get(kind)
        return values.pop(0) if values else None


class AdaptiveK:
    """The speculation length of every row, each round (module doc for the rule).

    ``admit(key)`` when a sequence takes a slot, ``choose(keys, sampled)`` before a round -> each
    row's limit K_i (the round runs max K_i drafts; row i accepts at most K_i of them), and
    ``observe(keys, limits, accepted)`` after it. ``enabled=False``: always K_max.
    ``schedule`` (for tests of the per-row limits: ``SSDLIB_K_SCHEDULE``): no rule, the n-th
    call gives row ``key`` the value ``schedule[(key + n) % len(schedule)]``."""

    def __init__(self, k_max: int, costs: StepCosts | None = None, enabled: bool = True,
                 sweep: bool = False, schedule: Sequence[int] = ()):
        if k_max < 1:
            raise ValueError(f"AdaptiveK: k_max must be >= 1, got {k_max}")
        if any(not 0 <= k <= k_max for k in schedule):
            raise ValueError(f"AdaptiveK: a schedule's values must be in [0, {k_max}], "
                             f"got {list(schedule)}")
        self.schedule = list(schedule)
        self._calls = 0
        self.sweeping = False  # the last choice was a sweep's (its round captures: not timed)
        self.probed = False  # a row of the last choice probes (the loop times its round)
        self.timing = False  # the last choice is a timing round of an untimed K (module doc)
        self._since_timing = 0  # choices since the last timing round
        self.k_max = k_max
        self.costs = costs if costs is not None else StepCosts(k_max)
        self.enabled = enabled
        self.rows: dict[int, RowState] = {}
        self.choices = k_choices(k_max)
        order = sorted(self.choices, reverse=True) + [0]
        self._sweep = _Sweep({kind: list(order) for kind in BATCH_KINDS}
                             if enabled and sweep else {})
        # choose_ahead's choices for the next choose: key -> (sampled, K before the lift, probe)
        self._ahead: dict[int, tuple[bool, int, bool]] = {}

    def admit(self, key: int) -> None:
        """A sequence takes slot ``key``: it starts from the prior."""
        self.rows[key] = RowState()
        self._ahead.pop(key, None)

    def release(self, key: int) -> None:
        self.rows.pop(key, None)
        self._ahead.pop(key, None)

    def alpha(self, key: int) -> float:
        return self._row(key).alpha

    def _row(self, key: int) -> RowState:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = RowState()
        return row

    def choose(self, keys: Sequence[int], sampled: Sequence[bool]) -> list[int]:
        """Each row's K for the next round: keys [b] (e.g. KV slots), sampled [b] (whether the row
        samples: it then decides on the cost priors)."""
        if self.schedule:
            n, self._calls = len(self.schedule), self._calls + 1
            return [self.schedule[(key + self._calls) % n] for key in keys]
        if not self.enabled:
            return [self.k_max] * len(keys)
        ahead, self._ahead = self._ahead, {}
        self.costs.at_rows(len(keys))
        forced = self._sweep.next((not all(sampled), any(sampled))) if keys else None
        self.sweeping = forced is not None
        self.probed = False
        if forced is not None:
            return [forced] * len(keys)
        measured, prior = self.costs.table(), self.costs.table(measured=False)
        out = []
        for key, s in zip(keys, sampled):
            early = ahead.get(key)
            if early is not None and early[0] == s:
                k, probe = early[1:]
            else:
                k, probe = self._choose_row(key, s, prior if s else measured)
            self.probed |= probe
            out.append(k)
        return self._timing_round(self._lift(keys, sampled, out), sampled)

    def _timing_round(self, chosen: list[int], sampled: Sequence[bool]) -> list[int]:
        """``chosen``, or every COST_PROBE_GAP rounds of greedy rows, while a choice >= 1 below
        the round's longest K has no timing, the round at the longest such choice (module doc,
        Timing rounds)."""
        self._since_timing += 1
        self.timing = False
        if not chosen or any(sampled) or not self.costs.measured or \
                self._since_timing < COST_PROBE_GAP:
            return chosen
        longest = max(chosen)
        untimed = [k for k in self.choices if 0 < k < longest and not self.costs.timed(k)]
        if not untimed:
            return chosen
        self._since_timing = 0
        self.timing = True
        k = max(untimed)
        return [min(c, k) for c in chosen]

    def choose_ahead(self, keys: Sequence[int], sampled: Sequence[bool]) -> None:
        """The next round's choices for ``keys``, made now (module doc, Ahead of time): call
        it only once the current round's :meth:`observe` can teach the policy nothing (every
        limit 0), e.g. while a round at K = 0 runs. The next :meth:`choose` takes them."""
        if self.schedule or not self.enabled or not keys or \
                self._sweep.todo.get((not all(sampled), any(sampled))):
            return
        self.costs.at_rows(len(keys))
        measured, prior = self.costs.table(), self.costs.table(measured=False)
        self._ahead = {key: (s, *self._choose_row(key, s, prior if s else measured))
                       for key, s in zip(keys, sampled)}

    def _choose_row(self, key: int, sampled: bool, costs: list[float]) -> tuple[int, bool]:
        """One row's K before the lift, and whether it is a probe (its state moves on)."""
        row = self._row(key)
        k = best_k(row.alpha, costs, choices=self.choices)
        if k == 0 and row.stretch < HARD_STRETCH and \
                best_k(row.long_alpha, costs, choices=self.choices) > 0:
            # a hard stretch of a draft that does well in the long run: a shorter speculation
            row.stretch += 1
            k = best_k(row.alpha, costs, least=1, choices=self.choices)
        probe = False
        if k == 0:
            row.zeros += 1
            gap = max(row.interval, self.costs.probe_gap()) if row.probe_failed \
                else row.interval
            if row.zeros > gap:  # a probe
                k = best_k(row.alpha, costs, least=1, choices=self.choices)
                row.probing = probe = True
        if k > 0:
            row.zeros = 0
        else:  # a round that learns nothing: toward the long run for the next one
            row.recover()
        return k, probe

    def _lift(self, keys: Sequence[int], sampled: Sequence[bool], chosen: list[int]) -> list[int]:
        """Each greedy row's K raised to the round's longest (module doc, Batches)."""
        longest = max(chosen, default=0)
        out = []
        for key, s, k in zip(keys, sampled, chosen):
            if not s and k < longest:
                self._row(key).zeros = 0
                k = longest
            out.append(k)
        return out

    def observe(self, keys: Sequence[int], limits: Sequence[int], accepted: Sequence[int],
                sampled: Sequence[bool]) -> None:
        """A round verified ``limits[i]`` drafts of row ``keys[i]`` and accepted ``accepted[i]``
        of them (rows at K = 0 learn nothing)."""
        for key, k, a, s in zip(keys, limits, accepted, sampled):
            if k <= 0:
                continue
            row = self._row(key)
            tries = a + (1 if a < k else 0)
            row.accepted = DECAY * row.accepted + a
            row.tried = DECAY * row.tried + tries
            row.long_accepted = LONG_DECAY * row.long_accepted + a
            row.long_tried = LONG_DECAY * row.long_tried + tries
            if a > 0:
                row.stretch = 0
            if row.probing:
                row.probing = False
                costs = self.costs.table(measured=not s)
                failed = best_k(row.alpha, costs) == 0
                row.interval = (min(max(2 * row.interval, self.costs.probe_gap()),
                                    MAX_PROBE_INTERVAL) if failed else FIRST_PROBE_INTERVAL)


def k_schedule(k_max: int) -> list[int]:
    """``SSDLIB_K_SCHEDULE`` (tests: each row's K fixed by a schedule, :class:`AdaptiveK`) as a
    list of K values, [] when unset."""
    raw = env.text("SSDLIB_K_SCHEDULE")
    if raw is None:
        return []
    try:
        values = [int(x) for x in raw.split(",")]
    except ValueError:
        values = []
    if not values or any(not 0 <= k <= k_max for k in values):
        raise ConfigError(f"SSDLIB_K_SCHEDULE={raw!r}: expected comma-separated integers in "
                          f"[0, {k_max}] (--k)")
    return values
