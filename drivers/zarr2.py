"""The zarr v2 array format: ``.zarray`` metadata, numcodecs filters and compressor.

Chunks are the array's elements in ``order`` ("C" or "F") and the byte order of
``dtype``, passed through ``filters`` (in order) and then ``compressor``. Keys
join the chunk indices with ``dimension_separator`` ("." or "/").

``.zattrs`` holds the user attributes and, as xarray and zarr-python's
conventions have it, the dimension names as ``_ARRAY_DIMENSIONS`` (a list of
strings). It is read when an array opens, written when an array is created with
dimension names or attributes (a spec's metadata may carry ``dimension_names``
and ``attributes``; they go to ``.zattrs``, not ``.zarray``), and otherwise only
changed by ``update_attributes`` (a read-modify-write that keeps every other
member).

An ``"|O"`` array's first filter is its object codec: ``vlen-utf8`` (strings,
read as numpy's StringDType) or ``vlen-bytes`` (an object array of bytes); it
turns the elements into bytes (drivers/codecs/vlen.py) before the other filters.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from typing import Any, Literal

import numcodecs
import numpy as np

from tensorstore_py.core.errors import (
    DataCorruptionError,
    InvalidSpecError,
    UnsupportedError,
)
from tensorstore_py.drivers.base import ArrayDriver
from tensorstore_py.drivers.codecs import compression_compressor, v2_decoder
from tensorstore_py.drivers.codecs._limits import decode_limit
from tensorstore_py.drivers.codecs.base import ChunkCodec
from tensorstore_py.drivers.codecs.vlen import decode_vlen, encode_vlen
from tensorstore_py.drivers.copies import copy_into
from tensorstore_py.drivers.documents import AttributedArray, update_json
from tensorstore_py.drivers.dtypes import (
    default_fill_value,
    dtype_from_v2,
    dtype_to_v2,
    element_nbytes,
    fill_from_v2,
    fill_key,
    fill_to_v2,
    v2_object_codec,
    v2_object_dtype,
)
from tensorstore_py.drivers.engine import ChunkedArray, json_object
from tensorstore_py.drivers.formats import ArrayFormat, MetadataOptions, OpenOptions, register_array_format
from tensorstore_py.drivers.grid import default_chunks
from tensorstore_py.drivers.open import open_document, url_of
from tensorstore_py.kvstore.base import Buffer, Generation, KvStore

__all__ = ["Parsed2", "Zarr2Array", "build_metadata2", "default_metadata2", "normalize_field2"]

try:
    from numcodecs.errors import UnknownCodecError as _UnknownCodec
except ImportError:  # numcodecs < 0.14 raises a plain ValueError
    _UnknownCodec = ValueError  # type: ignore[assignment,misc]

METADATA_KEY = ".zarray"
ATTRS_KEY = ".zattrs"
DIMENSIONS_ATTR = "_ARRAY_DIMENSIONS"
MAX_CHUNK_ELEMENTS = 2**31
_FIELDS = {"zarr_format", "shape", "chunks", "dtype", "compressor", "fill_value", "order",
           "filters", "dimension_separator"}


def _err(field: str, msg: str) -> InvalidSpecError:
    return InvalidSpecError(f"zarr metadata field {field!r}: {msg}")


def _ints(v: Any, field: str, positive: bool) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) and (x > 0 if positive else x >= 0) for x in v
    ) or len(v) > 32 or any(x > 2**62 for x in v):
        raise _err(field, f"expected a list of {'positive' if positive else 'non-negative'} integers, got {v!r}")
    return tuple(int(x) for x in v)


def _codec(cfg: Any, field: str) -> numcodecs.abc.Codec:
    if not isinstance(cfg, dict) or not isinstance(cfg.get("id"), str):
        raise _err(field, f"expected {{'id': ...}}, got {cfg!r}")
    if field == "compressor":  # the values numcodecs accepts now and fails on at the first write
        v2_decoder(cfg["id"]).check_config(cfg, f"zarr metadata field {field!r}")
    try:
        return numcodecs.get_codec(dict(cfg))
    except _UnknownCodec:
        raise UnsupportedError(
            f"zarr metadata field {field!r}: unsupported codec {cfg['id']!r}; supported: the "
            f"numcodecs codecs {', '.join(sorted(numcodecs.registry.codec_registry))}"
        ) from None
    except Exception as e:  # numcodecs constructors raise TypeError, ValueError, KeyError ...
        raise _err(field, f"bad configuration for codec {cfg['id']!r}: {e}") from None


class V2ChunkCodec(ChunkCodec):
    """filters + compressor for one chunk shape; the compressor decodes through
    its registered checked decoder (drivers/codecs/registry.py). ``object_codec``
    (``vlen-utf8``/``vlen-bytes``, an ``"|O"`` array's first filter) serialises
    variable-length elements before ``filters``."""

    def __init__(self, shape: tuple[int, ...], stored: np.dtype, native: np.dtype, order: Literal["C", "F"],
                 filters: list[Any], compressor: Any, object_codec: str | None = None) -> None:
        self.shape, self.stored, self.native, self.order = shape, stored, native, order
        self.filters, self.compressor, self.object_codec = filters, compressor, object_codec
        self._decoder = None if compressor is None else v2_decoder(compressor.codec_id)
        self.elements = int(np.prod(shape, dtype=np.int64))
        self.nbytes = self.elements * stored.itemsize
        self.limit = decode_limit(self.elements, native)
        plain = (not filters and object_codec is None and order == "C"
                 and stored == native)  # stored bytes = native C order
        self.raw = plain and compressor is None
        # the compressor's output is exactly the chunk's bytes (no filter, fixed-size elements)
        self.exact_size = not filters and object_codec is None
        self.direct = plain and self._decoder is not None and self._decoder.decodes_into

    def encode(self, a: np.ndarray) -> Buffer:
        if self.object_codec is None and a.dtype != self.stored:
            a = a.astype(self.stored)
        if self.order == "C":
            buf: Any = np.ascontiguousarray(a)
        elif a.flags.f_contiguous:
            buf = a
        else:
            buf = np.empty(a.shape, a.dtype, order="F")
            copy_into(buf, a)  # in slabs (drivers/copies.py)
        buf = buf.reshape(-1, order=self.order)
        if self.object_codec is not None:
            buf = encode_vlen(self.object_codec, buf)
        elif buf.dtype.kind == "V":
            buf = buf.view(np.uint8)  # ml_dtypes arrays do not export buffers
        elif buf.dtype.kind in "mM":  # nor do times: their int64s (as numcodecs sees them)
            buf = buf.view(np.dtype("i8").newbyteorder(buf.dtype.byteorder))
        for c in (*self.filters, *([self.compressor] if self.compressor is not None else [])):
            try:
                buf = c.encode(buf)
            except Exception as e:  # a configuration numcodecs took but can not encode with
                raise InvalidSpecError(
                    f"zarr metadata: codec {c.get_config()!r} can not encode a chunk of "
                    f"{list(self.shape)} {self.stored}: {e}"
                ) from None
        return np.ascontiguousarray(buf).data.cast("B") if isinstance(buf, np.ndarray) else buf

    def decode(self, buf: Buffer, *, key: str, out: np.ndarray | None = None) -> np.ndarray:
        direct = out.reshape(-1).view(np.uint8).data if out is not None and self.direct else None
        if self._decoder is not None:
            buf = self._decoder.decode(
                self.compressor, buf, key=key, size=self.nbytes if self.exact_size else None,
                limit=self.limit, out=direct,
            )
            if direct is not None and np.shares_memory(np.frombuffer(buf, np.uint8), out):
                return out  # type: ignore[return-value]
        for f in reversed(self.filters):
            try:
                buf = f.decode(buf)
            except Exception as e:
                raise DataCorruptionError(f"chunk {key!r}: filter {f.codec_id!r} failed: {e}") from None
        if self.object_codec is not None:
            return decode_vlen(self.object_codec, buf, self.elements, key=key).reshape(
                self.shape, order=self.order)
        a = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8) if not isinstance(buf, np.ndarray) \
            else buf.reshape(-1).view(np.uint8)
        if a.nbytes != self.nbytes:
            raise DataCorruptionError(f"chunk {key!r}: decodes to {a.nbytes} bytes, expected {self.nbytes}")
        arr = a.view(self.stored).reshape(self.shape, order=self.order)
        if self.stored != self.native:
            arr = arr.astype(self.native)
        return arr


class Parsed2:
    """The validated, typed view of one .zarray document."""

    def __init__(self, meta: Any) -> None:
        if not isinstance(meta, dict):
            raise InvalidSpecError(f".zarray must be a JSON object, got {type(meta).__name__}")
        unknown = set(meta) - _FIELDS
        if unknown:
            raise _err(sorted(unknown)[0], "unknown field")
        if meta.get("zarr_format") != 2:
            raise _err("zarr_format", f"expected 2, got {meta.get('zarr_format')!r}")
        for f in ("shape", "chunks", "dtype"):
            if f not in meta:
                raise _err(f, "is required")
        self.shape = _ints(meta["shape"], "shape", False)
        self.chunk_shape = _ints(meta["chunks"], "chunks", True)
        if len(self.chunk_shape) != len(self.shape):
            raise _err("chunks", f"rank {len(self.chunk_shape)} differs from the shape's {len(self.shape)}")
        n = math.prod(self.chunk_shape)
        if n > MAX_CHUNK_ELEMENTS:
            raise _err("chunks", f"a chunk of {list(self.chunk_shape)} has {n} elements, more than {MAX_CHUNK_ELEMENTS}")
        self.stored = dtype_from_v2(meta["dtype"])
        filters = meta.get("filters") or []
        if not isinstance(filters, list):
            raise _err("filters", f"expected a list or null, got {filters!r}")
        object_codec = None
        if self.stored.kind == "O":  # the first filter says what the objects are
            first = filters[0] if filters else None
            object_codec = first.get("id") if isinstance(first, dict) else None
            self.dtype = v2_object_dtype(object_codec)
            filters = filters[1:]
        else:
            self.dtype = self.stored.newbyteorder("=") if self.stored.byteorder in "<>" else self.stored
        self.fill = fill_from_v2(meta.get("fill_value"), self.dtype)
        self.order: Literal["C", "F"] = meta.get("order", "C")
        if self.order not in ("C", "F"):
            raise _err("order", f"expected 'C' or 'F', got {self.order!r}")
        self.separator = meta.get("dimension_separator", ".")
        if self.separator not in (".", "/"):
            raise _err("dimension_separator", f"expected '.' or '/', got {self.separator!r}")
        comp = meta.get("compressor")
        self.codec = V2ChunkCodec(
            self.chunk_shape, self.stored, self.dtype, self.order,
            [_codec(f, "filters") for f in filters],
            None if comp is None else _codec(comp, "compressor"), object_codec,
        )
        self.dimension_names: tuple[str | None, ...] = (None,) * len(self.shape)

    def chunk_key(self, cell: tuple[int, ...]) -> str:
        return self.separator.join(map(str, cell)) if cell else "0"


def default_metadata2(partial: dict[str, Any], *, chunk_shape: tuple[int, ...]) -> dict[str, Any]:
    for f in ("shape", "dtype"):
        if f not in partial:
            raise _err(f, "is required to create an array")
    meta = {
        "zarr_format": 2,
        "shape": list(partial["shape"]),
        "chunks": list(partial.get("chunks", chunk_shape)),
        "dtype": partial["dtype"],
        "compressor": partial.get("compressor", None),
        "fill_value": partial.get("fill_value", None),
        "order": partial.get("order", "C"),
        "filters": partial.get("filters", None),
    }
    if "dimension_separator" in partial:
        meta["dimension_separator"] = partial["dimension_separator"]
    return meta


def normalize_field2(field: str, value: Any, parsed: Parsed2) -> Any:
    if field == "dtype":
        return dtype_from_v2(value).str
    if field == "fill_value":
        return fill_key(fill_from_v2(value, parsed.dtype), parsed.dtype) if value is not None else None
    if field == "dimension_separator":
        return value or "."
    if field == "filters":
        return value or None
    if field in ("shape", "chunks"):
        return list(value) if isinstance(value, (list, tuple)) else value
    if field == "compressor" and isinstance(value, dict):
        return _codec(value, "compressor").get_config()
    return value


def complete_metadata2(partial: Any) -> dict[str, Any]:
    """A creatable .zarray from a partial one: defaults filled in, the fill value
    normalised."""
    if "dtype" not in partial or "shape" not in partial:
        raise InvalidSpecError("zarr metadata fields 'shape' and 'dtype' are required to create an array")
    dt = dtype_from_v2(partial["dtype"])
    meta = default_metadata2(dict(partial), chunk_shape=default_chunks(partial["shape"], element_nbytes(dt)))
    if meta["fill_value"] is not None:
        meta["fill_value"] = fill_to_v2(fill_from_v2(meta["fill_value"], dt), dt)
    return meta


def build_metadata2(o: MetadataOptions) -> dict[str, Any]:
    """.zarray for ``tsp.open``'s keyword options (~2 MiB chunks by default;
    ``compression`` as for zarr3, as a numcodecs compressor; no sharding).
    Variable-length strings and bytes are ``"|O"`` with the ``vlen-utf8`` /
    ``vlen-bytes`` filter and an explicit empty fill value, as zarr-python writes them."""
    shape, dt, chunks = o.grid()
    o.refuse_zarr3_options("zarr v2")
    object_codec = v2_object_codec(dt)
    fill = default_fill_value(dt) if o.fill_value is None and object_codec else o.fill_value
    meta: dict[str, Any] = {
        "zarr_format": 2, "shape": shape, "chunks": chunks, "dtype": dtype_to_v2(dt),
        "compressor": compression_compressor(o.compression, dt),
        "fill_value": fill_to_v2(fill, dt), "order": o.order,
        "filters": [{"id": object_codec}] if object_codec else None, "dimension_separator": ".",
    }
    if o.dimension_names is not None:
        meta["dimension_names"] = _dimension_names(o.dimension_names, len(shape), "dimension_names")
    return meta


def _dimension_names(names: Any, rank: int, where: str) -> list[str] | None:
    """``names`` as ``_ARRAY_DIMENSIONS`` stores them: a name for every
    dimension, or none at all (None)."""
    if names is None:
        return None
    if not isinstance(names, (list, tuple)) or len(names) != rank:
        raise InvalidSpecError(f"zarr {where}: expected a list of {rank} names, got {names!r}")
    if all(n is None for n in names):
        return None
    if not all(isinstance(n, str) for n in names):
        raise InvalidSpecError(f"zarr {where}: zarr v2 stores dimension names as {DIMENSIONS_ATTR} "
                               f"in .zattrs, a name for every dimension; got {list(names)!r}")
    return list(names)


class Zarr2Array(AttributedArray, ChunkedArray):
    """A zarr v2 array over a kvstore folder; attributes and dimension names
    (``_ARRAY_DIMENSIONS``) in ``.zattrs``."""

    driver = "zarr"
    metadata_key = METADATA_KEY
    attributes_key = ATTRS_KEY
    optional_fields = frozenset({"filters", "dimension_separator", "compressor"})

    @staticmethod
    def complete_metadata(partial: Mapping[str, Any]) -> dict[str, Any]:
        return complete_metadata2(partial)

    @staticmethod
    def normalize_field(field: str, value: Any, parsed: Parsed2) -> Any:
        return normalize_field2(field, value, parsed)

    @staticmethod
    def parse_metadata(meta: dict[str, Any]) -> Parsed2:
        return Parsed2(meta)

    @staticmethod
    def encode_metadata(meta: dict[str, Any]) -> bytes:
        """The stored .zarray: 4-space indent, sorted keys."""
        return json.dumps(meta, indent=4, sort_keys=True).encode()

    @staticmethod
    def attributes_in(doc: dict[str, Any] | None) -> dict[str, Any]:
        return {k: v for k, v in (doc or {}).items() if k != DIMENSIONS_ATTR}

    @staticmethod
    def with_attributes(doc: dict[str, Any] | None, attrs: dict[str, Any], *, key: str) -> dict[str, Any]:
        names = (doc or {}).get(DIMENSIONS_ATTR)
        return {**attrs, DIMENSIONS_ATTR: names} if names is not None else dict(attrs)

    def set_attributes_document(self, doc: dict[str, Any] | None) -> None:
        """Take the stored ``.zattrs`` (None: missing) as this array's attributes
        and dimension names (InvalidSpecError for malformed ``_ARRAY_DIMENSIONS``)."""
        names = _dimension_names((doc or {}).get(DIMENSIONS_ATTR), len(self.shape),
                                 f".zattrs member {DIMENSIONS_ATTR!r} at {url_of(self.kvstore)}")
        self._attributes_doc = doc
        self._dimension_names = tuple(names) if names else (None,) * len(self.shape)

    def _reopen(self, metadata: dict[str, Any], kvstore: KvStore, generation: Generation) -> Zarr2Array:
        drv = super()._reopen(metadata, kvstore, generation)
        drv.set_attributes_document(self._attributes_doc)
        return drv

    async def update_attributes(self, changes: Any, *, replace: bool = False) -> dict[str, Any]:
        attrs = await super().update_attributes(changes, replace=replace)
        self.set_attributes_document(self._attributes_doc)
        return attrs


async def open_zarr2(spec: Any, kv: KvStore, options: OpenOptions) -> ArrayDriver:
    """Open or create a zarr v2 array (open_document) with its ``.zattrs``."""
    given = dict(spec.get("metadata") or {})
    names = given.pop("dimension_names", None)
    attrs = given.pop("attributes", None)
    # .zattrs is read alongside .zarray unless everything is deleted first
    early = None if options.delete_existing else asyncio.ensure_future(kv.read(ATTRS_KEY))
    created: list[dict[str, Any]] = []

    async def on_create(drv: ArrayDriver) -> None:
        doc = dict(attrs or {})
        rank = len(drv.shape)
        wanted = _dimension_names(names, rank, "metadata field 'dimension_names'")
        if wanted is not None:
            doc[DIMENSIONS_ATTR] = wanted
        if doc:
            new, _ = await update_json(kv, ATTRS_KEY, lambda old: {**(old or {}), **doc},
                                       encode=Zarr2Array.encode_attributes)
            created.append(new)

    try:
        drv = await open_document(Zarr2Array, {**spec, "metadata": given}, kv, options, on_create=on_create)
        if created:
            zattrs: dict[str, Any] | None = created[0]
        else:
            res = await (early if early is not None else kv.read(ATTRS_KEY))
            zattrs = json_object(res.value, ATTRS_KEY) if res.state == "value" else None
    finally:
        if early is not None and not early.done():
            early.cancel()
    assert isinstance(drv, Zarr2Array)
    drv.set_attributes_document(zattrs)
    if names is not None and not created:
        want = _dimension_names(names, len(drv.shape), "metadata field 'dimension_names'")
        if tuple(want or (None,) * len(drv.shape)) != drv.dimension_names:
            raise InvalidSpecError(f"zarr array at {url_of(kv)}: dimension names do not match: expected "
                                   f"{names!r}, stored {list(drv.dimension_names)!r}")
    return drv


register_array_format(ArrayFormat(
    driver="zarr", aliases=("zarr2",), probe_key=METADATA_KEY, build_metadata=build_metadata2,
    open=open_zarr2,
))
