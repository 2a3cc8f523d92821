"""Chunk I/O of a sharded scale (``neuroglancer_uint64_sharded_v1``) over a kvstore.

Reading never fetches a whole shard. For each shard a read touches it needs
the 16-byte shard index entries of the minishards involved, those minishard
indexes, and then the chunks: three rounds of ranged reads
(``KvStore.read_ranges``, nearby ranges merged into one request; reads of one
shard in flight at once send the ranges they ask for in the same turn of the
event loop as one such read: ``drivers/shard_reads.py::ShardRequests``). Shard index
entries and decoded minishard indexes are cached per shard (an LRU bounded in
bytes) together with the shard's generation; every data read is checked
against that generation and a changed shard is looked up afresh, so a reader
never mixes two versions of a shard. A read that finds none of its chunks in
the cached indexes revalidates them with one conditional read
(``if_not_equal``), so chunks written since are seen.

Writing rewrites whole shards, as TensorStore does: the shard is read, the
chunks written are replaced (partial chunks decoded and merged first, the
others kept as stored bytes), and the new shard is written on condition that
its generation is unchanged (create-only when it did not exist), retried when
another writer won the race. A write that covers every chunk of a shard whose
chunks form one box of the grid skips the read and replaces the shard
unconditionally. So a partial write of a shard costs one read of the whole
shard, the decoding of the partially written chunks, and one write of the
whole shard; chunks equal to the fill value are left out, and a shard left
empty is deleted.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorstore_py.core.budget import ByteBudget, run_bounded
from tensorstore_py.core.errors import ConditionFailedError, DataCorruptionError
from tensorstore_py.core.pools import available_cpus, run_cpu
from tensorstore_py.drivers.fastpath import ChunkOps
from tensorstore_py.drivers.grid import ChunkPart
from tensorstore_py.drivers.precomputed.sharding import (
    MAX_MINISHARD_INDEX_BYTES,
    MinishardIndex,
    ShardingSpec,
    build_shard,
    compressed_morton_code,
    decode_chunk_data,
    decode_minishard_index,
    decode_shard_index_entry,
    split_shard,
)
from tensorstore_py.drivers.rmw import RMW_RETRY, rmw_lost
from tensorstore_py.drivers.shard_reads import ShardRequests
from tensorstore_py.kvstore.base import Buffer, ByteRange, Generation, KvStore, ReadResult

__all__ = ["ShardedChunks"]

# Ranges of one shard closer than this are fetched in one request; larger gaps
# would download data nobody asked for.
_GAP = 16 << 10
# Chunk bytes decoded on the loop thread below this; above it on the CPU pool.
_INLINE_BYTES = 64 << 10
# Cached shard and minishard indexes, per array.
_INDEX_CACHE_BYTES = 32 << 20
_ATTEMPTS = 5
# Shards read or written concurrently.
_MAX_SHARD_TASKS = 16


@dataclass
class _ShardIndexes:
    """What is known of one shard at ``generation``: index entries and minishard indexes."""

    generation: Generation
    entries: dict[int, ByteRange | None] = field(default_factory=dict)
    minishards: dict[int, MinishardIndex] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return 16 * len(self.entries) + sum(24 * len(m) for m in self.minishards.values())


class _IndexCache:
    """LRU of :class:`_ShardIndexes` by shard key, at most ``limit`` bytes (event loop only)."""

    def __init__(self, limit: int = _INDEX_CACHE_BYTES) -> None:
        self._items: OrderedDict[str, _ShardIndexes] = OrderedDict()
        self._limit = limit

    def get(self, key: str) -> _ShardIndexes | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: str, item: _ShardIndexes) -> None:
        self._items[key] = item
        self._items.move_to_end(key)
        total = sum(i.nbytes for i in self._items.values())
        while total > self._limit and len(self._items) > 1:
            _k, old = self._items.popitem(last=False)
            total -= old.nbytes

    def drop(self, key: str) -> None:
        self._items.pop(key, None)


@dataclass(frozen=True)
class _Item:
    """One chunk's share of a request, located in its shard."""

    part: ChunkPart
    chunk_id: int
    minishard: int


def _size(r: ByteRange) -> int:
    return (r.stop or 0) - r.start


def _exact(data: Buffer, r: ByteRange, key: str, what: str) -> Buffer:
    want = _size(r)
    if len(data) != want:
        raise DataCorruptionError(f"shard {key!r}: {what} at {r} should be {want} bytes, read {len(data)}")
    return data


class ShardedChunks:
    """Reads and writes the chunks of one sharded scale of ``arr`` through ``kvstore``,
    its shard files under ``prefix`` (the scale's folder). ``max_chunk_bytes`` bounds one stored chunk after the
    sharding ``data_encoding`` is undone (a larger one is corrupt);
    ``shard_cells(key)`` is the number of grid cells shard ``key`` holds when its
    chunks form one box of the grid (None otherwise)."""

    def __init__(self, arr: ChunkOps, kvstore: KvStore, sharding: ShardingSpec, grid_shape: tuple[int, ...],
                 *, prefix: str, max_chunk_bytes: int, budget: ByteBudget,
                 shard_cells: Callable[[str], int | None]) -> None:
        self._arr = arr
        self._kv = kvstore
        self._prefix = prefix
        self._spec = sharding
        self._grid = grid_shape
        self._max_chunk_bytes = max_chunk_bytes
        self._budget = budget
        self._shard_cells = shard_cells
        self._cache = _IndexCache()
        self._shared = ShardRequests(_GAP)  # concurrent reads of one shard share their requests

    # -- locating chunks ---------------------------------------------------------------
    def chunk_id(self, cell: tuple[int, ...]) -> int:
        return compressed_morton_code(cell[:3], self._grid)

    def shard_key(self, cell: tuple[int, ...]) -> str:
        """The key (in the scale's folder) of the shard holding grid cell ``cell``."""
        shard, _ = self._spec.shard_and_minishard(self.chunk_id(cell))
        return self._prefix + self._spec.shard_key(shard)

    def _group(self, parts: Iterable[ChunkPart]) -> dict[str, list[_Item]]:
        by_shard: dict[str, list[_Item]] = {}
        spec = self._spec
        for p in parts:
            cid = self.chunk_id(p.cell)
            shard, minishard = spec.shard_and_minishard(cid)
            by_shard.setdefault(self._prefix + spec.shard_key(shard), []).append(_Item(p, cid, minishard))
        return by_shard

    async def _for_each_shard(self, parts: Iterable[ChunkPart],
                              fn: Callable[[str, list[_Item]], Any]) -> None:
        groups = self._group(parts)
        nbytes = self._arr._chunk_nbytes
        await run_bounded(groups.items(), lambda kv: fn(*kv), budget=self._budget,
                          cost=lambda kv: len(kv[1]) * nbytes, max_tasks=_MAX_SHARD_TASKS)

    # -- shard and minishard indexes -----------------------------------------------------
    async def _indexes(self, key: str, minishards: set[int], fresh: bool) -> _ShardIndexes | None:
        """The indexes of ``minishards`` in shard ``key`` (None: no such shard), all of
        one generation; from the cache unless ``fresh``."""
        for _attempt in range(_ATTEMPTS):
            st = None if fresh else self._cache.get(key)
            want = sorted(m for m in minishards if st is None or m not in st.entries)
            if want:
                ranges = [self._spec.shard_index_range(m) for m in want]
                rr = await self._shared.ranges(self._kv, key, ranges)
                if rr.state == "missing":
                    self._cache.drop(key)
                    return None
                if st is None or rr.generation != st.generation:
                    st = _ShardIndexes(rr.generation)
                    if len(want) < len(minishards):
                        fresh = True  # the shard changed: look up everything again
                        continue
                for m, r, v in zip(want, ranges, rr.values):
                    entry = _exact(v, r, key, f"shard index entry {m}")
                    st.entries[m] = decode_shard_index_entry(entry, self._spec, key=key)
            assert st is not None  # nothing wanted: every minishard (at least one) was cached
            todo = [(m, e) for m in sorted(minishards)
                    if (e := st.entries[m]) is not None and m not in st.minishards]
            if todo:
                raws = await self._fetch(key, st, [(f"minishard {m} index", r) for m, r in todo],
                                         MAX_MINISHARD_INDEX_BYTES)
                if raws is None:
                    fresh = True  # rewritten between the index and the minishard indexes
                    continue
                for (m, _r), raw in zip(todo, raws):
                    st.minishards[m] = decode_minishard_index(raw, self._spec, key=key)
            self._cache.put(key, st)
            return st
        raise ConditionFailedError(f"shard {key!r} kept changing while its index was read")

    async def _fetch(self, key: str, st: _ShardIndexes, ranges: list[tuple[str, ByteRange]],
                     limit: int) -> list[Buffer] | None:
        """The bytes of the named ``ranges`` of shard ``key`` as of ``st.generation``
        (None: the shard has changed since). A range longer than ``limit`` is corrupt."""
        for what, r in ranges:
            if _size(r) > limit:
                raise DataCorruptionError(f"shard {key!r}: {what} is {_size(r)} bytes, more than {limit}")
        rr = await self._shared.ranges(self._kv, key, [r for _, r in ranges])
        if rr.state == "missing" or rr.generation != st.generation:
            return None
        return [_exact(v, r, key, what) for (what, r), v in zip(ranges, rr.values)]

    async def _unchanged(self, key: str, st: _ShardIndexes, minishard: int) -> bool:
        """Whether shard ``key`` is still at ``st.generation`` (one conditional ranged read)."""
        res = await self._kv.read(key, byte_range=self._spec.shard_index_range(minishard),
                                  if_not_equal=st.generation)
        return res.state == "unchanged"

    # -- reading ------------------------------------------------------------------------
    async def read(self, parts: Iterable[ChunkPart], out: np.ndarray) -> None:
        """Read every part into ``out`` (absent chunks read as the fill value)."""
        await self._for_each_shard(parts, lambda key, items: self._read_shard(key, items, out))

    async def _read_shard(self, key: str, items: list[_Item], out: np.ndarray) -> None:
        arr = self._arr
        minishards = {it.minishard for it in items}
        fresh = False
        for _attempt in range(_ATTEMPTS):
            st = await self._indexes(key, minishards, fresh)
            if st is None:
                for it in items:
                    out[it.part.out + (Ellipsis,)] = arr._fill_arr
                return
            found: list[tuple[_Item, ByteRange]] = []
            for it in items:
                index = st.minishards.get(it.minishard)
                r = None if index is None else index.find(it.chunk_id)
                if r is not None:
                    found.append((it, r))
            if not found:
                if fresh or await self._unchanged(key, st, items[0].minishard):
                    for it in items:
                        out[it.part.out + (Ellipsis,)] = arr._fill_arr
                    return
                fresh = True
                continue
            limit = self._max_chunk_bytes + (self._max_chunk_bytes >> 3) + 1024  # gzip may grow data a bit
            values = await self._fetch(key, st, [(f"chunk {it.chunk_id}", r) for it, r in found], limit)
            if values is None:
                fresh = True  # the shard changed since its index was read
                continue
            present = {it.chunk_id for it, _ in found}
            for it in items:
                if it.chunk_id not in present:
                    out[it.part.out + (Ellipsis,)] = arr._fill_arr
            if sum(len(v) for v in values) <= _INLINE_BYTES:
                self._decode(key, found, values, out)
                return
            # one pool call per core's share of the chunks: decoders release the GIL
            k = max(1, min(len(found), available_cpus()))
            await asyncio.gather(*(run_cpu(self._decode, key, found[i::k], values[i::k], out) for i in range(k)))
            return
        raise ConditionFailedError(f"shard {key!r} kept changing while being read")

    def _decode(self, key: str, found: list[tuple[_Item, ByteRange]], values: list[Buffer],
                out: np.ndarray) -> None:
        for (it, _r), v in zip(found, values):
            p = it.part
            where = f"{key} chunk {it.chunk_id}"
            data = decode_chunk_data(v, self._spec, key=where, limit=self._max_chunk_bytes)
            self._arr._decode_into(data, where, p, out[p.out + (Ellipsis,)])

    # -- writing ------------------------------------------------------------------------
    async def write(self, parts: Iterable[ChunkPart], value: np.ndarray) -> None:
        """Write ``value`` (one part per chunk), rewriting each shard touched."""
        await self._for_each_shard(parts, lambda key, items: self._write_shard(key, items, value))

    async def _write_shard(self, key: str, items: list[_Item], value: np.ndarray) -> None:
        whole = all(it.part.full for it in items) and self._shard_cells(key) == len(items)
        for attempt in range(1, RMW_RETRY.max_attempts + 1):
            res = ReadResult.missing() if whole else await self._kv.read(key)
            data = await run_cpu(self._merge, key, res, items, value)
            try:
                if data is None:
                    if whole:
                        await self._kv.delete(key)
                    elif not res.generation.is_no_value:
                        await self._kv.delete(key, if_equal=res.generation)
                else:
                    await self._kv.write(key, data, if_equal=None if whole else res.generation)
                return
            except ConditionFailedError:
                await asyncio.sleep(RMW_RETRY.delay(attempt))  # another writer got there first
            finally:
                self._cache.drop(key)
        raise rmw_lost(key)

    def _merge(self, key: str, res: ReadResult, items: list[_Item], value: np.ndarray) -> bytes | None:
        """The shard ``res`` with the chunks of ``items`` replaced (CPU work, no I/O)."""
        arr = self._arr
        chunks: dict[int, Buffer] = {}
        if res.state == "value":
            chunks = split_shard(self._spec, res.value, key=key, limit=self._max_chunk_bytes)
        for it in items:
            p = it.part
            src = value[p.out + (Ellipsis,)]
            where = f"{key} chunk {it.chunk_id}"
            if p.full:
                enc = arr._encode_full(p, src)
            else:
                old = chunks.get(it.chunk_id)
                stored = ReadResult.missing() if old is None else ReadResult("value", old, res.generation)
                enc = arr._modify(stored, where, p, src)
            if enc is None:
                chunks.pop(it.chunk_id, None)
            else:
                chunks[it.chunk_id] = enc
        return build_shard(self._spec, chunks)
