"""Values: where they are stored (inline, packed, alone) and reading them back.

* values of at most :data:`INLINE_MAX` bytes live inside the index leaf;
* values of at least :data:`LARGE_MIN` bytes are written alone, immediately
  (a transaction never holds a large value in memory until its commit);
* everything in between is staged in memory and packed many to one data
  object at commit, or when the staging buffer passes :data:`STAGING_MAX`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from tensorstore_py.core.errors import ChecksumError, DataCorruptionError, StorageError
from tensorstore_py.core.pools import run_cpu, run_io
from tensorstore_py.kvstore.base import BlockingRead, Buffer, ByteRange, Generation, KvStore, ReadResult
from tensorstore_py.kvstore.versioned.create import create_fresh_blocking, create_object
from tensorstore_py.kvstore.versioned.format import (
    Entry,
    InlineEntry,
    RefEntry,
    crc32c,
    new_name,
    new_stamp,
)
from tensorstore_py.kvstore.versioned.root import VersionedRoot, missing_object

__all__ = [
    "INLINE_MAX", "LARGE_MIN", "STAGING_MAX", "Pending", "Staged",
    "UploadFailed", "blocking_reader", "make_entry", "missing_objects", "pack", "read_entry",
    "start_entry", "start_pack", "uploaded",
]

INLINE_MAX = 128
LARGE_MIN = 256 * 1024
STAGING_MAX = 16 * 1024 * 1024
#: a packed data object is cut at this size
PACK_MAX = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True, eq=False)
class Pending:
    """A small value waiting in memory to be packed into a data object."""

    stamp: bytes
    value: bytes


#: what a transaction holds for a written key: an entry, a pending value, or None (deleted)
Staged = Entry | Pending | None


def _crc_of(value: Any) -> int:
    return crc32c(value)


async def make_entry(root: VersionedRoot, value: Buffer) -> Entry | Pending:
    """Inline, pending, or (for a large value) written now to its own object."""
    n = len(memoryview(value).cast("B")) if not isinstance(value, bytes) else len(value)
    stamp = new_stamp()
    if n <= INLINE_MAX:
        return InlineEntry(stamp, bytes(value))
    if n < LARGE_MIN:
        return Pending(stamp, bytes(value))
    # large values: checksum off the loop (crc32c releases the GIL), then write alone
    base = root.base
    if not base.blocking_io:
        entry, upload = await start_entry(root, value)
        await upload
        return entry
    name = new_name("data")
    # checksum and create in ONE pool call (one thread hop, warm caches)
    try:
        crc = await run_io(_crc_and_create, base, name, value)
    except OSError:  # transient: the async create retries (create-only, so idempotent)
        crc = await run_cpu(_crc_of, value)
        await create_object(base, name, value, exists="ours")
    return RefEntry(stamp, name, 0, n, crc)


async def start_entry(root: VersionedRoot, value: Buffer) -> tuple[RefEntry, asyncio.Future[None]]:
    """A large value's entry once its checksum is known, with the upload of its
    data object still in flight (the future: cancel it if it is not awaited).
    A caller that plans a commit meanwhile awaits the upload before the record."""
    n = len(memoryview(value).cast("B")) if not isinstance(value, bytes) else len(value)
    stamp, name = new_stamp(), new_name("data")
    crc = await run_cpu(_crc_of, value)

    async def create() -> None:
        await create_object(root.base, name, value, exists="ours")

    upload = asyncio.ensure_future(create())
    upload.add_done_callback(lambda f: f.cancelled() or f.exception())  # raised to whoever awaits it
    return RefEntry(stamp, name, 0, n, crc), upload


def _crc_and_create(base: KvStore, name: str, value: Buffer) -> int:
    """crc32c of ``value``, then create the fresh data object ``name`` holding it (blocking)."""
    crc = crc32c(value)
    create_fresh_blocking(base, name, value)
    return crc


async def pack(root: VersionedRoot, items: list[Pending]) -> list[RefEntry]:
    """Write ``items`` packed into as few data objects as possible; their entries."""
    entries, upload = await start_pack(root, items)
    await upload
    return entries


async def start_pack(root: VersionedRoot, items: list[Pending]) -> tuple[list[RefEntry], asyncio.Future[None]]:
    """Pack ``items`` as :func:`pack` does, returning their entries once the
    objects' names and checksums are known, with the upload still in flight
    (the future: cancel it if it is not awaited). A caller that plans a commit
    meanwhile must await the upload before the commit record."""
    # checksums and the concatenation (up to PACK_MAX bytes) run on the CPU pool:
    # crc32c releases the GIL, and the loop stays free for other requests
    values = [p.value for p in items]
    if sum(len(v) for v in values) < LARGE_MIN:
        groups, crcs, objects = _pack_objects(values)  # cheaper than a thread hop
    else:
        groups, crcs, objects = await run_cpu(_pack_objects, values)
    out: list[RefEntry] = []
    it = iter(crcs)
    for (name, _data), group in zip(objects, groups):
        offset = 0
        for i in group:
            n = len(items[i].value)
            out.append(RefEntry(items[i].stamp, name, offset, n, next(it)))
            offset += n
    upload = asyncio.ensure_future(root.write_all(objects))
    upload.add_done_callback(lambda f: f.cancelled() or f.exception())  # raised to whoever awaits it
    return out, upload


class UploadFailed(Exception):
    """A started upload (:func:`start_pack`, :func:`start_entry`) failed, seen
    from a commit's ``before_publish``: not an OSError, so that the commit
    engine does not retry an attempt around an upload that will not land; the
    caller raises ``error`` itself. ``owner``: whose upload it was (as given)."""

    def __init__(self, error: BaseException, owner: Any = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.owner = owner


async def uploaded(upload: asyncio.Future[None] | None, owner: Any = None) -> None:
    """Wait for an upload of :func:`start_pack` or :func:`start_entry`;
    UploadFailed (naming ``owner``) if it failed, or if it was cancelled (its
    writer gave up: a group commit drops that one write, the rest of its batch
    commits). A cancellation of the waiting task itself propagates."""
    if upload is None:
        return
    try:
        await asyncio.shield(upload)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if upload.cancelled() and (task is None or not task.cancelling()):
            raise UploadFailed(StorageError(
                "the upload of a value's data object was cancelled before it landed (its writer "
                "was cancelled); nothing references it"), owner) from None
        raise
    except Exception as e:
        raise UploadFailed(e, owner) from e


def _pack_objects(values: list[bytes]) -> tuple[list[list[int]], list[int], list[tuple[str, bytes]]]:
    """Group ``values`` into objects of at most PACK_MAX bytes (at least one value
    each): (indices per object, crc32c per value, (name, bytes) per object)."""
    groups: list[list[int]] = []
    objects: list[tuple[str, bytes]] = []
    crcs = [crc32c(v) for v in values]
    i = 0
    while i < len(values):
        group: list[int] = []
        size = 0
        while i < len(values) and (not group or size + len(values[i]) <= PACK_MAX):
            group.append(i)
            size += len(values[i])
            i += 1
        groups.append(group)
        objects.append((new_name("data"), b"".join(values[j] for j in group)))
    return groups, crcs, objects


async def missing_objects(base: KvStore, names: list[str]) -> list[str]:
    """Those of the data objects ``names`` that do not exist (one 1-byte read each)."""
    sem = asyncio.Semaphore(64)

    async def gone(name: str) -> bool:
        async with sem:
            return (await base.read(name, byte_range=ByteRange(0, 1))).state != "value"

    flags = await asyncio.gather(*(gone(n) for n in names))
    return [n for n, f in zip(names, flags) if f]


async def require_present(base: KvStore, names: list[str], txn: str, whose: str) -> None:
    """Raise DataCorruptionError (nothing committed) if any data object of
    ``names`` (written by ``whose``) is gone: the pre-commit check that garbage
    collection did not delete what the commit is about to reference."""
    gone = await missing_objects(base, names) if names else []
    if gone:
        raise DataCorruptionError(
            f"{txn}: {len(gone)} data object(s) {whose} are gone (e.g. {gone[0]!r}; deleted by "
            f"garbage collection while the transaction was open?); nothing was committed: "
            f"retry the transaction"
        )


def staged_generation(staged: Staged) -> Generation:
    return Generation.NO_VALUE if staged is None else Generation(staged.stamp)


def _checked(root: VersionedRoot, key: str, entry: RefEntry, res: ReadResult, start: int, stop: int,
             whole: bool, crc: int | None) -> ReadResult:
    """``res`` (bytes [start, stop) of ``entry``'s value) checked for presence,
    length and, for a whole value, crc32c (``crc``: precomputed, or None)."""
    if res.state != "value":
        raise missing_object(
            entry.object, f"versioned store {root.base!r}: key {key!r}: data object {entry.object!r} is missing"
        )
    value = res.value
    if len(value) != stop - start:
        raise DataCorruptionError(
            f"versioned store {root.base!r}: key {key!r}: data object {entry.object!r} is truncated "
            f"(expected {stop - start} bytes at offset {entry.offset + start}, got {len(value)})"
        )
    if whole:
        if crc is None:
            crc = crc32c(value)
        if crc != entry.crc:
            raise ChecksumError(
                f"versioned store {root.base!r}: key {key!r}: crc32c mismatch in data object "
                f"{entry.object!r} at offset {entry.offset} (stored {entry.crc:#010x}, computed {crc:#010x})"
            )
    return ReadResult("value", value, Generation(entry.stamp))


def blocking_reader(root: VersionedRoot, key: str, entry: Staged) -> BlockingRead | None:
    """A blocking whole-value read of ``entry`` (data I/O and crc32c check, for
    a pool thread), or None when the base store has no blocking I/O."""
    if entry is None:
        return ReadResult.missing
    if isinstance(entry, (InlineEntry, Pending)):
        res = ReadResult("value", entry.value, Generation(entry.stamp))
        return lambda: res
    base = root.base
    if not base.blocking_io:
        return None
    if entry.length == 0:
        empty = ReadResult("value", b"", Generation(entry.stamp))
        return lambda: empty
    full = base._full(entry.object)
    rng = ByteRange(entry.offset, entry.offset + entry.length)

    def run() -> ReadResult:
        return _checked(root, key, entry, base._read_blocking(full, rng, None), 0, entry.length, True, None)

    return run


async def read_entry(
    root: VersionedRoot,
    key: str,
    entry: Staged,
    byte_range: ByteRange | None,
    if_not_equal: Generation | None,
) -> ReadResult:
    """Read the value an entry points to, checking its crc32c when read whole."""
    if entry is None:
        return ReadResult.missing()
    gen = Generation(entry.stamp)
    if if_not_equal is not None and if_not_equal == gen:
        return ReadResult("unchanged", b"", gen)
    if isinstance(entry, (InlineEntry, Pending)):
        value = entry.value
        return ReadResult("value", value if byte_range is None else bytes(byte_range.apply(value)), gen)
    if byte_range is None:
        start, stop = 0, entry.length
        if stop >= LARGE_MIN and root.base.blocking_io:
            # read and checksum in one pool call: one thread hop, warm caches
            reader = blocking_reader(root, key, entry)
            assert reader is not None
            return await run_io(reader)
    else:
        start, stop = byte_range.clip(entry.length)
    if stop == start:
        return ReadResult("value", b"", gen)
    res = await root.base.read(entry.object, byte_range=ByteRange(entry.offset + start, entry.offset + stop))
    crc = None
    if byte_range is None and res.state == "value" and len(res.value) == stop - start >= LARGE_MIN:
        crc = await run_cpu(_crc_of, res.value)  # off the loop: crc32c releases the GIL
    return _checked(root, key, entry, res, start, stop, byte_range is None, crc)
