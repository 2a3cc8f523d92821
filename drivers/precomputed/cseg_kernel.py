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

__all__ = ["ERRORS", "block_runs", "kernel"]

#: what the kernel's non-zero return codes mean
ERRORS = {
    1: "the block headers run past the end of the data",
    2: "a block's encoded bits are not 0, 1, 2, 4, 8, 16 or 32",
    3: "a block's encoded values lie past the end of the data",
    4: "an encoded value indexes past the end of its lookup table",
}

_KERNEL: list[Any] = []


def block_runs(coords: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For ascending ``coords`` along one axis: the block of each run of coordinates
    that share one, and where each run starts and stops in ``coords``."""
    blocks = coords // block
    starts = np.empty(0, np.int64) if not len(coords) else np.concatenate(
        ([0], np.flatnonzero(blocks[1:] != blocks[:-1]) + 1))
    stops = np.empty_like(starts)
    stops[:-1], stops[-1:] = starts[1:], len(coords)
    return blocks[starts].astype(np.int64), starts.astype(np.int64), stops


def _decode(words: Any, nblocks: int, bvol: int, wpl: int, runs: Any, pos: Any, bmul: Any,
            out: Any) -> int:  # pragma: no cover - compiled by numba
    """Decode some voxels of one channel into ``out``, a 3-d array whose axes A, B, C
    are the chunk's axes in any order (C varies fastest in the loops: give it the
    smallest stride of ``out``). Per axis: ``runs`` = (block numbers, first and
    end output index of each run of voxels in one block), ``pos`` = each voxel's
    position in its block times the axis' step in the block's bit order
    (x: 1, y: bx, z: bx*by), ``bmul`` = the axis' step in block numbering."""
    n = words.shape[0]
    if n < 2 * nblocks:
        return 1
    (ab, a0, a1), (bb, b0, b1), (cb, c0, c1) = runs
    pa, pb, pc = pos
    ma, mb, mc = bmul
    for ka in range(ab.shape[0]):
        for kb in range(bb.shape[0]):
            for kc in range(cb.shape[0]):
                blk = ab[ka] * ma + bb[kb] * mb + cb[kc] * mc
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
                    for i in range(a0[ka], a1[ka]):
                        for j in range(b0[kb], b1[kb]):
                            for k in range(c0[kc], c1[kc]):
                                out[i, j, k] = v
                    continue
                checked = table + (mask + 1) * wpl <= n  # else a short last table: check each voxel
                for i in range(a0[ka], a1[ka]):
                    for j in range(b0[kb], b1[kb]):
                        pij = pa[i] + pb[j]
                        for k in range(c0[kc], c1[kc]):
                            bitpos = (pij + pc[k]) * bits
                            t = table + ((np.int64(words[values + (bitpos >> 5)]) >> (bitpos & 31)) & mask) * wpl
                            if not checked and t + wpl > n:
                                return 4
                            v = np.uint64(words[t])
                            if wpl == 2:
                                v |= np.uint64(words[t + 1]) << np.uint64(32)
                            out[i, j, k] = v
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
            idx = t.Array(t.int64, 1, "C")
            # one signature per label type; any ``out`` layout converts to "A": no
            # recompilation per stride pattern
            sigs = [t.int64(t.Array(t.uint32, 1, "C", readonly=True), t.int64, t.int64, t.int64,
                            t.UniTuple(t.UniTuple(idx, 3), 3), t.UniTuple(idx, 3), t.UniTuple(t.int64, 3),
                            t.Array(label, 3, "A")) for label in (t.uint32, t.uint64)]
            _KERNEL.append(numba.njit(sigs, nogil=True, cache=True)(_decode))
    return _KERNEL[0]
