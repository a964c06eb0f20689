"""ops/capture_rules.py: what a CUDA graph capture refuses, seen on CPU in EagerPool's warm-up
runs (the captured-step path's stand-in for a capture), and what it allows."""

import pytest
import torch

from ssdlib.ops.capture_rules import CaptureRuleError, CaptureRules
from ssdlib.ops.graph_pool import EagerPool


def run(step) -> None:
    x = torch.zeros(4, 6, dtype=torch.long)
    rows = torch.tensor([0, 2])
    with CaptureRules("step"):
        step(x, rows)


@pytest.mark.parametrize("step,what", [
    (lambda x, rows: x.__setitem__((rows, slice(3, None)), -1), "index_put_"),  # e9bbce3's
    (lambda x, rows: x[rows].copy_(torch.tensor(5)), "copy_"),
    (lambda x, rows: torch.cat([x[0, :1], torch.tensor(7).view(1)]), "cat"),
    (lambda x, rows: x + torch.tensor([1, 2, 3, 4, 5, 6]), "6 elements"),
    (lambda x, rows: int(x.sum()), "reads a value back"),
    (lambda x, rows: bool((x > 0).any()), "reads a value back"),
])
def test_what_a_capture_refuses_is_refused(step, what):
    with pytest.raises(CaptureRuleError, match=what):
        run(step)


@pytest.mark.parametrize("step", [
    lambda x, rows: x.__setitem__((slice(None), slice(3, None)), -1),  # fill_: a kernel argument
    lambda x, rows: x.__setitem__(rows, torch.full((2, 6), -1)),       # a device tensor
    lambda x, rows: x.index_fill_(0, rows, -1),
    lambda x, rows: torch.where(x > 0, x, -1) * 2 + 1,
    lambda x, rows: x[rows].masked_fill_(x[rows] == 0, 3),
])
def test_what_a_capture_allows_passes(step):
    run(step)


def test_eager_pool_checks_its_warm_up_runs_and_names_the_step():
    x, rows = torch.zeros(4, 6, dtype=torch.long), torch.tensor([1])

    def bad():
        x[rows, 2:] = -1

    with pytest.raises(CaptureRuleError, match="'build'.*index_put_"):
        EagerPool(warmup=1).capture("build", bad)
    pool = EagerPool(warmup=0)  # no warm-up run: nothing checked, the step still runs
    pool.capture("build", bad)
    pool.replay("build")
    assert (x[1, 2:] == -1).all()
