"""Batched chunk I/O for stores whose operations are cheap blocking calls.

On this kind of machine an asyncio -> thread-pool -> asyncio round trip costs
~100 us, more than reading and decoding a small chunk. Stores with blocking I/O
hooks (``KvStore.blocking_io``: ``_read_blocking``/``_write_blocking``/
``_delete_blocking``, the semantics of ``_read``/``_write``/``_delete`` — the
local file store has them) get whole batches of chunks read, decoded and copied
(or encoded and written) in ONE pool call. Stores that can split a read into
loop-side resolution and blocking data I/O (``KvStore._prepare_read``: the
versioned store over the file store) get each chunk read, checked and decoded
in one pool call (:func:`read_prepared_batch`). Every other store takes the generic
async path; the results and guarantees are identical.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar

import numpy as np

from tensorstore_py.core.buffers import aligned_empty, thread_scratch
from tensorstore_py.core.errors import ConditionFailedError
from tensorstore_py.core.future import submit_blocking
from tensorstore_py.drivers.chunk_buffers import chunk_buffer
from tensorstore_py.drivers.codecs.base import ChunkCodec
from tensorstore_py.drivers.codecs.sharding import ShardingCodec
from tensorstore_py.drivers.grid import ChunkPart, chunk_parts
from tensorstore_py.drivers.raw_regions import LARGE_CHUNK_BYTES, read_region_blocking, wants_ranges
from tensorstore_py.drivers.rmw import RMW_RETRY, rmw_lost
from tensorstore_py.drivers.shard_reads import ShardIndexCache, read_part, run_blocking
from tensorstore_py.kvstore.base import ByteRange, KvStore, ReadResult

__all__ = ["ChunkOps", "batches", "has_sync_io", "read_batch", "read_blocking", "read_prepared_batch", "write_batch"]

T = TypeVar("T")

BATCH_BYTES = 1 << 20
#: room beyond a chunk's decoded size for its stored bytes (headers of an
#: incompressible chunk) in read_batch_general's buffer
READ_SLACK_BYTES = 4096
#: chunk bytes per batch of a blocking read of chunks to decode (see read_batch_bytes)
DECODE_BATCH_BYTES = 128 << 10
BATCH_PARTS = 256


class ChunkOps(Protocol):
    """What the batched paths need from a chunked array (engine.ChunkedArray):
    its grid, its fill value and the per-chunk steps, which stay in one place
    so that every I/O path encodes, decodes and merges chunks alike."""

    _codec: ChunkCodec
    _shard: ShardingCodec | None  # the array's codec is sharding_indexed alone
    _shard_indexes: ShardIndexCache | None  # see drivers/shard_reads.py
    _chunk_shape: tuple[int, ...]
    _shape: tuple[int, ...]
    _chunk_nbytes: int
    _dtype: np.dtype
    _fill_arr: np.ndarray

    def chunk_key(self, cell: tuple[int, ...]) -> str: ...

    def codec_at(self, cell: tuple[int, ...]) -> ChunkCodec: ...

    def _decode_into(self, buf: Any, key: str, p: ChunkPart, dest: np.ndarray) -> np.ndarray | None:
        """Decode one chunk and copy its part into ``dest``."""

    def _encode_full(self, p: ChunkPart, src: np.ndarray) -> Any:
        """The encoded chunk wholly given by ``src`` (None: all fill, delete it)."""

    def _modify(self, res: ReadResult, key: str, p: ChunkPart, src: np.ndarray) -> Any:
        """The stored chunk ``res`` with ``p``'s part set to ``src``, encoded (None: delete)."""


def has_sync_io(kv: KvStore) -> bool:
    """True when ``kv`` implements the blocking I/O hooks (see KvStore.blocking_io)."""
    return bool(getattr(kv, "blocking_io", False))


def batches(parts: Iterable[T], chunk_nbytes: int, *,
            target: int = BATCH_BYTES, max_parts: int = BATCH_PARTS) -> Iterator[list[T]]:
    """Consecutive parts (of ``chunk_nbytes`` each) grouped to ~``target`` bytes (at least one each)."""
    per = max(1, min(max_parts, target // max(1, chunk_nbytes)))
    batch: list[T] = []
    for p in parts:
        batch.append(p)
        if len(batch) >= per:
            yield batch
            batch = []
    if batch:
        yield batch


def read_blocking(arr: ChunkOps, kv: Any, index: tuple[slice, ...], out: np.ndarray, *, tasks: int) -> None:
    """Read ``index`` into ``out`` from the calling thread, with up to ``tasks`` - 1
    helpers: ``submit_blocking`` jobs that, like the caller, take batches from
    one shared queue until it is empty. A helper that starts late finds less (or
    no) work; one that never started is run by the caller when it waits for it
    (and finds the queue empty), so helpers never deadlock a full pool. No event
    loop round trip: on a busy machine every thread hand-off waits for a CPU,
    and a small read (a crop, a plane) is mostly hand-offs. Memory in flight:
    ``tasks`` batches (each ~BATCH_BYTES of chunks)."""
    target = read_batch_bytes(arr)
    todo = batches(chunk_parts(index, arr._chunk_shape, arr._shape), arr._chunk_nbytes, target=target)
    lock = threading.Lock()
    failed: list[BaseException] = []

    def work() -> None:
        while not failed:
            with lock:
                b = next(todo, None)
            if b is None:
                return
            try:
                read_batch(arr, kv, b, out)
            except BaseException as e:  # stop every worker; the caller raises it
                failed.append(e)

    # batches of at most this many chunks (see ``batches``): no helper without work
    n_chunks = math.prod(0 if s.stop <= s.start else (s.stop - 1) // c - s.start // c + 1
                         for s, c in zip(index, arr._chunk_shape))
    per_batch = max(1, min(BATCH_PARTS, target // max(1, arr._chunk_nbytes)))
    helpers = [submit_blocking(work) for _ in range(min(tasks, -(-n_chunks // per_batch)) - 1)]
    work()
    for h in helpers:  # they still write into out: wait for every one
        h.result()
    if failed:
        raise failed[0]


def read_batch_bytes(arr: ChunkOps) -> int:
    """Chunk bytes per batch of a blocking read: BATCH_BYTES of raw chunks
    (per-chunk overhead matters there), DECODE_BATCH_BYTES of chunks to decode
    (decoding dominates: small batches share the work evenly among the
    threads, so no thread waits long for another's last batch)."""
    return BATCH_BYTES if arr._codec.raw and arr._shard is None else DECODE_BATCH_BYTES


def read_batch(arr: ChunkOps, kv: Any, parts: list[ChunkPart], out: np.ndarray) -> None:
    """Read, decode and copy every part of ``parts`` into ``out`` (blocking); parts
    of large raw chunks by their byte ranges only (drivers/raw_regions.py)."""
    if arr._shard is None and arr._codec.raw and arr._chunk_nbytes > LARGE_CHUNK_BYTES:
        rest = []
        for p in parts:
            if p.full or not wants_ranges(arr._chunk_nbytes, True, p.chunk):
                rest.append(p)
                continue
            key = arr.chunk_key(p.cell)
            full = kv.path + key

            def read(r: ByteRange, full: str = full) -> ReadResult:
                return kv._read_blocking(full, r, None)

            read_region_blocking(read, key, arr._chunk_shape, p.chunk, out[p.out + (Ellipsis,)], arr._fill_arr)
        parts = rest
        if not parts:
            return
    if arr._codec.raw and arr._shard is None and hasattr(kv, "_read_into_blocking"):
        _read_raw_batch(arr, kv, parts, out)
    else:
        read_batch_general(arr, kv, parts, out)


def read_batch_general(arr: ChunkOps, kv: Any, parts: list[ChunkPart], out: np.ndarray) -> None:
    """``read_batch`` for any chunk encoding (and partial shards).

    Where the store can read a value into a given buffer (the file store),
    each chunk's stored bytes go into this thread's scratch buffer
    (core/buffers.py::thread_scratch), warm in cache, and are decoded from
    there before the next chunk is read: no allocation, generation or result
    object per chunk; chunks too large for it, into a block of
    drivers/chunk_buffers.py. A value larger than the buffer takes ``_read_blocking``.
    """
    buf = None
    pooled = False  # a block per chunk from drivers/chunk_buffers.py (chunks too large for the scratch)
    if arr._shard is None and hasattr(kv, "_read_into_blocking"):
        buf = thread_scratch(arr._chunk_nbytes + READ_SLACK_BYTES)
        pooled = buf is None
    for p in parts:
        key = arr.chunk_key(p.cell)
        full = kv.path + key  # our keys are valid by construction
        dest = out[p.out + (Ellipsis,)]
        if pooled:
            buf = None  # the last chunk's block goes back first: two blocks per thread, not three
            buf = chunk_buffer(arr._chunk_nbytes + READ_SLACK_BYTES)
        if buf is not None:
            size = kv._read_into_blocking(full, buf, smaller=True)
            if size < 0:
                dest[...] = arr._fill_arr
                continue
            if size <= buf.nbytes:  # decoded (and copied out) before the buffer is read into again
                arr._decode_into(buf[:size].data, key, p, dest)
                continue
        if arr._shard is not None and not p.full:
            _read_sharded(arr, kv, key, full, p, dest)
            continue
        res = kv._read_blocking(full, None, None)
        if res.state == "missing":
            dest[...] = arr._fill_arr
        else:
            arr._decode_into(res.value, key, p, dest)


def _read_raw_batch(arr: ChunkOps, kv: Any, parts: list[ChunkPart], out: np.ndarray) -> None:
    """``read_batch`` for raw chunks (stored bytes = the chunk's native C-order
    bytes): each chunk is read into one reused page-aligned buffer (or straight
    into ``out`` where it maps there 1:1 and contiguously) and copied, with no
    per-chunk allocation or decode call. Small chunks are dominated by such
    per-chunk overhead. A value of any other size takes the general path, which
    reports it as corrupt with the usual message."""
    read_into = kv._read_into_blocking
    prefix = kv.path
    key_of = arr.chunk_key
    cs = arr._chunk_shape
    nbytes = arr._chunk_nbytes
    scratch = thread_scratch(nbytes)  # this thread's, warm (a read of one chunk allocates nothing)
    raw = scratch if scratch is not None else aligned_empty(nbytes)
    chunk = raw.view(arr._dtype).reshape(cs)
    copyto = np.copyto
    # a whole chunk can be contiguous in ``out`` only if it spans out's rows
    maybe_direct = out.flags.c_contiguous and cs[1:] == out.shape[1:]
    ell = (Ellipsis,)
    fill = arr._fill_arr
    for p in parts:
        dest = out[p.out + ell]  # a view even for 0-d arrays
        if p.full and dest.shape == cs:
            if maybe_direct and dest.flags.c_contiguous:
                size = read_into(prefix + key_of(p.cell), dest.reshape(-1).view(np.uint8))
                if size == nbytes:
                    continue
            else:
                size = read_into(prefix + key_of(p.cell), raw)
                if size == nbytes:
                    copyto(dest, chunk)
                    continue
        else:
            size = read_into(prefix + key_of(p.cell), raw)
            if size == nbytes:
                copyto(dest, chunk[p.chunk])
                continue
        if size < 0:
            copyto(dest, fill)
        else:  # a value of another size (corrupt, or changed): the general path decides
            read_batch_general(arr, kv, [p], out)


def read_prepared_batch(arr: ChunkOps, prepared: list[tuple[ChunkPart, Any]], out: np.ndarray) -> None:
    """Run prepared whole-chunk reads (``KvStore._prepare_read``) and decode
    each into ``out`` (blocking)."""
    for p, reader in prepared:
        dest = out[p.out + (Ellipsis,)]
        res = reader()
        if res.state == "missing":
            dest[...] = arr._fill_arr
        else:
            arr._decode_into(res.value, arr.chunk_key(p.cell), p, dest)


def _read_sharded(arr: ChunkOps, kv: Any, key: str, full: str, p: ChunkPart, dest: np.ndarray) -> None:
    assert arr._shard is not None
    run_blocking(read_part(arr._shard, key, p.chunk, dest, arr._shard_indexes), kv, full)


def encode_batch(arr: ChunkOps, parts: list[ChunkPart], value: np.ndarray) -> list[Any]:
    """Encode whole-chunk parts (CPU work; None = all fill value, delete)."""
    return [arr._encode_full(p, value[p.out + (Ellipsis,)]) for p in parts]


def store_batch(arr: ChunkOps, kv: Any, parts: list[ChunkPart], encoded: list[Any]) -> None:
    """Write (or delete) encoded whole chunks unconditionally (blocking I/O)."""
    writes = []
    for p, enc in zip(parts, encoded):
        full = kv.path + arr.chunk_key(p.cell)
        if enc is None:
            kv._delete_blocking(full, None)
        else:
            writes.append((full, enc))
    if writes:
        kv._write_many_blocking(writes)


def write_batch(arr: ChunkOps, kv: Any, parts: list[ChunkPart], value: np.ndarray) -> None:
    """Encode and write every part: whole chunks unconditionally, together (one
    ``store_batch``), partial ones as a generation-checked read-modify-write
    retried on a lost race."""
    whole = [p for p in parts if p.full]
    if whole:
        store_batch(arr, kv, whole, encode_batch(arr, whole, value))
    for p in parts:
        if p.full:
            continue
        key = arr.chunk_key(p.cell)
        full = kv.path + key  # our keys are valid by construction
        src = value[p.out + (Ellipsis,)]
        for attempt in range(1, RMW_RETRY.max_attempts + 1):
            res = kv._read_blocking(full, None, None)
            enc = arr._modify(res, key, p, src)
            try:
                if enc is None:
                    if not res.generation.is_no_value:
                        kv._delete_blocking(full, res.generation)
                else:
                    kv._write_blocking(full, enc, res.generation)
                break
            except ConditionFailedError:
                time.sleep(RMW_RETRY.delay(attempt))  # lost to another writer: merge again
        else:
            raise rmw_lost(key)
