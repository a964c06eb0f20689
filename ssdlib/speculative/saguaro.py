"""Saguaro sampling sigma_{F,C} (SSD paper Sec. 4.2, Thm 15).

After a rejection at position i the bonus token comes from the residual max(p_i - q_i, 0). The
speculator caches its guesses for that bonus among the draft's top-F tokens, so it wants the
residual's mass there: drawing the speculation from a q that puts *less* mass on the top-F tokens
does exactly that. sigma_{F,C} multiplies the top-F draft probabilities by C in (0, 1] and
renormalises; C = 1 is plain sampling. Lower C raises the cache hit rate and lowers acceptance.

Exactness: the verifier must receive this q (the one the token was drawn from), not the draft's
unscaled probabilities. Which of several tied tokens counts as top-F is torch.topk's choice; that
only affects hit rate, never exactness, because q itself is sent.
"""

from __future__ import annotations

import math

import torch

from ssdlib.errors import ConfigError, require_int
from ssdlib.speculative.rng import Generators, sample_token


def check_saguaro_c(c: float) -> float:
    """Validate C in (0, 1]."""
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) \
            or not 0.0 < c <= 1.0:
        raise ConfigError(f"saguaro_c must be in (0, 1], got {c!r}")
    return float(c)


def saguaro_q(draft_probs: torch.Tensor, fan_out: int | torch.Tensor, c: float) -> torch.Tensor:
    """sigma_{F,C}: draft_probs [..., V] -> q [..., V], the top-F probabilities scaled by C and
    renormalised.

    fan_out: an int F >= 0 for every row, or an int64 tensor of shape [...] (one F per row, e.g.
    the fan-out F_k of the position being drafted). F = 0 or F >= V leaves a row unchanged, and so
    does C = 1 (the input itself is returned).
    """
    c = check_saguaro_c(c)
    vocab = draft_probs.shape[-1]
    if isinstance(fan_out, torch.Tensor):
        if fan_out.shape != draft_probs.shape[:-1]:
            raise ConfigError(f"fan_out tensor must have shape {tuple(draft_probs.shape[:-1])}, "
                              f"got {tuple(fan_out.shape)}")
        if fan_out.numel() and int(fan_out.min()) < 0:
            raise ConfigError("fan_out must be >= 0")
        f_max = min(int(fan_out.max()), vocab) if fan_out.numel() else 0
    else:
        require_int("fan_out", fan_out, 0)
        f_max = min(fan_out, vocab)
    if c == 1.0 or f_max == 0:
        return draft_probs
    top = draft_probs.topk(f_max, dim=-1).indices                         # [..., f_max]
    factor = torch.full(top.shape, c, dtype=draft_probs.dtype, device=draft_probs.device)
    if isinstance(fan_out, torch.Tensor):
        # rank j of a row is scaled only if j < that row's F
        in_top = torch.arange(f_max, device=top.device) < fan_out.to(top.device)[..., None]
        factor = torch.where(in_top, factor, torch.ones_like(factor))
    scale = torch.ones_like(draft_probs).scatter(-1, top, factor)        # [..., V]
    q = draft_probs * scale
    return q / q.sum(-1, keepdim=True)


def sample_saguaro(draft_probs: torch.Tensor, fan_out: int | torch.Tensor, c: float,
                   generators: Generators = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from sigma_{F,C}(draft_probs).

    draft_probs [..., V] -> (tokens [...] int64, q [..., V]); send q to the verifier with the token.
    """
    q = saguaro_q(draft_probs, fan_out, c)
    return sample_token(q, generators), q
