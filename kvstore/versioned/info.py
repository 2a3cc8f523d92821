"""Public value types and index reads of the versioned kvstore.

What tools (the CLI, checkpoint restore) need to know about stored values
without decoding the on-storage format themselves: per-key index entries
(:class:`EntryInfo`), commit records (:class:`CommitDetails`) and a bulk span
reader that coalesces reads of values packed into one data object.
Everything here only reads; nothing is cached beyond the store's node cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tensorstore_py.core.errors import ChecksumError, DataCorruptionError, NotFoundError
from tensorstore_py.core.pools import run_cpu, run_io
from tensorstore_py.kvstore.base import ByteRange, Generation, KvStore
from tensorstore_py.kvstore.versioned.format import (
    MAGIC_COMMIT,
    CommitRecord,
    Entry,
    InlineEntry,
    commit_name,
    crc32c,
    unframe,
)
from tensorstore_py.kvstore.versioned.root import VersionedRoot, read_hint

__all__ = ["CommitDetails", "EntryInfo", "Span", "entry_info", "read_formats", "read_spans"]

#: ``(key, start, stop)``: bytes ``[start, stop)`` of the value of ``key``
Span = tuple[str, int, int]


@dataclass(frozen=True)
class EntryInfo:
    """One key's index entry at some version.

    ``size`` and ``crc32c`` describe the whole stored value; ``object`` is the
    data object (a key of the base store) holding it at ``offset``, or None when
    the value is stored inline in the index. ``generation`` is what a read of
    the key reports.
    """

    key: str
    size: int
    crc32c: int
    object: str | None
    offset: int
    generation: Generation


@dataclass(frozen=True)
class CommitDetails:
    """One commit record as stored (docs/FORMAT.md §5).

    ``kind`` is "data", "tag" or "delete_versions"; ``key_count`` the number of
    keys in the version; ``changed_count`` the number of keys the commit changed
    when the record lists them inline (None when they live in a separate
    object: :meth:`VersionedKvStore.changed_keys` reads them); ``tags`` the tags
    as of this commit; ``deleted`` whether a newer commit deleted this version.
    """

    version: int
    time: float
    write_id: str
    message: str
    metadata: dict[str, Any]
    kind: str
    key_count: int
    changed_count: int | None
    tags: dict[str, int] = field(default_factory=dict)
    txn_id: str | None = None
    deleted: bool = False


def details(rec: CommitRecord, *, deleted: bool) -> CommitDetails:
    return CommitDetails(
        version=rec.version, time=rec.time, write_id=rec.write_id, message=rec.message,
        metadata=dict(rec.metadata), kind=rec.kind, key_count=rec.count,
        changed_count=None if rec.changes is None or rec.changes_ref is not None else len(rec.changes),
        tags=dict(rec.tags), txn_id=rec.txn_id, deleted=deleted,
    )


def entry_info(key: str, e: Entry) -> EntryInfo:
    if isinstance(e, InlineEntry):
        return EntryInfo(key, len(e.value), crc32c(e.value), None, 0, Generation(e.stamp))
    return EntryInfo(key, e.length, e.crc, e.object, e.offset, Generation(e.stamp))


async def read_spans(
    root: VersionedRoot, tree: str | None, path: str, spans: Sequence[Span], *, where: str,
    coalesce_gap: int, into: Sequence[memoryview | None] | None = None,
) -> list[Any]:
    """The bytes of each span, reading each data object with one ``read_ranges``.

    A span covering a whole value is checked against its crc32c
    (:class:`ChecksumError`); a missing key raises :class:`NotFoundError`; a
    missing or short data object raises :class:`DataCorruptionError`.

    ``into[i]`` (a writable byte buffer of the span's size, or None) receives
    span ``i``'s bytes and is its result: read straight into it where the base
    store reads into caller buffers (the file store), else copied into it.
    """
    entries = await asyncio.gather(*(root.lookup(tree, path + s[0]) for s in spans))
    out: list[Any] = [b""] * len(spans)
    by_object: dict[str, list[int]] = {}
    for i, ((key, a, b), e) in enumerate(zip(spans, entries)):
        if e is None:
            raise NotFoundError(f"{where}: key {path + key!r} does not exist")
        if isinstance(e, InlineEntry):
            out[i] = memoryview(e.value)[a:b]
            continue
        if not 0 <= a <= b <= e.length:
            raise DataCorruptionError(
                f"{where}: key {path + key!r}: {e.length} bytes stored, span [{a}, {b}) requested"
            )
        by_object.setdefault(e.object, []).append(i)

    async def one_object(obj: str, idx: list[int]) -> None:
        refs = [entries[i] for i in idx]
        ranges = [ByteRange(e.offset + spans[i][1], e.offset + spans[i][2])  # type: ignore[union-attr]
                  for i, e in zip(idx, refs)]
        dests = [into[i] for i in idx] if into is not None else []
        values = await read_into_buffers(root.base, obj, ranges, dests) if any(d is not None for d in dests) else None
        if values is None:
            res = await root.base.read_ranges(obj, ranges, coalesce_gap=coalesce_gap)
            if res.state != "value":
                raise DataCorruptionError(f"{where}: data object {obj!r} is missing")
            values = copied_into(res.values, dests)
        for i, e, buf in zip(idx, refs, values):
            key, a, b = spans[i]
            if len(buf) != b - a:
                raise DataCorruptionError(f"{where}: data object {obj!r} is truncated (key {path + key!r})")
            if a == 0 and b == e.length:  # type: ignore[union-attr]
                # large buffers off the loop: crc32c releases the GIL
                crc = int(await run_cpu(crc32c, buf)) if len(buf) >= 1 << 20 else crc32c(buf)
                if crc != e.crc:  # type: ignore[union-attr]
                    raise ChecksumError(
                        f"{where}: key {path + key!r}: crc32c mismatch in data object {obj!r} "
                        f"(stored {e.crc:#010x}, computed {crc:#010x})"  # type: ignore[union-attr]
                    )
            out[i] = buf

    await asyncio.gather(*(one_object(o, idx) for o, idx in by_object.items()))
    return out


async def read_into_buffers(
    base: KvStore, obj: str, ranges: list[ByteRange], dests: list[memoryview | None]
) -> list[Any] | None:
    """The ranges of data object ``obj`` read by the base store into ``dests``
    (a range without a buffer gets one of its own) on one pool thread, for a
    store with blocking I/O (``KvStore._read_range_into_blocking``: the file
    store reads straight into them); None for other stores (their
    ``read_ranges`` coalesces ranges into fewer requests), and for a missing
    object (which the caller's ``read_ranges`` then reports)."""
    if not base.blocking_io:
        return None
    read_into = base._read_range_into_blocking
    full = base._full(obj)

    def run() -> list[Any] | None:
        out: list[Any] = []
        for r, dest in zip(ranges, dests):
            assert r.stop is not None
            buf = dest if dest is not None else memoryview(bytearray(r.stop - r.start))
            got = read_into(full, r.start, buf)
            if got < 0:
                return None
            out.append(buf[:got])
        return out

    return await run_io(run)


def copied_into(values: Sequence[Any], dests: Sequence[memoryview | None]) -> list[Any]:
    """Each value copied into its buffer of ``dests`` (where one is given and
    the sizes match; a size mismatch is left for the caller to report), which
    is then its result."""
    out: list[Any] = []
    for i, v in enumerate(values):
        dest = dests[i] if i < len(dests) else None
        if dest is None or len(v) != len(dest):
            out.append(v)
            continue
        dest[:] = memoryview(v).cast("B")
        out.append(dest)
    return out


async def read_formats(base: KvStore) -> dict[str, int]:
    """The ``format`` field of the first and the newest (per the hint) commit records.

    Reads only the record envelopes, so that a store written by a newer format
    is recognised before anything tries to decode it. Missing or damaged
    records and hints are skipped (verification reports them).
    """
    names = [commit_name(1)]
    hint = await read_hint(base)
    if hint > 1:
        names.append(commit_name(hint))
    out: dict[str, int] = {}
    for name in names:
        res = await base.read(name)
        if res.state != "value":
            continue
        try:
            body = unframe(MAGIC_COMMIT, res.value, name)
        except DataCorruptionError:
            continue
        fmt = body.get("format") if isinstance(body, dict) else None
        if isinstance(fmt, int):
            out[name] = fmt
    return out
