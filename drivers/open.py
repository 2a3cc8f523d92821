"""Open or create an array from a spec: dispatch to the registered format, and
the shared open/create flow of formats described by one metadata document.

``open_driver(spec, ...)`` resolves ``spec["driver"]`` in the format registry
(drivers/formats.py), opens the kvstore (with ``path`` applied) and lets the
format open or create the array. ``build_metadata(driver, ...)`` turns
``tsp.open``'s keyword options into the format's metadata.

Formats whose array is ONE metadata document (``zarr.json``, ``.zarray``,
``attributes.json``) share :func:`open_document`: creation is create-only on the
metadata key (``if_equal=Generation.NO_VALUE``), so of two concurrent creators
exactly one writes the metadata; the other finds it and opens it if compatible,
or raises InvalidSpecError naming the field. A document that describes no array
(a group's) is either refused with an error naming the path and listing the
group's member arrays, or, for formats whose groups and arrays share one
document (N5), created into: the array's fields are added to the attributes
already there, conditioned on the document's generation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from tensorstore_py.core.budget import ByteBudget, default_bytes_in_flight
from tensorstore_py.core.errors import (
    ConditionFailedError,
    InvalidArgumentError,
    InvalidSpecError,
    NotFoundError,
)
from tensorstore_py.core.pools import Concurrency
from tensorstore_py.drivers.base import ArrayDriver
from tensorstore_py.drivers.cache import CachePool
from tensorstore_py.drivers.documents import url_of
from tensorstore_py.drivers.formats import MetadataOptions, OpenOptions, array_format
from tensorstore_py.drivers.grid import default_chunks
from tensorstore_py.drivers.groups import not_an_array_error
from tensorstore_py.kvstore.base import Generation, KvStore, ReadResult
from tensorstore_py.kvstore.registry import open_kvstore

__all__ = ["DocumentFormat", "build_metadata", "default_chunks", "open_document", "open_driver", "url_of"]

_SPEC_FIELDS = frozenset({"driver", "kvstore", "path", "metadata"})


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
    """Full metadata for a new array of format ``driver`` from ``tsp.open``'s
    keyword options (see each format's ``build_metadata`` for its defaults;
    options a format cannot express raise InvalidArgumentError)."""
    return array_format(driver).build_metadata(MetadataOptions(
        shape=shape, dtype=dtype, chunks=chunks, shards=shards, codecs=codecs,
        compression=compression, fill_value=fill_value, dimension_names=dimension_names,
        order=order))


async def open_driver(
    spec: Mapping[str, Any],
    *,
    create: bool = False,
    open: bool | None = None,
    delete_existing: bool = False,
    cache_pool: CachePool | None = None,
    bytes_in_flight: int | None = None,
    concurrency: Concurrency | None = None,
    prefetched: Mapping[str, ReadResult] | None = None,
) -> ArrayDriver:
    """Open (and/or create) the array described by ``spec``.

    ``create=False``: the array must exist (else NotFoundError naming the URL).
    ``create=True``: create it, or open it if it exists with compatible metadata.
    ``open=False`` with ``create=True``: it must not exist yet.
    ``delete_existing=True``: delete everything under the array's path first.
    Given metadata fields must match the stored ones (InvalidSpecError naming
    the field otherwise). ``bytes_in_flight`` / ``concurrency``: the array's
    byte budget and threads (defaults from the usable CPUs, see core/budget.py).
    ``prefetched``: reads of keys under the array's path made just before
    (:func:`~tensorstore_py.drivers.formats.probe_formats`), used instead of
    reading the metadata document again.
    """
    if not isinstance(spec, Mapping):
        raise InvalidSpecError(f"array spec must be a dict, got {type(spec).__name__}")
    fmt = array_format(spec.get("driver"))
    unknown = set(spec) - _SPEC_FIELDS - fmt.spec_fields
    if unknown:
        raise InvalidSpecError(f"{fmt.driver} array spec: unknown fields {sorted(unknown)}")
    if "kvstore" not in spec:
        raise InvalidSpecError("array spec: 'kvstore' is required")
    if delete_existing and not create:
        raise InvalidArgumentError("delete_existing=True requires create=True")
    kv = await open_kvstore(spec["kvstore"])
    if spec.get("path"):
        kv = kv.with_path(str(spec["path"]))
    options = OpenOptions(
        create=create, open=(not delete_existing) if open is None else open,
        delete_existing=delete_existing, cache_pool=cache_pool,
        budget=ByteBudget(bytes_in_flight or default_bytes_in_flight(), concurrency=concurrency),
        prefetched=None if delete_existing else prefetched)
    return await fmt.open(spec, kv, options)


class DocumentFormat(Protocol):
    """An array class whose array is described by one metadata document."""

    driver: str
    metadata_key: str

    @classmethod
    def decode_metadata(cls, raw: Any) -> dict[str, Any]: ...

    @staticmethod
    def parse_metadata(meta: dict[str, Any]) -> Any: ...

    @staticmethod
    def encode_metadata(meta: dict[str, Any]) -> bytes: ...

    @staticmethod
    def complete_metadata(partial: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults filled in for creation (required fields checked)."""

    @staticmethod
    def normalize_field(field: str, value: Any, parsed: Any) -> Any:
        """A comparable form of one metadata field (given vs stored)."""

    #: fields that may be given but absent from a stored document
    optional_fields: frozenset[str]

    @staticmethod
    def is_array_document(doc: dict[str, Any]) -> bool:
        """False for a stored document that describes no array (a group)."""

    @staticmethod
    def create_into(doc: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any] | None:
        """The document of a new array ``meta`` created where the non-array
        document ``doc`` is stored (its other members kept), or None when the
        format does not create arrays into such documents."""

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], kvstore: KvStore, generation: Generation, *,
                      cache_pool: CachePool | None = None, budget: ByteBudget | None = None,
                      parsed: Any = None) -> ArrayDriver: ...


def _check_compatible(cls: DocumentFormat, given: Mapping[str, Any], stored: dict[str, Any],
                      parsed: Any, url: str) -> None:
    for field, value in given.items():
        if field == "attributes" or field == "zarr_format" and value == stored.get(field):
            continue
        if field not in stored and field not in cls.optional_fields:
            raise InvalidSpecError(f"{cls.driver} array at {url}: metadata field {field!r} is not stored")
        if cls.normalize_field(field, value, parsed) != cls.normalize_field(field, stored.get(field), parsed):
            raise InvalidSpecError(
                f"{cls.driver} array at {url}: metadata field {field!r} does not match: "
                f"expected {value!r}, stored {stored.get(field)!r}"
            )


async def open_document(cls: DocumentFormat, spec: Mapping[str, Any], kv: KvStore,
                        options: OpenOptions, *,
                        on_create: Callable[[ArrayDriver], Awaitable[None]] | None = None) -> ArrayDriver:
    """Open or create the one-document array ``cls`` at ``kv`` (see the module doc).

    ``on_create(driver)`` runs after this call created the array (not when it
    opened one), e.g. to write documents that accompany the metadata.
    """
    given = spec.get("metadata") or {}
    if not isinstance(given, Mapping):
        raise InvalidSpecError(f"{cls.driver} array spec field 'metadata' must be an object")
    key, url = cls.metadata_key, url_of(kv)
    if options.delete_existing:
        await kv.delete_range("")
    prefetched = options.prefetched or {}
    for attempt in range(5):
        # the first look may use the detection's read of the document (one round trip less)
        res = prefetched[key] if attempt == 0 and key in prefetched else await kv.read(key)
        if res.state == "value":
            stored = cls.decode_metadata(res.value)
            if cls.is_array_document(stored):
                if not options.open:
                    raise InvalidSpecError(f"{cls.driver} array at {url} already exists (open=False)")
                parsed = cls.parse_metadata(stored)
                _check_compatible(cls, given, stored, parsed, url)
                return cls.from_metadata(stored, kv, res.generation, cache_pool=options.cache_pool,
                                         budget=options.budget, parsed=parsed)
            meta = cls.complete_metadata(given) if options.create else None
            doc = None if meta is None else cls.create_into(stored, meta)
            if doc is None:
                raise await not_an_array_error(kv, f"{cls.driver} array") or InvalidSpecError(
                    f"{cls.driver} array expected at {url}: its {key} describes no array")
        elif not options.create:
            raise await not_an_array_error(kv, f"{cls.driver} array") or NotFoundError(
                f"{cls.driver} array not found: no {key} at {url}")
        else:
            doc = cls.complete_metadata(given)
            # a group of another document (zarr v2's .zgroup) must not get an array on top
            group = None if options.delete_existing else await not_an_array_error(kv, f"{cls.driver} array")
            if group is not None:
                raise group
        parsed = cls.parse_metadata(doc)
        try:
            gen = await kv.write(key, cls.encode_metadata(doc), if_equal=res.generation)
        except ConditionFailedError:
            continue  # someone else created it (or changed the group): look again
        drv = cls.from_metadata(doc, kv, gen, cache_pool=options.cache_pool,
                                budget=options.budget, parsed=parsed)
        if on_create is not None:
            await on_create(drv)
        return drv
    raise ConditionFailedError(f"{cls.driver} array at {url}: metadata kept changing while opening")
