"""Part of a large raw chunk read by byte ranges, never the whole chunk.

A chunk whose stored bytes are its native C-order bytes (``ChunkCodec.raw``:
the bytes codec alone) holds a box of it in contiguous *runs*: the innermost
dimensions the box covers whole, times the box's extent along the next one.
:func:`byte_runs` lists them; the readers fetch them in slabs of at most
``SLAB_BYTES`` (runs closer than ``MERGE_GAP`` share one request) and copy each
run into the destination, so memory is the slab plus the destination, whatever
the chunk's size (a plane of a 4 GiB chunk costs the plane).

Consistency: every slab of one chunk must come from the same generation; when
the chunk changes between slabs (or is deleted) the part is read again, up to
``ATTEMPTS`` times, then ``ConditionFailedError``. A stored value shorter than
the chunk raises ``DataCorruptionError`` naming the key (a longer one is not
detected without reading its end). Compressed chunks still decode whole: their
codecs have no random access.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Awaitable, Callable, Iterator

import numpy as np

from tensorstore_py.core.errors import ConditionFailedError, DataCorruptionError
from tensorstore_py.kvstore.base import ByteRange, Generation, ReadResult

__all__ = ["LARGE_CHUNK_BYTES", "byte_runs", "read_region_async", "read_region_blocking", "wants_ranges"]

#: partial reads of raw chunks larger than this go by byte ranges
LARGE_CHUNK_BYTES = 256 << 20
SLAB_BYTES = 16 << 20
MERGE_GAP = 64 << 10
ATTEMPTS = 5

Run = tuple[tuple[int, ...], int, int]  # (outer index in the box, first byte, length)


def wants_ranges(chunk_nbytes: int, raw: bool, sel: tuple[slice, ...]) -> bool:
    """Whether a part ``sel`` (a box of the chunk, unit steps) of a raw chunk of
    ``chunk_nbytes`` bytes is read by ranges: large chunks, partial boxes."""
    return raw and chunk_nbytes > LARGE_CHUNK_BYTES and all(s.step in (None, 1) for s in sel)


def byte_runs(chunk_shape: tuple[int, ...], itemsize: int, sel: tuple[slice, ...]) -> tuple[int, Iterator[Run]]:
    """``(j, runs)``: the box ``sel`` of a C-order chunk as contiguous runs, each
    covering ``sel[j:]`` at one index of the dimensions before ``j``, in C order."""
    n = len(chunk_shape)
    j = n - 1
    while j > 0 and sel[j].start == 0 and sel[j].stop == chunk_shape[j]:
        j -= 1
    strides = [itemsize * math.prod(chunk_shape[d + 1:]) for d in range(n)]
    length = (sel[j].stop - sel[j].start) * strides[j]
    base = sel[j].start * strides[j]
    outer = [range(s.stop - s.start) for s in sel[:j]]
    starts = [s.start for s in sel[:j]]

    def runs() -> Iterator[Run]:
        for idx in itertools.product(*outer):
            yield idx, base + sum((i + s) * st for i, s, st in zip(idx, starts, strides)), length

    return j, runs()


def _slabs(runs: Iterator[Run]) -> Iterator[tuple[ByteRange, list[Run]]]:
    """Runs grouped into requests of at most SLAB_BYTES (one run may exceed it)."""
    group: list[Run] = []
    lo = hi = 0
    for r in runs:
        _, a, n = r
        if group and (a - hi > MERGE_GAP or a + n - lo > SLAB_BYTES):
            yield ByteRange(lo, hi), group
            group = []
        if not group:
            lo = a
        group.append(r)
        hi = a + n
    if group:
        yield ByteRange(lo, hi), group


def _copy(value: bytes | bytearray | memoryview, rng: ByteRange, group: list[Run], j: int, dest: np.ndarray,
          key: str) -> None:
    mv = memoryview(value).cast("B")
    if len(mv) < (rng.stop or 0) - rng.start:
        raise DataCorruptionError(f"chunk {key!r}: stored value ends before byte {rng.stop} "
                                  f"(a raw chunk of {dest.dtype} holds more)")
    sub = dest.shape[j:]
    for idx, a, n in group:
        off = a - rng.start
        dest[idx] = np.frombuffer(mv[off:off + n], dest.dtype).reshape(sub)


def read_region_blocking(read: Callable[[ByteRange], ReadResult], key: str, chunk_shape: tuple[int, ...],
                         sel: tuple[slice, ...], dest: np.ndarray, fill: np.ndarray) -> None:
    """Read box ``sel`` of the raw chunk at ``key`` into ``dest`` with ``read(range)``
    (a blocking ranged read of the chunk's value); fill when the chunk is missing."""
    for _ in range(ATTEMPTS):
        j, runs = byte_runs(chunk_shape, dest.dtype.itemsize, sel)
        gen: Generation | None = None
        for rng, group in _slabs(runs):
            res = read(rng)
            if gen is None:
                gen = res.generation
                if res.state == "missing":
                    dest[...] = fill
                    return
            elif res.generation != gen:
                break  # changed under us: read the part again
            _copy(res.value, rng, group, j, dest, key)
        else:
            return
    raise ConditionFailedError(f"chunk {key!r} kept changing while a part of it was read "
                               f"({ATTEMPTS} attempts)")


async def read_region_async(read: Callable[[ByteRange], Awaitable[ReadResult]], key: str,
                            chunk_shape: tuple[int, ...], sel: tuple[slice, ...], dest: np.ndarray,
                            fill: np.ndarray) -> None:
    """:func:`read_region_blocking` with an awaitable ranged read."""
    for _ in range(ATTEMPTS):
        j, runs = byte_runs(chunk_shape, dest.dtype.itemsize, sel)
        gen: Generation | None = None
        for rng, group in _slabs(runs):
            res = await read(rng)
            if gen is None:
                gen = res.generation
                if res.state == "missing":
                    dest[...] = fill
                    return
            elif res.generation != gen:
                break
            _copy(res.value, rng, group, j, dest, key)
        else:
            return
    raise ConditionFailedError(f"chunk {key!r} kept changing while a part of it was read "
                               f"({ATTEMPTS} attempts)")
