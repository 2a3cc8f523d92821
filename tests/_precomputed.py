"""Test glue for the neuroglancer precomputed format layer: TensorStore as the
oracle, and a minimal reader/writer of whole volumes built only from the
format functions (no driver), working on plain files under a folder."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from tensorstore_py.core.ranges import ByteRange
from tensorstore_py.drivers.precomputed import ChunkCodec, MultiscaleMetadata, ScaleMetadata
from tensorstore_py.drivers.precomputed.sharding import build_shard, read_chunk


def ts_create(path: Path, *, data_type: str, size: tuple[int, int, int], chunk_size: tuple[int, int, int],
              num_channels: int = 1, encoding: str = "raw", volume_type: str = "image",
              **scale: Any) -> Any:
    """Create a one-scale volume with TensorStore (resolution 1, key "1_1_1" unless given)."""
    sm = {"size": list(size), "chunk_size": list(chunk_size), "encoding": encoding,
          "resolution": [1, 1, 1], **scale}
    spec = {"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(path)},
            "multiscale_metadata": {"type": volume_type, "data_type": data_type, "num_channels": num_channels},
            "scale_metadata": sm}
    return ts.open(spec, create=True, delete_existing=True).result()


def ts_open(path: Path, scale_index: int = 0) -> Any:
    return ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(path)},
                    "scale_index": scale_index}).result()


def read_info(root: Path) -> MultiscaleMetadata:
    return MultiscaleMetadata.decode((root / "info").read_bytes())


def file_reader(root: Path):
    """``read(key, byte_range)`` over files under ``root``; None for a missing file."""

    def read(key: str, r: ByteRange) -> bytes | None:
        p = root / key
        if not p.exists():
            return None
        data = p.read_bytes()
        a, b = r.clip(len(data))
        return data[a:b]

    return read


def cells(scale: ScaleMetadata):
    return itertools.product(*(range(g) for g in scale.grid_shape()))


def region(scale: ScaleMetadata, cell: tuple[int, ...]) -> tuple[slice, ...]:
    """Where a chunk lies in a whole-scale array indexed from 0 (not from voxel_offset)."""
    begin, end = scale.chunk_box(cell)
    return tuple(slice(b - o, e - o) for b, e, o in zip(begin, end, scale.voxel_offset))


def read_volume(root: Path, scale_index: int = 0) -> np.ndarray:
    """The whole scale as an (x, y, z, channel) array; absent chunks read as 0."""
    info = read_info(root)
    scale = info.scales[scale_index]
    codec = ChunkCodec.for_scale(info, scale)
    out = np.zeros((*scale.size, info.num_channels), info.dtype)
    read = file_reader(root)
    for cell in cells(scale):
        shape = scale.chunk_shape(cell)
        if scale.sharding is None:
            key = scale.chunk_key(cell)
            data = read(key, ByteRange(0))
        else:
            key = scale.shard_key(cell)
            data = read_chunk(scale.sharding, scale.chunk_id(cell), read, prefix=scale.key,
                              limit=codec.max_encoded_size(shape))
        if data is None:
            continue
        out[region(scale, cell)] = codec.decode(data, shape, key=key)
    return out


def write_volume(root: Path, info: MultiscaleMetadata, array: np.ndarray, scale_index: int = 0, *,
                 skip_zero: bool = False) -> dict[str, bytes]:
    """Write ``info`` and every chunk (or shard) of one scale; returns {key: bytes} written.
    ``skip_zero`` leaves out all-zero chunks, as TensorStore does (they read as the fill value)."""
    scale = info.scales[scale_index]
    codec = ChunkCodec.for_scale(info, scale)
    files: dict[str, bytes] = {"info": info.encode()}
    shards: dict[str, dict[int, bytes]] = {}
    for cell in cells(scale):
        chunk = array[region(scale, cell)]
        if skip_zero and not chunk.any():
            continue
        data = codec.encode(chunk)
        if scale.sharding is None:
            files[scale.chunk_key(cell)] = data
        else:
            shards.setdefault(scale.shard_key(cell), {})[scale.chunk_id(cell)] = data
    for key, chunks in shards.items():
        shard = build_shard(scale.sharding, chunks)
        assert shard is not None
        files[key] = shard
    for key, data in files.items():
        p = root / key
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return files


def written_files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by its "/"-separated key."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            out[p.relative_to(root).as_posix()] = p.read_bytes()
    return out


def label_volume(shape: tuple[int, ...], dtype: str, rng: np.random.Generator, *, labels: int = 12) -> np.ndarray:
    """A realistic segmentation: Voronoi cells of random (large) ids, a zero background slab."""
    pts = rng.integers(0, shape[:3], size=(labels, 3))
    ids = rng.integers(1, np.iinfo(dtype).max, size=labels, dtype=np.uint64 if dtype == "uint64" else np.int64)
    grid = np.stack(np.meshgrid(*(np.arange(s) for s in shape[:3]), indexing="ij"), -1)
    nearest = ((grid[..., None, :] - pts) ** 2).sum(-1).argmin(-1)
    vol = ids[nearest].astype(dtype)
    vol[: max(1, shape[0] // 4)] = 0
    if len(shape) == 4:
        vol = np.stack([vol if c % 2 == 0 else vol[::-1].copy() for c in range(shape[3])], axis=-1)
    return vol
