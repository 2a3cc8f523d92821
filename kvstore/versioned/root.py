"""One version history on one base store: discovery, reads, and the commit engine.

A :class:`VersionedRoot` is shared by every :class:`VersionedKvStore` view of the
same base store in a process (views differ only by key prefix or snapshot), so
they share one node cache, one known-newest version and one group-commit queue.

The commit engine (:meth:`VersionedRoot.commit`) is the only code that creates
commit records. Its loop: find the newest version ``n``; let the caller plan the
changes against it (conflict checks, conditions); write the new tree nodes; then
create ``commits/<n+1>`` create-only (the linearisation point). Losing that race
re-plans against the newer version (rebase). A failed or timed-out create is
resolved by reading the record back and comparing write-ids (FORMAT.md §6.3);
when no answer tells, the commit raises ``CommitOutcomeUnknownError`` (never a
plain StorageError) and :meth:`VersionedRoot.find_record` answers later.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensorstore_py.core.errors import (
    CommitOutcomeUnknownError,
    ConditionFailedError,
    DataCorruptionError,
    DeadlineExceededError,
    NotFoundError,
    SnapshotExpiredError,
    StorageError,
)
from tensorstore_py.core.retry import RetryPolicy
from tensorstore_py.kvstore.base import Generation, KvStore
from tensorstore_py.kvstore.participant import note_may_land
from tensorstore_py.kvstore.versioned.create import create_object
from tensorstore_py.kvstore.versioned.format import (
    MAGIC_CHANGES,
    MAX_INLINE_CHANGES,
    CommitRecord,
    Entry,
    commit_name,
    frame,
    new_name,
    new_write_id,
    ranges_contain,
    unframe,
)
from tensorstore_py.kvstore.versioned.leases import LeaseKeeper
from tensorstore_py.kvstore.versioned.newest import (
    HintWriter,
    probe_newest,
    read_hint,
)
from tensorstore_py.kvstore.versioned.tree import (
    Change,
    Node,
    NodeCache,
    TreeWriter,
    decode_node,
    lookup,
    scan,
)

__all__ = [
    "Plan", "RootView", "VersionedRoot", "base_of", "get_root", "is_missing", "missing_object",
    "probe_newest", "read_hint",
]

#: concurrent object writes of one commit
WRITE_CONCURRENCY = 64
#: one commit-record write that fails with an I/O error: 6 attempts, waits of
#: 50 ms doubling to 1.6 s on average between them
PUBLISH_RETRY = RetryPolicy(max_attempts=6, initial_delay=0.1, max_delay=4.0)
#: the preparation of a commit (probe, plan, tree nodes) on I/O errors: 4
#: attempts, waits of 40, 80 and 160 ms on average between them
PREPARE_RETRY = RetryPolicy(max_attempts=4, initial_delay=0.08, max_delay=4.0)
#: I/O errors of a write whose outcome a read-back resolves
_IO_ERRORS = (TimeoutError, StorageError, DeadlineExceededError, OSError)
#: commit records read at once when scanning history for a write-id
SCAN_BATCH = 16
#: commit records kept decoded per root (immutable, so never stale)
RECORD_CACHE = 1024


@dataclass
class Plan:
    """What one commit attempt writes, planned against its parent version."""

    changes: list[Change]
    kind: str = "data"
    message: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    txn_id: str | None = None
    txn_nonce: str | None = None  # the multi-writer attempt committing
    tags: dict[str, int] | None = None  # None = the parent's
    deleted: list[list[int]] | None = None  # None = the parent's
    write_id: str = field(default_factory=new_write_id)
    #: awaited after the attempt's objects are written, right before its commit
    #: record; raising aborts the commit (nothing becomes visible)
    before_publish: Callable[[], Awaitable[None]] | None = None


Planner = Callable[[CommitRecord | None], Awaitable[Plan | None]]


def missing_object(name: str, message: str) -> DataCorruptionError:
    """The error for a referenced object that is absent (``is_missing`` tells it
    apart from other corruption: a reclaimed version reads like this)."""
    err = DataCorruptionError(message)
    err.missing_object = name  # type: ignore[attr-defined]
    return err


def is_missing(err: BaseException) -> bool:
    return getattr(err, "missing_object", None) is not None


class _Lru(OrderedDict):  # type: ignore[type-arg]
    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def put(self, k: Any, v: Any) -> None:
        self[k] = v
        self.move_to_end(k)
        while len(self) > self.cap:
            self.popitem(last=False)


class VersionedRoot:
    """The shared state of one versioned store (one base store) in this process."""

    def __init__(self, base: KvStore) -> None:
        self.base = base
        self.cache = NodeCache()
        self.records: _Lru = _Lru(RECORD_CACHE)
        self.known = 0  # newest version this process knows exists
        # the write-id of commits/<known> as read or written: checked by every
        # probe even after the record left the bounded record cache
        self._known_id: str | None = None
        self._hint_read = False
        self._probe: asyncio.Task[int] | None = None
        self._probe_seq = 0
        self._probe_done = 0
        self._node_loads: dict[str, asyncio.Future[Node]] = {}
        # group commit of writes outside transactions (see store.py)
        self.queue: list[Any] = []
        self.committer: asyncio.Task[None] | None = None
        self.hints = HintWriter(base)
        #: this process's lease on the store (docs/FORMAT.md §9.3)
        self.leases = LeaseKeeper(base)

    def __repr__(self) -> str:
        return f"VersionedRoot({self.base!r})"

    # -- objects -----------------------------------------------------------------
    async def load_node(self, name: str) -> Node:
        node = self.cache.get(name)
        if node is not None:
            return node
        # single-flight: concurrent readers of one node share one read
        fut = self._node_loads.get(name)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._node_loads[name] = fut
        try:
            res = await self.base.read(name)
            if res.state != "value":
                raise missing_object(name, f"versioned store {self.base!r}: index node {name!r} is missing")
            node = decode_node(res.value, name)
            self.cache.put(name, node)
            fut.set_result(node)
            return node
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            del self._node_loads[name]

    async def read_record(self, version: int, *, cached: bool = True) -> CommitRecord | None:
        """The commit record of ``version`` (None if it does not exist)."""
        if cached:
            rec = self.records.get(version)
            if rec is not None:
                return rec  # type: ignore[no-any-return]
        name = commit_name(version)
        res = await self.base.read(name)
        if res.state != "value":
            return None
        rec = CommitRecord.decode(res.value, name)
        self.records.put(version, rec)
        self._note_known(rec)
        return rec

    def _note_known(self, rec: CommitRecord) -> None:
        if rec.version >= self.known:
            self.known, self._known_id = rec.version, rec.write_id

    async def changed_keys(self, rec: CommitRecord) -> list[str]:
        if rec.changes_ref is None:
            return list(rec.changes or [])
        res = await self.base.read(rec.changes_ref)
        if res.state != "value":
            raise DataCorruptionError(
                f"versioned store {self.base!r}: changes object {rec.changes_ref!r} of version "
                f"{rec.version} is missing (collected?)"
            )
        body = unframe(MAGIC_CHANGES, res.value, rec.changes_ref)
        keys = body.get("keys") if isinstance(body, dict) else None
        if not isinstance(keys, list):
            raise DataCorruptionError(f"versioned store: changes object {rec.changes_ref!r} is malformed")
        return keys

    async def write_all(self, objects: Sequence[tuple[str, Any]]) -> None:
        """Create every ``(name, data)`` object (fresh names), retrying I/O errors."""
        sem = asyncio.Semaphore(WRITE_CONCURRENCY)

        async def one(name: str, data: Any) -> None:
            async with sem:
                await create_object(self.base, name, data, exists="ours")

        await asyncio.gather(*(one(n, d) for n, d in objects))

    # -- versions -------------------------------------------------------------------
    async def newest(self) -> int:
        """The newest version, as of some moment after this call started.

        Concurrent callers share probes: a caller waits for a probe that began
        after it arrived, so 256 concurrent reads cost one or two probes.
        """
        target = self._probe_seq + 1
        while self._probe_done < target:
            if self._probe is None:
                self._probe_seq += 1
                self._probe = asyncio.ensure_future(self._run_probe(self._probe_seq))
            probe = self._probe
            await asyncio.shield(probe)
        return self.known

    def start_probe(self) -> asyncio.Future[int]:
        """For :meth:`commit`'s ``probe``: the version a commit builds on, looked
        up in the background while the writer uploads its data.

        Where this process knows the store's history, that is the newest version
        it knows, once ``commits/<known>`` is read back from the store with the
        write-id cached (FORMAT.md §5.1 asks for that read); the version above
        it is not probed. The commit record's create-only write is that probe: a
        version another writer committed meanwhile makes it fail, and the next
        attempt looks the newest version up in full (:meth:`newest`). One request
        less per commit (a one-key commit: 4, was 5), for one round trip more
        when another writer won the race. Otherwise (nothing known, or the record
        read back differs) it is :meth:`newest`."""
        probe = asyncio.ensure_future(self._base_version())
        probe.add_done_callback(lambda f: f.cancelled() or f.exception())
        return probe

    async def _base_version(self) -> int:
        known = self.known
        if known > 0 and await self._same_record(known):
            return known
        return await self.newest()

    async def _run_probe(self, seq: int) -> int:
        try:
            v = await self._find_newest()
            self._probe_done = max(self._probe_done, seq)
            return v
        finally:
            self._probe = None

    async def _exists(self, v: int) -> bool:
        return v == 0 or (await self.read_record(v)) is not None

    async def _find_newest(self) -> int:
        """Probe for the newest version, checking (never trusting) the cached history.

        The newest version this process knows is re-read from the store, with
        its write-id, alongside the probe above it: a store deleted and
        recreated at the same place (tests, notebooks, benchmarks) has lost or
        replaced that record, and then everything cached of the old history is
        dropped and the probe starts over from the store as it is.
        """
        known = self.known
        if known == 0:
            if self._hint_read:
                lo = await probe_newest(self._exists, 0)
            else:
                self._hint_read = True
                lo = await self._probe_unknown()
        else:
            hint = 0
            if not self._hint_read:
                self._hint_read = True
                hint = await read_hint(self.base)
            same, lo = await asyncio.gather(self._same_record(known), probe_newest(self._exists, known, hint))
            if not same:
                self._forget_history()
                self._hint_read = True
                lo = await self._probe_unknown()
        self.known = max(self.known, lo)
        return self.known

    async def _probe_unknown(self) -> int:
        """The newest version of a store whose history this process does not
        know: the ``latest`` hint and ``commits/1`` are read together, so an
        empty store is found empty in one round trip (and a store with
        history costs the same two as reading the hint first)."""
        hint, first = await asyncio.gather(read_hint(self.base), self._exists(1))
        return await probe_newest(self._exists, 1, hint) if first else 0

    async def _same_record(self, version: int) -> bool:
        """Whether ``commits/<version>`` still holds the record this process cached."""
        cached = self.records.get(version)
        expected = cached.write_id if cached is not None else self._known_id if version == self.known else None
        rec = await self.read_record(version, cached=False)
        return rec is not None and (expected is None or rec.write_id == expected)

    async def snapshot_expired(self, version: int | None, err: BaseException) -> SnapshotExpiredError | None:
        """What to raise instead of ``err`` when it is a missing object of
        ``version`` and the newest record lists ``version`` as deleted: its
        objects were reclaimed by garbage collection. None otherwise."""
        if version is None or version < 1 or not is_missing(err):
            return None
        newest = await self.record_at(await self.newest())
        if newest is None or not ranges_contain(newest.deleted, version):
            return None
        return SnapshotExpiredError(
            f"versioned store {self.base!r}: version {version} was deleted and garbage collection "
            f"reclaimed its objects ({err.missing_object!r} is gone); read a retained version "  # type: ignore[attr-defined]
            f"(hold a snapshot, which leases its version, to keep reading one)"
        )

    async def record_at(self, version: int) -> CommitRecord | None:
        """The record of ``version`` (None for version 0); raises if absent."""
        if version == 0:
            return None
        rec = await self.read_record(version)
        if rec is None:
            raise NotFoundError(f"versioned store {self.base!r}: version {version} does not exist")
        return rec

    # -- reads at a version ------------------------------------------------------
    async def lookup(self, root: str | None, key: str) -> Entry | None:
        return await lookup(self.load_node, root, key)

    async def scan(self, root: str | None, prefix: str) -> list[tuple[str, Entry]]:
        return await scan(self.load_node, root, prefix)

    # -- the commit engine -----------------------------------------------------------
    async def commit(self, plan_fn: Planner, *, probe: asyncio.Future[int] | None = None) -> CommitRecord | None:
        """Commit what ``plan_fn`` plans against the newest version.

        ``plan_fn(parent)`` is called once per attempt with the parent record
        (None for the empty store); it may raise (e.g. ConflictError) to abort
        or return None for "nothing to commit". Returns the new record.
        ``plan_fn`` must keep no state from an attempt that never reached its
        ``before_publish``: an attempt may be planned speculatively and dropped.
        Cancelled once ``before_publish`` returned (the record is sent right
        after, with no await between), the commit raises
        CommitOutcomeUnknownError: the record may land; before, it is a plain
        cancellation and nothing becomes visible.

        ``probe``: a :meth:`start_probe` the caller started earlier, to overlap the
        search for the version to build on with its own work (uploading data). While
        it is in flight, the first attempt is planned and its tree nodes are
        written against the newest version this process knows (one round trip
        less: probe and nodes together, then the record); it is kept only if
        the probe answers that same version, with the same record, else
        dropped (its nodes are garbage for gc) and re-planned against the
        answer. An answer that is stale by the time of the record (or was
        stale already: that probe does not look above the version it checked)
        costs nothing but a lost race: the create of the commit record fails
        and the next attempt re-plans against a fresh probe. An attempt that
        writes no record (a false condition, nothing to commit) asks for the
        newest version first and is planned again there if it is newer.

        Holds a writer lease (§9.3) while it writes nodes and the record: a
        coordinator that wrote nothing else has none of its own.
        """
        async with self.leases.writing():
            return await self._commit(plan_fn, probe)

    async def _commit(self, plan_fn: Planner, probe: asyncio.Future[int] | None) -> CommitRecord | None:
        failures = 0
        newer: int | None = None  # a version above the first probe's, found by _newer_than
        while True:
            try:
                # Dense versions rest on "commits/<n+1> is only created by a writer
                # that read commits/<n>" (FORMAT.md §5.1), and a store deleted and
                # recreated under this process's cached history must never get a
                # gap. The probe behind ``n`` (one that began after the commit was
                # called: the caller's ``probe`` or :meth:`newest`) read commits/<n>
                # from the store, never from the cache: the version it knew with
                # its write-id (``_same_record``) or a version above it
                # (``_exists``; cached records are never above ``known``), or this
                # process created it meanwhile. No second read of it is needed.
                if probe is not None:
                    first, probe = probe, None
                    try:
                        prepared = await self._prepare_beside(first, plan_fn)
                    except ConditionFailedError:
                        if (newer := await self._newer_than(first.result())) is None:
                            raise
                        continue
                    if prepared is None and (newer := await self._newer_than(first.result())) is not None:
                        continue
                else:
                    n = newer if newer is not None else await self.newest()
                    newer = None
                    prepared = await self._prepare(n, plan_fn)
                if prepared is None:
                    return None
                plan, rec = prepared
                if plan.before_publish is not None:
                    await plan.before_publish()
            except (TimeoutError, OSError):
                # Nothing is visible before the commit record, and every object
                # of an attempt has a fresh name: a failed attempt is safe to redo.
                failures += 1
                if failures >= PREPARE_RETRY.max_attempts:
                    raise
                await asyncio.sleep(PREPARE_RETRY.delay(failures))
                continue
            try:
                landed = await self._publish(rec)
            except asyncio.CancelledError:
                # the record was sent, or is being sent: it may land all the same
                raise CommitOutcomeUnknownError(
                    f"versioned store {self.base!r}: the commit was cancelled while its record "
                    f"{commit_name(rec.version)!r} (write-id {rec.write_id}) was being written; it may "
                    f"or may not have landed: VersionedKvStore.find_write_id(err) tells",
                    write_id=rec.write_id, key=commit_name(rec.version), version=rec.version,
                ) from None
            if landed:
                self.records.put(rec.version, rec)
                self._note_known(rec)
                self.hints.note(self.known)
                return rec
            # lost the race: the loop re-plans against the newer version (rebase)

    async def _newer_than(self, version: int) -> int | None:
        """After a first attempt found a condition false, or nothing to commit, on
        the ``version`` its probe answered: the newest version if it is above that
        one, else None. A writer's probe does not look above the version it
        checked (:meth:`start_probe`) and only a record write finds a newer one,
        so an attempt that writes no record must ask: a condition may hold there,
        or a delete find its key."""
        n = await self.newest()
        return n if n > version else None

    async def _prepare(self, n: int, plan_fn: Planner) -> tuple[Plan, CommitRecord] | None:
        """Plan against version ``n`` and write the attempt's objects: (plan,
        record to publish), or None for nothing to commit."""
        parent = await self.record_at(n)
        plan = await plan_fn(parent)
        if plan is None:
            return None
        return plan, await self._build(parent, plan)

    async def _prepare_beside(self, probe: asyncio.Future[int], plan_fn: Planner) -> tuple[Plan, CommitRecord] | None:
        """:meth:`_prepare` against the answer of ``probe``, started against the
        newest cached version while the probe is in flight (see :meth:`commit`)."""
        guess = self.known
        if probe.done():
            return await self._prepare(await probe, plan_fn)
        cached = self.records.get(guess) if guess > 0 else None
        # an empty store is guessed too once a probe of this process found it
        # empty: there is no record whose write-id could differ
        empty = guess == 0 and self._probe_done > 0
        if cached is None and not empty:
            return await self._prepare(await probe, plan_fn)
        attempt = asyncio.ensure_future(self._prepare(guess, plan_fn))
        attempt.add_done_callback(lambda f: f.cancelled() or f.exception())  # a dropped one's error
        try:
            n = await probe
        except Exception:
            attempt.cancel()
            await asyncio.wait([attempt])  # ended before a retry plans again
            raise
        except BaseException:
            attempt.cancel()
            raise
        now = self.records.get(n)
        # the same version with the same record: the probe re-read commits/<guess>
        # from the store and found the write-id cached (a recreated store drops
        # the cache and never matches)
        if n == guess and (empty or (now is not None and cached is not None and now.write_id == cached.write_id)):
            return await attempt
        attempt.cancel()
        await asyncio.wait([attempt])  # its plan_fn call has ended before the next one
        return await self._prepare(n, plan_fn)

    async def _build(self, parent: CommitRecord | None, plan: Plan) -> CommitRecord:
        writer = TreeWriter(self.load_node, self.cache)
        root, count = await writer.apply(parent.root if parent else None, plan.changes)
        objects: list[tuple[str, Any]] = list(writer.written.items())
        keys = [k for k, _ in plan.changes]
        changes: list[str] | None = keys
        changes_ref = None
        if len(keys) > MAX_INLINE_CHANGES:
            changes_ref = new_name("changes")
            objects.append((changes_ref, frame(MAGIC_CHANGES, {"keys": keys})))
            changes = None
        await self.write_all(objects)  # durable before the commit record
        v = (parent.version if parent else 0) + 1
        return CommitRecord(
            version=v,
            parent=v - 1,
            time=time.time(),
            write_id=plan.write_id,
            message=plan.message,
            metadata=plan.metadata,
            root=root,
            count=count,
            changes=changes,
            changes_ref=changes_ref,
            kind=plan.kind,
            tags=dict(parent.tags if parent else {}) if plan.tags is None else plan.tags,
            deleted=list(parent.deleted if parent else []) if plan.deleted is None else plan.deleted,
            txn_id=plan.txn_id,
            txn_nonce=plan.txn_nonce,
        )

    async def _publish(self, rec: CommitRecord) -> bool:
        """Create the commit record: True if ours landed, False if we lost the race.

        Raises CommitOutcomeUnknownError when every attempt and every read-back
        failed, so that neither answer is known (FORMAT.md §6.3).
        """
        name = commit_name(rec.version)
        data = rec.encode()
        last: BaseException | None = None
        note_may_land()  # from here on, an interrupted commit may still land
        for attempt in range(1, PUBLISH_RETRY.max_attempts + 1):
            try:
                await self.base.write(name, data, if_equal=Generation.NO_VALUE)
                return True
            except ConditionFailedError:
                pass  # exists: ours (an earlier attempt landed) or another writer's
            except _IO_ERRORS as e:
                last = e  # the write may or may not have landed: read it back
            landed = await self._landed(rec, name)
            if landed is not None:
                return landed
            await asyncio.sleep(PUBLISH_RETRY.delay(attempt))
        # the attempts are used up: look the write-id up one last time
        landed = await self._landed(rec, name)
        if landed is not None:
            return landed
        raise CommitOutcomeUnknownError(
            f"versioned store {self.base!r}: commit record {name!r} (write-id {rec.write_id}) "
            f"could not be written or read back in {PUBLISH_RETRY.max_attempts} attempts "
            f"(last error: {last}); it may or may not have landed. Once the store answers, "
            f"VersionedKvStore.find_write_id(err) tells whether it committed "
            f"(it can only land as version {rec.version})",
            write_id=rec.write_id, key=name, version=rec.version,
        ) from last

    async def _landed(self, rec: CommitRecord, name: str) -> bool | None:
        """Read ``commits/<v>`` back: True if it holds our write-id, False if
        another writer's, None if it is missing or can not be read."""
        try:
            other = await self.read_record(rec.version, cached=False)
        except _IO_ERRORS:
            return None
        if other is None:
            return None
        return other.write_id == rec.write_id

    async def find_record(self, match: Callable[[CommitRecord], bool], since: int = 0) -> CommitRecord | None:
        """The newest commit record above version ``since`` for which ``match`` is true.

        Scans down from the newest version in growing batches, so a recent
        commit costs a few reads; ``since`` bounds the scan. Records of deleted
        versions are searched too (commit records are never deleted).
        """
        v = await self.newest()
        batch = SCAN_BATCH
        while v > since:
            lo = max(since, v - batch)
            recs = await asyncio.gather(*(self.read_record(x) for x in range(v, lo, -1)))
            for rec in recs:
                if rec is not None and match(rec):
                    return rec
            v = lo
            batch = min(batch * 2, 16 * SCAN_BATCH)
        return None

    def _forget_history(self) -> None:
        """Drop what this process cached of the store's history (records, nodes,
        the newest version): the store under it is not the one it read."""
        self.records.clear()
        self.cache = NodeCache()
        self.known = 0
        self._known_id = None
        self._hint_read = False

    def _reset_after_fork(self) -> None:
        # asyncio objects belong to the parent's loop, which does not exist here
        self._probe = None
        self._probe_seq = self._probe_done = 0
        self._node_loads = {}
        self.queue = []
        self.committer = None
        self.hints.reset_after_fork()


class RootView:
    """A store that is a view of a :class:`VersionedRoot` (the versioned kvstore).

    The modules below the store (gc, verify) take a versioned store or its base
    store; this marker lets them tell the two apart without importing the store.
    """

    base: KvStore


def base_of(store: KvStore) -> KvStore:
    """The base store of a versioned store; any other store is taken as a base."""
    return store.base if isinstance(store, RootView) else store


# Weak: a root (and its caches) lives as long as some store, task or
# transaction refers to it.
_roots: weakref.WeakValueDictionary[str, VersionedRoot] = weakref.WeakValueDictionary()


def _after_fork_in_child() -> None:
    for r in list(_roots.values()):
        r._reset_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def get_root(base: KvStore) -> VersionedRoot:
    """The process-wide root for ``base`` (views of one base share it)."""
    key = json.dumps(base.spec(), sort_keys=True)
    root = _roots.get(key)
    if root is None:
        root = VersionedRoot(base)
        _roots[key] = root
    return root
