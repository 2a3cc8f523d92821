"""Transactions: atomic, isolated groups of reads and writes across keys.

::

    with tsp.Transaction(message="step 100") as txn:     # commits on clean exit
        kv.with_transaction(txn).write("a", b"1").result()
        kv.with_transaction(txn).write("b", b"2").result()
    # an exception inside the block aborts: nothing is written

    txn = tsp.Transaction()
    ...
    info = txn.commit().result()      # CommitInfo; info.version on a versioned store

Guarantees on the versioned store (``{"driver": "versioned", ...}``):

* **Atomic**: all writes of a transaction become visible at once, in one new
  version, or none do (the commit point is one create-only write).
* **Isolated**: reads see the version the transaction started from (pinned at
  its first read or write) plus its own writes and deletes. The default,
  ``isolation="snapshot"``, is snapshot isolation: only keys the transaction
  also *writes* are checked at commit, so two transactions that each read what
  the other writes may both commit (write skew, below).
  ``isolation="serializable"`` also records every key read (including reads
  that found nothing) and every prefix listed, and at commit checks them against
  the keys changed by versions committed after the one it read: a read-write
  conflict raises ConflictError naming the key. Serializable transactions
  behave as if they ran one at a time, in commit order.
* **Conflicts**: at commit, if newer versions changed a key this transaction
  also writes (or, serializable, read; or, whatever the isolation, the
  metadata of an array whose chunks it writes through a view), the commit raises
  :class:`~tensorstore_py.errors.ConflictError` naming the key and leaves
  nothing visible; otherwise it is rebased onto the newest version
  automatically. Retrying the whole transaction is safe.
* **Durable**: when ``commit()`` resolves, every byte is on the base store (and
  fsync'ed on the file store).

Write skew, the classic example: two doctors are on call and at least one must
stay. Each, in its own transaction, checks that the other is on call and signs
off::

    def sign_off(me, other, isolation):
        with tsp.Transaction(isolation=isolation) as txn:
            v = kv.with_transaction(txn)
            if v.read(other).result().value == b"on":
                v.write(me, b"off").result()

Run concurrently (both read before either commits), under ``"snapshot"`` both
commit (they write different keys) and nobody is on call; under
``"serializable"`` the second commit raises ConflictError (the key it read was
changed by the first), and its retry sees the other doctor already off.

On any other store a transaction is honoured only when it can be: it may write
ONE key (committed as a conditional write: a compare-and-swap against the
generation it read, or the ``if_equal`` it was given), which serialises a
read-modify-write of that key under either isolation mode. Reads go straight to
the store (there are no snapshots); with ``isolation="serializable"``, a
transaction that writes its key after reading *other* keys raises
:class:`~tensorstore_py.errors.UnsupportedError` at commit, because those reads
can not be checked atomically with the write. The first write of a
second key raises :class:`~tensorstore_py.errors.UnsupportedError`. One
transaction writes into one store root; the first write into a second root
raises ``UnsupportedError`` too.

Multi-writer (multi-controller) commits: ``Transaction(txn_id="step-100",
process_index=i, process_count=N, timeout=600, coordinator=None)`` in each of N
processes. Each process writes its own keys; ``commit()`` writes its part (a
fragment); process 0 waits for all N fragments, merges them into ONE version
and publishes the result, which every process's ``commit()`` returns. If a
process never delivers its fragment, nothing is committed and the others raise
:class:`~tensorstore_py.errors.DeadlineExceededError` after ``timeout`` seconds.

* **Attempts**: every run of process 0 opens a new *attempt* of the
  transaction (a fresh random nonce, published through the coordinator and the
  store) and merges only fragments written for that attempt. A participant
  writes its fragment for the newest attempt it sees and, while it waits,
  rewrites it for a newer attempt (it still has its data), unless its own
  attempt failed (then it raises that failure, as does a participant arriving
  late after the attempt it could belong to failed). So a job restarted with the
  same ``txn_id`` after process 0 died never merges a fragment left by the dead
  run, nor one a slow participant of a failed run delivers later: the commit
  holds exactly the restarted processes' data, or nothing
  (DeadlineExceededError) when a participant is missing.
* **The txn_id is an idempotency key**: a transaction id commits at most once.
  A process that calls ``commit()`` again with the same ``txn_id`` after the
  transaction committed (e.g. the job restarted after process 0 committed but
  before everyone heard) gets that commit's :class:`CommitInfo` back, and
  nothing is committed again, provided its writes are the ones committed (same
  keys, deleted or holding values of the same length and crc32c); other
  writes raise InvalidArgumentError ("transaction ids must not be reused").
  A process that asks after the commit, even if process 0 died before
  announcing it, finds the commit record (it carries the ``txn_id``).
* ``isolation="serializable"`` works per participant: each one's read set
  travels in its fragment and process 0 checks all of them (from the oldest
  version any participant read) before committing.

``coordinator`` is an optional :class:`Barrier`: an object with
``publish(key, value)`` and ``wait_for(key, timeout) -> value`` (str keys and
values); without it the processes poll the store. A checkpoint
``tensorstore_py.checkpoint.Coordinator`` is a Barrier that also knows the
process index and count, so it can be passed as is. An adapter over
jax.distributed's key-value store is three lines::

    class JaxBarrier:
        def __init__(self, client): self.client = client   # jax's distributed client
        def publish(self, key, value): self.client.key_value_set(key, value)
        def wait_for(self, key, timeout):
            return self.client.blocking_key_value_get(key, int(timeout * 1000))

See docs/FORMAT.md §7 for the objects written and docs/TRANSACTIONS.md for a
tour of the guarantees.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Hashable
from types import TracebackType
from typing import Any, Self

from tensorstore_py.core.errors import (
    CommitOutcomeUnknownError,
    InvalidArgumentError,
    UnsupportedError,
)
from tensorstore_py.core.future import Future, get_loop, spawn
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.ids import check_id
from tensorstore_py.kvstore.participant import (
    ISOLATION_LEVELS,
    Barrier,
    CommitInfo,
    Isolation,
    Participant,
    TxnState,
    note_may_land,
    watch_may_land,
)
from tensorstore_py.kvstore.single_key_participant import SingleKeyParticipant
from tensorstore_py.kvstore.transactional_view import TransactionalKvStore

# The participant side (participant.py: Participant, CommitInfo, Barrier,
# TransactionHandle; single_key_participant.py; transactional_view.py) is
# re-exported: tensorstore_py.kvstore.transaction.X stays the public path.
__all__ = [
    "Barrier", "CommitInfo", "Participant", "Transaction", "TransactionalKvStore", "note_may_land",
]


class Transaction:
    """A group of reads and writes committed atomically (see the module doc).

    Options (keyword-only): ``message`` and ``metadata`` (JSON-able) are stored
    in the commit record; ``isolation`` is ``"snapshot"`` (the default) or
    ``"serializable"``; ``txn_id``, ``process_index``, ``process_count``,
    ``timeout`` (seconds) and ``coordinator`` configure multi-writer commits.
    """

    def __init__(
        self,
        *,
        txn_id: str | None = None,
        process_index: int = 0,
        process_count: int = 1,
        timeout: float = 600.0,
        coordinator: Barrier | None = None,
        message: str = "",
        metadata: dict[str, Any] | None = None,
        isolation: Isolation = "snapshot",
    ) -> None:
        if not isinstance(process_count, int) or process_count < 1:
            raise InvalidArgumentError(f"Transaction: process_count must be an int >= 1, got {process_count!r}")
        if not isinstance(process_index, int) or not 0 <= process_index < process_count:
            raise InvalidArgumentError(
                f"Transaction: process_index must be in [0, {process_count}), got {process_index!r}"
            )
        if process_count > 1 and txn_id is None:
            raise InvalidArgumentError(
                "Transaction: a multi-writer transaction (process_count > 1) needs a txn_id "
                "shared by all processes, e.g. txn_id='step-100'"
            )
        if txn_id is not None:
            check_id("Transaction: txn_id", txn_id)
        if not timeout > 0:
            raise InvalidArgumentError(f"Transaction: timeout must be > 0 seconds, got {timeout!r}")
        if isolation not in ISOLATION_LEVELS:
            raise InvalidArgumentError(
                f"Transaction: isolation must be one of {list(ISOLATION_LEVELS)}, got {isolation!r}"
            )
        self.isolation: Isolation = isolation
        self.txn_id = txn_id
        self.process_index = process_index
        self.process_count = process_count
        self.timeout = float(timeout)
        self.coordinator = coordinator
        self.message = str(message)
        self.metadata = dict(metadata or {})
        self.write_id = uuid.uuid4().hex
        self.state: TxnState = "open"
        self._participants: dict[Hashable, Participant] = {}
        self._writer: Participant | None = None
        self._commit_future: Future[CommitInfo] | None = None
        self._issued = 0
        self._issued_lock = threading.Lock()
        self._issued_waiter: asyncio.Event | None = None

    def __repr__(self) -> str:
        extra = f", txn_id={self.txn_id!r}, process {self.process_index}/{self.process_count}" if self.txn_id else ""
        return f"Transaction(state={self.state!r}{extra})"

    @property
    def multi_writer(self) -> bool:
        return self.process_count > 1

    def bind(self, store: KvStore) -> TransactionalKvStore:
        """``store`` seen through this transaction (what ``store.with_transaction(self)`` returns)."""
        return TransactionalKvStore(store, self)

    # -- participants ----------------------------------------------------------------
    def _participant_for(self, store: KvStore) -> Participant:
        p: Participant | None = store._transaction_participant(self)
        if p is None:
            p = SingleKeyParticipant(store)
        existing = self._participants.get(p.key)
        if existing is not None:
            return existing
        self._participants[p.key] = p
        return p

    def _check_open(self, what: str) -> None:
        if self.state != "open":
            raise InvalidArgumentError(f"{what}: {self!r} is no longer open")

    def _claim_writer(self, p: Participant, key: str) -> None:
        """Called (on the loop) before staging a write issued while open."""
        if self.state not in ("open", "committing"):
            raise InvalidArgumentError(f"write of {key!r}: {self!r} is no longer open")
        if self._writer is None:
            if self.multi_writer and isinstance(p, SingleKeyParticipant):
                raise UnsupportedError(
                    f"write of {key!r}: multi-writer transactions need a versioned store; "
                    f"{p.name} can not merge fragments"
                )
            self._writer = p
        elif self._writer is not p:
            raise UnsupportedError(
                f"write of {key!r} into {p.name}: this transaction already writes into "
                f"{self._writer.name}; one transaction commits atomically into one store root"
            )

    # -- commit / abort ---------------------------------------------------------------
    def commit(self, *, wait: bool = True) -> Future[CommitInfo]:
        """Commit atomically; the Future resolves to a :class:`CommitInfo`.

        Raises (through the Future) ConflictError when newer versions changed a
        written key (or, serializable, a key or prefix read),
        DeadlineExceededError when a multi-writer barrier times out. On those
        errors nothing is visible and the transaction is "failed".
        ``wait=False`` (multi-writer, process_index > 0): resolve as soon as
        this process's fragment is durable for process 0's current attempt,
        without waiting for the merge (such a process can not follow a newer
        attempt of a restarted process 0).

        Writes issued before ``commit()`` (even if not yet awaited) are part of
        the transaction. A commit-record write that fails or times out is
        resolved by reading the record back (its write-id tells whether it
        landed) and retried. Only when the store stays unreachable through
        every retry and a last look-up does ``commit`` raise
        :class:`~tensorstore_py.errors.CommitOutcomeUnknownError`: the commit
        may or may not have landed. Do NOT treat it as a failure and simply
        retry (that could apply the transaction twice); once the store answers
        again, ask ``kv.find_write_id(err)`` (``err.write_id`` is
        :attr:`write_id`): a version number means it committed as that
        version, None means it did not and never will (the transaction may be
        redone); while it still could land, the outcome is unknown again. A
        multi-writer transaction may instead simply be run again with the same
        ``txn_id``: it commits at most once (see the module doc).
        """
        with self._issued_lock:  # no write can be issued after this point
            if self._commit_future is not None:
                return self._commit_future
            self._check_open("commit")
            self.state = "committing"
            self._commit_future = spawn(self._commit(wait), cancel_reports_outcome=True)
        return self._commit_future

    # -- writes issued but not yet staged ------------------------------------------------
    # commit() may be called right after write() returned its Future, before the
    # write's coroutine ran: such writes were issued while the transaction was
    # open, so the commit waits for them instead of losing them.
    def _issue(self, what: str) -> None:
        with self._issued_lock:
            self._check_open(what)
            self._issued += 1

    def _unissue(self) -> None:
        with self._issued_lock:
            self._issued -= 1
            waiter = self._issued_waiter if self._issued == 0 else None
        if waiter is not None:
            get_loop().call_soon_threadsafe(waiter.set)

    async def _wait_issued(self) -> None:
        with self._issued_lock:
            if self._issued == 0:
                return
            self._issued_waiter = asyncio.Event()
        await self._issued_waiter.wait()

    async def _commit(self, wait: bool) -> CommitInfo:
        may_land = watch_may_land()  # this task's context (and the tasks it starts)
        try:
            await self._wait_issued()
            if self._writer is None:
                info = await self._commit_without_writes(wait)
            else:
                info = await self._writer.commit(self, wait=wait)
        except asyncio.CancelledError:
            if not may_land[0]:
                self.state = "failed"  # nothing was sent that could make it visible
                raise
            # cancelled after its commit record (or fragment) was sent: it may
            # still land, so the outcome is unknown, never "failed"
            self.state = "unknown"
            raise CommitOutcomeUnknownError(
                f"{self!r}: the commit was cancelled after what makes it visible was sent; it may "
                f"or may not have landed (write-id {self.write_id}). Once the store answers, "
                f"kv.find_write_id(err) tells whether it committed",
                write_id=self.write_id,
            ) from None
        except CommitOutcomeUnknownError:
            self.state = "unknown"
            raise
        except BaseException:
            self.state = "failed"
            raise
        self.state = "committed"
        return info

    async def _commit_without_writes(self, wait: bool) -> CommitInfo:
        if self.multi_writer:
            # a process with nothing to write still takes part in the barrier
            versioned = [p for p in self._participants.values() if not isinstance(p, SingleKeyParticipant)]
            if len(versioned) != 1:
                raise InvalidArgumentError(
                    f"{self!r}: a multi-writer transaction must be bound to exactly one versioned "
                    f"store (call kv.with_transaction(txn) in every process); found {len(versioned)}"
                )
            return await versioned[0].commit(self, wait=wait)
        version = None
        for p in self._participants.values():
            v = getattr(p, "base_version", None)
            if v is not None:
                version = v
        return CommitInfo(version=version, write_id="", time=time.time(), txn_id=self.txn_id)

    def abort(self) -> None:
        """Drop every staged write; nothing of this transaction becomes visible."""
        if self.state in ("committing", "committed"):
            raise InvalidArgumentError(f"abort: {self!r} is already {self.state}")
        self.state = "aborted"
        for p in self._participants.values():
            p.abort()

    @property
    def committed(self) -> bool:
        return self.state == "committed"

    @property
    def aborted(self) -> bool:
        return self.state == "aborted"

    def _leave(self, failed: bool) -> Future[CommitInfo] | None:
        """Leaving a ``with`` block: abort when it raised, else commit (or join
        the commit already started); returns the commit to wait for."""
        if failed:
            if self.state == "open":
                self.abort()
            return None
        if self.state == "open":
            return self.commit()
        return self._commit_future

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        commit = self._leave(exc_type is not None)
        if commit is not None:
            commit.result()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        commit = self._leave(exc_type is not None)
        if commit is not None:
            await commit

