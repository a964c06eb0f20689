"""GGUF checkpoints (llama.cpp's single-file format): Llama weights served under HF names.

Tensors are dequantized to float32 on demand (``dequant.py``: torch for Q4_0, Q4_1 and Q8_0,
the ``gguf`` package for the other types). Two details matter:

* llama.cpp's converter permutes the rows of ``q_proj``/``k_proj`` within each head (it pairs
  rotary dimensions ``(i, i + d/2)`` as adjacent rows, its RoPE layout). We undo it exactly as
  transformers' GGUF loader does, so weights equal the HF checkpoint's (and HF's GGUF load).
* Quantized blocks run along rows, so a row slice (``dim=0``: a column-parallel shard) is
  dequantized alone. A column slice (``dim=1``: a row-parallel shard) needs whole rows; that full
  tensor is kept in a small LRU (``cache_bytes``), as the next shard usually wants the same one.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np
import torch
from gguf import GGMLQuantizationType
from ssdlib.loading.dequant import dequantize

from ssdlib.config import ModelConfig
from ssdlib.errors import CheckpointError
from ssdlib.gguf_reader import GGUFFile, GGUFTensor, open_gguf, read_metadata
from ssdlib.loading.checkpoint_types import Checkpoint
from ssdlib.loading.gguf_config import config_from_gguf
from ssdlib.loading.llama_names import expected_shapes, hf_name_for_gguf
from ssdlib.tokenizer import tokenizer_from_gguf

SUPPORTED_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                   GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
DEFAULT_CACHE_BYTES = 256 << 20
_ROPE_FREQS = "rope_freqs.weight"


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation: rows ``[head, d/2, 2]`` -> ``[head, 2, d/2]``."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _torch_order(shape) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first (ggml's ne[]); torch lists them slowest-first.
    return tuple(int(d) for d in reversed(list(shape)))


class GGUFWeights:
    """A :class:`~ssdlib.loading.checkpoint.WeightSource` over a GGUF file (float32 tensors)."""

    def __init__(self, path: str, reader: GGUFFile, config: ModelConfig,
                 cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.path = path
        self._tensors: dict[str, GGUFTensor] = {}
        self._head_dim = config.head_dim
        # Rows of these tensors are permuted by llama.cpp, in groups of head_dim rows per head.
        self._permuted: set[str] = set()
        expected = expected_shapes(config)
        unknown = []
        for t in reader.tensors:
            hf = hf_name_for_gguf(t.name)
            if hf not in expected:
                # Not a Llama weight, or a layer past block_count.
                if t.name != _ROPE_FREQS:
                    unknown.append(t.name)
                continue
            found, want = _torch_order(t.shape), expected[hf]
            if found != want:
                raise CheckpointError(f"{path}: tensor {hf!r} (GGUF {t.name!r}) has shape "
                                      f"{list(found)}, expected {list(want)} from the config")
            if t.tensor_type not in SUPPORTED_TYPES:
                raise CheckpointError(
                    f"{path}: tensor {t.name!r} is stored as {t.tensor_type.name}; ssdlib reads "
                    f"{', '.join(q.name for q in SUPPORTED_TYPES)} GGUF tensors")
            self._tensors[hf] = t
            if hf.endswith(("q_proj.weight", "k_proj.weight")):
                self._permuted.add(hf)
        if unknown:
            raise CheckpointError(f"{path}: tensors that are not part of a Llama model with this "
                                  "config: "
                                  f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
        missing = [n for n in expected if n not in self._tensors]
        if missing:
            raise CheckpointError(f"{path}: missing tensors: {', '.join(missing[:5])}"
                                  f"{' ...' if len(missing) > 5 else ''}")
        self._shapes = expected
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_bytes = cache_bytes

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            raise CheckpointError(f"{self.path}: tensor {name!r} missing from the checkpoint")
        return self._shapes[name]

    def get(self, name: str, dim: int | None = None, start: int = 0,
            stop: int | None = None) -> torch.Tensor:
        """The float32 tensor ``name``, or its slice ``[start:stop]`` along ``dim`` (a new tensor
        the caller owns)."""
        shape = self.shape(name)
        if dim is None:
            return self._dequantize(name)
        if not -len(shape) <= dim < len(shape):
            raise IndexError(f"dim {dim} out of range for {name!r} of shape {list(shape)}")
        dim %= len(shape)
        start, stop, step = slice(start, stop).indices(shape[dim])
        if step != 1 or stop < start:
            raise IndexError(f"bad slice [{start}:{stop}] of {name!r} along dim {dim}")
        cached = self._cache.get(name)
        if cached is not None:
            self._cache.move_to_end(name)
            return cached.narrow(dim, start, stop - start).clone()
        if dim == 0 and (name not in self._permuted
                         or (start % self._head_dim == 0 and stop % self._head_dim == 0)):
            return self._dequantize(name, start, stop)
        full = self._dequantize(name)
        self._remember(name, full)
        return full.narrow(dim, start, stop - start).clone()

    def _remember(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if size > self._cache_bytes:
            return
        self._cache[name] = tensor
        while sum(t.numel() * t.element_size() for t in self._cache.values()) > self._cache_bytes:
            self._cache.popitem(last=False)

    def _dequantize(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start:stop]`` of ``name`` as float32, q/k un-permuted (whole heads only)."""
        t = self._tensors[name]
        raw = t.data if stop is None else t.data[start:stop]
        try:
            values = dequantize(raw, t.tensor_type)
        except (ValueError, IndexError) as e:
            raise CheckpointError(f"{self.path}: cannot dequantize tensor {t.name!r} "
                                  f"({type(e).__name__}: {e})") from None
        if name in self._permuted:
            values = unpermute_rope_rows(values, values.shape[0] // self._head_dim)
        values = np.ascontiguousarray(values, dtype=np.float32)
        if not values.flags.writeable:
            # F32 tensors come back as read-only views of the memory map: the caller gets a copy.
            values = values.copy()
        return torch.from_numpy(values)


# the tokenizers built from GGUF files in this process, by (real path, size, mtime): a target
# and the draft naming it share one (built once: ~0.35 s for SmolLM2's vocabulary; and the
# draft's compatibility check is then a comparison of one object with itself)
_TOKENIZERS: dict[tuple, object] = {}


def _shared_tokenizer(path: str, metadata):
    try:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    except OSError:
        return tokenizer_from_gguf(metadata)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = tokenizer_from_gguf(metadata)
    return _TOKENIZERS[key]


def load_gguf(path: str, cache_bytes: int = DEFAULT_CACHE_BYTES) -> Checkpoint:
    """A Llama GGUF file as a :class:`Checkpoint`: config and shapes checked now, tensors
    dequantized when read, the tokenizer built from the file's vocabulary on first use."""
    reader = open_gguf(path)
    metadata = read_metadata(path, reader)
    shapes = {t.name: _torch_order(t.shape) for t in reader.tensors}
    rope_freqs = None
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            rope_freqs = dequantize(t.data, t.tensor_type)
    config = config_from_gguf(path, metadata, shapes, rope_freqs)
    weights = GGUFWeights(path, reader, config, cache_bytes=cache_bytes)

    def tokenizer_factory():
        return _shared_tokenizer(path, metadata)

    return Checkpoint(source=path, config=config, weights=weights,
                      tokenizer_factory=tokenizer_factory)
