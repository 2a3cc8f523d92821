"""A transaction's part on one versioned store: staging, snapshot reads, commit.

Reads come from the version pinned at the transaction's first use of the store
plus its own staged writes. Large values are written to data objects at once;
small ones are staged and packed at commit (or when the staging buffer fills).
At commit the staged changes are checked against every version committed
since the pinned one (write-write conflicts; with ``isolation="serializable"``
also the keys and prefixes the transaction read) and committed as one new
version.
"""

from __future__ import annotations

import asyncio
import bisect
import builtins
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tensorstore_py.core.errors import ConditionFailedError, ConflictError, DataCorruptionError
from tensorstore_py.kvstore.base import BlockingRead, Buffer, ByteRange, Generation, ReadResult
from tensorstore_py.kvstore.participant import CommitInfo, Participant, TransactionHandle
from tensorstore_py.kvstore.versioned.data import (
    STAGING_MAX,
    Pending,
    Staged,
    UploadFailed,
    blocking_reader,
    make_entry,
    read_entry,
    require_present,
    staged_generation,
    start_pack,
    uploaded,
)
from tensorstore_py.kvstore.versioned.format import (
    CommitRecord,
    InlineEntry,
    RefEntry,
    commit_name,
    new_stamp,
)
from tensorstore_py.kvstore.versioned.leases import Hold, lease_clock
from tensorstore_py.kvstore.versioned.root import Plan, VersionedRoot
from tensorstore_py.kvstore.versioned.tree import Change

__all__ = [
    "AlreadyCommitted", "ReadSet", "VersionedParticipant", "check_conflicts", "check_same_history",
    "commit_changes", "validate",
]

#: commit records read at once while checking a transaction against newer versions
CHECK_CONCURRENCY = 64


@dataclass
class ReadSet:
    """What a serializable transaction read: keys (found or not) and listed prefixes."""

    keys: set[str] = field(default_factory=set)
    prefixes: set[str] = field(default_factory=set)

    def update(self, other: ReadSet) -> None:
        self.keys |= other.keys
        self.prefixes |= other.prefixes

    def __bool__(self) -> bool:
        return bool(self.keys or self.prefixes)

    def matcher(self) -> Callable[[str], str | None]:
        """``match(key)``: a description of the read ``key`` falls in, or None."""
        keys = self.keys
        # drop prefixes covered by a shorter one: then the greatest prefix <= key
        # is the only one that can match it
        prefixes: list[str] = []
        for p in sorted(self.prefixes):
            if not prefixes or not p.startswith(prefixes[-1]):
                prefixes.append(p)

        def match(key: str) -> str | None:
            if key in keys:
                return f"key {key!r}, which this transaction read (or derived its writes from),"
            i = bisect.bisect_right(prefixes, key)
            if i and key.startswith(prefixes[i - 1]):
                return (f"key {key!r}, under the prefix {prefixes[i - 1]!r} that this serializable "
                        f"transaction listed,")
            return None

        return match


class AlreadyCommitted(Exception):
    """Raised while planning: a version already carries this multi-writer transaction."""

    def __init__(self, rec: CommitRecord) -> None:
        super().__init__(f"version {rec.version} already commits transaction {rec.txn_id!r}")
        self.rec = rec


async def validate(
    root: VersionedRoot, lo: int, hi: int, *, writes: set[str], reads: ReadSet | None = None,
    txn_id: str | None = None, txn_from: int | None = None,
) -> None:
    """Check versions ``lo+1..hi`` against a transaction that read version ``lo``.

    ConflictError if one changed a key in ``writes`` (write-write) or a key or
    prefix in ``reads`` (read-write, serializable transactions). With
    ``txn_id``, versions ``> txn_from`` are also checked for a record of that
    transaction id (AlreadyCommitted), so one id commits at most once.
    """
    first = lo if txn_from is None else min(lo, txn_from)
    if hi <= first:
        return
    if txn_from is None and not writes and not reads:
        return
    match = reads.matcher() if reads else None
    sem = asyncio.Semaphore(CHECK_CONCURRENCY)

    async def one(v: int) -> tuple[CommitRecord, list[str]]:
        async with sem:
            rec = await root.record_at(v)
            assert rec is not None
            if v <= lo:
                return rec, []
            try:
                return rec, await root.changed_keys(rec)
            except DataCorruptionError as e:
                raise ConflictError(
                    f"versioned store {root.base!r}: can not check version {v} for conflicts: {e}"
                ) from e

    found = await asyncio.gather(*(one(v) for v in range(first + 1, hi + 1)))
    if txn_id is not None and txn_from is not None:
        for rec, _ in found:
            if rec.version > txn_from and rec.txn_id == txn_id:
                raise AlreadyCommitted(rec)  # precedes conflicts: that commit is ours
    for rec, keys in found:
        for k in keys:
            what = f"key {k!r}" if k in writes else match(k) if match is not None else None
            if what is not None:
                raise ConflictError(
                    f"versioned store {root.base!r}: {what} was changed by version {rec.version} "
                    f"after this transaction read version {lo}; retry the transaction",
                    key=k,
                )


async def check_same_history(root: VersionedRoot, version: int, write_id: str) -> None:
    """ConflictError unless ``commits/<version>`` still holds the record with
    ``write_id`` that a transaction read from.

    A store deleted and recreated at the same place has another history under
    the same version numbers: what the transaction read is not in it, and the
    conflict check (which compares versions after ``version``) would not see
    the new history's changes at or below it, so a read-modify-write would
    overwrite them unchecked (a lost update). The record comes from the cache,
    which every probe for the newest version drops when the newest record this
    process knew is no longer on the store; so this costs no round trip unless
    the store was replaced, and a speculative attempt that trusted the cache is
    kept only when its probe confirms the cached history (``VersionedRoot.commit``).
    """
    rec = await root.read_record(version)
    if rec is None or rec.write_id != write_id:
        found = "nothing" if rec is None else f"write-id {rec.write_id}"
        raise ConflictError(
            f"versioned store {root.base!r}: version {version}, which this transaction read, is no "
            f"longer on the store ({commit_name(version)!r} holds {found}, expected write-id "
            f"{write_id}): the store was deleted and recreated since; retry the transaction"
        )


async def check_conflicts(root: VersionedRoot, ours: set[str], lo: int, hi: int) -> None:
    """Raise ConflictError if a version in ``lo+1..hi`` changed a key in ``ours``."""
    await validate(root, lo, hi, writes=ours)


class VersionedParticipant(Participant):
    """The staged state of one transaction on one versioned root.

    Commits as one process; a multi-writer transaction (``txn.multi_writer``)
    gets the subclass ``multiwriter.MultiWriterParticipant`` instead.
    """

    def __init__(self, root: VersionedRoot, snapshot: int | None, txn: TransactionHandle) -> None:
        self.root = root
        self.snapshot = snapshot
        self.txn = txn
        self.key = ("versioned", id(root), snapshot)
        self.name = f"versioned store over {root.base!r}"
        self.base_version: int | None = None
        self._base_root: str | None = None
        # the write-id of the pinned version's record (None for version 0): the
        # commit checks that the store still holds that record (same history)
        self._base_write_id: str | None = None
        self._pin_lock = asyncio.Lock()
        self.writes: dict[str, Staged] = {}
        self._pending_bytes = 0
        self._packing: set[int] = set()  # ids of Pending values being packed
        # the writer lease (from the first staged change until the commit ends)
        # and the data objects written so far, with when each write started
        # (leases.lease_clock(): the lease may vouch for it at commit)
        self._hold: Hold | None = None
        self._written: dict[str, float] = {}
        #: what the transaction read, checked at commit (serializable isolation only)
        self.reads: ReadSet | None = ReadSet() if txn.isolation == "serializable" else None
        #: the keys whose values :meth:`link` staged elsewhere: checked at commit like
        #: a serializable read, whatever the isolation
        self.links: set[str] = set()
        #: the keys the writes were derived from (an array's metadata: depend),
        #: checked at commit like a serializable read, whatever the isolation
        self.depends: set[str] = set()

    @property
    def has_writes(self) -> bool:
        return bool(self.writes)

    @property
    def pinned_record(self) -> tuple[int, str] | None:
        """(version, write-id) of the record this transaction read from (None:
        not pinned yet, or pinned at the empty version 0)."""
        if self.base_version is None or self._base_write_id is None:
            return None
        return self.base_version, self._base_write_id

    async def pin(self, probe: asyncio.Future[int] | None = None) -> int:
        """The version this transaction reads (fixed at first use; ``probe``: a
        ``root.start_probe()`` to take the newest version from)."""
        if self.base_version is None:
            async with self._pin_lock:
                if self.base_version is None:
                    v = self.snapshot if self.snapshot is not None else \
                        await (probe if probe is not None else self.root.newest())
                    rec = await self.root.record_at(v)
                    self._base_root = rec.root if rec else None
                    self._base_write_id = rec.write_id if rec else None
                    self.base_version = v
        return self.base_version

    async def pin_at(self, version: int) -> int:
        """Make ``version`` the version this transaction reads and is checked for
        conflicts from, if it has not pinned one yet; the pinned version."""
        async with self._pin_lock:
            if self.base_version is None:
                rec = await self.root.record_at(version)
                self._base_root = rec.root if rec else None
                self._base_write_id = rec.write_id if rec else None
                self.base_version = version
        return self.base_version

    async def _current(self, key: str) -> Staged:
        if key in self.writes:
            return self.writes[key]
        await self.pin()
        return await self.root.lookup(self._base_root, key)

    def _note_read(self, key: str) -> None:
        if self.reads is not None and key not in self.writes:
            self.reads.keys.add(key)  # found or not: a phantom counts too

    async def read(self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None) -> ReadResult:
        self._note_read(key)
        try:
            return await read_entry(self.root, key, await self._current(key), byte_range, if_not_equal)
        except DataCorruptionError as e:
            expired = await self.root.snapshot_expired(self.base_version, e)
            if expired is not None:
                raise expired from e
            raise

    async def _protect(self) -> None:
        """Hold a writer lease until the transaction is over (garbage collection
        keeps what this transaction writes; docs/FORMAT.md §9.3)."""
        if self._hold is None:
            ref = weakref.ref(self.txn)

            def alive() -> bool:
                t = ref()
                return t is not None and t.state in ("open", "committing")

            self._hold = await self.root.leases.write_hold(alive)

    def _release(self) -> None:
        if self._hold is not None:
            self._hold.release()
            self._hold = None

    async def prepare_read(self, key: str) -> BlockingRead | None:
        """A blocking whole-value read of ``key`` as this transaction sees it (or None)."""
        if not self.root.base.blocking_io:
            return None
        self._note_read(key)
        return blocking_reader(self.root, key, await self._current(key))

    async def write(self, key: str, value: Buffer | None, if_equal: Generation | None) -> Generation | None:
        if if_equal is not None:
            found = staged_generation(await self._current(key))
            if found != if_equal:
                raise ConditionFailedError(
                    f"{self.name}: key {key!r} in a transaction: expected generation "
                    f"{if_equal!r}, found {found!r}"
                )
        else:
            await self.pin()
        await self._protect()
        if value is None:
            self._stage(key, None)
            return None
        started = lease_clock()  # under the writer lease, before the object's write
        entry = await make_entry(self.root, value)
        if isinstance(entry, RefEntry):
            self._written[entry.object] = started
        had, prev = key in self.writes, self.writes.get(key)
        self._stage(key, entry)
        if isinstance(entry, Pending) and self._pending_bytes >= STAGING_MAX:
            try:
                await self._flush()
            except BaseException:
                if self.writes.get(key) is entry:  # this write failed: its key is as it was
                    if had:
                        self._stage(key, prev)
                    else:
                        self._pending_bytes -= len(entry.value)
                        del self.writes[key]
                raise
        return Generation(entry.stamp)

    async def link(self, key: str, source: str) -> bool:
        """Stage at ``key`` the value ``source`` holds in the pinned version: the
        same bytes in the same data object, not a copy, under a fresh generation.

        ``source`` is checked at commit like a key a serializable transaction
        read: a version committed since the pinned one that changed or deleted
        it fails this commit with ConflictError. So the version this commit
        builds on still references the object, and garbage collection keeps it
        while any kept version references it (docs/FORMAT.md §9.2). False, and
        nothing staged, when ``source`` is absent from the pinned version.
        """
        await self.pin()
        try:
            found = await self.root.lookup(self._base_root, source)
        except DataCorruptionError as e:
            expired = await self.root.snapshot_expired(self.base_version, e)
            if expired is not None:
                raise expired from e
            raise
        if found is None:
            return False
        await self._protect()
        self.links.add(source)
        if isinstance(found, InlineEntry):
            self._stage(key, InlineEntry(new_stamp(), found.value))
        else:
            self._stage(key, RefEntry(new_stamp(), found.object, found.offset, found.length, found.crc))
        return True

    def depend(self, key: str) -> None:
        self.depends.add(key)

    def checked_reads(self) -> ReadSet | None:
        """What the commit checks besides the written keys: the serializable read
        set, the sources of :meth:`link` and the keys of :meth:`depend`."""
        if not self.links and not self.depends:
            return self.reads
        out = ReadSet(self.links | self.depends)
        if self.reads is not None:
            out.update(self.reads)
        return out

    def _stage(self, key: str, staged: Staged) -> None:
        old = self.writes.get(key)
        if isinstance(old, Pending) and id(old) not in self._packing:
            self._pending_bytes -= len(old.value)
        if isinstance(staged, Pending):
            self._pending_bytes += len(staged.value)
        self.writes[key] = staged

    async def _flush(self) -> None:
        """Pack every pending value into data objects (bounded memory). If the
        upload fails, the values stay pending, as before the call (the write
        that flushed raises; the transaction goes on and packs them at commit):
        no staged entry is left naming an object that was never written, which
        a commit whose lease vouches for it would reference unchecked."""
        flushed = await self._start_flush()
        if flushed is None:
            return
        upload, swapped = flushed
        try:
            await upload
        except BaseException:
            for k, pending, entry in swapped:
                if self.writes.get(k) is entry:  # else a newer write replaced it
                    self._stage(k, pending)
                self._written.pop(entry.object, None)
            raise

    async def _start_flush(self) -> tuple[asyncio.Future[None], builtins.list[tuple[str, Pending, RefEntry]]] | None:
        """:meth:`_flush` up to the upload, which is returned in flight with the
        (key, pending value, entry) staged in its place (None: nothing to pack)."""
        items = [
            (k, s) for k, s in self.writes.items() if isinstance(s, Pending) and id(s) not in self._packing
        ]
        if not items:
            return None
        for _, s in items:  # concurrent flushes take disjoint items
            self._packing.add(id(s))
            self._pending_bytes -= len(s.value)
        started = lease_clock()
        try:
            entries, upload = await start_pack(self.root, [s for _, s in items])
        finally:
            for _, s in items:
                self._packing.discard(id(s))
        swapped: builtins.list[tuple[str, Pending, RefEntry]] = []
        for (k, s), e in zip(items, entries, strict=True):
            self._written.setdefault(e.object, started)
            if self.writes.get(k) is s:  # else a newer write replaced it: garbage
                self.writes[k] = e
                swapped.append((k, s, e))
        return upload, swapped

    async def list(self, prefix: str) -> list[str]:
        if self.reads is not None:
            self.reads.prefixes.add(prefix)
        await self.pin()
        try:
            keys = {k for k, _ in await self.root.scan(self._base_root, prefix)}
        except DataCorruptionError as e:
            expired = await self.root.snapshot_expired(self.base_version, e)
            if expired is not None:
                raise expired from e
            raise
        for k, s in self.writes.items():
            if k.startswith(prefix):
                if s is None:
                    keys.discard(k)
                else:
                    keys.add(k)
        return sorted(keys)

    async def finalize(self) -> builtins.list[Change]:
        """Pack pending values; the sorted changes of this transaction."""
        await self._flush()
        out: builtins.list[Change] = []
        for k in sorted(self.writes):
            s = self.writes[k]
            assert not isinstance(s, Pending)
            out.append((k, s))
        return out

    async def commit(self, txn: TransactionHandle, *, wait: bool) -> CommitInfo:
        probe: asyncio.Future[int] | None = None
        upload: asyncio.Future[None] | None = None
        try:
            # the newest version is looked up while pending values upload
            probe = self.root.start_probe()
            # the last pending values upload while the probe runs and the first
            # attempt's nodes are written; they have landed before the record
            flushed = await self._start_flush()
            upload = flushed[0] if flushed is not None else None
            changes = await self.finalize()
            # pinned at the first read or write: the probe is awaited here only by
            # a transaction that did neither, so the commit's first attempt can
            # write its nodes while the probe is in flight
            base = await self.pin(probe)

            async def check() -> None:
                await uploaded(upload)
                await self.check_written(changes)

            try:
                rec = await commit_changes(self.root, changes, base, txn, reads=self.checked_reads(),
                                           before_publish=check, probe=probe,
                                           pinned=[r for r in [self.pinned_record] if r is not None])
            except UploadFailed as e:
                raise e.error from None
            probe = None
        finally:
            if probe is not None:
                probe.cancel()
            if upload is not None:
                upload.cancel()  # landed by now unless the commit failed
            self._release()
        return CommitInfo(
            version=rec.version, write_id=rec.write_id, time=rec.time, txn_id=txn.txn_id,
            keys_changed=len(changes),
        )

    async def check_written(self, changes: builtins.list[Change]) -> None:
        """Refuse the commit when a data object this transaction wrote and still
        references is gone (a collector that did not see our lease took it):
        DataCorruptionError, nothing visible. Such an object is checked,
        whatever its age (a collector with a short grace may take a young one),
        unless this process's lease vouches for it (written under a lease that
        has said ``writing`` without a lapse since, on a store stamped by one
        clock: ``LeaseKeeper.vouches``, docs/FORMAT.md §9.3); objects the base
        version already references are not (collectors mark them). Cost: one
        1-byte read per data object the commit adds that the lease does not
        vouch for; none on gcs and s3 while the lease holds."""
        written = self._written
        mine = {e.object: written[e.object] for _, e in changes if isinstance(e, RefEntry) and e.object in written}
        await require_present(self.root.base, self.root.leases.unvouched(mine), self.name, "this transaction wrote")

    def abort(self) -> None:
        self.writes.clear()
        self.links.clear()
        self._pending_bytes = 0
        self._release()


async def commit_changes(
    root: VersionedRoot, changes: list[Change], base: int, txn: TransactionHandle, *,
    reads: ReadSet | None = None, nonce: str | None = None, txn_from: int | None = None,
    before_publish: Callable[[], Awaitable[None]] | None = None,
    probe: asyncio.Future[int] | None = None,
    pinned: builtins.list[tuple[int, str]] | None = None,
) -> CommitRecord:
    """Commit ``changes`` read from version ``base``: rebase, or ConflictError.

    ``pinned``: (version, write-id) of each record the transaction (its parts)
    read from; each attempt checks that the store still holds them (:func:`check_same_history`),
    so a transaction that read a store deleted and recreated meanwhile never
    commits on the new history. ``reads`` (serializable) are checked like the written keys. A multi-writer
    commit passes its attempt's ``nonce`` (stored in the record) and
    ``txn_from``: a version above it that carries ``txn.txn_id`` raises
    AlreadyCommitted instead of committing the transaction twice.
    """
    ours = {k for k, _ in changes}
    # every version <= checked is validated; only an attempt that reaches its
    # record moves it (a speculative attempt may be dropped: root.commit)
    checked = base
    checked_txn = txn_from

    async def plan(parent: CommitRecord | None) -> Plan:
        n = parent.version if parent else 0
        for version, write_id in sorted(set(pinned or ())):
            await check_same_history(root, version, write_id)
        lo, lo_txn = checked, checked_txn
        if n > lo or (lo_txn is not None and n > lo_txn):
            await validate(root, lo, n, writes=ours, reads=reads, txn_id=txn.txn_id, txn_from=lo_txn)

        async def publishing() -> None:
            nonlocal checked, checked_txn
            checked = max(lo, n)
            checked_txn = None if lo_txn is None else max(lo_txn, n)
            if before_publish is not None:
                await before_publish()

        return Plan(
            changes, kind="data", message=txn.message, metadata=txn.metadata,
            txn_id=txn.txn_id, txn_nonce=nonce, write_id=txn.write_id, before_publish=publishing,
        )

    rec = await root.commit(plan, probe=probe)
    assert rec is not None
    return rec
