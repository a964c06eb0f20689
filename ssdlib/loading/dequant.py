"""GGUF block dequantization in torch for the common types, gguf.quants for the rest.

``gguf.quants`` is the reference (it reads every GGML type) but runs numpy over groups of rows;
a model's load spent most of its time there (SmolLM2-135M Q4_1: 213 tensors). The types a
Llama GGUF mostly holds (Q4_0, Q4_1, Q8_0) are decoded here with the same arithmetic as
``gguf.quants``, in float32, over whole tensors at once (equal results are tested); any other
type goes to ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

Q = GGMLQuantizationType
FAST_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32] values 0..15: the low nibbles first, then the high ones
    (GGML's order within a block)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block, as float32 [n, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).to(torch.float32)


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``raw`` (a GGUF tensor's ``data``: uint8 block rows for a quantized type) -> float32
    values shaped like ``gguf.quants.dequantize`` returns them."""
    if qtype not in FAST_TYPES:
        return gguf_dequantize(raw, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if raw.dtype != np.uint8 or raw.shape[-1] % type_size:
        raise ValueError(f"{qtype.name} data must be uint8 rows of whole {type_size}-byte blocks, "
                         f"got {raw.dtype} {list(raw.shape)}")
    out_shape = (*raw.shape[:-1], raw.shape[-1] // type_size * block_size)
    if raw.size == 0:
        return np.zeros(out_shape, dtype=np.float32)
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).view(-1, type_size)
    if qtype == Q.Q8_0:
        values = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _scale(blocks, 0)
    elif qtype == Q.Q4_0:
        values = _scale(blocks, 0) * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).to(torch.float32)
    else:  # Q4_1
        values = _scale(blocks, 0) * _nibbles(blocks[:, 4:]).to(torch.float32) + _scale(blocks, 2)
    return values.reshape(out_shape).numpy()
