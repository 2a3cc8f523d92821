"""Open or create a zarr3 / zarr array from a spec; build metadata for the
convenience path of ``tsp.open(url, create=True, dtype=..., shape=...)``.

Creation is create-only on the metadata key (``if_equal=Generation.NO_VALUE``):
of two concurrent creators exactly one writes the metadata; the other finds it
and opens it if compatible, or raises InvalidSpecError naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tensorstore_py.core.budget import DEFAULT_BYTES_IN_FLIGHT, ByteBudget
from tensorstore_py.core.errors import (
    ConditionFailedError,
    InvalidArgumentError,
    InvalidSpecError,
    NotFoundError,
)
from tensorstore_py.drivers import zarr2 as _z2
from tensorstore_py.drivers import zarr3 as _z3
from tensorstore_py.drivers.base import ArrayDriver
from tensorstore_py.drivers.cache import CachePool
from tensorstore_py.drivers.codecs import compression_codecs, compression_compressor
from tensorstore_py.drivers.dtypes import (
    dtype_from_v2,
    dtype_from_v3,
    dtype_to_v2,
    dtype_to_v3,
    fill_from_json,
    fill_from_v2,
    fill_to_json,
    fill_to_v2,
)
from tensorstore_py.drivers.engine import ChunkedArray
from tensorstore_py.kvstore.base import Generation, KvStore
from tensorstore_py.kvstore.registry import open_kvstore

__all__ = ["build_metadata", "default_chunks", "open_driver"]

_DRIVERS = ("zarr3", "zarr")
_SPEC_FIELDS = {"driver", "kvstore", "path", "metadata"}


def default_chunks(shape: Sequence[int], itemsize: int, *, target_bytes: int = 2 << 20) -> tuple[int, ...]:
    """A chunk shape of about ``target_bytes`` (1-4 MiB), halving the largest
    dimension first so chunks stay close to cubes."""
    chunks = [max(1, int(s)) for s in shape]
    while math.prod(chunks) * itemsize > 2 * target_bytes:
        d = max(range(len(chunks)), key=lambda i: chunks[i])
        if chunks[d] == 1:
            break
        chunks[d] = -(-chunks[d] // 2)
    return tuple(chunks)


def build_metadata(
    driver: str,
    *,
    shape: Sequence[int],
    dtype: Any,
    chunks: Sequence[int] | None = None,
    shards: Sequence[int] | None = None,
    codecs: list[dict[str, Any]] | None = None,
    compression: Any = None,
    fill_value: Any = None,
    dimension_names: Sequence[str | None] | None = None,
    order: str = "C",
) -> dict[str, Any]:
    """Full metadata for a new array.

    ``chunks`` defaults to ~2 MiB chunks. With ``shards`` (zarr3 only) the chunk
    grid is the shard shape and ``chunks`` the inner chunk shape of a
    ``sharding_indexed`` codec (crc32c-protected index at the end).
    ``compression``: a registered alias ("zstd" (level 1, no checksum), "gzip"
    (level 5), "blosc" (lz4, clevel 5, byte shuffle)), a ``(name, level)``
    pair, or None (see drivers/codecs/registry.py); InvalidArgumentError for
    anything else. ``codecs`` (zarr3) overrides the codec list entirely.
    """
    shape = [int(s) for s in shape]
    dt = np.dtype(dtype)
    if chunks is None:
        chunks = default_chunks(shape, dt.itemsize)
    chunks = [int(c) for c in chunks]
    if len(chunks) != len(shape):
        raise InvalidArgumentError(f"chunks {chunks} must have the rank of shape {shape}")
    if driver == "zarr3":
        inner = _z3.default_codecs(dt) + compression_codecs(compression, dt)
        if codecs is None:
            if order == "F":
                inner = [{"name": "transpose", "configuration": {"order": list(range(len(shape)))[::-1]}}] + inner
            codecs = inner
            if shards is not None:
                codecs = [{"name": "sharding_indexed", "configuration": {
                    "chunk_shape": chunks, "codecs": inner,
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                     {"name": "crc32c"}],
                    "index_location": "end"}}]
        grid = [int(s) for s in shards] if shards is not None else chunks
        meta: dict[str, Any] = {
            "zarr_format": 3, "node_type": "array", "shape": shape,
            "data_type": dtype_to_v3(dt),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill_to_json(0 if fill_value is None else fill_value, dt),
            "codecs": codecs,
        }
        if dimension_names is not None:
            meta["dimension_names"] = list(dimension_names)
        return meta
    if driver == "zarr":
        if shards is not None:
            raise InvalidArgumentError("zarr v2 has no sharding; use driver 'zarr3'")
        return {
            "zarr_format": 2, "shape": shape, "chunks": chunks, "dtype": dtype_to_v2(dt),
            "compressor": compression_compressor(compression, dt),
            "fill_value": fill_to_v2(fill_value, dt), "order": order,
            "filters": None, "dimension_separator": ".",
        }
    raise InvalidSpecError(f"array driver must be one of {_DRIVERS}, got {driver!r}")


def _complete(driver: str, partial: Mapping[str, Any]) -> dict[str, Any]:
    """Fill in defaults for creation and normalise the fill value to JSON."""
    if driver == "zarr3":
        if "data_type" not in partial or "shape" not in partial:
            raise InvalidSpecError(
                "zarr3 metadata fields 'shape' and 'data_type' are required to create an array"
            )
        dt = dtype_from_v3(partial["data_type"])
        meta = _z3.default_metadata(dict(partial), chunk_shape=default_chunks(partial["shape"], dt.itemsize))
        meta["fill_value"] = fill_to_json(fill_from_json(meta["fill_value"], dt), dt)
        meta["codecs"] = _z3.with_serializer(meta["codecs"], dt)
        return meta
    if "dtype" not in partial or "shape" not in partial:
        raise InvalidSpecError("zarr metadata fields 'shape' and 'dtype' are required to create an array")
    dt = dtype_from_v2(partial["dtype"])
    meta = _z2.default_metadata2(dict(partial), chunk_shape=default_chunks(partial["shape"], dt.itemsize))
    if meta["fill_value"] is not None:
        meta["fill_value"] = fill_to_v2(fill_from_v2(meta["fill_value"], dt), dt)
    return meta


def _check_compatible(driver: str, given: Mapping[str, Any], stored: dict[str, Any], parsed: Any, url: str) -> None:
    norm = _z3.normalize_field if driver == "zarr3" else _z2.normalize_field2
    for field, value in given.items():
        if field == "attributes" or field == "zarr_format" and value == stored.get(field):
            continue
        if field not in stored and field not in ("dimension_names", "storage_transformers",
                                                 "filters", "dimension_separator", "compressor"):
            raise InvalidSpecError(f"{driver} array at {url}: metadata field {field!r} is not stored")
        try:
            a = norm(field, value, parsed)
        except InvalidSpecError:
            raise
        b = norm(field, stored.get(field), parsed)
        if a != b:
            raise InvalidSpecError(
                f"{driver} array at {url}: metadata field {field!r} does not match: "
                f"expected {value!r}, stored {stored.get(field)!r}"
            )


def _url(kv: KvStore) -> str:
    try:
        return kv.url()
    except Exception:
        return repr(kv)


async def open_driver(
    spec: Mapping[str, Any],
    *,
    create: bool = False,
    open: bool | None = None,
    delete_existing: bool = False,
    cache_pool: CachePool | None = None,
    bytes_in_flight: int | None = None,
) -> ArrayDriver:
    """Open (and/or create) the array described by ``spec``.

    ``create=False``: the array must exist (else NotFoundError naming the URL).
    ``create=True``: create it, or open it if it exists with compatible metadata.
    ``open=False`` with ``create=True``: it must not exist yet.
    ``delete_existing=True``: delete everything under the array's path first.
    Given metadata fields must match the stored ones (InvalidSpecError naming
    the field otherwise).
    """
    if not isinstance(spec, Mapping):
        raise InvalidSpecError(f"array spec must be a dict, got {type(spec).__name__}")
    unknown = set(spec) - _SPEC_FIELDS
    if unknown:
        raise InvalidSpecError(f"array spec: unknown fields {sorted(unknown)}")
    driver = spec.get("driver")
    if driver not in _DRIVERS:
        raise InvalidSpecError(f"array spec field 'driver' must be one of {_DRIVERS}, got {driver!r}")
    if "kvstore" not in spec:
        raise InvalidSpecError("array spec: 'kvstore' is required")
    kv = await open_kvstore(spec["kvstore"])
    if spec.get("path"):
        kv = kv.with_path(str(spec["path"]))
    given = spec.get("metadata") or {}
    if not isinstance(given, Mapping):
        raise InvalidSpecError("array spec field 'metadata' must be an object")
    if delete_existing and not create:
        raise InvalidArgumentError("delete_existing=True requires create=True")
    if open is None:
        open = not delete_existing
    cls: type[ChunkedArray] = _z3.Zarr3Array if driver == "zarr3" else _z2.Zarr2Array
    key = cls.metadata_key
    budget = ByteBudget(bytes_in_flight or DEFAULT_BYTES_IN_FLIGHT)
    url = _url(kv)

    if delete_existing:
        await kv.delete_range("")
    for _attempt in range(5):
        res = await kv.read(key)
        if res.state == "value":
            if not open:
                raise InvalidSpecError(f"{driver} array at {url} already exists (open=False)")
            stored = cls.decode_metadata(res.value)
            parsed = cls.parse_metadata(stored)
            _check_compatible(driver, given, stored, parsed, url)
            return cls.from_metadata(stored, kv, res.generation, cache_pool=cache_pool,
                                     budget=budget, parsed=parsed)
        if not create:
            raise NotFoundError(f"{driver} array not found: no {key} at {url}")
        meta = _complete(driver, given)
        parsed = cls.parse_metadata(meta)
        raw = cls.encode_metadata(meta)
        try:
            gen = await kv.write(key, raw, if_equal=Generation.NO_VALUE)
        except ConditionFailedError:
            continue  # someone else created it: open theirs (compatibility checked)
        return cls.from_metadata(meta, kv, gen, cache_pool=cache_pool, budget=budget, parsed=parsed)
    raise ConditionFailedError(f"{driver} array at {url}: metadata kept changing while opening")
