"""What became of a multi-writer transaction id, and the records process 0 keeps of it.

Shared by the multi-writer participant (:mod:`.multiwriter`) and by commits of
changes staged in many processes (:mod:`.staging`), docs/FORMAT.md §7: process
0 opens an *attempt* (``txns/<txn_id>/attempts/<k>``, create-only, with a fresh
nonce), announces the outcome (``txns/<txn_id>/result`` on success, the
attempt's ``failed`` object otherwise, and the coordination object if any),
and cleans the attempts and fragments up once the result is stored. A
transaction id commits at most once: :func:`find_committed` finds its commit
(through the result, else the commit records above its newest attempt).
Announcing and cleaning up are best effort (a commit is durable before them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from tensorstore_py.core.errors import DataCorruptionError, InvalidArgumentError, TensorStoreError
from tensorstore_py.core.pools import run_io
from tensorstore_py.kvstore.participant import TransactionHandle
from tensorstore_py.kvstore.versioned.create import create_object
from tensorstore_py.kvstore.versioned.format import CommitRecord, new_write_id
from tensorstore_py.kvstore.versioned.fragments import (
    Attempt,
    attempt_name,
    attempts_prefix,
    decode_attempt,
    decode_outcome,
    encode_attempt,
    encode_outcome,
    failed_name,
    outcome_body,
    result_name,
    txn_prefix,
)
from tensorstore_py.kvstore.versioned.root import VersionedRoot

__all__ = [
    "CONCURRENCY", "announce", "cleanup", "committed_record", "committed_since", "failed_since", "failure",
    "find_committed", "first_attempt", "newest_attempt", "open_attempt", "quietly", "read_result", "success",
]

log = logging.getLogger("tensorstore_py.kvstore.versioned")

#: concurrent reads / deletes of a transaction id's objects
CONCURRENCY = 64


# -- what happened to a transaction id ----------------------------------------------
async def read_result(root: VersionedRoot, txn_id: str) -> dict[str, Any] | None:
    """The successful outcome stored in ``txns/<txn_id>/result``, or None."""
    name = result_name(txn_id)
    res = await root.base.read(name)
    if res.state != "value":
        return None
    outcome = decode_outcome(res.value, name)
    if outcome["error"] is not None:  # only format 1 stored failures there
        raise InvalidArgumentError(
            f"multi-writer transaction {txn_id!r}: {name!r} on {root.base!r} records a failed "
            f"transaction (format 1); transaction ids must not be reused"
        )
    return outcome


async def committed_record(root: VersionedRoot, txn_id: str, outcome: dict[str, Any]) -> CommitRecord:
    """The commit record a successful outcome names (checked to be this transaction's)."""
    rec = await root.record_at(int(outcome["version"]))
    if rec is None or rec.txn_id != txn_id:
        raise DataCorruptionError(
            f"versioned store {root.base!r}: the outcome of transaction {txn_id!r} names version "
            f"{outcome['version']}, which does not commit it"
        )
    return rec


async def committed_since(root: VersionedRoot, txn_id: str, since: int) -> CommitRecord | None:
    """The version above ``since`` that commits ``txn_id``, if any."""
    return await root.find_record(lambda r: r.txn_id == txn_id, since)


async def newest_attempt(root: VersionedRoot, txn_id: str) -> tuple[Attempt | None, bool]:
    """(the newest attempt still there, whether any attempt was listed)."""
    names = await root.base.list(attempts_prefix(txn_id))
    numbers = sorted(int(n[-6:]) for n in names if n[-6:].isdigit() and n == attempt_name(txn_id, int(n[-6:])))
    for k in reversed(numbers):
        res = await root.base.read(attempt_name(txn_id, k))
        if res.state == "value":
            return decode_attempt(res.value, attempt_name(txn_id, k), txn_id), True
    return None, bool(numbers)  # listed but deleted meanwhile: the transaction finished


async def find_committed(root: VersionedRoot, txn_id: str) -> tuple[CommitRecord | None, Attempt | None]:
    """(the commit of ``txn_id`` or None, its newest attempt or None)."""
    for _ in range(3):
        outcome = await read_result(root, txn_id)
        if outcome is not None:
            return await committed_record(root, txn_id, outcome), None
        prev, listed = await newest_attempt(root, txn_id)
        if prev is not None:
            return await committed_since(root, txn_id, prev.since), prev
        if not listed:
            return None, None  # no attempt ever opened: nothing can have committed
    raise DataCorruptionError(
        f"multi-writer transaction {txn_id!r}: attempts on {root.base!r} vanish without a result"
    )


# -- participants: which runs they can belong to ---------------------------------------
async def first_attempt(root: VersionedRoot, txn_id: str) -> int:
    """The first attempt a participant beginning now can belong to: the newest
    attempt if it has not failed, else the next one (1 with none).

    Attempts below it were over before this participant began; an attempt at
    or above it that failed ended this participant's run (FORMAT.md §7.3)."""
    a, _ = await newest_attempt(root, txn_id)
    if a is None:
        return 1
    res = await root.base.read(failed_name(txn_id, a.number, a.nonce))
    return a.number + 1 if res.state == "value" else a.number


async def failed_since(root: VersionedRoot, txn_id: str, first: int, below: int) -> dict[str, Any] | None:
    """The recorded failure of an attempt ``first <= k < below``, if any (the
    outcome body of its ``failed`` object)."""
    for k in range(first, below):
        res = await root.base.read(attempt_name(txn_id, k))
        if res.state != "value":
            continue  # deleted: the transaction committed (its result says so)
        a = decode_attempt(res.value, attempt_name(txn_id, k), txn_id)
        name = failed_name(txn_id, k, a.nonce)
        fail = await root.base.read(name)
        if fail.state == "value":
            return decode_outcome(fail.value, name)
    return None


# -- process 0: its attempt, the outcome, cleanup -------------------------------------
async def open_attempt(root: VersionedRoot, txn: TransactionHandle) -> Attempt | CommitRecord:
    """Open process 0's attempt, or return the commit if ``txn_id`` already committed
    (then the result object is repaired if missing and the others are told)."""
    txn_id = txn.txn_id
    assert txn_id is not None
    try:
        while True:
            rec, prev = await find_committed(root, txn_id)
            if rec is not None:
                await announce(root, txn, None, success(rec))
                return rec
            since = prev.since if prev is not None else await root.newest()
            a = Attempt(txn_id, prev.number + 1 if prev else 1, new_write_id(), txn.process_count,
                        since, time.time())
            if await create_object(root.base, attempt_name(txn_id, a.number), encode_attempt(a),
                                   exists="compare"):
                break
            # another process 0 opened attempt k first: look again
        if txn.coordinator is not None:
            await run_io(txn.coordinator.publish, f"tsp/{txn_id}/attempt", json.dumps(a.to_json()))
        return a
    except TensorStoreError as e:
        if txn.coordinator is not None:  # the others wait for an attempt: tell them
            body = json.dumps({"result": outcome_body(txn_id, None, failure(e))})
            await quietly(run_io(txn.coordinator.publish, f"tsp/{txn_id}/attempt", body))
        raise


def success(rec: CommitRecord) -> dict[str, Any]:
    return {"version": rec.version, "write_id": rec.write_id, "time": rec.time, "error": None, "message": ""}


def failure(e: BaseException) -> dict[str, Any]:
    return {"version": None, "write_id": getattr(e, "write_id", None), "time": time.time(),
            "error": type(e).__name__, "message": str(e)}


async def quietly(aw: Any) -> None:
    try:
        await aw
    except Exception as e:  # best effort: the others fall back to their deadline
        log.warning("multi-writer transaction: could not announce an outcome: %s", e)


async def announce(root: VersionedRoot, txn: TransactionHandle, a: Attempt | None, outcome: dict[str, Any]) -> None:
    """Tell the others: ``result`` (success, stays) or the attempt's ``failed`` object,
    and the coordination object. Best effort: a commit is durable before this,
    and a participant that hears nothing finds the commit record at its deadline."""
    txn_id = txn.txn_id
    assert txn_id is not None
    if outcome["error"] is None:
        # "ours" also when a result is there: one transaction id commits one version
        await quietly(create_object(root.base, result_name(txn_id), encode_outcome(txn_id, a, outcome),
                                     exists="ours"))
    elif a is not None:
        await quietly(create_object(root.base, failed_name(txn_id, a.number, a.nonce),
                                     encode_outcome(txn_id, a, outcome), exists="ours"))
    if txn.coordinator is not None:
        body = outcome_body(txn_id, a, outcome)
        if a is None:  # the others still wait for an attempt
            await quietly(run_io(txn.coordinator.publish, f"tsp/{txn_id}/attempt", json.dumps({"result": body})))
        await quietly(run_io(txn.coordinator.publish, f"tsp/{txn_id}/result", json.dumps(body)))


async def cleanup(root: VersionedRoot, txn_id: str) -> None:
    """Delete the transaction's attempts and fragments; the small result stays
    (garbage collection keeps it while the version it names is retained,
    FORMAT.md §9). Best effort. Nothing is deleted while no ``result`` is
    listed (its write failed): the attempts then bound the search for the
    commit record (§7.2), so that a re-run still finds the commit."""
    try:
        listed = await root.base.list(txn_prefix(txn_id))
        if result_name(txn_id) not in listed:
            return
        names = [n for n in listed if n != result_name(txn_id)]
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(name: str) -> None:
            async with sem:
                await root.base.delete(name)

        await asyncio.gather(*(one(n) for n in names))
    except Exception as e:
        log.warning("multi-writer transaction %r: cleanup of %s failed (gc collects it): %s",
                    txn_id, txn_prefix(txn_id), e)

