"""Reading a sentencepiece ``tokenizer.model`` without sentencepiece or protobuf.

The file is a serialized ``ModelProto``; we need only the pieces (text, score, type), the model
type and ``add_dummy_prefix``, so a minimal protobuf wire-format reader does, and it also gives the
piece types (user-defined, ...) that the sentencepiece Python API does not expose.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ssdlib.errors import CheckpointError

# sentencepiece's TrainerSpec.ModelType.
MODEL_UNIGRAM, MODEL_BPE = 1, 2
_NORMAL = 1


@dataclass
class SentencePieceModel:
    pieces: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    # sentencepiece piece types; same numbering as llama.cpp's token types.
    types: list[int] = field(default_factory=list)
    model_type: int = MODEL_UNIGRAM
    add_dummy_prefix: bool = True


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of each field of one message; value is an int or bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > len(buf):
            raise ValueError("message ends early")
        yield number, wire, value


def read_sentencepiece_model(path: str) -> SentencePieceModel:
    """Pieces, scores, types, model type and ``add_dummy_prefix`` of a ``tokenizer.model``."""
    try:
        with open(path, "rb") as f:
            buf = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    model = SentencePieceModel()
    try:
        for number, wire, value in _fields(buf):
            if number == 1 and wire == 2:
                piece, score, kind = "", 0.0, _NORMAL
                for n, w, v in _fields(value):
                    if n == 1 and w == 2:
                        piece = v.decode("utf-8")
                    elif n == 2 and w == 5:
                        score = struct.unpack("<f", v)[0]
                    elif n == 3 and w == 0:
                        kind = v
                model.pieces.append(piece)
                model.scores.append(score)
                model.types.append(kind)
            elif number == 2 and wire == 2:
                for n, w, v in _fields(value):
                    if n == 3 and w == 0:
                        model.model_type = v
            elif number == 3 and wire == 2:
                for n, w, v in _fields(value):
                    if n == 3 and w == 0:
                        model.add_dummy_prefix = bool(v)
    except (ValueError, IndexError, UnicodeDecodeError, struct.error) as e:
        raise CheckpointError(f"{path}: corrupt sentencepiece model ({e})") from None
    if not model.pieces:
        raise CheckpointError(f"{path}: sentencepiece model without pieces")
    return model
