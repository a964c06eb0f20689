"""tools/distill/budget.py: a run's time budget cuts its step count once, early, to what fits,
counting the evaluations and checkpoints due on the way; a budget that fits changes nothing."""

import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.tiny import make_tiny_llama
from tools.distill.budget import StepBudget, _due, fit_steps
from tools.distill.lockstep import Hooks, run_lockstep
from tools.distill.train import lr_at
from tools.distill_draft import build_candidate, load_shared, main, resolve_args

DRAFT = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn", "64"]


def test_due_counts_the_multiples_and_the_last_step():
    assert _due(20, 2200, 250) == 9  # 250 .. 2000, and 2200 itself
    assert _due(20, 2000, 250) == 8  # 2000 is a multiple: counted once
    assert _due(250, 251, 250) == 1  # only the last step
    assert _due(0, 10, 0) == 1  # no periodic ones: the last step alone


def test_fit_steps():
    # 1 s a step, nothing else: 100 s from step 10 fit 100 more steps
    assert fit_steps(10, 1000, 1.0, [], 100.0) == 110
    # everything fits: the target
    assert fit_steps(10, 50, 1.0, [], 100.0) == 50
    # an evaluation every 10 steps at 5 s: from 10, N = 80 costs 70 + 7 * 5 = 105 > 100,
    # N = 76 costs 66 + 7 * 5 = 101 (70 and the last), N = 75 costs 65 + 7 * 5 = 100
    assert fit_steps(10, 1000, 1.0, [(10, 5.0)], 100.0) == 75
    # two drafts' rounds add up (checkpoints every 20 at 2 s each)
    n = fit_steps(10, 1000, 1.0, [(10, 5.0), (20, 2.0)], 100.0)
    assert (n - 10) + _due(10, n, 10) * 5 + _due(10, n, 20) * 2 <= 100
    n1 = n + 1
    assert (n1 - 10) + _due(10, n1, 10) * 5 + _due(10, n1, 20) * 2 > 100
    # nothing fits: one more step anyway (the run ends on a step that exports)
    assert fit_steps(10, 1000, 1.0, [], -5.0) == 11


class FakeTrainer:
    def __init__(self, steps, eval_every=0, save_every=0):
        self.step = 0
        self.s = SimpleNamespace(steps=steps, eval_every=eval_every, save_every=save_every)
        self.eval_seconds = self.save_seconds = 0.0
        self.last_eval_seconds = self.last_save_seconds = 0.0

    @property
    def done(self):
        return self.step >= self.s.steps


def test_step_budget_times_the_steps_without_evaluations_and_cuts_once():
    now = [0.0]
    reports = []
    budget = StepBudget(100.0, calibrate=4, skip=0, reserve=0.0, clock=lambda: now[0],
                        on_decide=reports.append)
    a, b = FakeTrainer(1000, eval_every=10), FakeTrainer(800, eval_every=10)
    a.last_eval_seconds = b.last_eval_seconds = 1.5  # their step-0 evaluations
    for step in range(6):
        a.step = b.step = step
        budget.before_step([a, b])
        now[0] += 2.0  # a step of the pair
        if step == 2:  # an evaluation inside the timed steps: 3 s, not a step's time
            now[0] += 3.0
            a.eval_seconds += 3.0
    assert budget.decided and len(reports) == 1
    r = budget.report
    # marked at step 0 (t = 0), decided at step 4 (t = 11): (11 - 3) / 4 = 2 s a step
    assert r["decided_at_step"] == 4 and r["seconds_per_step"] == 2.0
    assert r["seconds_left"] == 100.0 - 11.0
    # the fit: 89 s from step 4 at 2 s a step, 1.5 s per draft per evaluation round (every 10)
    want = fit_steps(4, 1000, 2.0, [(10, 1.5), (10, 1.5), (0, 0.0), (0, 0.0)], 89.0)
    assert r["steps"] == want and a.s.steps == want and b.s.steps == want
    assert r["steps_before"] == 1000 and want < 800
    a.s.steps = 999  # decided once: later calls change nothing
    budget.before_step([a, b])
    assert a.s.steps == 999 and len(reports) == 1


def test_step_budget_refuses_nonsense():
    with pytest.raises(ValueError, match="positive"):
        StepBudget(0)
    with pytest.raises(ValueError, match="calibrate"):
        StepBudget(10, calibrate=0)
    with pytest.raises(ValueError, match="skip"):
        StepBudget(10, skip=-1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    target = make_tiny_llama(str(root / "target"), "gqa", scale=2.0)
    main(["--target", target, "--out", str(root / "data_run"), "--device", "cpu",
          "--seq-len", "48", "--batch", "8", "--eval-samples", "16", "--eval-batch", "16",
          *DRAFT, "--data", "random-target-samples", "--random-samples", "64",
          "--random-len", "48", "--steps", "0"])
    data = str(root / "data_run.work" / "data.safetensors")
    common = ["--target", target, "--data-from", data, "--device", "cpu", "--seq-len", "48",
              "--batch", "8", "--eval-batch", "16", "--lr", "1e-2", *DRAFT]
    return common


def test_a_budget_that_fits_changes_nothing(setup, tmp_path):
    common = [*setup, "--steps", "24", "--eval-every", "8", "--save-every", "8"]
    plain = main([*common, "--out", str(tmp_path / "plain")])
    budgeted = main([*common, "--out", str(tmp_path / "budgeted"), "--train-budget", "3600"])
    assert plain["train_budget"] is None
    r = budgeted["train_budget"]
    assert r["decided_at_step"] == 23 and r["steps"] == r["steps_before"] == 24  # 3 + 20
    assert budgeted["step"] == 24
    w1 = load_file(os.path.join(tmp_path / "plain", "model.safetensors"))
    w2 = load_file(os.path.join(tmp_path / "budgeted", "model.safetensors"))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert plain["history"][-1]["kl"] == budgeted["history"][-1]["kl"]


def test_a_tight_budget_ends_the_schedule_early_and_exports_there(setup, tmp_path):
    """A clock that advances 1 s a step: a 60 s budget cuts a 1000-step run to about 50
    steps; the run ends there, evaluated and exported, with its learning rate at the end of
    its (now shorter) cosine schedule."""
    out = str(tmp_path / "cut")
    args = resolve_args([*setup, "--steps", "1000", "--eval-every", "10", "--save-every", "10",
                         "--out", out, "--min-lr-ratio", "0.1", "--warmup", "2"])
    shared = load_shared(args, say=lambda _: None)
    cand = build_candidate(args, shared, say=lambda _: None)
    t = cand.trainer
    ticks = [0.0]

    def clock():  # 1 s per step: called once before each step
        ticks[0] += 1.0
        return ticks[0]

    budget = StepBudget(60.0, calibrate=5, reserve=0.0, clock=clock)
    lrs = []
    run_lockstep([t], [Hooks(on_step=lambda *_: lrs.append(t.opt.param_groups[0]["lr"]),
                             on_save=cand.export)], budget)
    r = budget.report
    assert r["decided_at_step"] == 8 and 0.9 < r["seconds_per_step"] <= 1.0  # 3 skipped + 5
    assert 30 <= r["steps"] < 60 and r["steps_before"] == 1000
    assert t.step == t.s.steps == r["steps"]
    assert t.history[-1]["step"] == r["steps"]  # evaluated at its last step
    assert os.path.exists(os.path.join(out, "model.safetensors"))  # and exported
    # the last step's learning rate is the schedule's end (min_lr_ratio * lr), not mid-way
    assert lrs[-1] == pytest.approx(lr_at(t.s.steps - 1, t.s))
    assert lrs[-1] < 0.15 * args.lr


def test_the_first_steps_are_not_timed():
    """A slow first step (a GPU's warm-up) is skipped: the steps are timed after it."""
    now = [0.0]
    budget = StepBudget(1000.0, calibrate=4, skip=1, reserve=0.0, clock=lambda: now[0])
    t = FakeTrainer(10_000)
    for step in range(6):
        t.step = step
        budget.before_step([t])
        now[0] += 50.0 if step == 0 else 1.0
    assert budget.report["decided_at_step"] == 5 and budget.report["seconds_per_step"] == 1.0


def test_a_resumed_run_takes_its_own_budget(setup, tmp_path):
    """The time limit belongs to an invocation: --resume neither inherits the first run's
    budget nor refuses a new one."""
    common = [*setup, "--eval-every", "3", "--save-every", "3", "--out", str(tmp_path / "r")]
    first = main([*common, "--steps", "3", "--train-budget", "3600"])
    assert first["step"] == 3
    # long enough to decide (3 skipped + 20 timed after step 3) had it kept the budget
    resumed = main([*common, "--steps", "30", "--resume"])
    assert resumed["step"] == 30 and resumed["train_budget"] is None
    again = main([*common, "--steps", "60", "--resume", "--train-budget", "1800"])
    assert again["step"] == 60
    assert again["train_budget"]["seconds"] == 1800 and again["train_budget"]["steps"] == 60
