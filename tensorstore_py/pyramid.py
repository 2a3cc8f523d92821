"""Writing multiscale pyramids from a base array: OME-Zarr groups and neuroglancer
precomputed scales.

:func:`write_pyramid` stores ``levels`` resolution levels: level 0 is the base
array itself, level ``i`` is :func:`tsp.downsample <tensorstore_py.downsample>`
of level ``i - 1`` *as stored* (so each level reads only the one before it).

* ``format="ome-zarr"``: arrays ``<url>/0``, ``<url>/1``, ... (zarr v3 with
  ``zarr_format=3``, v2 with 2) and the group's ``multiscales`` metadata: NGFF
  0.5 in the v3 group's ``zarr.json`` (``attributes.ome``), NGFF 0.4 in the v2
  group's ``.zattrs``. Each level's ``scale`` is the base voxel size times the
  factors so far; a level whose domain does not start at 0 (a base with a
  non-zero origin) gets the matching ``translation``. Other attributes of an
  existing group are kept.
* ``format="neuroglancer_precomputed"``: a volume at ``url`` whose scale 0 is
  the base ([x, y, z, channel]; a 3-d base gets one channel), or, with
  ``url=None`` and a base that is a scale of a precomputed volume, new scales
  added to that volume. New scales have the resolution times the factors, the
  ``voxel_offset`` of the downsampled domain, and the base scale's chunk size,
  encoding and sharding (the same shard shape in chunks) unless given.

Guarantees: the pyramid's description is written last (the group's metadata
with a compare-and-swap on its generation; each precomputed scale joins the
``info`` by compare-and-swap when it is created, before its data), so a reader
of an OME-Zarr group never sees a level that is not complete. Existing levels
are not overwritten unless ``overwrite=True``. Levels are copied block by
block, blocks aligned to the destination's write chunks (whole shards, no
read-modify-write), a few blocks in flight.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tensorstore_py.core.budget import ByteBudget, run_bounded
from tensorstore_py.core.errors import InvalidArgumentError
from tensorstore_py.core.future import Future, spawn
from tensorstore_py.downsample_view import downsample
from tensorstore_py.drivers.groups import GroupFormat, create_group, update_group_attributes
from tensorstore_py.drivers.precomputed.driver import PrecomputedArray, encoding_members
from tensorstore_py.drivers.precomputed.sharding import ShardingSpec, shard_shape, sharding_for
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.registry import open_kvstore
from tensorstore_py.multiscale import Axis, Level, Multiscale, ngff_attributes, open_multiscale
from tensorstore_py.opening import open as open_array
from tensorstore_py.tensorstore import TensorStore

__all__ = ["write_pyramid"]

FORMATS = ("ome-zarr", "neuroglancer_precomputed")
_BLOCK_BYTES = 16 << 20  # output bytes per copied block
_MAX_BLOCK_BYTES = 256 << 20  # larger write chunks (unaligned shards) are copied in smaller blocks
_BLOCKS_IN_FLIGHT = 2
_NGFF_AXES = {2: "yx", 3: "zyx", 4: "czyx", 5: "tczyx"}
_AXIS_TYPES = {"t": "time", "c": "channel", "z": "space", "y": "space", "x": "space"}


def write_pyramid(
    base: TensorStore,
    url: str | Mapping[str, Any] | None = None,
    *,
    format: str = "ome-zarr",
    levels: int = 3,
    factors: int | Sequence[int] | None = None,
    method: str | None = None,
    chunks: Sequence[int] | None = None,
    shards: Sequence[int] | None = None,
    compression: Any = None,
    zarr_format: int = 3,
    axes: Sequence[str | Axis] | None = None,
    voxel_size: Sequence[float] | None = None,
    name: str | None = None,
    overwrite: bool = False,
) -> Future[Multiscale]:
    """Write a ``levels``-level pyramid of ``base`` (see the module docstring); the
    Future gives the pyramid as :func:`~tensorstore_py.open_multiscale` reads it.

    ``factors``: per dimension (or one int for the spatial ones), default 2 along
    spatial axes and 1 along channel and time. ``method``: a downsample method,
    default ``"mode"`` for precomputed segmentations and ``"mean"`` otherwise.
    ``chunks`` / ``shards`` / ``compression``: as ``tsp.open`` takes them for the
    new arrays (default: the base's chunking for precomputed scales, ~2 MiB
    chunks for OME-Zarr). ``axes``: NGFF axis names or :class:`Axis` (default
    the last of ``t, c, z, y, x``); ``voxel_size``: the base's scale per axis
    (default 1; precomputed: the base scale's resolution).
    """
    if format not in FORMATS:
        raise InvalidArgumentError(f"write_pyramid: format must be one of {list(FORMATS)}, got {format!r}")
    if not isinstance(levels, int) or levels < 1:
        raise InvalidArgumentError(f"write_pyramid: levels must be a positive integer, got {levels!r}")
    if format == "ome-zarr":
        if url is None:
            raise InvalidArgumentError("write_pyramid: an OME-Zarr pyramid needs a url")
        if zarr_format not in (2, 3):
            raise InvalidArgumentError(f"write_pyramid: zarr_format must be 2 or 3, got {zarr_format!r}")
        ax = _ngff_axes(axes, base.ndim)
        fs = _factors(factors, [a.type == "space" for a in ax])
        return spawn(_write_ome_zarr(base, url, ax, fs, method or "mean", levels, chunks, shards, compression,
                                     zarr_format, voxel_size, name, overwrite))
    if base.ndim == 3:
        base = base[..., None]
    if base.ndim != 4:
        raise InvalidArgumentError(f"write_pyramid: a precomputed volume is [x, y, z, channel], "
                                   f"got a view of rank {base.ndim}")
    if url is None and not isinstance(base.driver, PrecomputedArray):
        raise InvalidArgumentError("write_pyramid: url=None adds scales to a precomputed volume, "
                                   "but base is not a scale of one")
    fs = _factors(factors, [True, True, True, False])
    return spawn(_write_precomputed(base, url, fs, method, levels, chunks, shards, compression, voxel_size,
                                    overwrite))


def _ngff_axes(axes: Sequence[str | Axis] | None, rank: int) -> tuple[Axis, ...]:
    if axes is None:
        if rank not in _NGFF_AXES:
            raise InvalidArgumentError(f"write_pyramid: OME-Zarr images have 2 to 5 dimensions, got {rank}")
        axes = list(_NGFF_AXES[rank])
    out = tuple(a if isinstance(a, Axis) else Axis(a, _AXIS_TYPES.get(a, "space")) for a in axes)
    if len(out) != rank or len({a.name for a in out}) != rank:
        raise InvalidArgumentError(f"write_pyramid: expected {rank} distinct axes, got {list(axes)}")
    return out


def _factors(factors: int | Sequence[int] | None, spatial: Sequence[bool]) -> tuple[int, ...]:
    if factors is None:
        factors = 2
    fs = [factors if s else 1 for s in spatial] if isinstance(factors, (int, np.integer)) else list(factors)
    if len(fs) != len(spatial) or any(not isinstance(f, (int, np.integer)) or f < 1 for f in fs):
        raise InvalidArgumentError(f"write_pyramid: factors must be {len(spatial)} integers >= 1, got {factors!r}")
    return tuple(int(f) for f in fs)


# -- copying a level ------------------------------------------------------------------------------
async def copy_blocks(src: TensorStore, dst: TensorStore) -> None:
    """``dst[...] = src[...]`` (equal shapes) in blocks aligned to ``dst``'s write chunks."""
    src = src.translate_to(dst.origin)
    lay = dst.chunk_layout
    block = list(lay.write_chunk_shape)
    itemsize = dst.dtype.itemsize
    if math.prod(block) * itemsize > _MAX_BLOCK_BYTES:
        block = list(lay.read_chunk_shape)
    while math.prod(block) * itemsize < _BLOCK_BYTES:
        grow = [d for d in range(len(block)) if block[d] < dst.shape[d]]
        if not grow:
            break
        d = max(grow, key=lambda i: dst.shape[i] / block[i])
        block[d] *= 2
    starts = []
    for lo, n, g, b in zip(dst.origin, dst.shape, lay.grid_origin, block):
        first = lo - (lo - g) % b  # the aligned block start at or below lo
        starts.append([(max(lo, s), min(lo + n, s + b)) for s in range(first, lo + n, b)])

    async def one(box: tuple[tuple[int, int], ...]) -> None:
        where = tuple(slice(a, b) for a, b in box)
        await dst.at[where].write(await src.at[where].read())

    await run_bounded(itertools.product(*starts), one, budget=ByteBudget(1 << 62), cost=0,
                      max_tasks=_BLOCKS_IN_FLIGHT)


# -- OME-Zarr -----------------------------------------------------------------------------------------
async def _write_ome_zarr(base: TensorStore, url: Any, axes: tuple[Axis, ...], fs: tuple[int, ...], method: str,
                          levels: int, chunks: Any, shards: Any, compression: Any, zarr_format: int,
                          voxel_size: Sequence[float] | None, name: str | None, overwrite: bool) -> Multiscale:
    kv = await open_kvstore(url)
    vs = tuple(float(v) for v in voxel_size) if voxel_size is not None else (1.0,) * base.ndim
    if len(vs) != base.ndim:
        raise InvalidArgumentError(f"write_pyramid: voxel_size needs {base.ndim} values, got {list(vs)}")
    written: list[Level] = []
    stored: TensorStore | None = None  # the previous level, as stored, in its own coordinates
    for i in range(levels):
        src = base if stored is None else downsample(stored, fs, method)
        scale = tuple(v * f ** i for v, f in zip(vs, fs))
        dst = await open_array(
            {"kvstore": kv.with_path(str(i)).spec()}, create=True, open=False, delete_existing=overwrite,
            driver="zarr3" if zarr_format == 3 else "zarr", dtype=src.dtype, shape=src.shape,
            chunks=_clip(chunks, src.shape), shards=_clip(shards, src.shape), compression=compression,
            dimension_names=[a.name for a in axes])
        await copy_blocks(src, dst)
        stored = dst.translate_to(src.origin)
        written.append(Level(str(i), scale, tuple(o * s for o, s in zip(src.origin, scale))))
    attrs = ngff_attributes(axes, written, zarr_format=zarr_format, name=name,
                            method=method if levels > 1 else None)
    await _update_group(kv, zarr_format, attrs)
    return await open_multiscale(kv)


def _clip(shape: Sequence[int] | None, extent: Sequence[int]) -> list[int] | None:
    return None if shape is None else [min(int(c), max(1, n)) for c, n in zip(shape, extent)]


async def _update_group(kv: KvStore, zarr_format: int, attrs: dict[str, Any]) -> None:
    """Merge ``attrs`` into the group's attributes (the group is created if absent;
    an array there is an error)."""
    fmt: GroupFormat = "zarr3" if zarr_format == 3 else "zarr2"
    node = await create_group(kv, fmt)  # exist_ok: opens the group already there
    await update_group_attributes(kv, node.format, attrs)


# -- neuroglancer precomputed ---------------------------------------------------------------------------
async def _write_precomputed(base: TensorStore, url: Any, fs: tuple[int, ...], method: str | None, levels: int,
                             chunks: Any, shards: Any, compression: Any, voxel_size: Any,
                             overwrite: bool) -> Multiscale:
    if url is None:  # new scales after the base's, in its volume
        stored = base
    else:
        src_drv = base.driver
        template = src_drv.resolved.scale.to_json() if isinstance(src_drv, PrecomputedArray) else {}
        resolution = voxel_size or template.get("resolution") or (1, 1, 1)
        spec = _scale_spec(await open_kvstore(url), base, template, resolution, chunks, shards, compression)
        encoding = spec["scale_metadata"]["encoding"]
        kind = "segmentation" if encoding in ("compressed_segmentation", "compresso") else "image"
        spec["multiscale_metadata"] = {"type": kind, "data_type": str(np.dtype(base.dtype)),
                                       "num_channels": base.shape[3]}
        stored = await open_array(spec, create=True, open=False, delete_existing=overwrite)
        await copy_blocks(base, stored)
    top: PrecomputedArray = stored.driver  # type: ignore[assignment]
    template = top.resolved.scale.to_json()
    method = method or ("mode" if top.resolved.info.type == "segmentation" else "mean")
    for i in range(1, levels):
        src = downsample(stored, fs, method)
        resolution = [r * f ** i for r, f in zip(template["resolution"], fs)]
        spec = _scale_spec(top.volume_kvstore, src, template, resolution, chunks, shards, compression)
        dst = await open_array(spec, create=True, open=False)
        await copy_blocks(src, dst)
        stored = dst
    return await open_multiscale(top.volume_kvstore)


def _scale_spec(volume: KvStore, src: TensorStore, template: Mapping[str, Any], resolution: Sequence[float],
                chunks: Any, shards: Any, compression: Any) -> dict[str, Any]:
    """The spec creating a scale that holds ``src``: its size and voxel offset from
    ``src``, chunking and encoding from the arguments, else from ``template``
    (the scale it derives from)."""
    size = list(src.shape[:3])
    chunk = _clip((chunks or template.get("chunk_sizes", [[64, 64, 64]])[0])[:3], size)
    assert chunk is not None
    sm: dict[str, Any] = {"size": size, "voxel_offset": list(src.origin[:3]),
                          "resolution": [float(r) for r in resolution], "chunk_size": chunk}
    if compression is not None or not template:
        sm.update(encoding_members(compression))
    else:
        sm.update({k: template[k] for k in ("encoding", "jpeg_quality", "png_level",
                                            "compressed_segmentation_block_size") if k in template})
    grid = [-(-n // c) for n, c in zip(size, chunk)]
    if shards is not None:
        sm["sharding"] = sharding_for(grid, [max(1, int(s) // c) for s, c in zip(shards[:3], chunk)],
                                      data_encoding="gzip" if sm["encoding"] == "raw" else "raw").to_json()
    elif template.get("sharding") is not None:
        sm["sharding"] = _sharding_like(template, grid)
    return {"driver": "neuroglancer_precomputed", "kvstore": volume.spec(), "scale_metadata": sm}


def _sharding_like(template: Mapping[str, Any], grid: Sequence[int]) -> dict[str, Any]:
    """The template scale's sharding for a grid of ``grid`` chunks: shards of the same
    box of chunks when its shards are boxes, else the same spec."""
    spec = ShardingSpec.from_json(template["sharding"])
    old_grid = [-(-n // c) for n, c in zip(template["size"], template["chunk_sizes"][0])]
    box = shard_shape(spec, old_grid)
    if box is None:
        return spec.to_json()
    return sharding_for(grid, box, minishard_bits=spec.minishard_bits,
                        minishard_index_encoding=spec.minishard_index_encoding,
                        data_encoding=spec.data_encoding).to_json()
