"""Multi-writer commits: N processes, one transaction id, ONE version.

Protocol (docs/FORMAT.md §7; objects in :mod:`.fragments`; what became of a
transaction id, process 0's attempt and the outcome objects in :mod:`.outcomes`):

* Process 0 (the coordinator) opens an **attempt** when it first touches the
  store: it checks that the transaction id has not committed yet, then creates
  ``txns/<txn_id>/attempts/<k>`` (create-only, k one above the newest) with a
  fresh random nonce, and publishes it through the coordination object if one
  is given.
* Participant ``i > 0`` learns the newest attempt (from the coordination
  object, else from the store), writes its data and then its fragment for that
  attempt (create-only; name and body carry the nonce) and waits for the
  outcome. While it waits it watches for a newer attempt and rewrites its
  fragment for it, so a restarted process 0 can finish the transaction.
* Process 0 merges exactly the fragments of its own attempt with its own
  changes, commits ONE version (its record carries the txn id and the nonce),
  writes ``txns/<txn_id>/result`` and deletes the attempt and fragment objects.
  A missing fragment means no commit: at its deadline process 0 records the
  failure of its attempt and raises DeadlineExceededError.
* A transaction id commits at most once: a version above the first attempt that
  carries the id counts as this transaction's commit, and every process that
  asks afterwards (a restarted job included) gets it back, provided its own
  writes are the ones committed.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from tensorstore_py.core import errors as _errors
from tensorstore_py.core.errors import (
    CommitOutcomeUnknownError,
    DataCorruptionError,
    DeadlineExceededError,
    InvalidArgumentError,
    TensorStoreError,
)
from tensorstore_py.core.pools import run_io
from tensorstore_py.core.retry import RetryPolicy
from tensorstore_py.kvstore.participant import CommitInfo, TransactionHandle, note_may_land
from tensorstore_py.kvstore.versioned.create import create_object
from tensorstore_py.kvstore.versioned.data import require_present
from tensorstore_py.kvstore.versioned.format import CommitRecord, InlineEntry, RefEntry, crc32c
from tensorstore_py.kvstore.versioned.fragments import (
    Attempt,
    Fragment,
    attempt_name,
    check_outcome,
    decode_attempt,
    decode_fragment,
    decode_outcome,
    encode_fragment,
    failed_name,
    fragment_key,
    fragment_name,
    fragments_prefix,
    merge_fragments,
    participant_failed,
    participant_failure,
)
from tensorstore_py.kvstore.versioned.outcomes import (
    CONCURRENCY,
    announce,
    cleanup,
    committed_record,
    committed_since,
    failed_since,
    failure,
    first_attempt,
    newest_attempt,
    open_attempt,
    quietly,
    read_result,
    success,
)
from tensorstore_py.kvstore.versioned.root import VersionedRoot
from tensorstore_py.kvstore.versioned.tree import Change
from tensorstore_py.kvstore.versioned.txn import (
    AlreadyCommitted,
    ReadSet,
    VersionedParticipant,
    commit_changes,
)

__all__ = ["MultiWriterParticipant"]

#: waits between two polls of the store for attempts, fragments or the outcome
#: (full jitter): 5 ms on average, doubling up to 0.5 s. Polling ends at the
#: transaction's deadline, not after a number of attempts.
POLL = RetryPolicy(max_attempts=1, initial_delay=0.01, max_delay=1.0)


class MultiWriterParticipant(VersionedParticipant):
    """A process's part in a multi-writer transaction on one versioned root:
    staged like any transaction; process 0 opens its attempt at first use."""

    def __init__(self, root: VersionedRoot, snapshot: int | None, txn: TransactionHandle) -> None:
        super().__init__(root, snapshot, txn)
        self._attempt: asyncio.Future[Attempt | CommitRecord] | None = None
        self._first: asyncio.Future[int] | None = None

    async def pin(self, probe: asyncio.Future[int] | None = None) -> int:
        v = await super().pin(probe)
        if self.txn.process_index == 0:
            self._open()  # early, so that participants can deliver while process 0 still writes
        elif self.txn.coordinator is None:  # (a coordination object is fresh per run)
            self._began()
        return v

    def _began(self) -> asyncio.Future[int]:
        """(Participants) the first attempt this process can belong to, looked up
        when it begins: it never joins a later run after its own run failed."""
        if self._first is None:
            self._first = asyncio.ensure_future(first_attempt(self.root, self.txn.txn_id or ""))
            self._first.add_done_callback(lambda f: f.cancelled() or f.exception())
        return self._first

    def _open(self) -> asyncio.Future[Attempt | CommitRecord]:
        if self._attempt is None:
            self._attempt = asyncio.ensure_future(open_attempt(self.root, self.txn))
            # an abandoned transaction never awaits it: retrieve the error here
            self._attempt.add_done_callback(lambda f: f.cancelled() or f.exception())
        return self._attempt

    async def commit(self, txn: TransactionHandle, *, wait: bool) -> CommitInfo:
        deadline = time.monotonic() + txn.timeout
        try:
            try:
                changes = await self.finalize()
                base = await self.pin()
            except BaseException as e:  # process 0 waits for this part: tell it (FORMAT.md §7.1)
                if txn.process_index > 0 and txn.coordinator is not None:
                    key = fragment_key(txn.txn_id or "", txn.process_index)
                    await quietly(run_io(txn.coordinator.publish, key, participant_failure(txn.process_index, e)))
                raise
            reads = self.checked_reads() or ReadSet()
            mine = Fragment(txn.process_index, base, changes, sorted(reads.keys), sorted(reads.prefixes))
            if txn.process_index == 0:
                return await _coordinate(self, mine, deadline)
            first = await self._began() if txn.coordinator is None else 1
            return await _participate(self.root, txn, mine, deadline, wait, first)
        finally:
            self._release()  # the writer lease: this process's part is over

    async def check_merged(self, own: list[Change], others: list[Fragment]) -> None:
        """Before the commit record (process 0): this process's data objects
        still exist (as for one process), and so do the other participants'
        (a participant that delivered its fragment holds no lease for them any
        more; a collector that found the fragment older than its grace took
        them), whatever their age. DataCorruptionError, nothing visible,
        otherwise. Cost: one 1-byte read per data object the commit adds."""
        await self.check_written(own)
        names = sorted({e.object for f in others for _, e in f.changes if isinstance(e, RefEntry)})
        await require_present(self.root.base, names, self.name, "of other participants")


# -- process 0 --------------------------------------------------------------------------
async def _coordinate(p: MultiWriterParticipant, mine: Fragment, deadline: float) -> CommitInfo:
    root, txn = p.root, p.txn
    txn_id = txn.txn_id
    assert txn_id is not None
    got = await p._open()
    if isinstance(got, CommitRecord):
        info = await _if_same_writes(root, txn, got, mine.changes)
        await cleanup(root, txn_id)
        return info
    a = got
    try:
        frags = await _gather(root, txn, a, deadline)
        changes = merge_fragments([(0, mine.changes)] + [(f.index, f.changes) for f in frags])
        reads = ReadSet()
        for f in [mine, *frags]:
            reads.update(ReadSet(set(f.reads), set(f.read_prefixes)))
        # conflicts are checked from the oldest version any participant read
        low = min(f.base for f in [mine, *frags])
        async def check() -> None:
            await p.check_merged(mine.changes, frags)

        rec = await commit_changes(root, changes, low, txn, reads=reads or None, nonce=a.nonce,
                                   txn_from=a.since, before_publish=check, pinned=[r for r in [p.pinned_record] if r])
    except AlreadyCommitted as e:  # another process 0 (of an older run) committed it
        await announce(root, txn, a, success(e.rec))
        info = await _if_same_writes(root, txn, e.rec, mine.changes)
        await cleanup(root, txn_id)
        return info
    except TensorStoreError as e:
        await announce(root, txn, a, failure(e))
        raise
    await announce(root, txn, a, success(rec))
    await cleanup(root, txn_id)
    return CommitInfo(version=rec.version, write_id=rec.write_id, time=rec.time, txn_id=txn_id,
                      keys_changed=len(changes))



async def _gather(root: VersionedRoot, txn: TransactionHandle, a: Attempt, deadline: float) -> list[Fragment]:
    """Wait until every participant's fragment for attempt ``a`` exists; read them."""
    txn_id, n = a.txn_id, a.count
    names = [fragment_name(txn_id, a.number, a.nonce, i) for i in range(1, n)]
    if txn.coordinator is not None:
        for i in range(1, n):
            got = await _coord_wait(
                txn, fragment_key(txn_id, i), deadline,
                f"multi-writer transaction {txn_id!r}: participant {i} of {n} delivered no fragment "
                f"within {txn.timeout} s; nothing was committed",
            )
            failed = participant_failed(txn_id, n, got)
            if failed is not None:  # it gave up: fail now, not at the deadline
                raise failed
    else:
        want = set(names)
        missing: set[str] = set(want)

        async def probe() -> bool | None:
            nonlocal missing
            missing = want - set(await root.base.list(fragments_prefix(txn_id, a.number, a.nonce)))
            return True if not missing else None

        try:
            await _backoff_poll(probe, deadline, "")
        except DeadlineExceededError:
            idx = sorted(int(m[-6:]) for m in missing)
            raise DeadlineExceededError(
                f"multi-writer transaction {txn_id!r}: participant(s) {idx[:20]} of {n} delivered no "
                f"fragment within {txn.timeout} s; nothing was committed"
            ) from None
    sem = asyncio.Semaphore(CONCURRENCY)

    async def load(i: int, name: str) -> Fragment:
        async with sem:
            res = await root.base.read(name)
        if res.state != "value":
            raise DataCorruptionError(f"versioned store: fragment {name!r} vanished")
        return decode_fragment(res.value, name, a, i)

    return list(await asyncio.gather(*(load(i + 1, nm) for i, nm in enumerate(names))))


# -- participants i > 0 ---------------------------------------------------------------------
async def _participate(root: VersionedRoot, txn: TransactionHandle, mine: Fragment, deadline: float,
                       wait: bool, first: int) -> CommitInfo:
    txn_id = txn.txn_id
    assert txn_id is not None
    watched: Attempt | None = None  # the attempt whose outcome this process waits for
    mine_in: Attempt | None = None  # the attempt holding this process's fragment
    try:
        got = await _learn_attempt(root, txn, deadline, first)
        if isinstance(got, Attempt):
            watched = got
            if await _deliver(root, txn, watched, mine):
                mine_in = watched
            elif not wait or txn.coordinator is not None:
                raise _index_taken(root, watched, mine.index)
            # else: another process delivered for this index (a run before this one):
            # wait for the attempt's outcome, or deliver to the next attempt
            if not wait:
                return CommitInfo(version=None, write_id=txn.write_id, time=time.time(), txn_id=txn_id,
                                  keys_changed=len(mine.changes))
            outcome, watched, mine_in = await _await_outcome(root, txn, watched, mine_in, mine, deadline)
            if isinstance(outcome, CommitRecord):
                return await _as_ours(root, txn, outcome, mine, mine_in)
            got = outcome
    except DeadlineExceededError:
        # process 0 may have committed and died before announcing it:
        # the commit record itself carries the transaction id
        rec = await committed_since(root, txn_id, mine.base if watched is None else min(mine.base, watched.since))
        if rec is None:
            raise
        return await _as_ours(root, txn, rec, mine, mine_in)
    if got["error"] is not None:
        raise _error_of(got, txn)
    return await _as_ours(root, txn, await committed_record(root, txn_id, got), mine, mine_in)


def _index_taken(root: VersionedRoot, a: Attempt, index: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"multi-writer transaction {a.txn_id!r}: participant {index} already delivered another "
        f"fragment for attempt {a.number} ({fragment_name(a.txn_id, a.number, a.nonce, index)!r} on "
        f"{root.base!r}); each process index must be used by one process per attempt"
    )


async def _as_ours(root: VersionedRoot, txn: TransactionHandle, rec: CommitRecord, mine: Fragment,
                   a: Attempt | None) -> CommitInfo:
    """The CommitInfo of ``rec`` for this participant: its fragment of attempt
    ``a`` was merged, or its writes are the ones committed."""
    if a is not None and rec.txn_nonce == a.nonce:
        return CommitInfo(version=rec.version, write_id=rec.write_id, time=rec.time, txn_id=txn.txn_id)
    return await _if_same_writes(root, txn, rec, mine.changes)


def _size_crc(e: Any) -> tuple[int, int] | None:
    if e is None:
        return None
    if isinstance(e, InlineEntry):
        return len(e.value), crc32c(e.value)
    return e.length, e.crc


async def _if_same_writes(root: VersionedRoot, txn: TransactionHandle, rec: CommitRecord,
                          changes: list[Change]) -> CommitInfo:
    """``rec``'s CommitInfo if ``changes`` are what it committed (same keys deleted,
    or holding values of the same length and crc32c), else InvalidArgumentError."""
    what = (f"multi-writer transaction {txn.txn_id!r} already committed as version {rec.version} "
            f"on {root.base!r}")
    try:
        found = await asyncio.gather(*(root.lookup(rec.root, k) for k, _ in changes))
    except DataCorruptionError as e:
        raise InvalidArgumentError(
            f"{what}, and its index can not be read to compare this process's writes with it ({e}); "
            f"transaction ids must not be reused"
        ) from e
    for (k, entry), cur in zip(changes, found):
        if _size_crc(entry) != _size_crc(cur):
            raise InvalidArgumentError(
                f"{what} with other data for key {k!r}; transaction ids must not be reused "
                f"(a retry of a committed transaction must write the same values)"
            )
    return CommitInfo(version=rec.version, write_id=rec.write_id, time=rec.time, txn_id=txn.txn_id,
                      keys_changed=len(changes))


def _error_of(outcome: dict[str, Any], txn: TransactionHandle) -> TensorStoreError:
    name = str(outcome.get("error"))
    msg = f"multi-writer transaction {txn.txn_id!r} failed at the coordinator: {outcome.get('message', '')}"
    if name == "CommitOutcomeUnknownError":
        return CommitOutcomeUnknownError(msg, write_id=outcome.get("write_id"))
    cls = getattr(_errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, TensorStoreError)):
        cls = TensorStoreError
    return cls(msg)


async def _learn_attempt(root: VersionedRoot, txn: TransactionHandle, deadline: float,
                         first: int) -> Attempt | dict[str, Any]:
    """Process 0's newest attempt, or the transaction's outcome if it was already
    decided, or the failure of an attempt ``>= first``: this process's run
    failed, and a job that runs again must not merge this process's writes."""
    txn_id = txn.txn_id
    assert txn_id is not None
    what = (f"multi-writer transaction {txn_id!r}: process {txn.process_index} saw no attempt of "
            f"process 0 within {txn.timeout} s; nothing was committed")
    if txn.coordinator is not None:
        done = await read_result(root, txn_id)
        if done is not None:
            return done
        body = json.loads(await _coord_wait(txn, f"tsp/{txn_id}/attempt", deadline, what))
        if isinstance(body, dict) and "result" in body:
            return check_outcome(body["result"], f"tsp/{txn_id}/attempt")
        a = Attempt.from_json(body, f"tsp/{txn_id}/attempt")
        if a.txn_id != txn_id:
            raise DataCorruptionError(f"tsp/{txn_id}/attempt announces transaction {a.txn_id!r}")
        return a
    done, (a, _) = await asyncio.gather(read_result(root, txn_id), newest_attempt(root, txn_id))
    if done is not None:
        return done
    if a is not None:
        ended = await failed_since(root, txn_id, first, a.number)
        if ended is not None:
            return ended
        name = failed_name(txn_id, a.number, a.nonce)
        res = await root.base.read(name)
        if res.state != "value":
            return a
        if a.number >= first:
            return decode_outcome(res.value, name)
        # that attempt was over before this process began (a job that failed before):
        # wait for process 0's next one
    nxt = attempt_name(txn_id, a.number + 1 if a is not None else 1)

    async def probe() -> Attempt | dict[str, Any] | None:
        res, outcome = await asyncio.gather(root.base.read(nxt), read_result(root, txn_id))
        if outcome is not None:
            return outcome
        return decode_attempt(res.value, nxt, txn_id) if res.state == "value" else None

    return await _backoff_poll(probe, deadline, what)  # type: ignore[no-any-return]


async def _deliver(root: VersionedRoot, txn: TransactionHandle, a: Attempt, mine: Fragment) -> bool:
    """Write this participant's fragment for attempt ``a`` (create-only; durable when
    this returns True). False: another process delivered another fragment for this
    index in this attempt."""
    if a.count != txn.process_count:
        raise InvalidArgumentError(
            f"multi-writer transaction {a.txn_id!r}: process 0 runs it with {a.count} processes, "
            f"this process with process_count={txn.process_count}"
        )
    name = fragment_name(a.txn_id, a.number, a.nonce, mine.index)
    note_may_land()  # process 0 may commit what this fragment holds
    if not await create_object(root.base, name, encode_fragment(a.txn_id, a, txn.write_id, mine),
                               exists="compare"):
        return False
    if txn.coordinator is not None:
        await run_io(txn.coordinator.publish, f"tsp/{a.txn_id}/fragment/{mine.index}", name)
    return True


async def _await_outcome(
    root: VersionedRoot, txn: TransactionHandle, a: Attempt, mine_in: Attempt | None, mine: Fragment,
    deadline: float,
) -> tuple[dict[str, Any] | CommitRecord, Attempt, Attempt | None]:
    """Wait for the outcome of the transaction (or its commit record, found while
    polling), following newer attempts: (outcome, the attempt watched last, the
    attempt holding this process's fragment or None)."""
    txn_id = a.txn_id
    what = (f"multi-writer transaction {txn_id!r}: process {txn.process_index} got no result from "
            f"the coordinator (process 0) within {txn.timeout} s, and no version was committed for it")
    if txn.coordinator is not None:
        body = json.loads(await _coord_wait(txn, f"tsp/{txn_id}/result", deadline, what))
        return check_outcome(body, f"tsp/{txn_id}/result"), a, mine_in
    while True:
        kind, got = await _backoff_poll(_Watch(root, a, min(mine.base, a.since)), deadline, what)
        if kind != "attempt":
            return got, a, mine_in
        # a restarted process 0 opened a newer attempt: deliver again, unless the
        # watched attempt failed meanwhile (then this process's run is over)
        failed = failed_name(txn_id, a.number, a.nonce)
        res = await root.base.read(failed)
        if res.state == "value":
            return decode_outcome(res.value, failed), a, mine_in
        a = got
        if await _deliver(root, txn, a, mine):
            mine_in = a


class _Watch:
    """The polls of a participant of attempt ``a`` (without a coordination object).

    Each poll reads the transaction's result; every :attr:`ATTEMPT_EVERY` polls
    also the attempt's ``failed`` object and the next attempt; every
    :attr:`RECORD_EVERY` polls it also looks for the commit record itself
    (process 0 may have died right after committing).
    """

    ATTEMPT_EVERY = 2
    RECORD_EVERY = 4

    def __init__(self, root: VersionedRoot, a: Attempt, since: int) -> None:
        self.root, self.a, self.since = root, a, since
        self.polls = 0

    async def __call__(self) -> tuple[str, Any] | None:
        root, a = self.root, self.a
        self.polls += 1
        if self.polls % self.ATTEMPT_EVERY:
            outcome = await read_result(root, a.txn_id)
            return None if outcome is None else ("outcome", outcome)
        nxt = attempt_name(a.txn_id, a.number + 1)
        failed = failed_name(a.txn_id, a.number, a.nonce)
        outcome, fail, newer = await asyncio.gather(
            read_result(root, a.txn_id), root.base.read(failed), root.base.read(nxt))
        if outcome is not None:
            return "outcome", outcome
        if fail.state == "value":
            return "outcome", decode_outcome(fail.value, failed)
        if newer.state == "value":
            return "attempt", decode_attempt(newer.value, nxt, a.txn_id)
        if self.polls % self.RECORD_EVERY == 0:
            rec = await committed_since(root, a.txn_id, self.since)
            if rec is not None:
                return "record", rec
        return None


# -- waiting ------------------------------------------------------------------------------
async def _backoff_poll(fn: Any, deadline: float, what: str) -> Any:
    """Call ``fn()`` until it returns non-None, with jittered exponential backoff."""
    polls = 0
    while True:
        got = await fn()
        if got is not None:
            return got
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError(what)
        polls += 1
        await asyncio.sleep(min(left, POLL.delay(polls)))


async def _coord_wait(txn: TransactionHandle, key: str, deadline: float, what: str) -> str:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError(what)
    try:
        return await run_io(txn.coordinator.wait_for, key, left)  # type: ignore[union-attr]
    except Exception as e:
        if time.monotonic() >= deadline - 0.01 or isinstance(e, TimeoutError):
            raise DeadlineExceededError(f"{what} ({e})") from e
        raise
