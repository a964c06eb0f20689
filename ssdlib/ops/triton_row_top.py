"""Triton kernels of ``row_top`` (the argmax and the few largest of each vocabulary row).

Imported lazily by ``ssdlib.ops.row_top``; importing this module needs triton.

Both are two passes over a row of V logits, so that a few rows (a verify's K + 1 positions, a
tree depth's branches) still spread over many SMs:

1. a program per (row, chunk of BLOCK logits) keeps its chunk's largest k (k = 1 for the
   argmax) by k rounds of "maximum, then mask it out", the lowest index first among equal
   values;
2. a program per row merges the chunks' n_chunks * k candidates the same way.

Ties go to the lowest index (torch.argmax's rule; torch.topk leaves their order open), and the
k indices come out largest first. No host sync and no data-dependent shape: both launches can be
captured in a CUDA graph; the partial buffers are allocated per call (from the graph's pool under
capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
BIG_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _chunk_top(x_ptr, val_ptr, idx_ptr, V, row_stride, n_chunks, K: tl.constexpr,
               BLOCK_V: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    col = tl.arange(0, BLOCK_V)
    offs = chunk * BLOCK_V + col
    alive = offs < V
    x = tl.load(x_ptr + row.to(tl.int64) * row_stride + offs, mask=alive,
                other=-float("inf")).to(tl.float32)
    out = (row * n_chunks + chunk) * K
    if K == 1:
        v, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(val_ptr + out, v)
        tl.store(idx_ptr + out, i + chunk * BLOCK_V)
    else:
        for j in tl.static_range(K):
            # the largest of the columns not taken yet, the lowest column among its equals
            # (-inf included: a chunk of fewer than K finite logits still gives K columns; a
            # chunk of fewer than K columns gives BIG_INDEX with -inf for the rest)
            v = tl.max(tl.where(alive, x, -float("inf")), axis=0)
            i = tl.min(tl.where(alive & (x == v), col, BIG_INDEX), axis=0)
            tl.store(val_ptr + out + j, v)
            tl.store(idx_ptr + out + j, tl.where(i == BIG_INDEX, BIG_INDEX, i + chunk * BLOCK_V))
            alive = alive & (col != i)


@triton.jit
def _merge_top(val_ptr, idx_ptr, out_ptr, n, K: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    v = tl.load(val_ptr + row * n + offs, mask=offs < n, other=-float("inf"))
    idx = tl.load(idx_ptr + row * n + offs, mask=offs < n, other=BIG_INDEX)
    alive = offs < n
    for j in tl.static_range(K):
        # the largest value, the lowest vocabulary index among its equals (a chunk's candidates
        # are in value order, not index order)
        m = tl.max(tl.where(alive, v, -float("inf")), axis=0)
        best = tl.min(tl.where(alive & (v == m), idx, BIG_INDEX), axis=0)
        tl.store(out_ptr + row * K + j, best)
        alive = alive & (idx != best)


def row_top(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [rows, V] (unit stride along V) -> int64 [rows, k]: the indices of each row's k largest,
    largest first, lowest index first among equals."""
    rows, V = x.shape
    n_chunks = triton.cdiv(V, BLOCK)
    val = torch.empty(rows, n_chunks * k, device=x.device, dtype=torch.float32)
    idx = torch.empty(rows, n_chunks * k, device=x.device, dtype=torch.int32)
    out = torch.empty(rows, k, device=x.device, dtype=torch.int32)
    _chunk_top[(rows, n_chunks)](x, val, idx, V, x.stride(0), n_chunks, K=k, BLOCK_V=BLOCK)
    _merge_top[(rows,)](val, idx, out, n_chunks * k, K=k,
                        BLOCK_N=triton.next_power_of_2(n_chunks * k))
    return out.long()
