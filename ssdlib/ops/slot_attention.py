"""Attention that reads the slot KV cache in place, for decode, verify and tree-decode steps.

Row i of a batch owns KV slot ``slots[i]``. Query (i, j) attends to that slot's keys at positions
``[kv_start[i, j], kv_limit[i, j])`` (limit, decode / verify: ``position + 1``; a tree branch: its
prefix length; start: 0, or ``position - window + 1`` for a sliding-window model) and,
optionally, to the tree keys t of the same slot's branch scratch region where
``tree_mask[i, j, t]``; one softmax runs over both key sets. Nothing is gathered or copied: the
Triton kernel (``triton_slot_attention.py``) indexes the cache through ``slots``, and has no host
sync and no data-dependent shape, so it can be captured in a CUDA graph.

``slot_attention_reference`` is a dense-mask fp32 softmax in plain PyTorch; it defines the
semantics and is the fallback on CPU or without Triton. docs/ATTENTION.md, "Slot attention".
"""

from __future__ import annotations

from types import ModuleType

import torch

from ssdlib import env
from ssdlib.log import get_logger
from ssdlib.ops.triton_modules import triton_module

logger = get_logger(__name__)

BACKENDS = ("auto", "torch", "triton")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)
_warned: set[str] = set()


def _check_inputs(q, k_cache, v_cache, slots, kv_limit, tree_k, tree_v, tree_mask,
                  kv_start=None) -> None:
    """Shape / dtype / device checks on metadata only (no device data is read: no sync)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [b, s, hq, hd], got shape {tuple(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be a floating tensor (fp16/bf16/fp32/fp64), got {q.dtype}")
    b, s, hq, hd = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [n_slots, hkv, L, hd], got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}")
    _, hkv, _, cache_hd = k_cache.shape
    if cache_hd != hd:
        raise ValueError(f"head_dim of q ({hd}) and of the cache ({cache_hd}) differ")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if tuple(slots.shape) != (b,) or slots.dtype not in _INT_DTYPES:
        raise ValueError(f"slots must be int32/int64 of shape [{b}], got {slots.dtype} {tuple(slots.shape)}")
    tensors = [q, k_cache, v_cache, slots]
    bounds = [("kv_limit", kv_limit)] + ([("kv_start", kv_start)] if kv_start is not None else [])
    for name, bound in bounds:  # each query's key range
        if tuple(bound.shape) != (b, s) or bound.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be int32/int64 of shape [{b}, {s}], got "
                             f"{bound.dtype} {tuple(bound.shape)}")
        tensors.append(bound)
    given = [t is not None for t in (tree_k, tree_v, tree_mask)]
    if any(given):
        if not all(given):
            raise ValueError("tree_k, tree_v and tree_mask must be given together")
        if tree_k.dim() != 4 or tree_k.shape != tree_v.shape:
            raise ValueError(
                f"tree_k and tree_v must both be [n_slots, hkv, T, hd], got {tuple(tree_k.shape)} "
                f"and {tuple(tree_v.shape)}")
        if tree_k.shape[0] != k_cache.shape[0] or tree_k.shape[1] != hkv or tree_k.shape[3] != hd:
            raise ValueError(f"tree_k {tuple(tree_k.shape)} does not match the cache {tuple(k_cache.shape)}")
        if tree_k.dtype != q.dtype or tree_v.dtype != q.dtype:
            raise TypeError(f"tree_k / tree_v must have q's dtype {q.dtype}, got {tree_k.dtype}, {tree_v.dtype}")
        if tuple(tree_mask.shape) != (b, s, tree_k.shape[2]) or tree_mask.dtype != torch.bool:
            raise ValueError(f"tree_mask must be bool of shape [{b}, {s}, {tree_k.shape[2]}], "
                             f"got {tree_mask.dtype} {tuple(tree_mask.shape)}")
        tensors += [tree_k, tree_v, tree_mask]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def slot_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slots: torch.Tensor, kv_limit: torch.Tensor, scale: float,
                             tree_k: torch.Tensor | None = None, tree_v: torch.Tensor | None = None,
                             tree_mask: torch.Tensor | None = None,
                             kv_start: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch ``slot_attention``: a dense [b, s, L (+T)] mask and one fp32 softmax.

    It gathers the rows' slots (a copy of [b, hkv, L, hd]); it is the definition and the fallback,
    not the fast path. fp64 inputs are computed in fp64, everything else in fp32.
    """
    _check_inputs(q, k_cache, v_cache, slots, kv_limit, tree_k, tree_v, tree_mask, kv_start)
    b, s, hq, hd = q.shape
    hkv, L = k_cache.shape[1], k_cache.shape[2]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = k_cache[slots].to(compute)  # [b, hkv, L, hd]
    values = v_cache[slots].to(compute)
    positions = torch.arange(L, device=q.device)
    mask = positions.view(1, 1, L) < kv_limit.view(b, s, 1)  # [b, s, L]
    if kv_start is not None:
        mask &= positions.view(1, 1, L) >= kv_start.view(b, s, 1)
    if tree_k is not None:
        keys = torch.cat([keys, tree_k[slots].to(compute)], dim=2)  # [b, hkv, L + T, hd]
        values = torch.cat([values, tree_v[slots].to(compute)], dim=2)
        mask = torch.cat([mask, tree_mask], dim=2)  # [b, s, L + T]
    qg = q.to(compute).view(b, s, hkv, hq // hkv, hd)  # query head h*group + g uses kv head h
    scores = torch.einsum("bshgd,bhnd->bshgn", qg, keys) * scale  # [b, s, hkv, group, n]
    visible = mask.view(b, s, 1, 1, -1)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible.any(dim=-1, keepdim=True), probs, 0.0)  # no key: zeros, not NaN
    out = torch.einsum("bshgn,bhnd->bshgd", probs, values)
    return out.reshape(b, s, hq, hd).to(q.dtype)


def _triton_module() -> ModuleType | None:
    return triton_module("triton_slot_attention")


def triton_available() -> bool:
    """True when the Triton kernel can be imported (triton installed and working)."""
    return _triton_module() is not None


def _use_triton(q: torch.Tensor, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' was requested but triton cannot be imported")
        return True
    if not q.is_cuda or env.choice("SSDLIB_ATTENTION") == "torch":
        return False
    if triton_available():
        return True
    if "no-triton" not in _warned:
        _warned.add("no-triton")
        logger.warning("slot_attention on CUDA uses the PyTorch reference (triton is not importable)")
    return False


def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, kv_limit: torch.Tensor, scale: float,
                   tree_k: torch.Tensor | None = None, tree_v: torch.Tensor | None = None,
                   tree_mask: torch.Tensor | None = None, backend: str = "auto",
                   kv_start: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of new queries over the slot KV cache (read in place) and an optional tree region.

    Args:
        q: [b, s, hq, hd], fp16/bf16/fp32 (fp64 on the torch backend only).
        k_cache, v_cache: [n_slots, hkv, L, hd], q's dtype: one layer of the slot cache;
            query head ``h`` uses kv head ``h // (hq // hkv)`` (GQA).
        slots: [b] int32/int64, the slot of each row.
        kv_limit: [b, s] int32/int64; query (i, j) attends slot keys ``[0, kv_limit[i, j])`` of
            slot ``slots[i]``; 0 (or less) = none, values above L act as L.
        scale: softmax scale (usually ``hd ** -0.5``).
        tree_k, tree_v: [n_slots, hkv, T, hd] or None, the speculator's branch scratch region.
        tree_mask: [b, s, T] bool or None; query (i, j) also attends tree key t of slot
            ``slots[i]`` iff ``tree_mask[i, j, t]``.
        backend: "auto" (Triton for CUDA tensors when triton imports and the environment
            variable SSDLIB_ATTENTION, read at each call, is not "torch"; else the reference),
            "torch" or "triton" (forces one; "triton" on CPU tensors needs TRITON_INTERPRET=1).

    Returns:
        [b, s, hq, hd] in q's dtype: one softmax over the visible slot keys and tree keys,
        accumulated in fp32; a query that sees no key gets zeros.

    Slot indices and limits are not range-checked (that would sync the GPU). The Triton path has
    no host sync and fixed shapes for fixed input shapes, so it can be captured in a CUDA graph
    (run it once before capturing, so that the kernels are compiled).
    """
    if _use_triton(q, backend):
        _check_inputs(q, k_cache, v_cache, slots, kv_limit, tree_k, tree_v, tree_mask, kv_start)
        return _triton_module().triton_slot_attention(
            q, k_cache, v_cache, slots, kv_limit, scale, tree_k, tree_v, tree_mask,
            kv_start=kv_start)
    return slot_attention_reference(q, k_cache, v_cache, slots, kv_limit, scale, tree_k, tree_v,
                                    tree_mask, kv_start)
