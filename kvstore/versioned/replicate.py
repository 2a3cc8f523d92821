"""Byte-for-byte copy of a versioned store's objects to another (empty) store.

Every object a retained version references is copied as stored (index nodes,
change lists, data objects), checked on the way: index nodes by their crc32c,
each referenced value in a data object by its crc32c. Objects are created with
create-only writes, and commit records are written last, oldest first, so the
destination shows no version before everything that version references is there.
Not atomic: an interrupted copy leaves unreferenced objects (collected by gc)
and possibly a prefix of the versions. Only retained versions' objects are
copied, so while that prefix ends below the newest version, a version the
source deleted (and reclaimed) looks retained at the destination without its
objects: reading it, and a collector there, fail with DataCorruptionError
until the newest record lands. Running the copy again resumes it: an
object already at the destination holding exactly the bytes to be written is
kept; different bytes fail the copy with ConditionFailedError (nothing is ever
overwritten).

The copy is a writer of the destination like any commit (docs/FORMAT.md §9.3):
it holds a writer lease there (``LeaseKeeper.writing``) from before its first
object until its last commit record landed, so a collector running on the
destination meanwhile keeps what it copied, and right before the first commit
record it checks that every object it copied or found there (nodes, change
lists, data objects) still exists, except those its lease vouches for
(``LeaseKeeper.unvouched``, ``data.require_present``). An object gone by then
(a collector that ignored or missed the lease) refuses the copy with
DataCorruptionError before any commit record is written: the destination shows
no version referencing it. The records then land one by one while the lease
holds, so the window between the check and a record (a collector that ignores
a live lease) is as long as the records take, not one write as for a commit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tensorstore_py.core.errors import ConditionFailedError, DataCorruptionError
from tensorstore_py.core.pools import run_cpu
from tensorstore_py.kvstore.base import Buffer, KvStore
from tensorstore_py.kvstore.versioned.create import create_object
from tensorstore_py.kvstore.versioned.data import require_present
from tensorstore_py.kvstore.versioned.format import (
    MAGIC_CHANGES,
    MAGIC_HINT,
    CommitRecord,
    RefEntry,
    commit_name,
    crc32c,
    frame,
    ranges_contain,
    unframe,
)
from tensorstore_py.kvstore.versioned.leases import LeaseKeeper, lease_clock
from tensorstore_py.kvstore.versioned.root import get_root
from tensorstore_py.kvstore.versioned.tree import Inner, decode_node

__all__ = ["copy_store", "create_copy"]


async def create_copy(dst: KvStore, name: str, data: Buffer) -> bool:
    """Create ``name`` holding ``data`` at the copy destination ``dst`` (a
    create-only write). An object already there holding exactly ``data`` (an
    interrupted copy being resumed) is kept; other bytes raise ConditionFailedError.
    Returns True when this call wrote the object, False when it was kept."""
    if await create_object(dst, name, data, exists="refuse"):
        return True
    found = await dst.read(name)
    if found.state != "value" or bytes(found.value) != bytes(data):
        raise ConditionFailedError(
            f"copy: {name!r} already exists at the destination {dst!r} with other content "
            f"(expected {len(data)} bytes equal to the source's, found "
            f"{'nothing on reading it back' if found.state != 'value' else f'{len(found.value)} other bytes'}); "
            f"copy into an empty location"
        )
    return False


async def copy_store(base: KvStore, out: KvStore, count: Callable[[int], None]) -> None:
    """See :meth:`VersionedKvStore.copy_to`."""
    keeper = get_root(out).leases
    # a writer of ``out`` from before its first object until its last record
    async with keeper.writing():
        await _copy(base, out, keeper, count)


async def _copy(base: KvStore, out: KvStore, keeper: LeaseKeeper, count: Callable[[int], None]) -> None:
    # every object the records will reference -> when its write started
    # (-inf: found there, written by an earlier copy: its lease does not vouch)
    copied: dict[str, float] = {}

    async def put(name: str, data: Buffer) -> None:
        started = lease_clock()
        copied[name] = started if await create_copy(out, name, data) else float("-inf")

    newest = await get_root(base).newest()
    records: list[tuple[int, bytes, CommitRecord]] = []
    for v in range(1, newest + 1):
        res = await base.read(commit_name(v))
        if res.state != "value":
            raise DataCorruptionError(f"copy: commit record {commit_name(v)!r} is missing at the source")
        raw = bytes(res.value)
        records.append((v, raw, CommitRecord.decode(raw, commit_name(v))))
    deleted = records[-1][2].deleted if records else []
    retained = [r for v, _, r in records if not ranges_contain(deleted, v)]
    seen: set[str] = set()
    values: dict[str, list[tuple[int, int, int, str]]] = {}
    sem = asyncio.Semaphore(32)

    async def node(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        async with sem:
            res = await base.read(name)
        if res.state != "value":
            raise DataCorruptionError(f"copy: index node {name!r} is missing at the source")
        n = decode_node(res.value, name)  # verifies magic + crc32c
        if isinstance(n, Inner):
            await asyncio.gather(*(node(c) for c in n.children))
        else:
            for k, e in zip(n.keys, n.entries):
                if isinstance(e, RefEntry):
                    values.setdefault(e.object, []).append((e.offset, e.length, e.crc, k))
        async with sem:
            await put(name, res.value)
        count(len(res.value))

    for rec in retained:
        if rec.root is not None:
            await node(rec.root)
    for _, _, rec in records:
        if rec.changes_ref is not None and rec.changes_ref not in seen:
            seen.add(rec.changes_ref)
            res = await base.read(rec.changes_ref)
            if res.state == "value":  # a deleted version's may be collected
                unframe(MAGIC_CHANGES, res.value, rec.changes_ref)
                await put(rec.changes_ref, res.value)
                count(len(res.value))
    data_sem = asyncio.Semaphore(4)

    async def data(obj: str, entries: list[tuple[int, int, int, str]]) -> None:
        async with data_sem:
            res = await base.read(obj)
            if res.state != "value":
                raise DataCorruptionError(f"copy: data object {obj!r} is missing at the source "
                                          f"(key {entries[0][3]!r})")
            bad = await run_cpu(_bad_value, res.value, entries)
            if bad is not None:
                raise DataCorruptionError(f"copy: data object {obj!r}: {bad}")
            await put(obj, res.value)
        count(len(res.value))

    await asyncio.gather(*(data(o, e) for o, e in sorted(values.items())))
    # the pre-commit check of every commit (FORMAT.md §9.3): nothing a record
    # references may have been collected meanwhile
    await require_present(out, keeper.unvouched(copied), f"copy to {out!r}", "the copy wrote or kept")
    for v, raw, _ in records:  # the commit points last, oldest first
        await create_copy(out, commit_name(v), raw)
        count(len(raw))
    if newest:
        await out.write("latest", frame(MAGIC_HINT, {"version": newest}))


def _bad_value(data: Any, entries: list[tuple[int, int, int, str]]) -> str | None:
    mv = memoryview(data).cast("B")
    for off, length, crc, key in entries:
        if off + length > len(mv):
            return f"key {key!r}: value [{off}, {off + length}) lies past the end ({len(mv)} bytes)"
        found = crc32c(mv[off:off + length])
        if found != crc:
            return f"key {key!r}: crc32c mismatch at offset {off} (stored {crc:#010x}, computed {found:#010x})"
    return None
