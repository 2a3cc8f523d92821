"""The chunk engine shared by the zarr3 and zarr2 drivers.

Reads and writes map a normalised strided region onto the chunk grid and run
one operation per touched chunk, concurrently, under a bytes-in-flight budget.
Chunk I/O goes through the kvstore (whatever it is); decoding and encoding run
on the CPU pool (the codecs release the GIL) so every core works.

Three I/O paths, same results and guarantees: stores with blocking I/O hooks
(``KvStore.blocking_io``: the file store) get batches of chunks read and decoded
or encoded and written in one pool call (drivers/fastpath.py); stores that can
prepare a read (``KvStore._prepare_read``: the versioned store over the file
store, also inside a transaction) resolve each chunk on the loop and read,
check and decode it in one pool call; every other store (gcs, http, wrappers)
takes the per-chunk async path, with fewer chunks in flight the larger they are.

Guarantees:

* A write that covers a whole chunk replaces it with one unconditional write
  (atomic per chunk; the request as a whole is not atomic unless the kvstore is
  a transaction view).
* A partial-chunk write is a read-modify-write conditioned on the chunk's
  generation (``if_equal``) and retried on ConditionFailedError, so concurrent
  writers of disjoint parts of one chunk never lose each other's data.
* A chunk whose every element equals the fill value (bitwise) is deleted
  instead of stored, as zarr-python and TensorStore do.
* Missing chunks read as the fill value.
"""

from __future__ import annotations

import asyncio
import itertools
from abc import abstractmethod
from typing import Any, Self

import numpy as np

import tensorstore_py.drivers.fastpath as fastpath
from tensorstore_py.core.budget import ByteBudget, default_bytes_in_flight, run_bounded
from tensorstore_py.core.buffers import new_array
from tensorstore_py.core.errors import (
    ConditionFailedError,
    InvalidArgumentError,
    NotFoundError,
    ReadOnlyError,
)
from tensorstore_py.core.pools import run_in
from tensorstore_py.drivers.base import ArrayDriver, Index
from tensorstore_py.drivers.cache import CachePool
from tensorstore_py.drivers.chunk_buffers import chunk_buffer
from tensorstore_py.drivers.chunked_metadata import ParsedMetadata, json_object
from tensorstore_py.drivers.codecs.base import ChunkCodec
from tensorstore_py.drivers.codecs.chain import CodecChain
from tensorstore_py.drivers.codecs.sharding import ShardingCodec, is_fill
from tensorstore_py.drivers.copies import as_contiguous, copy_into
from tensorstore_py.drivers.dtypes import element_nbytes
from tensorstore_py.drivers.fastpath import has_sync_io
from tensorstore_py.drivers.grid import ChunkPart, chunk_parts, count_chunks, dim_parts, out_shape
from tensorstore_py.drivers.raw_regions import read_region_async, wants_ranges
from tensorstore_py.drivers.rmw import RMW_RETRY, rmw_lost
from tensorstore_py.drivers.shard_reads import (
    ShardIndexCache,
    ShardRequests,
    decode_whole,
    read_part,
    run_async,
)
from tensorstore_py.drivers.sizing import (
    async_tasks,
    blocking_read_tasks,
    prepared_read_tasks,
    write_batch_bytes,
    write_tasks,
)
from tensorstore_py.kvstore.base import BlockingRead, Generation, KvStore, ReadResult

__all__ = ["ChunkCodec", "ChunkedArray", "ParsedMetadata", "json_object"]

# Chunks smaller than this are decoded on the loop thread: a thread hop costs
# more than a memcpy or decompression of a few KiB.
_INLINE_BYTES = 64 << 10
# How many batches run at once, and their bytes, come from drivers/sizing.py.
_WRITE_BATCH_PARTS = 8
# Prepared reads (KvStore._prepare_read): chunk bytes resolved together (their
# lookups share one probe of the newest version), and chunk bytes per pool call.
_PREPARED_BATCH_BYTES = 16 << 20
_PREPARED_CALL_BYTES = 1 << 20
#: the most bytes one chunk may take in memory for a write to allocate it (a
#: missing or partially written chunk is materialised whole): a one-element
#: write must not try to allocate 15 GiB because the chunks are huge
MAX_WRITE_CHUNK_BYTES = 2 << 30


async def _value(x: Any) -> Any:
    return x


class ChunkedArray(ArrayDriver):
    """A regular chunk grid of encoded chunks over a kvstore.

    A format (zarr3, zarr2) subclasses it with its ``driver`` name, its
    ``metadata_key`` and two hooks: :meth:`parse_metadata` (validation, codec,
    key encoding) and :meth:`encode_metadata` (how the document is stored).
    """

    def __init__(
        self,
        *,
        kvstore: KvStore,
        metadata: dict[str, Any],
        parsed: ParsedMetadata,
        metadata_generation: Generation,
        cache_pool: CachePool | None = None,
        budget: ByteBudget | None = None,
    ) -> None:
        self.kvstore = kvstore
        self._metadata = metadata
        self._parsed = parsed
        self._shape = tuple(int(s) for s in parsed.shape)
        self._dtype = dtype = parsed.dtype
        self._fill = parsed.fill
        self._fill_arr = np.array(parsed.fill, dtype=dtype)
        self._chunk_shape = tuple(int(c) for c in parsed.chunk_shape)
        self._codec = codec = parsed.codec
        self._dimension_names = parsed.dimension_names
        self._metadata_generation = metadata_generation
        self._cache = cache_pool
        self._budget = budget or ByteBudget(default_bytes_in_flight())
        self._threads = self._budget.concurrency
        # what the byte budget counts per chunk; for strings and bytes an estimate
        # (element_nbytes): their elements' sizes are unknown until decoded
        self._chunk_nbytes = int(np.prod(self._chunk_shape, dtype=np.int64)) * element_nbytes(dtype)
        # sharding_indexed alone: partial reads fetch inner chunks, writes update them
        self._shard: ShardingCodec | None = (
            codec.ab if isinstance(codec, CodecChain) and isinstance(codec.ab, ShardingCodec)
            and not codec.aa and not codec.bb else None
        )
        # indexes of shards read in part, checked against the data's generation
        self._shard_indexes = ShardIndexCache() if self._shard is not None else None
        # concurrent reads of one shard share their index and range requests
        self._shard_requests = ShardRequests() if self._shard is not None else None
        # a chunk being written holds a contiguous copy and its encoding; a shard
        # gathers its inner chunks straight from the source: its encoding only
        self._write_cost = self._chunk_nbytes * (1 if self._shard is not None else 2)

    # -- format hooks -----------------------------------------------------------
    metadata_key: str

    @staticmethod
    @abstractmethod
    def parse_metadata(meta: dict[str, Any]) -> ParsedMetadata:
        """The validated form of a metadata document (InvalidSpecError naming the field)."""

    @staticmethod
    @abstractmethod
    def encode_metadata(meta: dict[str, Any]) -> bytes:
        """The stored bytes of a metadata document."""

    # drivers/open.py::DocumentFormat: every stored document is an array's, and
    # none is created into a group's document
    @staticmethod
    def is_array_document(doc: dict[str, Any]) -> bool:
        return True

    @staticmethod
    def create_into(doc: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any] | None:
        return None

    @classmethod
    def decode_metadata(cls, raw: Any) -> dict[str, Any]:
        """The metadata document stored as ``raw`` (a JSON object)."""
        return json_object(raw, cls.metadata_key)

    @classmethod
    def from_metadata(
        cls, meta: dict[str, Any], kvstore: KvStore, generation: Generation, *,
        cache_pool: CachePool | None = None, budget: ByteBudget | None = None,
        parsed: ParsedMetadata | None = None,
    ) -> Self:
        """A driver of this format for ``meta`` (``parsed``: its parsed form,
        when the caller has it) over ``kvstore``."""
        return cls(kvstore=kvstore, metadata=meta, parsed=parsed or cls.parse_metadata(meta),
                   metadata_generation=generation, cache_pool=cache_pool, budget=budget)

    def chunk_key(self, cell: tuple[int, ...]) -> str:
        """The kvstore key of the chunk at grid position ``cell``."""
        return self._parsed.chunk_key(cell)

    def _reopen(self, metadata: dict[str, Any], kvstore: KvStore, generation: Generation) -> Self:
        """A driver of the same format for ``metadata`` over ``kvstore``."""
        return self.from_metadata(metadata, kvstore, generation,
                                  cache_pool=self._cache, budget=self._budget)

    def _metadata_with_shape(self, metadata: dict[str, Any], shape: tuple[int, ...]) -> dict[str, Any]:
        return {**metadata, "shape": list(shape)}

    def decode_chunk(self, key: str, data: Any) -> np.ndarray:
        return self._codec.decode(data, key=key)

    def codec_at(self, cell: tuple[int, ...]) -> ChunkCodec:
        """The codec of the chunk at grid position ``cell``: the array's codec.

        Formats that store edge chunks clipped to the array (n5, neuroglancer
        precomputed) override this with a codec that decodes a stored edge
        chunk into the full chunk shape (the rest filled) and encodes the full
        chunk's in-bounds part. Every per-chunk encode/decode goes through it.
        """
        return self._codec

    @property
    def raw_chunk_nbytes(self) -> int | None:
        if not self._codec.raw:
            return None
        return int(np.prod(self.write_chunk_shape, dtype=np.int64)) * self.dtype.itemsize

    # -- properties --------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def fill_value(self) -> Any:
        return self._fill

    @property
    def dimension_names(self) -> tuple[str | None, ...]:
        return self._dimension_names

    @property
    def read_chunk_shape(self) -> tuple[int, ...]:
        return self._shard.chunk_shape if self._shard is not None else self._chunk_shape

    @property
    def write_chunk_shape(self) -> tuple[int, ...]:
        return self._chunk_shape

    @property
    def metadata(self) -> dict[str, Any]:
        return self._metadata

    def spec(self) -> dict[str, Any]:
        return {"driver": self.driver, "kvstore": self.kvstore.spec(), "metadata": self._metadata}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()!r})"

    def with_kvstore(self, kvstore: KvStore) -> ChunkedArray:
        return self._reopen(self._metadata, kvstore, self._metadata_generation)

    # -- checks --------------------------------------------------------------------
    def _check_index(self, index: Index) -> Index:
        if len(index) != len(self._shape):
            raise InvalidArgumentError(
                f"index has {len(index)} dimensions, array has {len(self._shape)}"
            )
        for d, (s, n) in enumerate(zip(index, self._shape)):
            if not (isinstance(s, slice) and isinstance(s.start, int) and isinstance(s.stop, int)
                    and isinstance(s.step, int) and 0 <= s.start <= s.stop <= n and s.step >= 1):
                raise InvalidArgumentError(
                    f"index dimension {d}: expected a normalised slice within [0, {n}] with "
                    f"step >= 1, got {s!r}"
                )
        return index

    # -- reading -------------------------------------------------------------------
    def _out(self, index: Index, out: np.ndarray | None) -> np.ndarray:
        shape = out_shape(index)
        if out is None:
            return new_array(shape, self._dtype,
                             what=lambda: f"reading {shape} of the array on {self.kvstore!r}")
        if out.shape != shape or out.dtype != self._dtype or not out.flags.writeable:
            raise InvalidArgumentError(
                f"out must be a writeable {self._dtype} array of shape {shape}, "
                f"got {out.dtype} {out.shape}"
            )
        return out

    @property
    def reads_blocking(self) -> bool:  # type: ignore[override]
        return self._cache is None and has_sync_io(self.kvstore)

    def read_blocking(self, index: Index, out: np.ndarray) -> np.ndarray:
        index = self._check_index(index)
        out = self._out(index, out)
        if out.size:  # every worker is busy on a CPU here (no loop to wait on): one per core
            tasks = min(self._sync_read_tasks(), max(2, self._threads.cpu))
            # within the byte budget: each worker holds one batch (or one whole chunk)
            tasks = max(1, min(tasks, self._budget.limit // max(self._chunk_nbytes, fastpath.BATCH_BYTES)))
            fastpath.read_blocking(self, self.kvstore, index, out, tasks=tasks)
        return out

    async def read(self, index: Index, *, out: np.ndarray | None = None) -> np.ndarray:
        index = self._check_index(index)
        out = self._out(index, out)
        if out.size == 0:
            return out
        target = out
        kv = self.kvstore
        if self._cache is None and has_sync_io(kv):
            async def batch(b: list[ChunkPart]) -> None:
                await self._run_io(fastpath.read_batch, self, kv, b, target)

            await run_bounded(
                fastpath.batches(chunk_parts(index, self._chunk_shape, self._shape), self._chunk_nbytes),
                batch, budget=self._budget, cost=lambda b: len(b) * self._chunk_nbytes,
                max_tasks=self._sync_read_tasks(),
            )
            return out

        parts = chunk_parts(index, self._chunk_shape, self._shape)
        first = next(parts)
        parts = itertools.chain([first], parts)
        first_reader = None if self._cache is not None else await self._prepare(first)
        if first_reader is not None:
            # the store splits reads into loop-side resolution and blocking data
            # I/O: read, check and decode each batch of chunks in one pool call
            given = {first.cell: first_reader}  # used by the first batch, at once

            async def prepared(b: list[ChunkPart]) -> None:
                readers = await asyncio.gather(
                    *(self._prepare(p) if p.cell not in given else _value(given.pop(p.cell)) for p in b)
                )
                ready = [(p, r) for p, r in zip(b, readers) if r is not None]
                rest = [p for p, r in zip(b, readers) if r is None]  # e.g. partial shards
                # one pool call per ~_PREPARED_CALL_BYTES: reading a chunk and
                # decoding it back to back keeps it in cache
                for c in fastpath.batches(ready, self._chunk_nbytes, target=_PREPARED_CALL_BYTES):
                    await self._run_io(fastpath.read_prepared_batch, self, c, target)
                await asyncio.gather(*(self._read_part(p, target[p.out + (Ellipsis,)]) for p in rest))

            await run_bounded(
                fastpath.batches(parts, self._chunk_nbytes, target=_PREPARED_BATCH_BYTES),
                prepared, budget=self._budget, cost=lambda b: len(b) * self._chunk_nbytes,
                max_tasks=prepared_read_tasks(self._threads),
            )
            return out

        async def one(p: ChunkPart) -> None:
            await self._read_part(p, target[p.out + (Ellipsis,)])

        await run_bounded(parts, one, budget=self._budget, cost=self._chunk_nbytes,
                          max_tasks=async_tasks(self._threads, self._chunk_nbytes, write=False,
                                                slots=self.kvstore.requests_in_flight,
                                                budget_bytes=self._budget.limit))
        return out

    def _sync_read_tasks(self) -> int:
        """Batches in flight on the blocking read path (see drivers/sizing.py)."""
        raw = self._codec.raw and self._shard is None
        return blocking_read_tasks(self._threads, self._chunk_nbytes, raw=raw)

    async def _run_io(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on this array's blocking-I/O threads."""
        return await run_in(self._threads.io_pool(), fn, *args)

    async def _run_cpu(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on this array's codec threads."""
        return await run_in(self._threads.cpu_pool(), fn, *args)

    async def _prepare(self, p: ChunkPart) -> BlockingRead | None:
        """The store's prepared whole-value read of ``p``'s chunk, if it has one."""
        if (self._shard is not None or self._ranged(p)) and not p.full:
            return None  # partial shard reads, and parts of large raw chunks, fetch byte ranges
        return await self.kvstore._prepare_read(self.kvstore._full(self.chunk_key(p.cell)))

    async def _fetch(self, key: str) -> tuple[ReadResult, np.ndarray | None]:
        """Read a chunk's bytes, or its decoded array from the cache pool."""
        cache = self._cache
        if cache is None:
            return await self.kvstore.read(key), None
        ck = (self.kvstore._identity(), self.kvstore.path, key)
        hit = cache.get(ck)
        res = await self.kvstore.read(key, if_not_equal=hit[0] if hit else None)
        if res.state == "unchanged" and hit is not None:
            return res, hit[1]
        return res, None

    def _ranged(self, p: ChunkPart) -> bool:
        return (not p.full and self._shard is None and self._cache is None
                and wants_ranges(self._chunk_nbytes, self._codec.raw, p.chunk))

    def _remember(self, key: str, gen: Generation, arr: np.ndarray) -> None:
        if self._cache is not None:
            ck = (self.kvstore._identity(), self.kvstore.path, key)
            self._cache.put(ck, gen, arr)

    async def _read_part(self, p: ChunkPart, dest: np.ndarray) -> None:
        key = self.chunk_key(p.cell)
        if self._shard is not None and not p.full:
            await self._read_sharded(key, p, dest)
            return
        if self._ranged(p):  # a part of a large raw chunk: only its byte ranges (drivers/raw_regions.py)
            await read_region_async(lambda r: self.kvstore.read(key, byte_range=r), key, self._chunk_shape,
                                    p.chunk, dest, self._fill_arr)
            return
        res, cached = await self._fetch(key)
        if res.state == "missing":
            dest[...] = self._fill_arr
            return
        if cached is not None:
            dest[...] = cached[p.chunk]
            return
        if self._shard is not None and self._cache is None and dest.shape == self._chunk_shape:
            # a whole shard: its inner chunks decoded on every codec thread at once
            return await decode_whole(self._shard, res.value, key, dest, self._run_cpu, self._threads.cpu)
        if self._chunk_nbytes <= _INLINE_BYTES:
            arr = self._decode_into(res.value, key, p, dest)
        else:
            arr = await self._run_cpu(self._decode_into, res.value, key, p, dest)
        if self._cache is not None and arr is not None:
            self._remember(key, res.generation, arr)

    def _decode_into(self, buf: Any, key: str, p: ChunkPart, dest: np.ndarray) -> np.ndarray | None:
        """Decode one chunk and copy its part into ``dest``; returns the chunk
        array when it is a standalone copy (so it may be cached)."""
        whole = dest.shape == self._chunk_shape
        codec = self.codec_at(p.cell)
        if whole and self._cache is None and (dest.flags.c_contiguous or codec.strided_out):
            arr = codec.decode(buf, key=key, out=dest)
            if arr is not dest:
                copy_into(dest, arr)
            return None
        if self._cache is None and codec.direct and not self._dtype.hasobject:
            # decoded only to be copied: into a block that serves the next chunk warm
            block = chunk_buffer(self._chunk_nbytes)
            if block is not None:
                arr = codec.decode(buf, key=key, out=block.view(self._dtype).reshape(self._chunk_shape))
                copy_into(dest, arr if whole else arr[p.chunk])
                return None
        arr = codec.decode(buf, key=key)
        copy_into(dest, arr if whole else arr[p.chunk])
        return arr

    async def _read_sharded(self, key: str, p: ChunkPart, dest: np.ndarray) -> None:
        """Read part of a shard with as few requests as possible (drivers/shard_reads.py)."""
        assert self._shard is not None
        await run_async(read_part(self._shard, key, p.chunk, dest, self._shard_indexes),
                        self.kvstore, key, self._run_cpu, self._shard_requests)

    # -- writing -------------------------------------------------------------------
    async def write(self, index: Index, value: np.ndarray) -> None:
        index = self._check_index(index)
        shape = out_shape(index)
        value = np.asarray(value)
        if value.shape != shape:
            raise InvalidArgumentError(f"write of shape {value.shape} into a region of shape {shape}")
        if value.dtype != self._dtype:
            raise InvalidArgumentError(f"write of dtype {value.dtype} into an array of dtype {self._dtype}")
        if value.size == 0:
            return
        kv = self.kvstore
        if kv.read_only:
            raise ReadOnlyError(f"{self.driver} array over {kv!r}: the store is read-only")
        self._check_write_allocation(index)
        # chunks are encoded by this metadata: a transaction must not commit them
        # over metadata that another writer changed meanwhile
        kv.depend_on(self.metadata_key)
        if has_sync_io(kv):
            async def batch(b: list[ChunkPart]) -> None:
                if all(p.full for p in b):
                    # encode on the CPU pool (one thread per core keeps the
                    # caches warm), write on the I/O pool (many fsyncs overlap)
                    encoded = await self._run_cpu(fastpath.encode_batch, self, b, value)
                    await self._run_io(fastpath.store_batch, self, kv, b, encoded)
                else:
                    await self._run_io(fastpath.write_batch, self, kv, b, value)

            target = write_batch_bytes(
                self._threads, count_chunks(index, self._chunk_shape, self._shape) * self._chunk_nbytes)
            await run_bounded(
                fastpath.batches(chunk_parts(index, self._chunk_shape, self._shape), self._chunk_nbytes,
                                 target=target, max_parts=_WRITE_BATCH_PARTS),
                batch, budget=self._budget, cost=lambda b: len(b) * self._write_cost,
                max_tasks=write_tasks(self._threads),
            )
            return

        async def one(p: ChunkPart) -> None:
            await self._write_part(p, value[p.out + (Ellipsis,)])

        await run_bounded(
            chunk_parts(index, self._chunk_shape, self._shape), one,
            budget=self._budget, cost=self._write_cost,
            max_tasks=async_tasks(self._threads, self._chunk_nbytes, write=True,
                                  slots=self.kvstore.requests_in_flight, budget_bytes=self._budget.limit),
        )

    def _check_write_allocation(self, index: Index) -> None:
        """Refuse, before anything is allocated or written, a write that would
        materialise a chunk larger than MAX_WRITE_CHUNK_BYTES: every chunk it
        covers whole (or clipped by the array's edge) or touches in part, except
        that a partial write into a shard materialises only inner chunks."""
        unit, n = self._chunk_shape, self._chunk_nbytes
        if n > MAX_WRITE_CHUNK_BYTES and self._shard is not None:
            # a shard is materialised whole only where the write covers one
            # whole (within the array): every dimension has a whole part
            if not all(any(d.full for d in dim_parts(sl, c, e))
                       for sl, c, e in zip(index, self._chunk_shape, self._shape)):
                unit = self._shard.chunk_shape
                n = int(np.prod(unit, dtype=np.int64)) * self._dtype.itemsize
        if n > MAX_WRITE_CHUNK_BYTES:
            raise InvalidArgumentError(
                f"write to the {self.driver} array over {self.kvstore!r}: it would allocate a "
                f"chunk of {list(unit)} {self._dtype} ({n} bytes), more than the "
                f"{MAX_WRITE_CHUNK_BYTES} bytes (MAX_WRITE_CHUNK_BYTES) a write may allocate for "
                "one chunk; store the array with smaller chunks (or shards of smaller inner chunks)"
            )

    def _in_bounds(self, cell: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(
            slice(0, min(c, n - i * c)) for i, c, n in zip(cell, self._chunk_shape, self._shape)
        )

    def _encode_full(self, p: ChunkPart, src: np.ndarray) -> Any:
        """Encode a chunk wholly given by ``src`` (out-of-bounds part = fill)."""
        if src.shape == self._chunk_shape:
            # a shard gathers its inner chunks from any strides: no copy first
            arr = src if self._shard is not None else as_contiguous(src)
        else:
            arr = np.full(self._chunk_shape, self._fill_arr, dtype=self._dtype)
            arr[self._in_bounds(p.cell)] = src
        if is_fill(arr, self._fill_arr):
            return None
        enc = self.codec_at(p.cell).encode(arr)
        return None if len(enc) == 0 else enc

    def _modify(self, res: ReadResult, key: str, p: ChunkPart, src: np.ndarray) -> Any:
        if self._shard is not None:  # re-encode only the inner chunks written
            enc = self._shard.update(None if res.state == "missing" else res.value, p.chunk, src,
                                     key=key)
            return None if len(enc) == 0 else enc
        codec = self.codec_at(p.cell)
        if res.state == "missing":
            arr = np.full(self._chunk_shape, self._fill_arr, dtype=self._dtype)
        else:
            arr = np.array(codec.decode(res.value, key=key), copy=True)
        arr[p.chunk] = src
        if is_fill(arr, self._fill_arr):
            return None
        enc = codec.encode(arr)
        return None if len(enc) == 0 else enc

    async def _write_part(self, p: ChunkPart, src: np.ndarray) -> None:
        key = self.chunk_key(p.cell)
        if p.full:
            enc = await self._run_cpu(self._encode_full, p, src)
            if enc is None:
                await self.kvstore.delete(key)
            else:
                await self.kvstore.write(key, enc)
            return
        for attempt in range(1, RMW_RETRY.max_attempts + 1):
            res = await self.kvstore.read(key)
            enc = await self._run_cpu(self._modify, res, key, p, src)
            try:
                if enc is None:
                    if not res.generation.is_no_value:
                        await self.kvstore.delete(key, if_equal=res.generation)
                else:
                    await self.kvstore.write(key, enc, if_equal=res.generation)
                return
            except ConditionFailedError:
                # another writer changed the chunk: re-read and merge again
                await asyncio.sleep(RMW_RETRY.delay(attempt))
        raise rmw_lost(key)

    # -- resizing --------------------------------------------------------------------
    async def resize(self, new_shape: tuple[int, ...]) -> ChunkedArray:
        new_shape = tuple(int(s) for s in new_shape)
        if len(new_shape) != len(self._shape) or any(s < 0 for s in new_shape):
            raise InvalidArgumentError(
                f"resize: new shape {list(new_shape)} must have {len(self._shape)} non-negative sizes"
            )
        for attempt in range(1, RMW_RETRY.max_attempts + 1):
            res = await self.kvstore.read(self.metadata_key)
            if res.state == "missing":
                raise NotFoundError(f"resize: {self.metadata_key!r} is gone from {self.kvstore!r}")
            current = self.decode_metadata(res.value)
            old_shape = tuple(self.parse_metadata(current).shape)
            meta = self._metadata_with_shape(current, new_shape)
            try:
                gen = await self.kvstore.write(
                    self.metadata_key, self.encode_metadata(meta), if_equal=res.generation
                )
            except ConditionFailedError:
                await asyncio.sleep(RMW_RETRY.delay(attempt))
                continue
            break
        else:
            raise ConditionFailedError(f"resize: {self.metadata_key!r} kept changing")
        await self._delete_outside(old_shape, new_shape)
        return self._reopen(meta, self.kvstore, gen)

    async def _delete_outside(self, old: tuple[int, ...], new: tuple[int, ...]) -> None:
        """Delete chunks of the old grid that lie wholly outside ``new``."""
        if all(n >= o for n, o in zip(new, old)):
            return
        keep = [-(-n // c) * c for n, c in zip(new, self._chunk_shape)]

        async def drop(p: ChunkPart) -> None:
            await self.kvstore.delete(self.chunk_key(p.cell))

        # one slab per shrunk dimension; earlier dimensions limited to the kept
        # part so that no chunk is visited twice
        for d in range(len(old)):
            if keep[d] >= old[d]:
                continue
            region = tuple(
                slice(0, min(keep[e], old[e]), 1) if e < d
                else slice(keep[d], old[d], 1) if e == d
                else slice(0, old[e], 1)
                for e in range(len(old))
            )
            await run_bounded(chunk_parts(region, self._chunk_shape, old), drop,
                              budget=self._budget, cost=0)
