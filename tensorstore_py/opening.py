"""``tsp.open``: open or create an array from a JSON spec or a URL.

The keyword options are checked here (InvalidArgumentError naming the option,
raised by ``open()`` itself before any I/O); the format is the spec's driver or
is detected from what is stored (drivers/formats.py); the driver layer opens or
creates the array (drivers/open.py) and the result is a :class:`TensorStore`
view. See docs/ARRAYS.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tensorstore_py.context import Context, default_context
from tensorstore_py.core.errors import InvalidArgumentError, InvalidSpecError, NotFoundError
from tensorstore_py.core.future import Future, spawn
from tensorstore_py.drivers.base import ArrayDriver
from tensorstore_py.drivers.dtypes import as_dtype
from tensorstore_py.drivers.formats import array_format, array_formats, probe_formats
from tensorstore_py.drivers.groups import not_an_array_error
from tensorstore_py.drivers.open import build_metadata, open_driver, url_of
from tensorstore_py.indexing import IndexTransform
from tensorstore_py.kvstore.base import ReadResult
from tensorstore_py.kvstore.registry import open_kvstore
from tensorstore_py.kvstore.transaction import Transaction
from tensorstore_py.tensorstore import TensorStore

__all__ = ["open"]


def open(
    spec: str | Mapping[str, Any],
    *,
    create: bool = False,
    open: bool | None = None,
    delete_existing: bool = False,
    context: Context | None = None,
    transaction: Transaction | None = None,
    driver: str | None = None,
    dtype: Any = None,
    shape: Sequence[int] | None = None,
    chunks: Sequence[int] | None = None,
    shards: Sequence[int] | None = None,
    codecs: Any = None,
    compression: Any = None,
    fill_value: Any = None,
    dimension_names: Sequence[str | None] | None = None,
    order: str = "C",
) -> Future[TensorStore]:
    """Open (or create) an array from a JSON spec or a kvstore URL.

    ``spec``: ``{"driver": "zarr3"|"zarr"|"n5", "kvstore": URL or kvstore spec,
    "metadata": {...}, "context": {...}, "transform": {...}}`` or just a URL.
    Without a driver, an existing array is detected (``zarr.json`` -> zarr3,
    ``.zarray`` -> zarr, ``attributes.json`` with ``dimensions`` -> n5); a new
    one is zarr3. A group where an array is expected raises InvalidSpecError
    naming the path and listing the group's member arrays.

    ``create=True`` creates the array, or opens it if it exists with compatible
    metadata (else InvalidSpecError naming the field); ``delete_existing=True``
    replaces it. The keyword options (``dtype``, ``shape``, ``chunks``,
    ``shards``, ``codecs``, ``compression``, ``fill_value``,
    ``dimension_names``, ``order``) build the metadata when creating; when
    opening they are checked against the stored array.
    """
    opts = _check_options({"dtype": dtype, "shape": shape, "chunks": chunks, "shards": shards,
                           "codecs": codecs, "compression": compression, "fill_value": fill_value,
                           "dimension_names": dimension_names}, order)
    return spawn(_open(spec, create=create or delete_existing, open_=open,
                       delete_existing=delete_existing, context=context, transaction=transaction,
                       driver=driver, opts=opts, order=order))


# as TensorStore and zarr3: ranks up to 32, extents up to 2^62 (int64 index arithmetic)
_MAX_RANK = 32
_MAX_EXTENT = 2**62


def _int_list(v: Any, what: str, *, positive: bool) -> tuple[int, ...]:
    kind = "positive" if positive else "non-negative"
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence | np.ndarray):
        raise InvalidArgumentError(f"open: {what} must be a sequence of {kind} integers, got {v!r}")
    out = []
    for x in v:
        if (isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer))
                or x < (1 if positive else 0) or x > _MAX_EXTENT):
            raise InvalidArgumentError(
                f"open: {what} must be a sequence of {kind} integers up to 2^62, got {list(v)!r}"
            )
        out.append(int(x))
    if len(out) > _MAX_RANK:
        raise InvalidArgumentError(f"open: {what} has rank {len(out)}, more than {_MAX_RANK}")
    return tuple(out)


def _check_options(opts: dict[str, Any], order: Any) -> dict[str, Any]:
    """The keyword options of :func:`open`, checked and normalised (ints, a
    numpy dtype); InvalidArgumentError naming the option otherwise."""
    out = dict(opts)
    if opts["dtype"] is not None:
        try:
            out["dtype"] = as_dtype(opts["dtype"])
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"open: dtype={opts['dtype']!r} is not a data type (e.g. 'float32', np.uint8, "
                "'bfloat16' from ml_dtypes)"
            ) from None
    if opts["shape"] is not None:
        out["shape"] = _int_list(opts["shape"], "shape", positive=False)
    for name in ("chunks", "shards"):
        if opts[name] is not None:
            out[name] = _int_list(opts[name], name, positive=True)
    names = opts["dimension_names"]
    if names is not None:
        if isinstance(names, (str, bytes)) or not isinstance(names, Sequence) or not all(
                n is None or isinstance(n, str) for n in names):
            raise InvalidArgumentError(
                f"open: dimension_names must be a sequence of strings or None, got {names!r}"
            )
        out["dimension_names"] = tuple(names)
    if order not in ("C", "F"):
        raise InvalidArgumentError(f"open: order must be 'C' or 'F', got {order!r}")
    if out["dtype"] is not None and opts["fill_value"] is not None:
        _check_fill(opts["fill_value"], out["dtype"])
    return out


def _check_fill(value: Any, dtype: np.dtype) -> None:
    """A scalar numpy can store in ``dtype`` (a complex dtype also takes a
    ``[re, im]`` pair, as in zarr3 JSON)."""
    if dtype.kind == "c" and isinstance(value, (list, tuple)) and len(value) == 2:
        for part in value:
            _check_fill(part, np.dtype(f"f{dtype.itemsize // 2}"))
        return
    try:
        ok = np.array(value, dtype=dtype).ndim == 0
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise InvalidArgumentError(f"open: fill_value={value!r} is not a scalar of dtype {dtype}")


async def _detect(spec: Mapping[str, Any], create: bool) -> tuple[str | None, dict[str, ReadResult]]:
    """The driver of the array at the spec's kvstore (None: none there) and
    the reads that told, which the open reuses instead of reading again."""
    kv = await open_kvstore(spec["kvstore"])
    if spec.get("path"):
        kv = kv.with_path(str(spec["path"]))
    fmt, reads = await probe_formats(kv)
    if fmt is None and not create:
        probes = ", ".join(sorted({f.probe_key for f in array_formats()}))
        raise await not_an_array_error(kv, "an array") or NotFoundError(
            f"open: no array at {url_of(kv)} (none of {probes} found)")
    return (None if fmt is None else fmt.driver), reads


async def _open(spec: Any, *, create: bool, open_: bool | None, delete_existing: bool,
                context: Context | None, transaction: Any, driver: str | None,
                opts: dict[str, Any], order: str) -> TensorStore:
    if isinstance(spec, str):
        spec = {"kvstore": spec}
    if not isinstance(spec, Mapping):
        raise InvalidSpecError(f"open: spec must be a URL or a dict, got {type(spec).__name__}")
    spec = dict(spec)
    if "kvstore" not in spec:
        raise InvalidSpecError(f"open: spec {spec!r} has no 'kvstore'")
    ctx_json = spec.pop("context", None)
    if context is None:
        context = Context(ctx_json) if ctx_json is not None else default_context()
    spec["kvstore"] = context.bind_kvstore(spec["kvstore"])  # memory:// shares the Context's store
    transform_json = spec.pop("transform", None)

    if driver is not None and spec.get("driver") not in (None, driver):
        raise InvalidSpecError(
            f"open: driver={driver!r} contradicts the spec's driver {spec['driver']!r}"
        )
    name = driver or spec.get("driver")
    prefetched: dict[str, ReadResult] | None = None
    if name is None and not delete_existing:
        name, prefetched = await _detect(spec, create)
    name = name or "zarr3"
    spec["driver"] = array_format(name).driver

    given = {k: v for k, v in opts.items() if v is not None}
    if create and given:
        meta = dict(spec.get("metadata") or {})
        if "shape" not in given or "dtype" not in given:
            if not meta:
                raise InvalidArgumentError("open(create=True): shape= and dtype= are required")
        else:
            built = build_metadata(spec["driver"], shape=given.pop("shape"),
                                   dtype=given.pop("dtype"), order=order, **given)
            built.update(meta)  # explicit metadata fields win
            spec["metadata"] = built
    drv = await open_driver(spec, create=create, open=open_, delete_existing=delete_existing,
                            cache_pool=context.cache_pool, bytes_in_flight=context.bytes_in_flight,
                            concurrency=context.concurrency, prefetched=prefetched)
    if not create and given:
        _check_matches(drv, given, spec["kvstore"])
    if transaction is not None:
        drv = drv.with_kvstore(drv.kvstore.with_transaction(transaction))
    t = None
    if transform_json is not None:
        t = IndexTransform.from_json(transform_json, len(drv.shape))
        t.plan(drv.shape)  # bounds check now, not at first read
    return TensorStore(drv, t, context)


def _check_matches(drv: ArrayDriver, given: dict[str, Any], where: Any) -> None:
    found = {
        "shape": tuple(drv.shape),
        "dtype": np.dtype(drv.dtype),
        "chunks": tuple(drv.read_chunk_shape),
        "shards": tuple(drv.write_chunk_shape),
        "dimension_names": tuple(drv.dimension_names),
    }
    for field, want in given.items():
        if field not in found:
            continue  # codecs/compression/fill_value: the metadata document is the authority
        want_n = as_dtype(want) if field == "dtype" else tuple(want)
        if found[field] != want_n:
            raise InvalidSpecError(
                f"open {where}: the stored array has {field}={found[field]}, expected {want_n}"
            )
