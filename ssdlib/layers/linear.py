"""Tensor-parallel linears. Sharding knowledge lives here, next to the weight it applies to.

Column-parallel (merged: several projections of one input in one matmul, e.g. q/k/v): each
rank holds a block of output rows of each part; no communication.
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


# torch >= 2.13 names the one-buffer all-gather all_gather_single (all_gather_into_tensor is
# deprecated there); older torch (2.11 on our GPU machines) has only the old name
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_last(x: torch.Tensor, tp_group) -> torch.Tensor:
    """Every rank's ``x`` [..., n] side by side along the last dim -> [..., tp * n]. One flat
    all-gather into one buffer, which a CUDA graph can capture."""
    tp, _ = tp_size_rank(tp_group)
    if tp == 1:
        return x
    gathered = x.new_empty((tp, *x.shape))
    _all_gather_flat(gathered.view(-1), x.contiguous().view(-1), group=tp_group)
    return torch.cat(gathered.unbind(0), dim=-1)


def load_padded_block(weights, name: str, dim: int, start: int, stop: int, real: int,
                       shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    """Read rows/cols [start, stop) of ``name`` along ``dim``; indices >= ``real`` are zeros."""
    real_stop = min(stop, real)
    block = weights.get(name, dim=dim, start=start, stop=real_stop) if real_stop > start else None
    if block is not None and tuple(block.shape) == tuple(shape):
        # nothing to pad: one copy, not a zeroed one filled (a copy all the same: a source may
        # hand out a tensor it keeps, e.g. a target's embedding that a draft shares)
        return block.to(device=device, dtype=dtype, copy=True)
    out = torch.zeros(shape, dtype=torch.float32)
    if block is not None:
        out.narrow(dim, 0, real_stop - start).copy_(block)
    return out.to(device=device, dtype=dtype)


class MergedColumnParallelLinear(nn.Module):
    """Column-parallel projections of the same input, merged into one matmul (q/k/v, gate/up).

    ``parts``: (HF name of the sibling tensor, padded out_features, real out_features) each;
    every rank holds its block of every part, concatenated. Fewer, larger kernels per layer.
    """

    def __init__(self, in_features: int, parts: list[tuple[str, int, int]], tp_group=None):
        super().__init__()
        tp, rank = tp_size_rank(tp_group)
        for name, padded, _ in parts:
            if padded % tp:
                raise ValueError(f"{name}: out_features {padded} not divisible by tp {tp}")
        self.tp_group = tp_group
        self.parts = parts
        self.in_features = in_features
        self.local_sizes = [padded // tp for _, padded, _ in parts]
        self.rank = rank
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), in_features))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(nn.functional.linear(x, self.weight).split(self.local_sizes, dim=-1))

    def _sibling(self, prefix: str, name: str) -> str:
        return prefix.rsplit(".", 1)[0] + "." + name + ".weight"

    def checkpoint_tensors(self, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(self._sibling(prefix, name), (real, self.in_features))
                for name, _, real in self.parts]

    def load(self, weights, prefix: str) -> None:
        w = self.weight
        blocks = []
        for (name, _, real), local in zip(self.parts, self.local_sizes):
            start = self.rank * local
            blocks.append(load_padded_block(weights, self._sibling(prefix, name), 0, start,
                                            start + local, real, (local, self.in_features),
                                            w.dtype, w.device))
        w.data = torch.cat(blocks)

    def hf_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The HF tensors this weight holds (unsharded models only)."""
        parts = self.weight.split(self.local_sizes)
        return {self._sibling(prefix, name): t[:real]
                for (name, _, real), t in zip(self.parts, parts)}


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

    def checkpoint_tensors(self, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(prefix + ".weight", self.checkpoint_shape)]

    def load(self, weights, prefix: str) -> None:
        w = self.weight
        w.data = load_padded_block(weights, prefix + ".weight", 1, self.col_start,
                                   self.col_start + self.local_in, self.real_in,
                                   tuple(w.shape), w.dtype, w.device)
