"""Tensor-parallel linears. Sharding knowledge lives here, next to the weight it applies to.

Column-parallel: each rank holds a block of output rows; no communication.
Row-parallel: each rank holds a block of input columns; the partial outputs are summed by an
all-reduce on ``tp_group`` inside the layer.

Both support *padding*: the logical (padded) size is a multiple of the TP size and rows/columns
beyond the checkpoint's real size are zero. This is how a model whose head count does not divide
the TP size (SmolLM2: 9 query heads, 3 KV heads at TP 4) runs unchanged: padded heads produce zero
output and their o_proj columns are zero, so the result equals the unpadded model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def tp_size_rank(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def all_reduce(x: torch.Tensor, tp_group) -> torch.Tensor:
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(x, group=tp_group)
    return x


def load_padded_block(weights, name: str, dim: int, start: int, stop: int, real: int,
                       shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    """Read rows/cols [start, stop) of ``name`` along ``dim``; indices >= ``real`` are zeros."""
    out = torch.zeros(shape, dtype=torch.float32)
    real_stop = min(stop, real)
    if real_stop > start:
        block = weights.get(name, dim=dim, start=start, stop=real_stop)
        out.narrow(dim, 0, real_stop - start).copy_(block)
    return out.to(device=device, dtype=dtype)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across ranks. out_features is the padded size."""

    def __init__(self, in_features: int, out_features: int, tp_group=None,
                 real_out_features: int | None = None):
        super().__init__()
        tp, rank = tp_size_rank(tp_group)
        if out_features % tp:
            raise ValueError(f"out_features {out_features} not divisible by tp {tp}")
        self.tp_group = tp_group
        self.local_out = out_features // tp
        self.row_start = rank * self.local_out
        self.real_out = out_features if real_out_features is None else real_out_features
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features))
        self.checkpoint_shape = (self.real_out, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)

    def load(self, weights, name: str) -> None:
        w = self.weight
        w.data = load_padded_block(weights, name, 0, self.row_start,
                                    self.row_start + self.local_out, self.real_out,
                                    tuple(w.shape), w.dtype, w.device)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) with W's input columns split. in_features is padded."""

    def __init__(self, in_features: int, out_features: int, tp_group=None,
                 real_in_features: int | None = None):
        super().__init__()
        tp, rank = tp_size_rank(tp_group)
        if in_features % tp:
            raise ValueError(f"in_features {in_features} not divisible by tp {tp}")
        self.tp_group = tp_group
        self.local_in = in_features // tp
        self.col_start = rank * self.local_in
        self.real_in = in_features if real_in_features is None else real_in_features
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in))
        self.checkpoint_shape = (out_features, self.real_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(nn.functional.linear(x, self.weight), self.tp_group)

    def load(self, weights, name: str) -> None:
        w = self.weight
        w.data = load_padded_block(weights, name, 1, self.col_start,
                                    self.col_start + self.local_in, self.real_in,
                                    tuple(w.shape), w.dtype, w.device)
