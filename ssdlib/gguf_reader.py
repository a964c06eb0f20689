"""Opening a GGUF file: the reader and its key/value metadata, with clear errors.

``gguf.GGUFReader`` parses the whole header (metadata and tensor table) when it opens a file and
memory-maps the tensor data. A truncated or corrupt file makes it fail deep inside numpy; here that
becomes one :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import gguf

from ssdlib.errors import CheckpointError

_MAGIC = b"GGUF"

# What GGUFReader raises on bad bytes: short reads (ValueError/IndexError from numpy), bad
# enum values, undecodable strings, absurd sizes.
_PARSE_ERRORS = (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError, OverflowError,
                 MemoryError, struct.error)


def open_gguf(path: str) -> gguf.GGUFReader:
    """A reader for the GGUF file ``path`` (metadata parsed, tensors memory-mapped)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open GGUF file ({e.strerror or e})") from None
    if magic != _MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (bad magic {magic!r})")
    try:
        reader = gguf.GGUFReader(path, "r")
    except _PARSE_ERRORS as e:
        raise CheckpointError(f"{path}: corrupt or truncated GGUF file "
                              f"({type(e).__name__}: {e})") from None
    _check_tensor_extents(path, reader)
    return reader


def _check_tensor_extents(path: str, reader: gguf.GGUFReader) -> None:
    """Every tensor's bytes must lie inside the file (the reader checks only some cases)."""
    size = os.path.getsize(path)
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise CheckpointError(
                f"{path}: truncated GGUF file: tensor {t.name!r} needs bytes up to {end}, the file "
                f"has {size}")


def read_metadata(path: str, reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value fields as Python values (lists for arrays)."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            metadata[key] = field.contents()
        except _PARSE_ERRORS as e:
            raise CheckpointError(f"{path}: corrupt GGUF metadata field {key!r} "
                                  f"({type(e).__name__}: {e})") from None
    return metadata
