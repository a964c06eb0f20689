"""Triton kernel of ``slot_attention`` (flash-decoding over the slot KV cache, read in place).

Imported lazily by ``ssdlib.ops.slot_attention``; importing this module needs triton.

Two kernels:

1. ``_split_kernel``, grid ``(n_parts, b * hkv, m_blocks)``. A program takes one row i, one kv
   head h and a block of BLOCK_M of the row's ``s * group`` queries (all GQA query heads of h
   for consecutive tokens, so they share every K/V tile it loads), and one *part* of the keys:
   parts ``0 .. n_splits-1`` split the slot keys, part ``n_splits`` (when there is a tree) is the
   tree region. The slot keys a program looks at are ``[row_min, row_max)``, row_max = max
   kv_limit over its queries, row_min = min kv_start (0 without a sliding window, rounded down to
   BLOCK_N), read from device memory inside the kernel; that range is cut into n_splits chunks of
   ``cdiv(row_max - row_min, n_splits)`` keys rounded up to BLOCK_N. So the *number* of splits is
   fixed by the static shapes (L, b, hkv, s*group and the SM count) while the work follows the
   actual lengths: a split past row_max exits at once. Each part writes its normalised partial
   output and log2-sum-exp per query (fp32).
2. ``_combine_kernel``, one program per (row, token, query head): merges the parts by
   log-sum-exp. With a single part (no tree, one split) ``_split_kernel`` writes the output
   itself and no combine runs.

No host sync and no data-dependent shape anywhere, so both launches can be captured in a CUDA
graph; the partial buffers are allocated per call (from the graph's pool under capture).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

# A finite stand-in for -inf in the running max: exp2(-inf - NEG_BIG) = 0 and exp2(NEG_BIG - m)
# = 0 without the NaN that -inf - (-inf) would give for a query that has seen no key yet.
NEG_BIG = tl.constexpr(-1.0e30)
MAX_SPLITS = 64
PROGRAMS_PER_SM = 2
CPU_SM_COUNT = 4  # interpreter runs: a few programs, still several splits


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_ptrs, v_ptrs, load_mask, visible, scale_log2,
                 UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # q: [BLOCK_M, BLOCK_D]; k_ptrs, v_ptrs: [BLOCK_N, BLOCK_D]; visible: [BLOCK_M, BLOCK_N]
    k = tl.load(k_ptrs, mask=load_mask, other=0.0)
    v = tl.load(v_ptrs, mask=load_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _split_kernel(
    Q, K, V, TK, TV, TMASK, SLOTS, LIMIT, START, O_PART, LSE_PART, OUT,
    scale_log2, s, L, T, HKV, HQ, n_queries,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kl, stride_kd,
    stride_vn, stride_vh, stride_vl, stride_vd,
    stride_tkn, stride_tkh, stride_tkl, stride_tkd,
    stride_tvn, stride_tvh, stride_tvl, stride_tvd,
    stride_mb, stride_ms, stride_mt,
    stride_lb, stride_ls, stride_sb, stride_ss, stride_slot,
    GROUP: tl.constexpr, HD: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_TREE: tl.constexpr,
    HAS_START: tl.constexpr,
    WRITE_OUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    part = tl.program_id(0)
    row = tl.program_id(1) // HKV
    head = tl.program_id(1) % HKV
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # query m = token * GROUP + g
    m_valid = offs_m < s * GROUP
    tok = offs_m // GROUP
    q_head = head * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HD
    offs_n = tl.arange(0, BLOCK_N)
    slot = tl.load(SLOTS + row * stride_slot).to(tl.int64)  # slots may be a strided view

    q = tl.load(Q + row * stride_qb + tok[:, None] * stride_qs + q_head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    if part < NUM_SPLITS:
        limit = tl.load(LIMIT + row * stride_lb + tok * stride_ls, mask=m_valid, other=0)
        limit = tl.minimum(limit.to(tl.int32), L)  # [BLOCK_M]; <= 0: no slot key
        row_max = tl.max(limit, 0)
        if HAS_START:  # a sliding window: keys below a query's start are not seen
            first = tl.load(START + row * stride_sb + tok * stride_ss, mask=m_valid, other=0)
            first = tl.maximum(first.to(tl.int32), 0)
            row_min = tl.min(tl.where(m_valid, first, L), 0) // BLOCK_N * BLOCK_N
            row_min = tl.minimum(row_min, row_max)
        else:
            first = tl.zeros([BLOCK_M], dtype=tl.int32)
            row_min = 0
        chunk = tl.cdiv(tl.cdiv(row_max - row_min, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = row_min + part * chunk
        end = tl.minimum(start + chunk, row_max)
        k_base = K + slot * stride_kn + head * stride_kh + offs_d[None, :] * stride_kd
        v_base = V + slot * stride_vn + head * stride_vh + offs_d[None, :] * stride_vd
        for n0 in range(start, end, BLOCK_N):
            n = n0 + offs_n  # [BLOCK_N]; chunks are BLOCK_N-aligned, so n < start + chunk
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q,
                k_base + n[:, None] * stride_kl, v_base + n[:, None] * stride_vl,
                (n < end)[:, None] & d_valid[None, :],
                (n[None, :] < limit[:, None]) & (n[None, :] >= first[:, None]),
                scale_log2, UPCAST, DOT_PRECISION)
    elif HAS_TREE:
        k_base = TK + slot * stride_tkn + head * stride_tkh + offs_d[None, :] * stride_tkd
        v_base = TV + slot * stride_tvn + head * stride_tvh + offs_d[None, :] * stride_tvd
        mask_base = TMASK + row * stride_mb + tok[:, None] * stride_ms
        for t0 in range(0, T, BLOCK_N):
            t = t0 + offs_n
            visible = tl.load(mask_base + t[None, :] * stride_mt,
                              mask=m_valid[:, None] & (t < T)[None, :], other=0) != 0
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q,
                k_base + t[:, None] * stride_tkl, v_base + t[:, None] * stride_tvl,
                (t < T)[:, None] & d_valid[None, :], visible,
                scale_log2, UPCAST, DOT_PRECISION)

    seen = l_i > 0.0  # l_i >= 1 once a query has seen a key (its max term is exp2(0))
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # zeros for a query without keys
    q_index = (row * s + tok) * HQ + q_head  # [BLOCK_M] flat index into [b, s, hq]
    if WRITE_OUT:
        tl.store(OUT + q_index[:, None] * HD + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=m_valid[:, None] & d_valid[None, :])
    else:
        lse = tl.where(seen, m_i + tl.log2(tl.maximum(l_i, 1.0)), float("-inf"))
        tl.store(LSE_PART + part * n_queries + q_index, lse, mask=m_valid)
        # Parts a query did not see are not written; the combine skips them by their lse.
        tl.store(O_PART + (part * n_queries + q_index)[:, None] * HD + offs_d[None, :], out,
                 mask=(m_valid & seen)[:, None] & d_valid[None, :])


@triton.jit
def _combine_kernel(O_PART, LSE_PART, OUT, n_queries,
                    NUM_PARTS: tl.constexpr, HD: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    qid = tl.program_id(0)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HD
    lse = tl.load(LSE_PART + offs_p * n_queries + qid, mask=offs_p < NUM_PARTS, other=float("-inf"))
    seen = lse > float("-inf")  # [BLOCK_P]
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)
    w = tl.where(seen, tl.exp2(lse - lse_max), 0.0)
    o = tl.load(O_PART + (offs_p * n_queries + qid)[:, None] * HD + offs_d[None, :],
                mask=seen[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_P, BLOCK_D]
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(OUT + qid * HD + offs_d, out.to(OUT.dtype.element_ty), mask=d_valid)


def _interpreted() -> bool:
    """Whether the kernels were built by triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_split_kernel).__name__ == "InterpretedFunction"


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_config(s: int, group: int, hd: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) for ``s * group`` queries of one kv head.

    Sized so that sm_90 builds do not spill registers (checked with cuobjdump on cubins compiled
    for CUDA_SHAPES of tests/ops/test_slot_attention.py); fp32 tiles are smaller because fp32 operands take twice
    the registers. tl.dot needs every dimension >= 16.
    """
    block_d = max(16, triton.next_power_of_2(hd))
    queries = triton.next_power_of_2(s * group)
    if dtype == torch.float32:
        block_m, block_n = min(32, max(16, queries)), 16
        warps = 8 if block_m * block_d >= 32 * 128 else 4
    else:
        block_m = min(64, max(16, queries))
        # Decode-sized blocks take 32 keys a tile: twice the splits with work on short caches.
        block_n = 64 if block_d <= 64 and block_m > 16 else 32
        warps = 8 if block_m == 64 else 4
    return block_m, block_n, block_d, warps


def num_splits(b: int, hkv: int, m_blocks: int, L: int, block_n: int, sm_count: int) -> int:
    """Slot-key splits per (row, kv head, query block), from static shapes only.

    Enough programs to fill ``PROGRAMS_PER_SM * sm_count`` slots, at most one split per BLOCK_N
    keys of L and at most MAX_SPLITS.
    """
    programs = b * hkv * m_blocks
    wanted = -(-PROGRAMS_PER_SM * sm_count // programs)
    return max(1, min(wanted, MAX_SPLITS, -(-L // block_n)))


def triton_slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slots: torch.Tensor, kv_limit: torch.Tensor, scale: float,
                          tree_k: torch.Tensor | None = None, tree_v: torch.Tensor | None = None,
                          tree_mask: torch.Tensor | None = None,
                          splits: int | None = None,
                          kv_start: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton ``slot_attention`` (inputs already checked by the caller). ``splits`` overrides
    the number of slot-key splits (tests); by default ``num_splits`` picks it."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the Triton kernel takes fp16/bf16/fp32, got {q.dtype}")
    if not q.is_cuda and not _interpreted():
        raise ValueError("the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 when triton is imported)")
    b, s, hq, hd = q.shape
    hkv, L = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    block_m, block_n, block_d, warps = launch_config(s, group, hd, q.dtype)
    m_blocks = -(-(s * group) // block_m)
    if splits is None:
        sm_count = _sm_count(q.device.index) if q.is_cuda else CPU_SM_COUNT
        splits = num_splits(b, hkv, m_blocks, L, block_n, sm_count)
    elif splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    has_tree = tree_k is not None
    n_parts = splits + int(has_tree)
    n_queries = b * s * hq
    out = torch.empty((b, s, hq, hd), dtype=q.dtype, device=q.device)
    if n_queries == 0:
        return out
    if n_parts > 1:
        o_part = torch.empty((n_parts, n_queries, hd), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((n_parts, n_queries), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out  # unused
    if has_tree:
        T = tree_k.shape[2]
        tmask = tree_mask.view(torch.uint8)  # same storage, no copy
    else:
        T, tree_k, tree_v, tmask = 0, k_cache, v_cache, kv_limit  # placeholders, never read
    # Triton's interpreter (3.9) computes bf16 tl.dot wrongly, so there bf16 tiles are upcast to
    # fp32; on a GPU bf16 tiles go to the tensor cores as they are.
    upcast = _interpreted() and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    split_grid = (n_parts, b * hkv, m_blocks)
    first = kv_limit if kv_start is None else kv_start  # a placeholder without a window
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _split_kernel[split_grid](
            q, k_cache, v_cache, tree_k, tree_v, tmask, slots, kv_limit, first,
            o_part, lse_part, out,
            scale * math.log2(math.e), s, L, T, hkv, hq, n_queries,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *tree_k.stride(), *tree_v.stride(),
            *(tmask.stride() if has_tree else (0, 0, 0)), *kv_limit.stride(),
            *first.stride(), slots.stride(0),
            GROUP=group, HD=hd, NUM_SPLITS=splits, HAS_TREE=has_tree,
            HAS_START=kv_start is not None, WRITE_OUT=n_parts == 1,
            UPCAST=upcast, DOT_PRECISION=precision,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            num_warps=warps, num_stages=2,
        )
        if n_parts > 1:
            _combine_kernel[(n_queries,)](
                o_part, lse_part, out, n_queries,
                NUM_PARTS=n_parts, HD=hd, BLOCK_P=triton.next_power_of_2(n_parts), BLOCK_D=block_d,
                num_warps=1 if block_d <= 64 else 2,
            )
    return out

