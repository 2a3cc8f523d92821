"""Garbage collection of a versioned store (docs/FORMAT.md §9).

::

    report = gc(kv).result()                          # dry run: what would go
    report = gc(kv, dry_run=False).result()           # delete orphans older than 6 h
    kv.delete_versions([1, 2]).result()
    report = reclaim(kv).result()                     # free deleted versions' bytes now

Two collections:

* :func:`reclaim` (*prompt reclaim*, after ``delete_versions``; what checkpoint
  retention runs after every save): deletes the objects reachable only from
  deleted versions, whatever their age, reading only what changed (the
  watermark and the contiguous-range argument of :mod:`.reclaim`), so its cost
  does not grow with the history. It also drops what finished multi-writer
  transactions left besides their ``result`` once older than the grace
  period (their ``result`` is left to full collections) and, at most once per
  ``sweep_interval`` (store clock), runs a full collection.
* :func:`gc` (a *full collection*, dry run by default): marks everything the
  kept versions reference and deletes what is unmarked, old and not claimed by
  a live writer's lease.

**Marking.** Every kept version -- retained (``1..newest`` minus the deleted
ranges of the newest commit record; tags pin their versions), or deleted but
pinned by a live reader lease or committed over less than ``read_grace``
seconds ago -- marks its root node and every node and data object reachable
from it. The ``changes_ref`` of *every* commit record is marked, deleted ones
included: conflict checks of in-flight transactions read the changed keys of
every version above their base. Fragments of multi-writer transactions that
have no ``result`` yet mark the data objects they reference. ``commits/*`` and
``latest`` are never deleted (dense version numbers depend on them), nor is
anything outside ``nodes/``, ``data/``, ``changes/``, ``txns/`` (and the
collector's own ``leases/`` / ``gc/`` objects) or any object whose name is not
of the form the format defines. A collection refuses (DataCorruptionError,
nothing deleted) when a kept version can not be walked, a commit record in
``1..newest`` is missing, or records exist above the newest reachable version
(a lost record would make everything after it look unreferenced).

**Ages and leases.** Ages are measured by the STORE's clock: the collector
writes a probe object and reads its modification time back
(:func:`.lease_reads.store_now`; which clock that is per store: FORMAT.md §9.1).
It reads the writers' leases before it lists and reads the newest version,
the readers' after, and the newest version again after marking, marking what
was committed meanwhile (the proof: FORMAT.md §9.5). An
unmarked object is deleted only when it is older than ``grace`` seconds AND no
live writer lease claims it (:mod:`.leases`: a transaction open for hours keeps
what it wrote, whatever the grace). A store that can not tell an object's age
keeps every unmarked object unless ``grace == 0`` and no writer holds a lease.
What answers "did this txn id commit?" stays while the version the id
committed is kept: a full collection keeps ``txns/<id>/result`` of every
``txn_id`` a kept version's record carries (and the attempt records while no
result exists); prompt reclaim deletes no result at all. Any other
multi-writer transaction whose ``result`` is older than the grace period is
over: all its ``txns/<id>/`` objects go. Leases whose owners are gone are
deleted. With a file store, temporaries of crashed writers older than the
grace (``FileKvStore.sweep_temporaries``) are collected too.

**Prompt reclaim** is safe for writers in flight whatever their age (the
argument of FORMAT.md §9.2: no commit can ever again reference an object that
the newest version does not). What it could take away is *reads* of deleted
versions; a reader that holds a lease (a snapshot, a checkpoint restore or
``open_array`` view) keeps its version's objects; a reader without one gets
:class:`~tensorstore_py.errors.SnapshotExpiredError` (a read of the newest
version just starts again). A collector that dies midway leaves only
unreferenced objects behind; data objects are deleted before the nodes that
reference them, so the next reclaim still finds them. Collectors may run
concurrently with each other and with writers; deletes are idempotent.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable
from typing import Any

from tensorstore_py.core.errors import DataCorruptionError, InvalidArgumentError
from tensorstore_py.core.future import Future, spawn
from tensorstore_py.kvstore.base import KeyInfo, KvStore
from tensorstore_py.kvstore.versioned.format import (
    MAGIC_FRAGMENT,
    CommitRecord,
    RefEntry,
    commit_name,
    decode_entry,
    ranges_contain,
    unframe,
)
from tensorstore_py.kvstore.versioned.gcreport import GcReport, kinds, merge
from tensorstore_py.kvstore.versioned.lease_reads import Leases, delete_expired, read_leases, store_now
from tensorstore_py.kvstore.versioned.reclaim import (
    WATERMARK,
    Reclaim,
    find_reclaimable,
    read_watermark,
    update_watermark,
    versions_in,
)
from tensorstore_py.kvstore.versioned.root import VersionedRoot, base_of, get_root
from tensorstore_py.kvstore.versioned.tree import walk

__all__ = ["DEFAULT_GRACE", "DEFAULT_READ_GRACE", "DEFAULT_SWEEP_INTERVAL", "GcReport", "gc", "is_layout_object",
           "reclaim"]

#: default grace period: six hours (longer than any commit should take)
DEFAULT_GRACE = 6 * 3600.0
#: seconds a deleted version stays readable without a lease (0: reclaim at once;
#: readers that need longer hold a lease)
DEFAULT_READ_GRACE = 0.0
#: :func:`reclaim` runs a full collection when the last one is older than this
DEFAULT_SWEEP_INTERVAL = 24 * 3600.0
#: concurrent reads / deletes
CONCURRENCY = 64

_OBJECT_RE = re.compile(r"(nodes|data|changes)/[0-9a-f]{32}\Z")
#: multi-writer objects (FORMAT.md §7): format-1 fragments ``<i>``; format-2 attempts,
#: fragments ``<k>-<nonce>/<i>`` and failures ``<k>-<nonce>/failed``; the result
_TXN_RE = re.compile(
    r"txns/([A-Za-z0-9_.\-]{1,128})/"
    r"([0-9]{6}|result|attempts/[0-9]{6}|[0-9]{6}-[0-9a-f]{32}/(?:[0-9]{6}|failed))\Z"
)
_COMMIT_RE = re.compile(r"commits/([0-9]{20})\Z")
_CLOCK_RE = re.compile(r"gc/clock-[0-9a-f]{32}\Z")
_LEASE_RE = re.compile(r"leases/[0-9a-f]{32}\Z")


def is_layout_object(name: str) -> bool:
    """Whether ``name`` is an object only a versioned store's layout uses
    (docs/FORMAT.md §2): a commit record, node, data, changes, multi-writer
    (formats 1 and 2), lease, clock probe or watermark object. One match among
    a folder's keys marks it as a versioned store, even one whose first commit
    never landed."""
    return bool(_COMMIT_RE.match(name) or _OBJECT_RE.match(name) or _TXN_RE.match(name)
                or _LEASE_RE.match(name) or _CLOCK_RE.match(name) or name == WATERMARK)


#: deletion order: data before the nodes that reference them (see the module doc)
_ORDER = {"data": 0, "nodes": 1, "txns": 2, "changes": 3, "gc": 4, "leases": 5}


def _check_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InvalidArgumentError(f"gc: {name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def gc(
    store: KvStore,
    *,
    grace: float = DEFAULT_GRACE,
    dry_run: bool = True,
    reclaim_deleted: bool = False,
    read_grace: float = DEFAULT_READ_GRACE,
    on_delete: Callable[[int, int], None] | None = None,
) -> Future[GcReport]:
    """A full collection of ``store`` (a versioned store or its base store).

    Deletes unreferenced ``nodes/``, ``data/``, ``changes/`` and ``txns/``
    objects older than ``grace`` seconds (store clock) that no live writer
    lease claims and, with ``reclaim_deleted``, objects reachable only from
    deleted versions regardless of age (see the module doc for why that never
    robs a writer; deleted versions pinned by a reader lease or committed over
    less than ``read_grace`` seconds ago are kept). ``dry_run=True`` (the
    default) deletes nothing and reports what would go. Raises
    ``DataCorruptionError`` (deleting nothing) when marking would be incomplete.
    ``on_delete(done, total)`` is called as objects are deleted (progress displays).
    """
    g = _check_seconds("grace", grace)
    rg = _check_seconds("read_grace", read_grace)
    return spawn(_Gc(base_of(store), g, bool(dry_run), bool(reclaim_deleted), rg, on_delete).run())


def reclaim(
    store: KvStore,
    *,
    grace: float = DEFAULT_GRACE,
    read_grace: float = DEFAULT_READ_GRACE,
    sweep_interval: float = DEFAULT_SWEEP_INTERVAL,
) -> Future[GcReport]:
    """Free the bytes of deleted versions now (call after ``delete_versions``).

    Objects reachable only from deleted versions go at once (except versions a
    reader lease pins or committed over less than ``read_grace`` seconds ago:
    a later reclaim takes them), reading only the versions not reclaimed
    before and their neighbours. Leftovers of finished multi-writer
    transactions older than ``grace`` go too (never a ``result``: a txn id is
    remembered while its version is retained); when the last full collection is older than
    ``sweep_interval`` seconds, a full one (:func:`gc` with ``grace``) runs as
    well, so orphans of failed writes do not pile up. Idempotent.
    """
    g = _check_seconds("grace", grace)
    rg = _check_seconds("read_grace", read_grace)
    si = _check_seconds("sweep_interval", sweep_interval)
    return spawn(_reclaim(base_of(store), g, rg, si))


# -- shared pieces --------------------------------------------------------------------
class _Rules:
    """When an unreferenced object may go: old by the store clock, and no live
    writer lease claims it."""

    def __init__(self, now: float, grace: float, leases: Leases) -> None:
        self.now = now
        self.grace = grace
        self.leases = leases

    def old(self, info: KeyInfo) -> bool:
        if info.mtime is None:
            return self.grace == 0
        return self.now - info.mtime > self.grace

    def collectable(self, info: KeyInfo) -> bool:
        return self.old(info) and not self.leases.protects(info.mtime)


def _txns(listed: dict[str, KeyInfo], rules: _Rules,
          committed: set[str] | None) -> tuple[set[str], list[str]]:
    """(multi-writer objects to delete, fragments still in flight: they mark their data).

    ``committed``: the transaction ids that kept versions carry (a full
    collection reads every commit record); their ``result`` stays, and so do
    their attempt records while no ``result`` exists: what answers "did this id
    commit?" lives as long as the version it committed (docs/FORMAT.md §7.5).
    None (prompt reclaim, which does not read every record): no ``result`` and
    nothing of a transaction without one is deleted; only the leftovers of
    finished transactions (those with a ``result``) go.
    """
    by_txn: dict[str, list[str]] = {}
    for name in listed:
        m = _TXN_RE.match(name)
        if m:
            by_txn.setdefault(m.group(1), []).append(name)
    out: set[str] = set()
    live: list[str] = []
    for txn_id, names in by_txn.items():
        result = f"txns/{txn_id}/result"
        finished = result in listed
        over = finished and rules.old(listed[result])
        if committed is None or txn_id in committed:
            # the id's commit is retained (or might be): its answer stays
            for n in names:
                if n == result or (not finished and "/attempts/" in n):
                    continue
                if over or rules.collectable(listed[n]):
                    out.add(n)
                elif not finished and _is_fragment(n):
                    live.append(n)
            continue
        if over:
            out.update(names)  # the transaction is over and its version is not kept
            continue
        # Without a result, the attempt records are what tells a restarted
        # coordinator that this txn id may have committed already: they stay while
        # any object of the transaction is young (docs/FORMAT.md §9).
        in_use = not finished and any(not rules.old(listed[n]) for n in names)
        for n in names:
            attempt = "/attempts/" in n
            if attempt and in_use:
                continue
            if rules.collectable(listed[n]):
                out.add(n)
            elif not finished and _is_fragment(n):
                live.append(n)  # no outcome yet: its data is not referenced by a commit
    return out, live


def _is_fragment(name: str) -> bool:
    """A participant's fragment (format 1 ``<i>``, format 2 ``<k>-<nonce>/<i>``),
    not an attempt record, a failure record or the result."""
    last = name.rsplit("/", 1)[1]
    return last.isdigit() and "/attempts/" not in name


async def _list(base: KvStore, prefixes: tuple[str, ...]) -> list[KeyInfo]:
    found = await asyncio.gather(*(base.list_info(p) for p in prefixes))
    return [i for infos in found for i in infos]


async def _young_successors(base: KvStore, versions: list[int], now: float, read_grace: float,
                            mtimes: dict[int, float | None] | None = None) -> set[int]:
    """The versions among ``versions`` whose successor was committed less than
    ``read_grace`` seconds ago (store clock): a reader may have pinned them as
    the newest version just now. ``mtimes``: commit record times already listed."""
    if read_grace <= 0 or not versions:
        return set()

    async def mtime(v: int) -> float | None:
        if mtimes is not None:
            return mtimes.get(v)
        infos = await base.list_info(commit_name(v))
        return next((i.mtime for i in infos if i.key == commit_name(v)), None)

    out: set[int] = set()
    for v in sorted(versions, reverse=True):  # commit times grow with the version
        t = await mtime(v + 1)
        if t is not None and now - t > read_grace:
            break
        out.add(v)
    return out


async def _delete(base: KvStore, names: list[str],
                  on_delete: Callable[[int, int], None] | None = None) -> None:
    sem = asyncio.Semaphore(CONCURRENCY)
    # progress counts what the report lists as deleted (not the collector's own
    # clock probes and expired leases)
    total = sum(1 for n in names if _ORDER[n.split("/", 1)[0]] < _ORDER["gc"])
    done = 0

    async def one(name: str) -> None:
        nonlocal done
        async with sem:
            await base.delete(name)
        if on_delete is not None and _ORDER[name.split("/", 1)[0]] < _ORDER["gc"]:
            done += 1
            on_delete(done, total)

    # kinds in order, so a crash midway never strands data behind deleted nodes
    for kind in sorted(_ORDER, key=_ORDER.__getitem__):
        await asyncio.gather(*(one(n) for n in names if n.startswith(kind + "/")))


def _order(names: set[str]) -> list[str]:
    return sorted(names, key=lambda n: (_ORDER[n.split("/", 1)[0]], n))


# -- prompt reclaim ------------------------------------------------------------------
async def _reclaim(base: KvStore, grace: float, read_grace: float, sweep_interval: float) -> GcReport:
    shared = get_root(base)
    newest = await shared.newest()
    head = await shared.record_at(newest)
    now, clock = await store_now(base)
    wm = await read_watermark(base)
    # the retention state first, then the leases (a reader's lease, then its
    # check of the retention state: one of the two sees the other, FORMAT.md §9.3)
    leases = await read_leases(base, now, shared.leases)
    found = Reclaim()
    deleted = head.deleted if head is not None else []
    if head is not None:
        todo = [v for v in versions_in(deleted) if not ranges_contain(wm.reclaimed, v)]
        pinned = set(leases.pinned) | await _young_successors(base, todo, now, read_grace)
        found = await find_reclaimable(base, shared, shared.read_record, head, wm.reclaimed, pinned)
    rules = _Rules(now, grace, leases)
    txns = {i.key: i for i in await base.list_info("txns/") if _TXN_RE.match(i.key)}
    txn_delete, _live = _txns(txns, rules, None)
    names = set(found.objects) | txn_delete
    await _delete(base, _order(names))
    await delete_expired(base, leases)
    if found.versions:
        await update_watermark(base, found.versions)
    sizes = {**{n: txns[n].size for n in txn_delete}, **found.objects}
    report = GcReport(
        dry_run=False, grace=grace, newest=newest,
        retained_versions=newest - len(versions_in(deleted)), deleted_versions=len(versions_in(deleted)),
        deleted=tuple(sorted(names)), deleted_bytes=sum(s or 0 for s in sizes.values()),
        reclaimed=tuple(sorted(found.objects)), kept_reachable=0, kept_reachable_bytes=0,
        kept_young=(), kept_young_bytes=0, unknown_size=sum(1 for s in sizes.values() if s is None),
        by_kind=kinds(names), deferred_versions=tuple(found.deferred), leases=leases.live,
        expired_leases=leases.expired, clock=clock,
    )
    if wm.swept is not None and now - wm.swept < sweep_interval:
        return report
    full = await _Gc(base, grace, False, False, read_grace).run()
    return merge(report, full)


# -- a full collection ------------------------------------------------------------------
class _Gc:
    def __init__(self, base: KvStore, grace: float, dry_run: bool, reclaim_deleted: bool,
                 read_grace: float, on_delete: Callable[[int, int], None] | None = None) -> None:
        self.base = base
        self.on_delete = on_delete
        self.root = VersionedRoot(base)  # private: its caches die with this run
        self.grace = grace
        self.dry_run = dry_run
        self.reclaim_deleted = reclaim_deleted
        self.read_grace = read_grace
        self.sem = asyncio.Semaphore(CONCURRENCY)
        self.marked: set[str] = set()

    async def run(self) -> GcReport:
        # The order is the proof of FORMAT.md §9.5: now, the writers' leases,
        # the listing, the newest version and what it keeps, the readers'
        # leases, marking, the newest version again; then deletes.
        now, clock = await store_now(self.base)
        own = get_root(self.base).leases
        writers = await read_leases(self.base, now, own)
        # list BEFORE finding the newest version: an object written after the
        # listing is never a candidate, whatever commits meanwhile
        listed: dict[str, KeyInfo] = {}
        commits: dict[int, float | None] = {}
        clocks: list[KeyInfo] = []
        for info in await _list(self.base, ("nodes/", "data/", "changes/", "txns/", "commits/", "gc/")):
            if _OBJECT_RE.match(info.key) or _TXN_RE.match(info.key):
                listed[info.key] = info
            elif m := _COMMIT_RE.match(info.key):
                commits[int(m.group(1))] = info.mtime
            elif _CLOCK_RE.match(info.key):
                clocks.append(info)

        newest = await self.root.newest()
        above = sorted(v for v in commits if v > newest)
        if above:
            raise DataCorruptionError(
                f"gc of versioned store over {self.base!r}: commit record(s) {above[:5]} exist above "
                f"the newest reachable version {newest} (version {newest + 1} is missing); "
                f"refusing to collect"
            )
        records = await self._records(1, newest)
        head = records.get(newest)
        deleted_ranges = head.deleted if head is not None else []
        # readers: their lease, then their check of the retention state; ours:
        # the retention state, then the leases (one of the two sees the other)
        leases = writers.merge(await read_leases(self.base, now, own))
        gone = [v for v in sorted(records) if ranges_contain(deleted_ranges, v)]
        pinned = set(leases.pinned) | await _young_successors(
            self.base, gone, now, self.read_grace, commits)
        kept = [r for v, r in sorted(records.items()) if not ranges_contain(deleted_ranges, v) or v in pinned]

        for rec in records.values():
            if rec.changes_ref is not None:
                self.marked.add(rec.changes_ref)
        nodes: set[str] = set()
        for rec in kept:  # shared subtrees are walked once (nodes is shared)
            await walk(self.root.load_node, rec.root, nodes, self._mark_entry)

        rules = _Rules(now, self.grace, leases)
        committed = {r.txn_id for r in kept if r.txn_id is not None}
        txn_delete, in_flight = _txns(listed, rules, committed)
        await asyncio.gather(*(self._mark_fragment(n) for n in in_flight))
        # versions committed since the newest was read: a fragment found gone
        # above was merged into one of them, a writer whose lease we read first
        # may have published its objects there (§9.5)
        later = await self.root.newest()
        if later > newest:
            for rec in (await self._records(newest + 1, later)).values():
                if rec.changes_ref is not None:
                    self.marked.add(rec.changes_ref)
                await walk(self.root.load_node, rec.root, nodes, self._mark_entry)
                if rec.txn_id is not None:  # committed meanwhile: what answers for its id stays
                    txn_delete = {n for n in txn_delete if not n.startswith(f"txns/{rec.txn_id}/")}
        self.marked |= nodes

        found = Reclaim()
        if self.reclaim_deleted and head is not None and gone:
            wm = await read_watermark(self.base)
            found = await find_reclaimable(
                self.base, self.root, self.root.read_record, head, wm.reclaimed, pinned,
                kept_nodes=nodes, kept_objects=self.marked,
            )
        reclaimed = {n for n in found.objects if n in listed and n not in self.marked}

        to_delete: set[str] = set(reclaimed) | txn_delete
        kept_young: list[str] = []
        kept_leased: list[str] = []
        kept_ref = kept_ref_bytes = 0
        for name, info in listed.items():
            if name in to_delete:
                continue
            if name in self.marked:
                kept_ref += 1
                kept_ref_bytes += info.size or 0
            elif not rules.old(info):
                kept_young.append(name)
            elif leases.protects(info.mtime):
                kept_leased.append(name)
            elif name.startswith("txns/"):
                # what _txns keeps answers "did this id commit?": referenced by its id
                kept_ref += 1
                kept_ref_bytes += info.size or 0
            else:
                to_delete.add(name)

        stale = [i.key for i in clocks if rules.old(i)]
        temporaries = await self._temporaries(now, leases)
        order = _order(to_delete)
        if not self.dry_run:
            await _delete(self.base, order + stale, self.on_delete)
            await delete_expired(self.base, leases)
            await update_watermark(self.base, found.versions, swept=now)
        return GcReport(
            dry_run=self.dry_run,
            grace=self.grace,
            newest=newest,
            retained_versions=newest - len(gone),
            deleted_versions=len(gone),
            deleted=tuple(sorted(to_delete)),
            deleted_bytes=sum(listed[n].size or 0 for n in to_delete),
            reclaimed=tuple(sorted(reclaimed)),
            kept_reachable=kept_ref,
            kept_reachable_bytes=kept_ref_bytes,
            kept_young=tuple(sorted(kept_young)),
            kept_young_bytes=sum(listed[n].size or 0 for n in kept_young),
            unknown_size=sum(1 for n in to_delete if listed[n].size is None),
            by_kind=kinds(to_delete),
            kept_leased=tuple(sorted(kept_leased)),
            deferred_versions=tuple(v for v in gone if v in pinned),
            leases=leases.live,
            expired_leases=leases.expired,
            temporaries=tuple(temporaries),
            clock=clock,
        )

    async def _temporaries(self, now: float, leases: Leases) -> list[str]:
        """Temporaries of crashed writers the base store keeps (a file store's
        ``.__tsp__/``), older than the grace and than every live writer."""
        sweep: Callable[..., Any] | None = getattr(self.base, "sweep_temporaries", None)
        if sweep is None:
            return []
        older_than = self.grace
        if leases.protect_from is not None:
            if math.isinf(leases.protect_from):
                return []
            older_than = max(older_than, now - leases.protect_from)
        return sorted(await sweep(older_than, dry_run=self.dry_run))

    def _mark_entry(self, key: str, entry: Any) -> None:
        if isinstance(entry, RefEntry):
            self.marked.add(entry.object)

    async def _records(self, first: int, last: int) -> dict[int, CommitRecord]:
        """The commit records ``first..last``; a missing one aborts the collection."""

        async def one(v: int) -> CommitRecord:
            async with self.sem:
                rec = await self.root.read_record(v)
            if rec is None:
                raise DataCorruptionError(
                    f"gc of versioned store over {self.base!r}: commit record of version {v} "
                    f"is missing (newest is {last}); refusing to collect"
                )
            return rec

        recs = await asyncio.gather(*(one(v) for v in range(first, last + 1)))
        return {r.version: r for r in recs}

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

