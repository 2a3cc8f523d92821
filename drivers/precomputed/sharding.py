"""``neuroglancer_uint64_sharded_v1``: many chunks in a few shard files.

A chunk is named by a uint64 *chunk id* (for volumes: the compressed Morton
code of its grid cell, :func:`compressed_morton_code`). The id, shifted right
by ``preshift_bits`` and hashed (``identity`` or ``murmurhash3_x86_128``),
picks a shard (``<hex>.shard``) and a minishard inside it. A shard file is::

    shard index      2**minishard_bits entries of (start, end) uint64le, the byte
                     range of each minishard's index, relative to the index's end
    ... data ...     chunk data (``data_encoding``: raw or gzip) and minishard
                     indexes, in any order
    minishard index  ``minishard_index_encoding`` (raw or gzip) of a [3, n]
                     uint64le array: delta-coded chunk ids, delta-coded offsets
                     (each relative to the end of the previous chunk), sizes

Reading one chunk takes three ranged reads (index entry -> minishard index ->
chunk); :func:`chunk_reader` states them without doing I/O so a sync or an
async driver can serve them. :func:`build_shard` writes a whole shard the way
TensorStore does (minishards in order, each one's chunks by id, then its
index; gzip at level 9), :func:`split_shard` takes one apart.

Malformed shards (ranges that overflow or point past the data, index lengths
that are not a multiple of 24, gzip bombs, duplicate ids) raise
:class:`DataCorruptionError` naming the shard key, before anything is
allocated from the declared sizes.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from tensorstore_py.core.errors import DataCorruptionError, InvalidArgumentError, UnsupportedError
from tensorstore_py.core.ranges import Buffer, ByteRange
from tensorstore_py.drivers.codecs.gzip_codec import inflate
from tensorstore_py.drivers.precomputed._json import member, parse_enum, parse_int, spec_error

mmh3: ModuleType | None
try:  # optional (extra "precomputed"): only the murmurhash3_x86_128 hash needs it
    import mmh3
except ImportError:  # pragma: no cover - exercised only where the extra is missing
    mmh3 = None

__all__ = [
    "SHARDING_TYPE",
    "ChunkReader",
    "MinishardIndex",
    "ShardingSpec",
    "build_shard",
    "chunk_reader",
    "compressed_morton_code",
    "compressed_morton_codes",
    "decode_chunk_data",
    "decode_minishard_index",
    "decode_shard_index",
    "decode_shard_index_entry",
    "encode_chunk_data",
    "encode_minishard_index",
    "encode_shard_index",
    "morton_bits",
    "morton_cell",
    "read_chunk",
    "shard_cells",
    "shard_shape",
    "sharding_for",
    "split_shard",
]

SHARDING_TYPE = "neuroglancer_uint64_sharded_v1"
HASHES = ("identity", "murmurhash3_x86_128")
DATA_ENCODINGS = ("raw", "gzip")
#: decoded minishard indexes larger than this are refused (2.8 million chunks)
MAX_MINISHARD_INDEX_BYTES = 64 << 20
#: default cap on one chunk's data after ``data_encoding``; drivers pass the exact bound
MAX_CHUNK_BYTES = 1 << 30
#: building a shard allocates its whole index; refuse more than 2**26 minishards
MAX_BUILD_MINISHARD_BITS = 26
GZIP_LEVEL = 9  # what TensorStore writes
_U64 = (1 << 64) - 1
_LE64 = np.dtype("<u8")


def _low_mask(bits: int) -> int:
    return (1 << bits) - 1


def _parse_sharding(j: Any, where: str) -> dict[str, Any]:
    if not isinstance(j, Mapping):
        raise spec_error(where, f"expected an object, got {j!r}")
    if j.get("@type") != SHARDING_TYPE:
        raise spec_error(f"{where}.@type", f"expected {SHARDING_TYPE!r}, got {j.get('@type')!r}")
    fields = {"@type", "preshift_bits", "hash", "minishard_bits", "shard_bits",
              "minishard_index_encoding", "data_encoding"}
    extra = sorted(set(j) - fields)
    if extra:
        raise spec_error(where, f"unknown members {extra}")
    minishard_bits = parse_int(member(j, "minishard_bits", where), f"{where}.minishard_bits", 0, 32)
    return {
        "preshift_bits": parse_int(member(j, "preshift_bits", where), f"{where}.preshift_bits", 0, 64),
        "hash": parse_enum(member(j, "hash", where), f"{where}.hash", HASHES),
        "minishard_bits": minishard_bits,
        "shard_bits": parse_int(member(j, "shard_bits", where), f"{where}.shard_bits", 0, 64 - minishard_bits),
        **{name: parse_enum(j.get(name, "raw"), f"{where}.{name}", DATA_ENCODINGS)
           for name in ("minishard_index_encoding", "data_encoding")},
    }


@dataclass(frozen=True)
class ShardingSpec:
    """The ``sharding`` member of a scale: how chunk ids map to shard files.

    ``minishard_bits`` is at most 32 and ``shard_bits`` at most
    ``64 - minishard_bits`` (TensorStore's limits).
    """

    preshift_bits: int
    hash: str
    minishard_bits: int
    shard_bits: int
    minishard_index_encoding: str = "raw"
    data_encoding: str = "raw"

    def __post_init__(self) -> None:
        _parse_sharding(self.to_json(), "sharding")  # the constructor validates too

    @classmethod
    def from_json(cls, j: Any, *, where: str = "sharding") -> ShardingSpec:
        """Parse and validate; InvalidSpecError names the offending member."""
        return cls(**_parse_sharding(j, where))

    def to_json(self) -> dict[str, Any]:
        return {
            "@type": SHARDING_TYPE,
            "preshift_bits": self.preshift_bits,
            "hash": self.hash,
            "minishard_bits": self.minishard_bits,
            "shard_bits": self.shard_bits,
            "minishard_index_encoding": self.minishard_index_encoding,
            "data_encoding": self.data_encoding,
        }

    @property
    def num_shards(self) -> int:
        return 1 << self.shard_bits

    @property
    def num_minishards(self) -> int:
        return 1 << self.minishard_bits

    @property
    def shard_index_size(self) -> int:
        """Bytes of the shard index at the start of every shard file."""
        return 16 << self.minishard_bits

    def hash_chunk_id(self, chunk_id: int) -> int:
        """``hash(chunk_id >> preshift_bits)`` as a uint64."""
        _check_chunk_id(chunk_id)
        x = int(chunk_id) >> self.preshift_bits
        if self.hash == "identity":
            return x
        if mmh3 is None:
            raise ImportError(
                "the murmurhash3_x86_128 sharding hash needs the 'mmh3' package: "
                "pip install 'tensorstore_py[precomputed]'"
            )
        # the low 8 bytes of the 128-bit hash of the little-endian id, seed 0
        return mmh3.hash128(x.to_bytes(8, "little"), seed=0, x64arch=False, signed=False) & _U64

    def shard_and_minishard(self, chunk_id: int) -> tuple[int, int]:
        """The shard number and the minishard number (within it) of a chunk id."""
        h = self.hash_chunk_id(chunk_id)
        return (h >> self.minishard_bits) & _low_mask(self.shard_bits), h & _low_mask(self.minishard_bits)

    def shard_key(self, shard: int) -> str:
        """``<shard>.shard``: lowercase hex, zero-padded to ceil(shard_bits / 4) digits."""
        if not 0 <= shard < self.num_shards:
            raise InvalidArgumentError(f"shard {shard} is outside [0, {self.num_shards})")
        return f"{shard:0{-(-self.shard_bits // 4)}x}.shard"

    def shard_index_range(self, minishard: int) -> ByteRange:
        """Where minishard ``minishard``'s 16-byte entry lies in the shard file."""
        if not 0 <= minishard < self.num_minishards:
            raise InvalidArgumentError(f"minishard {minishard} is outside [0, {self.num_minishards})")
        return ByteRange(16 * minishard, 16 * minishard + 16)


def _check_chunk_id(chunk_id: int) -> None:
    if not isinstance(chunk_id, (int, np.integer)) or not 0 <= chunk_id <= _U64:
        raise InvalidArgumentError(f"chunk id must be an integer in [0, 2**64), got {chunk_id!r}")


# -- compressed Morton codes ----------------------------------------------------------------

def morton_bits(grid_shape: Sequence[int]) -> tuple[int, ...]:
    """Bits each dimension contributes to a compressed Morton code: enough for
    ``grid_shape[d] - 1``."""
    return tuple(max(int(g) - 1, 0).bit_length() for g in grid_shape)


def _bit_owners(bits: Sequence[int]) -> list[int]:
    """The dimension each bit of a compressed Morton code comes from, least significant first."""
    return [d for i in range(max(bits, default=0)) for d, n in enumerate(bits) if i < n]


def _interleave(coords: Sequence[Any], bits: Sequence[int], code: Any) -> Any:
    """OR the interleaved bits of ``coords`` into ``code``: Python ints or uint64 arrays alike."""
    level = [0] * len(bits)
    for j, d in enumerate(_bit_owners(bits)):
        code |= ((coords[d] >> level[d]) & 1) << j
        level[d] += 1
    return code


def _check_grid(grid_shape: Sequence[int]) -> tuple[int, ...]:
    bits = morton_bits(grid_shape)
    if sum(bits) > 64:
        raise InvalidArgumentError(f"a grid of {list(grid_shape)} cells needs {sum(bits)} > 64 bits of chunk id")
    return bits


def compressed_morton_code(cell: Sequence[int], grid_shape: Sequence[int]) -> int:
    """The chunk id of grid cell ``cell`` (x, y, z) in a grid of ``grid_shape`` cells.

    Bits are interleaved from the least significant up, x before y before z, and
    a dimension stops contributing once its bits are used up.
    """
    if len(cell) != len(grid_shape) or any(not 0 <= c < g for c, g in zip(cell, grid_shape)):
        raise InvalidArgumentError(f"grid cell {list(cell)} is outside the grid {list(grid_shape)}")
    return _interleave([int(c) for c in cell], _check_grid(grid_shape), 0)


def compressed_morton_codes(cells: np.ndarray, grid_shape: Sequence[int]) -> np.ndarray:
    """:func:`compressed_morton_code` of each row of an ``(n, 3)`` integer array, as uint64."""
    cells = np.asarray(cells)
    if cells.ndim != 2 or cells.shape[1] != len(grid_shape):
        raise InvalidArgumentError(f"cells must be an (n, {len(grid_shape)}) array, got shape {cells.shape}")
    if cells.size and ((cells < 0).any() or (cells >= np.asarray(grid_shape)).any()):
        raise InvalidArgumentError(f"grid cells outside the grid {list(grid_shape)}")
    c = cells.astype(np.uint64)
    return _interleave([c[:, d] for d in range(c.shape[1])], _check_grid(grid_shape), np.zeros(len(c), np.uint64))


def shard_shape(spec: ShardingSpec, grid_shape: Sequence[int]) -> tuple[int, ...] | None:
    """Chunks per shard along each dimension when every shard is one aligned box of the grid,
    else None.

    That holds for the ``identity`` hash when the chunk id bits above
    ``preshift_bits + minishard_bits`` (which name the shard) are all kept by
    ``shard_bits``: the low bits then hold the low bits of each coordinate.
    """
    bits = morton_bits(grid_shape)
    low = spec.preshift_bits + spec.minishard_bits
    if spec.hash != "identity" or sum(bits) > low + spec.shard_bits:
        return None
    owners = _bit_owners(bits)[:low]
    return tuple(1 << owners.count(d) for d in range(len(bits)))


def morton_cell(chunk_id: int, grid_shape: Sequence[int]) -> tuple[int, ...]:
    """The grid cell whose compressed Morton code is ``chunk_id`` (the inverse of
    :func:`compressed_morton_code`; bits past the grid's are ignored)."""
    bits = _check_grid(grid_shape)
    cell, level = [0] * len(bits), [0] * len(bits)
    for j, d in enumerate(_bit_owners(bits)):
        cell[d] |= ((int(chunk_id) >> j) & 1) << level[d]
        level[d] += 1
    return tuple(cell)


def shard_cells(spec: ShardingSpec, grid_shape: Sequence[int], shard: int) -> int | None:
    """How many grid cells shard number ``shard`` holds when shards are boxes of the grid
    (:func:`shard_shape`; boxes are clipped at the grid's end), else None."""
    box = shard_shape(spec, grid_shape)
    if box is None:
        return None
    first = morton_cell(shard << (spec.preshift_bits + spec.minishard_bits), grid_shape)
    return math.prod(max(0, min(b, g - f)) for b, g, f in zip(box, grid_shape, first))


def sharding_for(grid_shape: Sequence[int], chunks_per_shard: Sequence[int], *,
                 minishard_bits: int = 3, minishard_index_encoding: str = "gzip",
                 data_encoding: str = "raw") -> ShardingSpec:
    """A sharding spec (identity hash) whose shards are aligned boxes of ``chunks_per_shard``
    chunks (powers of two; clipped to the grid).

    Compressed Morton codes interleave one bit of each dimension per level, so
    a shard box must take the same number of bits from every dimension that
    still has bits: (8, 8, 8) chunks fit any grid, (8, 8, 1) does not unless the
    grid has a single chunk along z. ``minishard_bits`` (at most the shard's own
    bits) splits each shard's index into minishards, so a lookup reads a smaller index.
    """
    bits = morton_bits(grid_shape)
    if len(chunks_per_shard) != len(bits) or any(
            not isinstance(c, (int, np.integer)) or c < 1 or c & (c - 1) for c in chunks_per_shard):
        raise InvalidArgumentError(f"chunks per shard must be {len(bits)} powers of two, "
                                   f"got {list(chunks_per_shard)}")
    want = [min(int(c).bit_length() - 1, n) for c, n in zip(chunks_per_shard, bits)]
    low = sum(want)
    owners = _bit_owners(bits)[:low]
    if [owners.count(d) for d in range(len(bits))] != want:
        raise InvalidArgumentError(
            f"a shard of {list(chunks_per_shard)} chunks is not a box of the compressed Morton order "
            f"of a {list(grid_shape)} chunk grid: use the same power of two along every dimension")
    mb = min(minishard_bits, low)
    return ShardingSpec(preshift_bits=low - mb, hash="identity", minishard_bits=mb,
                        shard_bits=sum(bits) - low, minishard_index_encoding=minishard_index_encoding,
                        data_encoding=data_encoding)


# -- data and index encodings ----------------------------------------------------------------

def encode_chunk_data(data: Buffer, spec: ShardingSpec) -> bytes:
    """Apply the spec's ``data_encoding`` to one chunk's encoded bytes."""
    return _encode(data, spec.data_encoding)


def decode_chunk_data(data: Buffer, spec: ShardingSpec, *, key: str, limit: int) -> Buffer:
    """Undo ``data_encoding``; gzip output beyond ``limit`` bytes is refused."""
    if spec.data_encoding == "raw":
        return data
    return inflate(data, wbits=31, codec="gzip", key=key, size=None, limit=limit)


def _encode(data: Buffer, encoding: str) -> bytes:
    if encoding == "gzip":
        return zlib.compress(data, GZIP_LEVEL, wbits=31)
    return bytes(data)


def encode_shard_index(ranges: Sequence[ByteRange | None], spec: ShardingSpec) -> bytes:
    """The shard index from absolute minishard-index ranges (None = empty minishard)."""
    if len(ranges) != spec.num_minishards:
        raise InvalidArgumentError(f"a shard index has {spec.num_minishards} entries, got {len(ranges)}")
    out = np.zeros((len(ranges), 2), _LE64)
    base = spec.shard_index_size
    for i, r in enumerate(ranges):
        if r is not None:
            if r.start < base or r.stop is None:
                raise InvalidArgumentError(f"minishard {i}: {r} does not lie after the shard index")
            out[i] = (r.start - base, r.stop - base)
    return out.tobytes()


def decode_shard_index_entry(entry: Buffer, spec: ShardingSpec, *, key: str) -> ByteRange | None:
    """The absolute byte range of one minishard index, or None when it is empty."""
    if len(entry) != 16:
        raise DataCorruptionError(f"shard {key!r}: shard index entry is {len(entry)} bytes, expected 16")
    start, stop = (int(x) for x in np.frombuffer(entry, _LE64))
    return _absolute(start, stop, spec, key, "shard index entry")


def decode_shard_index(index: Buffer, spec: ShardingSpec, *, key: str) -> list[ByteRange | None]:
    """Every entry of a shard index (the first ``spec.shard_index_size`` bytes)."""
    if len(index) != spec.shard_index_size:
        raise DataCorruptionError(
            f"shard {key!r}: shard index is {len(index)} bytes, expected {spec.shard_index_size}"
        )
    pairs = np.frombuffer(index, _LE64).reshape(-1, 2)
    return [_absolute(int(a), int(b), spec, key, f"shard index entry {i}") for i, (a, b) in enumerate(pairs)]


def _absolute(start: int, stop: int, spec: ShardingSpec, key: str, what: str) -> ByteRange | None:
    base = spec.shard_index_size
    if stop < start or stop + base > _U64:
        raise DataCorruptionError(f"shard {key!r}: {what} has invalid byte range [{start}, {stop})")
    return None if start == stop else ByteRange(start + base, stop + base)


@dataclass(frozen=True)
class MinishardIndex:
    """A decoded minishard index: chunk ids (sorted) and absolute byte ranges in the shard."""

    chunk_ids: np.ndarray  # uint64, ascending
    starts: np.ndarray  # uint64
    stops: np.ndarray  # uint64

    def __len__(self) -> int:
        return len(self.chunk_ids)

    def find(self, chunk_id: int) -> ByteRange | None:
        """The byte range of ``chunk_id``'s data, or None when it is not in this minishard."""
        i = int(np.searchsorted(self.chunk_ids, np.uint64(chunk_id)))
        if i == len(self.chunk_ids) or int(self.chunk_ids[i]) != chunk_id:
            return None
        return ByteRange(int(self.starts[i]), int(self.stops[i]))

    def items(self) -> Iterator[tuple[int, ByteRange]]:
        for c, a, b in zip(self.chunk_ids.tolist(), self.starts.tolist(), self.stops.tolist()):
            yield c, ByteRange(a, b)


def encode_minishard_index(entries: Sequence[tuple[int, ByteRange]], spec: ShardingSpec) -> bytes:
    """Encode ``(chunk_id, absolute byte range)`` pairs, in the given order (ascending
    ids and offsets are what readers expect), with ``minishard_index_encoding``."""
    n = len(entries)
    arr = np.zeros((3, n), _LE64)
    prev_id, prev_end = 0, spec.shard_index_size
    for i, (cid, r) in enumerate(entries):
        _check_chunk_id(cid)
        if r.stop is None or r.start < prev_end or cid < prev_id:
            raise InvalidArgumentError(
                f"minishard index entry {i} (chunk {cid}, {r}): ids and ranges must ascend and not overlap"
            )
        arr[:, i] = (cid - prev_id, r.start - prev_end, r.stop - r.start)
        prev_id, prev_end = cid, r.stop
    return _encode(arr.tobytes(), spec.minishard_index_encoding)


def decode_minishard_index(data: Buffer, spec: ShardingSpec, *, key: str,
                           limit: int = MAX_MINISHARD_INDEX_BYTES) -> MinishardIndex:
    """Decode one minishard index; byte ranges come back absolute within the shard."""
    if spec.minishard_index_encoding == "gzip":
        data = inflate(data, wbits=31, codec="gzip", key=key, size=None, limit=limit)
    elif len(data) > limit:
        raise DataCorruptionError(f"shard {key!r}: minishard index of {len(data)} bytes exceeds {limit}")
    if len(data) % 24:
        raise DataCorruptionError(f"shard {key!r}: minishard index length {len(data)} is not a multiple of 24")
    arr = np.frombuffer(data, _LE64).reshape(3, -1)
    # Sums wrap modulo 2**64 as in TensorStore, so ids and chunks written out of
    # order decode; what must hold is start <= stop for every chunk and that the
    # absolute offsets (after the shard index) fit in 64 bits.
    ids = np.cumsum(arr[0], dtype=np.uint64)
    bounds = np.cumsum(arr[1:].T.reshape(-1), dtype=np.uint64)  # start0, stop0, start1, ...
    starts, stops = bounds[0::2], bounds[1::2]
    if len(ids) and ((stops < starts).any() or int(stops.max()) > _U64 - spec.shard_index_size):
        raise DataCorruptionError(f"shard {key!r}: minishard index has invalid byte ranges")
    base = np.uint64(spec.shard_index_size)
    starts, stops = starts + base, stops + base
    order = np.argsort(ids, kind="stable")  # writers normally emit ascending ids already
    return MinishardIndex(ids[order], starts[order], stops[order])


# -- reading one chunk ----------------------------------------------------------------------

#: yields (shard key, byte range) requests, is sent the bytes read (None: no such
#: shard), returns the chunk's decoded data or None when the chunk is absent
ChunkReader = Generator[tuple[str, ByteRange], Buffer | None, Buffer | None]


def chunk_reader(spec: ShardingSpec, chunk_id: int, *, prefix: str = "",
                 limit: int = MAX_CHUNK_BYTES) -> ChunkReader:
    """The reads that find one chunk, without doing them (sans-I/O).

    Drive it with ``req = next(gen)``, then ``req = gen.send(data)`` for each
    request until ``StopIteration.value`` holds the chunk bytes (after
    ``data_encoding`` is undone, at most ``limit`` bytes) or None. Each request is
    a byte range of the shard file ``prefix/<shard>.shard``; send None when that
    key does not exist. At most three requests: the 16-byte shard index entry,
    the minishard index, the chunk.
    """
    shard, minishard = spec.shard_and_minishard(chunk_id)
    key = f"{prefix.rstrip('/')}/{spec.shard_key(shard)}" if prefix else spec.shard_key(shard)
    req = spec.shard_index_range(minishard)
    entry = yield key, req
    if entry is None:
        return None
    index_range = decode_shard_index_entry(_exact(entry, req, key, "shard index entry"), spec, key=key)
    if index_range is None:
        return None
    raw_index = yield key, index_range
    index = decode_minishard_index(_exact(raw_index, index_range, key, "minishard index"), spec, key=key)
    chunk_range = index.find(chunk_id)
    if chunk_range is None:
        return None
    data = yield key, chunk_range
    return decode_chunk_data(_exact(data, chunk_range, key, f"chunk {chunk_id}"), spec, key=key, limit=limit)


def _exact(data: Buffer | None, r: ByteRange, key: str, what: str) -> Buffer:
    want = (r.stop or 0) - r.start
    if data is None or len(data) != want:
        got = "nothing" if data is None else f"{len(data)} bytes"
        raise DataCorruptionError(f"shard {key!r}: {what} at {r} should be {want} bytes, read {got}")
    return data


def read_chunk(spec: ShardingSpec, chunk_id: int, read: Callable[[str, ByteRange], Buffer | None], *,
               prefix: str = "", limit: int = MAX_CHUNK_BYTES) -> Buffer | None:
    """Run :func:`chunk_reader` with a blocking ``read(key, byte_range)`` (None = missing key)."""
    gen = chunk_reader(spec, chunk_id, prefix=prefix, limit=limit)
    try:
        req = next(gen)
        while True:
            req = gen.send(read(*req))
    except StopIteration as stop:
        return stop.value


# -- whole shards ---------------------------------------------------------------------------

def build_shard(spec: ShardingSpec, chunks: Mapping[int, Buffer]) -> bytes | None:
    """A complete shard file holding ``chunks`` ({chunk id: encoded chunk bytes}).

    ``data_encoding`` is applied here. All ids must belong to one shard. Returns
    None for no chunks (a shard with nothing in it is not written). The layout
    is TensorStore's: for each minishard in order, its chunks by ascending id,
    then its minishard index.
    """
    if spec.minishard_bits > MAX_BUILD_MINISHARD_BITS:
        raise UnsupportedError(
            f"building a shard with minishard_bits={spec.minishard_bits} would allocate a "
            f"{spec.shard_index_size}-byte index; at most {MAX_BUILD_MINISHARD_BITS} bits are supported"
        )
    if not chunks:
        return None
    placed: dict[int, list[int]] = {}
    shards = set()
    for cid in chunks:
        shard, minishard = spec.shard_and_minishard(cid)
        shards.add(shard)
        placed.setdefault(minishard, []).append(int(cid))
    if len(shards) > 1:
        raise InvalidArgumentError(f"build_shard: chunk ids fall into shards {sorted(shards)}, not one")
    base = spec.shard_index_size
    parts: list[bytes] = []
    ranges: list[ByteRange | None] = [None] * spec.num_minishards
    offset = base
    for minishard in sorted(placed):
        entries = []
        for cid in sorted(placed[minishard]):
            data = encode_chunk_data(chunks[cid], spec)
            parts.append(data)
            entries.append((cid, ByteRange(offset, offset + len(data))))
            offset += len(data)
        index = encode_minishard_index(entries, spec)
        parts.append(index)
        ranges[minishard] = ByteRange(offset, offset + len(index))
        offset += len(index)
    return encode_shard_index(ranges, spec) + b"".join(parts)


def split_shard(spec: ShardingSpec, shard: Buffer, *, key: str,
                limit: int = MAX_CHUNK_BYTES) -> dict[int, Buffer]:
    """Every chunk of a whole shard file: {chunk id: data with ``data_encoding`` undone}."""
    size = len(shard)
    if size < spec.shard_index_size:
        raise DataCorruptionError(
            f"shard {key!r}: {size} bytes, shorter than its {spec.shard_index_size}-byte shard index"
        )
    mv = memoryview(shard)
    out: dict[int, Buffer] = {}
    for minishard, r in enumerate(decode_shard_index(mv[:spec.shard_index_size], spec, key=key)):
        if r is None:
            continue
        assert r.stop is not None  # _absolute bounds every range it returns
        if r.stop > size:
            raise DataCorruptionError(f"shard {key!r}: minishard {minishard} index at {r} is past the end ({size})")
        index = decode_minishard_index(mv[r.start:r.stop], spec, key=key)
        if len(index) and int(index.stops.max()) > size:
            raise DataCorruptionError(f"shard {key!r}: minishard {minishard} points past the end ({size})")
        for cid, cr in index.items():
            if cid in out:
                raise DataCorruptionError(f"shard {key!r}: chunk {cid} occurs more than once")
            out[cid] = decode_chunk_data(mv[cr.start:cr.stop], spec, key=key, limit=limit)
    return out
