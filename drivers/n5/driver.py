"""The ``n5`` array driver: N5 datasets on any kvstore, read and written through
the chunk engine.

The format itself (attributes.json, block headers, compressions, axis order)
is this package's other modules; this one plugs it into ``tsp.open``:

* a dataset is the folder whose ``attributes.json`` has ``dimensions``; it is
  opened and created with ``drivers/open.py::open_document`` (create-only on
  attributes.json). Creating a dataset where attributes.json already holds a
  group's attributes adds the dataset fields to them (conditioned on the
  document's generation): nothing stored there is lost. Resizing rewrites only
  ``dimensions``;
* blocks are chunks of ``blockSize``; a block that extends past the array's
  end is written clipped to the array, as N5-Java writes it, and read whether
  stored clipped (N5-Java) or padded to ``blockSize`` (TensorStore)
  (:meth:`N5Array.codec_at`); missing blocks read as 0 (N5 has no fill value);
* dimension names are ``axes`` (``""`` for an unnamed dimension, as TensorStore
  writes it); user attributes are every other member of attributes.json
  besides the dataset fields (``dimensions``, ``blockSize``, ``dataType``,
  ``compression``, ``axes``).

``tsp.open(url, driver="n5", create=True, dtype=, shape=, chunks=,
compression=)``: ``compression=None`` is TensorStore's default for N5 (blosc
lz4, level 5, byte shuffle; bit shuffle for 1-byte types), ``"raw"`` stores
blocks uncompressed, an N5 compression object (``{"type": "xz", "preset": 9}``)
is used as given, and a name or ``(name, level)``: the ``compression=``
aliases of every format ("zstd", "gzip", "blosc", ...) as the same compressor
in N5 terms, or an N5 type ("bzip2", "xz", "lz4", ...) with its level.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from tensorstore_py.core.errors import InvalidArgumentError, InvalidSpecError, NotFoundError
from tensorstore_py.drivers.codecs import compression_compressor
from tensorstore_py.drivers.codecs.base import ChunkCodec
from tensorstore_py.drivers.copies import copy_into
from tensorstore_py.drivers.documents import AttributedArray
from tensorstore_py.drivers.engine import ChunkedArray
from tensorstore_py.drivers.formats import ArrayFormat, MetadataOptions, register_array_format
from tensorstore_py.drivers.grid import default_chunks
from tensorstore_py.drivers.n5.blocks import block_key, encode_block, read_block
from tensorstore_py.drivers.n5.compression import COMPRESSIONS, compression_from_json
from tensorstore_py.drivers.n5.metadata import ATTRIBUTES_KEY, DATA_TYPES, N5Metadata
from tensorstore_py.drivers.open import open_document
from tensorstore_py.kvstore.base import Buffer

__all__ = ["N5Array", "N5BlockCodec", "build_metadata_n5", "n5_compression"]

#: the members of attributes.json that describe the dataset (not user attributes)
DATASET_FIELDS = frozenset({"dimensions", "blockSize", "dataType", "compression", "compressionType", "axes"})
#: dataset fields a spec may give that a stored document may lack
_SPEC_OPTIONAL = frozenset({"axes", "units", "resolution", "compression"})
# the parameter a compression level sets, per N5 type
_LEVEL_PARAM = {"gzip": "level", "bzip2": "blockSize", "xz": "preset", "blosc": "clevel", "zstd": "level"}


class N5BlockCodec(ChunkCodec):
    """One block position's encoding: header, big-endian elements with the
    first dimension fastest, compressed.

    ``clip`` (edge blocks): the in-bounds part, which is all that is written
    (N5-Java's form). Decoding accepts any stored block shape up to
    ``blockSize`` and fills the rest with 0.
    """

    strided_out = True  # decode(out=) fills any view: the copy does byte order and layout at once

    def __init__(self, meta: N5Metadata, clip: tuple[slice, ...] | None = None) -> None:
        self.meta, self.clip = meta, clip
        self.dtype = meta.dtype

    def encode(self, a: np.ndarray) -> Buffer:
        a = a.reshape(self.meta.block_size)  # (the engine may hand a rank-0 chunk as shape (1,))
        return encode_block(self.meta, a if self.clip is None else a[self.clip + (...,)])

    def decode(self, buf: Buffer, *, key: str, out: np.ndarray | None = None) -> np.ndarray:
        header, stored = read_block(self.meta, buf, key=key)
        whole = header.shape == self.meta.block_size
        if out is None:
            if whole and stored.dtype == self.dtype:  # 1-byte types: the decoded bytes as they are
                return stored
            out = np.empty(self.meta.block_size, self.dtype)
        if whole:
            copy_into(out, stored)  # byte order and element order in one pass, in slabs
        else:  # stored clipped (or smaller, written before the array grew)
            out[...] = 0
            out[tuple(slice(0, n) for n in header.shape) + (...,)] = stored
        return out


class N5Parsed:
    """A validated attributes.json, as the chunk engine needs it."""

    def __init__(self, doc: Any) -> None:
        self.meta = meta = N5Metadata.from_json(doc)
        self.shape, self.dtype, self.chunk_shape = meta.shape, meta.dtype, meta.block_size
        self.fill = meta.dtype.type(0)
        self.codec = N5BlockCodec(meta)
        axes = meta.axes
        self.dimension_names: tuple[str | None, ...] = (
            tuple(a or None for a in axes) if axes is not None else (None,) * meta.rank)

    @staticmethod
    def chunk_key(cell: tuple[int, ...]) -> str:
        return block_key(cell)


def n5_compression(compression: Any, dtype: np.dtype) -> dict[str, Any] | None:
    """The attributes.json ``compression`` for ``tsp.open``'s ``compression=``
    (None: the default, see the module doc)."""
    if compression is None:
        return None
    if isinstance(compression, dict):
        return compression_from_json(compression).to_json()
    name, level = (compression, None) if isinstance(compression, str) else (None, None)
    if name is None:
        try:
            name, level = compression
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"n5 compression must be a name, (name, level), an N5 compression "
                                       f"object or None; got {compression!r}") from None
    if name in COMPRESSIONS and name not in ("gzip", "zstd", "blosc"):  # N5's own names
        obj: dict[str, Any] = {"type": name}
        if level is not None:
            if name not in _LEVEL_PARAM:
                raise InvalidArgumentError(f"n5 compression {name!r} takes no level, got {level!r}")
            obj[_LEVEL_PARAM[name]] = level
        return compression_from_json(obj).to_json()
    cfg = compression_compressor(compression, dtype)  # the shared alias, as numcodecs describes it
    assert cfg is not None
    cid = cfg["id"]
    if cid in ("gzip", "zlib"):
        obj = {"type": "gzip", "level": cfg.get("level", -1), "useZlib": cid == "zlib"}
    elif cid == "zstd":
        obj = {"type": "zstd", "level": cfg.get("level", 3)}
    elif cid == "blosc":
        obj = {"type": "blosc", **{k: cfg[k] for k in ("cname", "clevel", "shuffle") if k in cfg},
               "blocksize": cfg.get("blocksize", 0)}
    elif cid == "bz2":
        obj = {"type": "bzip2", "blockSize": cfg.get("level", 9)}
    elif cid == "lzma":
        obj = {"type": "xz", "preset": cfg.get("preset", 6) or 6}
    else:
        raise InvalidArgumentError(
            f"compression {compression!r} has no N5 counterpart; N5 compressions: {', '.join(COMPRESSIONS)}")
    return compression_from_json(obj).to_json()


def build_metadata_n5(o: MetadataOptions) -> dict[str, Any]:
    """attributes.json for ``tsp.open``'s keyword options (~2 MiB blocks by default)."""
    shape, dt, chunks = o.grid()
    o.refuse_zarr3_options("N5")
    if o.fill_value is not None and np.array(o.fill_value, dt) != 0:
        raise InvalidArgumentError(f"N5 has no fill value (missing blocks read as 0), got {o.fill_value!r}")
    if o.order != "C":
        raise InvalidArgumentError("N5 blocks have one element order; order= does not apply")
    axes = None if o.dimension_names is None else [n or "" for n in o.dimension_names]
    return N5Metadata.create(shape, chunks, dt, compression=n5_compression(o.compression, dt),
                             axes=axes).to_json()


def complete_metadata_n5(partial: Any) -> dict[str, Any]:
    """A creatable attributes.json from a spec's metadata (``dimensions`` and
    ``dataType`` required; ``blockSize`` and ``compression`` defaulted)."""
    doc = dict(partial)
    for f in ("dimensions", "dataType"):
        if f not in doc:
            raise InvalidSpecError(f"n5 metadata field {f!r} is required to create a dataset")
    dt = DATA_TYPES.get(doc["dataType"]) if isinstance(doc["dataType"], str) else None
    if "blockSize" not in doc and isinstance(doc["dimensions"], list) and dt is not None:
        doc["blockSize"] = list(default_chunks(doc["dimensions"], dt.itemsize))
    if "compression" not in doc and "compressionType" not in doc and dt is not None:
        doc["compression"] = N5Metadata.create([1], [1], dt).compression.to_json()
    return N5Metadata.from_json(doc).to_json()


def _normalize(field: str, value: Any, parsed: N5Parsed) -> Any:
    if field == "compression":
        return parsed.meta.compression.to_json() if value is None else compression_from_json(value).to_json()
    if field == "dataType":
        return value
    return list(value) if isinstance(value, (list, tuple)) else value


class N5Array(AttributedArray, ChunkedArray):
    """An N5 dataset over a kvstore folder (see the module doc)."""

    driver = "n5"
    metadata_key = ATTRIBUTES_KEY
    optional_fields = _SPEC_OPTIONAL

    @staticmethod
    def complete_metadata(partial: Mapping[str, Any]) -> dict[str, Any]:
        return complete_metadata_n5(partial)

    @staticmethod
    def normalize_field(field: str, value: Any, parsed: N5Parsed) -> Any:
        return _normalize(field, value, parsed)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._edge_codecs: dict[tuple[int, ...], N5BlockCodec] = {}

    @staticmethod
    def parse_metadata(meta: dict[str, Any]) -> N5Parsed:
        return N5Parsed(meta)

    @staticmethod
    def encode_metadata(meta: dict[str, Any]) -> bytes:
        """attributes.json as N5-Java writes it: compact JSON."""
        return json.dumps(meta, separators=(",", ":")).encode()

    @staticmethod
    def is_array_document(doc: dict[str, Any]) -> bool:
        return "dimensions" in doc

    @staticmethod
    def create_into(doc: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any] | None:
        return {**doc, **meta}  # the group's attributes stay; the dataset's fields are added

    @staticmethod
    def attributes_in(doc: dict[str, Any] | None) -> dict[str, Any]:
        return {k: v for k, v in (doc or {}).items() if k not in DATASET_FIELDS}

    @staticmethod
    def with_attributes(doc: dict[str, Any] | None, attrs: dict[str, Any], *, key: str) -> dict[str, Any]:
        if doc is None or "dimensions" not in doc:
            raise NotFoundError(f"n5 dataset: its {key} is gone")
        clash = sorted(DATASET_FIELDS & set(attrs))
        if clash:
            raise InvalidArgumentError(f"n5 dataset attributes {clash} are dataset fields, not user attributes")
        new = {**{k: v for k, v in doc.items() if k in DATASET_FIELDS}, **attrs}
        N5Metadata.from_json(new)  # e.g. "units" / "resolution" must stay valid
        return new

    def _metadata_with_shape(self, metadata: dict[str, Any], shape: tuple[int, ...]) -> dict[str, Any]:
        return {**metadata, "dimensions": list(shape)}

    def spec(self) -> dict[str, Any]:
        """The dataset fields only: user attributes may change without making
        the spec stale."""
        meta = {k: v for k, v in self._metadata.items() if k in DATASET_FIELDS}
        return {"driver": self.driver, "kvstore": self.kvstore.spec(), "metadata": meta}

    def codec_at(self, cell: tuple[int, ...]) -> ChunkCodec:
        """Interior blocks: the array's codec; edge blocks: one that writes the
        in-bounds part only (see :class:`N5BlockCodec`)."""
        inside = tuple(min(b, n - c * b) for c, b, n in zip(cell, self._chunk_shape, self._shape))
        if inside == self._chunk_shape:
            return self._codec
        codec = self._edge_codecs.get(inside)
        if codec is None:
            codec = N5BlockCodec(self._parsed.meta, tuple(slice(0, n) for n in inside))  # type: ignore[attr-defined]
            self._edge_codecs[inside] = codec
        return codec


def _is_dataset(raw: Buffer) -> bool:
    """True unless attributes.json is valid JSON without ``dimensions`` (a group)."""
    try:
        doc = json.loads(bytes(raw))
    except ValueError:
        return True  # malformed: opening it reports the problem
    return not isinstance(doc, dict) or "dimensions" in doc


register_array_format(ArrayFormat(
    driver="n5", probe_key=ATTRIBUTES_KEY, build_metadata=build_metadata_n5, is_array=_is_dataset,
    open=lambda spec, kv, options: open_document(N5Array, spec, kv, options),
))
