"""The chi-square helper itself, against tabulated values."""

import math

import pytest
import torch

from .spec_stats import chi2_sf, chi2_test


@pytest.mark.parametrize("x, df, expected", [
    (3.841458820694124, 1, 0.05),
    (6.634896601021214, 1, 0.01),
    (2.0, 2, math.exp(-1.0)),          # df = 2: sf(x) = exp(-x/2) exactly
    (18.307038053275146, 10, 0.05),
    (23.209251158954356, 10, 0.01),
    (124.34211340400407, 100, 0.05),
    (10.0, 10, 0.44049328506521257),
])
def test_chi2_sf_known_values(x, df, expected):
    assert chi2_sf(x, df) == pytest.approx(expected, rel=1e-6)


def test_chi2_sf_matches_wilson_hilferty_for_large_df():
    # Wilson-Hilferty: (X/df)^(1/3) ~ Normal(1 - 2/(9 df), 2/(9 df)); accurate to ~1e-3 at df = 200.
    df, x = 200, 230.0
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    wh = 0.5 * math.erfc(z / math.sqrt(2))
    assert chi2_sf(x, df) == pytest.approx(wh, abs=2e-3)


def test_chi2_test_accepts_right_and_rejects_wrong_counts():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    counts = torch.bincount(torch.multinomial(probs, 20000, replacement=True, generator=g),
                            minlength=4)
    assert chi2_test(counts, probs) > 1e-3
    assert chi2_test(counts, torch.tensor([0.45, 0.35, 0.15, 0.05])) < 1e-6
    assert chi2_test(torch.tensor([10, 0, 0, 1]), torch.tensor([1.0, 0.0, 0.0, 0.0])) == 0.0
