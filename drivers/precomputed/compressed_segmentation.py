"""Neuroglancer's ``compressed_segmentation`` encoding of uint32/uint64 label volumes.

Format (per channel; a multi-channel chunk starts with one uint32 per channel
giving, in 32-bit words from the start of the chunk, where that channel's data
begins). A channel of shape (x, y, z) is cut into blocks of ``block_size``;
blocks at the upper edges are conceptually padded. It holds ``gx*gy*gz`` 64-bit
block headers (x fastest), then, per block, its encoded values and its lookup
table::

    header   bits 0-23: lookup table offset, bits 24-31: encoded bits (0, 1, 2, 4,
             8, 16 or 32), bits 32-63: encoded values offset (offsets in 32-bit
             words from the start of the channel)
    values   each voxel's index into the table, ``bits`` bits each, packed into
             little-endian uint32 words, position x + bx*(y + by*z) of the block
    table    the block's distinct labels, ascending, little-endian uint32/uint64

Identical tables are stored once and shared (TensorStore and neuroglancer do
this too); padded positions encode index 0. :func:`encode` is byte-for-byte
what TensorStore writes.

Both directions are vectorised with numpy: per-block distinct values come from
one row-wise sort, tables are deduplicated with ``np.unique`` per table length,
bit packing and unpacking work on whole groups of blocks. Decoding checks every
header, offset and index against the buffer before touching it and allocates
nothing larger than the output (and temporaries of its size).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorstore_py.core.errors import DataCorruptionError, InvalidArgumentError
from tensorstore_py.core.ranges import Buffer
from tensorstore_py.drivers.precomputed.cseg_kernel import ERRORS, kernel

__all__ = ["MAX_BLOCK_ELEMENTS", "decode", "encode"]

#: blocks larger than this are refused (TensorStore has no limit; real data uses 8**3..64**3)
MAX_BLOCK_ELEMENTS = 2**31
_BITS = (0, 1, 2, 4, 8, 16, 32)
_TABLE_OFFSET_LIMIT = 1 << 24  # the header's 24-bit lookup table offset
_DTYPES = (np.dtype("uint32"), np.dtype("uint64"))
# numpy decoding voxel by voxel costs ~2-3x a whole-chunk decode per voxel: regions
# above 1/_GATHER_FRACTION of the chunk are cut from a whole decode instead
_GATHER_FRACTION = 4


def _check_block(block_size: Sequence[int]) -> tuple[int, int, int]:
    if len(block_size) != 3 or any(not isinstance(b, (int, np.integer)) or b < 1 for b in block_size):
        raise InvalidArgumentError(f"compressed_segmentation: block size must be 3 positive integers, "
                                   f"got {list(block_size)}")
    if math.prod(int(b) for b in block_size) > MAX_BLOCK_ELEMENTS:
        raise InvalidArgumentError(f"compressed_segmentation: block size {list(block_size)} has more "
                                   f"than {MAX_BLOCK_ELEMENTS} elements")
    return int(block_size[0]), int(block_size[1]), int(block_size[2])


def _ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorised."""
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts.astype(np.int64) - offsets, lengths) + np.arange(total, dtype=np.int64)


def _encoded_bits(counts: np.ndarray) -> np.ndarray:
    """0 for one distinct value, else the smallest of 1, 2, 4, ... 32 bits that index them."""
    bits = np.zeros(counts.shape, np.int64)
    for b in (32, 16, 8, 4, 2, 1):
        bits[counts <= (1 << b)] = b
    bits[counts == 1] = 0
    return bits


def _blocks_of(vol: np.ndarray, block: tuple[int, int, int]) -> tuple[np.ndarray, tuple[int, ...], tuple[int, ...]]:
    """Cut a (z, y, x) volume into rows of block voxels (edge blocks padded with
    their own edge values). Returns (blocks, grid, extent): ``extent`` is the block
    size clipped to the volume, the part of a block that can hold voxels."""
    shape = vol.shape
    grid = tuple(-(-s // b) for s, b in zip(shape, block))
    ext = tuple(min(b, s) for s, b in zip(shape, block))
    pad = [(0, g * e - s) for g, e, s in zip(grid, ext, shape)]
    if any(p for _, p in pad):
        vol = np.pad(vol, pad, mode="edge")
    (gz, gy, gx), (ez, ey, ex) = grid, ext
    rows = vol.reshape(gz, ez, gy, ey, gx, ex).transpose(0, 2, 4, 1, 3, 5).reshape(gz * gy * gx, ez * ey * ex)
    return rows, grid, ext


def _inside_mask(shape: tuple[int, ...], grid: tuple[int, ...], ext: tuple[int, ...]) -> np.ndarray | None:
    """Per block row, which positions lie inside the volume (None: all of them)."""
    if all(g * e == s for g, e, s in zip(grid, ext, shape)):
        return None
    inside = np.zeros(tuple(g * e for g, e in zip(grid, ext)), bool)
    inside[: shape[0], : shape[1], : shape[2]] = True
    (gz, gy, gx), (ez, ey, ex) = grid, ext
    return inside.reshape(gz, ez, gy, ey, gx, ex).transpose(0, 2, 4, 1, 3, 5).reshape(gz * gy * gx, -1)


def _encode_channel(vol: np.ndarray, block: tuple[int, int, int]) -> np.ndarray:
    """One channel, ``vol`` in (z, y, x) order, ``block`` as (bz, by, bx); uint32 words."""
    wpl = vol.dtype.itemsize // 4  # words per label
    rows, grid, ext = _blocks_of(vol, block)
    nb, ev = rows.shape
    bvol = block[0] * block[1] * block[2]

    # distinct values and each voxel's rank among them, per block (one row-wise sort)
    lo, hi = rows.min(axis=1), rows.max(axis=1)
    mixed = np.flatnonzero(lo != hi)
    counts = np.ones(nb, np.int64)
    index = np.zeros((nb, ev), np.uint32)
    if len(mixed):
        sub = rows[mixed]
        order = np.argsort(sub, axis=1)
        ranked = np.take_along_axis(sub, order, axis=1)
        new = np.empty(ranked.shape, bool)
        new[:, 0] = True
        np.not_equal(ranked[:, 1:], ranked[:, :-1], out=new[:, 1:])
        rank = np.cumsum(new, axis=1, dtype=np.uint32) - np.uint32(1)
        sub_index = np.empty_like(rank)
        np.put_along_axis(sub_index, order, rank, axis=1)
        index[mixed] = sub_index
        counts[mixed] = rank[:, -1].astype(np.int64) + 1
        mixed_tables = ranked[new]  # each mixed block's sorted distinct values, in block order
    inside = _inside_mask(vol.shape, grid, ext)
    if inside is not None:
        index[~inside] = 0  # padded positions encode index 0, as TensorStore writes them

    # every block's table, concatenated in block order
    table_start = np.cumsum(counts) - counts
    tables = np.empty(int(counts.sum()), vol.dtype)
    tables[table_start] = lo
    if len(mixed):
        tables[_ragged_arange(table_start[mixed], counts[mixed])] = mixed_tables

    # identical tables are stored once: map each block to the first block with its table
    canon = np.arange(nb)
    for n in np.unique(counts):
        group = np.flatnonzero(counts == n)
        if len(group) < 2:
            continue
        t = np.ascontiguousarray(tables[table_start[group][:, None] + np.arange(n)])
        keys = t.view(np.dtype((np.void, t.shape[1] * t.itemsize))).reshape(-1)  # a bytes key per table
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        canon[group] = group[first[inverse.reshape(-1)]]
    is_first = canon == np.arange(nb)

    # layout: headers, then per block its encoded values and (if first) its table
    bits = _encoded_bits(counts)
    value_words = (bits * bvol + 31) // 32
    sizes = value_words + np.where(is_first, counts * wpl, 0)
    value_offset = 2 * nb + np.cumsum(sizes) - sizes
    table_offset = (value_offset + value_words)[canon]
    total = 2 * nb + int(sizes.sum())
    if nb and int(table_offset.max()) >= _TABLE_OFFSET_LIMIT:
        raise InvalidArgumentError(
            f"compressed_segmentation: a channel of shape {list(vol.shape[::-1])} encodes to "
            f"{total} words, past the 24-bit table offsets the format allows"
        )
    out = np.zeros(total, np.uint32)
    out[0 : 2 * nb : 2] = table_offset | (bits << 24)
    out[1 : 2 * nb : 2] = value_offset

    # encoded values: pack each group of blocks with the same bit width at once
    full = ev == bvol
    for b in _BITS[1:]:
        sel = np.flatnonzero(bits == b)
        if not len(sel):
            continue
        idx = index[sel]
        if not full:  # the block reaches past the volume: place it in a whole block of zeros
            whole = np.zeros((len(sel), *block), np.uint32)
            whole[:, : ext[0], : ext[1], : ext[2]] = idx.reshape(len(sel), *ext)
            idx = whole.reshape(len(sel), bvol)
        per_word = 32 // b
        nw = -(-bvol // per_word)
        if nw * per_word != bvol:
            idx = np.pad(idx, ((0, 0), (0, nw * per_word - bvol)))
        shifts = (np.arange(per_word, dtype=np.uint32) * np.uint32(b))
        packed = np.bitwise_or.reduce(idx.reshape(len(sel), nw, per_word) << shifts, axis=2)
        out[value_offset[sel][:, None] + np.arange(nw)] = packed

    # lookup tables of the first block with each table
    firsts = np.flatnonzero(is_first)
    values = tables[_ragged_arange(table_start[firsts], counts[firsts])]
    if wpl == 2:
        values = np.stack([values & np.uint64(0xFFFFFFFF), values >> np.uint64(32)], axis=1).reshape(-1)
    out[_ragged_arange(table_offset[firsts], counts[firsts] * wpl)] = values
    return out


def encode(array: np.ndarray, block_size: Sequence[int]) -> bytes:
    """Encode a uint32 or uint64 array of shape (x, y, z, channels).

    ``block_size`` is (bx, by, bz). The output is what TensorStore writes for the
    same chunk, byte for byte.
    """
    if array.ndim != 4 or array.dtype not in _DTYPES:
        raise InvalidArgumentError(f"compressed_segmentation: expected a uint32/uint64 array of shape "
                                   f"(x, y, z, channels), got {array.dtype} {array.shape}")
    bx, by, bz = _check_block(block_size)
    block = (bz, by, bx)
    nc = array.shape[3]
    channels = []
    offset = nc
    offsets = np.empty(nc, np.uint32)
    for c in range(nc):
        vol = np.ascontiguousarray(array[:, :, :, c].transpose(2, 1, 0))
        words = _encode_channel(vol, block) if vol.size else np.zeros(0, np.uint32)
        if offset >= 1 << 32:
            raise InvalidArgumentError("compressed_segmentation: encoding exceeds 2**32 words")
        offsets[c] = offset
        offset += len(words)
        channels.append(words)
    return b"".join([offsets.astype("<u4").tobytes(), *(w.astype("<u4").tobytes() for w in channels)])


def _bad(key: str, msg: str) -> DataCorruptionError:
    return DataCorruptionError(f"chunk {key!r}: corrupt compressed_segmentation data: {msg}")


def _headers(words: np.ndarray, grid: tuple[int, ...], bvol: int, key: str
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(table offsets, encoded bits, value offsets) of every block, checked against the data."""
    n = len(words)
    nb = grid[0] * grid[1] * grid[2]
    if n < 2 * nb:
        raise _bad(key, f"{n} words cannot hold {nb} block headers")
    header = words[: 2 * nb].reshape(nb, 2).astype(np.int64)
    table_offset = header[:, 0] & 0xFFFFFF
    bits = header[:, 0] >> 24
    value_offset = header[:, 1]
    if not np.isin(bits, _BITS).all():
        raise _bad(key, f"encoded bits {sorted(set(bits.tolist()) - set(_BITS))} not in {list(_BITS)}")
    value_words = (bits * bvol + 31) // 32
    if (value_offset + value_words > n).any() or (table_offset > n).any():
        raise _bad(key, "a block's values or table lie past the end of the data")
    return table_offset, bits, value_offset


def _lookup(words: np.ndarray, where: np.ndarray, wpl: int, key: str, out: np.ndarray) -> None:
    """``out[...] = `` the labels at word positions ``where`` (checked against the data)."""
    if where.size and int(where.max()) + wpl > len(words):
        raise _bad(key, "an encoded value indexes past the end of its lookup table")
    if wpl == 1:
        out[...] = words[where]
    else:
        out[...] = words[where].astype(np.uint64) | (words[where + 1].astype(np.uint64) << np.uint64(32))


def _decode_channel(words: np.ndarray, shape: tuple[int, int, int], block: tuple[int, int, int],
                    dtype: np.dtype, out: np.ndarray, key: str) -> None:
    """Decode one channel from ``words`` (from the channel start to the end of the chunk)."""
    grid = tuple(-(-s // b) for s, b in zip(shape, block))
    ext = tuple(min(b, s) for s, b in zip(shape, block))
    nb = grid[0] * grid[1] * grid[2]
    bvol = block[0] * block[1] * block[2]
    wpl = dtype.itemsize // 4
    table_offset, bits, value_offset = _headers(words, grid, bvol, key)
    value_words = (bits * bvol + 31) // 32

    # each voxel's table index, in padded block rows (nb, ez*ey*ex)
    ev = ext[0] * ext[1] * ext[2]
    index = np.zeros((nb, ev), np.int64)
    full = ev == bvol
    if not full:  # where each row position sits within its whole block
        z, y, x = np.meshgrid(*(np.arange(e) for e in ext), indexing="ij")
        pos = (x + block[2] * (y + block[1] * z)).reshape(-1)
    for b in _BITS[1:]:
        sel = np.flatnonzero(bits == b)
        if not len(sel):
            continue
        mask = np.uint32((1 << b) - 1) if b < 32 else np.uint32(0xFFFFFFFF)
        if full:
            per_word = 32 // b
            nw = int(value_words[sel[0]])
            w = words[value_offset[sel][:, None] + np.arange(nw)]
            shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(b)
            index[sel] = ((w[:, :, None] >> shifts) & mask).reshape(len(sel), -1)[:, :bvol]
        else:
            bitpos = pos * b
            w = words[value_offset[sel][:, None] + (bitpos >> 5)]
            index[sel] = (w >> (bitpos & 31).astype(np.uint32)) & mask

    # table positions of the voxels inside the chunk, checked against the data
    gz, gy, gx = grid
    ez, ey, ex = ext
    where = table_offset[:, None] + index * wpl
    where = where.reshape(gz, gy, gx, ez, ey, ex).transpose(0, 3, 1, 4, 2, 5)
    where = where.reshape(gz * ez, gy * ey, gx * ex)[: shape[0], : shape[1], : shape[2]]
    _lookup(words, where, wpl, key, out)


def _gather_channel(words: np.ndarray, shape: tuple[int, int, int], block: tuple[int, int, int],
                    dtype: np.dtype, zyx: tuple[np.ndarray, ...], out: np.ndarray,
                    key: str) -> None:
    """Decode only the voxels at coordinates ``zyx`` (one index array per dimension, their
    outer product) of one channel: work in proportion to the voxels, not the chunk."""
    grid = tuple(-(-s // b) for s, b in zip(shape, block))
    bz, by, bx = block
    table_offset, bits, value_offset = _headers(words, grid, bz * by * bx, key)
    zs, ys, xs = zyx[0][:, None, None], zyx[1][None, :, None], zyx[2][None, None, :]
    blk = ((zs // bz) * grid[1] + ys // by) * grid[2] + xs // bx
    bitpos = (((zs % bz) * by + ys % by) * bx + xs % bx) * bits[blk]
    # value words lie inside the data (checked); a 0-bit block may sit at its very end
    # and reads no word: its position is clamped and its mask is 0
    w = words[np.minimum(value_offset[blk] + (bitpos >> 5), len(words) - 1)].astype(np.int64)
    index = (w >> (bitpos & 31)) & ((np.int64(1) << bits[blk]) - 1)
    _lookup(words, table_offset[blk] + index * (dtype.itemsize // 4), dtype.itemsize // 4, key, out)


def decode(data: Buffer, shape: Sequence[int], block_size: Sequence[int], dtype: np.dtype | str, *,
           key: str = "", region: Sequence[slice] | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Decode a chunk of shape (x, y, z, channels) encoded with ``block_size`` (bx, by, bz).

    Returns a C-contiguous (channels, z, y, x) array viewed as (x, y, z, channels),
    or ``out`` (any strides, the result's shape) filled with it. With ``region``
    (one slice per dimension, steps >= 1, within ``shape``) only those voxels
    are decoded and the result has the region's shape. Decoding runs in the
    compiled kernel of :mod:`.cseg_kernel` when numba is installed (work in
    proportion to the voxels decoded), else in numpy. Raises
    DataCorruptionError (naming ``key``) on any inconsistency of the data it reads.
    """
    dtype = np.dtype(dtype)
    if dtype not in _DTYPES:
        raise InvalidArgumentError(f"compressed_segmentation: data type must be uint32 or uint64, got {dtype}")
    if len(shape) != 4 or any(s < 0 for s in shape):
        raise InvalidArgumentError(f"compressed_segmentation: shape must be (x, y, z, channels), got {shape}")
    bx, by, bz = _check_block(block_size)
    x, y, z, nc = (int(s) for s in shape)
    if region is not None and len(region) != 4:
        raise InvalidArgumentError(f"compressed_segmentation: region must have 4 slices, got {region!r}")
    sl = region if region is not None else [slice(0, n, 1) for n in (x, y, z, nc)]
    ranges = [range(*r.indices(n)) for r, n in zip(sl, (x, y, z, nc))]
    want = tuple(len(r) for r in ranges)
    if out is None:
        out = np.empty(want[::-1], dtype).transpose(3, 2, 1, 0)
    elif out.shape != want or out.dtype != dtype:
        raise InvalidArgumentError(f"compressed_segmentation: out must be {dtype} {want}, got {out.dtype} {out.shape}")
    if len(data) % 4:
        raise DataCorruptionError(f"chunk {key!r}: compressed_segmentation data of {len(data)} bytes "
                                  "is not a whole number of 32-bit words")
    words = np.frombuffer(data, "<u4")
    if len(words) < nc:
        raise DataCorruptionError(f"chunk {key!r}: compressed_segmentation data too short for {nc} channels")
    fast = kernel()
    for i, c in enumerate(ranges[3]):
        start = int(words[c])
        if start > len(words):
            raise DataCorruptionError(f"chunk {key!r}: compressed_segmentation channel {c} offset "
                                      f"{start} is past the end ({len(words)} words)")
        dest = out[..., i]
        if not dest.size:
            continue
        if fast is not None:
            _decode_compiled(fast, words[start:], (x, y, z), (bx, by, bz), dtype, ranges[:3], dest, key)
        elif region is None:
            _decode_channel(words[start:], (z, y, x), (bz, by, bx), dtype, dest.transpose(2, 1, 0), key)
        elif dest.size * _GATHER_FRACTION >= x * y * z:  # most of the chunk: decode it whole
            whole = np.empty((z, y, x), dtype)
            _decode_channel(words[start:], (z, y, x), (bz, by, bx), dtype, whole, key)
            dest[...] = whole.transpose(2, 1, 0)[tuple(region[:3])]
        else:
            zyx = tuple(np.arange(r.start, r.stop, r.step, dtype=np.int64) for r in ranges[2::-1])
            _gather_channel(words[start:], (z, y, x), (bz, by, bx), dtype, zyx, dest.transpose(2, 1, 0), key)
    return out


def _decode_compiled(fast: Any, words: np.ndarray, shape: tuple[int, int, int], block: tuple[int, int, int],
                     dtype: np.dtype, ranges: list[range], dest: np.ndarray, key: str) -> None:
    """One channel through the compiled kernel; ``dest`` is (x, y, z), any strides."""
    grid = [-(-s // b) for s, b in zip(shape, block)]
    pos_step = (1, block[0], block[0] * block[1])  # x fastest in a block's bit order
    block_step = (1, grid[0], grid[0] * grid[1])  # and in the numbering of blocks
    # loop over the axis with the smallest stride of ``dest`` innermost
    order = sorted(range(3), key=lambda d: -abs(dest.strides[d]))
    if words.flags.writeable:  # the kernel takes read-only words (one compiled signature)
        words = words.view()
        words.flags.writeable = False
    code = fast(words, grid[0] * grid[1] * grid[2], block[0] * block[1] * block[2], dtype.itemsize // 4,
                tuple(ranges[d].start for d in order), tuple(ranges[d].step for d in order),
                tuple(len(ranges[d]) for d in order), tuple(block[d] for d in order),
                tuple(pos_step[d] for d in order), tuple(block_step[d] for d in order), dest.transpose(order))
    if code:
        raise _bad(key, ERRORS[code])
