"""Choosing tokens from logits under each row's SamplingParams, batched over rows.

A row is anything with ``params`` (:class:`~ssdlib.sampling.SamplingParams`) and ``stream`` (its
:class:`~ssdlib.speculative.rng.RowStream`): the leader's Sequence, the speculator's rows. The
rows' parameters and streams go to the device as [b] tensors in one copy each; everything after
that is batched device work with no host read (``sample_rows`` ends with the step's read-back).
Greedy rows always get exactly the argmax of their logits.
"""

from __future__ import annotations

import torch

from ssdlib.ops.row_top import row_argmax
from ssdlib.sampling import SamplingTensors, target_distributions
from ssdlib.speculative.rng import RowStreams, sample_categorical
from ssdlib.speculative.saguaro import saguaro_q


def sampling_tensors(rows, device: torch.device | str) -> SamplingTensors:
    """The rows' sampling parameters as [b] tensors on ``device``."""
    return SamplingTensors.from_params([r.params for r in rows], device)


def reserve_streams(rows, n: int, device: torch.device | str) -> RowStreams:
    """Reserve ``n`` draws of each row's stream for one call (the rng convention's fixed count)."""
    return RowStreams.reserve([r.stream for r in rows], n, device)


def row_distributions(logits: torch.Tensor, rows) -> torch.Tensor:
    """logits [b, ..., V] -> each row's exact AR distribution [b, ..., V] float32: one-hot on the
    argmax for greedy rows (so the sampled acceptance rule reduces to the greedy one),
    temperature / top-k / top-p otherwise."""
    return target_distributions(logits, sampling_tensors(rows, logits.device))


def draw_tokens(probs: torch.Tensor, logits: torch.Tensor, params: SamplingTensors,
                u: torch.Tensor) -> torch.Tensor:
    """One token per distribution: probs and logits [b, ..., V], u [b, ...] uniforms -> ids
    [b, ...] int64, the argmax of the logits on greedy rows, an inverse-CDF draw from probs
    (:func:`~ssdlib.speculative.rng.sample_categorical`) on the others."""
    vocab = probs.shape[-1]
    tokens = sample_categorical(probs.reshape(-1, vocab), u.reshape(-1)).view(u.shape)
    if params.any_greedy:
        greedy = params.greedy.view((-1,) + (1,) * (u.dim() - 1))
        tokens = torch.where(greedy, row_argmax(logits), tokens)
    return tokens


def sample_tokens(logits: torch.Tensor, rows) -> torch.Tensor:
    """logits [b, V] (row i belongs to rows[i]) -> one token per row [b] on the device; one draw
    of each row's stream."""
    if all(r.params.greedy for r in rows):  # the decode hot path: no parameter tensors to build
        return row_argmax(logits)
    params = sampling_tensors(rows, logits.device)
    u = reserve_streams(rows, 1, logits.device).uniforms(1)[:, 0]       # [b]
    return draw_tokens(target_distributions(logits, params), logits, params, u)


def sample_rows(logits: torch.Tensor, rows) -> list[int]:
    """logits [b, V] -> one token per row, on the host (the step's read-back)."""
    return sample_tokens(logits, rows).tolist()


def sample_branches(logits: torch.Tensor, params: SamplingTensors, u: torch.Tensor,
                    fan_out: int, saguaro_c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculator's next token for every branch of every row: logits [b, B, V], u [b, B]
    (B draws of each row's stream) -> tokens [b, B] int64 and the q each was drawn from
    [b, B, V] float32: Saguaro's sigma_{F,C} of the row's distribution on sampled rows, the
    argmax and its one-hot on greedy rows."""
    q = target_distributions(logits, params)                            # [b, B, V]
    if params.any_sampled:
        scaled = saguaro_q(q, fan_out, saguaro_c)
        q = torch.where(params.greedy[:, None, None], q, scaled) if params.any_greedy else scaled
    return draw_tokens(q, logits, params, u), q
