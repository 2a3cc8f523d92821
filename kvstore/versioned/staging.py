"""Staged changes: write data in many places, commit it as ONE version in one place.

For writers whose scheduler carries results back to one place (Dask): each
task writes through an ordinary :class:`~tensorstore_py.Transaction` on a
versioned store, then :func:`stage` makes its data durable and returns the
changes (key -> index entry; small and picklable) *instead of committing*. One
process then commits every task's changes together with :func:`commit_staged`::

    txn = tsp.Transaction()
    kv.with_transaction(txn).write("a/c/0", chunk).result()
    part = stage(txn, kv).result()             # data durable, nothing visible
    ...                                        # parts travel as task results
    commit_staged(kv, parts, txn_id="ingest-7").result()   # ONE new version

Guarantees:

* When :func:`stage` resolves, every value the transaction wrote is durable in
  data objects (fsync'ed on the file store); nothing is visible. The
  transaction is closed (its state becomes "aborted": it commits nothing
  itself). Staged data that is never committed is unreferenced and collected by
  gc after its grace period.
* :func:`commit_staged` is atomic: all parts become visible in one version or
  nothing does. A key staged by two parts raises InvalidArgumentError; a key
  that a version newer than the oldest part's base version changed raises
  ConflictError (the same rule as a transaction); nothing is committed then.
* Only the parts passed are committed: the data of a task attempt whose result
  was lost (a killed worker) is never referenced.
* With ``txn_id``, a repeated call with the same parts (a retried commit task)
  commits nothing new and returns the version the earlier call committed: the
  versions after the oldest part's base are searched for ``txn_id`` inside the
  commit loop, so two concurrent calls with one ``txn_id`` make one version.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tensorstore_py.core.errors import InvalidArgumentError
from tensorstore_py.core.future import Future, spawn
from tensorstore_py.kvstore.ids import check_id
from tensorstore_py.kvstore.transaction import CommitInfo, Transaction
from tensorstore_py.kvstore.versioned.format import CommitRecord, decode_entry
from tensorstore_py.kvstore.versioned.root import Plan, VersionedRoot
from tensorstore_py.kvstore.versioned.store import VersionedKvStore
from tensorstore_py.kvstore.versioned.tree import Change
from tensorstore_py.kvstore.versioned.txn import VersionedParticipant, check_conflicts

__all__ = ["StagedChanges", "commit_staged", "stage"]


@dataclass(frozen=True)
class StagedChanges:
    """One writer's changes, durable but not committed (see the module doc).

    ``history`` names the version history they belong to (the base store's spec
    as JSON); ``base_version`` is the version the writer read from;
    ``changes`` are ``(key, encoded entry or None for a delete)`` pairs, sorted,
    with keys relative to the history's root. Plain data: pickles anywhere.
    """

    history: str
    base_version: int
    changes: tuple[tuple[str, Any], ...]

    def __len__(self) -> int:
        return len(self.changes)


def _history(store: VersionedKvStore) -> str:
    return json.dumps(store.base.spec(), sort_keys=True)


def _check_store(store: Any, what: str) -> VersionedKvStore:
    if not isinstance(store, VersionedKvStore):
        raise InvalidArgumentError(f"{what} needs a versioned store, got {store!r}")
    return store


def stage(txn: Transaction, store: VersionedKvStore) -> Future[StagedChanges]:
    """Make what ``txn`` wrote into ``store`` durable and return it as changes,
    without committing; ``txn`` is closed (see the module doc).

    ``txn`` must be open and single-process (not multi-writer).
    """
    _check_store(store, "stage")
    if txn.multi_writer:
        raise InvalidArgumentError(f"stage: {txn!r} is a multi-writer transaction; stage a plain one")
    txn._check_open("stage")
    participant = txn._participant_for(store)
    if not isinstance(participant, VersionedParticipant) or txn._writer not in (None, participant):
        raise InvalidArgumentError(f"stage: {txn!r} writes into another store than {store!r}")

    async def run() -> StagedChanges:
        await txn._wait_issued()  # writes issued before stage() belong to it
        base = await participant.pin()
        changes = await participant.finalize()
        txn.abort()
        return StagedChanges(
            _history(store), base,
            tuple((k, None if e is None else e.encode()) for k, e in changes),
        )

    return spawn(run())


def commit_staged(
    store: VersionedKvStore,
    parts: Iterable[StagedChanges],
    *,
    txn_id: str | None = None,
    message: str = "",
    metadata: dict[str, Any] | None = None,
) -> Future[CommitInfo]:
    """Commit every part's changes as ONE new version of ``store``'s history.

    Resolves to the :class:`CommitInfo` of the new version (or, with ``txn_id``,
    of the version an earlier call with that id committed). Parts with no
    changes are ignored; when every part is empty nothing is committed and the
    info names the newest version. See the module doc for the guarantees.
    """
    _check_store(store, "commit_staged")
    store._check_writable("commit_staged", "")
    if txn_id is not None:
        check_id("commit_staged: txn_id", txn_id)
    parts = list(parts)
    history = _history(store)
    merged: dict[str, Any] = {}
    owner: dict[str, int] = {}
    for i, part in enumerate(parts):
        if not isinstance(part, StagedChanges):
            raise InvalidArgumentError(f"commit_staged: part {i} is a {type(part).__name__}, not StagedChanges")
        if part.changes and part.history != history:
            raise InvalidArgumentError(
                f"commit_staged: part {i} was staged on another version history ({part.history}), "
                f"not on {history}"
            )
        for k, e in part.changes:
            if k in owner:
                raise InvalidArgumentError(
                    f"commit_staged: key {k!r} was staged by both part {owner[k]} and part {i}; "
                    f"each key must be written by exactly one part"
                )
            owner[k] = i
            merged[k] = None if e is None else decode_entry(e, f"staged change of {k!r}")
    changes: list[Change] = sorted(merged.items())
    bases = [p.base_version for p in parts if p.changes]
    txn = Transaction(txn_id=txn_id, message=message, metadata=metadata)
    return spawn(_commit(store._root, changes, min(bases, default=0), txn))


async def _find_txn(root: VersionedRoot, txn_id: str, lo: int, hi: int) -> CommitRecord | None:
    """The commit of ``txn_id`` among versions ``lo+1..hi``, if any."""
    recs = await asyncio.gather(*(root.record_at(v) for v in range(lo + 1, hi + 1)))
    return next((r for r in recs if r is not None and r.txn_id == txn_id), None)


async def _commit(root: VersionedRoot, changes: list[Change], base: int, txn: Transaction) -> CommitInfo:
    ours = {k for k, _ in changes}
    checked = base
    done: CommitRecord | None = None

    async def plan(parent: CommitRecord | None) -> Plan | None:
        nonlocal checked, done
        n = parent.version if parent else 0
        if n > checked:
            if txn.txn_id is not None:
                done = await _find_txn(root, txn.txn_id, checked, n)
                if done is not None:
                    return None  # committed by an earlier call: nothing new
            await check_conflicts(root, ours, checked, n)
            checked = n
        if not changes:
            return None
        return Plan(changes, kind="data", message=txn.message, metadata=txn.metadata,
                    txn_id=txn.txn_id, write_id=txn.write_id)

    rec = await root.commit(plan)
    if rec is None:
        rec = done if done is not None else await root.record_at(await root.newest())
        if rec is None:
            return CommitInfo(version=0, txn_id=txn.txn_id)
        return CommitInfo(version=rec.version, write_id=rec.write_id, time=rec.time, txn_id=rec.txn_id)
    return CommitInfo(version=rec.version, write_id=rec.write_id, time=rec.time, txn_id=txn.txn_id,
                      keys_changed=len(changes))
