"""The torch block decoders equal gguf.quants (the reference) bit for bit, on random blocks of
every type they take and on the real SmolLM2 GGUF when it is installed; other types pass through
to gguf.quants."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference

from ssdlib.loading.dequant import FAST_TYPES, dequantize

Q = GGMLQuantizationType


def random_blocks(qtype, rows: int, blocks: int, seed: int) -> np.ndarray:
    """uint8 rows of ``blocks`` random blocks whose float16 scales are finite."""
    _, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * blocks, size), dtype=np.uint8)
    scales = 2 if qtype == Q.Q4_1 else 1  # d (and m)
    raw[:, :2 * scales] = rng.normal(0, 0.05, (rows * blocks, scales)).astype(
        np.float16).view(np.uint8)
    return raw.reshape(rows, blocks * size)


@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (3, 4), (17, 9)])
def test_equal_to_gguf_quants(qtype, rows, blocks):
    raw = random_blocks(qtype, rows, blocks, seed=rows * 31 + blocks)
    want = reference(raw, qtype)
    got = dequantize(raw, qtype)
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want)
    # a row slice of a memory-mapped tensor (read-only) decodes the same
    ro = raw[rows // 2:].copy()
    ro.setflags(write=False)
    assert np.array_equal(dequantize(ro, qtype), reference(ro, qtype))
    assert dequantize(raw[:0], qtype).shape == (0, blocks * GGML_QUANT_SIZES[qtype][0])


def test_other_types_and_bad_input():
    f16 = np.arange(12, dtype=np.float16).reshape(3, 4)
    assert np.array_equal(dequantize(f16, Q.F16), reference(f16, Q.F16))
    with pytest.raises(ValueError, match="whole 20-byte blocks"):
        dequantize(np.zeros((2, 30), dtype=np.uint8), Q.Q4_1)


def test_real_file_equal(smollm2_path):
    from ssdlib.gguf_reader import open_gguf

    tensors = [t for t in open_gguf(smollm2_path).tensors if t.tensor_type in FAST_TYPES]
    assert tensors
    for t in tensors[:24]:  # a sample: every type present, kept quick
        assert np.array_equal(dequantize(t.data, t.tensor_type),
                              reference(t.data, t.tensor_type)), t.name
