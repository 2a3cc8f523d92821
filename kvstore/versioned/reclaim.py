"""Prompt reclaim of deleted versions, reading only what changed (FORMAT.md §9.2, §9.4).

Objects reachable from deleted versions but from no kept one may go at once
(the argument of FORMAT.md §9.2: no writer in flight can publish a reference
to them). Finding them must not cost the whole history, so:

* **the watermark** ``gc/reclaimed`` lists the deleted versions already
  reclaimed; a reclaim handles only the others (:func:`read_watermark`,
  :func:`update_watermark`);
* **the contiguous-range argument**: the versions referencing an object form
  one range, so an object of a deleted version ``d`` is referenced by some
  kept version iff it is referenced by the nearest kept version below ``d`` or
  the nearest above. A run of consecutive deleted versions therefore needs the
  trees of its not yet reclaimed versions and of its two neighbours, nothing
  else: a reclaim after a save reads the newest record, the watermark, a few
  records and those trees.

A *kept* version is a retained one, or a deleted one that a live reader lease
pins or whose successor was committed less than ``read_grace`` seconds ago:
such a version splits runs like a retained one and is reclaimed by a later
run. Data objects are deleted before the nodes that reference them, and the
watermark is extended only after the deletes, so a reclaim that dies midway
leaves nothing a later one can not find (missing nodes of deleted versions are
skipped).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tensorstore_py.core.errors import ConditionFailedError, DataCorruptionError, UnsupportedError
from tensorstore_py.kvstore.base import Generation, KvStore
from tensorstore_py.kvstore.versioned.format import (
    FORMAT,
    CommitRecord,
    RefEntry,
    frame,
    ranges_add,
    ranges_contain,
    unframe,
)
from tensorstore_py.kvstore.versioned.root import VersionedRoot, missing_object
from tensorstore_py.kvstore.versioned.tree import Leaf, Node, decode_node, walk

__all__ = [
    "MAGIC_WATERMARK", "WATERMARK", "Reclaim", "Watermark", "find_reclaimable", "read_watermark",
    "update_watermark", "versions_in",
]

MAGIC_WATERMARK = b"TSW1"
WATERMARK = "gc/reclaimed"
#: concurrent object reads
CONCURRENCY = 64
#: attempts of the watermark's compare-and-swap against concurrent collectors
_CAS_ATTEMPTS = 8
#: what a missing or broken node of a deleted version counts as (already reclaimed)
_EMPTY: Node = Leaf([], [])


def versions_in(ranges: Iterable[list[int]]) -> list[int]:
    return [v for a, b in ranges for v in range(a, b + 1)]


# -- the watermark -----------------------------------------------------------------
@dataclass(frozen=True)
class Watermark:
    """``gc/reclaimed``: deleted versions already reclaimed (ranges, as ``deleted``
    in commit records) and the store time of the last full sweep (None: never)."""

    reclaimed: list[list[int]] = field(default_factory=list)
    swept: float | None = None
    generation: Generation = Generation.NO_VALUE


async def read_watermark(base: KvStore) -> Watermark:
    """The watermark (empty when missing or unreadable: a later reclaim then walks
    every deleted version once, which is safe)."""
    res = await base.read(WATERMARK)
    if res.state != "value":
        return Watermark()
    try:
        body = unframe(MAGIC_WATERMARK, res.value, WATERMARK)
        ranges = ranges_add(
            [[int(a), int(b)] for a, b in body.get("reclaimed") or [] if 1 <= int(a) <= int(b)], []
        ) if isinstance(body, dict) else []
        swept = body.get("swept") if isinstance(body, dict) else None
    except (DataCorruptionError, TypeError, ValueError, AttributeError):
        return Watermark(generation=res.generation)
    swept = float(swept) if isinstance(swept, (int, float)) and not isinstance(swept, bool) else None
    return Watermark(ranges, swept, res.generation)


async def update_watermark(base: KvStore, add: list[int], *, swept: float | None = None) -> None:
    """Add ``add`` to the reclaimed versions (and record a sweep at store time
    ``swept``), merging with concurrent collectors by compare-and-swap."""
    for _ in range(_CAS_ATTEMPTS):
        wm = await read_watermark(base)
        ranges = ranges_add(wm.reclaimed, add)
        new_swept = max(s for s in (wm.swept, swept, float("-inf")) if s is not None)
        if ranges == wm.reclaimed and new_swept == (wm.swept if wm.swept is not None else float("-inf")):
            return
        body = {"format": FORMAT, "reclaimed": ranges,
                "swept": None if new_swept == float("-inf") else new_swept}
        try:
            await base.write(WATERMARK, frame(MAGIC_WATERMARK, body), if_equal=wm.generation)
            return
        except ConditionFailedError:
            continue  # another collector wrote it: merge with theirs
        except UnsupportedError:  # no compare-and-swap here: last writer wins (costs re-walks only)
            await base.write(WATERMARK, frame(MAGIC_WATERMARK, body))
            return


# -- finding what a reclaim deletes --------------------------------------------------------
@dataclass
class Reclaim:
    """The outcome of :func:`find_reclaimable` (nothing deleted yet).

    ``objects`` maps each object to delete to its size in bytes where known
    (a lower bound for packed data objects); ``versions`` are the deleted
    versions this reclaim completes (for the watermark); ``deferred`` the
    deleted versions kept for now (pinned, or inside ``read_grace``).
    """

    objects: dict[str, int | None] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)
    deferred: list[int] = field(default_factory=list)
    reads: int = 0


class _Trees:
    """Node loading for a reclaim (sizes recorded, reads counted)."""

    def __init__(self, base: KvStore, shared: VersionedRoot, sem: asyncio.Semaphore) -> None:
        self.base = base
        self.shared = shared
        self.sem = sem
        self.reads = 0
        self.sizes: dict[str, int] = {}
        self.present: set[str] = set()
        self._loaded: dict[str, Node] = {}

    async def _get(self, name: str, strict: bool) -> Node:
        # kept trees may come from the process's cache; a deleted version's nodes
        # are read, so that what is reported deleted existed (an earlier run
        # may have taken them)
        node = self._loaded.get(name) or (self.shared.cache.get(name) if strict else None)
        if node is not None:
            self.present.add(name)
            return node
        async with self.sem:
            res = await self.base.read(name)
        self.reads += 1
        if res.state != "value":
            if strict:
                raise missing_object(name, f"versioned store {self.base!r}: index node {name!r} of a "
                                     f"kept version is missing; refusing to reclaim")
            return _EMPTY
        try:
            node = decode_node(res.value, name)
        except DataCorruptionError:
            if strict:
                raise
            return _EMPTY
        self.sizes[name] = len(res.value)
        self.present.add(name)
        self._loaded[name] = node
        return node

    async def kept(self, name: str) -> Node:
        return await self._get(name, True)

    async def gone(self, name: str) -> Node:
        return await self._get(name, False)


async def find_reclaimable(
    base: KvStore,
    shared: VersionedRoot,
    record: Any,
    head: CommitRecord,
    done: list[list[int]],
    pinned: set[int],
    *,
    kept_nodes: set[str] | None = None,
    kept_objects: set[str] | None = None,
) -> Reclaim:
    """What prompt reclaim may delete now (see the module doc).

    ``record(v)`` returns the commit record of version ``v`` (a coroutine);
    ``head`` is the newest record (its ``deleted`` ranges); ``done`` the
    watermark's reclaimed ranges; ``pinned`` the deleted versions to keep for
    now. ``kept_nodes`` / ``kept_objects``: what a caller already marked from
    kept versions (a full collection), so their trees need no second walk.
    Raises DataCorruptionError when a neighbour's tree can not be walked.
    """
    out = Reclaim()
    todo = [v for v in versions_in(head.deleted) if not ranges_contain(done, v)]
    out.deferred = [v for v in todo if v in pinned]
    todo_set = {v for v in todo if v not in pinned}
    if not todo_set:
        return out
    # runs: maximal stretches of deleted, unpinned versions holding work to do
    runs: list[tuple[int, int]] = []
    for a, b in head.deleted:
        start = a
        for v in [*(p for p in sorted(pinned) if a <= p <= b), b + 1]:
            if start <= v - 1 and any(start <= t <= v - 1 for t in todo_set):
                runs.append((start, v - 1))
            start = v + 1
    neighbours = sorted({v for a, b in runs for v in (a - 1, b + 1) if v >= 1})
    sem = asyncio.Semaphore(CONCURRENCY)
    trees = _Trees(base, shared, sem)

    async def rec(v: int) -> CommitRecord:
        async with sem:
            r = await record(v)
        if r is None:
            raise DataCorruptionError(f"versioned store {base!r}: commit record of version {v} is missing; "
                                      f"refusing to reclaim")
        return r  # type: ignore[no-any-return]

    keep_nodes: set[str] = set(kept_nodes or ())
    keep_objects: set[str] = set(kept_objects or ())

    def keep_entry(_key: str, e: Any) -> None:
        if isinstance(e, RefEntry):
            keep_objects.add(e.object)

    if kept_nodes is None:
        for r in await asyncio.gather(*(rec(v) for v in neighbours)):
            await walk(trees.kept, r.root, keep_nodes, keep_entry)
    gone_versions = sorted(v for a, b in runs for v in range(a, b + 1) if v in todo_set)
    seen = set(keep_nodes)
    extents: dict[str, int] = {}

    def gone_entry(_key: str, e: Any) -> None:
        if isinstance(e, RefEntry) and e.object not in keep_objects:
            extents[e.object] = max(extents.get(e.object, 0), e.offset + e.length)

    for r in await asyncio.gather(*(rec(v) for v in gone_versions)):
        await walk(trees.gone, r.root, seen, gone_entry)
    for name in sorted((seen - keep_nodes) & trees.present):
        out.objects[name] = trees.sizes.get(name)
    for name, size in extents.items():
        out.objects[name] = size
    out.versions = gone_versions
    out.reads = trees.reads
    return out
