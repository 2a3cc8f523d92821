"""What a store contributes to a transaction, and what it may ask of it.

A :class:`Participant` is one store root's part of a transaction: it stages the
reads and writes made through that root and commits them. It sees its
transaction only through :class:`TransactionHandle` (identity, options and
state), so that participants (here, in :mod:`.single_key_participant` and in
``versioned/``) never import the :class:`~tensorstore_py.kvstore.transaction.Transaction`
class that drives them. Also here: what a commit returns (:class:`CommitInfo`),
the multi-writer :class:`Barrier` protocol, the isolation levels, and
:func:`note_may_land` (a participant tells the running commit that its outcome
is no longer "failed" if it is interrupted). ``tensorstore_py.kvstore.transaction``
re-exports every public name.
"""

from __future__ import annotations

import contextvars
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tensorstore_py.kvstore.base import Buffer, ByteRange, Generation, ReadResult

__all__ = [
    "ISOLATION_LEVELS", "Barrier", "CommitInfo", "Isolation", "Participant", "TransactionHandle", "TxnState",
    "note_may_land", "watch_may_land",
]

TxnState = Literal["open", "committing", "committed", "aborted", "failed", "unknown"]
Isolation = Literal["snapshot", "serializable"]
ISOLATION_LEVELS: tuple[Isolation, ...] = ("snapshot", "serializable")

#: set by a commit while it runs: a one-element list that becomes [True] once
#: something that can make the commit visible was sent (see note_may_land)
_MAY_LAND: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("tsp_may_land", default=None)


def watch_may_land() -> list[bool]:
    """Called by a commit as it starts, in its own task: returns a one-element
    flag that :func:`note_may_land` sets (from this task's context and the tasks
    it starts)."""
    flag = [False]
    _MAY_LAND.set(flag)
    return flag


def note_may_land() -> None:
    """Called by a participant right before it sends what can make the running
    commit visible (a commit record, a multi-writer fragment): from then on an
    interrupted commit has an unknown outcome, not a failed one."""
    flag = _MAY_LAND.get()
    if flag is not None:
        flag[0] = True


@dataclass(frozen=True)
class CommitInfo:
    """The outcome of a commit.

    ``version`` is the new version on a versioned store (the version read from
    for a transaction that wrote nothing; None on other stores, or for a
    multi-writer participant that did not wait for the result).
    """

    version: int | None
    write_id: str = ""
    time: float = 0.0
    txn_id: str | None = None
    keys_changed: int = 0


class Barrier(Protocol):
    """The barrier / broadcast service a multi-writer commit waits on.

    Both methods block and are called from worker threads. Keys used (each
    published once per transaction id, so a barrier must be fresh per job, as
    jax.distributed's is): ``tsp/<txn_id>/attempt`` (published by process 0
    when it opens its attempt; JSON text), ``tsp/<txn_id>/fragment/<i>``
    (published by participant ``i > 0`` once its fragment is durable) and
    ``tsp/<txn_id>/result`` (published by process 0; the result as JSON text).
    ``wait_for`` returns the value published for ``key``, waiting up to
    ``timeout`` seconds, and raises (any exception, e.g. TimeoutError) when it
    does not arrive in time.
    """

    def publish(self, key: str, value: str) -> None: ...

    def wait_for(self, key: str, timeout: float) -> str: ...


class TransactionHandle(Protocol):
    """What a participant reads of the transaction it belongs to (all read-only;
    ``tensorstore_py.Transaction`` is the implementation)."""

    @property
    def txn_id(self) -> str | None:
        """The id shared by the processes of a multi-writer transaction (None: none given)."""

    @property
    def write_id(self) -> str:
        """Unique per transaction object: stored in its commit record."""

    @property
    def process_index(self) -> int: ...

    @property
    def process_count(self) -> int: ...

    @property
    def multi_writer(self) -> bool:
        """True when ``process_count > 1``."""

    @property
    def timeout(self) -> float:
        """Seconds a multi-writer commit waits for the other processes."""

    @property
    def coordinator(self) -> Barrier | None: ...

    @property
    def message(self) -> str: ...

    @property
    def metadata(self) -> dict[str, Any]: ...

    @property
    def isolation(self) -> Isolation: ...

    @property
    def state(self) -> TxnState:
        """``"open"`` and ``"committing"`` while its staged state may still be committed."""


class Participant(ABC):
    """One store root's part of a transaction (stores with atomic commits
    provide their own via ``KvStore._transaction_participant``)."""

    #: identity of the atomic root (one participant per root per transaction)
    key: Hashable
    #: human name of the root for error messages
    name: str

    @property
    @abstractmethod
    def has_writes(self) -> bool: ...

    @abstractmethod
    async def read(self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None) -> ReadResult: ...

    @abstractmethod
    async def write(self, key: str, value: Buffer | None, if_equal: Generation | None) -> Generation | None:
        """Stage a write (``value=None`` deletes)."""

    @abstractmethod
    async def list(self, prefix: str) -> list[str]: ...

    async def delete_range(self, prefix: str) -> None:
        for k in await self.list(prefix):
            await self.write(k, None, None)

    @abstractmethod
    async def commit(self, txn: TransactionHandle, *, wait: bool) -> CommitInfo: ...

    def depend(self, key: str) -> None:  # noqa: B027 (an optional hook)
        """The staged writes were derived from the value of ``key``: a root with
        versions checks at commit that no version after the one read changed it.
        Default: nothing (the one-key participant writes under a condition)."""

    def abort(self) -> None:  # noqa: B027 (an optional hook: nothing to drop by default)
        """Drop staged state (written data objects become garbage)."""
