"""Staged changes: write data in many places, commit it as ONE version in one place.

For writers whose scheduler carries results back to one place (Dask): each
task writes through an ordinary :class:`~tensorstore_py.Transaction` on a
versioned store, then :func:`stage` makes its data durable and returns the
changes (key -> index entry; small and picklable) *instead of committing*. One
process then commits every task's changes together with :func:`commit_staged`::

    hold = protect(kv).result()                # the driving process, first
    txn = tsp.Transaction()                    # then in each task:
    read_from(txn, kv, base).result()          # (optional) the version the job read
    kv.with_transaction(txn).write("a/c/0", chunk).result()
    part = stage(txn, kv).result()             # data durable, nothing visible
    ...                                        # parts travel as task results
    commit_staged(kv, parts, txn_id="ingest-7").result()   # ONE new version
    hold.release()

Guarantees:

* When :func:`stage` resolves, every value the transaction wrote is durable in
  data objects (fsync'ed on the file store); nothing is visible. The
  transaction is closed (its state becomes "aborted": it commits nothing
  itself), and with it its writer lease: from then on only a lease held by the
  process that drives the job keeps garbage collection off the staged data.
  Take one with :func:`protect` BEFORE the first :func:`stage` and release it
  after :func:`commit_staged` (or when the job is abandoned): while it is held
  (its lease is refreshed while this process runs; it expires a lease TTL
  after the process dies), a collector in any process keeps every object
  written after it was taken. Staged data that is never committed is
  unreferenced and collected by gc after its grace period once no lease
  protects it.
* :func:`read_from` makes a transaction read (and be conflict-checked from) a
  given version instead of the newest at its first use: the version the job's
  inputs were read from.
* :func:`commit_staged` is atomic: all parts become visible in one version or
  nothing does. A key staged by two parts raises InvalidArgumentError; a key
  that a version newer than the oldest part's base version changed raises
  ConflictError (the same rule as a transaction), and so does a key a part's
  changes were derived from (``StagedChanges.depends``: the metadata of the
  array whose chunks it wrote); a data object a part
  references that no longer exists (collected while no lease protected it)
  raises DataCorruptionError, checked right before the commit record is
  written; nothing is committed then.
* Only the parts passed are committed: the data of a task attempt whose result
  was lost (a killed worker) is never referenced.
* With ``txn_id``, the id commits at most once, whatever the parts and their
  base versions: a later call with that id (a retried commit task, parts
  recomputed from a newer version, a job run again) commits nothing and
  returns the version the id committed, provided that version changed exactly
  the keys the parts stage (else InvalidArgumentError: ids must not be
  reused); concurrent calls make one version. This uses the transaction-id objects of multi-writer commits
  (``txns/<txn_id>/attempts/<k>`` before the commit, ``txns/<txn_id>/result``
  after it; docs/FORMAT.md §7), so one id is also shared with multi-writer
  transactions. An id is remembered as long as the version it committed is
  retained (garbage collection, full or prompt, in any process, keeps its
  ``result``, or its attempts while the ``result`` is missing); once
  retention deleted that version, until a full collection finds the
  ``result`` older than its grace period (docs/FORMAT.md §7.5). A call with
  the id after that commits again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tensorstore_py.core.errors import InvalidArgumentError, TensorStoreError, UnsupportedError
from tensorstore_py.core.future import Future, spawn
from tensorstore_py.kvstore.ids import check_id
from tensorstore_py.kvstore.transaction import CommitInfo, Transaction
from tensorstore_py.kvstore.versioned.data import require_present
from tensorstore_py.kvstore.versioned.format import CommitRecord, RefEntry, decode_entry
from tensorstore_py.kvstore.versioned.fragments import result_name, txn_prefix
from tensorstore_py.kvstore.versioned.leases import Hold
from tensorstore_py.kvstore.versioned.outcomes import announce, cleanup, failure, open_attempt, success
from tensorstore_py.kvstore.versioned.root import VersionedRoot
from tensorstore_py.kvstore.versioned.store import VersionedKvStore
from tensorstore_py.kvstore.versioned.tree import Change
from tensorstore_py.kvstore.versioned.txn import (
    AlreadyCommitted,
    ReadSet,
    VersionedParticipant,
    commit_changes,
)

__all__ = [
    "StagedChanges", "commit_staged", "history_id", "protect", "read_from", "release_when_decided", "stage",
]


@dataclass(frozen=True)
class StagedChanges:
    """One writer's changes, durable but not committed (see the module doc).

    ``history`` names the version history they belong to (the base store's spec
    as JSON); ``base_version`` is the version the writer read from, and
    ``base_write_id`` the write-id of its commit record (None for version 0, and
    in parts staged before it was recorded): the commit checks that the store
    still holds that record, so parts read from a store deleted and recreated
    since are refused (ConflictError);
    ``changes`` are ``(key, encoded entry or None for a delete)`` pairs, sorted,
    with keys relative to the history's root; ``depends`` are the keys the
    changes were derived from (an array's metadata), which no version after
    ``base_version`` may have changed. Plain data: pickles anywhere.
    """

    history: str
    base_version: int
    changes: tuple[tuple[str, Any], ...]
    base_write_id: str | None = None
    depends: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.changes)


def _history(store: VersionedKvStore) -> str:
    return json.dumps(store.base.spec(), sort_keys=True)


def history_id(store: VersionedKvStore) -> str:
    """A short stable name of ``store``'s version history (the same in every
    process that opens the same base store)."""
    return hashlib.sha256(_history(store).encode()).hexdigest()[:16]


def _check_store(store: Any, what: str) -> VersionedKvStore:
    if not isinstance(store, VersionedKvStore):
        raise InvalidArgumentError(f"{what} needs a versioned store, got {store!r}")
    return store


def protect(store: VersionedKvStore) -> Future[Hold]:
    """Hold a writer lease on ``store``'s history for staged data (see the module doc).

    Resolves once the lease object says so. Garbage collection, in any process,
    keeps every unreferenced object written after that moment until
    ``hold.release()`` (idempotent; also done when the hold is garbage
    collected). Best effort like every lease: a store that refuses the lease
    write (read-only) gets none, and :func:`commit_staged` still refuses to
    publish data that is gone.
    """
    _check_store(store, "protect")
    return spawn(store._root.leases.write_hold())


#: seconds between two looks at whether a transaction id was decided (release_when_decided)
DECIDED_POLL = 5.0


def release_when_decided(store: VersionedKvStore, txn_id: str, hold: Hold) -> None:
    """Release ``hold`` once the outcome of ``txn_id`` is recorded in ``store``'s
    history (committed: ``txns/<txn_id>/result``; a commit that failed: a
    ``failed`` object of it that was not there at this call), looked up every
    :data:`DECIDED_POLL` seconds from this process, whichever process commits.
    A job that never reaches its commit keeps the hold until it is released
    otherwise (process exit)."""
    _check_store(store, "release_when_decided")
    check_id("release_when_decided: txn_id", txn_id)
    base = store.base

    async def watch() -> None:
        try:
            earlier = set(await base.list(txn_prefix(txn_id)))  # failures of earlier runs
            while True:
                names = await base.list(txn_prefix(txn_id))
                if result_name(txn_id) in names or any(n.endswith("/failed") for n in set(names) - earlier):
                    return
                await asyncio.sleep(DECIDED_POLL)
        finally:
            hold.release()

    spawn(watch())


def _participant(txn: Transaction, store: VersionedKvStore, what: str) -> VersionedParticipant:
    _check_store(store, what)
    if txn.multi_writer:
        raise InvalidArgumentError(f"{what}: {txn!r} is a multi-writer transaction; stage a plain one")
    txn._check_open(what)
    participant = txn._participant_for(store)
    if not isinstance(participant, VersionedParticipant) or txn._writer not in (None, participant):
        raise InvalidArgumentError(f"{what}: {txn!r} writes into another store than {store!r}")
    return participant


def read_from(txn: Transaction, store: VersionedKvStore, version: int) -> Future[int]:
    """Make ``txn`` read ``store``'s history at ``version``, and so be checked for
    conflicts against every version after it (at :func:`commit_staged`, as at a
    commit), instead of at the newest version of its first use.

    Call it before ``txn`` touches ``store``; InvalidArgumentError if it already
    reads another version.
    """
    participant = _participant(txn, store, "read_from")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise InvalidArgumentError(f"read_from: version must be an int >= 0, got {version!r}")

    async def run() -> int:
        got = await participant.pin_at(version)
        if got != version:
            raise InvalidArgumentError(
                f"read_from: {txn!r} already reads version {got} of {store!r}, not {version}"
            )
        return got

    return spawn(run())


def stage(txn: Transaction, store: VersionedKvStore) -> Future[StagedChanges]:
    """Make what ``txn`` wrote into ``store`` durable and return it as changes,
    without committing; ``txn`` is closed (see the module doc).

    ``txn`` must be open and single-process (not multi-writer).
    """
    participant = _participant(txn, store, "stage")

    async def run() -> StagedChanges:
        await txn._wait_issued()  # writes issued before stage() belong to it
        if participant.links:  # their sources' check lives in this process only
            raise UnsupportedError(
                f"stage: the transaction linked values on {store!r} (link_value); a staged "
                "commit can not check their sources: commit the transaction itself"
            )
        base = await participant.pin()
        changes = await participant.finalize()
        txn.abort()
        pinned = participant.pinned_record
        return StagedChanges(
            _history(store), base,
            tuple((k, None if e is None else e.encode()) for k, e in changes),
            pinned[1] if pinned is not None else None,
            tuple(sorted(participant.depends)),
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
    pinned = sorted({(p.base_version, p.base_write_id) for p in parts if p.changes and p.base_write_id})
    depends = {k for p in parts if p.changes for k in p.depends}
    txn = Transaction(txn_id=txn_id, message=message, metadata=metadata)
    root = store._root

    return spawn(_commit(root, changes, min(bases, default=0), txn, pinned, ReadSet(depends) if depends else None),
                 cancel_reports_outcome=True)


def _info(rec: CommitRecord, keys_changed: int = 0) -> CommitInfo:
    return CommitInfo(version=rec.version, write_id=rec.write_id, time=rec.time, txn_id=rec.txn_id,
                      keys_changed=keys_changed)


async def _earlier(root: VersionedRoot, rec: CommitRecord, changes: list[Change], txn_id: str) -> CommitInfo:
    """The info of ``rec``, the commit of ``txn_id``, if it committed the keys of ``changes``
    (a recomputed job stages the same keys, with new data objects)."""
    keys = sorted(await root.changed_keys(rec))
    if keys != [k for k, _ in changes]:
        raise InvalidArgumentError(
            f"commit_staged: transaction id {txn_id!r} already committed version {rec.version} of "
            f"{root.base!r}, with other keys ({len(keys)}, e.g. {keys[:3]}) than these parts stage "
            f"({len(changes)}, e.g. {[k for k, _ in changes[:3]]}); transaction ids must not be reused"
        )
    return _info(rec)


async def _commit(root: VersionedRoot, changes: list[Change], base: int, txn: Transaction,
                  pinned: list[tuple[int, str]], depends: ReadSet | None) -> CommitInfo:
    objects = sorted({e.object for _, e in changes if isinstance(e, RefEntry)})

    async def present() -> None:
        # staged data outlives its transaction's lease: check it right before the record
        await require_present(root.base, objects, f"commit_staged on {root.base!r}",
                              "that the staged parts reference")

    if not changes:
        rec = await root.record_at(await root.newest())
        return CommitInfo(version=0, txn_id=txn.txn_id) if rec is None else _info(rec)
    if txn.txn_id is None:
        rec = await commit_changes(root, changes, base, txn, reads=depends, before_publish=present, pinned=pinned)
        return _info(rec, len(changes))
    got = await open_attempt(root, txn)  # None of it committed: an attempt, else its commit
    if isinstance(got, CommitRecord):
        await cleanup(root, txn.txn_id)
        return await _earlier(root, got, changes, txn.txn_id)
    try:
        # a version above the attempt's ``since`` (or the parts' base) that carries
        # the id is its commit: AlreadyCommitted instead of a second one
        rec = await commit_changes(root, changes, base, txn, reads=depends, nonce=got.nonce,
                                   txn_from=min(got.since, base), pinned=pinned, before_publish=present)
    except AlreadyCommitted as e:
        await announce(root, txn, got, success(e.rec))
        await cleanup(root, txn.txn_id)
        return await _earlier(root, e.rec, changes, txn.txn_id)
    except TensorStoreError as e:
        await announce(root, txn, got, failure(e))
        raise
    await announce(root, txn, got, success(rec))
    await cleanup(root, txn.txn_id)
    return _info(rec, len(changes))
