"""Goodness-of-fit helpers for the statistical tests (scipy is not a dependency)."""

from __future__ import annotations

import torch


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution: Q(df/2, x/2)."""
    x_t = torch.tensor(x / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), x_t))


def chi2_test(observed: torch.Tensor, expected_probs: torch.Tensor,
              min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of counts against exact cell probabilities (any shape).

    Cells whose expected count is below ``min_expected`` are pooled into one cell. A count in a
    cell of probability 0 gives p = 0: an impossible outcome was produced.
    """
    obs = observed.reshape(-1).double()
    probs = expected_probs.reshape(-1).double()
    probs = probs / probs.sum()
    if bool((obs[probs == 0] > 0).any()):
        return 0.0
    exp = probs * obs.sum()
    big = exp >= min_expected
    cells_o, cells_e = list(obs[big]), list(exp[big])
    small_e = exp[~big & (probs > 0)].sum()
    if small_e > 0:
        cells_o.append(obs[~big].sum())
        cells_e.append(small_e)
    o, e = torch.stack(cells_o), torch.stack(cells_e)
    if o.numel() < 2:
        return 1.0
    stat = float(((o - e) ** 2 / e).sum())
    return chi2_sf(stat, o.numel() - 1)
