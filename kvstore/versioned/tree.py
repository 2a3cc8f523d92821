"""The copy-on-write B+tree index (docs/FORMAT.md §4).

Nodes are immutable objects ``nodes/<hex32>``. :class:`TreeWriter` applies a
sorted batch of changes to a tree by merging it down the tree: only the
children a change falls into are loaded and rewritten, concurrently, so one
changed key costs one node per level and a bulk load builds each leaf once.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tensorstore_py.core.errors import DataCorruptionError, InvalidArgumentError
from tensorstore_py.kvstore.versioned.format import (
    MAGIC_NODE,
    Entry,
    check_ref,
    decode_entry,
    frame,
    new_name,
    unframe,
)

__all__ = [
    "MAX_DEPTH", "Inner", "Leaf", "Node", "NodeCache", "TreeWriter", "decode_node", "lookup", "scan",
    "too_deep", "walk",
]

#: most entries per leaf / children per inner node written by this implementation
MAX_FANOUT = 256
#: most levels below a root: a tree of 2 children per node this deep would hold
#: 2**64 keys, so a deeper descent means an index that references itself
MAX_DEPTH = 64


def too_deep(name: str, root: str | None) -> DataCorruptionError:
    """The error for a descent past MAX_DEPTH (a cycle in the index)."""
    return DataCorruptionError(
        f"versioned store: node {name!r} lies more than {MAX_DEPTH} levels below root {root!r}: "
        f"the index references itself (a cycle) or is otherwise corrupt"
    )


@dataclass(frozen=True, slots=True)
class Leaf:
    keys: list[str]
    entries: list[Entry]


@dataclass(frozen=True, slots=True)
class Inner:
    keys: list[str]
    children: list[str]
    counts: list[int]


Node = Leaf | Inner
Change = tuple[str, Entry | None]  # (key, new entry or None = delete)
Loader = Callable[[str], Awaitable[Node]]


def encode_node(node: Node) -> bytes:
    if isinstance(node, Leaf):
        return frame(MAGIC_NODE, {"t": "leaf", "k": node.keys, "v": [e.encode() for e in node.entries]})
    return frame(MAGIC_NODE, {"t": "inner", "k": node.keys, "c": node.children, "n": node.counts})


def _increasing(keys: list[Any]) -> bool:
    return all(isinstance(k, str) for k in keys) and all(a < b for a, b in itertools.pairwise(keys))


def decode_node(data: Any, name: str) -> Node:
    """Verify, decode and validate a node object."""
    body = unframe(MAGIC_NODE, data, name)
    where = f"node {name!r}"
    if not isinstance(body, dict) or body.get("t") not in ("leaf", "inner"):
        raise DataCorruptionError(f"versioned store: {where} is not a leaf or inner node")
    keys = body.get("k")
    if not isinstance(keys, list) or not _increasing(keys):
        raise DataCorruptionError(f"versioned store: {where}: keys missing or not increasing")
    if body["t"] == "leaf":
        raw = body.get("v")
        if not isinstance(raw, list) or len(raw) != len(keys):
            raise DataCorruptionError(f"versioned store: {where}: {len(keys)} keys but entries {raw!r:.80}")
        return Leaf(keys, [decode_entry(e, where) for e in raw])
    children, counts = body.get("c"), body.get("n")
    if (
        not isinstance(children, list) or not isinstance(counts, list)
        or len(children) != len(keys) or len(counts) != len(keys) or not keys
        or not all(isinstance(n, int) and n >= 0 for n in counts)
    ):
        raise DataCorruptionError(f"versioned store: {where}: malformed inner node")
    for c in children:
        check_ref("nodes", c, where)
    return Inner(keys, children, counts)


class NodeCache:
    """A bounded LRU of decoded nodes (immutable, so never invalidated).

    A decoded full leaf takes up to ~100 KB, so the default bound of 1024
    nodes keeps a root's cache near 100 MB at worst; hot inner nodes stay.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._d: OrderedDict[str, Node] = OrderedDict()

    def get(self, name: str) -> Node | None:
        node = self._d.get(name)
        if node is not None:
            self._d.move_to_end(name)
        return node

    def put(self, name: str, node: Node) -> None:
        self._d[name] = node
        self._d.move_to_end(name)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)


def _child_index(keys: list[str], key: str) -> int:
    return max(0, bisect.bisect_right(keys, key) - 1)


async def lookup(load: Loader, root: str | None, key: str) -> Entry | None:
    """The entry of ``key`` in the tree ``root`` (None = absent)."""
    if root is None:
        return None
    node = await load(root)
    depth = 0
    while isinstance(node, Inner):
        child = node.children[_child_index(node.keys, key)]
        depth += 1
        if depth > MAX_DEPTH:
            raise too_deep(child, root)
        node = await load(child)
    i = bisect.bisect_left(node.keys, key)
    if i < len(node.keys) and node.keys[i] == key:
        return node.entries[i]
    return None


async def scan(load: Loader, root: str | None, prefix: str) -> list[tuple[str, Entry]]:
    """All (key, entry) with ``key.startswith(prefix)``, sorted by key."""
    if root is None:
        return []
    out: list[tuple[str, Entry]] = []

    async def visit(name: str, depth: int = 0) -> list[tuple[str, Entry]]:
        if depth > MAX_DEPTH:
            raise too_deep(name, root)
        node = await load(name)
        if isinstance(node, Leaf):
            i = bisect.bisect_left(node.keys, prefix)
            res = []
            while i < len(node.keys) and node.keys[i].startswith(prefix):
                res.append((node.keys[i], node.entries[i]))
                i += 1
            return res
        picked = []
        for i, first in enumerate(node.keys):
            nxt = node.keys[i + 1] if i + 1 < len(node.keys) else None
            if nxt is not None and nxt <= prefix:
                continue  # child lies entirely before the prefix range
            if first > prefix and not first.startswith(prefix):
                break  # child (and all after it) lie after the range
            picked.append(node.children[i])
        parts = await asyncio.gather(*(visit(c, depth + 1) for c in picked))
        return [kv for part in parts for kv in part]

    out = await visit(root)
    return out


async def walk(
    load: Loader, root: str | None, seen: set[str], on_entry: Callable[[str, Entry], None] | None = None
) -> None:
    """Visit every node reachable from ``root`` not already in ``seen`` (adding it).

    Shared subtrees are visited once across calls sharing ``seen`` (GC marking,
    verification). ``on_entry(key, entry)`` is called for every leaf entry visited.
    """
    if root is None or root in seen:
        return
    seen.add(root)
    node = await load(root)
    if isinstance(node, Leaf):
        if on_entry is not None:
            for k, e in zip(node.keys, node.entries):
                on_entry(k, e)
        return
    await asyncio.gather(*(walk(load, c, seen, on_entry) for c in node.children if c not in seen))


def _split(n: int) -> list[tuple[int, int]]:
    """Balanced [start, stop) chunks of at most MAX_FANOUT covering range(n)."""
    k = max(1, -(-n // MAX_FANOUT))
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


ChildRef = tuple[str, str, int]  # (first key, node name, key count)


class TreeWriter:
    """Applies sorted changes to a tree, collecting the new nodes to write.

    After :meth:`apply`, :attr:`written` maps the name of every new node to its
    bytes; the caller writes them all (create-only) before the commit record.
    Nodes this writer emitted are not on storage yet, so it reads them back
    from its own table (:meth:`_load`), never through the bounded shared cache
    (which may have evicted them).
    """

    def __init__(self, load: Loader, cache: NodeCache | None = None) -> None:
        self.load_stored = load
        self.cache = cache
        self.written: dict[str, bytes] = {}  # insertion-ordered
        self._emitted: dict[str, Node] = {}  # node emitted by this writer -> itself

    async def _load(self, name: str) -> Node:
        node = self._emitted.get(name)
        return node if node is not None else await self.load_stored(name)

    def _emit(self, node: Node) -> str:
        name = new_name("nodes")
        self.written[name] = encode_node(node)
        self._emitted[name] = node
        if self.cache is not None:
            self.cache.put(name, node)  # for readers once committed
        return name

    def _drop(self, name: str) -> None:
        """Forget a node emitted by this writer that ended up unreferenced."""
        del self.written[name]
        del self._emitted[name]

    async def _rebalance(self, refs: list[ChildRef]) -> list[ChildRef]:
        """Merge each underfull child written by this commit into a neighbour.

        Keeps nodes at least ~1/4 full after deletions without touching
        children this commit did not rewrite (beyond the one neighbour).
        """
        low = max(2, MAX_FANOUT // 4)
        i = 0
        while i < len(refs) and len(refs) > 1:
            name = refs[i][1]
            mine = self._emitted.get(name)
            if mine is None or len(mine.keys) >= low:
                i += 1
                continue
            j = i + 1 if i + 1 < len(refs) else i - 1
            a, b = (i, j) if i < j else (j, i)
            left, right = await asyncio.gather(self._load(refs[a][1]), self._load(refs[b][1]))
            for r in (refs[a][1], refs[b][1]):
                if r in self._emitted:
                    self._drop(r)
            if isinstance(left, Leaf) and isinstance(right, Leaf):
                merged = self._emit_leaves(left.keys + right.keys, left.entries + right.entries)
            elif isinstance(left, Inner) and isinstance(right, Inner):
                kids = list(zip(left.keys + right.keys, left.children + right.children, left.counts + right.counts))
                merged = self._emit_inners(kids)
            else:  # mixed depths (not written by this implementation): leave as is
                i += 1
                continue
            refs[a:b + 1] = merged
            i = a + len(merged)
        return refs

    def _emit_leaves(self, keys: list[str], entries: list[Entry]) -> list[ChildRef]:
        out = []
        for a, b in _split(len(keys)) if keys else []:
            name = self._emit(Leaf(keys[a:b], entries[a:b]))
            out.append((keys[a], name, b - a))
        return out

    def _emit_inners(self, refs: list[ChildRef]) -> list[ChildRef]:
        out = []
        for a, b in _split(len(refs)) if refs else []:
            part = refs[a:b]
            node = Inner([r[0] for r in part], [r[1] for r in part], [r[2] for r in part])
            out.append((part[0][0], self._emit(node), sum(r[2] for r in part)))
        return out

    async def apply(self, root: str | None, changes: Sequence[Change]) -> tuple[str | None, int]:
        """The new root (None = empty) and key count after applying ``changes``.

        ``changes`` must be sorted by key with unique keys (checked: a tree
        built from unsorted input would be unreadable).
        """
        if any(a[0] >= b[0] for a, b in itertools.pairwise(changes)):
            raise InvalidArgumentError("versioned store: changes must be sorted by key and unique")
        if root is None:
            puts = [(k, e) for k, e in changes if e is not None]
            level = self._emit_leaves([k for k, _ in puts], [e for _, e in puts])  # type: ignore[misc]
        elif not changes:
            node = await self._load(root)
            return root, (len(node.keys) if isinstance(node, Leaf) else sum(node.counts))
        else:
            level = await self._apply(root, changes)
        while len(level) > 1:
            level = self._emit_inners(level)
        if not level:
            return None, 0
        _, name, count = level[0]
        # an inner root left with one child is replaced by that child
        node = await self._load(name)
        depth = 0
        while isinstance(node, Inner) and len(node.children) == 1:
            name = node.children[0]
            depth += 1
            if depth > MAX_DEPTH:
                raise too_deep(name, root)
            node = await self._load(name)
        return name, count

    async def _apply(self, name: str, changes: Sequence[Change], depth: int = 0) -> list[ChildRef]:
        if depth > MAX_DEPTH:
            raise too_deep(name, None)
        node = await self._load(name)
        if isinstance(node, Leaf):
            keys, entries = _merge_leaf(node, changes)
            return self._emit_leaves(keys, entries)
        ckeys = [k for k, _ in changes]
        bounds = [0]
        for first in node.keys[1:]:
            bounds.append(bisect.bisect_left(ckeys, first))
        bounds.append(len(changes))
        tasks, idx = [], []
        for i in range(len(node.children)):
            a, b = bounds[i], bounds[i + 1]
            if a < b:
                idx.append(i)
                tasks.append(self._apply(node.children[i], changes[a:b], depth + 1))
        results = dict(zip(idx, await asyncio.gather(*tasks)))
        refs: list[ChildRef] = []
        for i in range(len(node.children)):
            if i in results:
                refs.extend(results[i])
            else:
                refs.append((node.keys[i], node.children[i], node.counts[i]))
        return self._emit_inners(await self._rebalance(refs))


def _merge_leaf(leaf: Leaf, changes: Sequence[Change]) -> tuple[list[str], list[Entry]]:
    keys: list[str] = []
    entries: list[Entry] = []
    i, n = 0, len(leaf.keys)
    for ck, ce in changes:
        while i < n and leaf.keys[i] < ck:
            keys.append(leaf.keys[i])
            entries.append(leaf.entries[i])
            i += 1
        if i < n and leaf.keys[i] == ck:
            i += 1  # replaced or deleted
        if ce is not None:
            keys.append(ck)
            entries.append(ce)
    keys.extend(leaf.keys[i:])
    entries.extend(leaf.entries[i:])
    return keys, entries
