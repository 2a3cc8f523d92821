"""``sharding_indexed``: many inner chunks in one stored value plus an index.

The index is an array of shape ``chunks_per_shard + [2]`` of uint64
``(offset, nbytes)`` pairs encoded with ``index_codecs`` (by default little-endian
bytes + crc32c), stored at the start or the end of the shard. An entry of
``(2^64-1, 2^64-1)`` marks a missing inner chunk (read as the fill value). Inner
chunks are written in C order of their grid positions, as TensorStore does.
Every entry is validated against the shard before use: a truncated shard or
index is a DataCorruptionError naming the key, never garbage.

Inner chunks stored raw (``bytes`` alone) are equal-sized records: whole
shards are encoded and decoded, and many inner chunks read, with a few
vectorised numpy copies (``_cells.py``) instead of one step per inner chunk.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import numpy as np

from tensorstore_py.core.errors import DataCorruptionError, InvalidSpecError
from tensorstore_py.drivers.codecs._cells import MISSING, gather_cells, place_cells
from tensorstore_py.drivers.codecs.base import ArrayBytesCodec, ChunkSpec
from tensorstore_py.drivers.codecs.chain import CodecChain
from tensorstore_py.drivers.codecs.registry import register_codec
from tensorstore_py.drivers.copies import as_contiguous, copy_into
from tensorstore_py.drivers.dtypes import is_variable_length
from tensorstore_py.drivers.grid import ChunkPart, chunk_parts
from tensorstore_py.kvstore.base import Buffer, ByteRange

#: region reads of at most this many raw inner chunks copy them one by one (no scratch box)
FEW_PARTS = 8
# An index larger than this (16 bytes per entry) is refused before any read.
MAX_INNER_CHUNKS = 1 << 22


def is_fill(a: np.ndarray, fill: np.ndarray) -> bool:
    """True when every element of ``a`` has the bit pattern of ``fill`` (0-d array)."""
    if a.size == 0:
        return True
    if is_variable_length(a.dtype):  # strings/bytes: compare values, memory holds pointers
        return bool((a == fill).all())
    size = a.dtype.itemsize
    if size in (1, 2, 4, 8):
        u = np.dtype(f"u{size}")
        fv = fill.view(u)
        # most chunks with data differ at their first element: O(1) answer
        if a[(slice(0, 1),) * a.ndim].view(u).reshape(-1)[0] != fv:
            return False
        au = a.view(u)  # any strides: no contiguous copy first
        return not au.any() if fv == 0 else not (au != fv).any()
    if size % 8 == 0:
        u8 = np.ascontiguousarray(a).reshape(-1).view(np.uint64).reshape(-1, size // 8)
        return bool((u8 == fill.reshape(1).view(np.uint64)).all())
    b = np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(-1, size)  # e.g. S5, <U3
    return bool((b == np.frombuffer(fill.tobytes(), np.uint8)).all())


def _place(dest: np.ndarray, where: tuple[slice, ...], src: np.ndarray) -> None:
    """``dest[where] = src``; in 3 or more dimensions row by row (short rows: drivers/copies.py)."""
    if dest.ndim >= 3:
        copy_into(dest[where], src)
    else:
        dest[where] = src


@register_codec
class ShardingCodec(ArrayBytesCodec):
    """Shards of ``shape`` made of inner chunks of ``chunk_shape``."""

    name = "sharding_indexed"
    fills_any_out = True

    def __init__(self, chunk_shape: tuple[int, ...], inner: CodecChain, index: CodecChain,
                 index_location: str, shard_shape: tuple[int, ...], fill: np.ndarray) -> None:
        self.chunk_shape = chunk_shape
        self.inner = inner  # the inner chunks' codecs
        self.index = index  # the index array's codecs
        self.index_location = index_location
        self.shard_shape = shard_shape
        self.cps = tuple(s // c for s, c in zip(shard_shape, chunk_shape))
        self.fill = fill
        size = index.encoded_size
        if size is None:
            raise InvalidSpecError(
                "sharding_indexed codec: 'index_codecs' must have a fixed encoded size "
                "(bytes and crc32c only)"
            )
        self.index_nbytes = int(size)
        # inner chunks are the array's native bytes: moved as records (see _cells.py)
        self.raw_inner = bool(inner.raw)
        # (cell, slices) of every inner chunk in C order, computed once
        self.cells = [
            (cell, tuple(slice(i * c, (i + 1) * c) for i, c in zip(cell, chunk_shape)))
            for cell in itertools.product(*(range(n) for n in self.cps))
        ]

    @classmethod
    def from_json(cls, config: dict[str, Any], chunk: ChunkSpec) -> ShardingCodec:
        shape, dtype, fill_value = chunk.shape, chunk.dtype, chunk.fill_value
        where = "sharding_indexed codec"
        unknown = set(config) - {"chunk_shape", "codecs", "index_codecs", "index_location"}
        if unknown:
            raise InvalidSpecError(f"{where}: unknown configuration fields {sorted(unknown)}")
        cs = config.get("chunk_shape")
        if (not isinstance(cs, list) or len(cs) != len(shape)
                or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in cs)):
            raise InvalidSpecError(
                f"{where}: 'chunk_shape' must be {len(shape)} positive integers, got {cs!r}"
            )
        if any(s % c for s, c in zip(shape, cs)):
            raise InvalidSpecError(
                f"{where}: 'chunk_shape' {cs} must divide the shard shape {list(shape)}"
            )
        n_inner = 1
        for sdim, c in zip(shape, cs):
            n_inner *= sdim // c
        if n_inner > MAX_INNER_CHUNKS:
            raise InvalidSpecError(
                f"{where}: {n_inner} inner chunks per shard (index of {16 * n_inner} bytes) exceeds "
                f"the limit of {MAX_INNER_CHUNKS}"
            )
        loc = config.get("index_location", "end")
        if loc not in ("start", "end"):
            raise InvalidSpecError(f"{where}: 'index_location' must be 'start' or 'end', got {loc!r}")
        fill = np.array(fill_value, dtype=dtype)
        inner = CodecChain.from_json(
            config.get("codecs", [{"name": "bytes", "configuration": {"endian": "little"}}]),
            tuple(cs), dtype, fill_value, where=f"{where} field 'codecs'",
        )
        cps = tuple(s // c for s, c in zip(shape, cs))
        index = CodecChain.from_json(
            config.get("index_codecs", [{"name": "bytes", "configuration": {"endian": "little"}},
                                        {"name": "crc32c"}]),
            cps + (2,), np.dtype("uint64"), 0, where=f"{where} field 'index_codecs'",
        )
        return cls(tuple(cs), inner, index, loc, tuple(shape), fill)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": list(self.chunk_shape),
                "codecs": self.inner.to_json(),
                "index_codecs": self.index.to_json(),
                "index_location": self.index_location,
            },
        }

    # -- index ------------------------------------------------------------------
    def index_range(self) -> ByteRange:
        """Where the index lives in a stored shard."""
        if self.index_location == "end":
            return ByteRange(-self.index_nbytes)
        return ByteRange(0, self.index_nbytes)

    def decode_index(self, buf: Buffer, *, key: str, shard_size: int | None = None) -> np.ndarray:
        """The validated ``(offset, nbytes)`` table (``cps + (2,)``, uint64)."""
        mv = memoryview(buf).cast("B")
        if len(mv) != self.index_nbytes:
            raise DataCorruptionError(
                f"shard {key!r}: index is {len(mv)} bytes, expected {self.index_nbytes} (truncated?)"
            )
        idx = np.asarray(self.index.decode(mv, key=f"{key} (shard index)"), dtype=np.uint64)
        off, n = idx[..., 0], idx[..., 1]
        missing = (off == MISSING) & (n == MISSING)
        bad = ~missing & ((off == MISSING) | (n == MISSING) | (off > (MISSING - n)))
        if shard_size is not None:
            lo = self.index_nbytes if self.index_location == "start" else 0
            hi = shard_size if self.index_location == "start" else shard_size - self.index_nbytes
            with np.errstate(over="ignore"):
                bad |= ~missing & ((off < lo) | (off + n > hi))
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise DataCorruptionError(
                f"shard {key!r}: index entry {list(where)} (offset {int(off[where])}, "
                f"length {int(n[where])}) lies outside the shard"
                + (f" of {shard_size} bytes" if shard_size is not None else "")
            )
        return idx

    # -- part of a shard (the engine's partial reads) ---------------------------------
    def present_parts(self, idx: np.ndarray, parts: Iterable[ChunkPart],
                      dest: np.ndarray) -> list[tuple[ChunkPart, int, int]]:
        """Fill the parts of ``dest`` whose inner chunk the decoded index ``idx``
        marks missing; return the others with their ``(offset, nbytes)``."""
        present: list[tuple[ChunkPart, int, int]] = []
        for ip in parts:
            off, n = idx[ip.cell]
            if off == MISSING:
                dest[ip.out] = self.fill
            else:
                present.append((ip, int(off), int(n)))
        return present

    def whole_index(self, buf: Buffer, *, key: str) -> np.ndarray:
        """The validated index of the whole stored shard ``buf``."""
        mv = memoryview(buf).cast("B")
        if len(mv) < self.index_nbytes:
            raise DataCorruptionError(
                f"shard {key!r}: {len(mv)} bytes, shorter than its {self.index_nbytes}-byte index"
            )
        return self.decode_index(self.index_range().apply(mv), key=key, shard_size=len(mv))

    def decode_present(self, key: str, present: list[tuple[ChunkPart, int, int]],
                       values: list[Buffer], dest: np.ndarray, shared: Any = None) -> None:
        """Decode the inner chunks ``present`` (as from :meth:`present_parts`),
        read as ``values``, into their parts of ``dest``. ``shared``: the
        ``DecodedChunks`` of the reads in flight at the generation ``values``
        were read at (an inner chunk another of them decodes is taken from there)."""
        for (ip, off, n), v in zip(present, values):
            if shared is None:
                _place(dest, ip.out, self.decode_inner(v, ip, off, n, key=key)[ip.chunk])
            else:
                arr = shared.get(off, n, lambda ip=ip, off=off, n=n, v=v: self.decode_inner(v, ip, off, n, key=key))
                _place(dest, ip.out, arr[ip.chunk])

    def read_region(self, buf: Buffer, idx: np.ndarray, region: tuple[slice, ...],
                    parts: list[ChunkPart], dest: np.ndarray, key: str, base: int = 0) -> None:
        """Fill ``dest`` with ``region`` of the stored shard whose bytes from
        ``base`` on are ``buf`` (the whole shard when 0; its index ``idx``, every
        inner chunk the region needs inside ``buf``; ``parts``: the region's
        inner chunk parts)."""
        mv = memoryview(buf).cast("B")
        if base:
            idx = idx.copy()
            offsets = idx[..., 0]
            offsets[offsets != MISSING] -= np.uint64(base)
        if self.raw_inner and len(parts) > FEW_PARTS and self._place_region(mv, idx, region, dest):
            return
        present = self.present_parts(idx, parts, dest)
        self.decode_present(key, present, [mv[o: o + n] for _, o, n in present], dest)

    def _place_region(self, mv: memoryview, idx: np.ndarray, region: tuple[slice, ...],
                      dest: np.ndarray) -> bool:
        """``read_region`` of raw inner chunks, vectorised: the box of cells the
        region touches lands in ``dest`` directly when the region is that box,
        else in a scratch box that is then sliced once."""
        cells, lo, rel = [], [], []
        for s, c in zip(region, self.chunk_shape):
            last = s.start + (len(range(s.start, s.stop, s.step)) - 1) * s.step
            a, b = s.start // c, last // c + 1
            cells.append(slice(a, b))
            lo.append(a * c)
            rel.append(slice(s.start - a * c, s.stop - a * c, s.step))
        box = tuple((sl.stop - sl.start) * c for sl, c in zip(cells, self.chunk_shape))
        aligned = all(r.step == 1 and r.start == 0 and r.stop == n for r, n in zip(rel, box))
        target = dest if aligned else np.empty(box, dtype=dest.dtype)
        if not place_cells(mv, idx[tuple(cells)], target, self.chunk_shape, self.fill):
            return False
        if target is not dest:
            dest[...] = target[tuple(rel)]
        return True

    def decode_inner(self, buf: Buffer, ip: ChunkPart, off: int, n: int, *, key: str) -> np.ndarray:
        """Decode inner chunk ``ip.cell``, read from bytes ``[off, off + n)`` of
        shard ``key``; a short read is a DataCorruptionError."""
        found = memoryview(buf).nbytes
        if found != n:
            raise DataCorruptionError(
                f"shard {key!r}: inner chunk {list(ip.cell)} at bytes [{off}, {off + n}) is "
                f"truncated ({found} bytes present)"
            )
        return self.inner.decode(buf, key=f"{key} (inner chunk {list(ip.cell)})")

    # -- whole shards -------------------------------------------------------------
    def encode(self, a: np.ndarray) -> Buffer:
        """Encode a whole shard; inner chunks equal to the fill value are omitted.

        Returns an empty buffer when every inner chunk is missing.
        """
        if self.raw_inner:
            return self._encode_raw(a)
        encoded: list[tuple[int, Buffer]] = []
        for i, (_cell, sl) in enumerate(self.cells):
            chunk = as_contiguous(a[sl])
            if not is_fill(chunk, self.fill):
                encoded.append((i, memoryview(self.inner.encode(chunk)).cast("B")))
        return self._assemble(encoded)

    def _encode_raw(self, a: np.ndarray) -> Buffer:
        """``encode`` of raw inner chunks: the cells gathered in C order straight
        into the shard's buffer (one strided copy), fill cells dropped, the
        index computed for all cells at once."""
        ncells = len(self.cells)
        nbytes = self.inner.nbytes
        start = self.index_nbytes if self.index_location == "start" else 0
        buf = np.empty(ncells * nbytes + self.index_nbytes, dtype=np.uint8)
        cells = buf[start: start + ncells * nbytes].view(a.dtype).reshape((ncells,) + self.chunk_shape)
        keep = gather_cells(a, self.chunk_shape, self.fill, cells)
        kept = int(np.count_nonzero(keep))
        if kept == 0:
            return b""
        if kept < ncells:
            cells[:kept] = cells[keep]  # fill cells are not stored: close the gaps
        idx = np.full(self.cps + (2,), MISSING, dtype=np.uint64)
        flat = idx.reshape(-1, 2)
        flat[keep, 0] = start + nbytes * np.arange(kept, dtype=np.uint64)
        flat[keep, 1] = nbytes
        end = start + kept * nbytes
        at = 0 if self.index_location == "start" else end
        buf[at: at + self.index_nbytes] = np.frombuffer(self.index.encode(idx), np.uint8)
        return buf.data[: end + (0 if start else self.index_nbytes)]

    def _assemble(self, encoded: list[tuple[int, Buffer]]) -> Buffer:
        """The shard bytes for encoded inner chunks ``(cell number, bytes)`` in
        cell order, with the index; b"" when there are none."""
        if not encoded:
            return b""
        idx = np.full(self.cps + (2,), MISSING, dtype=np.uint64)
        flat = idx.reshape(-1, 2)
        offset = self.index_nbytes if self.index_location == "start" else 0
        parts: list[Buffer] = []
        for i, enc in encoded:
            flat[i] = (offset, len(enc))
            offset += len(enc)
            parts.append(enc)
        index = memoryview(self.index.encode(idx)).cast("B")
        if self.index_location == "start":
            parts.insert(0, index)
        else:
            parts.append(index)
        return b"".join(parts)

    def update(self, old: Buffer | None, region: tuple[slice, ...], src: np.ndarray, *,
               key: str) -> Buffer:
        """The shard ``old`` (None = missing) with ``region`` set to ``src``.

        Only the inner chunks the region touches are decoded and re-encoded;
        the others keep their stored bytes. Returns b"" when nothing is left
        but fill values (the shard should then be deleted).
        """
        idx: list[list[int]] | None = None
        mv = memoryview(old).cast("B") if old is not None else None
        if mv is not None:
            idx = self.whole_index(mv, key=key).reshape(-1, 2).tolist()
        touched = {ip.cell: ip for ip in chunk_parts(region, self.chunk_shape, self.shard_shape)}
        missing = int(MISSING)
        encoded: list[tuple[int, Buffer]] = []
        for i, (cell, _sl) in enumerate(self.cells):
            ip = touched.get(cell)
            present = idx is not None and idx[i][0] != missing
            if ip is None:
                if not present:
                    continue
                off, n = idx[i]  # type: ignore[index]
                enc = mv[off: off + n]  # type: ignore[index]
            else:
                if present:
                    off, n = idx[i]  # type: ignore[index]
                    arr = np.array(self.inner.decode(
                        mv[off: off + n], key=f"{key} (inner chunk {list(cell)})"), copy=True)  # type: ignore[index]
                else:
                    arr = np.full(self.chunk_shape, self.fill, dtype=self.fill.dtype)
                arr[ip.chunk] = src[ip.out]
                if is_fill(arr, self.fill):
                    continue
                enc = memoryview(self.inner.encode(arr)).cast("B")
            encoded.append((i, enc))
        return self._assemble(encoded)

    def decode(self, buf: Buffer, shape: tuple[int, ...], dtype: np.dtype, *, key: str,
               out: np.ndarray | None = None) -> np.ndarray:
        mv = memoryview(buf).cast("B")
        idx = self.whole_index(mv, key=key)
        res = out if out is not None else np.empty(shape, dtype=dtype)
        if self.raw_inner and place_cells(mv, idx, res, self.chunk_shape, self.fill):
            return res
        self.decode_cells(mv, idx, 0, len(self.cells), res, key=key)
        return res

    def decode_cells(self, buf: Buffer, idx: np.ndarray, first: int, stop: int, out: np.ndarray,
                     *, key: str) -> None:
        """Decode inner chunks ``first`` to ``stop`` (positions in C order of the
        shard's grid) of the whole stored shard ``buf`` (its validated index
        ``idx``) into their cells of ``out`` (shard-shaped); missing ones get the
        fill value. Disjoint position ranges touch disjoint cells of ``out``, so
        they may be decoded on several threads at once."""
        mv = memoryview(buf).cast("B")
        missing = int(MISSING)
        entries = idx.reshape(-1, 2)[first:stop].tolist()
        for (cell, sl), (off, n) in zip(self.cells[first:stop], entries):
            if off == missing:
                out[sl] = self.fill
                continue
            _place(out, sl, self.inner.decode(mv[off: off + n], key=f"{key} (inner chunk {list(cell)})"))

    def inner_cells(self, region: tuple[slice, ...]) -> list[tuple[int, ...]]:
        """Inner chunk positions that intersect ``region`` (step-1 bounds)."""
        ranges = [
            range(s.start // c, -(-s.stop // c)) if s.stop > s.start else range(0)
            for s, c in zip(region, self.chunk_shape)
        ]
        return list(itertools.product(*ranges))
