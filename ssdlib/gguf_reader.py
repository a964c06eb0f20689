"""Opening a GGUF file: its key/value metadata and tensor table, with clear errors.

The header (GGUF versions 2 and 3, little-endian) is parsed here with ``struct`` over one memory
map of the file; ``gguf`` is kept for what it does well: the type enums, ``GGML_QUANT_SIZES`` and
dequantization. (``gguf.GGUFReader`` builds one numpy view per metadata item, so a 49k-token
vocabulary and its merges took seconds to open; this parser reads them in one loop.) Tensors and
metadata come out exactly as ``GGUFReader`` gives them: ``tensor.data`` is a read-only view of the
memory map (float/int types as their numpy dtype, block-quantized types as rows of uint8), and
metadata values are what ``ReaderField.contents()`` returns (Python scalars, strings, lists).

A truncated or corrupt file becomes one :class:`CheckpointError` naming the file. Big-endian
files are refused (``GGUFReader`` would byte-swap the header, but quantized blocks would still be
little-endian to ``gguf.quants``). Nested arrays are flattened, as ``contents()`` flattens them.

Each file is parsed once per process: :func:`open_gguf` keeps the last few files it opened
(:data:`CACHE_SIZE`), keyed by real path, inode, size and modification time, so loading a model,
its tokenizer and a draft-compatibility check from the same file parses it once, and a rewritten
file is read again. An evicted entry only drops the cache's reference: tensors still held by a
model keep their memory map alive, and nothing else does.
"""

from __future__ import annotations

import math
import os
import struct
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from ssdlib.errors import CheckpointError

_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Files kept parsed (and mapped) by open_gguf; see the module docstring.
CACHE_SIZE = 4

# What GGUFReader raises on bad bytes (a reader passed to read_metadata may still be one).
_PARSE_ERRORS = (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError, OverflowError,
                 MemoryError, struct.error)

_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from
# Fixed-size value types: struct format (one value) and numpy dtype (an array of them).
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    GGUFValueType.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    GGUFValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    GGUFValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    GGUFValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    GGUFValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    GGUFValueType.BOOL: (struct.Struct("<?"), np.dtype("?")),
    GGUFValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    GGUFValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
# Tensor types GGUFReader exposes as typed elements; every other type as rows of uint8 blocks.
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
# Smallest encodings, to refuse absurd counts before looping over them.
_MIN_KV_BYTES = 8 + 4 + 1        # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_MIN_ARRAY_BYTES = 4 + 8          # item type, length


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file: the fields of ``gguf.ReaderTensor`` that ssdlib uses."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray          # uint64, GGUF order (fastest-varying dimension first)
    n_elements: int
    n_bytes: int
    data_offset: int           # absolute offset in the file
    data: np.ndarray           # read-only view of the memory map (see the module docstring)


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> value, with ``GGUF.version``,
    ``GGUF.tensor_count`` and ``GGUF.kv_count`` first, as ``GGUFReader.fields`` has them) and
    ``tensors`` (file order) over a read-only memory map of the file."""

    def __init__(self, path: str, version: int, alignment: int, data_offset: int,
                 metadata: dict[str, Any], tensors: list[GGUFTensor]):
        self.path = path
        self.version = version
        self.alignment = alignment
        self.data_offset = data_offset
        self.metadata = metadata
        self.tensors = tensors

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, version={self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors)")


class _Corrupt(Exception):
    """A parse error; open_gguf turns it into a CheckpointError naming the file."""


class _Parser:
    """Reads the header of a GGUF file from ``buf`` (a memoryview of the whole file)."""

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.size = len(buf)
        self.off = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.off + n > self.size:
            raise _Corrupt(f"truncated: {what} at offset {self.off} needs {n} bytes, the file "
                           f"has {self.size - self.off} left")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32(self.buf, self.off)
        self.off += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64(self.buf, self.off)
        self.off += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        self.need(n, what)
        start = self.off
        self.off += n
        try:
            return str(self.buf[start:self.off], "utf-8")
        except UnicodeDecodeError as e:
            raise _Corrupt(f"{what} at offset {start} is not UTF-8 ({e.reason})") from None

    def value(self, vtype: int, what: str) -> Any:
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            fmt = scalar[0]
            self.need(fmt.size, what)
            (v,) = fmt.unpack_from(self.buf, self.off)
            self.off += fmt.size
            return v
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            out: list[Any] = []
            self.array_into(out, what)
            return out
        raise _Corrupt(f"{what} has unknown value type {vtype}")

    def array_into(self, out: list[Any], what: str) -> None:
        """Append the items of the array at ``off`` to ``out`` (nested arrays flattened, as
        ``ReaderField.contents()`` does)."""
        itype = self.u32(f"{what} item type")
        n = self.u64(f"{what} length")
        scalar = _SCALARS.get(itype)
        if scalar is not None:
            dtype = scalar[1]
            self.need(n * dtype.itemsize, f"{what} ({n} items)")
            out.extend(np.frombuffer(self.buf, dtype, n, self.off).tolist())
            self.off += n * dtype.itemsize
        elif itype == GGUFValueType.STRING:
            self.need(n * 8, f"{what} ({n} strings)")
            buf, size, off, append = self.buf, self.size, self.off, out.append
            for i in range(n):
                if off + 8 > size:
                    self.off = off
                    self.need(8, f"{what}[{i}] length")
                (ln,) = _U64(buf, off)
                off += 8
                end = off + ln
                if end > size:
                    self.off = off
                    self.need(ln, f"{what}[{i}]")
                try:
                    append(str(buf[off:end], "utf-8"))
                except UnicodeDecodeError as e:
                    raise _Corrupt(f"{what}[{i}] at offset {off} is not UTF-8 "
                                   f"({e.reason})") from None
                off = end
            self.off = off
        elif itype == GGUFValueType.ARRAY:
            self.need(n * _MIN_ARRAY_BYTES, f"{what} ({n} arrays)")
            for i in range(n):
                self.array_into(out, f"{what}[{i}]")
        else:
            raise _Corrupt(f"{what} has unknown item type {itype}")


def _extent_error(path: str, name: str, end: int, size: int) -> CheckpointError:
    return CheckpointError(f"{path}: truncated GGUF file: tensor {name!r} needs bytes up to {end}, "
                           f"the file has {size}")


def _parse(path: str, mm: np.memmap) -> GGUFFile:
    with memoryview(mm) as buf:
        p = _Parser(buf)
        p.need(4, "magic")
        if bytes(buf[:4]) != _MAGIC:
            raise _Corrupt(f"bad magic {bytes(buf[:4])!r}")
        p.off = 4
        version = p.u32("version")
        if version & 0xFFFF == 0 and version:
            # GGUFReader's test: a small version number read in the wrong byte order.
            raise CheckpointError(f"{path}: big-endian GGUF file (version "
                                  f"{int.from_bytes(bytes(buf[4:8]), 'big')}); ssdlib reads "
                                  "little-endian GGUF files only")
        if version not in SUPPORTED_VERSIONS:
            raise CheckpointError(f"{path}: GGUF version {version} is not supported (ssdlib "
                                  f"reads versions {', '.join(map(str, SUPPORTED_VERSIONS))})")
        tensor_count = p.u64("tensor count")
        kv_count = p.u64("key/value count")
        if kv_count * _MIN_KV_BYTES > p.size - p.off:
            raise _Corrupt(f"{kv_count} key/value pairs cannot fit in the file")
        if tensor_count * _MIN_TENSOR_INFO_BYTES > p.size - p.off:
            raise _Corrupt(f"{tensor_count} tensors cannot fit in the file")

        metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count,
                                    "GGUF.kv_count": kv_count}
        alignment = DEFAULT_ALIGNMENT
        for i in range(kv_count):
            key = p.string(f"key #{i}")
            vtype = p.u32(f"type of {key!r}")
            if key in metadata:
                raise _Corrupt(f"duplicate metadata key {key!r}")
            metadata[key] = value = p.value(vtype, repr(key))
            if key == "general.alignment":
                if vtype != GGUFValueType.UINT32:
                    raise _Corrupt("general.alignment is not a uint32")
                if value == 0 or value & (value - 1):
                    raise _Corrupt(f"general.alignment = {value} is not a power of two")
                alignment = value

        infos = []
        for i in range(tensor_count):
            name = p.string(f"name of tensor #{i}")
            n_dims = p.u32(f"dimension count of {name!r}")
            p.need(8 * n_dims, f"dimensions of {name!r}")
            dims = np.frombuffer(buf, "<u8", n_dims, p.off).astype(np.uint64)
            dims.flags.writeable = False
            p.off += 8 * n_dims
            raw_type = p.u32(f"type of {name!r}")
            offset = p.u64(f"offset of {name!r}")
            infos.append((name, dims, raw_type, offset))
        data_offset = p.off + (-p.off % alignment)

    tensors = []
    names = set()
    size = len(mm)
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise _Corrupt(f"duplicate tensor {name!r}")
        names.add(name)
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise _Corrupt(f"tensor {name!r} has unknown type {raw_type}") from None
        n_elements = math.prod(int(d) for d in dims)
        n_bytes = n_elements * type_size // block_size
        start = data_offset + offset
        if start + n_bytes > size:
            raise _extent_error(path, name, start + n_bytes, size)
        np_dims = tuple(int(d) for d in reversed(dims.tolist()))
        item_type = _ELEMENT_DTYPES.get(ggml_type)
        if item_type is None:
            item_type = np.uint8
            try:
                np_dims = quant_shape_to_byte_shape(np_dims, ggml_type)
            except (ValueError, IndexError) as e:
                raise _Corrupt(f"tensor {name!r}: {e or 'no dimensions'}") from None
        data = mm[start:start + n_bytes].view(item_type).reshape(np_dims)
        tensors.append(GGUFTensor(name, ggml_type, dims, n_elements, n_bytes, start, data))
    return GGUFFile(path, version, alignment, data_offset, metadata, tensors)


_cache: OrderedDict[tuple, GGUFFile] = OrderedDict()
_cache_lock = threading.Lock()


def clear_cache() -> None:
    """Forget every parsed file (their memory maps close once no tensor refers to them)."""
    with _cache_lock:
        _cache.clear()


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The parsed GGUF file ``path`` (metadata read, tensors memory-mapped); the same object
    again while the file is unchanged and among the last :data:`CACHE_SIZE` opened."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            with _cache_lock:
                cached = _cache.get(key)
                if cached is not None:
                    _cache.move_to_end(key)
                    return cached
            magic = f.read(4)
            if magic != _MAGIC:
                raise CheckpointError(f"{path}: not a GGUF file (bad magic {magic!r})")
            mm = np.memmap(f, mode="r")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open GGUF file ({e.strerror or e})") from None
    try:
        parsed = _parse(path, mm)
    except _Corrupt as e:
        raise CheckpointError(f"{path}: corrupt or truncated GGUF file ({e})") from None
    _check_tensor_extents(path, parsed)
    with _cache_lock:
        _cache[key] = parsed
        _cache.move_to_end(key)
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return parsed


def _check_tensor_extents(path: str, reader: GGUFFile | gguf.GGUFReader) -> None:
    """Every tensor's bytes must lie inside the file (``GGUFReader`` checks only some cases)."""
    size = os.path.getsize(path)
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise _extent_error(path, t.name, end, size)


def read_metadata(path: str, reader: GGUFFile | gguf.GGUFReader) -> dict[str, Any]:
    """All key/value fields as Python values (lists for arrays), as ``ReaderField.contents()``
    gives them; a new dict and new lists (the parsed file is shared by everyone who opens it)."""
    if isinstance(reader, GGUFFile):
        return {k: list(v) if isinstance(v, list) else v for k, v in reader.metadata.items()}
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            metadata[key] = field.contents()
        except _PARSE_ERRORS as e:
            raise CheckpointError(f"{path}: corrupt GGUF metadata field {key!r} "
                                  f"({type(e).__name__}: {e})") from None
    return metadata
