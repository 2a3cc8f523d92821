"""A zarr-python 3 ``Store`` over any tensorstore_py kvstore.

::

    import zarr, xarray, tensorstore_py as tsp

    z = zarr.open_array(store=tsp.zarr_store("versioned+file:///run/@12"), path="000000000100/a/0")
    ds = xarray.open_zarr(tsp.zarr_store("versioned+gs://bucket/run/@12", path="dataset"))

    zs = tsp.zarr_store("versioned+file:///run/")      # writable: through a transaction
    zarr.create_array(store=zs, name="x", shape=(100,), dtype="f4")[:] = 1.0
    zs.commit().result()                                 # ONE new version

Needs the ``zarr`` extra (``pip install "tensorstore_py[zarr]"``). Keys are the
kvstore's keys (below ``path``); zarr's ``ByteRequest`` ranges map onto
tensorstore_py byte ranges (one ranged read each).

How it reads and writes, by store:

* **a pinned version** of a versioned store (``versioned+file:///run/@12``, a
  tag, or ``kv.snapshot(12)``), an ``http(s)://`` store or any read-only store:
  read-only, every read from that one snapshot;
* **a live versioned store**: writes go into a :class:`~tensorstore_py.Transaction`
  (one the store makes, or ``transaction=`` yours) and become visible together,
  in ONE version, when :meth:`TspZarrStore.commit` is called, or when a ``with``
  block around the store ends without an exception (an exception aborts: nothing
  is written). Reads see the version the transaction started from plus its own
  writes. After a commit the next write starts a new transaction;
* **any other store**: each ``set`` replaces one key atomically and is durable
  when it returns (the store's own guarantee); ``commit()`` has nothing to do.

``set_if_not_exists`` is a real create-only write (never "exists, then set").
The store pickles as its kvstore and mode; a store holding a transaction does
not travel (UnsupportedError).
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import AsyncIterator, Iterable
from types import TracebackType
from typing import Any

from tensorstore_py.core.errors import ConditionFailedError, InvalidArgumentError, UnsupportedError
from tensorstore_py.core.future import Future, ready, run_sync
from tensorstore_py.kvstore.base import ByteRange, Generation, KvStore
from tensorstore_py.kvstore.registry import open_kvstore
from tensorstore_py.kvstore.transaction import CommitInfo, Transaction
from tensorstore_py.kvstore.versioned import VersionedKvStore

try:
    from zarr.abc.store import (
        ByteRequest,
        OffsetByteRequest,
        RangeByteRequest,
        Store,
        SuffixByteRequest,
    )
    from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
except ImportError as e:  # the optional extra
    raise ImportError(
        f'tensorstore_py.zarr_store needs zarr-python 3 ({e.name} is missing): '
        'pip install "tensorstore_py[zarr]"'
    ) from e

__all__ = ["TspZarrStore", "zarr_store"]


def zarr_store(
    url_or_store: str | dict[str, Any] | KvStore,
    *,
    path: str = "",
    read_only: bool | None = None,
    transaction: Transaction | None = None,
) -> TspZarrStore:
    """A zarr-python Store over the kvstore at ``url_or_store`` (URL, spec or store).

    ``path``: a folder below it that becomes the zarr store's root.
    ``read_only``: default True for stores that can not be written (pinned
    versions, HTTP), else False. ``transaction``: write through this
    transaction (a live versioned store makes its own otherwise).
    """
    kv = url_or_store if isinstance(url_or_store, KvStore) else run_sync(open_kvstore(url_or_store))
    if path.strip("/"):
        kv = kv.with_path(path)
    return TspZarrStore(kv, read_only=kv.read_only if read_only is None else read_only,
                        transaction=transaction)


def _byte_range(byte_range: ByteRequest | None) -> ByteRange | None:
    if byte_range is None:
        return None
    if isinstance(byte_range, RangeByteRequest):
        return ByteRange(byte_range.start, byte_range.end)
    if isinstance(byte_range, OffsetByteRequest):
        return ByteRange(byte_range.offset)
    if isinstance(byte_range, SuffixByteRequest):
        return ByteRange(-byte_range.suffix)
    raise ValueError(f"Unexpected byte_range, got {byte_range!r}.")


def _reopen(kvstore: KvStore, read_only: bool) -> TspZarrStore:
    """What unpickling a TspZarrStore calls (the kvstore reopened itself)."""
    return TspZarrStore(kvstore, read_only=read_only)


class TspZarrStore(Store):
    """zarr-python's ``Store`` over a tensorstore_py :class:`KvStore` (see the module doc)."""

    supports_writes: bool = True
    supports_deletes: bool = True
    supports_listing: bool = True

    def __init__(self, kvstore: KvStore, *, read_only: bool = False,
                 transaction: Transaction | None = None) -> None:
        if not isinstance(kvstore, KvStore):
            raise InvalidArgumentError(f"TspZarrStore needs a tensorstore_py KvStore, got {kvstore!r}")
        if not read_only and kvstore.read_only:
            raise InvalidArgumentError(f"TspZarrStore: {kvstore!r} is read-only; open it with read_only=True")
        super().__init__(read_only=read_only)
        self.kvstore = kvstore
        self._given_txn = transaction
        self._txn: Transaction | None = transaction
        # writes through transactions: a live versioned store, or a transaction given
        self._transactional = not read_only and (
            transaction is not None or isinstance(kvstore, VersionedKvStore))

    # -- identity ----------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TspZarrStore) and self.kvstore == other.kvstore
                and self.read_only == other.read_only and self._given_txn is other._given_txn)

    def __repr__(self) -> str:
        return f"TspZarrStore({self.kvstore.spec()!r}, read_only={self.read_only})"

    def __reduce__(self) -> tuple[Any, ...]:
        if self._given_txn is not None or (self._txn is not None and self._txn.state == "open"):
            raise UnsupportedError(
                f"can not pickle {self!r}: it writes through a transaction of this process "
                f"(commit() first, or pickle a store without one)")
        return (_reopen, (self.kvstore, self.read_only))

    def with_read_only(self, read_only: bool = False) -> TspZarrStore:
        return TspZarrStore(self.kvstore, read_only=read_only,
                            transaction=None if read_only else self._given_txn)

    # -- transactions --------------------------------------------------------------------
    @property
    def transaction(self) -> Transaction | None:
        """The transaction writes go into now (None before the first write, or
        when the store writes directly)."""
        return self._txn

    def _view(self, *, write: bool) -> KvStore:
        if not self._transactional:
            return self.kvstore
        if self._txn is None or (self._given_txn is None and self._txn.state != "open"):
            if not write:
                return self.kvstore
            self._txn = Transaction(message="zarr store")
        return self.kvstore.with_transaction(self._txn)

    def commit(self) -> Future[CommitInfo]:
        """Commit the writes made so far as ONE version (see the module doc).

        Resolves to the CommitInfo; on a store without a transaction, or with
        no writes since the last commit, to ``CommitInfo(version=None)``.
        """
        txn = self._txn
        if txn is None or txn.state != "open":
            return ready(CommitInfo(version=None))
        return txn.commit()

    def __exit__(self, exc_type: type[BaseException] | None, exc_value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        txn = self._txn
        if self._given_txn is None and txn is not None and txn.state == "open":
            if exc_type is None:
                txn.commit().result()
            else:
                txn.abort()
        super().__exit__(exc_type, exc_value, traceback)

    # -- reads ---------------------------------------------------------------------------
    async def get(self, key: str, prototype: BufferPrototype | None = None,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        if prototype is None:
            prototype = default_buffer_prototype()
        rng = _byte_range(byte_range)
        if isinstance(byte_range, SuffixByteRequest) and byte_range.suffix == 0:
            res = await self._view(write=False).read(key)
            return None if res.state != "value" else prototype.buffer.from_bytes(b"")
        res = await self._view(write=False).read(key, byte_range=rng)
        if res.state != "value":
            return None
        return prototype.buffer.from_bytes(res.value)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        return (await self._view(write=False).read(key, byte_range=ByteRange(0, 0))).state == "value"

    async def getsize(self, key: str) -> int:
        infos = [i for i in await self._view(write=False).list_info(key) if i.key == key]
        if infos and infos[0].size is not None:
            return infos[0].size
        return await super().getsize(key)

    # -- writes --------------------------------------------------------------------------
    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()
        if not isinstance(value, Buffer):
            raise TypeError(f"TspZarrStore.set(): value must be a zarr Buffer, got {type(value).__name__}")
        await self._view(write=True).write(key, memoryview(value.as_buffer_like()))

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        self._check_writable()
        try:
            await self._view(write=True).write(key, memoryview(value.as_buffer_like()),
                                              if_equal=Generation.NO_VALUE)
        except ConditionFailedError:
            pass  # it exists: leave it

    async def delete(self, key: str) -> None:
        self._check_writable()
        await self._view(write=True).delete(key)

    async def delete_dir(self, prefix: str) -> None:
        self._check_writable()
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        await self._view(write=True).delete_range(prefix)

    # -- listing -------------------------------------------------------------------------
    async def _keys(self, prefix: str) -> list[str]:
        return await self._view(write=False).list(prefix)

    async def list(self) -> AsyncIterator[str]:
        for k in await self._keys(""):
            yield k

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for k in await self._keys(prefix):
            yield k

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        prefix = prefix.rstrip("/")
        base = prefix + "/" if prefix else ""
        seen: set[str] = set()
        for k in await self._keys(base):
            head = k[len(base):].split("/", 1)[0]
            if head and head not in seen:
                seen.add(head)
                yield head


class _CallableModule(types.ModuleType):
    """Importing this module makes it the package attribute ``tensorstore_py.zarr_store``
    (the import system sets it), where users call the function of that name: so
    calling the module calls the function."""

    def __call__(self, *args: Any, **kwargs: Any) -> TspZarrStore:
        return zarr_store(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
