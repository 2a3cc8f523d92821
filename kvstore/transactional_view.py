"""A store seen through a transaction: :class:`TransactionalKvStore`.

What ``store.with_transaction(txn)`` returns. Its reads and writes go to the
store root's :class:`~tensorstore_py.kvstore.participant.Participant` in the
transaction; it calls back into the transaction only through
:class:`BoundTransaction` (to find its participant, to claim the one root the
transaction writes, and to count writes issued but not yet staged), so it
never imports the Transaction class that creates it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from tensorstore_py.core.errors import InvalidArgumentError
from tensorstore_py.core.future import Future
from tensorstore_py.kvstore.base import (
    BlockingRead,
    Buffer,
    ByteRange,
    Generation,
    KvStore,
    ReadResult,
    TransactionLike,
    not_picklable,
)
from tensorstore_py.kvstore.participant import Participant

_T = TypeVar("_T")

__all__ = ["BoundTransaction", "TransactionalKvStore"]


@runtime_checkable
class BoundTransaction(TransactionLike, Protocol):
    """What a :class:`TransactionalKvStore` calls on its transaction, besides
    ``bind`` (``tensorstore_py.Transaction`` is the implementation)."""

    def _participant_for(self, store: KvStore) -> Participant:
        """``store``'s root's participant in this transaction (made at first use)."""

    def _check_open(self, what: str) -> None:
        """InvalidArgumentError naming ``what`` unless the transaction is open."""

    def _claim_writer(self, p: Participant, key: str) -> None:
        """Before staging a write into ``p``'s root: the one root it writes."""

    def _issue(self, what: str) -> None:
        """A write was issued (the commit waits for it); refused unless open."""

    def _unissue(self) -> None:
        """An issued write was staged (or failed)."""


class TransactionalKvStore(KvStore):
    """A view of ``store`` whose reads and writes go through a transaction.

    Reads see the transaction's own writes and deletes (``list`` too); writes
    are staged and become visible only when the transaction commits.
    """

    def __init__(self, store: KvStore, txn: BoundTransaction) -> None:
        if not isinstance(txn, BoundTransaction):
            raise InvalidArgumentError(f"with_transaction needs a tsp.Transaction, got {type(txn).__name__}")
        super().__init__(path=store.path)
        self.base = store
        self.txn = txn
        self.driver = store.driver  # type: ignore[misc]
        self.read_only = store.read_only
        self._participant = txn._participant_for(store)

    def spec(self) -> dict[str, Any]:
        d = self.base.spec()
        d["path"] = self.path
        return d

    def _spec_fields(self) -> dict[str, Any]:
        return {}

    def _full(self, key: str) -> str:
        return self.path + _validated(self.base, key)

    def __repr__(self) -> str:
        return f"TransactionalKvStore({self.spec()!r}, {self.txn!r})"

    def _identity(self) -> Any:
        return (self.base._identity(), self.path, id(self.txn))

    def __reduce__(self) -> tuple[Any, ...]:
        # the staged writes live in this process's memory: they can not travel
        raise not_picklable(
            self, "it is bound to a transaction whose staged writes live in this process; pickle "
            "the store itself and bind a transaction in the receiving process (tensorstore_py.dask."
            "store and kvstore.versioned.staging carry writes of many processes into one commit)"
        )

    def with_transaction(self, txn: TransactionLike) -> KvStore:
        if txn is self.txn:
            return self
        raise InvalidArgumentError(f"{self!r} is already bound to a transaction")

    async def _read(self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None) -> ReadResult:
        return await self._participant.read(key, byte_range, if_not_equal)

    async def _prepare_read(self, key: str) -> BlockingRead | None:
        prepare = getattr(self._participant, "prepare_read", None)
        return None if prepare is None else await prepare(key)

    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        self.txn._claim_writer(self._participant, self._rel(key))
        gen = await self._participant.write(key, value, if_equal)
        assert gen is not None
        return gen

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        self.txn._claim_writer(self._participant, self._rel(key))
        await self._participant.write(key, None, if_equal)

    async def _list(self, prefix: str) -> list[str]:
        return await self._participant.list(prefix)

    async def _delete_range(self, prefix: str) -> None:
        self.txn._claim_writer(self._participant, self._rel(prefix))
        await self._participant.delete_range(prefix)

    def depend_on(self, key: str) -> None:
        self._participant.depend(self._full(key))

    def _rel(self, key: str) -> str:
        return key.removeprefix(self.path)

    def _check_writable(self, op: str, key: str) -> None:
        super()._check_writable(op, key)
        self.txn._check_open(f"{op} of {key!r}")

    def _issued(self, what: str, start: Callable[[], Future[_T]]) -> Future[_T]:
        self.txn._issue(what)
        try:
            fut = start()
        except BaseException:
            self.txn._unissue()
            raise
        fut.add_done_callback(lambda _f: self.txn._unissue())
        return fut

    def write(self, key: str, value: Buffer, *, if_equal: Generation | None = None) -> Future[Generation]:
        return self._issued(f"write of {key!r}", lambda: super(TransactionalKvStore, self).write(key, value, if_equal=if_equal))

    def delete(self, key: str, *, if_equal: Generation | None = None) -> Future[None]:
        return self._issued(f"delete of {key!r}", lambda: super(TransactionalKvStore, self).delete(key, if_equal=if_equal))

    def delete_range(self, prefix: str = "") -> Future[None]:
        return self._issued(f"delete_range of {prefix!r}", lambda: super(TransactionalKvStore, self).delete_range(prefix))


def _validated(store: KvStore, key: str) -> str:
    """Validate ``key`` the way ``store`` does (e.g. reserved names) and return it."""
    store._full(key)
    return key
