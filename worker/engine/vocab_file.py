"""The model's GGUF without its weights: what a gateway needs to own the model's text.

A GGUF file is a header, its metadata (key, type, value), the tensors' descriptions and
their data. The metadata holds the vocabulary, the chat template and the sampling defaults;
llama.cpp loads a file of the header and the metadata alone with `vocab_only` (it reads the
hyperparameters, then skips the tensors). So the worker sends that, a few MB for a 262k
vocabulary, and a gateway tokenizes exactly as the worker does without the model file.

The metadata is copied byte for byte: it is walked only to find where it ends.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from pathlib import Path

_MAGIC = b"GGUF"
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count
_ALIGNMENT = 32  # GGUF's default; the data section (empty here) starts aligned
# Value types of GGUF metadata: the scalars' sizes; 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def metadata_only(path: Path) -> bytes:
    """The GGUF at `path` with no tensors: the same header version and metadata."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if len(data) < _HEADER.size:
            raise ValueError(f"{path} is too short for a GGUF file")
        magic, version, _, n_metadata = _HEADER.unpack_from(data, 0)
        if magic != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        end = _HEADER.size
        for _ in range(n_metadata):
            end = _skip_string(data, end)  # the key
            (kind,) = struct.unpack_from("<I", data, end)
            end = _skip_value(data, end + 4, kind)
        metadata = data[_HEADER.size : end]
    file_bytes = _HEADER.pack(_MAGIC, version, 0, n_metadata) + metadata
    return file_bytes + b"\0" * (-len(file_bytes) % _ALIGNMENT)


def compressed_metadata(path: Path) -> bytes:
    """metadata_only, zlib-compressed (vocabularies compress about threefold)."""
    return zlib.compress(metadata_only(path), 1)


def _skip_string(data: mmap.mmap, at: int) -> int:
    (length,) = struct.unpack_from("<Q", data, at)
    return at + 8 + length


def _skip_value(data: mmap.mmap, at: int, kind: int) -> int:
    if kind in _SCALAR_BYTES:
        return at + _SCALAR_BYTES[kind]
    if kind == _STRING:
        return _skip_string(data, at)
    if kind == _ARRAY:
        item_kind, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if item_kind in _SCALAR_BYTES:
            return at + count * _SCALAR_BYTES[item_kind]
        for _ in range(count):
            at = _skip_value(data, at, item_kind)
        return at
    raise ValueError(f"unknown GGUF metadata type {kind}")
