"""Group commit: writes outside a transaction, batched into few commits.

Every write, delete or ``delete_range`` of a versioned store outside a
transaction is queued on its root (one queue per base store and process); one
committer task at a time commits everything queued so far as ONE version (at
most :data:`MAX_BATCH` operations), re-planned against the newest version at
each attempt. A write with ``if_equal`` is checked then, and a failed condition
fails only that write. The batch holds a writer lease (docs/FORMAT.md §9.3) from
packing its small values to its commit record, and checks right before the
record that every data object it adds still exists (DataCorruptionError for
the whole batch, nothing visible, when a collector took one), except those the
lease vouches for (``LeaseKeeper.vouches``: written under a lease that has held
without a lapse since, on a store stamped by one clock).

Cancelling a write (its Future) before the record of the commit that would
carry it was sent drops it from its batch (re-planned without it: nothing of
it becomes visible) and is a plain cancellation; once that record was sent, the
write may still land, and its caller gets CommitOutcomeUnknownError with the
write-id and version of that record (``VersionedKvStore.find_write_id``).

Round trips: the packed values' upload, the probe for the newest version and
the first attempt's tree nodes (planned against the newest version this
process knows, ``VersionedRoot.commit``) are in flight together; the commit
record follows once all three have landed. A one-key commit with a warm
cache thus waits for two answers one after the other.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from tensorstore_py.core.errors import CommitOutcomeUnknownError, ConditionFailedError
from tensorstore_py.kvstore.base import Generation
from tensorstore_py.kvstore.versioned.data import Pending, UploadFailed, require_present, start_pack, uploaded
from tensorstore_py.kvstore.versioned.format import CommitRecord, Entry, RefEntry, commit_name
from tensorstore_py.kvstore.versioned.leases import lease_clock
from tensorstore_py.kvstore.versioned.root import Plan, VersionedRoot

__all__ = ["MAX_BATCH", "submit"]

#: most operations in one group commit
MAX_BATCH = 65536


@dataclass(eq=False)
class _Op:
    kind: str  # "put" | "delete" | "delete_prefix"
    key: str
    value: Entry | Pending | None
    if_equal: Generation | None
    future: asyncio.Future[Any]
    probe: asyncio.Future[int] | None = None
    #: when the upload of the value's data object started (``leases.lease_clock()``, under a writer lease)
    started: float | None = None
    #: that upload, if still in flight when the operation was queued
    upload: asyncio.Future[None] | None = None
    #: (write-id, version) of the commit record last sent carrying this operation
    sent: tuple[str, int] | None = None


class _Withdrawn(Exception):
    """Raised right before a batch's commit record: a writer of the batch was
    cancelled meanwhile, so the batch is planned again without it."""


async def submit(root: VersionedRoot, kind: str, key: str, value: Any, if_equal: Generation | None,
                 *, probe: asyncio.Future[int] | None = None, started: float | None = None,
                 upload: asyncio.Future[None] | None = None) -> Any:
    """Queue one operation (``kind``: "put", "delete" or "delete_prefix") and
    wait until the version holding it is committed (or its condition failed).

    ``probe``: a ``root.start_probe()`` the caller started while it uploaded the
    value, which the batch's commit plans against first (one round trip less;
    a stale answer only costs a lost race and a re-plan). ``started``: when the
    upload of ``value``'s data object started, under a writer lease held since
    (its lease may vouch for it at commit). ``upload``: that upload, if still
    in flight: the batch's nodes are written meanwhile, and the record only
    once it landed; if it fails, this operation fails with its error and the
    rest of the batch commits without it."""
    op = _Op(kind, key, value, if_equal, asyncio.get_running_loop().create_future(), probe, started, upload)
    root.queue.append(op)
    if root.committer is None:
        root.committer = asyncio.ensure_future(_run_queue(root))
    try:
        return await op.future
    except asyncio.CancelledError:
        if op.sent is None:
            raise  # withdrawn: no commit record carrying it was sent
        write_id, version = op.sent
        raise CommitOutcomeUnknownError(
            f"versioned store over {root.base!r}: the {kind} of {key!r} was cancelled after the "
            f"commit record carrying it ({commit_name(version)!r}, write-id {write_id}) was sent; it "
            f"may or may not have landed: VersionedKvStore.find_write_id(err) tells",
            write_id=write_id, key=commit_name(version), version=version,
        ) from None


async def _run_queue(root: VersionedRoot) -> None:
    """Commit queued operations in batches until the queue is empty."""
    try:
        while root.queue:
            await asyncio.sleep(0)  # let writers issued together join this batch
            batch, root.queue = root.queue[:MAX_BATCH], root.queue[MAX_BATCH:]
            try:
                await _commit_batch(root, batch)
            except BaseException as e:
                for op in batch:
                    if not op.future.done():
                        op.future.set_exception(e)
                if not isinstance(e, Exception):
                    raise
    finally:
        root.committer = None
        if root.queue:  # arrived while we were exiting
            root.committer = asyncio.ensure_future(_run_queue(root))


async def _commit_batch(root: VersionedRoot, batch: list[_Op]) -> None:
    # a writer lease from the first packed value to the commit record
    async with root.leases.writing():
        await _commit_batch_held(root, batch)


async def _commit_batch_held(root: VersionedRoot, batch: list[_Op]) -> None:
    batch = [op for op in batch if not op.future.done()]  # cancelled while queued: never sent
    if not batch:
        return
    pending = [op for op in batch if isinstance(op.value, Pending)]
    # the newest version is looked up while the data uploads and the first
    # attempt's nodes are written: two round trips less than one after another
    probe = next((op.probe for op in batch if op.probe is not None), None) or root.start_probe()
    upload: asyncio.Future[None] | None = None
    try:
        if pending:
            started = lease_clock()
            values = [op.value for op in pending if isinstance(op.value, Pending)]  # all of them
            entries, upload = await start_pack(root, values)
            for op, e in zip(pending, entries):
                op.value = e
                op.started = started
        while True:
            try:
                await _commit_planned(root, batch, probe, upload)
                return
            except _Withdrawn:
                batch = [op for op in batch if not op.future.done()]  # the cancelled ones go
                if not batch:
                    return
                probe.cancel()
                probe = root.start_probe()
            except UploadFailed as e:
                if not isinstance(e.owner, _Op):
                    raise e.error from None  # the packed values': the whole batch
                # one writer's own upload failed: it fails alone, the rest is
                # planned again (without its value) against a fresh probe
                if not e.owner.future.done():  # (its writer may have been cancelled)
                    e.owner.future.set_exception(e.error)
                batch = [op for op in batch if op is not e.owner]
                if not batch:
                    return
                probe.cancel()
                probe = root.start_probe()
    finally:
        probe.cancel()  # done by now unless the commit failed early
        if upload is not None:
            upload.cancel()


async def _commit_planned(root: VersionedRoot, batch: list[_Op], probe: asyncio.Future[int],
                          upload: asyncio.Future[None] | None) -> None:
    outcome: dict[int, BaseException | None] = {}
    # an upload without a start time (none so far) is checked whatever the lease says
    added = {op.value.object: float("-inf") if op.started is None else op.started
             for op in batch if isinstance(op.value, RefEntry)}
    attempt: list[tuple[str, int]] = []  # (write-id, version) of the record planned last

    async def check() -> None:
        await uploaded(upload)
        for op in batch:
            await uploaded(op.upload, op)
        await require_present(root.base, root.leases.unvouched(added), f"group commit on {root.base!r}",
                              "this batch wrote")
        # the record is sent right after this returns (no await in between): a
        # writer cancelled by now is left out; the others' outcome is the record's
        carried = [op for i, op in enumerate(batch) if i in outcome and outcome[i] is None]
        if any(op.future.cancelled() for op in carried):
            raise _Withdrawn()
        for op in carried:
            op.sent = attempt[-1]

    async def plan(parent: CommitRecord | None) -> Plan | None:
        tree = parent.root if parent else None
        effective: dict[str, Entry | None] = {}
        outcome.clear()
        cond_keys = {op.key for op in batch if op.if_equal is not None}
        found = dict(zip(cond_keys, await asyncio.gather(*(root.lookup(tree, k) for k in cond_keys))))
        for i, op in enumerate(batch):
            if op.future.done():
                continue  # cancelled: nothing of it is committed
            if op.if_equal is not None:
                cur = effective[op.key] if op.key in effective else found[op.key]
                gen = Generation.NO_VALUE if cur is None else Generation(cur.stamp)
                if gen != op.if_equal:
                    outcome[i] = ConditionFailedError(
                        f"versioned store over {root.base!r}: key {op.key!r}: expected generation "
                        f"{op.if_equal!r}, found {gen!r} at version {parent.version if parent else 0}"
                    )
                    continue
            if op.kind == "delete_prefix":
                for k, _ in await root.scan(tree, op.key):
                    effective.setdefault(k, None)
                for k in effective:
                    if k.startswith(op.key):
                        effective[k] = None
            else:
                effective[op.key] = op.value  # type: ignore[assignment]
            outcome[i] = None
        if not effective:
            return None
        out = Plan(sorted(effective.items()), kind="data", before_publish=check)
        attempt.append((out.write_id, (parent.version if parent else 0) + 1))
        return out

    await root.commit(plan, probe=probe)
    for i, op in enumerate(batch):
        if op.future.done():
            continue
        err = outcome.get(i)
        if err is not None:
            op.future.set_exception(err)
        else:
            op.future.set_result(None)
