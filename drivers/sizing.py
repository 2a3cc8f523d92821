"""How much chunk work the engine keeps in flight, from the threads it may use.

Every figure derives from a :class:`~tensorstore_py.core.pools.Concurrency`
(``cpu``: codec threads, by default one per usable CPU; ``io``: blocking I/O
threads), so a 16-core host runs 16 decoders where a 2-core one runs 4 batches
(enough to overlap I/O waits with decoding), and a Context that limits the
threads limits these too. Measured on 2 cores (page cache, float32):

* raw chunks under 64 KiB are Python work under the GIL (~3 us per chunk
  beside ~2-3 us of system calls, which release it): two batches overlap one's
  system calls with the other's Python work, more hand the GIL around instead
  (8192^2 float32 in 64x64 chunks: 29k chunks/s with one batch in flight, 62k
  with two, 48k with three; TensorStore 61k). Two, or one per 4 CPUs up to 4.
* raw chunks under 1 MiB: the copy releases the GIL; one batch per 2 CPUs (2..8).
* anything to decode (compressors release the GIL): one batch per CPU, at least 4.
* writes wait on fsync: two per CPU, at least 16, so the file system batches
  journal commits. Each write batch hops to a codec thread to encode and to an
  I/O thread to store, and the file store renames a batch's chunks of one folder
  under one hold of its lock and one folder fsync, so chunks are grouped to about
  2 MiB, or less for a write too small to give every codec thread several
  batches. 512^3 uint8 as N5 in 64^3 blocks of 256 KiB, 2 cores, TensorStore's
  time over ours in the same process: 0.55-0.78 in batches of one block (8 runs),
  0.65-1.00 in batches of four (8 runs), 0.90-1.58 in batches of eight (6 runs).
"""

from __future__ import annotations

from tensorstore_py.core.budget import default_max_tasks
from tensorstore_py.core.pools import Concurrency

__all__ = ["async_tasks", "blocking_read_tasks", "prepared_read_tasks", "write_batch_bytes", "write_tasks"]

#: raw chunks smaller than this are GIL-bound per-chunk Python work
RAW_SMALL_BYTES = 64 << 10
#: raw chunks smaller than this are cheap copies
RAW_MEDIUM_BYTES = 1 << 20
# chunk bytes in flight on the generic async path, per codec thread (at least
# the floor): enough to hide remote latency without thrashing caches and pools
# (64 x 4 MiB reads in flight were 1.6x slower than 8 on the local file store)
_ASYNC_READ_BYTES_PER_CPU, _ASYNC_READ_FLOOR = 4 << 20, 32 << 20
_ASYNC_WRITE_BYTES_PER_CPU, _ASYNC_WRITE_FLOOR = 8 << 20, 64 << 20
#: chunk bytes per write batch on stores with blocking I/O hooks (see the module doc),
#: and the least a small write's batches are cut down to
WRITE_BATCH_BYTES, MIN_WRITE_BATCH_BYTES = 2 << 20, 256 << 10
#: batches a write gets per codec thread at least, as far as MIN_WRITE_BATCH_BYTES allows
_WRITE_BATCHES_PER_CPU = 4


def _cap(c: Concurrency, n: int) -> int:
    return max(1, min(c.io, n))


def blocking_read_tasks(c: Concurrency, chunk_nbytes: int, *, raw: bool) -> int:
    """Batches in flight when reading from a store with blocking I/O hooks."""
    if raw and chunk_nbytes < RAW_SMALL_BYTES:
        return _cap(c, min(4, max(2, c.cpu // 4)))
    if raw and chunk_nbytes < RAW_MEDIUM_BYTES:
        return _cap(c, max(2, min(8, c.cpu // 2)))
    return _cap(c, max(4, c.cpu))


def prepared_read_tasks(c: Concurrency) -> int:
    """Batches in flight on the prepared-read path (``KvStore._prepare_read``)."""
    return _cap(c, max(4, c.cpu))


def write_batch_bytes(c: Concurrency, total_bytes: int) -> int:
    """Chunk bytes per batch of a write of ``total_bytes`` of chunks (blocking I/O
    hooks): WRITE_BATCH_BYTES, less where that would leave a codec thread
    without several batches, down to MIN_WRITE_BATCH_BYTES."""
    spread = total_bytes // (_WRITE_BATCHES_PER_CPU * max(1, c.cpu))
    return max(MIN_WRITE_BATCH_BYTES, min(WRITE_BATCH_BYTES, spread))


def write_tasks(c: Concurrency) -> int:
    """Write batches in flight on stores with blocking I/O hooks."""
    return _cap(c, max(16, 2 * c.cpu))


def async_tasks(c: Concurrency, chunk_nbytes: int, *, write: bool,
                slots: int | None = None, budget_bytes: int | None = None) -> int:
    """Chunk operations in flight on the generic async path (remote stores,
    wrappers): ~``max(floor, per-CPU bytes x cpu)`` of chunks, at least 4.

    ``slots``: the store's requests in flight (``KvStore.requests_in_flight``).
    A remote store's throughput is the bytes in flight over the round trip (the
    bandwidth-delay product), not a matter of CPUs: its slots are all kept busy,
    as far as ``budget_bytes`` (the array's byte budget) holds their chunks."""
    per, floor = ((_ASYNC_WRITE_BYTES_PER_CPU, _ASYNC_WRITE_FLOOR) if write
                  else (_ASYNC_READ_BYTES_PER_CPU, _ASYNC_READ_FLOOR))
    nbytes = max(floor, per * c.cpu)
    n = max(4, min(default_max_tasks(), nbytes // max(1, chunk_nbytes)))
    if slots:
        fit = slots if budget_bytes is None else budget_bytes // max(1, chunk_nbytes)
        n = max(n, min(slots, default_max_tasks(), fit))
    return n
