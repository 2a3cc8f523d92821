"""A compiled decoder of compressed_segmentation channels (numba), for any box of voxels.

The numpy decoder in :mod:`.compressed_segmentation` is the reference; this
kernel does the same work one block at a time in compiled code, releasing the
GIL (so decoding runs on every core), and writes only the voxels asked for
straight into the caller's array, whatever its strides: a plane through a
chunk costs a plane, a crop costs the crop. Every header, offset and table
position it reads is checked against the data first; a bad one stops it with
an error code that the caller turns into DataCorruptionError.

numba is optional (extra "precomputed"); without it :func:`kernel` returns None
and callers use the numpy decoder. The first call compiles the kernel for
uint32 and uint64 labels (a second or two; cached on disk by numba where the
package folder is writable).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ERRORS", "kernel"]

#: what the kernel's non-zero return codes mean
ERRORS = {
    1: "the block headers run past the end of the data",
    2: "a block's encoded bits are not 0, 1, 2, 4, 8, 16 or 32",
    3: "a block's encoded values lie past the end of the data",
    4: "an encoded value indexes past the end of its lookup table",
}

_KERNEL: list[Any] = []


def _decode(words: Any, nblocks: int, bvol: int, wpl: int, first: Any, step: Any, count: Any, bsize: Any,
            pstep: Any, bstep: Any, out: Any) -> int:  # pragma: no cover - compiled by numba
    """Decode some voxels of one channel into ``out``, a 3-d array whose axes A, B, C
    are the chunk's axes in any order (C varies fastest in the loops: give it the
    smallest stride of ``out``). Along each axis the voxels are ``first + i * step``
    for ``i < count``; ``bsize`` is the block's extent, ``pstep`` the axis' step in a
    block's bit order (x: 1, y: bx, z: bx*by), ``bstep`` its step in the numbering
    of blocks."""
    n = words.shape[0]
    if n < 2 * nblocks:
        return 1
    na, nb, nc = count[0], count[1], count[2]
    ba, pa = np.empty(na, np.int64), np.empty(na, np.int64)
    bb, pb = np.empty(nb, np.int64), np.empty(nb, np.int64)
    bc, pc = np.empty(nc, np.int64), np.empty(nc, np.int64)
    for i in range(na):
        v = first[0] + i * step[0]
        ba[i], pa[i] = v // bsize[0] * bstep[0], v % bsize[0] * pstep[0]
    for i in range(nb):
        v = first[1] + i * step[1]
        bb[i], pb[i] = v // bsize[1] * bstep[1], v % bsize[1] * pstep[1]
    for i in range(nc):
        v = first[2] + i * step[2]
        bc[i], pc[i] = v // bsize[2] * bstep[2], v % bsize[2] * pstep[2]
    a0 = 0
    while a0 < na:  # runs of voxels in one block along each axis
        a1 = a0 + 1
        while a1 < na and ba[a1] == ba[a0]:
            a1 += 1
        b0 = 0
        while b0 < nb:
            b1 = b0 + 1
            while b1 < nb and bb[b1] == bb[b0]:
                b1 += 1
            c0 = 0
            while c0 < nc:
                c1 = c0 + 1
                while c1 < nc and bc[c1] == bc[c0]:
                    c1 += 1
                blk = ba[a0] + bb[b0] + bc[c0]
                h = np.int64(words[2 * blk])
                table = h & 0xFFFFFF
                bits = h >> 24
                values = np.int64(words[2 * blk + 1])
                if bits != 0 and bits != 1 and bits != 2 and bits != 4 and bits != 8 and bits != 16 and bits != 32:
                    return 2
                mask = (np.int64(1) << bits) - 1
                if bits and values + (bits * bvol + 31) // 32 > n:
                    return 3
                if table + wpl > n:
                    return 4
                if bits == 0:  # one label for the whole block (common): no bits to read
                    v = np.uint64(words[table])
                    if wpl == 2:
                        v |= np.uint64(words[table + 1]) << np.uint64(32)
                    for i in range(a0, a1):
                        for j in range(b0, b1):
                            for k in range(c0, c1):
                                out[i, j, k] = v
                else:
                    checked = table + (mask + 1) * wpl <= n  # else a short last table: check each voxel
                    for i in range(a0, a1):
                        for j in range(b0, b1):
                            pij = pa[i] + pb[j]
                            for k in range(c0, c1):
                                bitpos = (pij + pc[k]) * bits
                                t = table + ((np.int64(words[values + (bitpos >> 5)]) >> (bitpos & 31)) & mask) * wpl
                                if not checked and t + wpl > n:
                                    return 4
                                v = np.uint64(words[t])
                                if wpl == 2:
                                    v |= np.uint64(words[t + 1]) << np.uint64(32)
                                out[i, j, k] = v
                c0 = c1
            b0 = b1
        a0 = a1
    return 0


def kernel() -> Callable[..., int] | None:
    """The compiled kernel, or None when numba is not installed."""
    if not _KERNEL:
        try:
            import numba  # optional and heavy (LLVM): only compressed_segmentation decoding uses it
        except ImportError:
            _KERNEL.append(None)
        else:
            t = numba.types
            three = t.UniTuple(t.int64, 3)
            # one signature per label type; any ``out`` layout converts to "A": no
            # recompilation per stride pattern
            sigs = [t.int64(t.Array(t.uint32, 1, "C", readonly=True), t.int64, t.int64, t.int64,
                            three, three, three, three, three, three, t.Array(label, 3, "A"))
                    for label in (t.uint32, t.uint64)]
            _KERNEL.append(numba.njit(sigs, nogil=True, cache=True)(_decode))
    return _KERNEL[0]
