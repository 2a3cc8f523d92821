"""Per-leaf layout: chunk grids aligned to shardings, zarr v3 metadata, region math.

Every array leaf is cut into a regular chunk grid whose chunk shape divides the
save-time *shard* shape (the block one device holds), so each chunk lies inside
exactly one shard and no two processes ever write the same chunk. Large shards
are further split along their leading axes into chunks of at most
``target_chunk_bytes`` so writes and reads run in parallel and in bounded memory.

A leaf is a zarr v3 array (``bytes`` codec, little endian, default chunk key
encoding ``c/i/j``): its chunks are the raw C-order bytes of the block, so a
region of a chunk is a computable byte span and restores read only that span.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorstore_py.core.buffers import aligned_empty
from tensorstore_py.core.errors import DataCorruptionError
from tensorstore_py.core.pools import available_cpus, cpu_pool
from tensorstore_py.drivers.dtypes import dtype_from_v3, dtype_to_v3, fill_to_json

__all__ = [
    "LeafLayout",
    "Region",
    "chunk_key",
    "chunk_shape_for",
    "chunks_overlapping",
    "zarr3_metadata",
]

Region = tuple[tuple[int, int], ...]  # per dimension [start, stop)

DEFAULT_TARGET_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class LeafLayout:
    """How one array leaf is stored: dtype, global shape, chunk grid, and the
    key prefix of its zarr v3 array (relative to the step)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    key: str
    #: zarr v3 bytes->bytes codecs after ``bytes`` (compression.py); empty: raw chunks
    codecs: tuple[dict[str, Any], ...] = field(default=(), compare=False, hash=False)
    #: a leaf packed with others (packing.py): ``(pack key, offset, crc32c)``; its
    #: one chunk is the leaf's bytes at that offset of that value of the step
    packed: tuple[str, int, int | None] | None = field(default=None, compare=False, hash=False)

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": dtype_to_v3(self.dtype),
            "shape": list(self.shape),
            "chunk_shape": list(self.chunk_shape),
            "key": self.key,
            **({"codecs": list(self.codecs)} if self.codecs else {}),
            **({"packed": _packed_json(self.packed)} if self.packed else {}),
        }

    @staticmethod
    def from_json(j: dict[str, Any]) -> LeafLayout:
        shape = tuple(map(int, j["shape"]))
        cshape = tuple(map(int, j["chunk_shape"]))
        packed = j.get("packed")
        return LeafLayout(
            dtype=_dtype(j["dtype"]),
            shape=shape,
            chunk_shape=cshape,
            key=str(j["key"]),
            codecs=tuple(j.get("codecs") or ()),
            packed=None if packed is None else _packed_from_json(j, packed, shape, cshape),
        )


def _packed_json(packed: tuple[str, int, int | None]) -> dict[str, Any]:
    key, offset, crc = packed
    return {"key": key, "offset": offset, **({"crc32c": crc} if crc is not None else {})}


def _packed_from_json(
    j: dict[str, Any], packed: Any, shape: tuple[int, ...], cshape: tuple[int, ...]
) -> tuple[str, int, int | None]:
    try:
        key, offset, crc = str(packed["key"]), int(packed["offset"]), packed.get("crc32c")
        ok = offset >= 0 and cshape == shape and not j.get("codecs") and (crc is None or isinstance(crc, int))
    except (KeyError, TypeError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise DataCorruptionError(
            f"checkpoint leaf {j.get('path')!r}: malformed 'packed' entry {packed!r} (expected "
            "{'key': 'p/<n>', 'offset': int >= 0, 'crc32c': int} on a leaf stored as one raw chunk)"
        )
    return key, offset, crc


_DTYPES: dict[str, np.dtype] = {}


def _dtype(name: Any) -> np.dtype:
    """``dtype_from_v3``, memoised for the names (thousands of leaves share a few)."""
    if not isinstance(name, str):
        return dtype_from_v3(name)
    dt = _DTYPES.get(name)
    if dt is None:
        dt = _DTYPES[name] = dtype_from_v3(name)
    return dt


def chunk_shape_for(
    shard_shape: tuple[int, ...], itemsize: int, *, target_bytes: int = DEFAULT_TARGET_CHUNK_BYTES
) -> tuple[int, ...]:
    """The largest chunk shape that divides ``shard_shape`` and holds at most
    ``target_bytes`` (splitting leading axes first, so chunks stay contiguous).

    Always aligned: every chunk lies inside one shard.
    """
    shape = [max(1, n) for n in shard_shape]
    if math.prod(shape) * itemsize <= target_bytes:  # one chunk (every small leaf)
        return tuple(shape)
    for d in range(len(shape)):
        inner = math.prod(shape[d + 1:]) * itemsize
        if shape[d] * inner <= target_bytes:
            break
        if inner <= target_bytes:
            # the largest divisor of this axis that fits: stays aligned and contiguous
            n = shape[d]
            shape[d] = max(k for k in _divisors(n) if k * inner <= target_bytes)
            break
        shape[d] = 1
    return tuple(shape)


def _divisors(n: int) -> list[int]:
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in small]


def chunk_key(leaf_dir: str, idx: tuple[int, ...]) -> str:
    """The zarr v3 default-encoding key of chunk ``idx`` (``c/0/1``; ``c`` for 0-d)."""
    return f"{leaf_dir}/c" + "".join(f"/{i}" for i in idx)


def zarr3_metadata(
    dtype: np.dtype, shape: tuple[int, ...], chunk_shape: tuple[int, ...],
    codecs: list[dict[str, Any]] | tuple[dict[str, Any], ...] = (),
) -> dict[str, Any]:
    """A zarr v3 ``zarr.json`` for a little-endian array with this chunk grid,
    its chunks raw or compressed by ``codecs`` (bytes->bytes, after ``bytes``)."""
    codec: dict[str, Any] = {"name": "bytes"}
    if dtype.itemsize > 1:
        codec["configuration"] = {"endian": "little"}
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dtype_to_v3(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill_to_json(0, dtype),
        "codecs": [codec, *codecs],
        "attributes": {},
    }


def chunks_overlapping(
    region: Region, chunk_shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], Region]]:
    """Chunk grid indices overlapping ``region``, each with the overlap (global coords)."""
    ranges = []
    for (lo, hi), c in zip(region, chunk_shape):
        if hi <= lo:
            return []
        ranges.append(range(lo // c, (hi - 1) // c + 1))
    out: list[tuple[tuple[int, ...], Region]] = []
    for idx in _product(ranges):
        ov = tuple(
            (max(lo, i * c), min(hi, (i + 1) * c))
            for (lo, hi), i, c in zip(region, idx, chunk_shape)
        )
        out.append((idx, ov))
    return out


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [t + (i,) for t in out for i in r]
    return out


def region_of_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    """A JAX shard index (tuple of slices, step 1) as a region."""
    out = []
    for sl, n in zip(index, shape):
        start, stop, _ = sl.indices(n)
        out.append((start, stop))
    for n in shape[len(index):]:
        out.append((0, n))
    return tuple(out)


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in region)


def span_in_chunk(
    sub: Region, chunk_origin: tuple[int, ...], chunk_shape: tuple[int, ...], itemsize: int
) -> tuple[int, int]:
    """The smallest byte span ``[a, b)`` of a C-order chunk that holds ``sub``."""
    strides = c_strides(chunk_shape)
    first = sum((lo - o) * s for (lo, _), o, s in zip(sub, chunk_origin, strides))
    last = sum((hi - 1 - o) * s for (_, hi), o, s in zip(sub, chunk_origin, strides))
    return first * itemsize, (last + 1) * itemsize


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    acc = 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


_PARALLEL_COPY_MIN = 64 << 20


def host_copy(src: np.ndarray) -> np.ndarray:
    """A C-order, page-aligned copy of ``src``; large arrays are copied by several
    threads at once (numpy releases the GIL while copying)."""
    src = np.asarray(src)
    out = aligned_empty(src.shape, src.dtype)
    if src.nbytes < _PARALLEL_COPY_MIN or src.ndim == 0 or src.shape[0] < 2:
        np.copyto(out, src)
        return out
    parts = max(2, min(8, available_cpus()))
    bounds = np.linspace(0, src.shape[0], parts + 1).astype(int).tolist()
    futures = [
        cpu_pool().submit(np.copyto, out[a:b], src[a:b])
        for a, b in itertools.pairwise(bounds) if b > a
    ]
    for f in futures:
        f.result()
    return out
