"""A GGUF file's metadata (its key-value header), read in one pass without touching the weights.

Why not ``gguf.GGUFReader``: it maps every scalar of every field to a numpy view, about 2 µs
each, so the 262k-token vocabulary of the embedded Gemma 3 takes 17 s to open, and that was paid
by every ``bench --dry-run`` that checks a prompt length against the model's context. The format
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) is a little-endian header followed by
typed key-value pairs; here each scalar array is one ``numpy.frombuffer`` and each string array a
loop over length-prefixed bytes, so the same header reads in well under a second. The values are
what ``GGUFReader``'s ``contents()`` gives (a test compares the two on the embedded SmolLM2).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

GGUF_MAGIC = b"GGUF"
#: value type -> numpy dtype of its scalars (little-endian), by the format's numbering
SCALAR_TYPES = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("<u1"),  # bool, one byte
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
BOOL, STRING, ARRAY = 7, 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF file, or its header ends early."""


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFFormatError(f"the header ends early ({len(data)} of {n} bytes at offset {f.tell()})")
    return data


def _u32(f: BinaryIO) -> int:
    return struct.unpack("<I", _read(f, 4))[0]


def _u64(f: BinaryIO) -> int:
    return struct.unpack("<Q", _read(f, 8))[0]


def _string(f: BinaryIO) -> str:
    return _read(f, _u64(f)).decode("utf-8", errors="replace")


def _scalar(f: BinaryIO, kind: int) -> Any:
    if kind == STRING:
        return _string(f)
    dtype = SCALAR_TYPES.get(kind)
    if dtype is None:
        raise GGUFFormatError(f"unknown value type {kind} at offset {f.tell()}")
    value = np.frombuffer(_read(f, dtype.itemsize), dtype)[0].item()
    return bool(value) if kind == BOOL else value


def _array(f: BinaryIO) -> list:
    kind, count = _u32(f), _u64(f)
    if kind == STRING:
        return [_string(f) for _ in range(count)]
    if kind == ARRAY:
        return [_array(f) for _ in range(count)]
    dtype = SCALAR_TYPES.get(kind)
    if dtype is None:
        raise GGUFFormatError(f"unknown array type {kind} at offset {f.tell()}")
    values = np.frombuffer(_read(f, dtype.itemsize * count), dtype).tolist()
    return [bool(v) for v in values] if kind == BOOL else values


def read_metadata(path: str | Path, done: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
    """The key-value metadata of the GGUF file at ``path``, in file order; with ``done``, reading
    stops as soon as ``done(fields so far)`` is true (the general and architecture keys come before
    the tokenizer's large arrays)."""
    fields: dict[str, Any] = {}
    with open(path, "rb", buffering=1 << 20) as f:
        if _read(f, 4) != GGUF_MAGIC:
            raise GGUFFormatError(f"not a GGUF file (no GGUF magic): {path}")
        version = _u32(f)
        if version < 2:
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and later are): {path}")
        _u64(f)  # tensor count
        for _ in range(_u64(f)):
            key = _string(f)
            kind = _u32(f)
            fields[key] = _array(f) if kind == ARRAY else _scalar(f, kind)
            if done is not None and done(fields):
                break
    return fields


def context_length(path: str | Path) -> int:
    """The model's ``<arch>.context_length`` (0 when the file does not say)."""

    def found(fields: dict[str, Any]) -> bool:
        arch = fields.get("general.architecture")
        return arch is not None and f"{arch}.context_length" in fields

    fields = read_metadata(path, found)
    return int(fields.get(f"{fields.get('general.architecture')}.context_length") or 0)
