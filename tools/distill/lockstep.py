"""Several drafts trained on the same batches, one teacher forward per batch.

The teacher's forward is the part of a distillation step that drafts trained on the same
batches can share: trained side by side in separate processes each pays for it; trained here,
in lockstep, they share it. ``tools/distill_draft.py`` trains one draft through this loop.
On one H200 (SmolLM2-135M, batch 32 x 512) the teacher is roughly 15 ms of a step and each
draft's own vocabulary-wide loss and backward ~50 ms.
Each draft still has its own optimiser, schedule, evaluations and checkpoints (its
:class:`~tools.distill.train.Trainer`), and sees exactly the batches, in the same order, that it
would see trained alone with the same data, batch, sequence length and seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tools.distill.budget import StepBudget
from tools.distill.train import Trainer


@dataclass
class Hooks:
    """One draft's callbacks. ``on_step(step, loss, tokens_per_s)`` after each step (loss and
    rate are None on steps where they are not read, to keep the GPU busy), ``on_eval(result)``
    after each evaluation, ``on_save()`` after each checkpoint (e.g. the export)."""
    on_step: Callable[[int, float | None, float | None], None] | None = None
    on_eval: Callable[[dict], None] | None = None
    on_save: Callable[[], None] | None = None


def check_lockstep(trainers: list[Trainer]) -> None:
    """Raise ValueError unless the trainers can run in lockstep: one batcher and one teacher
    object shared by all, one device, and all at the same step (a resumed set must resume
    together)."""
    if not trainers:
        raise ValueError("no drafts to train")
    first = trainers[0]
    if any(t.batcher is not first.batcher for t in trainers):
        raise ValueError("drafts trained in lockstep must share one Batcher")
    if any(t.teacher is not first.teacher for t in trainers):
        raise ValueError("drafts trained in lockstep must share one teacher")
    if any(t.device != first.device for t in trainers):
        raise ValueError("drafts trained in lockstep must be on one device")
    steps = {t.step for t in trainers}
    if len(steps) > 1:
        raise ValueError(f"drafts trained in lockstep must be at the same step, got "
                         f"{sorted(steps)} (resume them together, from checkpoints of one run)")


def run_lockstep(trainers: list[Trainer], hooks: list[Hooks] | None = None,
                 budget: StepBudget | None = None) -> None:
    """Train every trainer until its own ``steps``: each batch is drawn once, the teacher's
    logits for it computed once, and every unfinished draft takes its step on them. A draft
    with fewer steps drops out; the others go on. One trainer alone trains exactly as it
    would in this loop with others. ``budget`` may lower the trainers' ``steps`` once, early,
    so that the run ends in time (tools/distill/budget.py)."""
    check_lockstep(trainers)
    hooks = hooks or [Hooks() for _ in trainers]
    first = trainers[0]
    for t, h in zip(trainers, hooks):
        t.begin(h.on_eval)
    while not all(t.done for t in trainers):
        if budget is not None:
            budget.before_step(trainers)
        ids = first.batcher.next().to(first.device, non_blocking=True)
        with torch.no_grad():
            t_logits = first.teacher.forward_full(ids)
        for t, h in zip(trainers, hooks):
            if not t.done:
                t.after_step(t.train_on(ids, t_logits), h.on_step, h.on_eval, h.on_save)
