"""An N5 dataset's ``attributes.json``: parse, validate, encode.

A dataset is a group whose attributes hold::

    "dimensions":  [d0, d1, ...]    array shape, non-negative integers
    "blockSize":   [b0, b1, ...]    block (chunk) shape, positive integers
    "dataType":    "uint8" | "uint16" | "uint32" | "uint64" | "int8" | "int16" | "int32"
                   | "int64" | "float32" | "float64"
    "compression": {"type": "gzip", "level": -1, "useZlib": false}   (see .compression)
      or, before N5 1.0, "compressionType": "gzip" (a type with default parameters)

Optional, validated when present as TensorStore does: ``"axes"`` (one label per
dimension), ``"units"`` (one unit string per dimension) and ``"resolution"``
(one number per dimension). Every other attribute (user metadata, the root
group's ``"n5"`` version, multiscale descriptions, ...) is kept untouched and
written back as found; so is the legacy ``"compressionType"`` form.

Axis order: dimensions are presented in attributes.json order, exactly as
TensorStore's ``n5`` driver does: index ``[i0, i1, ...]`` of the array is
element ``(i0, i1, ...)`` of N5 (N5-Java's x, y, z, ...). Block keys and block
headers list the same order, and inside a block the FIRST dimension varies
fastest (column-major / Fortran order; TensorStore's chunk ``inner_order`` is
``[rank-1, ..., 0]``). Elements are big-endian.

Errors: InvalidSpecError naming the field for malformed values,
UnsupportedError naming an unknown data type or compression.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorstore_py.core.errors import InvalidSpecError, UnsupportedError
from tensorstore_py.drivers.n5.compression import BloscCompression, Compression, compression_from_json

__all__ = ["ATTRIBUTES_KEY", "DATA_TYPES", "N5Metadata", "data_type_of"]

#: the key of a group's attributes, relative to the group
ATTRIBUTES_KEY = "attributes.json"

#: N5 ``dataType`` -> numpy dtype (native byte order; blocks store them big-endian)
DATA_TYPES: dict[str, np.dtype] = {
    name: np.dtype(name) for name in (
        "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float32", "float64")
}
# a block's decoded bytes must fit in a Java array (N5-Java) / 2 GiB (TensorStore)
_MAX_BLOCK_BYTES = 1 << 31
_MAX_INDEX = 2**63 - 1
_CORE = ("dimensions", "blockSize", "dataType", "compression")


def _err(name: str, message: str) -> InvalidSpecError:
    return InvalidSpecError(f"n5 attributes field {name!r}: {message}")


def _int_list(doc: dict[str, Any], name: str, lo: int, hi: int, rank: int | None) -> tuple[int, ...]:
    v = doc.get(name)
    if v is None:
        raise _err(name, "required")
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise _err(name, f"expected a list of integers, got {v!r}")
    if rank is not None and len(v) != rank:
        raise _err(name, f"expected {rank} entries (one per dimension), got {len(v)}")
    if not all(lo <= x <= hi for x in v):
        raise _err(name, f"entries must be in [{lo}, {hi}], got {v!r}")
    return tuple(v)


def data_type_of(dtype: Any) -> str:
    """The N5 ``dataType`` of a numpy dtype (byte order ignored)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise UnsupportedError(f"{dtype!r} is not a numpy dtype with an N5 data type") from None
    name = dt.newbyteorder("=").name
    if name not in DATA_TYPES:
        raise UnsupportedError(
            f"numpy dtype {dt} has no N5 data type; supported: {', '.join(DATA_TYPES)}")
    return name


def _check_optional(doc: dict[str, Any], rank: int) -> None:
    """``axes`` / ``units`` / ``resolution``: one entry per dimension, as TensorStore requires."""
    for name, ok, what in (
        ("axes", lambda x: isinstance(x, str), "strings"),
        ("units", lambda x: isinstance(x, str), "strings"),
        ("resolution", lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
         and math.isfinite(x), "finite numbers"),
    ):
        v = doc.get(name)
        if v is None:
            continue
        if not isinstance(v, list) or len(v) != rank or not all(ok(x) for x in v):
            raise _err(name, f"expected a list of {rank} {what}, got {v!r}")
    axes = doc.get("axes")
    if axes is not None:
        named = [a for a in axes if a]
        if len(set(named)) != len(named):
            raise _err("axes", f"labels must be unique, got {axes!r}")


@dataclass(frozen=True)
class N5Metadata:
    """The attributes of one N5 dataset.

    ``attributes`` holds every attribute other than the four dataset fields,
    untouched; :meth:`to_json` writes them back. Instances are immutable and
    always valid (constructors validate); use :meth:`with_dimensions` to resize.
    """

    dimensions: tuple[int, ...]
    block_size: tuple[int, ...]
    data_type: str
    compression: Compression
    attributes: dict[str, Any] = field(default_factory=dict, hash=False)
    #: the compression was the pre-1.0 ``"compressionType"`` string (kept so on rewrite)
    legacy_compression: bool = False

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_json(cls, doc: Any) -> N5Metadata:
        """Parse a decoded attributes.json object."""
        if not isinstance(doc, dict):
            raise InvalidSpecError(f"n5 attributes.json must be a JSON object, got {type(doc).__name__}")
        dims = _int_list(doc, "dimensions", 0, _MAX_INDEX, None)
        block = _int_list(doc, "blockSize", 1, 2**31 - 1, len(dims))
        name = doc.get("dataType")
        if not isinstance(name, str):
            raise _err("dataType", f"expected a string, got {name!r}")
        if name not in DATA_TYPES:
            raise UnsupportedError(
                f"n5 data type {name!r} is not supported; supported: {', '.join(DATA_TYPES)}")
        nbytes = math.prod(block) * DATA_TYPES[name].itemsize
        if nbytes > _MAX_BLOCK_BYTES:
            raise _err("blockSize", f"{list(block)} of {name} is {nbytes} bytes, more than the 2 GiB "
                                    "an N5 block may hold")
        legacy = "compression" not in doc and "compressionType" in doc
        if "compression" not in doc and not legacy:
            raise _err("compression", "required")
        if legacy and not isinstance(doc["compressionType"], str):
            raise _err("compressionType", f"expected a string, got {doc['compressionType']!r}")
        compression = compression_from_json({"type": doc["compressionType"]} if legacy else doc["compression"])
        _check_optional(doc, len(dims))
        skip = ("compressionType",) if legacy else ()
        others = {k: v for k, v in doc.items() if k not in _CORE and k not in skip}
        return cls(dims, block, name, compression, json.loads(json.dumps(others)), legacy)

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview) -> N5Metadata:
        """Parse the stored bytes of attributes.json."""
        try:
            doc = json.loads(bytes(raw))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InvalidSpecError(f"n5 attributes.json is not valid JSON: {e}") from None
        return cls.from_json(doc)

    @classmethod
    def create(cls, dimensions: Sequence[int], block_size: Sequence[int], dtype: Any, *,
               compression: Compression | dict[str, Any] | None = None,
               axes: Sequence[str] | None = None,
               attributes: dict[str, Any] | None = None) -> N5Metadata:
        """New dataset attributes, validated as if read back.

        ``compression`` defaults to TensorStore's choice: blosc lz4, level 5,
        byte shuffle (bit shuffle for 1-byte types).
        """
        name = data_type_of(dtype)
        if compression is None:
            compression = BloscCompression("lz4", 5, 2 if DATA_TYPES[name].itemsize == 1 else 1, 0)
        doc = dict(attributes or {})
        doc.update(dimensions=list(dimensions), blockSize=list(block_size), dataType=name,
                   compression=compression.to_json() if isinstance(compression, Compression) else compression)
        if axes is not None:
            doc["axes"] = list(axes)
        return cls.from_json(doc)

    def with_dimensions(self, dimensions: Sequence[int]) -> N5Metadata:
        """The same dataset with another shape (rank unchanged); other attributes kept."""
        dims = _int_list({"dimensions": list(dimensions)}, "dimensions", 0, _MAX_INDEX, self.rank)
        return dataclasses.replace(self, dimensions=dims)

    # -- encoding ---------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The attributes.json object: the dataset fields, then the other attributes."""
        doc: dict[str, Any] = {
            "dimensions": list(self.dimensions),
            "blockSize": list(self.block_size),
            "dataType": self.data_type,
        }
        if self.legacy_compression:
            doc["compressionType"] = self.compression.type
        else:
            doc["compression"] = self.compression.to_json()
        doc.update(json.loads(json.dumps(self.attributes)))
        return doc

    def encode(self) -> bytes:
        """attributes.json bytes (compact JSON, as N5-Java writes it)."""
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    # -- derived ----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return len(self.dimensions)

    @property
    def shape(self) -> tuple[int, ...]:
        """The array shape (``dimensions``, in attributes.json order)."""
        return self.dimensions

    @property
    def dtype(self) -> np.dtype:
        """The element type, native byte order."""
        return DATA_TYPES[self.data_type]

    @property
    def stored_dtype(self) -> np.dtype:
        """The element type as blocks store it (big-endian)."""
        return self.dtype.newbyteorder(">")

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """Blocks per dimension."""
        return tuple(-(-d // b) for d, b in zip(self.dimensions, self.block_size))

    @property
    def axes(self) -> tuple[str, ...] | None:
        """Dimension labels (``"axes"``), if stored."""
        axes = self.attributes.get("axes")
        return None if axes is None else tuple(axes)
