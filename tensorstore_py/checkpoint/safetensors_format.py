"""The safetensors format: an 8-byte little-endian header length, a JSON header,
then the raw little-endian C-order bytes of every tensor.

The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [a, b]}``
(offsets relative to the first byte after the header) and may hold
``"__metadata__"``: a str -> str map. A Hugging Face model split into several files
has ``model.safetensors.index.json``: ``{"metadata": {...}, "weight_map": {name: file}}``.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from tensorstore_py.core.errors import DataCorruptionError, InvalidArgumentError

__all__ = [
    "INDEX_NAME",
    "SINGLE_NAME",
    "TensorEntry",
    "dtype_of",
    "encode_header",
    "parse_header",
    "tag_of",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: a header larger than this is refused as corrupt (the safetensors library's own limit)
MAX_HEADER_BYTES = 100_000_000

_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"), "I64": np.dtype("<i8"), "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_TAGS = {dt.newbyteorder("="): tag for tag, dt in _DTYPES.items()}


def dtype_of(tag: str, *, where: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype tag (``"BF16"``)."""
    dt = _DTYPES.get(tag)
    if dt is None:
        raise DataCorruptionError(f"{where}: unsupported safetensors dtype {tag!r}; known: {sorted(_DTYPES)}")
    return dt


def tag_of(dtype: np.dtype, *, name: str) -> str:
    """The safetensors dtype tag of a numpy dtype."""
    tag = _TAGS.get(np.dtype(dtype).newbyteorder("="))
    if tag is None:
        raise InvalidArgumentError(
            f"array {name!r} has dtype {dtype}, which safetensors can not store; it stores {sorted(_DTYPES)}"
        )
    return tag


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: where its bytes are (``start`` counts from the file's first byte)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


def header_length(first8: bytes, *, where: str) -> int:
    if len(first8) != 8:
        raise DataCorruptionError(f"{where}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", first8)
    if n > MAX_HEADER_BYTES:
        raise DataCorruptionError(f"{where}: safetensors header of {n} bytes (at most {MAX_HEADER_BYTES} expected)")
    return int(n)


def parse_header(raw: bytes, *, where: str) -> tuple[list[TensorEntry], dict[str, str]]:
    """The tensors (file offsets) and ``__metadata__`` of a header; checks every entry."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataCorruptionError(f"{where}: safetensors header is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise DataCorruptionError(f"{where}: safetensors header is not a JSON object")
    base = 8 + len(raw)
    meta = doc.pop("__metadata__", None) or {}
    out = []
    for name, entry in doc.items():
        try:
            dt = dtype_of(entry["dtype"], where=f"{where} tensor {name!r}")
            shape = tuple(int(n) for n in entry["shape"])
            a, b = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise DataCorruptionError(f"{where}: tensor {name!r} has a malformed header entry {entry!r}") from err
        if b - a != math.prod(shape) * dt.itemsize or a < 0 or any(n < 0 for n in shape):
            raise DataCorruptionError(
                f"{where}: tensor {name!r} of shape {shape} and dtype {entry['dtype']} needs "
                f"{math.prod(shape) * dt.itemsize} bytes, its data_offsets {[a, b]} hold {b - a}"
            )
        out.append(TensorEntry(name, dt, shape, base + a, base + b))
    return out, {str(k): str(v) for k, v in meta.items()}


def encode_header(tensors: list[tuple[str, np.dtype, tuple[int, ...]]],
                  metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[int]]:
    """The first bytes of a file holding ``tensors`` in this order (length + JSON header
    padded with spaces to 8 bytes, as the safetensors library writes it) and each
    tensor's offset after them."""
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    offsets = []
    pos = 0
    for name, dt, shape in tensors:
        n = math.prod(shape) * np.dtype(dt).itemsize
        doc[name] = {"dtype": tag_of(dt, name=name), "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets.append(pos)
        pos += n
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets
