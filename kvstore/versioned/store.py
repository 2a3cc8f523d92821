"""The ``versioned`` kvstore: multi-version, transactional, over any base store.

::

    kv = tsp.KvStore.open({"driver": "versioned", "base": "file:///run/", "path": "params/"}).result()
    kv.write("a", b"1").result()                 # one commit (batched with concurrent writes)
    kv.versions().result()                       # [VersionInfo(version=1, ...)]
    snap = tsp.KvStore.open("versioned+file:///run/@1").result()   # read-only snapshot

Guarantees:

* Every write, delete or ``delete_range`` outside a transaction is committed
  atomically as (part of) a new version before its Future resolves; writes
  issued concurrently are grouped into few commits (group commit). A write
  with ``if_equal`` is checked against the newest version at commit; a failed
  condition fails only that write.
* A commit whose commit record can not be written, nor read back, through
  every retry raises :class:`~tensorstore_py.errors.CommitOutcomeUnknownError`
  (never a plain StorageError or ConditionFailedError): it may have landed.
  :meth:`VersionedKvStore.find_write_id` tells whether it did, once the store
  answers.
* Reads outside a transaction see the newest version committed before the read
  started (found by probing commit records, never by listing data).
* Snapshots (``version`` / ``tag`` in the spec, ``@N`` / ``@tag`` in the URL)
  are immutable and read-only (:class:`~tensorstore_py.errors.ReadOnlyError`).
* Everything a commit references is durable on the base store before its
  commit record is created (docs/FORMAT.md).
* Every value carries a crc32c, checked when a whole value is read
  (:class:`~tensorstore_py.errors.ChecksumError` names the key and the object).
* A store pickles as its base store, path and pin: a snapshot reopens at the
  same version (a tag resolved here travels as its version), a live store reads
  the newest version in the receiving process. Unpickling does no I/O.

Keys live under the store's ``path`` inside one shared version history, so
views with different paths over one base commit into the same versions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from tensorstore_py.core.errors import (
    DataCorruptionError,
    InvalidArgumentError,
    InvalidSpecError,
    NotFoundError,
)
from tensorstore_py.core.future import Future, in_loop_thread, run_sync, spawn
from tensorstore_py.kvstore.base import (
    BlockingRead,
    Buffer,
    ByteRange,
    Generation,
    KvStore,
    ReadResult,
    TransactionLike,
    rebuild,
)
from tensorstore_py.kvstore.registry import open_kvstore, register_kvstore, require_conditional_writes
from tensorstore_py.kvstore.transaction import Transaction
from tensorstore_py.kvstore.versioned.data import (
    INLINE_MAX,
    LARGE_MIN,
    blocking_reader,
    make_entry,
    read_entry,
    start_entry,
)
from tensorstore_py.kvstore.versioned.format import (
    FORMAT,
    CommitRecord,
    ranges_contain,
)
from tensorstore_py.kvstore.versioned.groupcommit import submit
from tensorstore_py.kvstore.versioned.history import VersionHistory, VersionInfo, check_tag
from tensorstore_py.kvstore.versioned.info import (
    CommitDetails,
    EntryInfo,
    Span,
    details,
    entry_info,
    read_formats,
    read_spans,
)
from tensorstore_py.kvstore.versioned.leases import Hold, lease_clock
from tensorstore_py.kvstore.versioned.multiwriter import MultiWriterParticipant
from tensorstore_py.kvstore.versioned.replicate import copy_store
from tensorstore_py.kvstore.versioned.root import VersionedRoot, get_root, is_missing
from tensorstore_py.kvstore.versioned.txn import VersionedParticipant

__all__ = ["CommitDetails", "EntryInfo", "VersionInfo", "VersionedKvStore"]

T = TypeVar("T")

class VersionedKvStore(VersionHistory):
    """A versioned, transactional view of ``base`` (see the module docstring)."""

    driver = "versioned"
    # a write cancelled after the commit record carrying it was sent may land
    cancel_reports_outcome = True
    #: the on-storage format this code reads and writes (docs/FORMAT.md)
    FORMAT: int = FORMAT

    def __init__(
        self, base: KvStore, *, path: str = "", version: int | None = None, tag: str | None = None
    ) -> None:
        if not isinstance(base, KvStore):
            raise InvalidSpecError(f"versioned kvstore: base must be a KvStore, got {type(base).__name__}")
        if isinstance(base, VersionedKvStore):
            raise InvalidSpecError("versioned kvstore: the base store must not itself be versioned")
        if version is not None and (not isinstance(version, int) or version < 1):
            raise InvalidSpecError(f"versioned kvstore: version must be an int >= 1, got {version!r}")
        if tag is not None:
            check_tag(tag)
        super().__init__(path=path)
        self.base = base
        self.version = version
        self.tag_name = tag
        self.read_only = version is not None or tag is not None
        self._root: VersionedRoot = get_root(base)
        # a pinned version is checked (exists, not deleted) once, on first use,
        # and leased from then on (shared by the with_path views made after it)
        self._checked = False
        self._hold: Hold | None = None
        # unpickled from a snapshot that the sending process had checked and
        # leased: its version may be deleted meanwhile; that lease keeps its objects
        self._leased_elsewhere = False

    # -- spec / URL ------------------------------------------------------------------
    @classmethod
    async def from_spec(cls, spec: dict[str, Any]) -> VersionedKvStore:
        unknown = set(spec) - {"driver", "base", "path", "version", "tag"}
        if unknown:
            raise InvalidSpecError(f"versioned kvstore spec: unknown fields {sorted(unknown)}")
        if "base" not in spec:
            raise InvalidSpecError("versioned kvstore spec: 'base' (a spec or URL of the base store) is required")
        if spec.get("version") is not None and spec.get("tag") is not None:
            raise InvalidSpecError("versioned kvstore spec: give 'version' or 'tag', not both")
        path = spec.get("path", "")
        if not isinstance(path, str):
            raise InvalidSpecError(f"versioned kvstore spec: path must be a string, got {path!r}")
        base = await open_kvstore(spec["base"])
        store = cls(base, version=spec.get("version"), tag=spec.get("tag"))
        if path:
            store = store.with_path(path)  # type: ignore[assignment]
        await store._resolve_snapshot()
        return store

    async def _resolve_snapshot(self) -> None:
        """Check a snapshot version exists; resolve a tag to its version."""
        if self.tag_name is not None:
            n = await self._root.newest()
            rec = await self._root.record_at(n)
            tags = rec.tags if rec else {}
            if self.tag_name not in tags:
                raise NotFoundError(
                    f"versioned store over {self.base!r}: no tag {self.tag_name!r} "
                    f"(tags: {sorted(tags) or 'none'})"
                )
            self.version = tags[self.tag_name]
        if self.version is not None:
            if self._hold is None:
                # the lease first, then the check: a collector reads the retention
                # state before the leases, so either it sees our lease or we see
                # the version deleted (docs/FORMAT.md §9.3)
                self._hold = await self._root.leases.pin(self.version)
            try:
                await self._check_version(self.version)
            except NotFoundError:
                self.close()
                raise
        self._checked = True

    def close(self) -> None:
        """Release a snapshot's reader lease now (else: when the last view of it
        is garbage-collected). Reads still work while the version's objects
        exist; once it is deleted and reclaimed they raise SnapshotExpiredError."""
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.release()

    async def _check_version(self, version: int) -> None:
        rec = await self._root.read_record(version)
        if rec is None:
            raise NotFoundError(f"versioned store over {self.base!r}: version {version} does not exist")
        if self._leased_elsewhere:
            return  # read while the sender's lease holds; SnapshotExpiredError once reclaimed
        newest = await self._root.record_at(await self._root.newest())
        if newest is not None and ranges_contain(newest.deleted, version):
            raise NotFoundError(f"versioned store over {self.base!r}: version {version} was deleted")

    @classmethod
    def spec_from_url(cls, url: str) -> dict[str, Any]:
        """``versioned+<base URL>[@<version>|@<tag>]`` (the suffix right after the last '/')."""
        if not url.startswith("versioned+"):
            raise InvalidSpecError(f"versioned URL {url!r} must start with 'versioned+'")
        rest = url[len("versioned+"):]
        spec: dict[str, Any] = {"driver": "versioned"}
        head, sep, sel = rest.rpartition("/@")
        if sep and "/" not in sel and sel:
            rest = head + "/"
            if sel.isdigit():
                spec["version"] = int(sel)
            else:
                spec["tag"] = check_tag(sel)
        spec["base"] = rest
        return spec

    def _spec_fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {"base": self.base.spec()}
        if self.tag_name is not None:
            d["tag"] = self.tag_name
        elif self.version is not None:
            d["version"] = self.version
        return d

    def url(self) -> str:
        if self.path:
            raise InvalidArgumentError(f"{self!r}: a versioned store with a path has no URL form; use spec()")
        u = "versioned+" + self.base.url()
        if not u.endswith("/"):
            u += "/"
        if self.tag_name is not None:
            u += "@" + self.tag_name
        elif self.version is not None:
            u += f"@{self.version}"
        return u

    def _identity(self) -> Any:
        return (self.base._identity(), self.path, self.version)

    def __reduce__(self) -> tuple[Any, ...]:
        # the base travels as an object (its own pickling rules apply); a resolved
        # tag travels as its version, so the receiver reads the same snapshot
        if self.version is not None and (self.tag_name is None or self._checked):
            pin: dict[str, Any] = {"version": self.version}
        else:
            pin = {"tag": self.tag_name} if self.tag_name is not None else {}
        if self.version is not None and (self._hold is not None or self._leased_elsewhere):
            # checked and leased here (or by the process that sent it here): the
            # receiver reads the version even once it is deleted, while that lease holds
            return (_rebuild_leased, (self.base, self.path, self.version))
        return (rebuild, (VersionedKvStore, (self.base,), {"path": self.path, **pin}))

    def snapshot(self, version: int | str) -> VersionedKvStore:
        """A read-only view of ``version`` (an int, or a tag name resolved on first use).

        The version is checked on the snapshot's first use: every operation on a
        snapshot of a version that does not exist or was deleted raises
        :class:`~tensorstore_py.errors.NotFoundError`, even while its data has not
        been garbage-collected yet (as ``KvStore.open`` of ``...@N`` does).
        From its first use until :meth:`close` (or garbage collection of its
        last view) the snapshot holds a reader lease: if the version is deleted
        meanwhile, garbage collection keeps its objects, so reads keep working.
        """
        if isinstance(version, str):
            out = VersionedKvStore(self.base, path=self.path, tag=version)
        else:
            out = VersionedKvStore(self.base, path=self.path, version=version)
        return out

    def open_snapshot(self, version: int | str) -> Future[VersionedKvStore]:
        """:meth:`snapshot`, checked and leased now: NotFoundError if ``version``
        does not exist or was deleted (a tag is resolved now)."""
        snap = self.snapshot(version)

        async def run() -> VersionedKvStore:
            await snap._resolve_snapshot()
            return snap

        return spawn(run())

    # -- reads -------------------------------------------------------------------------
    async def _record(self) -> CommitRecord | None:
        if not self._checked and (self.tag_name is not None or self.version is not None):
            await self._resolve_snapshot()
        v = self.version if self.version is not None else await self._root.newest()
        return await self._root.record_at(v)

    async def _at(self, version: int | None, op: Callable[[CommitRecord | None], Awaitable[T]]) -> T:
        """``op(record)`` at ``version`` (None: this view's snapshot, or the newest).

        When ``op`` meets a missing object of a version that was deleted and
        reclaimed meanwhile: a pinned version raises SnapshotExpiredError, a
        read of the newest version starts again at the (new) newest version.
        """
        for attempt in range(3):
            rec = await self._tree_at(version)
            try:
                return await op(rec)
            except DataCorruptionError as e:
                expired = await self._root.snapshot_expired(rec.version if rec else None, e)
                if expired is None:
                    raise
                if version is not None or self.version is not None or attempt == 2:
                    raise expired from e
        raise AssertionError("unreachable")

    async def _read(self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None) -> ReadResult:
        async def op(rec: CommitRecord | None) -> ReadResult:
            entry = await self._root.lookup(rec.root if rec else None, key)
            return await read_entry(self._root, key, entry, byte_range, if_not_equal)

        return await self._at(None, op)

    async def _prepare_read(self, key: str) -> BlockingRead | None:
        # resolve the newest version and the key's entry now (on the loop);
        # data objects are immutable, so the I/O may run a moment later
        if not self.base.blocking_io:
            return None  # nothing to gain: the data I/O is async anyway

        async def op(rec: CommitRecord | None) -> Any:
            return await self._root.lookup(rec.root if rec else None, key)

        reader = blocking_reader(self._root, key, await self._at(None, op))
        if reader is None:
            return None

        def run() -> ReadResult:
            try:
                return reader()
            except DataCorruptionError as e:
                if not is_missing(e) or in_loop_thread():
                    raise
                # reclaimed since it was prepared: the async path tells why (or retries)
                return run_sync(self._read(key, None, None))

        return run

    async def _list(self, prefix: str) -> list[str]:
        async def op(rec: CommitRecord | None) -> list[str]:
            return [k for k, _ in await self._root.scan(rec.root if rec else None, prefix)]

        return await self._at(None, op)

    # -- writes (group commit) -------------------------------------------------------------
    def _require_commits(self, what: str) -> None:
        """A commit needs create-only writes of the base store: refuse, before any
        data object is written, a base that can not do them (a generic fsspec
        filesystem); reading such a store stays possible."""
        require_conditional_writes(self.base, f"versioned store {what}")

    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        self._require_commits(f"write of {key!r}")
        if len(memoryview(value).cast("B")) <= INLINE_MAX:
            entry = await make_entry(self._root, value)  # writes nothing before the commit
            await self._submit("put", key, entry, if_equal)
        else:  # a writer lease keeps the data object until the commit references it
            async with self._root.leases.writing():
                # a large value is uploaded now: look the newest version up meanwhile
                large = len(memoryview(value).cast("B")) >= LARGE_MIN
                probe = self._root.start_probe() if large else None
                started = lease_clock()
                if large and not self.base.blocking_io:
                    # the commit's nodes are written while the value uploads
                    entry, upload = await start_entry(self._root, value)
                    try:
                        await submit(self._root, "put", key, entry, if_equal, probe=probe, started=started,
                                     upload=upload)
                    finally:
                        upload.cancel()  # landed by now unless the commit failed
                else:
                    entry = await make_entry(self._root, value)  # on failure the probe just ends
                    await submit(self._root, "put", key, entry, if_equal, probe=probe, started=started)
        return Generation(entry.stamp)

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        self._require_commits(f"delete of {key!r}")
        await self._submit("delete", key, None, if_equal)

    async def _delete_range(self, prefix: str) -> None:
        self._require_commits(f"delete_range of {prefix!r}")
        await self._submit("delete_prefix", prefix, None, None)

    async def _submit(self, kind: str, key: str, value: Any, if_equal: Generation | None) -> Any:
        return await submit(self._root, kind, key, value, if_equal)

    def _transaction_participant(self, txn: TransactionLike) -> VersionedParticipant:
        if not isinstance(txn, Transaction):  # Transaction.bind, the caller, passes itself
            raise InvalidArgumentError(f"{self!r}: a transaction is a tensorstore_py.Transaction, "
                                       f"got {type(txn).__name__}")
        if self.tag_name is not None and self.version is None:
            raise InvalidArgumentError(
                f"{self!r}: open a tag snapshot with KvStore.open (which resolves the tag) "
                f"before using it in a transaction"
            )
        if not self.read_only:
            self._require_commits("transaction")
        cls = MultiWriterParticipant if txn.multi_writer else VersionedParticipant
        return cls(self._root, self.version, txn)

    # -- index reads (public, read-only) ---------------------------------------------------
    async def _tree_at(self, version: int | None) -> CommitRecord | None:
        if version is None:
            return await self._record()
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidArgumentError(f"{self!r}: version must be an int >= 0, got {version!r}")
        if version == 0:
            return None  # the empty state before the first commit
        await self._check_version(version)
        return await self._root.record_at(version)

    def entries(self, prefix: str = "", *, version: int | None = None) -> Future[list[EntryInfo]]:
        """The index entry of every key under ``prefix``, sorted by key, from the index alone.

        Keys are relative to this store's path. ``version`` (default: this
        snapshot's, or the newest; 0 is the empty state) must exist and not be deleted
        (:class:`~tensorstore_py.errors.NotFoundError`). No value is read.
        """

        async def op(rec: CommitRecord | None) -> list[EntryInfo]:
            n = len(self.path)
            found = await self._root.scan(rec.root if rec else None, self.path + prefix)
            return [entry_info(k[n:], e) for k, e in found]

        return spawn(self._at(version, op))

    def stat(self, keys: Sequence[str], *, version: int | None = None) -> Future[list[EntryInfo | None]]:
        """The index entry of each of ``keys`` (None where absent), in order; no value is read."""
        return spawn(self._at(version, lambda rec: self._stat_in(rec, keys)))

    def stat_with_version(self, keys: Sequence[str]) -> Future[tuple[int, list[EntryInfo | None]]]:
        """``(version, entries)``: :meth:`stat` of ``keys`` at this view's snapshot
        or the newest version, and which version that was (0: the empty state),
        from one look-up of the newest version. A writer that checked keys this
        way can make its transaction read that version
        (:func:`~tensorstore_py.kvstore.versioned.staging.read_from`) instead of
        looking the newest up again."""

        async def op(rec: CommitRecord | None) -> tuple[int, list[EntryInfo | None]]:
            return (rec.version if rec else 0), await self._stat_in(rec, keys)

        return spawn(self._at(None, op))

    async def _stat_in(self, rec: CommitRecord | None, keys: Sequence[str]) -> list[EntryInfo | None]:
        tree = rec.root if rec else None
        found = await asyncio.gather(*(self._root.lookup(tree, self.path + k) for k in keys))
        return [None if e is None else entry_info(k, e) for k, e in zip(keys, found, strict=True)]

    def commit_details(self, version: int) -> Future[CommitDetails]:
        """The commit record of ``version``, deleted or not (NotFoundError if it never existed)."""

        async def run() -> CommitDetails:
            rec = await self._root.read_record(version) if version >= 1 else None
            if rec is None:
                raise NotFoundError(f"versioned store over {self.base!r}: version {version} does not exist")
            newest = await self._root.record_at(await self._root.newest())
            return details(rec, deleted=newest is not None and ranges_contain(newest.deleted, version))

        return spawn(run())

    def changed_keys(self, version: int) -> Future[list[str]]:
        """The keys (under this store's path, relative to it) that commit ``version`` wrote or deleted.

        May read one extra object; raises DataCorruptionError if that object
        of a deleted version was already collected.
        """

        async def run() -> list[str]:
            rec = await self._root.record_at(version)
            if rec is None:
                return []
            n = len(self.path)
            return [k[n:] for k in await self._root.changed_keys(rec) if k.startswith(self.path)]

        return spawn(run())

    def copy_to(self, dst: KvStore, *, on_bytes: Callable[[int], None] | None = None) -> Future[None]:
        """Copy this store's whole history (every retained version) to the empty store ``dst``.

        The objects are copied byte for byte and checked on the way (see
        :mod:`~tensorstore_py.kvstore.versioned.replicate`); ``on_bytes`` is called
        with the size of each object copied. Opening ``dst`` as a versioned store
        afterwards gives the same versions, tags and values. A writer of ``dst``
        like any commit: it holds a writer lease on ``dst`` while it copies (a
        collector running there keeps what it copied), and right before its
        first commit record it checks that every object it copied is still there
        (DataCorruptionError, no version written, if one is gone; docs/FORMAT.md
        §9.3). Not atomic: the records land one by one, oldest first; running
        the copy again resumes an interrupted one.
        """
        return spawn(copy_store(self.base, dst, on_bytes or (lambda _n: None)))

    def stored_formats(self) -> Future[dict[str, int]]:
        """Commit record name -> its ``format`` number, for the first and the newest record.

        Reads only record envelopes, so a store written by a newer format than
        :attr:`FORMAT` can be recognised (and refused with a clear message)
        before anything decodes it. Damaged or missing records are skipped.
        """
        return spawn(read_formats(self.base))

    def read_spans(
        self, spans: Sequence[Span], *, coalesce_gap: int = 4096, into: Sequence[memoryview | None] | None = None,
    ) -> Future[list[Any]]:
        """The bytes ``[start, stop)`` of each ``(key, start, stop)`` span, in order.

        Reads as an independent reader of docs/FORMAT.md §6.4 would: every key is
        looked up in the (cached) index of this snapshot's version (default: the
        newest, resolved once for all spans, so the result is consistent), and
        the spans inside one data object are fetched with one coalesced
        ``read_ranges`` of the base store, so many small values packed into few
        objects cost few requests. A span covering a whole value is checked
        against the value's crc32c (ChecksumError). A missing key raises
        NotFoundError; a missing or truncated data object DataCorruptionError.
        Not retried beyond what the base store retries.

        ``into``: per span a writable byte buffer of its size (or None) that
        receives its bytes and is returned as its result; the file store reads
        straight into it (no buffer of its own), other stores' bytes are copied.
        """

        async def op(rec: CommitRecord | None) -> list[Any]:
            return await read_spans(self._root, rec.root if rec else None, self.path, spans,
                                    where=repr(self), coalesce_gap=coalesce_gap, into=into)

        return spawn(self._at(None, op))

register_kvstore(VersionedKvStore, adapter=True)


def _rebuild_leased(base: KvStore, path: str, version: int) -> VersionedKvStore:
    """Unpickle a snapshot that its sender had checked and leased (see ``__reduce__``):
    it reads ``version`` whether or not it was deleted since, as long as its
    objects exist (the sender's lease keeps them), and raises
    SnapshotExpiredError once garbage collection reclaimed them."""
    store = VersionedKvStore(base, path=path, version=version)
    store._leased_elsewhere = True
    return store
