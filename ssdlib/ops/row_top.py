"""The argmax and the k largest of each vocabulary row: greedy tokens and a build's candidates.

On the hot path these run on a few rows of V ~ 50k logits (a verify's K + 1 positions, a tree
depth's branches, a draft step's row). torch's kernels take such a row on one block (the
argmax: ~12 us on an H200 whatever the rows) or in several radix passes (top-17: 35-85 us).
Two Triton passes that spread a row over many SMs (``triton_row_top.py``) take 4-7 us for the
argmax and 16-32 us for the top-17 of up to 32 rows (``dev/gpu_micro_argmax.py``, one H200).

``row_argmax`` / ``top_indices`` take the Triton kernels inside a CUDA-graph capture (the
captured steps, whose replay launches them at no host cost) when triton imports and
``SSDLIB_ROW_TOP`` is not ``torch``; else torch.argmax / torch.topk. Called eagerly, two Triton
launches cost the host more than they save on the GPU (AR's eager argmax after its step's
replay made AR 7 % slower with them on an H200). The kernels break ties the way the plain
references below do (the lowest index first: torch.argmax's rule, and a stable sort's), and are
tested for equality against them; torch.topk leaves the order of equal values open. NaN logits
are outside the contract (a step that produced them is already broken)."""

from __future__ import annotations

from types import ModuleType

import torch

from ssdlib import env
from ssdlib.ops.triton_modules import triton_module

MAX_K = 32  # the kernel unrolls k rounds per chunk; larger k goes to torch.topk
MAX_TOP_ROWS = 64


def row_argmax_reference(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's maximum over the last dim (the first among equals)."""
    return x.argmax(dim=-1)


def top_indices_reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices [..., k] of each row's k largest over the last dim, largest first, the lower
    index first among equals (a stable sort)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def _triton_module() -> ModuleType | None:
    return triton_module("triton_row_top")


def _use_kernel(x: torch.Tensor, k: int) -> bool:
    # top-k of many rows (a b = 8 tree depth's 128) is torch's: k rounds per chunk cost more
    # there than its radix passes (dev/gpu_micro_argmax.py)
    return (x.is_cuda and torch.cuda.is_current_stream_capturing() and x.numel() > 0
            and k <= MAX_K
            and (k == 1 or x.numel() // x.shape[-1] <= MAX_TOP_ROWS)
            and env.choice("SSDLIB_ROW_TOP") != "torch" and _triton_module() is not None)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] as [rows, V] with unit stride along V (a view where the strides allow)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.reshape(-1, x.shape[-1])


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices [..., k] (int64) of each row's k largest of x [..., V], largest first (k <=
    V; the kernel puts the lower index first among equals)."""
    if k < 1 or k > x.shape[-1]:
        raise ValueError(f"top_indices: k must be in 1..{x.shape[-1]}, got {k}")
    if not _use_kernel(x, k):
        return x.topk(k, dim=-1).indices
    return _triton_module().row_top(_rows(x), k).view(*x.shape[:-1], k)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """The index (int64) of each row's maximum of x [..., V], the first among equals."""
    if not _use_kernel(x, 1):
        return row_argmax_reference(x)
    return _triton_module().row_top(_rows(x), 1).view(x.shape[:-1])
