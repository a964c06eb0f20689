"""Randomness for speculative decoding: one convention shared by every sampler in this package.

``generators`` is accepted in three forms:

* a sequence with one ``torch.Generator`` per row -- what the engine passes: each row draws from its
  own stream, so a row's tokens are reproducible from its seed and do not depend on which other rows
  share the batch (see :func:`ssdlib.sampling.row_generators`);
* a single ``torch.Generator`` for the whole batch -- vectorised; statistical tests draw 50k rows at
  once this way;
* ``None`` -- torch's global generator.

Every call draws a fixed number of uniforms per row (never a number that depends on the outcome),
and a categorical sample consumes exactly one uniform (inverse CDF), so the streams stay aligned
and a per-row call costs one small ``torch.rand`` per row.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

Generators = Union[torch.Generator, Sequence[torch.Generator], None]


def uniforms(generators: Generators, rows: int, n: int,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """``n`` uniforms in [0, 1) per row, float64: returns [rows, n] on ``device``."""
    if generators is None or isinstance(generators, torch.Generator):
        gen_device = generators.device if generators is not None else device
        u = torch.rand(rows, n, dtype=torch.float64, generator=generators, device=gen_device)
        return u.to(device)
    if len(generators) != rows:
        raise ValueError(f"got {len(generators)} generators for {rows} rows (need one per row)")
    if rows == 0:
        return torch.empty(0, n, dtype=torch.float64, device=device)
    u = [torch.rand(n, dtype=torch.float64, generator=g, device=g.device) for g in generators]
    return torch.stack(u).to(device)


def sample_categorical(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample: probs [n, V] (non-negative, each row with positive mass, need not be
    normalised), u [n] uniforms in [0, 1) -> token ids [n] int64.

    A zero-probability token is never returned: its CDF interval is empty (cumsum in float64).
    """
    cdf = probs.double().cumsum(-1)                                      # [n, V]
    target = (u.double() * cdf[:, -1])[:, None]                          # [n, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)        # [n]: first cdf > target
    vocab = probs.shape[-1]
    over = idx >= vocab
    if bool(over.any()):
        # u * total rounded up to total (float64 makes this all but impossible): take the last
        # token with positive mass.
        last_pos = vocab - 1 - (probs[over] > 0).flip(-1).int().argmax(-1)
        idx = idx.masked_scatter(over, last_pos)
    return idx


def sample_token(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """Draw one token per row from probs [..., V] -> [...] int64 (one uniform per row).

    With a list of generators it must hold one per row (the product of the leading dims).
    """
    flat = probs.reshape(-1, probs.shape[-1])                            # [n, V]
    u = uniforms(generators, flat.shape[0], 1, probs.device)[:, 0]       # [n]
    return sample_categorical(flat, u).reshape(probs.shape[:-1])
