"""Multi-writer commits: N processes, one transaction id, ONE version.

Protocol (docs/FORMAT.md §7): every participant ``i > 0`` writes its data and
then its fragment ``txns/<txn_id>/<i:06d>`` (create-only); participant 0 waits
for all fragments (through the caller's coordination service when given, else
by listing the store with backoff), merges them with its own changes, commits
one version and writes ``txns/<txn_id>/result``; the others wait for that
result. A participant that never delivers its fragment means no commit: the
coordinator gives up at its deadline and publishes the failure.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import time
from typing import Any

from tensorstore_py.core import errors as _errors
from tensorstore_py.core.errors import (
    DataCorruptionError,
    DeadlineExceededError,
    InvalidArgumentError,
    TensorStoreError,
)
from tensorstore_py.core.pools import run_io
from tensorstore_py.core.retry import RetryPolicy
from tensorstore_py.kvstore.transaction import CommitInfo, Transaction
from tensorstore_py.kvstore.versioned.create import create_object
from tensorstore_py.kvstore.versioned.format import (
    FORMAT,
    MAGIC_FRAGMENT,
    MAGIC_RESULT,
    CommitRecord,
    decode_entry,
    frame,
    unframe,
)
from tensorstore_py.kvstore.versioned.root import VersionedRoot
from tensorstore_py.kvstore.versioned.tree import Change
from tensorstore_py.kvstore.versioned.txn import VersionedParticipant, commit_changes

__all__ = [
    "MultiWriterParticipant", "commit_multi", "encode_fragment", "fragment_name",
    "merge_fragments", "result_name",
]

#: waits between two polls of the store for fragments or the result (full
#: jitter): 5 ms on average, doubling up to 0.5 s. Polling ends at the
#: transaction's deadline, not after a number of attempts.
POLL = RetryPolicy(max_attempts=1, initial_delay=0.01, max_delay=1.0)


def fragment_name(txn_id: str, index: int) -> str:
    return f"txns/{txn_id}/{index:06d}"


def result_name(txn_id: str) -> str:
    return f"txns/{txn_id}/result"


def encode_fragment(txn: Transaction, base: int, changes: list[Change]) -> bytes:
    return frame(
        MAGIC_FRAGMENT,
        {
            "format": FORMAT,
            "txn_id": txn.txn_id,
            "index": txn.process_index,
            "count": txn.process_count,
            "base": base,
            "write_id": txn.write_id,
            "keys": [k for k, _ in changes],
            "entries": [None if e is None else e.encode() for _, e in changes],
        },
    )


def decode_fragment(data: Any, name: str, txn_id: str, index: int, count: int) -> tuple[int, list[Change]]:
    """(base version, sorted changes) of a fragment, validated."""
    body = unframe(MAGIC_FRAGMENT, data, name)
    if (
        not isinstance(body, dict) or body.get("txn_id") != txn_id or body.get("index") != index
        or body.get("count") != count
    ):
        raise DataCorruptionError(
            f"versioned store: fragment {name!r} is not participant {index} of {count} of "
            f"transaction {txn_id!r} (found {({k: body.get(k) for k in ('txn_id', 'index', 'count')} if isinstance(body, dict) else body)!r:.200})"
        )
    keys, entries, base = body.get("keys"), body.get("entries"), body.get("base")
    if not isinstance(keys, list) or not isinstance(entries, list) or len(keys) != len(entries) or not isinstance(base, int):
        raise DataCorruptionError(f"versioned store: fragment {name!r} is malformed")
    where = f"fragment {name!r}"
    changes = [(k, None if e is None else decode_entry(e, where)) for k, e in zip(keys, entries)]
    if not all(isinstance(k, str) for k in keys) or any(a >= b for a, b in itertools.pairwise(keys)):
        raise DataCorruptionError(f"versioned store: {where}: keys are not sorted strings")
    return base, changes


def merge_fragments(parts: list[tuple[int, list[Change]]]) -> list[Change]:
    """Merge sorted fragments into one sorted change list; a key in two -> error.

    ``parts`` are (participant index, changes) pairs.
    """
    merged: list[Change] = []
    owner: list[int] = []
    streams = [[(k, i, e) for k, e in ch] for i, ch in parts]
    for k, i, e in heapq.merge(*streams, key=lambda t: t[0]):
        if merged and merged[-1][0] == k:
            raise InvalidArgumentError(
                f"multi-writer transaction: key {k!r} written by both participant {owner[-1]} and {i}; "
                f"each key must be written by exactly one process"
            )
        merged.append((k, e))
        owner.append(i)
    return merged


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


async def _coord_wait(txn: Transaction, key: str, deadline: float, what: str) -> str:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError(what)
    try:
        return await run_io(txn.coordinator.wait_for, key, left)  # type: ignore[union-attr]
    except Exception as e:
        if time.monotonic() >= deadline - 0.01 or isinstance(e, TimeoutError):
            raise DeadlineExceededError(f"{what} ({e})") from e
        raise


class MultiWriterParticipant(VersionedParticipant):
    """A process's part in a multi-writer transaction on one versioned root:
    staged like any transaction, committed through :func:`commit_multi`."""

    async def commit(self, txn: Transaction, *, wait: bool) -> CommitInfo:
        return await commit_multi(self, txn, wait=wait)


async def commit_multi(p: VersionedParticipant, txn: Transaction, *, wait: bool) -> CommitInfo:
    deadline = time.monotonic() + txn.timeout
    assert txn.txn_id is not None
    changes = await p.finalize()
    base = await p.pin()
    if txn.process_index == 0:
        return await _coordinate(p.root, txn, base, changes, deadline)
    root = p.root
    name = fragment_name(txn.txn_id, txn.process_index)
    if not await create_object(root.base, name, encode_fragment(txn, base, changes), exists="compare"):
        raise _reused(txn, name, root)
    if txn.coordinator is not None:
        await run_io(txn.coordinator.publish, f"tsp/{txn.txn_id}/fragment/{txn.process_index}", name)
    if not wait:
        return CommitInfo(version=None, write_id=txn.write_id, time=time.time(), txn_id=txn.txn_id,
                          keys_changed=len(changes))
    try:
        result = await _wait_result(root, txn, deadline)
    except DeadlineExceededError:
        # The coordinator may have committed and died before publishing the
        # result: the commit record itself carries the transaction id.
        rec = await _find_commit(root, txn.txn_id, base)
        if rec is None:
            raise
        return CommitInfo(version=rec.version, write_id=rec.write_id, time=rec.time, txn_id=txn.txn_id)
    return _result_to_info(result, txn)


async def _find_commit(root: VersionedRoot, txn_id: str, since: int) -> CommitRecord | None:
    """The version committed for ``txn_id`` after version ``since``, if any."""
    n = await root.newest()
    recs = await asyncio.gather(*(root.record_at(v) for v in range(since + 1, n + 1)))
    return next((r for r in recs if r is not None and r.txn_id == txn_id), None)


def _reused(txn: Transaction, name: str, root: VersionedRoot) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"multi-writer transaction {txn.txn_id!r}: {name!r} already exists on {root.base!r}; "
        f"transaction ids must not be reused"
    )


async def _wait_result(root: VersionedRoot, txn: Transaction, deadline: float) -> dict[str, Any]:
    what = (
        f"multi-writer transaction {txn.txn_id!r}: process {txn.process_index} got no result from "
        f"the coordinator (process 0) within {txn.timeout} s, and no version was committed for it"
    )
    if txn.coordinator is not None:
        text = await _coord_wait(txn, f"tsp/{txn.txn_id}/result", deadline, what)
        body = json.loads(text)
        if isinstance(body, dict):
            return body
    name = result_name(txn.txn_id)  # type: ignore[arg-type]

    async def probe() -> dict[str, Any] | None:
        res = await root.base.read(name)
        if res.state != "value":
            return None
        body = unframe(MAGIC_RESULT, res.value, name)
        if not isinstance(body, dict):
            raise DataCorruptionError(f"versioned store: result {name!r} is malformed")
        return body

    return await _backoff_poll(probe, deadline, what)  # type: ignore[no-any-return]


def _result_to_info(result: dict[str, Any], txn: Transaction) -> CommitInfo:
    err = result.get("error")
    if err:
        cls = getattr(_errors, str(err), None)
        if not (isinstance(cls, type) and issubclass(cls, TensorStoreError)):
            cls = TensorStoreError
        raise cls(f"multi-writer transaction {txn.txn_id!r} failed at the coordinator: {result.get('message', '')}")
    return CommitInfo(
        version=result.get("version"), write_id=str(result.get("write_id") or ""),
        time=float(result.get("time") or 0.0), txn_id=txn.txn_id,
    )


async def _gather_fragments(root: VersionedRoot, txn: Transaction, deadline: float) -> list[str]:
    """Wait until every participant's fragment exists; their names."""
    txn_id, n = txn.txn_id, txn.process_count
    assert txn_id is not None
    names = [fragment_name(txn_id, i) for i in range(1, n)]
    if txn.coordinator is not None:
        for i in range(1, n):
            await _coord_wait(
                txn, f"tsp/{txn_id}/fragment/{i}", deadline,
                f"multi-writer transaction {txn_id!r}: participant {i} of {n} delivered no fragment "
                f"within {txn.timeout} s; nothing was committed",
            )
        return names
    want = set(names)
    missing: set[str] = set(want)

    async def probe() -> list[str] | None:
        nonlocal missing
        listed = set(await root.base.list(f"txns/{txn_id}/"))
        missing = want - listed
        return names if not missing else None

    try:
        return await _backoff_poll(probe, deadline, "")  # type: ignore[no-any-return]
    except DeadlineExceededError:
        idx = sorted(int(m.rsplit("/", 1)[1]) for m in missing)
        raise DeadlineExceededError(
            f"multi-writer transaction {txn_id!r}: participant(s) {idx[:20]} of {n} delivered no "
            f"fragment within {txn.timeout} s; nothing was committed"
        ) from None


async def _coordinate(
    root: VersionedRoot, txn: Transaction, base: int, own: list[Change], deadline: float
) -> CommitInfo:
    txn_id = txn.txn_id
    assert txn_id is not None
    if (await root.base.read(result_name(txn_id))).state == "value":
        raise _reused(txn, result_name(txn_id), root)
    try:
        names = await _gather_fragments(root, txn, deadline)
        sem = asyncio.Semaphore(64)

        async def load(i: int, name: str) -> tuple[int, tuple[int, list[Change]]]:
            async with sem:
                res = await root.base.read(name)
            if res.state != "value":
                raise DataCorruptionError(f"versioned store: fragment {name!r} vanished")
            return i, decode_fragment(res.value, name, txn_id, i, txn.process_count)

        loaded = await asyncio.gather(*(load(i + 1, nm) for i, nm in enumerate(names)))
        parts = [(0, own)] + [(i, ch) for i, (_, ch) in loaded]
        low = min([base] + [b for _, (b, _) in loaded])
        changes = merge_fragments(parts)
        # conflicts are checked from the oldest version any participant read
        rec = await commit_changes(root, changes, low, txn)
    except TensorStoreError as e:
        await _publish_result(root, txn, {"version": None, "write_id": None, "time": time.time(),
                                          "error": type(e).__name__, "message": str(e)})
        raise
    await _publish_result(root, txn, {"version": rec.version, "write_id": rec.write_id,
                                      "time": rec.time, "error": None, "message": ""})
    return CommitInfo(version=rec.version, write_id=rec.write_id, time=rec.time, txn_id=txn_id,
                      keys_changed=len(changes))


async def _publish_result(root: VersionedRoot, txn: Transaction, result: dict[str, Any]) -> None:
    body = {"format": FORMAT, "txn_id": txn.txn_id, **result}
    try:
        # "ours": _coordinate checked that no result existed before it started
        await create_object(root.base, result_name(txn.txn_id), frame(MAGIC_RESULT, body),  # type: ignore[arg-type]
                            exists="ours")
    except Exception:
        if result.get("error") is None:
            raise  # a success must be published
    if txn.coordinator is not None:
        await run_io(txn.coordinator.publish, f"tsp/{txn.txn_id}/result", json.dumps(body))
