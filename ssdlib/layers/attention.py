"""Attention over the slot KV cache.

Each forward writes the new K/V (at their positions in the row's slot, or in tree mode at
``tree_index`` of the slot's branch scratch region), then every query attends to the slot keys
below its own limit ``kv_limit`` (causal decode / verify / prefill: position + 1; a tree branch:
its prefix length) and, in tree mode, to the branch keys its ``tree_mask`` allows. A model with a
sliding window W (``ModelConfig.sliding_window``) also hides the slot keys more than W - 1
positions before each query (``kv_start``); the tree region is never hidden (a speculation and its
branches are far shorter than any window the config accepts).

Two ways to compute the same thing:
- ``slot_attention`` (``ssdlib.ops``): reads keys in place up to each row's limit (the Triton
  kernel on CUDA); used for small query counts (decode, verify, tree steps) when available;
- SDPA over a gathered copy of keys [0, kv_len) of each row with a dense mask; ``kv_len`` is a
  static bucket >= every limit (CPU, prefill, and the reference the kernel is tested against).

A prompt's prefill from position 0 (``from_zero``: every row's queries are positions 0 .. s - 1)
sees exactly this forward's own keys, causally: it attends over them with SDPA's causal flag and
no mask, which on CUDA is the flash kernel. The masked kernel's cost grows with the square of the
mask (on one H200, one SmolLM2 layer over 6,144 tokens: 1.22 ms masked, 0.25 ms causal flash;
``dev/prefill_probe.py``). A sliding window shorter than the prompt keeps the masked path.

Nothing here reads device values on the host: all metadata is shaped by host-known sizes, so a
forward can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ssdlib.ops.slot_attention import slot_attention


@dataclass
class AttentionMetadata:
    """Per-forward attention inputs, shared by all layers."""

    positions: torch.Tensor  # [b, s] int64, logical position of each new token
    slots: torch.Tensor | None  # [b] int64, KV slot of each row (None: no cache, training)
    kv_len: int  # static: slot keys [0, kv_len) may be read; >= every kv_limit
    kv_limit: torch.Tensor | None = None  # [b, s] int64: slot keys [0, limit) visible per query
    # Tree-decode mode (speculator branches): new K/V go to the tree scratch region at
    # tree_index [b, s] instead of the slot; tree_mask [b, s, tree_len] says which branch keys
    # each query sees (in addition to its slot keys below kv_limit).
    tree_index: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    tree_len: int = 0
    use_kernel: bool = False  # slot_attention reads the cache in place (else SDPA over kv_len)
    kernel_backend: str = "triton"  # slot_attention's backend when use_kernel ("torch": reference)
    slot_start: int | None = None  # host-known: rows use slots slot_start.. in order (no gather)
    rope: tuple | None = None  # (cos, sin) for ``positions``, set by the model once per forward
    window: int | None = None  # the model's sliding window (set by the model), None: all keys
    kv_start: torch.Tensor | None = None  # [b, s]: positions - window + 1, set once per forward
    mask: torch.Tensor | None = None  # SDPA mask [b, 1, s, kv_len (+ tree_len)], set once per forward
    # host-known: every row's queries are positions 0 .. s - 1 in order (a prompt's prefill)
    from_zero: bool = False
    causal: bool = False  # set once per forward: attend causally over this forward's own keys

    @classmethod
    def build(cls, positions: torch.Tensor, slots: torch.Tensor,
              kv_len: int | None = None) -> "AttentionMetadata":
        """Causal-by-position metadata (a query at position p sees keys <= p). Without
        ``kv_len`` it is read from ``positions`` (a host sync on GPU: not for the hot path)."""
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        return cls(positions, slots, kv_len, kv_limit=positions + 1)

    def prepare(self) -> None:
        """Once per forward (inside a captured graph too): each query's first visible key under
        a sliding window, and the SDPA mask from the limits."""
        if self.window is not None:
            self.kv_start = self.positions - (self.window - 1)
        s = self.positions.shape[1]
        self.causal = (self.from_zero and self.slots is not None and self.tree_index is None
                       and (self.window is None or s <= self.window))
        if self.use_kernel or self.causal:
            return
        if self.slots is None:  # cache-free (training): causal, banded by the window
            if self.window is not None:
                keys = self.positions.unsqueeze(1)  # [b, 1, s]: this forward's own positions
                query = self.positions.unsqueeze(-1)
                self.mask = ((keys <= query) & (keys >= self.kv_start.unsqueeze(-1))).unsqueeze(1)
            return
        keys = torch.arange(self.kv_len, device=self.positions.device)
        mask = keys.view(1, 1, -1) < self.kv_limit.unsqueeze(-1)  # [b, s, kv_len]
        if self.kv_start is not None:
            mask &= keys.view(1, 1, -1) >= self.kv_start.unsqueeze(-1)
        if self.tree_mask is not None:
            mask = torch.cat([mask, self.tree_mask], dim=-1)
        self.mask = mask.unsqueeze(1)


class CachedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, tree_k: torch.Tensor | None = None,
                tree_v: torch.Tensor | None = None) -> torch.Tensor:
        """q: [b, s, hq, hd]; k, v: [b, s, hkv, hd]; caches [slots, hkv, L, hd] -> [b, s, hq*hd].

        In tree mode the slot is read-only; tree_k/tree_v [slots, hkv, T, hd] receive the new K/V.
        """
        b, s = q.shape[:2]
        gqa = self.num_heads != self.num_kv_heads
        if k_cache is None:  # training / scoring: causal attention over these tokens
            out = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=meta.mask is None, attn_mask=meta.mask, scale=self.scale,
                enable_gqa=gqa)
            return out.transpose(1, 2).reshape(b, s, -1)
        rows = meta.slots.view(-1, 1)
        tree = meta.tree_index is not None
        if tree:
            tree_k[rows, :, meta.tree_index] = k
            tree_v[rows, :, meta.tree_index] = v
        else:
            k_cache[rows, :, meta.positions] = k
            v_cache[rows, :, meta.positions] = v
        if meta.causal:  # a prefill from position 0: its own keys are every key it sees
            return self._causal(q, k, v)
        if meta.use_kernel:
            n = meta.tree_len  # the mask covers the first tree_len branch keys
            # the custom op only where torch.compile traces: called eagerly it goes through
            # torch._dynamo (imported on first use: seconds of start-up) for nothing
            kernel = _slot_kernel if torch.compiler.is_compiling() else _slot_kernel_eager
            out = kernel(q, k_cache, v_cache, meta.slots, meta.kv_limit, self.scale,
                         tree_k[:, :, :n] if tree else None, tree_v[:, :, :n] if tree else None,
                         meta.tree_mask, meta.kernel_backend, meta.kv_start)
            return out.reshape(b, s, -1)
        if meta.slot_start is not None:  # a view, no copy
            rows = slice(meta.slot_start, meta.slot_start + b)
            keys, values = k_cache[rows, :, :meta.kv_len], v_cache[rows, :, :meta.kv_len]
        else:  # [b, hkv, kv_len, hd], a gathered copy
            keys = k_cache[meta.slots, :, :meta.kv_len]
            values = v_cache[meta.slots, :, :meta.kv_len]
        if tree:  # the row's branch keys after its prefix: one softmax over both
            rows = meta.slots if meta.slot_start is None else rows
            keys = torch.cat([keys, tree_k[rows, :, :meta.tree_len]], dim=2)
            values = torch.cat([values, tree_v[rows, :, :meta.tree_len]], dim=2)
        keys, values, gqa = self._heads_for_sdpa(keys, values)
        with _sdpa_backends(q.device):
            out = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=meta.mask, scale=self.scale,
                enable_gqa=gqa)  # [b, hq, s, hd]
        return out.transpose(1, 2).reshape(b, s, -1)

    def _heads_for_sdpa(self, keys: torch.Tensor, values: torch.Tensor):
        """(keys, values, enable_gqa) for SDPA from [b, hkv, n, hd]: on CUDA every query head's
        copy (the memory-efficient kernel takes no enable_gqa), elsewhere as they are."""
        gqa = self.num_heads != self.num_kv_heads
        if gqa and keys.device.type == "cuda":
            group = self.num_heads // self.num_kv_heads
            return (keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1),
                    False)
        return keys, values, gqa

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q over the forward's own k, v (no mask, no cache read): SDPA's
        flash kernel on CUDA (fp16 / bf16), which takes every head (like the masked path)."""
        b, s = q.shape[:2]
        keys, values, gqa = self._heads_for_sdpa(k.transpose(1, 2), v.transpose(1, 2))
        with _sdpa_backends(q.device):
            out = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, is_causal=True, scale=self.scale,
                enable_gqa=gqa)
        return out.transpose(1, 2).reshape(b, s, -1)


# SDPA's backends for the masked path on CUDA (prefill): torch's order less cuDNN. On Hopper
# torch picks cuDNN first, which builds an execution plan for every new (batch, length) shape,
# ~50 ms on an H200, so every prefill of a new prompt length paid it (measured: an admission
# took 85 ms instead of ~25 ms). Flash takes no mask; the memory-efficient kernel takes it and
# needs no plan, but no enable_gqa (without it the math path ran: 0.7 ms a layer).
_SDPA_CUDA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa_backends(device: torch.device):
    return sdpa_kernel(_SDPA_CUDA) if device.type == "cuda" else contextlib.nullcontext()


def _slot_kernel_eager(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, kv_limit: torch.Tensor, scale: float,
                       tree_k: torch.Tensor | None, tree_v: torch.Tensor | None,
                       tree_mask: torch.Tensor | None, backend: str,
                       kv_start: torch.Tensor | None) -> torch.Tensor:
    """``slot_attention`` with the model runner's backend (chosen once, by use_slot_kernel: no
    per-layer re-dispatch)."""
    return slot_attention(q, k_cache, v_cache, slots, kv_limit, scale, tree_k, tree_v,
                          tree_mask, backend=backend, kv_start=kv_start).contiguous()


# the same as an opaque op: torch.compile traces the step around it in one graph (fusing the
# small kernels before and after it) and launches the kernel as it is (it holds the function
# itself, not the module's name for it)
_slot_kernel = torch.library.custom_op("ssdlib::slot_attention", _slot_kernel_eager,
                                       mutates_args=())


@_slot_kernel.register_fake
def _(q, k_cache, v_cache, slots, kv_limit, scale, tree_k, tree_v, tree_mask, backend, kv_start):
    return q.new_empty(q.shape)
