"""Copies between arrays whose elements run in opposite orders.

A chunk stored with its first dimension fastest (N5 blocks, zarr ``order: F``,
a ``transpose`` codec) is copied into a C-order result, and a C-order source
into such a chunk when it is encoded, with every element of one side's
contiguous run landing in another cache line of the other side. numpy walks
such a copy in one order for the whole array, and a 64^3 block misses the
caches on one side at every element (820 us for a 256 KiB uint8 block here,
either way). Copied in slabs a few elements thick along the destination's
contiguous dimension, each slab's lines on both sides stay in the L1 cache
between its elements: 330 us into C order (100 instead of 215 us for an
unaligned part of the block), 160 us into F order.

Where both sides run the same way but their rows are short (the contiguous
last dimension of a 64^3 uint8 inner chunk is 64 bytes, landing 256 bytes
apart in a 256^3 shard), numpy's copy is a call per row, and the calls, not
the bytes, take the time. Each row seen as one element of a ``void`` dtype
makes the rows the copy loop's elements: a 256^3 uint8 shard assembled from
64^3 inner chunks took 3.6 instead of 4.9 ms here, 64^3 float32 chunks of a
256^3 result 12.2 instead of 17 ms, 64x64x16 uint8 chunks 3.7 instead of 8 ms.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SHORT_ROW_BYTES", "SLAB_TO_C", "SLAB_TO_F", "as_contiguous", "copy_into"]

#: elements along a C-order destination's last dimension per slab
SLAB_TO_C = 4
#: elements along an F-order destination's first dimension per slab
SLAB_TO_F = 8
# below this many elements per slab, numpy's per-call cost outweighs the gain
_MIN_SLAB_ELEMENTS = 2048
#: rows of at most this many bytes are copied as whole elements (see the module doc)
SHORT_ROW_BYTES = 256
# below this many bytes the row views cost more (about 2 us) than they save
_MIN_ROWS_BYTES = 64 << 10


def copy_into(dest: np.ndarray, src: np.ndarray) -> None:
    """``dest[...] = src`` (same shape), in slabs where the two run opposite
    ways: ``dest``'s last (first) dimension is contiguous while ``src``'s last
    dimension has a larger (smaller) stride than its first; row by row where
    both run the same way in short rows (same dtype, 3 or more dimensions)."""
    if src.ndim >= 2 and dest.ndim == src.ndim and dest.size:
        first, last = abs(src.strides[0]), abs(src.strides[-1])
        n, k = dest.shape[-1], SLAB_TO_C
        if (dest.strides[-1] == dest.itemsize and last > first and n > k
                and dest.size // n * k >= _MIN_SLAB_ELEMENTS):
            for c in range(0, n, k):
                dest[..., c:c + k] = src[..., c:c + k]
            return
        n, k = dest.shape[0], SLAB_TO_F
        if (dest.strides[0] == dest.itemsize and first > last and n > k
                and dest.size // n * k >= _MIN_SLAB_ELEMENTS):
            for c in range(0, n, k):
                dest[c:c + k] = src[c:c + k]
            return
        if (dest.ndim >= 3 and dest.dtype == src.dtype and not dest.dtype.hasobject
                and dest.strides[-1] == src.strides[-1] == dest.itemsize
                and dest.nbytes >= _MIN_ROWS_BYTES and dest.shape[-1] * dest.itemsize <= SHORT_ROW_BYTES):
            _rows(dest)[...] = _rows(src)
            return
    dest[...] = src


def as_contiguous(a: np.ndarray) -> np.ndarray:
    """``np.ascontiguousarray(a)``, through :func:`copy_into` where ``a`` is
    not C-contiguous already (a chunk gathered from a larger source)."""
    if a.flags.c_contiguous or a.ndim < 2:
        return np.ascontiguousarray(a)
    out = np.empty(a.shape, a.dtype)
    copy_into(out, a)
    return out


def _rows(a: np.ndarray) -> np.ndarray:
    """``a`` (its last dimension contiguous) with each row as one ``void`` element."""
    return a.view(np.uint8).view(np.dtype((np.void, a.shape[-1] * a.itemsize)))[..., 0]
