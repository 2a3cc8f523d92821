""":class:`TensorStore`, the lazy N-d array view (``tsp.open`` is in ``opening.py``).

A :class:`TensorStore` is an open array driver plus an
:class:`~tensorstore_py.indexing.IndexTransform`. Indexing, ``transpose``,
``translate_*`` and ``label`` build new views without I/O; ``read`` and
``write`` turn the view into one strided box per stored dimension and return
a :class:`~tensorstore_py.Future`. See docs/ARRAYS.md.

Guarantees (from the driver contract): a write never tears a chunk: each
stored chunk is replaced atomically, partial-chunk writes are read-modify-write
conditioned on the chunk's generation and retried. A write of several chunks
is *not* atomic as a whole unless it runs in a transaction
(:meth:`TensorStore.with_transaction`). Argument errors (shape, dtype, bounds)
are raised before any byte is read or written.

A view pickles as its spec (kvstore, metadata, transform) and its Context (a
downsampled view as its base view, factors and method: the members of
TensorStore's ``downsample`` spec): the
receiving process reopens the array (reading its metadata once per process and
Context; later copies reuse the open array) with that process's resources. A
view whose store can not travel (a memory store without a name, a store bound
to a transaction) raises UnsupportedError when pickled.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from tensorstore_py.context import Context, default_context
from tensorstore_py.core.budget import ByteBudget, default_bytes_in_flight
from tensorstore_py.core.buffers import new_array
from tensorstore_py.core.errors import (
    InvalidArgumentError,
    UnsupportedError,
)
from tensorstore_py.core.future import Future, ready, spawn, submit_blocking
from tensorstore_py.drivers.base import ArrayDriver
from tensorstore_py.drivers.dtypes import is_variable_length
from tensorstore_py.drivers.open import open_driver
from tensorstore_py.indexing import DimSelector, IndexDomain, IndexTransform, Plan
from tensorstore_py.kvstore.base import Generation, KvStore
from tensorstore_py.kvstore.transaction import Transaction
from tensorstore_py.values import broadcast_value, cast_value

__all__ = ["ChunkLayout", "TensorStore"]



@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """Chunking of a view, per view dimension.

    ``read_chunk_shape`` is the smallest unit read alone (the inner chunk of a
    sharded array), ``write_chunk_shape`` the unit written atomically (the
    shard). ``grid_origin`` is the view coordinate of a chunk boundary. New
    axes count as chunks of 1; along a strided dimension a chunk spans
    ``ceil(chunk / |stride|)`` view elements (a hint, boundaries may not align).
    """

    read_chunk_shape: tuple[int, ...]
    write_chunk_shape: tuple[int, ...]
    grid_origin: tuple[int, ...]


class TensorStore:
    """A lazy view of a stored N-d array (see docs/ARRAYS.md).

    Indexing with ``[]`` follows numpy (positions, negative from the end,
    slices clip); ``.at[]`` indexes by coordinates of :attr:`domain`;
    ``.dims[...]`` selects dimensions by label or position. None of these do I/O.
    """

    __slots__ = ("_context", "_driver", "_plan", "_t")

    def __init__(self, driver: ArrayDriver, transform: IndexTransform | None = None,
                 context: Context | None = None) -> None:
        self._driver = driver
        self._plan: tuple[tuple[int, ...], Plan] | None = None
        self._t = transform or _whole(driver)
        self._context = context

    def _get_plan(self) -> Plan:
        # Views are immutable; the plan only depends on the driver's shape.
        shape = self._driver.shape
        cached = self._plan
        if cached is not None and cached[0] == shape:
            return cached[1]
        plan = self._t.plan(shape)
        self._plan = (shape, plan)
        return plan

    def _view(self, t: IndexTransform) -> TensorStore:
        return TensorStore(self._driver, t, self._context)

    # -- properties -----------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._t.domain.shape

    @property
    def ndim(self) -> int:
        return self._t.rank

    rank = ndim

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def dtype(self) -> np.dtype:
        return self._driver.dtype

    @property
    def fill_value(self) -> Any:
        return self._driver.fill_value

    @property
    def domain(self) -> IndexDomain:
        """Coordinates of the view: ``inclusive_min``, ``exclusive_max``, ``shape``, ``labels``."""
        return self._t.domain

    @property
    def origin(self) -> tuple[int, ...]:
        return self._t.domain.inclusive_min

    @property
    def labels(self) -> tuple[str | None, ...]:
        """One label per view dimension (None = unlabelled)."""
        return self._t.domain.labels

    dimension_names = labels

    @property
    def transform(self) -> IndexTransform:
        return self._t

    @property
    def kvstore(self) -> KvStore:
        return self._driver.kvstore

    @property
    def driver(self) -> ArrayDriver:
        """The open array under this view (the whole stored array, ignoring the view's transform).

        Its public :class:`~tensorstore_py.drivers.base.ArrayDriver` contract gives
        the chunk grid, chunk keys and chunk decoding that tools checking or
        copying stored chunks need.
        """
        return self._driver

    @property
    def base(self) -> TensorStore:
        """The whole stored array (identity view)."""
        return TensorStore(self._driver, None, self._context)

    @property
    def chunk_layout(self) -> ChunkLayout:
        rd, wr = self._driver.read_chunk_shape, self._driver.write_chunk_shape
        read = [1] * self.ndim
        write = [1] * self.ndim
        origin = [0] * self.ndim
        for b, m in enumerate(self._t.output):
            d = m.input_dimension
            if d is None:
                continue
            s = abs(m.stride)
            read[d], write[d] = -(-rd[b] // s), -(-wr[b] // s)
            # base index 0 sits at view coordinate -offset/stride
            origin[d] = -m.offset // m.stride if m.offset % m.stride == 0 else 0
        return ChunkLayout(tuple(read), tuple(write), tuple(origin))

    @property
    def chunks(self) -> tuple[int, ...]:
        """The read chunk shape (inner chunk when sharded), per view dim."""
        return self.chunk_layout.read_chunk_shape

    @property
    def shards(self) -> tuple[int, ...] | None:
        """The write chunk (shard) shape, or None when not sharded."""
        lay = self.chunk_layout
        return None if lay.write_chunk_shape == lay.read_chunk_shape else lay.write_chunk_shape

    @property
    def attributes(self) -> dict[str, Any]:
        """The array's user attributes (zarr3 ``attributes``, zarr v2 ``.zattrs``
        without ``_ARRAY_DIMENSIONS``, N5 attributes.json members other than the
        dataset's), as of opening or the last :meth:`update_attributes` here."""
        return self._driver.attributes

    def update_attributes(self, changes: Mapping[str, Any]) -> Future[dict[str, Any]]:
        """Set the attributes in ``changes``, keeping the others: one atomic
        read-modify-write of the document holding them (conditioned on its
        generation, retried on a lost race; in the view's transaction, if any).
        Resolves to the attributes now stored."""
        return spawn(self._driver.update_attributes(dict(changes)))

    def spec(self) -> dict[str, Any]:
        """JSON from which :func:`open` reopens this view (``"transform"`` if not the whole array)."""
        d = dict(self._driver.spec())
        if self._t != _whole(self._driver):
            d["transform"] = self._t.to_json()
        if self._context is not None and self._context is not default_context():
            d["context"] = self._context.spec()
        return d

    def __repr__(self) -> str:
        return f"TensorStore({json.dumps(self.spec(), default=str)})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as the spec and the Context (see the module doc); the kvstore
        travels as an object, so its own rules apply (a version pin travels, a
        store that can not be reopened elsewhere raises UnsupportedError)."""
        t = self.spec().get("transform")
        own = getattr(self._driver, "reduce_view", None)
        if own is not None:  # a view over other views (tsp.downsample): the driver says how
            return cast("tuple[Any, ...]", own(t, self._context))
        spec = dict(self._driver.spec())
        spec["kvstore"] = self._driver.kvstore
        gen = getattr(self._driver, "_metadata_generation", None)
        if isinstance(gen, Generation) and gen.is_no_value and hasattr(self._driver, "from_metadata"):
            # metadata no stored document holds (a checkpoint leaf described by its
            # manifest): the metadata itself travels; reopening reads nothing
            return (_unpickle_described, (type(self._driver), spec["metadata"], spec["kvstore"], t,
                                          self._context))
        return (_unpickle_view, (spec, t, self._context))

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d TensorStore")
        return self.shape[0]

    # -- lazy views -----------------------------------------------------------
    def __getitem__(self, key: Any) -> TensorStore:
        """numpy basic indexing by position: ints, slices (any step), ``...``, ``None``."""
        return self._view(self._t.index(key))

    def __setitem__(self, key: Any, value: Any) -> None:
        """``view[key] = value``: a blocking :meth:`write`."""
        self[key].write(value).result()

    @property
    def at(self) -> _CoordIndexer:
        """Index by coordinates of :attr:`domain` (TensorStore semantics, no clipping)."""
        return _CoordIndexer(self, None)

    @property
    def dims(self) -> _DimsAccessor:
        """``view.dims["z"][10:20]``, ``view.dims["z", "y"].translate_to(0)`` ..."""
        return _DimsAccessor(self)

    def label(self, *labels: str | None) -> TensorStore:
        """Set the labels of every dimension (``None`` clears one)."""
        if len(labels) != self.ndim:
            raise InvalidArgumentError(f"label(): {len(labels)} labels for rank {self.ndim}")
        return self._view(self._t.with_labels(dict(enumerate(labels))))

    def transpose(self, *order: DimSelector | Sequence[DimSelector]) -> TensorStore:
        """Permute dims: ``t.transpose()`` reverses, ``t.transpose("x", "y", "z")`` / ``(2, 0, 1)``."""
        if len(order) == 1 and isinstance(order[0], (list, tuple)):
            order = tuple(order[0])
        if not order:
            perm = list(range(self.ndim))[::-1]
        else:
            perm = self._t.resolve_dims(order)  # type: ignore[arg-type]
            if len(perm) != self.ndim:
                raise InvalidArgumentError(
                    f"transpose order {list(order)} must name all {self.ndim} dimensions"
                )
        return self._view(self._t.transpose(perm))

    @property
    def T(self) -> TensorStore:
        return self.transpose()

    def translate_to(self, origin: int | Sequence[int | None]) -> TensorStore:
        """Shift coordinates so the domain starts at ``origin`` (an int applies to every dim)."""
        return _translate(self, list(range(self.ndim)), origin, to=True)

    def translate_by(self, offset: int | Sequence[int | None]) -> TensorStore:
        """Shift coordinates by ``offset`` (an int applies to every dim)."""
        return _translate(self, list(range(self.ndim)), offset, to=False)

    # -- I/O ------------------------------------------------------------------
    def read(self) -> Future[np.ndarray]:
        """Read the view into a new numpy array (missing chunks read as the fill value).

        The result may be a strided numpy view of a fresh buffer (after a
        transpose or negative step); it belongs to the caller.
        """
        plan = self._get_plan()
        if plan.empty:
            return ready(np.zeros(plan.shape, self.dtype))
        if self._driver.reads_blocking:
            # local files: no event loop round trips. Queued on the I/O pool, and
            # run by the caller itself when it waits before a pool thread took it
            # (core/future.py::submit_blocking): a read waited on at once takes
            # no thread hand-off (one chunk: 184 us, was 307-336 us through a pool
            # thread), and reads started together still run side by side.
            return submit_blocking(self._read_blocking, plan)
        return spawn(self._read(plan))

    async def _read(self, plan: Plan) -> np.ndarray:
        box = await self._driver.read(plan.index, out=_aligned_empty(plan.box_shape, self.dtype, self))
        return plan.to_view(box)

    def _read_blocking(self, plan: Plan) -> np.ndarray:
        box = self._driver.read_blocking(plan.index, _aligned_empty(plan.box_shape, self.dtype, self))
        return plan.to_view(box)

    def write(self, value: Any) -> Future[None]:
        """Write ``value`` (broadcast to the view's shape, cast with numpy ``same_kind`` rules).

        A value that does not broadcast or cast raises InvalidArgumentError (a
        ValueError) here, before any I/O. ``value`` may also be a TensorStore
        (read first). Each chunk is replaced atomically; the whole write is
        atomic only inside a transaction.
        """
        plan = self._get_plan()
        if isinstance(value, TensorStore):
            broadcast_value(_shape_probe(value), self.shape, self._t.domain)  # shape check, no I/O
            return spawn(self._write_from(value, plan))
        arr = broadcast_value(cast_value(value, self.dtype), self.shape, self._t.domain)
        if plan.empty:
            return ready(None)
        return spawn(self._driver.write(plan.index, plan.to_box(arr)))

    async def _write_from(self, src: TensorStore, plan: Plan) -> None:
        arr = broadcast_value(cast_value(await src.read(), self.dtype), self.shape, self._t.domain)
        if not plan.empty:
            await self._driver.write(plan.index, plan.to_box(arr))

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self.read().result()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def resize(self, new_shape: Sequence[int]) -> Future[TensorStore]:
        """Change the stored shape; chunks wholly outside it are deleted.

        Only on a view of the whole array (labels and a translation are kept);
        the returned TensorStore views the resized array. Views taken before
        keep the old driver and raise OutOfRangeError if they reach outside.
        """
        t = self._t
        base = self._driver.shape
        whole = (
            t.rank == t.base_rank and t.domain.shape == tuple(base)
            and all(m.input_dimension == b and m.stride == 1
                    and m.offset == -t.domain.inclusive_min[b] for b, m in enumerate(t.output))
        )
        if not whole:
            raise UnsupportedError(
                f"resize() needs a view of the whole array (domain {t.domain}); call it on .base"
            )
        new = tuple(_nonneg(s, "resize shape") for s in new_shape)
        if len(new) != len(base):
            raise InvalidArgumentError(f"resize: new shape {list(new)} has rank {len(new)}, "
                                       f"the array has rank {len(base)}")
        return spawn(self._resize(new))

    async def _resize(self, new: tuple[int, ...]) -> TensorStore:
        driver = await self._driver.resize(new)
        t = IndexTransform.identity(new, self._t.domain.labels)
        t = t.translate_by(dict(enumerate(self._t.domain.inclusive_min)))
        return TensorStore(driver, t, self._context)

    def with_transaction(self, txn: Transaction) -> TensorStore:
        """The same view with reads and writes going through ``txn``.

        Nothing written is visible to others until ``txn`` commits; then all of it is.
        """
        drv = self._driver.with_kvstore(self._driver.kvstore.with_transaction(txn))
        return TensorStore(drv, self._t, self._context)


class _CoordIndexer:
    __slots__ = ("_dims", "_ts")

    def __init__(self, ts: TensorStore, dims: list[int] | None) -> None:
        self._ts, self._dims = ts, dims

    def __getitem__(self, key: Any) -> TensorStore:
        return self._ts._view(self._ts._t.index(key, coords=True, dims=self._dims))

    def __setitem__(self, key: Any, value: Any) -> None:
        self[key].write(value).result()


class _DimsAccessor:
    __slots__ = ("_ts",)

    def __init__(self, ts: TensorStore) -> None:
        self._ts = ts

    def __getitem__(self, sel: DimSelector | tuple[DimSelector, ...] | slice) -> DimSelection:
        if isinstance(sel, slice):
            dims = list(range(self._ts.ndim))[sel]
        else:
            dims = self._ts._t.resolve_dims(sel if isinstance(sel, tuple) else (sel,))
        return DimSelection(self._ts, dims)


class DimSelection:
    """Some dimensions of a view, by label or position: ``view.dims["z", "y"]``.

    ``[key]`` indexes only those dims (numpy semantics, in selection order),
    ``.at[key]`` by coordinates; ``translate_to/by`` and ``label`` act on them.
    """

    __slots__ = ("_dims", "_ts")

    def __init__(self, ts: TensorStore, dims: list[int]) -> None:
        self._ts, self._dims = ts, dims

    def __getitem__(self, key: Any) -> TensorStore:
        return self._ts._view(self._ts._t.index(key, dims=self._dims))

    @property
    def at(self) -> _CoordIndexer:
        return _CoordIndexer(self._ts, self._dims)

    def translate_to(self, origin: int | Sequence[int | None]) -> TensorStore:
        return _translate(self._ts, self._dims, origin, to=True)

    def translate_by(self, offset: int | Sequence[int | None]) -> TensorStore:
        return _translate(self._ts, self._dims, offset, to=False)

    def label(self, *labels: str | None) -> TensorStore:
        if len(labels) != len(self._dims):
            raise InvalidArgumentError(
                f"label(): {len(labels)} labels for {len(self._dims)} selected dimension(s)"
            )
        return self._ts._view(self._ts._t.with_labels(dict(zip(self._dims, labels))))


# -- helpers ------------------------------------------------------------------
def _whole(driver: ArrayDriver) -> IndexTransform:
    """The view of the whole stored array: its labels, its domain at the driver's origin."""
    t = IndexTransform.identity(driver.shape, tuple(lab or None for lab in driver.dimension_names))
    origin = driver.origin
    return t.translate_by(dict(enumerate(origin))) if any(origin) else t


def _nonneg(x: Any, what: str) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 0:
        raise InvalidArgumentError(f"{what}: expected non-negative integers, got {x!r}")
    return int(x)


def _translate(ts: TensorStore, dims: list[int], amount: Any, *, to: bool) -> TensorStore:
    vals = [amount] * len(dims) if isinstance(amount, (int, np.integer)) else list(amount)
    if len(vals) != len(dims):
        raise InvalidArgumentError(
            f"translate: {len(vals)} values for {len(dims)} dimension(s)"
        )
    mins = ts._t.domain.inclusive_min
    offsets = {}
    for d, v in zip(dims, vals):
        if v is None:
            continue
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise InvalidArgumentError(f"translate: expected integers or None, got {v!r}")
        offsets[d] = int(v) - mins[d] if to else int(v)
    return ts._view(ts._t.translate_by(offsets))


_ALIGN_MIN_BYTES = 1 << 16


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype, view: TensorStore) -> np.ndarray:
    """An uninitialised C-order array for a read of ``view``; page-aligned when large.

    The kernel copies file data into page-aligned buffers several times faster
    than into malloc'ed ones (see core/buffers.py), and chunks that map 1:1
    onto the result are read straight into it. A result that can not be
    allocated (an absurd shape) raises ResourceExhaustedError.
    """
    n = math.prod(shape) * dtype.itemsize
    small = n < _ALIGN_MIN_BYTES or is_variable_length(dtype)  # strings/bytes: pointers, not data
    return new_array(shape, dtype, aligned=not small,
                     what=lambda: f"reading {view.domain} of the array on {view._driver.kvstore!r}")


def _shape_probe(ts: TensorStore) -> np.ndarray:
    # A zero-strided array of ts's shape: lets _broadcast check shapes without reading.
    return np.broadcast_to(np.zeros((), np.uint8), ts.shape)


# -- unpickling ---------------------------------------------------------------------
#: arrays reopened by unpickling, per process: (spec JSON, id of the Context) ->
#: (Context, identity view); bounded, least recently used first out
_REOPENED: OrderedDict[tuple[str, int], tuple[Context, TensorStore]] = OrderedDict()
_REOPENED_MAX = 64
_reopened_lock = threading.Lock()


def _unpickle_view(spec: dict[str, Any], transform: dict[str, Any] | None,
                   context: Context | None) -> TensorStore:
    """A pickled view, reopened in this process (blocks while the metadata is read)."""
    ctx = context if context is not None else default_context()
    key = (json.dumps({**spec, "kvstore": spec["kvstore"].spec()}, sort_keys=True, default=str), id(ctx))
    with _reopened_lock:
        hit = _REOPENED.get(key)
        if hit is not None and hit[0] is ctx:
            _REOPENED.move_to_end(key)
    if hit is None or hit[0] is not ctx:
        drv = spawn(open_driver(spec, cache_pool=ctx.cache_pool, bytes_in_flight=ctx.bytes_in_flight,
                                concurrency=ctx.concurrency)).result()
        base = TensorStore(drv, None, ctx)
        with _reopened_lock:
            _REOPENED[key] = (ctx, base)
            while len(_REOPENED) > _REOPENED_MAX:
                _REOPENED.popitem(last=False)
    else:
        base = hit[1]
    if transform is None:
        return base
    return base._view(IndexTransform.from_json(transform, len(base._driver.shape)))


def _unpickle_described(cls: Any, metadata: dict[str, Any], kvstore: KvStore, transform: dict[str, Any] | None,
                        context: Context | None) -> TensorStore:
    """A pickled view of an array whose metadata no document stores, rebuilt from it."""
    ctx = context if context is not None else default_context()
    budget = ByteBudget(ctx.bytes_in_flight or default_bytes_in_flight(), concurrency=ctx.concurrency)
    drv = cls.from_metadata(metadata, kvstore, Generation.NO_VALUE, cache_pool=ctx.cache_pool, budget=budget)
    base = TensorStore(drv, None, ctx)
    if transform is None:
        return base
    return base._view(IndexTransform.from_json(transform, len(drv.shape)))
