"""The zarr v3 array format: ``zarr.json`` metadata and chunk keys.

Metadata fields (zarr v3 core spec): ``zarr_format`` (3), ``node_type``
("array"), ``shape``, ``data_type``, ``chunk_grid`` (regular), ``chunk_key_encoding``
(``default`` with "/" or ".", or ``v2``), ``fill_value``, ``codecs``,
``dimension_names``, ``attributes``, ``storage_transformers`` (must be empty).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from tensorstore_py.core.errors import InvalidSpecError, NotFoundError
from tensorstore_py.drivers.codecs import CodecChain, compression_codecs
from tensorstore_py.drivers.codecs.base import ArrayArrayCodec, ArrayBytesCodec
from tensorstore_py.drivers.codecs.registry import codec_class
from tensorstore_py.drivers.documents import AttributedArray
from tensorstore_py.drivers.dtypes import (
    STRING_DTYPE,
    default_fill_value,
    dtype_from_v3,
    dtype_to_v3,
    element_nbytes,
    fill_from_json,
    fill_key,
    fill_to_json,
    has_byte_order,
    is_ml_dtype,
    is_variable_length,
)
from tensorstore_py.drivers.engine import ChunkedArray, json_object
from tensorstore_py.drivers.formats import ArrayFormat, MetadataOptions, register_array_format
from tensorstore_py.drivers.grid import default_chunks
from tensorstore_py.drivers.open import open_document
from tensorstore_py.kvstore.base import Buffer

__all__ = ["Zarr3Array", "build_metadata", "default_metadata", "normalize_field", "parse_metadata"]

METADATA_KEY = "zarr.json"
MAX_CHUNK_ELEMENTS = 2**31
MAX_RANK = 32
MAX_EXTENT = 2**62  # as TensorStore: index arithmetic stays within int64
_FIELDS = {
    "zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding",
    "fill_value", "codecs", "dimension_names", "attributes", "storage_transformers",
}


def _err(field: str, msg: str) -> InvalidSpecError:
    return InvalidSpecError(f"zarr3 metadata field {field!r}: {msg}")


def _int_list(v: Any, field: str, *, positive: bool) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) and (x > 0 if positive else x >= 0) for x in v
    ):
        kind = "positive" if positive else "non-negative"
        raise _err(field, f"expected a list of {kind} integers, got {v!r}")
    if len(v) > MAX_RANK:
        raise _err(field, f"rank {len(v)} exceeds the maximum of {MAX_RANK}")
    if any(x > MAX_EXTENT for x in v):
        raise _err(field, f"{list(v)} has a size above the maximum of 2^62")
    return tuple(int(x) for x in v)


def _chunk_shape(grid: Any, ndim: int) -> tuple[int, ...]:
    if not isinstance(grid, dict) or grid.get("name") != "regular":
        raise _err("chunk_grid", f"only the 'regular' chunk grid is supported, got {grid!r}")
    cfg = grid.get("configuration")
    if not isinstance(cfg, dict) or "chunk_shape" not in cfg:
        raise _err("chunk_grid", "missing configuration.chunk_shape")
    cs = _int_list(cfg["chunk_shape"], "chunk_grid", positive=True)
    if len(cs) != ndim:
        raise _err("chunk_grid", f"chunk_shape {list(cs)} has rank {len(cs)}, shape has rank {ndim}")
    n = int(np.prod(cs, dtype=object))
    if n > MAX_CHUNK_ELEMENTS:
        raise _err("chunk_grid", f"a chunk of {list(cs)} has {n} elements, more than {MAX_CHUNK_ELEMENTS}")
    return cs


def _key_encoding(enc: Any) -> tuple[str, str]:
    if enc is None:
        return "default", "/"
    if not isinstance(enc, dict) or enc.get("name") not in ("default", "v2"):
        raise _err("chunk_key_encoding", f"expected name 'default' or 'v2', got {enc!r}")
    cfg = enc.get("configuration")
    if cfg is None:
        cfg = {}
    if not isinstance(cfg, dict) or set(cfg) - {"separator"}:
        raise _err("chunk_key_encoding", f"configuration must be {{'separator': '/' or '.'}}, got {cfg!r}")
    sep = cfg.get("separator", "/" if enc["name"] == "default" else ".")
    if sep not in ("/", "."):
        raise _err("chunk_key_encoding", f"separator must be '/' or '.', got {sep!r}")
    return enc["name"], sep


def default_fill(dt: np.dtype) -> Any:
    """The JSON fill value of a new array that names none (zarr-python's defaults:
    zero, NaT for times, empty strings and bytes)."""
    if dt.kind == "b":
        return False
    if dt.kind == "c":
        return [0.0, 0.0]
    if dt.kind in "iu":
        return 0
    if dt.kind == "f" or is_ml_dtype(dt):
        return 0.0
    return fill_to_json(default_fill_value(dt), dt)


def default_codecs(dt: np.dtype) -> list[dict[str, Any]]:
    """The serializer zarr-python writes for ``dt``: ``bytes`` (with an endianness
    where it matters) or, for variable-length types, ``vlen-utf8``/``vlen-bytes``."""
    if is_variable_length(dt):
        return [{"name": "vlen-utf8" if dt == STRING_DTYPE else "vlen-bytes", "configuration": {}}]
    if not has_byte_order(dt):
        return [{"name": "bytes"}]
    return [{"name": "bytes", "configuration": {"endian": "little"}}]


def _is(entry: Any, kind: type) -> bool:
    """Whether the codec list entry names a registered codec of ``kind`` (an abstract
    codec class: mypy admits only concrete classes where ``type[Codec]`` is expected)."""
    name = entry.get("name") if isinstance(entry, dict) else entry
    cls = codec_class(name) if isinstance(name, str) else None
    return cls is not None and issubclass(cls, kind)


def with_serializer(codecs: Any, dt: np.dtype) -> Any:
    """Insert the default ``bytes`` codec when a codec list has no array->bytes
    codec (as TensorStore does), e.g. ``[{"name": "zstd"}]``."""
    if not isinstance(codecs, list) or any(_is(c, ArrayBytesCodec) for c in codecs):
        return codecs
    n_aa = 0
    while n_aa < len(codecs) and _is(codecs[n_aa], ArrayArrayCodec):
        n_aa += 1
    return codecs[:n_aa] + default_codecs(dt) + codecs[n_aa:]


def default_metadata(partial: dict[str, Any], *, chunk_shape: tuple[int, ...]) -> dict[str, Any]:
    """Complete a partial metadata document for creation (shape, data_type required)."""
    for f in ("shape", "data_type"):
        if f not in partial:
            raise _err(f, "is required to create an array")
    dt = dtype_from_v3(partial["data_type"])
    meta: dict[str, Any] = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(partial["shape"]),
        "data_type": partial["data_type"],
        "chunk_grid": partial.get(
            "chunk_grid", {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}}
        ),
        "chunk_key_encoding": partial.get(
            "chunk_key_encoding", {"name": "default", "configuration": {"separator": "/"}}
        ),
        "fill_value": partial.get("fill_value", default_fill(dt)),
        "codecs": partial.get("codecs", default_codecs(dt)),
    }
    for f in ("attributes", "dimension_names", "storage_transformers"):
        if f in partial and partial[f] is not None:
            meta[f] = partial[f]
    return meta


class Parsed:
    """The validated, typed view of one zarr.json document."""

    def __init__(self, meta: dict[str, Any]) -> None:
        if not isinstance(meta, dict):
            raise InvalidSpecError(f"zarr3 metadata must be a JSON object, got {type(meta).__name__}")
        unknown = set(meta) - _FIELDS
        for f in sorted(unknown):
            v = meta[f]
            if not (isinstance(v, dict) and v.get("must_understand") is False):
                raise _err(f, "unknown field (extensions must set must_understand: false)")
        if meta.get("zarr_format") != 3:
            raise _err("zarr_format", f"expected 3, got {meta.get('zarr_format')!r}")
        if meta.get("node_type") != "array":
            raise _err("node_type", f"expected 'array', got {meta.get('node_type')!r}")
        if "shape" not in meta:
            raise _err("shape", "is required")
        self.shape = _int_list(meta["shape"], "shape", positive=False)
        if "data_type" not in meta:
            raise _err("data_type", "is required")
        self.dtype = dtype_from_v3(meta["data_type"])
        self.chunk_shape = _chunk_shape(meta.get("chunk_grid"), len(self.shape))
        self.key_name, self.separator = _key_encoding(meta.get("chunk_key_encoding"))
        if "fill_value" not in meta:
            raise _err("fill_value", "is required")
        self.fill = fill_from_json(meta["fill_value"], self.dtype)
        st = meta.get("storage_transformers", [])
        if st:
            raise _err("storage_transformers", f"storage transformers are not supported, got {st!r}")
        names = meta.get("dimension_names")
        if names is None:
            self.dimension_names: tuple[str | None, ...] = (None,) * len(self.shape)
        else:
            if (not isinstance(names, list) or len(names) != len(self.shape)
                    or not all(n is None or isinstance(n, str) for n in names)):
                raise _err("dimension_names", f"expected {len(self.shape)} strings or nulls, got {names!r}")
            self.dimension_names = tuple(names)
        attrs = meta.get("attributes", {})
        if not isinstance(attrs, dict):
            raise _err("attributes", f"expected an object, got {attrs!r}")
        if "codecs" not in meta:
            raise _err("codecs", "is required")
        self.codec = CodecChain.from_json(meta["codecs"], self.chunk_shape, self.dtype, self.fill)

    def chunk_key(self, cell: tuple[int, ...]) -> str:
        if self.key_name == "default":
            return self.separator.join(("c", *map(str, cell)))
        return self.separator.join(map(str, cell)) if cell else "0"


def parse_metadata(meta: Any) -> Parsed:
    return Parsed(meta)


def normalize_field(field: str, value: Any, parsed: Parsed) -> Any:
    """A comparable form of one metadata field (given vs stored)."""
    if field == "chunk_key_encoding":
        return _key_encoding(value)
    if field == "chunk_grid":
        return _chunk_shape(value, len(parsed.shape))
    if field == "fill_value":
        return fill_key(fill_from_json(value, parsed.dtype), parsed.dtype)
    if field == "codecs":
        value = with_serializer(value, parsed.dtype)
        return CodecChain.from_json(value, parsed.chunk_shape, parsed.dtype, parsed.fill).to_json()
    if field == "shape":
        return list(value) if isinstance(value, (list, tuple)) else value
    if field == "dimension_names":
        return None if value is None or all(v is None for v in value) else list(value)
    if field == "storage_transformers":
        return value or []
    return value


def complete_metadata(partial: Any) -> dict[str, Any]:
    """A creatable document from a partial one: defaults filled in, the fill
    value normalised to JSON, a ``bytes`` serializer added where missing, an
    explicit ``configuration`` on ``numcodecs.*`` entries (zarr-python requires it)."""
    if "data_type" not in partial or "shape" not in partial:
        raise InvalidSpecError(
            "zarr3 metadata fields 'shape' and 'data_type' are required to create an array"
        )
    dt = dtype_from_v3(partial["data_type"])
    meta = default_metadata(dict(partial), chunk_shape=default_chunks(partial["shape"], element_nbytes(dt)))
    meta["fill_value"] = fill_to_json(fill_from_json(meta["fill_value"], dt), dt)
    meta["codecs"] = with_serializer(meta["codecs"], dt)
    if isinstance(meta["codecs"], list):
        meta["codecs"] = [
            {**c, "configuration": c.get("configuration") or {}}
            if isinstance(c, dict) and str(c.get("name", "")).startswith("numcodecs.") else c
            for c in meta["codecs"]
        ]
    return meta


def build_metadata(o: MetadataOptions) -> dict[str, Any]:
    """zarr.json for ``tsp.open``'s keyword options.

    ``chunks`` defaults to ~2 MiB chunks. With ``shards`` the chunk grid is the
    shard shape and ``chunks`` the inner chunk shape of a ``sharding_indexed``
    codec (crc32c-protected index at the end). ``compression``: a registered
    alias ("zstd" (level 1, no checksum), "gzip" (level 5), "blosc" (lz4,
    clevel 5, byte shuffle)), a ``(name, level)`` pair, or None (see
    drivers/codecs/registry.py). ``codecs`` overrides the codec list entirely.
    """
    shape, dt, chunks = o.grid()
    codecs = o.codecs
    inner = default_codecs(dt) + compression_codecs(o.compression, dt)
    if codecs is None:
        if o.order == "F":
            inner = [{"name": "transpose", "configuration": {"order": list(range(len(shape)))[::-1]}}] + inner
        codecs = inner
        if o.shards is not None:
            codecs = [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": chunks, "codecs": inner,
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                 {"name": "crc32c"}],
                "index_location": "end"}}]
    grid = [int(s) for s in o.shards] if o.shards is not None else chunks
    meta: dict[str, Any] = {
        "zarr_format": 3, "node_type": "array", "shape": shape,
        "data_type": dtype_to_v3(dt),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": default_fill(dt) if o.fill_value is None else fill_to_json(o.fill_value, dt),
        "codecs": codecs,
    }
    if o.dimension_names is not None:
        meta["dimension_names"] = list(o.dimension_names)
    return meta


class Zarr3Array(AttributedArray, ChunkedArray):
    """A zarr v3 array (optionally sharded) over a kvstore folder; its user
    attributes are zarr.json's ``attributes``."""

    driver = "zarr3"
    metadata_key = METADATA_KEY
    optional_fields = frozenset({"dimension_names", "storage_transformers"})

    @staticmethod
    def complete_metadata(partial: Mapping[str, Any]) -> dict[str, Any]:
        return complete_metadata(partial)

    @staticmethod
    def normalize_field(field: str, value: Any, parsed: Parsed) -> Any:
        return normalize_field(field, value, parsed)

    @staticmethod
    def is_array_document(doc: dict[str, Any]) -> bool:
        return doc.get("node_type") != "group"

    @staticmethod
    def attributes_in(doc: dict[str, Any] | None) -> dict[str, Any]:
        attrs = (doc or {}).get("attributes") or {}
        return attrs if isinstance(attrs, dict) else {}

    @staticmethod
    def with_attributes(doc: dict[str, Any] | None, attrs: dict[str, Any], *, key: str) -> dict[str, Any]:
        if doc is None or doc.get("node_type") != "array":
            raise NotFoundError(f"zarr3 array: its {key} is gone")
        return {**doc, "attributes": attrs}

    @staticmethod
    def parse_metadata(meta: dict[str, Any]) -> Parsed:
        return Parsed(meta)

    @staticmethod
    def encode_metadata(meta: dict[str, Any]) -> bytes:
        return encode_metadata(meta)


def encode_metadata(meta: dict[str, Any]) -> bytes:
    """The stored zarr.json: 2-space indent, fields in the order given."""
    return json.dumps(meta, indent=2).encode()


def decode_metadata(raw: Any, where: str) -> dict[str, Any]:
    return json_object(raw, where)


__all__ += ["decode_metadata", "encode_metadata", "fill_to_json"]


def _is_array(raw: Buffer) -> bool:
    """True unless ``zarr.json`` declares a node other than an array (a group)."""
    try:
        return json.loads(bytes(raw)).get("node_type", "array") == "array"
    except (ValueError, AttributeError):
        return True  # malformed: opening it reports the problem


register_array_format(ArrayFormat(
    driver="zarr3", probe_key=METADATA_KEY, build_metadata=build_metadata, is_array=_is_array,
    open=lambda spec, kv, options: open_document(Zarr3Array, spec, kv, options),
))
