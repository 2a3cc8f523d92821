"""A full consistency walk of a versioned store (docs/FORMAT.md).

::

    problems = verify(kv).result()     # kv: a versioned store, or its base store
    for p in problems:
        print(p)                        # names the object, the version and what is wrong

What is checked, reading everything from the base store (never from a cache):

* every commit record ``1..newest`` exists (versions are dense), passes its
  crc32c, decodes, names its own version and parent, and its ``changes_ref``
  (if any) decodes. ``newest`` is the highest version anything names: probing
  (FORMAT.md §6.1), the ``latest`` hint, the listing of ``commits/`` and the
  results of multi-writer transactions. So a deleted first record, a gap, or
  a deleted newest record (which silently rolls readers back) is reported,
  as far as the hint, a listing or a result still names the lost version;
* the retention state of the newest record: deleted ranges are sorted,
  disjoint, within ``1..newest-1``; every tag names an existing, retained version;
* for every retained version, its whole index tree: every node passes its
  crc32c and decodes, its references are well formed, keys are strictly
  increasing, every child's keys lie in the range the lookup rule sends to it,
  the per-child key counts and the record's ``count`` are right;
* every value in those trees: the data object exists, the range lies inside it
  and the value's crc32c matches (inline values are covered by the node checksum).

Deleted versions are not walked (garbage collection may have reclaimed their
objects); their commit records are still checked. Shared subtrees are walked
once; a problem in an object several versions share names the oldest retained
version holding it, whatever order the concurrent walk took. The walk only reads; it never writes or repairs. I/O errors of the base
store propagate (they say nothing about the stored bytes); every problem found
in the stored bytes is returned, not raised.

:func:`audit` returns the problems together with the *unreferenced* objects
(when the base store lists): ``nodes/``, ``data/`` and ``changes/`` objects no
retained version references -- left by interrupted writes (a first save that
died before its commit leaves nothing else) or by deleted versions not yet
reclaimed. They are not problems (garbage collection deletes them), but a
tool should say they are there.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c_lib

from tensorstore_py.core.errors import ChecksumError, DataCorruptionError, UnsupportedError
from tensorstore_py.core.future import Future, spawn
from tensorstore_py.core.pools import run_cpu
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.versioned.format import (
    MAGIC_CHANGES,
    MAGIC_RESULT,
    CommitRecord,
    InlineEntry,
    RefEntry,
    commit_name,
    crc32c,
    ranges_contain,
    unframe,
)
from tensorstore_py.kvstore.versioned.root import base_of, probe_newest, read_hint
from tensorstore_py.kvstore.versioned.tree import Inner, Leaf, Node, decode_node

__all__ = ["Audit", "Problem", "audit", "base_of", "verify"]

#: concurrent object reads of the walk
READ_CONCURRENCY = 32
#: data objects checked at once
DATA_CONCURRENCY = 4
#: most bytes of a data object held in memory at once
PIECE = 64 * 1024 * 1024

_COMMIT_RE = re.compile(r"commits/([0-9]{20})\Z")
_OBJECT_RE = re.compile(r"(nodes|data|changes)/[0-9a-f]{32}\Z")
_RESULT_RE = re.compile(r"txns/[A-Za-z0-9_.\-]{1,128}/result\Z")

Progress = Callable[[str, int], None]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the stored bytes.

    ``object`` is the base-store object at fault (``commits/...``, ``nodes/...``,
    ``data/...``, ``changes/...``); ``kind`` is one of ``"missing"``,
    ``"checksum"``, ``"corrupt"``, ``"structure"``; ``version`` is a version
    whose content depends on the object (None when not tied to one).
    """

    object: str
    kind: str
    message: str
    version: int | None = None

    def __str__(self) -> str:
        at = f" (version {self.version})" if self.version is not None else ""
        return f"{self.kind}: {self.object}{at}: {self.message}"


@dataclass(frozen=True)
class Audit:
    """What :func:`audit` found: ``problems`` (as :func:`verify` returns them),
    ``newest`` (the newest version a reader reaches) and ``unreferenced``
    (object -> size in bytes, None if unknown; empty when the store can not list)."""

    problems: list[Problem]
    newest: int
    unreferenced: dict[str, int | None]
    #: bytes read from the base store
    bytes_read: int = 0
    #: bytes checked against a checksum: records, nodes, change lists, values
    bytes_verified: int = 0


def verify(store: KvStore, *, progress: Progress | None = None) -> Future[list[Problem]]:
    """Check every checksum and reference of ``store``'s history (see the module doc).

    ``store`` is a versioned store (its whole history is checked, whatever its
    path or snapshot) or the base store holding one. ``progress(what, n)`` is
    called as work is done, for progress displays: ``what`` in "records",
    "nodes", "values" (``n`` objects or values checked), "bytes" (``n`` bytes
    read) and, once after listing the store, "listed_bytes" (the size of every
    object under the format's prefixes: an upper bound of the bytes the walk reads). Resolves to the problems found, in a stable order;
    an empty list means the store is sound.
    """

    async def run() -> list[Problem]:
        return (await _Walker(base_of(store), progress).run()).problems

    return spawn(run())


def audit(store: KvStore, *, progress: Progress | None = None) -> Future[Audit]:
    """:func:`verify`, plus the objects no retained version references (see the module doc)."""
    return spawn(_Walker(base_of(store), progress).run())


def _exc_kind(e: DataCorruptionError) -> str:
    return "checksum" if isinstance(e, ChecksumError) else "corrupt"


@dataclass
class _Sub:
    """Summary of a verified subtree: key count and key range (None if broken)."""

    count: int
    first: str | None
    last: str | None


class _Walker:
    def __init__(self, base: KvStore, progress: Progress | None) -> None:
        self.base = base  # everything is read from it, nothing from a cache
        self.progress = progress
        self.problems: list[Problem] = []
        self.sem = asyncio.Semaphore(READ_CONCURRENCY)
        self.subtrees: dict[str, asyncio.Task[_Sub | None]] = {}
        self.children: dict[str, list[str]] = {}  # inner node -> its children
        # data object -> {(offset, length, crc): (key, leaf node, other leaf nodes...)}
        self.values: dict[str, dict[tuple[int, int, int], tuple[str, ...]]] = defaultdict(dict)
        # problems of shared objects, named with a version once the walk is over
        self.in_nodes: list[tuple[Problem, str]] = []
        # node -> the oldest retained version whose tree holds it (after the walk)
        self.first: dict[str, int] = {}
        self.bytes_read = 0
        self.bytes_verified = 0

    def _problem(self, obj: str, kind: str, message: str, version: int | None = None) -> None:
        self.problems.append(Problem(obj, kind, message, version))

    def _node_problem(self, obj: str, kind: str, message: str, node: str) -> None:
        """A problem found through index node ``node``: the version it names is the
        oldest retained one holding ``node``, known when the walk is over."""
        self.in_nodes.append((Problem(obj, kind, message), node))

    async def _read(self, name: str, byte_range: slice | None = None) -> Any:
        """``base.read``, counting the bytes read."""
        res = await self.base.read(name, byte_range=byte_range)
        if res.state == "value":
            n = memoryview(res.value).nbytes
            self.bytes_read += n
            self._tick("bytes", n)
        return res

    def _tick(self, what: str, n: int = 1) -> None:
        if self.progress is not None:
            self.progress(what, n)

    async def run(self) -> Audit:
        reached = await self._newest()
        listed = await self._listing()
        newest, why = reached, ""
        for v, what in await self._evidence(reached, listed):
            if v > newest:
                newest, why = v, what
        records = await self._records(newest, reached, why)
        head = records[max(records)] if records else None
        deleted = head.deleted if head is not None else []
        if head is not None:
            self._check_retention(head)
        retained = [
            rec for v, rec in sorted(records.items()) if not ranges_contain(deleted, v)
        ]
        await asyncio.gather(*(self._check_version(rec) for rec in retained))
        self._name_versions(retained)
        await self._check_values()
        for p, node in self.in_nodes:
            self.problems.append(Problem(p.object, p.kind, p.message, self.first.get(node)))
        order = {"commits": 0, "changes": 1, "nodes": 2, "data": 3}
        self.problems.sort(
            key=lambda p: (order.get(p.object.split("/", 1)[0], 9), p.object, p.version or 0, p.message)
        )
        referenced = set(self.subtrees) | set(self.values)
        referenced |= {r.changes_ref for r in records.values() if r.changes_ref is not None}
        unreferenced = {
            i.key: i.size for i in listed or [] if _OBJECT_RE.match(i.key) and i.key not in referenced
        }
        return Audit(self.problems, reached, unreferenced, self.bytes_read, self.bytes_verified)

    def _name_versions(self, retained: list[CommitRecord]) -> None:
        """Each walked node -> the oldest retained version whose tree holds it."""
        for rec in retained:  # oldest first
            stack = [rec.root] if rec.root is not None else []
            while stack:
                name = stack.pop()
                if name not in self.first:
                    self.first[name] = rec.version
                    stack.extend(self.children.get(name, ()))

    async def _listing(self) -> list[Any] | None:
        """Every object under the format's prefixes (None: the store can not list)."""
        try:
            found = await asyncio.gather(*(self.base.list_info(p) for p in
                                           ("commits/", "nodes/", "data/", "changes/", "txns/")))
        except UnsupportedError:
            return None
        listed = [i for infos in found for i in infos]
        self._tick("listed_bytes", sum(i.size or 0 for i in listed))
        return listed

    async def _evidence(self, reached: int, listed: list[Any] | None) -> list[tuple[int, str]]:
        """Versions something names beyond the reachable newest: (version, what)."""
        out: list[tuple[int, str]] = []
        hint = await read_hint(self.base)
        if hint > reached:
            out.append((hint, "the 'latest' hint"))
        for info in listed or []:
            m = _COMMIT_RE.match(info.key)
            if m and int(m.group(1)) > reached:
                out.append((int(m.group(1)), f"the listing ({info.key!r} exists)"))
        results = [i.key for i in listed or [] if _RESULT_RE.match(i.key)]

        async def result(name: str) -> None:
            async with self.sem:
                res = await self._read(name)
            try:
                body = unframe(MAGIC_RESULT, res.value, name) if res.state == "value" else None
            except DataCorruptionError:
                return  # an unreadable result says nothing about the records
            v = body.get("version") if isinstance(body, dict) else None
            if isinstance(v, int) and not isinstance(v, bool) and v > reached:
                out.append((v, f"the multi-writer result {name!r}"))

        await asyncio.gather(*(result(n) for n in results))
        return out

    # -- commit records --------------------------------------------------------------
    async def _exists(self, v: int) -> bool:
        # existence only: a corrupt record must be reported, not stop the probe
        return v == 0 or (await self._read(commit_name(v), byte_range=slice(0, 1))).state == "value"

    async def _newest(self) -> int:
        """The newest version, probing as FORMAT.md §6.1 without decoding records."""
        return await probe_newest(self._exists, 0, await read_hint(self.base))

    async def _records(self, newest: int, reached: int, why: str) -> dict[int, CommitRecord]:
        out: dict[int, CommitRecord] = {}

        async def one(v: int) -> None:
            name = commit_name(v)
            async with self.sem:
                res = await self._read(name)
            self._tick("records")
            if res.state != "value":
                if v > reached:
                    self._problem(name, "missing", f"commit record of version {v} is missing: {why} "
                                  f"names version {newest}, but readers reach only version {reached} "
                                  f"(a lost record rolls the store back)", v)
                else:
                    self._problem(name, "missing", f"commit record of version {v} is missing "
                                  f"(versions 1..{newest} must all exist)", v)
                return
            try:
                rec = CommitRecord.decode(res.value, name)
            except DataCorruptionError as e:
                self._problem(name, _exc_kind(e), str(e), v)
                return
            self.bytes_verified += len(res.value)
            if rec.parent != v - 1:
                self._problem(name, "corrupt", f"parent is {rec.parent}, expected {v - 1}", v)
            if rec.root is None and rec.count != 0:
                self._problem(name, "corrupt", f"empty tree (root nil) but count {rec.count}", v)
            if rec.changes_ref is not None:
                await self._check_changes(rec)
            out[v] = rec

        await asyncio.gather(*(one(v) for v in range(1, newest + 1)))
        return out

    async def _check_changes(self, rec: CommitRecord) -> None:
        ref = rec.changes_ref
        assert ref is not None
        async with self.sem:
            res = await self._read(ref)
        if res.state != "value":
            self._problem(ref, "missing", f"changes object of version {rec.version} is missing", rec.version)
            return
        try:
            body = unframe(MAGIC_CHANGES, res.value, ref)
        except DataCorruptionError as e:
            self._problem(ref, _exc_kind(e), str(e), rec.version)
            return
        self.bytes_verified += len(res.value)
        keys = body.get("keys") if isinstance(body, dict) else None
        if (
            not isinstance(keys, list)
            or not all(isinstance(k, str) for k in keys)
            or any(a >= b for a, b in itertools.pairwise(keys))
        ):
            self._problem(ref, "corrupt", "'keys' is not a sorted list of unique keys", rec.version)

    def _check_retention(self, head: CommitRecord) -> None:
        name = commit_name(head.version)
        prev = None
        for a, b in head.deleted:
            if a > b or a < 1 or b >= head.version or (prev is not None and a <= prev + 1):
                self._problem(
                    name, "corrupt",
                    f"deleted ranges {head.deleted!r} are not sorted, disjoint, non-adjacent "
                    f"ranges within 1..{head.version - 1}", head.version,
                )
                break
            prev = b
        for tag, v in sorted(head.tags.items()):
            if not 1 <= v <= head.version or ranges_contain(head.deleted, v):
                self._problem(name, "corrupt", f"tag {tag!r} names version {v}, which does not "
                              f"exist or was deleted", head.version)

    # -- trees -------------------------------------------------------------------------
    async def _check_version(self, rec: CommitRecord) -> None:
        if rec.root is None:
            return
        sub = await self._subtree(rec.root)
        if sub is not None and sub.count != rec.count:
            self._problem(commit_name(rec.version), "structure",
                          f"record says {rec.count} keys, the tree holds {sub.count}", rec.version)

    def _subtree(self, name: str) -> asyncio.Task[_Sub | None]:
        task = self.subtrees.get(name)
        if task is None:  # shared subtrees are verified once
            task = self.subtrees[name] = asyncio.ensure_future(self._node(name))
        return task

    def _pending_reaches(self, start: str, target: str) -> bool:
        """Whether ``target`` is ``start`` or below it through nodes whose walk
        is still running (a finished walk can not be waiting on ``target``)."""
        stack, seen = [start], set()
        while stack:
            n = stack.pop()
            if n == target:
                return True
            task = self.subtrees.get(n)
            if n in seen or task is None or task.done():
                continue
            seen.add(n)
            stack.extend(self.children.get(n, ()))
        return False

    async def _load(self, name: str) -> Node | None:
        async with self.sem:
            res = await self._read(name)
        self._tick("nodes")
        if res.state != "value":
            self._node_problem(name, "missing", "index node is missing", name)
            return None
        try:
            node = decode_node(res.value, name)
        except DataCorruptionError as e:
            self._node_problem(name, _exc_kind(e), str(e), name)
            return None
        self.bytes_verified += len(res.value)
        return node

    async def _node(self, name: str) -> _Sub | None:
        node = await self._load(name)
        if node is None:
            return None
        if isinstance(node, Leaf):
            for key, entry in zip(node.keys, node.entries):
                if isinstance(entry, RefEntry):
                    refs = self.values[entry.object]
                    at = (entry.offset, entry.length, entry.crc)
                    refs[at] = refs.get(at, (key,)) + (name,)  # every leaf: see _version_of
                elif not isinstance(entry, InlineEntry):  # pragma: no cover - decode guarantees
                    self._node_problem(name, "corrupt", f"key {key!r}: unknown entry", name)
            if not node.keys:
                return _Sub(0, None, None)
            return _Sub(len(node.keys), node.keys[0], node.keys[-1])
        return await self._inner(name, node)

    async def _inner(self, name: str, node: Inner) -> _Sub | None:
        self.children[name] = list(node.children)
        for child in node.children:
            if self._pending_reaches(child, name):
                # a node below itself: waiting on that child would wait forever
                self._node_problem(name, "structure", f"the index references itself: child "
                                   f"{child!r} leads back to node {name!r} (a cycle)", name)
                return None
        subs = await asyncio.gather(*(self._subtree(c) for c in node.children))
        ok = True
        total = 0
        first = last = None
        for i, (child, sub) in enumerate(zip(node.children, subs)):
            if sub is None:
                ok = False
                continue
            if sub.count != node.counts[i]:
                self._node_problem(name, "structure", f"child {i} ({child}) holds {sub.count} keys, "
                                   f"the node says {node.counts[i]}", name)
            total += sub.count
            if sub.first is None or sub.last is None:
                continue
            # the lookup rule sends keys in [k[i], k[i+1]) to child i (child 0: below k[1])
            lo = node.keys[i] if i > 0 else None
            hi = node.keys[i + 1] if i + 1 < len(node.keys) else None
            if (lo is not None and sub.first < lo) or (hi is not None and sub.last >= hi):
                self._node_problem(name, "structure", f"child {i} ({child}) holds keys "
                                   f"{sub.first!r}..{sub.last!r} outside its range [{lo!r}, {hi!r})", name)
            first = sub.first if first is None else first
            last = sub.last
        if not ok:
            return None
        return _Sub(total, first, last)

    # -- values ------------------------------------------------------------------------
    async def _check_values(self) -> None:
        sem = asyncio.Semaphore(DATA_CONCURRENCY)

        async def one(obj: str, entries: dict[tuple[int, int, int], tuple[str, ...]]) -> None:
            span = max(off + length for off, length, _ in entries)
            async with sem:
                if span <= PIECE:  # packed objects: one read covers every value
                    res = await self._read(obj, byte_range=slice(0, span))
                    bad = None if res.state != "value" else await run_cpu(_check_object, res.value, sorted(entries))
                else:  # big values: streamed in pieces, so memory stays bounded
                    bad = await self._check_streamed(obj, sorted(entries))
            if bad is None:
                key = entries[min(entries)][0]
                v = min((v for ref in entries.values() if (v := self._version_of(ref)) is not None),
                        default=None)
                self._problem(obj, "missing", f"data object is missing ({len(entries)} values, "
                              f"e.g. key {key!r})", v)
                return
            self._tick("values", len(entries))
            self.bytes_verified += sum(length for _, length, _ in entries)
            for (off, length, crc), what in bad:
                ref = entries[(off, length, crc)]
                self._problem(obj, "checksum" if what == "crc" else "corrupt",
                              f"key {ref[0]!r}: value at offset {off}, length {length}: "
                              + ("crc32c mismatch" if what == "crc" else
                                 "extends past the end of the object"), self._version_of(ref))

        await asyncio.gather(*(one(o, e) for o, e in sorted(self.values.items())))

    def _version_of(self, ref: tuple[str, ...]) -> int | None:
        """The oldest retained version holding a value (``ref``: its key, then
        the leaf nodes referencing it)."""
        found = [self.first[leaf] for leaf in ref[1:] if leaf in self.first]
        return min(found) if found else None

    async def _check_streamed(
        self, obj: str, entries: list[tuple[int, int, int]]
    ) -> list[tuple[tuple[int, int, int], str]] | None:
        """Check each value by reading it in :data:`PIECE`-sized ranges; None if missing."""
        bad = []
        for off, length, crc in entries:
            got, pos = 0, off
            while True:
                stop = min(off + length, pos + PIECE)
                res = await self._read(obj, byte_range=slice(pos, stop))
                if res.state != "value":
                    return None
                got = await run_cpu(_crc_more, res.value, got)
                if len(res.value) < stop - pos:
                    bad.append(((off, length, crc), "range"))
                    break
                pos = stop
                if pos >= off + length:
                    if got != crc:
                        bad.append(((off, length, crc), "crc"))
                    break
        return bad


def _crc_more(data: Any, crc: int) -> int:
    return int(_crc32c_lib.crc32c(data, crc))


def _check_object(data: Any, entries: list[tuple[int, int, int]]) -> list[tuple[tuple[int, int, int], str]]:
    """The entries of one data object whose range or crc32c is wrong."""
    mv = memoryview(data).cast("B")
    bad = []
    for off, length, crc in entries:
        if off + length > len(mv):
            bad.append(((off, length, crc), "range"))
        elif crc32c(mv[off:off + length]) != crc:
            bad.append(((off, length, crc), "crc"))
    return bad
