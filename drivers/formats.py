"""The array formats ``tsp.open`` knows: one registry, each format registers itself.

A format module (``zarr3``, ``zarr2``, ...) calls :func:`register_array_format`
with an :class:`ArrayFormat`: its driver name and aliases, the metadata key that
identifies an existing array of the format (used when a spec names no driver),
how to open or create an array from a spec, and how to build metadata from the
keyword options of ``tsp.open(..., dtype=, shape=, chunks=, ...)``.

Adding a format = one new module that registers itself plus one import line in
``drivers/__init__.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorstore_py.core.budget import ByteBudget
from tensorstore_py.core.errors import InvalidArgumentError, InvalidSpecError
from tensorstore_py.drivers.base import ArrayDriver
from tensorstore_py.drivers.cache import CachePool
from tensorstore_py.drivers.dtypes import as_dtype, element_nbytes
from tensorstore_py.drivers.grid import default_chunks
from tensorstore_py.kvstore.base import Buffer, KvStore, ReadResult

__all__ = [
    "ArrayFormat",
    "MetadataOptions",
    "OpenOptions",
    "array_format",
    "array_formats",
    "detect_format",
    "probe_formats",
    "register_array_format",
]


@dataclass(frozen=True, slots=True)
class OpenOptions:
    """What ``open_driver`` was asked to do, for a format's ``open``."""

    create: bool
    open: bool
    delete_existing: bool
    cache_pool: CachePool | None
    budget: ByteBudget
    #: reads of metadata keys made just before (format detection), by key: the
    #: open's first look at its metadata uses them instead of asking the store again
    prefetched: Mapping[str, ReadResult] | None = None


@dataclass(frozen=True, slots=True)
class MetadataOptions:
    """The keyword options of ``tsp.open`` that describe a new array."""

    shape: Sequence[int]
    dtype: Any
    chunks: Sequence[int] | None = None
    shards: Sequence[int] | None = None
    codecs: Any = None
    compression: Any = None
    fill_value: Any = None
    dimension_names: Sequence[str | None] | None = None
    order: str = "C"

    def grid(self) -> tuple[list[int], np.dtype, list[int]]:
        """``shape``, ``dtype`` and ``chunks`` (~2 MiB chunks when not given),
        the rank checked (InvalidArgumentError)."""
        shape = [int(s) for s in self.shape]
        dt = as_dtype(self.dtype)
        chunks = [int(c) for c in (self.chunks if self.chunks is not None
                                   else default_chunks(shape, element_nbytes(dt)))]
        if len(chunks) != len(shape):
            raise InvalidArgumentError(f"chunks {chunks} must have the rank of shape {shape}")
        return shape, dt, chunks

    def refuse_zarr3_options(self, fmt: str) -> None:
        """InvalidArgumentError for ``shards`` and ``codecs``, which only zarr3
        arrays have (``fmt``: the format's name in the message)."""
        if self.shards is not None:
            raise InvalidArgumentError(f"{fmt} has no sharding; use driver 'zarr3'")
        if self.codecs is not None:
            raise InvalidArgumentError(f"codecs= is a zarr3 codec list; {fmt} takes compression=")


OpenFn = Callable[[Mapping[str, Any], KvStore, OpenOptions], Awaitable[ArrayDriver]]
BuildFn = Callable[[MetadataOptions], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class ArrayFormat:
    """How one array format plugs into ``tsp.open``.

    ``open(spec, kvstore, options)`` opens (or creates, per ``options``) the
    array described by ``spec`` over ``kvstore`` (the spec's ``path`` already
    applied); it validates its own spec fields. ``build_metadata(options)``
    turns ``tsp.open``'s keyword options into the format's metadata document.
    ``probe_key`` is read when a spec names no driver; ``is_array(raw)`` tells
    whether that document describes an array (a group's document does not).
    """

    driver: str
    probe_key: str
    open: OpenFn
    build_metadata: BuildFn
    aliases: tuple[str, ...] = ()
    is_array: Callable[[Buffer], bool] = lambda raw: True
    #: spec fields the format accepts besides driver, kvstore, path, metadata
    spec_fields: frozenset[str] = frozenset()


_FORMATS: dict[str, ArrayFormat] = {}
_ALIASES: dict[str, str] = {}


def register_array_format(fmt: ArrayFormat) -> ArrayFormat:
    """Make ``fmt`` known to ``tsp.open`` under its driver name and aliases.

    Formats are probed in registration order when a spec names no driver.
    """
    _FORMATS[fmt.driver] = fmt
    for name in (fmt.driver, *fmt.aliases):
        _ALIASES[name] = fmt.driver
    return fmt


def array_formats() -> list[ArrayFormat]:
    """Every registered format, in registration (probe) order."""
    return list(_FORMATS.values())


def array_format(name: Any) -> ArrayFormat:
    """The format registered as ``name`` (a driver name or alias)."""
    driver = _ALIASES.get(name) if isinstance(name, str) else None
    if driver is None:
        known = ", ".join(sorted(_ALIASES))
        raise InvalidSpecError(f"unknown array driver {name!r}; known drivers: {known}")
    return _FORMATS[driver]


async def detect_format(kv: KvStore) -> ArrayFormat | None:
    """The format of the array stored at ``kv``, or None if there is none."""
    return (await probe_formats(kv))[0]


async def probe_formats(kv: KvStore) -> tuple[ArrayFormat | None, dict[str, ReadResult]]:
    """The format of the array stored at ``kv`` (or None) and the reads that
    found it, by key: every format's probe key, read concurrently (one round
    trip). Passed on as ``OpenOptions.prefetched``, they spare the open a
    second read of the metadata document."""
    formats = array_formats()
    keys = list(dict.fromkeys(f.probe_key for f in formats))
    results = dict(zip(keys, await asyncio.gather(*(kv.read(k) for k in keys)), strict=True))
    for fmt in formats:
        res = results[fmt.probe_key]
        if res.state == "value" and fmt.is_array(res.value):
            return fmt, results
    return None, results
