"""Vectorised moves of raw inner chunks between a shard's bytes and an array.

A shard whose inner chunks are stored raw (their native C-order bytes, no
compression) is a table of equal-sized records. These helpers move many of them
with a few numpy calls instead of one Python step per inner chunk: the array
side is seen through a *blocked view* (grid cells first, then the positions in
a cell), the bytes side as an array of records.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

__all__ = ["blocked", "gather_cells", "place_cells"]

#: a missing inner chunk's index entry (offset and length)
MISSING = np.uint64(2**64 - 1)


def blocked(a: np.ndarray, chunk_shape: tuple[int, ...]) -> np.ndarray:
    """A writeable view of ``a`` (any strides; each dimension a multiple of
    the chunk's) with shape ``cells + chunk_shape``: ``blocked(a, c)[i, j]`` is
    the cell at grid position ``(i, j)``."""
    cells = tuple(s // c for s, c in zip(a.shape, chunk_shape))
    strides = tuple(st * c for st, c in zip(a.strides, chunk_shape)) + a.strides
    return as_strided(a, cells + tuple(chunk_shape), strides)


def place_cells(buf: memoryview, entries: np.ndarray, target: np.ndarray,
                chunk_shape: tuple[int, ...], fill: np.ndarray) -> bool:
    """Copy the raw inner chunks that ``entries`` (``cells + (2,)`` uint64
    ``(offset, nbytes)`` pairs into ``buf``, already validated) locate into the
    cells of ``target`` (``cells x chunk_shape``); missing entries get ``fill``.

    Returns False, touching nothing, when an entry is not a whole raw chunk or
    the records do not sit on one stride (the caller then decodes chunk by
    chunk, which reports bad entries precisely).
    """
    nbytes = int(np.prod(chunk_shape, dtype=np.int64)) * target.dtype.itemsize
    off, n = entries[..., 0], entries[..., 1]
    present = off != MISSING
    if not present.any():
        target[...] = fill
        return True
    po = off[present]
    if (n[present] != nbytes).any():
        return False
    base = int(po.min())
    rel = po - np.uint64(base)
    if (rel % np.uint64(nbytes)).any():
        return False
    k = (rel // np.uint64(nbytes)).astype(np.intp)
    count = int(k.max()) + 1
    if base + count * nbytes > len(buf):
        return False
    records = np.frombuffer(buf, dtype=target.dtype, count=count * (nbytes // target.dtype.itemsize),
                            offset=base).reshape((count,) + tuple(chunk_shape))
    view = blocked(target, chunk_shape)
    if present.all() and count == k.size and (k == np.arange(k.size)).all():
        view[...] = records.reshape(view.shape)  # stored in C order of the cells: one copy
    else:
        view[present] = records[k]
        if not present.all():
            view[~present] = fill
    return True


def gather_cells(a: np.ndarray, chunk_shape: tuple[int, ...], fill: np.ndarray,
                 out: np.ndarray) -> np.ndarray:
    """Copy the cells of ``a`` in C order of the grid into ``out`` (a contiguous
    ``(ncells,) + chunk_shape`` array of ``a``'s dtype) with one strided copy;
    returns the boolean mask of the cells that are not entirely ``fill`` (bitwise)."""
    view = blocked(a, chunk_shape)
    ncells = out.shape[0]
    out.reshape(view.shape)[...] = view
    size = a.dtype.itemsize
    if size in (1, 2, 4, 8):
        flat = out.reshape(ncells, -1).view(f"u{size}")
        fv = fill.view(f"u{size}")
        # a (ncells,) mask: np.asarray only narrows the type (any() may be a scalar on 1-d input)
        return np.asarray(flat.any(axis=1) if fv == 0 else (flat != fv).any(axis=1))
    raw = out.reshape(ncells, -1).view(np.uint8).reshape(ncells, -1, size)
    return (raw != np.frombuffer(fill.tobytes(), np.uint8)).any(axis=(1, 2))
