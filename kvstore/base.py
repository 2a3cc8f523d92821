"""The kvstore contract: bytes by key, with honest conditions.

This module holds the contract and nothing else: the abstract :class:`KvStore`,
:class:`ReadResult` and :class:`Generation`; the key rules live in
``tensorstore_py.kvstore.keys`` and are re-exported here. The byte-range
value types (:class:`ByteRange`, ``Buffer``) come from ``tensorstore_py.core.ranges``
and are re-exported here. Each backend is one module beside it.

Guarantees every store gives (a store that can not give one raises
:class:`~tensorstore_py.errors.UnsupportedError` naming the operation):

* ``write(key, value)`` replaces the whole value atomically: a reader sees the old
  value or the new one, never a mix.
* ``write(..., if_equal=Generation.NO_VALUE)`` creates only: it raises
  :class:`~tensorstore_py.errors.ConditionFailedError` if the key exists.
  ``write(..., if_equal=g)`` is a compare-and-swap against generation ``g``.
  Both are atomic with respect to every other writer the store serves.
* A missing key is a result (``state == "missing"``), never an exception.
* Generations are opaque, change on every write, and are only comparable for one
  key of one store.
* Keys are relative to the store's ``path``; they are validated (no empty key, no
  absolute key, no ``.``/``..`` segment, no empty segment, no NUL, nothing
  that is not valid UTF-8 such as a lone surrogate) so nothing escapes the
  root and every store can name the key.
* A store pickles as its spec and reopens in the receiving process with its own
  sessions, locks and caches (:meth:`KvStore.__reduce__`); a store that can not
  be reopened elsewhere raises :class:`~tensorstore_py.errors.UnsupportedError`
  when it is pickled. ``copy.copy`` and ``copy.deepcopy`` give another handle on
  the same data (never a copy of the data).
"""

from __future__ import annotations

import asyncio
import builtins
import copy
import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, cast, runtime_checkable

from tensorstore_py.core.errors import (
    ConditionFailedError,
    InvalidArgumentError,
    InvalidSpecError,
    ReadOnlyError,
    UnsupportedError,
)
from tensorstore_py.core.future import Future, run_sync, spawn, submit_blocking
from tensorstore_py.core.ranges import Buffer, ByteRange, coalesce
from tensorstore_py.kvstore.keys import join_path, split_folder, validate_key, validate_prefix
from tensorstore_py.kvstore.registry import driver_class, open_kvstore

__all__ = [
    "BlockingRead",
    "Buffer",
    "ByteRange",
    "FolderListing",
    "Generation",
    "KeyInfo",
    "KvStore",
    "RangesResult",
    "ReadResult",
    "ReadState",
    "TransactionLike",
    "split_folder",
    "validate_key",
    "validate_prefix",
]

ReadState = Literal["value", "missing", "unchanged"]
#: a prepared whole-value read (see :meth:`KvStore._prepare_read`)
BlockingRead = Callable[[], "ReadResult"]


@dataclass(frozen=True, slots=True)
class Generation:
    """An opaque stamp of one stored value of one key.

    It changes on every write (even of identical bytes where the store allows),
    is only meaningful for the key and store it came from, and is never ordered.
    ``Generation.NO_VALUE`` stands for "the key is absent": as a write condition
    it means create-only.
    """

    token: bytes

    NO_VALUE: ClassVar[Generation]

    @property
    def is_no_value(self) -> bool:
        return self.token == b""

    def __repr__(self) -> str:
        return "Generation.NO_VALUE" if self.token == b"" else f"Generation({self.token.hex()})"


Generation.NO_VALUE = Generation(b"")


@dataclass(frozen=True, slots=True)
class ReadResult:
    """The outcome of a read: ``state`` is "value", "missing" or "unchanged".

    ``value`` is the bytes read (empty unless ``state == "value"``);
    ``generation`` is the value's generation (``NO_VALUE`` when missing).
    """

    state: ReadState
    value: Buffer
    generation: Generation

    @staticmethod
    def missing() -> ReadResult:
        return ReadResult("missing", b"", Generation.NO_VALUE)


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """A listed key with its size in bytes and last-modified time (Unix seconds).

    ``size`` / ``mtime`` are None where the store does not know them cheaply.
    """

    key: str
    size: int | None = None
    mtime: float | None = None


@dataclass(frozen=True, slots=True)
class FolderListing:
    """The direct children of a folder (:meth:`KvStore.list_folder`): ``keys`` in
    it and ``folders`` below it (each ending in ``/``), sorted."""

    keys: list[str]
    folders: list[str]


@dataclass(frozen=True, slots=True)
class RangesResult:
    """Several byte ranges of one value, all read at the same generation."""

    state: Literal["value", "missing"]
    values: list[Buffer]
    generation: Generation


@runtime_checkable
class TransactionLike(Protocol):
    """What :meth:`KvStore.with_transaction` needs of a transaction: it binds a
    store, i.e. returns a view of it whose reads and writes go through the
    transaction (``tensorstore_py.Transaction`` is the implementation)."""

    def bind(self, store: KvStore) -> KvStore: ...


# Coalescing of nearby byte ranges into one request (see KvStore.read_ranges).
DEFAULT_COALESCE_GAP = 1 << 20
_MAX_RANGES_ATTEMPTS = 5


class KvStore(ABC):
    """Abstract key-value store: every public call returns a :class:`Future`.

    Backends implement the ``_``-prefixed coroutines, which receive *full* keys
    (``self.path + key``), already validated. Everything else is derived here.
    """

    #: name of the driver in specs and in the registry
    driver: ClassVar[str] = ""
    #: True when the store rejects every mutation
    read_only: bool = False
    #: True when :meth:`list_folder` asks the store for one level (a delimiter
    #: listing, a directory read) rather than listing every key below
    lists_folders_natively: ClassVar[bool] = False
    #: True when one clock stamps every modification time, whatever host writes (gcs,
    #: s3: the server's; memory), docs/FORMAT.md §9.1; False where clients may (file)
    single_clock: ClassVar[bool] = False
    #: True when a mutation's Future, once cancelled, reports what the
    #: operation made of it: a plain cancellation only when nothing that could
    #: apply it was sent, else CommitOutcomeUnknownError (the versioned store)
    cancel_reports_outcome: ClassVar[bool] = False
    #: requests the store keeps in flight at once (a remote store's
    #: ``concurrency``), None when it has no such bound (local stores). Array
    #: drivers keep that many chunk requests going, as far as their byte budget
    #: allows: at cloud latency throughput is bytes in flight over the round trip.
    requests_in_flight: int | None = None

    def __init__(self, *, path: str = "") -> None:
        self.path = path

    # -- opening ------------------------------------------------------------
    @staticmethod
    def open(spec: str | Mapping[str, Any] | KvStore) -> Future[KvStore]:
        """Open a store from a URL (``file:///abs/``, ``memory://``, ``gs://b/p``,
        ``http(s)://...``, any fsspec URL) or a JSON spec dict."""
        return cast(Future[KvStore], spawn(open_kvstore(spec)))

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> KvStore | Awaitable[KvStore]:
        """A store of this driver from its JSON spec (what :meth:`spec` returns).

        Adapters, which open a base store first, return an awaitable. Every
        registered driver implements it (``kvstore.registry`` calls it).
        """
        raise UnsupportedError(f"{cls.__name__} can not be opened from a spec")

    @classmethod
    def spec_from_url(cls, url: str) -> dict[str, Any]:
        """The JSON spec of a URL of one of this driver's schemes (see the registry)."""
        raise InvalidSpecError(f"{cls.__name__} has no URL form: {url!r}")

    # -- identity -----------------------------------------------------------
    def spec(self) -> dict[str, Any]:
        """A JSON-able dict from which ``KvStore.open`` reopens this store."""
        d: dict[str, Any] = {"driver": self.driver}
        d.update(self._spec_fields())
        d["path"] = self.path
        return d

    @abstractmethod
    def _spec_fields(self) -> dict[str, Any]:
        """Backend fields of the spec (everything but driver and path)."""

    def url(self) -> str:
        """A URL for this store (where the backend has a URL form)."""
        raise UnsupportedError(f"{self.driver} store has no URL form; use spec()")

    def __repr__(self) -> str:
        return f"KvStore({self.spec()!r})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash((type(self), self._identity()))

    def _identity(self) -> Any:
        """What makes two instances the same store (default: the spec)."""
        return json.dumps(self.spec(), sort_keys=True)

    # -- pickling and copying ---------------------------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as the spec: the receiving process reopens the store with its own
        sessions, locks and caches (nothing of this process travels).

        Stores that can not be reopened elsewhere override this to raise
        UnsupportedError; adapters pickle their base store as an object (so its
        own rules apply) and reopen without I/O.
        """
        return (reopen, (self.spec(),))

    def __copy__(self) -> KvStore:
        # A plain shallow copy: views (with_path) share sessions, locks and state;
        # without this, copy.copy would go through __reduce__ and reopen the store.
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        return other

    def __deepcopy__(self, memo: dict[int, Any]) -> KvStore:
        # A store is a handle on stored data: a deep copy is another handle.
        return self.__copy__()

    # -- sub-paths ----------------------------------------------------------
    def with_path(self, sub: str) -> KvStore:
        """A view of this store whose keys live under ``sub/``."""
        other = copy.copy(self)
        other.path = join_path(self.path, sub)
        return other

    def __truediv__(self, sub: str) -> KvStore:
        return self.with_path(sub)

    def _full(self, key: str) -> str:
        return self.path + validate_key(key)

    # -- the public, Future-returning API -------------------------------------
    def read(
        self,
        key: str,
        *,
        byte_range: slice | ByteRange | None = None,
        if_not_equal: Generation | None = None,
    ) -> Future[ReadResult]:
        """Read ``key`` (optionally a byte range of it).

        ``if_not_equal=g``: when the stored generation is still ``g`` the result
        has ``state == "unchanged"`` and no value (cache revalidation).
        """
        full = self._full(key)
        rng = ByteRange.of(byte_range)
        if self.blocking_io:
            return submit_blocking(self._read_blocking, full, rng, if_not_equal)
        return spawn(self._read(full, rng, if_not_equal))

    def read_ranges(
        self,
        key: str,
        ranges: Sequence[slice | ByteRange],
        *,
        coalesce_gap: int = DEFAULT_COALESCE_GAP,
    ) -> Future[RangesResult]:
        """Read several byte ranges of one value, consistently.

        Ranges closer than ``coalesce_gap`` bytes are merged into one request;
        requests run concurrently. All ranges come from the same generation: if
        the value changes between requests, the read is retried.
        """
        full = self._full(key)
        if isinstance(ranges, (str, bytes, slice, ByteRange)) or not hasattr(ranges, "__iter__"):
            raise InvalidArgumentError(
                f"read_ranges of key {key!r}: ranges must be a sequence of slices or ByteRanges, "
                f"got {type(ranges).__name__}"
            )
        norm = [ByteRange.of(r) or ByteRange(0) for r in ranges]
        return spawn(self._read_ranges(full, norm, coalesce_gap))

    def write(self, key: str, value: Buffer, *, if_equal: Generation | None = None) -> Future[Generation]:
        """Write ``value`` at ``key``; returns the new generation.

        ``if_equal=None`` overwrites; ``Generation.NO_VALUE`` creates only;
        a generation makes it a compare-and-swap. A lost condition raises
        :class:`ConditionFailedError`. The write is atomic; durability on return
        is the backend's (documented per store).
        """
        full = self._full(key)
        self._check_writable("write", key)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(
                f"value for key {key!r} must be bytes-like, got {type(value).__name__}"
            )
        if self.blocking_io:
            return submit_blocking(self._write_blocking, full, value, if_equal)
        return spawn(self._write(full, value, if_equal), cancel_reports_outcome=self.cancel_reports_outcome)

    def delete(self, key: str, *, if_equal: Generation | None = None) -> Future[None]:
        """Delete ``key`` (a missing key is not an error unless ``if_equal`` is set)."""
        full = self._full(key)
        self._check_writable("delete", key)
        if self.blocking_io:
            return submit_blocking(self._delete_blocking, full, if_equal)
        return spawn(self._delete(full, if_equal), cancel_reports_outcome=self.cancel_reports_outcome)

    def delete_range(self, prefix: str = "") -> Future[None]:
        """Delete every key starting with ``prefix``. Not atomic as a whole."""
        validate_prefix(prefix)
        self._check_writable("delete_range", prefix)
        return spawn(self._delete_range(self.path + prefix), cancel_reports_outcome=self.cancel_reports_outcome)

    def list(self, prefix: str = "") -> Future[list[str]]:
        """Sorted keys (relative to this store's path) starting with ``prefix``."""
        validate_prefix(prefix)
        return spawn(self._list_relative(prefix))

    def list_folder(self, folder: str = "") -> Future[FolderListing]:
        """The direct children of ``folder`` (``""`` or ending in ``/``), relative to
        this store's path: the keys in it with no further ``/`` and the subfolders
        (``"<folder><name>/"``) holding at least one key, each sorted. Object stores
        ask the server with ``delimiter=/`` (one request per page of *children*, not
        of every key below), the file store reads one directory (where a folder
        emptied by deletes may still be listed); other stores list every key below
        ``folder`` and group them. Like :meth:`list`, not a snapshot."""
        validate_prefix(folder)
        if folder and not folder.endswith("/"):
            raise InvalidArgumentError(f"list_folder: {folder!r} is not a folder (end it with '/')")

        async def run() -> FolderListing:
            n = len(self.path)
            keys, folders = await self._list_folder(self.path + folder)
            return FolderListing(sorted(k[n:] for k in keys), sorted(f[n:] for f in folders))

        return spawn(run())

    def list_info(self, prefix: str = "") -> Future[builtins.list[KeyInfo]]:
        """Like :meth:`list`, with each key's size and modification time where the
        store knows them from the listing itself (None otherwise). Sorted by key."""
        validate_prefix(prefix)

        async def run() -> builtins.list[KeyInfo]:
            n = len(self.path)
            infos = await self._list_info(self.path + prefix)
            return sorted((KeyInfo(i.key[n:], i.size, i.mtime) for i in infos), key=lambda i: i.key)

        return spawn(run())

    def with_transaction(self, txn: TransactionLike) -> KvStore:
        """A view of this store whose reads and writes go through ``txn``."""
        if not isinstance(txn, TransactionLike):
            raise InvalidArgumentError(
                f"with_transaction needs a tsp.Transaction, got {type(txn).__name__}"
            )
        return txn.bind(self)

    def depend_on(self, key: str) -> None:  # noqa: B027 (nothing to do outside a transaction)
        """Say that what is being written through this store was derived from the
        value of ``key`` (an array's metadata, which encodes its chunks). Inside a
        transaction on a store with versions, the commit then fails with
        ConflictError when a version after the one the transaction read changed
        ``key``; anywhere else this does nothing."""

    def _transaction_participant(self, txn: TransactionLike) -> Any:
        """This store's part in ``txn``: stores with their own atomic multi-key
        commits (the versioned store) return a ``transaction.Participant``;
        None (the default) means the generic one-key participant."""
        return None

    # -- optional blocking-I/O hooks ------------------------------------------
    # Stores whose operations are cheap blocking calls that are safe on any pool
    # thread (the local file store) set ``blocking_io`` and implement the
    # ``*_blocking`` twins with exactly the semantics of ``_read``/``_write``/
    # ``_delete`` (full keys). The public read/write/delete then run them straight
    # on the I/O pool (``future.submit_blocking``: one thread hop), and array
    # drivers batch many chunk operations, I/O and codec work together, into
    # one pool call: on a small machine an
    # event loop -> pool -> event loop round trip costs ~100 us and, worse,
    # separates reading a chunk from decoding it (cold caches).
    #: True when the ``*_blocking`` hooks below are implemented
    blocking_io: ClassVar[bool] = False

    def _read_blocking(
        self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None
    ) -> ReadResult:
        raise UnsupportedError(f"{self.driver} store: no blocking read")

    def _write_blocking(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        raise UnsupportedError(f"{self.driver} store: no blocking write")

    def _delete_blocking(self, key: str, if_equal: Generation | None) -> None:
        raise UnsupportedError(f"{self.driver} store: no blocking delete")

    def _read_range_into_blocking(self, key: str, offset: int, dest: memoryview) -> int:
        """Read full ``key`` from byte ``offset`` into ``dest`` (a writable byte
        buffer) until it is full or the value ends, without a buffer of the
        store's; return the bytes read, or -1 when the key is missing. For
        immutable values (no generation is taken)."""
        raise UnsupportedError(f"{self.driver} store: no blocking read into a buffer")

    def _write_many_blocking(self, items: builtins.list[tuple[str, Buffer]]) -> None:
        """Unconditional writes of several values (full keys), each with the
        semantics of ``_write_blocking(key, value, None)``; a store may share
        work between them (the file store: one lock and one directory fsync per
        folder). On an error, the values before it may have been written."""
        for key, value in items:
            self._write_blocking(key, value, None)

    async def _prepare_read(self, key: str) -> BlockingRead | None:
        """Resolve everything a whole-value read of full ``key`` needs on the
        event loop, and return a blocking callable doing the rest (data I/O,
        checksums) on a pool thread, returning what ``_read(key, None, None)``
        would; or None when the store has no such split (the default: then use
        ``_read``). The callable must be safe to run on any thread, once, soon.

        Adapters whose data lives in a ``blocking_io`` store (the versioned
        store) implement it so that drivers read and decode a chunk in one
        pool call.
        """
        return None

    # -- backend hooks ------------------------------------------------------
    @abstractmethod
    async def _read(
        self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None
    ) -> ReadResult: ...

    @abstractmethod
    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation: ...

    @abstractmethod
    async def _delete(self, key: str, if_equal: Generation | None) -> None: ...

    @abstractmethod
    async def _list(self, prefix: str) -> builtins.list[str]:
        """Full keys starting with the full ``prefix``, in any order."""

    async def _list_info(self, prefix: str) -> builtins.list[KeyInfo]:
        """Full keys starting with the full ``prefix`` with size and mtime; stores
        that know them override this (the default knows neither)."""
        return [KeyInfo(k) for k in await self._list(prefix)]

    async def _list_folder(self, folder: str) -> tuple[builtins.list[str], builtins.list[str]]:
        """Full keys directly in the full ``folder`` and its full subfolder names
        (ending in ``/``), in any order. The default lists every key below and
        groups them; stores with a delimiter listing override it."""
        return split_folder(folder, await self._list(folder))

    async def _delete_range(self, prefix: str) -> None:
        keys = await self._list(prefix)
        await asyncio.gather(*(self._delete(k, None) for k in keys))

    async def _list_relative(self, prefix: str) -> builtins.list[str]:
        n = len(self.path)
        return sorted(k[n:] for k in await self._list(self.path + prefix))

    async def _read_ranges(
        self, key: str, ranges: builtins.list[ByteRange], gap: int
    ) -> RangesResult:
        groups = coalesce(ranges, gap)
        for _attempt in range(_MAX_RANGES_ATTEMPTS):
            results = await asyncio.gather(
                *(self._read(key, g_range, None) for g_range, _members in groups)
            )
            gens = {r.generation for r in results}
            if any(r.state == "missing" for r in results):
                if all(r.state == "missing" for r in results):
                    return RangesResult("missing", [], Generation.NO_VALUE)
                continue  # deleted in between: try again
            if len(gens) != 1:
                continue  # changed in between: try again
            values: builtins.list[Buffer] = [b""] * len(ranges)
            for (g_range, members), res in zip(groups, results):
                buf = res.value if isinstance(res.value, memoryview) else memoryview(res.value)
                for idx in members:
                    r = ranges[idx]
                    if r.start < 0 or r.stop is None:
                        values[idx] = buf  # an unbounded range is its own request
                    else:
                        values[idx] = buf[r.start - g_range.start: r.stop - g_range.start]
            return RangesResult("value", values, results[0].generation)
        raise ConditionFailedError(
            f"{self.driver} store: key {key!r} kept changing during a multi-range read "
            f"({_MAX_RANGES_ATTEMPTS} attempts)"
        )

    def _check_writable(self, op: str, key: str) -> None:
        if self.read_only:
            raise ReadOnlyError(f"{op} of {key!r}: {self!r} is read-only")


def reopen(spec: dict[str, Any]) -> KvStore:
    """The store of ``spec``, opened in this process (what unpickling a store calls).

    Drivers whose ``from_spec`` does I/O are opened with a blocking wait, so do not
    unpickle such a store on the library's event loop thread.
    """
    store = driver_class(spec["driver"]).from_spec(dict(spec))
    if inspect.isawaitable(store):
        store = run_sync(store)
    return cast(KvStore, store)


def rebuild(cls: type[KvStore], args: tuple[Any, ...], kwargs: dict[str, Any]) -> KvStore:
    """``cls(*args, **kwargs)``: how adapters unpickle (their base stores travel as
    objects and reopen themselves; see :meth:`KvStore.__reduce__`)."""
    return cls(*args, **kwargs)


def not_picklable(store: KvStore, why: str) -> UnsupportedError:
    """The error a store raises when it is pickled but can not be reopened elsewhere."""
    return UnsupportedError(f"can not pickle {store!r}: {why}")


def condition_failed(store: KvStore, key: str, expected: Generation | None, found: Generation) -> ConditionFailedError:
    """The standard message for a lost condition."""
    if expected is not None and expected.is_no_value:
        what = "create-only write: the key already exists"
    elif found.is_no_value:
        what = f"compare-and-swap expected generation {expected!r} but the key is absent"
    else:
        what = f"compare-and-swap expected generation {expected!r}, found {found!r}"
    return ConditionFailedError(f"{store.driver} store {store.spec().get('path', '')!r}: key {key!r}: {what}")
