"""A training run's wall-clock budget: the step count cut once so that the run ends on time.

A run under a time limit that is killed at the limit loses what it trained since its last
checkpoint, and its learning-rate schedule never reaches its end (a four-draft run stopped at
step 2000 of 2200, two of the drafts at their step-1750 export). With a budget,
the run times its own first steps. Then, once, it lowers every draft's step count to what fits
in the budget: the remaining steps, the evaluations and checkpoints due on the way, and the
final evaluation and export. The cosine schedule reads the step count (``lr_at``), so it then
ends at the new last step. The cut comes early, during the warm-up when the run is long enough
to have one, so the learning rate does not jump.

The budget counts from ``start`` (by default when the budget is made, i.e. before the target
and the data are loaded), so it can be the process's own time limit less a margin. A run that
was cut has finished its schedule: continue it with ``--init-from`` (a fresh schedule), not
``--resume``.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def _due(first: int, last: int, every: int) -> int:
    """How many of the steps first+1 .. last trigger an evaluation (or a checkpoint): the
    multiples of ``every``, and ``last`` itself (the run's last step always does)."""
    n = (last // every - first // every) if every > 0 else 0
    return n + (1 if every <= 0 or last % every else 0)


def fit_steps(step: int, target: int, per_step: float, rounds: list[tuple[int, float]],
              seconds_left: float) -> int:
    """The largest step count N in step+1 .. target whose remaining work fits in
    ``seconds_left``: (N - step) steps of ``per_step`` seconds, plus, for each (every, cost) of
    ``rounds`` (a draft's evaluations, or its checkpoints), ``cost`` for each one due from
    step+1 to N. At least step+1: the run must end on a step, which evaluates and exports."""
    for n in range(target, step, -1):
        cost = (n - step) * per_step + sum(_due(step, n, every) * c for every, c in rounds)
        if cost <= seconds_left:
            return n
    return step + 1


class StepBudget:
    """Cuts the step count of drafts trained together (``run_lockstep``) to fit ``seconds``.

    ``before_step(trainers)`` is called before every step. It lets ``skip`` steps pass (the
    first steps on a GPU also pay for its warm-up), times the next ``calibrate`` steps (minus
    the time spent in evaluations and checkpoints meanwhile), and then decides once. A
    draft's evaluation and checkpoint cost what it last measured (``Trainer.last_eval_seconds``
    / ``last_save_seconds``): its step-0 evaluation, and nothing for checkpoints until its
    first. ``reserve`` (a fraction of ``seconds``) is kept for what is not timed: the first
    checkpoints, and the exit. (A resumed run has no step-0 evaluation, so until its first one
    its evaluations count as free: give it a larger ``reserve``.)
    """

    def __init__(self, seconds: float, start: float | None = None, calibrate: int = 20,
                 skip: int = 3, reserve: float = 0.05,
                 clock: Callable[[], float] = time.perf_counter,
                 on_decide: Callable[[dict], None] | None = None):
        if seconds <= 0:
            raise ValueError(f"a time budget must be positive, got {seconds}")
        if calibrate < 1 or skip < 0:
            raise ValueError(f"calibrate must be at least 1 step and skip at least 0, got "
                             f"{calibrate} and {skip}")
        self.seconds, self.calibrate, self.skip, self.reserve, self.clock, self.on_decide = (
            seconds, calibrate, skip, reserve, clock, on_decide)
        self.start = clock() if start is None else start
        self.report: dict | None = None  # what was measured and decided (for distill.json)
        self._first_step: int | None = None
        self._mark: tuple[float, int, float] | None = None

    @property
    def decided(self) -> bool:
        return self.report is not None

    def before_step(self, trainers) -> None:
        if self.decided:
            return
        live = [t for t in trainers if not t.done]
        if not live:
            return
        now, step = self.clock(), live[0].step
        busy = sum(t.eval_seconds + t.save_seconds for t in trainers)
        if self._first_step is None:
            self._first_step = step
        if self._mark is None:
            if step - self._first_step >= self.skip:
                self._mark = (now, step, busy)
            return
        t0, step0, busy0 = self._mark
        if step - step0 < self.calibrate:
            return
        per_step = max(0.0, (now - t0) - (busy - busy0)) / (step - step0)
        rounds = [(t.s.eval_every, t.last_eval_seconds) for t in live] + \
                 [(t.s.save_every, t.last_save_seconds) for t in live]
        left = self.seconds * (1 - self.reserve) - (now - self.start)
        target = max(t.s.steps for t in live)
        steps = fit_steps(step, target, per_step, rounds, left)
        for t in live:
            t.s.steps = min(t.s.steps, steps)
        self.report = {"seconds": self.seconds, "decided_at_step": step,
                       "seconds_per_step": round(per_step, 4),
                       "eval_seconds": round(sum(t.last_eval_seconds for t in live), 2),
                       "save_seconds": round(sum(t.last_save_seconds for t in live), 2),
                       "seconds_left": round(left, 1), "steps_before": target, "steps": steps}
        if self.on_decide:
            self.on_decide(self.report)
