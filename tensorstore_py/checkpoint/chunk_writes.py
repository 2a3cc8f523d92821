"""Writing a save's chunks: the bytes-in-flight budget, host copies, batches, encoding.

One task per chunk (small host chunks batched), each holding its bytes of the
budget (``SaveOptions.max_bytes_in_flight``) from its device-to-host copy until
its value is handed to the store; a chunk is encoded (compression.py) in the
background and, with incremental saves, hashed and linked to the previous
step's chunk when its bytes are the same (dedup.py). What is durable, and when,
is the transaction's business (the versioned store fsyncs every data object
before the commit record).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.dedup import Incremental
from tensorstore_py.checkpoint.hostpool import HostLease, HostPool, shared_pool
from tensorstore_py.checkpoint.packing import Pack, write_pack
from tensorstore_py.core.budget import MAX_TASKS, ByteBudget, run_bounded
from tensorstore_py.core.pools import run_copy, run_cpu
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.progress import Progress

__all__ = ["MAX_STREAMED_TASKS", "SMALL_BATCH_BYTES", "SMALL_CHUNK_BYTES", "Chunk", "write_chunks"]

#: concurrent chunk tasks of a streamed save (each holds its share of the budget)
MAX_STREAMED_TASKS = 4096


@dataclass(slots=True)
class Chunk:
    key: str
    data: np.ndarray | None  # C-contiguous chunk, full chunk shape
    nbytes: int
    #: a chunk staged on a device: copies it to the host (blocking, on an I/O thread)
    fetch: Callable[[], np.ndarray] | None = None
    #: the fetch reads the caller's array (streamed "pinned_host" staging)
    reads_caller: bool = False
    #: a whole shard fetched at once and cut into chunks on the host: per chunk
    #: its key and how to cut it from the fetched shard (``key`` is then unused)
    cuts: list[tuple[str, Callable[[np.ndarray], np.ndarray]]] | None = None
    #: small host chunks written by one task, one after the other (``key`` unused)
    batch: list[Chunk] | None = None
    #: small leaves packed into one value (packing.py; ``key`` unused)
    pack: Pack | None = None
    #: the leaf's compressor (None: raw chunks)
    codec: Any = None
    #: a metadata document (zarr.json), not a chunk: never hashed or linked
    meta: bool = False
    #: a chunk of a CPU device's array: fills a slot of the host pool (given as a
    #: C-order array of the chunk's shape and dtype) and returns it (blocking)
    fill: Callable[[np.ndarray], np.ndarray] | None = None
    #: the chunk's shape and dtype (with ``fill``)
    shape: tuple[int, ...] = ()
    dtype: Any = None
    #: stored as it is, neither hashed nor linked: a promoted chunk of a compressed
    #: leaf whose digest (of its raw bytes, dedup.py) the local part did not record
    unhashed: bool = False
    #: a chunk read back from a store (a promotion's local part): awaited inside
    #: the budget, on the store's own I/O path (no thread of the copy pool waits for it)
    read: Callable[[], Awaitable[np.ndarray]] | None = None


def _bytes(a: np.ndarray) -> memoryview:
    return a.reshape(-1).view(np.uint8).data


async def write_chunks(
    view: KvStore, chunks: list[Chunk], zarr_json: dict[str, dict[str, Any]], *,
    max_bytes_in_flight: int, chunk_staged: Callable[[], None],
    progress: Progress | None = None, incremental: Incremental | None = None,
) -> None:
    """Write ``chunks`` (and the ``zarr_json`` documents) into ``view`` (the step's
    folder) under the bytes-in-flight budget, copying each chunk staged on a
    device to the host first (inside the budget; ``chunk_staged()`` after each
    copy that read the caller's array), and dropping each chunk's host copy as
    soon as it is stored. With ``incremental``, a chunk whose bytes equal the
    previous step's is linked instead of written (dedup.py)."""

    async def put(key: str, data: np.ndarray, codec: Any) -> None:
        if incremental is None:
            await view.write(key, await _encoded(data, codec))
        else:
            await incremental.put(view, key, data, lambda: _encoded(data, codec))

    async def one(c: Chunk) -> None:
        if incremental is not None and not (c.meta or c.unhashed) and c.batch is None and c.pack is None:
            # a leaf that is the very array this process saved last time: linked
            # without copying it off the device or hashing it (dedup.py)
            keys = [k for k, _ in c.cuts] if c.cuts is not None else [c.key]
            if await incremental.link_known(keys, c.nbytes):
                c.fetch = c.fill = c.cuts = c.data = c.read = None
                if c.reads_caller:
                    chunk_staged()
                if progress is not None:
                    progress.advance(c.nbytes)
                return
        if pool is not None and (c.fill is not None or c.fetch is not None):
            # its host copy lives in a slot of the pool (or, for JAX's pinned
            # copies, is counted against the pool's limit) until it is stored
            lease = await pool.acquire(1, buffers=c.fill is not None)
            try:
                await stage_and_write(c, lease)
            finally:
                c.data = None
                lease.release()
            return
        await stage_and_write(c, None)

    async def stage_and_write(c: Chunk, lease: HostLease | None) -> None:
        if c.fill is not None:
            assert lease is not None
            fill, c.fill = c.fill, None
            # CPU device -> a slot of the host pool, on the copy pool's threads
            c.data = await run_copy(fill, lease.array(c.shape, c.dtype))
            del fill  # the last reference to the caller's shard may go now
            if c.reads_caller:
                chunk_staged()
        if c.read is not None:
            read, c.read = c.read, None
            c.data = await read()
        if c.fetch is not None:
            fetch, c.fetch = c.fetch, None
            # device -> (pinned) host, inside the budget, on the few threads of the
            # copy pool: the host memory of freed chunks is reused, not kept per
            # I/O thread (core/pools.py copy_pool)
            c.data = await run_copy(fetch)
            del fetch  # the last reference to the staged shard may go now
            if c.reads_caller:
                chunk_staged()
        if c.cuts is not None:
            await _write_cuts(put, c, progress)
            return
        if c.pack is not None:  # small leaves packed together: written, never linked
            await write_pack(view, c.pack, progress)
            return
        if c.batch is not None:
            batch, c.batch = c.batch, None
            for b in batch:
                assert b.data is not None
                if b.meta:
                    await view.write(b.key, _bytes(b.data))
                else:
                    await put(b.key, b.data, b.codec)
                if progress is not None:
                    progress.advance(b.nbytes)
            return
        assert c.data is not None
        if c.meta or c.unhashed:
            await view.write(c.key, _bytes(c.data))
        else:
            await put(c.key, c.data, c.codec)
        c.data = None  # release the host copy as soon as it is stored
        if progress is not None:
            progress.advance(c.nbytes)

    chunks = list(chunks)
    for k, doc in zarr_json.items():
        body = np.frombuffer(json.dumps(doc).encode(), dtype=np.uint8)
        chunks.append(Chunk(k, body, body.nbytes, meta=True))
    # chunks staged on a device leave it as fast as the budget allows, not only as
    # fast as the chunks before them are written (a "pinned_host" caller waits for
    # the last one): the budget bounds them, the task cap is raised
    streamed = any(c.fetch is not None or c.fill is not None for c in chunks)
    pool = _staging_pool(chunks, max_bytes_in_flight)
    chunks = _batch_small(chunks)
    await run_bounded(
        chunks, one, budget=ByteBudget(max_bytes_in_flight), cost=lambda c: c.nbytes,
        max_tasks=max(MAX_TASKS, min(len(chunks), MAX_STREAMED_TASKS)) if streamed else MAX_TASKS,
    )


def _staging_pool(chunks: list[Chunk], max_bytes_in_flight: int) -> HostPool | None:
    """The shared host pool (hostpool.py) whose slots hold the chunks copied off
    the devices while they are written (one slot per chunk, the largest chunk's
    size), limited to the write budget; None when no chunk is copied off a device."""
    largest = max((c.nbytes for c in chunks if c.fill is not None or c.fetch is not None), default=0)
    return shared_pool(largest, max_bytes_in_flight) if largest else None


#: host chunks below this size are written in batches (the versioned store packs
#: them into shared data objects: what costs is the task per chunk, not the bytes)
SMALL_CHUNK_BYTES = 64 << 10
#: bytes of small chunks one task writes
SMALL_BATCH_BYTES = 4 << 20


def _batch_small(chunks: list[Chunk]) -> list[Chunk]:
    """``chunks`` with the small ones already on the host grouped into batches."""
    out: list[Chunk] = []
    cur: list[Chunk] = []
    acc = 0
    for c in chunks:
        if c.fetch is not None or c.fill is not None or c.data is None or c.nbytes >= SMALL_CHUNK_BYTES:
            out.append(c)
            continue
        cur.append(c)
        acc += c.nbytes
        if acc >= SMALL_BATCH_BYTES:
            out.append(Chunk("", None, acc, batch=cur))
            cur, acc = [], 0
    if cur:
        out.append(Chunk("", None, acc, batch=cur) if len(cur) > 1 else cur[0])
    return out


_ENCODE_IN_POOL = 256 << 10


async def _encoded(data: np.ndarray, codec: Any) -> Any:
    """The stored bytes of a chunk: raw, or compressed by ``codec`` (on the CPU
    pool for large chunks: the codecs release the GIL)."""
    if codec is None:
        return _bytes(data)
    if data.nbytes >= _ENCODE_IN_POOL:
        return await run_cpu(codec.encode, _bytes(data))
    return codec.encode(_bytes(data))


async def _write_cuts(
    put: Callable[[str, np.ndarray, Any], Awaitable[None]], c: Chunk, progress: Progress | None
) -> None:
    """Write the chunks cut from a whole shard fetched to the host (``c.data``)."""
    host, cuts, c.data, c.cuts = c.data, c.cuts or [], None, None
    assert host is not None

    async def put_cut(key: str, cut: Callable[[np.ndarray], np.ndarray]) -> None:
        data = cut(host)
        await put(key, data, c.codec)
        if progress is not None:
            progress.advance(data.nbytes)

    await asyncio.gather(*(put_cut(k, cut) for k, cut in cuts))
