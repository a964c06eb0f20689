"""Saguaro sampling sigma_{F,C}."""

import pytest
import torch

from ssdlib.errors import ConfigError
from ssdlib.speculative import sample_saguaro, saguaro_q

from .spec_stats import chi2_test


def random_probs(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=g, dtype=torch.float64) * 2, -1)


@pytest.mark.parametrize("F, c", [(1, 0.5), (3, 0.1), (5, 0.9), (12, 0.3)])
def test_top_f_scaled_by_c_relative_to_the_rest(F, c):
    p = random_probs(4, 12)
    q = saguaro_q(p, F, c)
    assert torch.allclose(q.sum(-1), torch.ones(4, dtype=torch.float64))
    top = p.topk(min(F, 12), -1).indices
    in_top = torch.zeros_like(p, dtype=torch.bool).scatter(-1, top, True)
    ratio = q / p                                                   # constant on each group
    for row in range(4):
        inside, outside = ratio[row][in_top[row]], ratio[row][~in_top[row]]
        assert torch.allclose(inside, inside[0].expand_as(inside))
        if outside.numel():
            assert torch.allclose(outside, outside[0].expand_as(outside))
            assert (inside[0] / outside[0]).item() == pytest.approx(c)
        else:                                                       # F >= V: nothing changes
            assert torch.allclose(q[row], p[row])


def test_c_one_and_f_zero_are_identity():
    p = random_probs(3, 7)
    assert saguaro_q(p, 4, 1.0) is p
    assert saguaro_q(p, 0, 0.2) is p


def test_per_row_fan_out_tensor():
    p = random_probs(3, 8)
    fan_out = torch.tensor([0, 2, 5])
    q = saguaro_q(p, fan_out, 0.4)
    for row, f in enumerate(fan_out.tolist()):
        assert torch.allclose(q[row], saguaro_q(p[row:row + 1], f, 0.4)[0])


@pytest.mark.parametrize("c", [0.0, -0.5, 1.5, float("nan"), True, "0.5"])
def test_bad_c(c):
    with pytest.raises(ConfigError):
        saguaro_q(random_probs(2, 5), 2, c)


@pytest.mark.parametrize("F", [-1, 1.5, True])
def test_bad_fan_out(F):
    with pytest.raises(ConfigError):
        saguaro_q(random_probs(2, 5), F, 0.5)


def test_theorem_19_example():
    p = torch.tensor([0.48, 0.48, 0.02, 0.02], dtype=torch.float64)
    q = torch.tensor([0.49, 0.49, 0.01, 0.01], dtype=torch.float64)
    q2 = saguaro_q(q, 2, 47 / 147)
    assert torch.allclose(q2, torch.tensor([0.47, 0.47, 0.03, 0.03], dtype=torch.float64))
    # acceptance sum_x min(p, q) stays 0.98 ...
    assert torch.minimum(p, q).sum().item() == pytest.approx(0.98)
    assert torch.minimum(p, q2).sum().item() == pytest.approx(0.98)
    # ... but the residual moves from the two tail tokens (never cached with F = 2) onto the top 2
    assert (p - q).clamp_min(0).nonzero().flatten().tolist() == [2, 3]
    assert (p - q2).clamp_min(0).nonzero().flatten().tolist() == [0, 1]


def test_sample_saguaro_draws_from_q():
    p = random_probs(12, seed=3)
    tokens, q = sample_saguaro(p.expand(50_000, 12), 3, 0.25, torch.Generator().manual_seed(0))
    assert torch.allclose(q[0], saguaro_q(p, 3, 0.25))
    assert chi2_test(torch.bincount(tokens, minlength=12), q[0]) > 1e-3
    assert chi2_test(torch.bincount(tokens, minlength=12), p) < 1e-6
