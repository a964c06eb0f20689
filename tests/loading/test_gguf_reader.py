"""ssdlib's GGUF header parser against ``gguf.GGUFReader`` (the reference), its errors on
truncated and corrupt files, and its per-process cache."""

from __future__ import annotations

import os
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf.quants import quantize

from ssdlib import gguf_reader
from ssdlib.errors import CheckpointError
from ssdlib.gguf_reader import clear_cache, open_gguf, read_metadata

# A string array long enough that its parsing loop, not the fixed header, dominates.
TOKENS = ["<s>", "", "é", "日本", "a b", "\u0120t"] + [f"tok{i}" for i in range(200)]
NESTED_INTS = [[1, 2], [3, 4, 5]]
NESTED_STRS = [["a", "bc"], ["", "日本"]]


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_cache()
    yield
    clear_cache()


def write_sample(path, *, alignment: int | None = None, extra: dict | None = None,
                 endianess=gguf.GGUFEndian.LITTLE) -> str:
    """Every metadata value type, plain and nested arrays, and tensors of float, int and
    block-quantized types (1-D to 3-D)."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("test.u8", 255)
    w.add_int8("test.i8", -128)
    w.add_uint16("test.u16", 65535)
    w.add_int16("test.i16", -32768)
    w.add_uint32("test.u32", 2**32 - 1)
    w.add_int32("test.i32", -(2**31))
    w.add_uint64("test.u64", 2**64 - 1)
    w.add_int64("test.i64", -(2**63))
    w.add_float32("test.f32", 0.1)
    w.add_float64("test.f64", -1e300)
    w.add_bool("test.true", True)
    w.add_bool("test.false", False)
    w.add_string("test.str", "héllo 日本")
    w.add_key_value("test.empty_str", "", V.STRING)
    for vtype, values in [(V.UINT8, [0, 255]), (V.INT8, [-1, 1]), (V.UINT16, [7, 65535]),
                          (V.INT16, [-7, 8]), (V.UINT32, [1, 2**32 - 1]), (V.INT32, [-5, 5]),
                          (V.UINT64, [2**64 - 1, 0]), (V.INT64, [-(2**63), 3]),
                          (V.FLOAT32, [0.5, 0.1, -2.0]), (V.FLOAT64, [0.1, 1e-300]),
                          (V.BOOL, [True, False, True])]:
        w.add_key_value(f"test.array.{vtype.name.lower()}", values, V.ARRAY, sub_type=vtype)
    w.add_array("test.array.string", TOKENS)
    w.add_array("test.array.nested_int", NESTED_INTS)
    w.add_array("test.array.nested_str", NESTED_STRS)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    rng = np.random.default_rng(0)
    w.add_tensor("f32.weight", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f32.vector", rng.standard_normal(7).astype(np.float32))
    w.add_tensor("f16.weight", rng.standard_normal((2, 3, 4)).astype(np.float16))
    w.add_tensor("i32.ids", np.arange(6, dtype=np.int32))
    for qtype in (Q.Q4_1, Q.Q8_0, Q.BF16):
        data = quantize(rng.standard_normal((4, 64)).astype(np.float32), qtype)
        w.add_tensor(f"{qtype.name.lower()}.weight", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _typed(value):
    """``value`` with the type of every leaf (so True != 1 and 1.0 != 1)."""
    if isinstance(value, list):
        return ["list", [_typed(v) for v in value]]
    return [type(value).__name__, value]


def assert_matches_gguf_reader(path: str, check_data: bool = True) -> None:
    ours = open_gguf(path)
    ref = gguf.GGUFReader(path, "r")
    ref_metadata = {key: field.contents() for key, field in ref.fields.items()}
    metadata = read_metadata(path, ours)
    assert list(metadata) == list(ref_metadata)
    for key, value in ref_metadata.items():
        assert _typed(metadata[key]) == _typed(value), key
    assert ours.alignment == ref.alignment and ours.data_offset == ref.data_offset
    assert len(ours.tensors) == len(ref.tensors)
    for t, r in zip(ours.tensors, ref.tensors):
        assert t.name == r.name
        assert t.tensor_type is r.tensor_type
        assert t.shape.dtype == r.shape.dtype and t.shape.tolist() == r.shape.tolist()
        assert (t.n_elements, t.n_bytes, t.data_offset) == (r.n_elements, r.n_bytes,
                                                           r.data_offset), t.name
        assert type(t.data) is type(r.data), t.name
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape, t.name
        assert not t.data.flags.writeable
        if check_data:
            assert t.data.tobytes() == r.data.tobytes(), t.name


# --- (a) tiny files written by GGUFWriter -------------------------------------------------------

@pytest.mark.parametrize("alignment", [None, 64, 1])
def test_sample_matches_gguf_reader(tmp_path, alignment):
    path = write_sample(tmp_path / "sample.gguf", alignment=alignment)
    assert_matches_gguf_reader(path)
    metadata = read_metadata(path, open_gguf(path))
    assert metadata["test.array.string"] == TOKENS
    assert metadata["test.array.nested_int"] == [1, 2, 3, 4, 5]  # flattened, as contents() does
    assert metadata["test.array.nested_str"] == ["a", "bc", "", "日本"]
    assert open_gguf(path).alignment == (alignment or 32)


def test_version_2_matches_gguf_reader(tmp_path):
    data = bytearray(open(write_sample(tmp_path / "v3.gguf"), "rb").read())
    data[4:8] = struct.pack("<I", 2)  # v2 and v3 share the layout (v3 added big-endian files)
    path = tmp_path / "v2.gguf"
    path.write_bytes(data)
    assert_matches_gguf_reader(str(path))
    assert read_metadata(str(path), open_gguf(path))["GGUF.version"] == 2


def test_tiny_llama_matches_gguf_reader(tiny_gguf):
    for qtype in (None, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1):
        assert_matches_gguf_reader(tiny_gguf(qtype).path)


def test_read_metadata_accepts_a_gguf_reader(tmp_path):
    path = write_sample(tmp_path / "sample.gguf")
    assert read_metadata(path, gguf.GGUFReader(path)) == read_metadata(path, open_gguf(path))


# --- (b) the real SmolLM2 file ------------------------------------------------------------------

def test_smollm2_matches_gguf_reader(smollm2_path):
    assert_matches_gguf_reader(smollm2_path)
    metadata = read_metadata(smollm2_path, open_gguf(smollm2_path))
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152


# --- (c) truncated and corrupt files ------------------------------------------------------------

_ERROR = r"(not a GGUF file|corrupt or truncated GGUF file|truncated GGUF file)"


def _expect_error(path, match: str = _ERROR) -> CheckpointError:
    with pytest.raises(CheckpointError, match=match) as err:
        open_gguf(str(path))
    assert str(path) in str(err.value)
    return err.value


def test_truncated_at_every_header_offset(tmp_path):
    good = write_sample(tmp_path / "good.gguf")
    data = open(good, "rb").read()
    end = open_gguf(good).data_offset
    cuts = list(range(0, end + 1)) + [end + 1, len(data) // 2, len(data) - 1]
    for cut in cuts:
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        _expect_error(path)
        path.unlink()


def _patched(tmp_path, name: str, data: bytes, offset: int, value: bytes):
    out = bytearray(data)
    out[offset:offset + len(value)] = value
    path = tmp_path / name
    path.write_bytes(out)
    return path


def _after_key(data: bytes, key: str) -> int:
    """Offset of the value type that follows ``key`` in the header."""
    raw = key.encode()
    return data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)


def _tensor_info(data: bytes, name: str) -> int:
    """Offset of n_dims in the tensor info of ``name``."""
    raw = name.encode()
    return data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)


def test_corrupt_headers(tmp_path):
    data = open(write_sample(tmp_path / "good.gguf", extra={"test.dup_a": "x",
                                                            "test.dup_b": "y"}), "rb").read()
    big = struct.pack("<Q", 2**62)
    tokens = _after_key(data, "test.array.string")
    f32 = _tensor_info(data, "f32.weight")
    cases = {
        "magic": (0, b"GGUG", "not a GGUF file"),
        "version1": (4, struct.pack("<I", 1), "GGUF version 1 is not supported"),
        "version9": (4, struct.pack("<I", 9), "GGUF version 9 is not supported"),
        "tensor_count": (8, big, "tensors cannot fit"),
        "kv_count": (16, big, "key/value pairs cannot fit"),
        "key_length": (24, big, "key #0 at offset 32 needs"),
        "value_type": (_after_key(data, "test.u8"), struct.pack("<I", 99), "unknown value type 99"),
        "item_type": (tokens + 4, struct.pack("<I", 77), "unknown item type 77"),
        "array_length": (tokens + 8, big, "'test.array.string' .* strings"),
        "string_length": (tokens + 16, big, r"'test.array.string'\[0\]"),
        "string_utf8": (tokens + 24, b"\xff", "not UTF-8"),
        "key_utf8": (32, b"\xff", "not UTF-8"),
        "n_dims": (f32, struct.pack("<I", 2**31), "dimensions of 'f32.weight'"),
        "dim": (f32 + 4, big, "truncated GGUF file: tensor 'f32.weight' needs bytes"),
        "tensor_type": (f32 + 4 + 16, struct.pack("<I", 1000), "unknown type 1000"),
        "tensor_offset": (f32 + 4 + 16 + 4, big, "tensor 'f32.weight' needs bytes up to"),
        "duplicate_key": (data.index(b"test.dup_b") + 9, b"a", "duplicate metadata key"),
        "duplicate_tensor": (_tensor_info(data, "f32.vector") - 6, b"weight",
                             "duplicate tensor 'f32.weight'"),
    }
    for name, (offset, value, match) in cases.items():
        err = _expect_error(_patched(tmp_path, f"{name}.gguf", data, offset, value), match)
        assert f"{name}.gguf" in str(err), name


def test_bad_alignment(tmp_path):
    data = open(write_sample(tmp_path / "good.gguf", alignment=64), "rb").read()
    at = _after_key(data, "general.alignment")
    _expect_error(_patched(tmp_path, "odd.gguf", data, at + 4, struct.pack("<I", 48)),
                  "general.alignment = 48 is not a power of two")
    _expect_error(_patched(tmp_path, "typed.gguf", data, at, struct.pack("<I", V.INT32)),
                  "general.alignment is not a uint32")


def test_big_endian_refused(tmp_path):
    path = write_sample(tmp_path / "big.gguf", endianess=gguf.GGUFEndian.BIG)
    gguf.GGUFReader(path)  # the reference reads it (byte-swapped); ssdlib refuses it clearly
    _expect_error(path, "big-endian GGUF file .*little-endian GGUF files only")


def test_missing_and_empty_files(tmp_path):
    _expect_error(tmp_path / "nope.gguf", "cannot open GGUF file")
    (tmp_path / "empty.gguf").write_bytes(b"")
    _expect_error(tmp_path / "empty.gguf", "not a GGUF file")


# --- (d) the cache ------------------------------------------------------------------------------

@pytest.fixture
def parses(monkeypatch):
    calls = []
    real = gguf_reader._parse

    def counting(path, mm):
        calls.append(path)
        return real(path, mm)

    monkeypatch.setattr(gguf_reader, "_parse", counting)
    return calls


def test_cache_reuses_an_unchanged_file(tmp_path, parses):
    path = write_sample(tmp_path / "sample.gguf")
    first = open_gguf(path)
    link = tmp_path / "link.gguf"
    link.symlink_to(path)
    assert open_gguf(path) is first and open_gguf(link) is first
    assert len(parses) == 1
    # Each caller gets its own metadata lists.
    read_metadata(path, first)["test.array.string"].append("x")
    assert read_metadata(path, open_gguf(path))["test.array.string"] == TOKENS


def test_cache_rereads_a_changed_file(tmp_path, parses):
    path = write_sample(tmp_path / "sample.gguf")
    first = open_gguf(path)
    # Rewritten in place (new size).
    write_sample(path, extra={"test.new": "value"})
    second = open_gguf(path)
    assert second is not first and len(parses) == 2
    assert read_metadata(path, second)["test.new"] == "value"
    # Same size, new modification time.
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert open_gguf(path) is not second and len(parses) == 3
    # Replaced by another file (new inode) of the same size and time.
    other = tmp_path / "other.gguf"
    other.write_bytes(open(path, "rb").read())
    st = os.stat(path)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    open_gguf(path)
    assert len(parses) == 4


def test_cache_is_bounded(tmp_path, parses, monkeypatch):
    monkeypatch.setattr(gguf_reader, "CACHE_SIZE", 2)
    paths = [write_sample(tmp_path / f"s{i}.gguf") for i in range(3)]
    for p in paths:
        open_gguf(p)
    assert len(gguf_reader._cache) == 2
    open_gguf(paths[2])
    open_gguf(paths[1])
    assert len(parses) == 3
    open_gguf(paths[0])  # evicted: read again
    assert len(parses) == 4
    # An evicted file's tensors stay readable by whoever holds them.
    clear_cache()
    t = open_gguf(paths[0]).tensors[0]
    clear_cache()
    assert np.isfinite(t.data).all()
