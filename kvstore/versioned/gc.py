"""Garbage collection of a versioned store (docs/FORMAT.md §9).

::

    report = gc(kv).result()                          # dry run: what would go
    report = gc(kv, dry_run=False).result()           # delete orphans older than 6 h
    kv.delete_versions([1, 2]).result()
    report = reclaim(kv).result()                     # free deleted versions' bytes now

**Marking.** Every retained version (``1..newest`` minus the deleted ranges of
the newest commit record; tagged versions can not be deleted, so tags pin
their versions) marks its root node and every node and data object reachable
from it. The ``changes_ref`` of *every* commit record is marked, deleted ones
included: conflict checks of in-flight transactions read the changed keys of
every version above their base. Fragments of multi-writer transactions that
are kept mark the data objects they reference. ``commits/*`` and ``latest``
are never deleted (dense version numbers depend on them), nor is anything
outside ``nodes/``, ``data/``, ``changes/`` and ``txns/`` or any object whose
name is not of the form the format defines.

**Grace.** An unmarked object is deleted only when it is older than ``grace``
seconds (by the base store's modification time, see ``KvStore.list_info``):
a writer in flight has written objects that no commit record references yet.
A store that can not tell an object's age keeps every unmarked object unless
``grace == 0``. ``grace=0`` is only safe when no writer is running.
A multi-writer transaction whose ``result`` is older than the grace period
is over: all its ``txns/<id>/`` objects go.

**Prompt reclaim** (``reclaim_deleted=True``, and :func:`reclaim`): objects
reachable from deleted versions but from no retained one are deleted at once,
whatever their age. Why no writer in flight can be robbed by this:

1. Object names are unique and never reused, and a writer creates a new object
   for every value and node it writes. So the objects referenced by version
   ``v`` are objects written by ``v``'s own writer plus objects referenced by
   its parent ``v - 1`` (untouched subtrees and entries it copied). By
   induction, the versions referencing an object form one contiguous range
   ``[created, last]``: once a version drops an object, no later version
   references it again.
2. A commit of version ``p + 1`` only succeeds (its create-only write of
   ``commits/<p+1>``) if it was built on ``p`` and ``p`` is still the newest
   version. The newest version can not be deleted. Let ``m`` be the newest
   version GC saw; any commit that succeeds later is built on some ``p >= m``.
3. An object reachable only from deleted versions has ``last < m`` (``m`` is
   retained and does not reference it), so by 1. neither ``m`` nor any later
   ``p`` references it, and by 2. no writer in flight can publish a reference
   to it: a writer whose tree still points at it was built on an older parent,
   loses the race for ``commits/<p+1>`` and rebuilds from the newest tree,
   keeping only the objects it wrote itself (which are not reachable from any
   committed version, so prompt reclaim never touches them).

What prompt reclaim CAN take away is *reads* pinned to a deleted version: a
snapshot opened on it, or a transaction whose base version was deleted while it
ran. Such a read then fails with ``DataCorruptionError`` naming the missing
object (it never returns wrong bytes: names are never reused). A retry reads
the newest version. So delete a version only when nobody reads it any more,
which is what a checkpoint manager's retention policy decides anyway.

A GC that dies midway leaves only unreferenced objects behind; data objects are
deleted before the nodes that reference them, so the next prompt reclaim still
finds them by walking the deleted versions (missing nodes are skipped).
GCs may run concurrently with each other and with writers (within the grace
rule above); deletes are idempotent.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any

from tensorstore_py.core.errors import DataCorruptionError, InvalidArgumentError
from tensorstore_py.core.future import Future, spawn
from tensorstore_py.kvstore.base import KeyInfo, KvStore
from tensorstore_py.kvstore.versioned.format import (
    MAGIC_FRAGMENT,
    CommitRecord,
    RefEntry,
    decode_entry,
    ranges_contain,
    unframe,
)
from tensorstore_py.kvstore.versioned.root import VersionedRoot, base_of
from tensorstore_py.kvstore.versioned.tree import Leaf, Node, walk

__all__ = ["DEFAULT_GRACE", "GcReport", "gc", "reclaim"]

#: default grace period: six hours (longer than any commit should take)
DEFAULT_GRACE = 6 * 3600.0
#: concurrent reads / deletes
CONCURRENCY = 64

_OBJECT_RE = re.compile(r"(nodes|data|changes)/[0-9a-f]{32}\Z")
#: multi-writer objects (FORMAT.md §7): format-1 fragments ``<i>``; format-2 attempts,
#: fragments ``<k>-<nonce>/<i>`` and failures ``<k>-<nonce>/failed``; the result
_TXN_RE = re.compile(
    r"txns/([A-Za-z0-9_.\-]{1,128})/"
    r"([0-9]{6}|result|attempts/[0-9]{6}|[0-9]{6}-[0-9a-f]{32}/(?:[0-9]{6}|failed))\Z"
)
#: deletion order: data before the nodes that reference them (see the module doc)
_ORDER = {"data": 0, "nodes": 1, "txns": 2, "changes": 3}
#: what a missing or broken node of a deleted version counts as (see _reachable_from)
_EMPTY: Node = Leaf([], [])


@dataclass(frozen=True)
class GcReport:
    """What a garbage collection deleted (or, for a dry run, would delete) and kept.

    ``deleted`` lists object names (sorted), ``reclaimed`` the subset that was
    reachable only from deleted versions (prompt reclaim). Byte counts cover
    objects whose size the base store reports (``unknown_size`` counts the rest).
    """

    dry_run: bool
    grace: float
    newest: int
    retained_versions: int
    deleted_versions: int
    deleted: tuple[str, ...]
    deleted_bytes: int
    reclaimed: tuple[str, ...]
    kept_reachable: int
    kept_reachable_bytes: int
    kept_young: tuple[str, ...]
    kept_young_bytes: int
    unknown_size: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def deleted_count(self) -> int:
        return len(self.deleted)

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.by_kind.items())) or "nothing"
        return (
            f"gc of {self.newest} versions ({self.retained_versions} retained, "
            f"{self.deleted_versions} deleted): {verb} {self.deleted_count} objects "
            f"({kinds}; {self.deleted_bytes} bytes, {len(self.reclaimed)} of deleted versions); "
            f"kept {self.kept_reachable} referenced ({self.kept_reachable_bytes} bytes) and "
            f"{len(self.kept_young)} younger than {self.grace:g} s ({self.kept_young_bytes} bytes)"
        )


def gc(
    store: KvStore,
    *,
    grace: float = DEFAULT_GRACE,
    dry_run: bool = True,
    reclaim_deleted: bool = False,
) -> Future[GcReport]:
    """Collect the garbage of ``store`` (a versioned store or its base store).

    Deletes unreferenced ``nodes/``, ``data/``, ``changes/`` and ``txns/``
    objects older than ``grace`` seconds and, with ``reclaim_deleted``, objects
    reachable only from deleted versions regardless of age (see the module
    doc for why that never robs a writer). ``dry_run=True`` (the default)
    deletes nothing and reports what would go. Raises ``DataCorruptionError``
    (deleting nothing) when a retained version can not be walked completely:
    marking would be incomplete.
    """
    if not isinstance(grace, (int, float)) or grace < 0:
        raise InvalidArgumentError(f"gc: grace must be a number of seconds >= 0, got {grace!r}")
    return spawn(_Gc(base_of(store), float(grace), bool(dry_run), bool(reclaim_deleted)).run())


def reclaim(store: KvStore, *, grace: float = DEFAULT_GRACE) -> Future[GcReport]:
    """Free the bytes of deleted versions now (call after ``delete_versions``).

    ``gc(store, grace=grace, dry_run=False, reclaim_deleted=True)``: objects of
    deleted versions go at once; orphans of unknown origin only after ``grace``.
    """
    return gc(store, grace=grace, dry_run=False, reclaim_deleted=True)


class _Gc:
    def __init__(self, base: KvStore, grace: float, dry_run: bool, reclaim_deleted: bool) -> None:
        self.base = base
        self.root = VersionedRoot(base)  # private: its node cache dies with this run
        self.grace = grace
        self.dry_run = dry_run
        self.reclaim_deleted = reclaim_deleted
        self.sem = asyncio.Semaphore(CONCURRENCY)
        self.marked: set[str] = set()

    async def run(self) -> GcReport:
        now = time.time()
        # list BEFORE finding the newest version: an object written after the
        # listing is never a candidate, whatever commits meanwhile
        listed: dict[str, KeyInfo] = {}
        for infos in await asyncio.gather(
            *(self.base.list_info(p) for p in ("nodes/", "data/", "changes/", "txns/"))
        ):
            for info in infos:
                if _OBJECT_RE.match(info.key) or _TXN_RE.match(info.key):
                    listed[info.key] = info

        newest = await self.root.newest()
        records = await self._records(newest)
        head = records.get(newest)
        deleted_ranges = head.deleted if head is not None else []
        retained = [r for v, r in sorted(records.items()) if not ranges_contain(deleted_ranges, v)]
        gone = [r for v, r in sorted(records.items()) if ranges_contain(deleted_ranges, v)]

        for rec in records.values():
            if rec.changes_ref is not None:
                self.marked.add(rec.changes_ref)
        nodes: set[str] = set()
        for rec in retained:  # shared subtrees are walked once (nodes is shared)
            await walk(self.root.load_node, rec.root, nodes, self._mark_entry)
        self.marked |= nodes

        def old(info: KeyInfo) -> bool:
            if info.mtime is None:
                return self.grace == 0
            return now - info.mtime > self.grace

        txn_delete = await self._txns(listed, old)

        reclaimed: set[str] = set()
        if self.reclaim_deleted and gone:
            only_gone = await self._reachable_from(gone, nodes)
            reclaimed = {n for n in only_gone - self.marked if n in listed}

        to_delete: set[str] = set(reclaimed) | txn_delete
        kept_young: list[str] = []
        kept_ref = kept_ref_bytes = 0
        for name, info in listed.items():
            if name in to_delete:
                continue
            if name in self.marked:
                kept_ref += 1
                kept_ref_bytes += info.size or 0
            elif old(info):
                to_delete.add(name)
            else:
                kept_young.append(name)

        order = sorted(to_delete, key=lambda n: (_ORDER[n.split("/", 1)[0]], n))
        if not self.dry_run:
            await self._delete(order)
        by_kind: dict[str, int] = {}
        for n in order:
            kind = n.split("/", 1)[0]
            by_kind[kind] = by_kind.get(kind, 0) + 1
        return GcReport(
            dry_run=self.dry_run,
            grace=self.grace,
            newest=newest,
            retained_versions=len(retained),
            deleted_versions=len(gone),
            deleted=tuple(sorted(to_delete)),
            deleted_bytes=sum(listed[n].size or 0 for n in to_delete),
            reclaimed=tuple(sorted(reclaimed)),
            kept_reachable=kept_ref,
            kept_reachable_bytes=kept_ref_bytes,
            kept_young=tuple(sorted(kept_young)),
            kept_young_bytes=sum(listed[n].size or 0 for n in kept_young),
            unknown_size=sum(1 for n in to_delete if listed[n].size is None),
            by_kind=by_kind,
        )

    def _mark_entry(self, key: str, entry: Any) -> None:
        if isinstance(entry, RefEntry):
            self.marked.add(entry.object)

    async def _records(self, newest: int) -> dict[int, CommitRecord]:
        """Every commit record; a missing one aborts the collection."""

        async def one(v: int) -> CommitRecord:
            async with self.sem:
                rec = await self.root.read_record(v)
            if rec is None:
                raise DataCorruptionError(
                    f"gc of versioned store over {self.base!r}: commit record of version {v} "
                    f"is missing (newest is {newest}); refusing to collect"
                )
            return rec

        recs = await asyncio.gather(*(one(v) for v in range(1, newest + 1)))
        return {r.version: r for r in recs}

    async def _txns(self, listed: dict[str, KeyInfo], old: Any) -> set[str]:
        """Multi-writer objects to delete; kept fragments mark their data objects."""
        by_txn: dict[str, list[str]] = {}
        for name in listed:
            m = _TXN_RE.match(name)
            if m:
                by_txn.setdefault(m.group(1), []).append(name)
        out: set[str] = set()
        keep: list[str] = []
        for txn_id, names in by_txn.items():
            result = f"txns/{txn_id}/result"
            if result in listed and old(listed[result]):
                out.update(names)  # the transaction is over
                continue
            for n in names:
                if old(listed[n]):
                    out.add(n)
                elif n != result:
                    keep.append(n)
        await asyncio.gather(*(self._mark_fragment(n) for n in keep))
        return out

    async def _mark_fragment(self, name: str) -> None:
        async with self.sem:
            res = await self.base.read(name)
        if res.state != "value":
            return
        try:
            body = unframe(MAGIC_FRAGMENT, res.value, name)
            entries = body.get("entries") if isinstance(body, dict) else None
            for raw in entries or []:
                if raw is not None:
                    self._mark_entry("", decode_entry(raw, f"fragment {name!r}"))
        except DataCorruptionError:
            pass  # an unreadable fragment can not be merged either; it ages out

    async def _reachable_from(self, recs: list[CommitRecord], retained_nodes: set[str]) -> set[str]:
        """Nodes and data objects reachable from ``recs`` but not through a
        retained node. Missing or broken nodes are skipped (already collected)."""
        seen = set(retained_nodes)
        found: set[str] = set()

        async def load(name: str) -> Node:
            try:
                return await self.root.load_node(name)
            except DataCorruptionError:
                return _EMPTY

        def on_entry(key: str, entry: Any) -> None:
            if isinstance(entry, RefEntry):
                found.add(entry.object)

        for rec in recs:
            await walk(load, rec.root, seen, on_entry)
        found |= seen - retained_nodes
        return found

    async def _delete(self, names: list[str]) -> None:
        async def one(name: str) -> None:
            async with self.sem:
                await self.base.delete(name)

        # kinds in order, so a crash midway never strands data behind deleted nodes
        for kind in sorted(_ORDER, key=_ORDER.__getitem__):
            await asyncio.gather(*(one(n) for n in names if n.startswith(kind + "/")))

