"""The ``neuroglancer_precomputed`` array driver: one scale of a precomputed volume.

Spec, as TensorStore's driver takes it::

    {"driver": "neuroglancer_precomputed", "kvstore": ..., "path": "...",
     "scale_index": 0, "scale_metadata": {...}, "multiscale_metadata": {...}}

``scale_index`` / ``scale_metadata`` / ``multiscale_metadata`` select the scale
of an existing volume and constrain it, or describe a new scale or volume
(drivers/precomputed/spec.py has the rules). A ``metadata`` member holding
``multiscale_metadata`` and ``scale_metadata`` supplies defaults for them
(what ``tsp.open(..., driver="neuroglancer_precomputed", shape=, dtype=, ...)``
builds, see :func:`build_metadata`).

The array has the dimensions ``x, y, z, channel``; its domain starts at the
scale's ``voxel_offset`` (channel at 0), and its chunk grid starts there too.
Unsharded chunks are read and written through the chunk engine (edge chunks
are stored clipped to the volume: :meth:`PrecomputedArray.codec_at`); on a
local disk, chunks CloudVolume stored with a compression suffix (``<key>.gz``,
``.br``, ``.zstd``, ``.xz``, ``.bz2``) are read as ``<key>`` and replaced by
the plain form when written (:mod:`.suffixed`); sharded
scales go through :mod:`.shard_io` (ranged reads of the shard and minishard
indexes and the chunks; whole-shard read-modify-write).

Guarantees: creating a volume writes ``info`` create-only; adding a scale to
an existing volume rewrites ``info`` as a compare-and-swap on its generation
(retried when another writer changed it, so concurrent creators of different
scales both land). Each unsharded chunk and each shard is replaced atomically;
partial writes are read-modify-writes conditioned on the generation of the
chunk or shard. Chunks equal to the fill value (0) are not stored. Durability
is the kvstore's.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorstore_py.core.budget import ByteBudget
from tensorstore_py.core.errors import (
    ConditionFailedError,
    InvalidArgumentError,
    InvalidSpecError,
    NotFoundError,
    ReadOnlyError,
    UnsupportedError,
)
from tensorstore_py.drivers.base import Index
from tensorstore_py.drivers.cache import CachePool
from tensorstore_py.drivers.codecs.base import ChunkCodec as EngineCodec
from tensorstore_py.drivers.engine import ChunkedArray
from tensorstore_py.drivers.formats import ArrayFormat, MetadataOptions, OpenOptions, register_array_format
from tensorstore_py.drivers.grid import ChunkPart, chunk_parts, out_shape
from tensorstore_py.drivers.open import url_of
from tensorstore_py.drivers.precomputed.encodings import ChunkCodec
from tensorstore_py.drivers.precomputed.metadata import (
    DATA_TYPES,
    INFO_KEY,
    LABELS,
    MultiscaleMetadata,
    ScaleMetadata,
    join_key,
)
from tensorstore_py.drivers.precomputed.shard_io import ShardedChunks
from tensorstore_py.drivers.precomputed.sharding import shard_cells, shard_shape, sharding_for
from tensorstore_py.drivers.precomputed.spec import ResolvedScale, resolve_scale, scale_spec
from tensorstore_py.drivers.precomputed.suffixed import SuffixedChunks, has_suffixed_chunks
from tensorstore_py.kvstore.base import Buffer, Generation, KvStore

__all__ = ["DRIVER", "PrecomputedArray", "build_metadata", "encoding_members", "open_precomputed",
           "scale_location"]

DRIVER = "neuroglancer_precomputed"
_SPEC_MEMBERS = ("scale_index", "scale_metadata", "multiscale_metadata")
_INFO_ATTEMPTS = 20


class _ScaleCodec(EngineCodec):
    """One chunk of a scale as the engine sees it: the whole (x, y, z, channel) chunk
    shape in and out, the stored chunk clipped to ``stored`` (x, y, z) at the volume's
    upper edges (the rest reads as 0)."""

    def __init__(self, codec: ChunkCodec, chunk_shape: tuple[int, ...], stored: tuple[int, ...]) -> None:
        self.codec = codec
        self.chunk_shape = chunk_shape
        self.stored = stored
        self.clip = tuple(slice(0, n) for n in stored)
        self.clipped = stored != chunk_shape[:3]

    def encode(self, a: np.ndarray) -> Buffer:
        return self.codec.encode(a[self.clip] if self.clipped else a)

    def decode(self, buf: Buffer, *, key: str, out: np.ndarray | None = None) -> np.ndarray:
        arr = self.codec.decode(buf, self.stored, key=key)
        if not self.clipped:
            return arr
        full = out if out is not None else np.empty(self.chunk_shape, arr.dtype)
        full[...] = 0
        full[self.clip] = arr
        return full


@dataclass(frozen=True)
class _Layout:
    """A scale as the chunk engine needs it (chunked_metadata.ParsedMetadata)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fill: np.generic
    chunk_shape: tuple[int, ...]
    codec: EngineCodec
    dimension_names: tuple[str | None, ...]
    scale: ScaleMetadata
    chunk_size: tuple[int, int, int]
    prefix: str  # the scale's folder in the store

    def chunk_key(self, cell: tuple[int, ...]) -> str:
        return self.prefix + self.scale.chunk_name(cell[:3], self.chunk_size)


def _layout(resolved: ResolvedScale, codec: ChunkCodec, prefix: str) -> _Layout:
    info, scale, cs = resolved.info, resolved.scale, resolved.chunk_size
    nc = info.num_channels
    chunk_shape = (*cs, nc)
    return _Layout(shape=(*scale.size, nc), dtype=info.dtype, fill=info.dtype.type(0),
                   chunk_shape=chunk_shape, codec=_ScaleCodec(codec, chunk_shape, cs),
                   dimension_names=LABELS, scale=scale, chunk_size=cs, prefix=prefix)


def scale_location(kv: KvStore, key: str) -> tuple[KvStore, str]:
    """Where the chunks of scale ``key`` of the volume at ``kv`` live: ``(store, prefix)``,
    the volume's store and ``"<key>/"``, or, for a key that steps out of the volume's
    folder with ``..`` (never out of the store's root), a store at the scale's folder."""
    try:
        folder = join_key(key)
    except InvalidSpecError:  # leaves the volume's folder: resolve it against the store's path
        where = join_key(kv.path, key)
        other = copy.copy(kv)
        other.path = ("/" if kv.path.startswith("/") else "") + where + ("/" if where else "")
        return other, ""
    return kv, folder + "/" if folder else ""


class PrecomputedArray(ChunkedArray):
    """One scale of a neuroglancer precomputed volume (see the module docstring).

    ``volume_kvstore`` holds the ``info``; chunks (or shards) are read and
    written through ``kvstore`` under ``chunk_prefix``: the volume's store and
    the scale's folder, unless the scale's key leaves the volume's folder.
    """

    driver = DRIVER
    metadata_key = INFO_KEY

    def __init__(self, *, volume_kvstore: KvStore, resolved: ResolvedScale, info_generation: Generation,
                 kvstore: KvStore | None = None, cache_pool: CachePool | None = None,
                 budget: ByteBudget | None = None) -> None:
        codec = ChunkCodec.for_scale(resolved.info, resolved.index)
        store, prefix = scale_location(volume_kvstore, resolved.scale.key)
        if kvstore is None and resolved.scale.sharding is None and has_suffixed_chunks(store, prefix):
            store = SuffixedChunks(store)  # CloudVolume's <key>.gz chunks on a local disk
        layout = _layout(resolved, codec, prefix)
        super().__init__(kvstore=kvstore or store, metadata=resolved.info.to_json(), parsed=layout,
                         metadata_generation=info_generation, cache_pool=cache_pool, budget=budget)
        self.volume_kvstore = volume_kvstore
        self.chunk_prefix = prefix
        self.resolved = resolved
        self._pcodec = codec
        self._scale = resolved.scale
        self._chunk_size = resolved.chunk_size
        self._grid = resolved.scale.grid_shape(resolved.chunk_size)
        self._full_codec = layout.codec
        self._by_region = codec.encoding == "compressed_segmentation"
        sharding = resolved.scale.sharding
        self._shard_box = None if sharding is None else shard_shape(sharding, self._grid)
        self._sharded = None if sharding is None else ShardedChunks(
            self, self.kvstore, sharding, self._grid, prefix=prefix, budget=self._budget,
            max_chunk_bytes=codec.max_encoded_size(self._chunk_size), shard_cells=self._shard_cells)

    # -- the engine's format hooks ---------------------------------------------------------
    @staticmethod
    def parse_metadata(meta: dict[str, Any]) -> Any:
        raise UnsupportedError(f"{DRIVER}: a scale is opened through open_precomputed, not from metadata alone")

    @staticmethod
    def encode_metadata(meta: dict[str, Any]) -> bytes:
        return MultiscaleMetadata.from_json(meta).encode()

    def codec_at(self, cell: tuple[int, ...]) -> EngineCodec:
        """The full-chunk codec inside the volume, a clipping one at its upper edges."""
        stored = self._scale.chunk_shape(cell[:3], self._chunk_size)
        if stored == self._chunk_size:
            return self._full_codec
        return _ScaleCodec(self._pcodec, self._chunk_shape, stored)

    def chunk_key(self, cell: tuple[int, ...]) -> str:
        """The key (in :attr:`kvstore`) of the chunk, or for sharded scales of the
        shard, holding grid cell ``cell``."""
        if self._sharded is not None:
            return self._sharded.shard_key(cell)
        return self._parsed.chunk_key(cell)

    def decode_chunk(self, key: str, data: Any) -> np.ndarray:
        if self._sharded is not None:
            raise UnsupportedError(f"{DRIVER}: {key!r} is a shard of many chunks; read the array instead")
        return self.codec_at(self._cell_of(key)).decode(data, key=key)

    def _cell_of(self, key: str) -> tuple[int, ...]:
        """The grid cell of an unsharded chunk name ``<x0>-<x1>_<y0>-<y1>_<z0>-<z1>``."""
        try:
            begins = [int(part.split("-")[0]) for part in key.rsplit("/", 1)[-1].split("_")]
        except ValueError:
            begins = []
        cell = tuple((b - o) // c for b, o, c in zip(begins, self._scale.voxel_offset, self._chunk_size))
        if len(begins) != 3 or self._parsed.chunk_key((*cell, 0)).rsplit("/", 1)[-1] != key.rsplit("/", 1)[-1]:
            raise InvalidArgumentError(f"{DRIVER}: {key!r} is not a chunk name of scale {self._scale.key!r}")
        return (*cell, 0)

    def _decode_into(self, buf: Any, key: str, p: ChunkPart, dest: np.ndarray) -> np.ndarray | None:
        """The engine's per-chunk decode, except that compressed_segmentation
        chunks decode only the voxels asked for, straight into ``dest`` (a plane
        through a chunk costs a plane)."""
        if self._by_region:
            stored = self._scale.chunk_shape(p.cell[:3], self._chunk_size)
            self._pcodec.decode(buf, stored, key=key, region=p.chunk, out=dest)
            return None
        return super()._decode_into(buf, key, p, dest)

    @property
    def raw_chunk_nbytes(self) -> int | None:
        return None  # edge chunks are stored clipped: sizes differ

    # -- properties -------------------------------------------------------------------------
    @property
    def origin(self) -> tuple[int, ...]:
        return (*self._scale.voxel_offset, 0)

    @property
    def write_chunk_shape(self) -> tuple[int, ...]:
        """The chunk, or for sharded scales whose shards are boxes of the grid, the shard
        (else the whole volume: a shard's chunks may lie anywhere)."""
        if self._sharded is None:
            return self._chunk_shape
        if self._shard_box is None:
            return self._shape
        return (*(c * n for c, n in zip(self._chunk_size, self._shard_box)), self._chunk_shape[3])

    def spec(self) -> dict[str, Any]:
        return {"driver": DRIVER, "kvstore": self.volume_kvstore.spec(), **scale_spec(self.resolved)}

    def with_kvstore(self, kvstore: KvStore) -> PrecomputedArray:
        """The same scale with its chunks read and written through ``kvstore`` (a view
        of :attr:`kvstore`, e.g. bound to a transaction), under the same prefix."""
        if isinstance(self.kvstore, SuffixedChunks) and not isinstance(kvstore, SuffixedChunks):
            kvstore = SuffixedChunks(kvstore)
        return PrecomputedArray(volume_kvstore=self.volume_kvstore, resolved=self.resolved,
                                info_generation=self._metadata_generation, kvstore=kvstore,
                                cache_pool=self._cache, budget=self._budget)

    async def resize(self, new_shape: tuple[int, ...]) -> ChunkedArray:
        raise UnsupportedError(f"{DRIVER}: resizing a scale is not supported (as in TensorStore)")

    # -- sharded I/O --------------------------------------------------------------------------
    def _shard_cells(self, key: str) -> int | None:
        """Grid cells in shard ``key`` when shards are boxes of the grid, else None."""
        assert self._scale.sharding is not None
        return shard_cells(self._scale.sharding, self._grid, int(key.rsplit("/", 1)[-1].split(".")[0], 16))

    @property
    def reads_blocking(self) -> bool:  # type: ignore[override]
        # sharded scales read through their own ranged path (indexes, then chunks)
        return self._sharded is None and super().reads_blocking

    async def read(self, index: Index, *, out: np.ndarray | None = None) -> np.ndarray:
        if self._sharded is None:
            return await super().read(index, out=out)
        index = self._check_index(index)
        out = self._out(index, out)
        if out.size:
            await self._sharded.read(chunk_parts(index, self._chunk_shape, self._shape), out)
        return out

    async def write(self, index: Index, value: np.ndarray) -> None:
        if self._sharded is None:
            return await super().write(index, value)
        index = self._check_index(index)
        value = np.asarray(value)
        if value.shape != out_shape(index) or value.dtype != self._dtype:
            raise InvalidArgumentError(f"write of {value.dtype} {value.shape} into a region of "
                                       f"{self._dtype} {out_shape(index)}")
        if value.size == 0:
            return
        self._check_writable()
        self.kvstore.depend_on(self.metadata_key)  # as ChunkedArray.write: shards encoded by this info
        await self._sharded.write(chunk_parts(index, self._chunk_shape, self._shape), value)

    def _check_writable(self) -> None:
        if self.kvstore.read_only:
            raise ReadOnlyError(f"{DRIVER} volume at {url_of(self.volume_kvstore)}: the store is read-only")


# -- opening and creating ------------------------------------------------------------------------
def _spec_members(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``scale_index`` / ``scale_metadata`` / ``multiscale_metadata``, with the defaults
    a ``metadata`` member supplies (the spec's own members win)."""
    defaults = spec.get("metadata") or {}
    if not isinstance(defaults, Mapping) or set(defaults) - set(_SPEC_MEMBERS):
        raise InvalidSpecError(f"{DRIVER} spec: 'metadata' may only hold {list(_SPEC_MEMBERS)}, got {defaults!r}")
    members: dict[str, Any] = {}
    for name in _SPEC_MEMBERS:
        given, default = spec.get(name), defaults.get(name)
        if isinstance(given, Mapping) and isinstance(default, Mapping):
            members[name] = {**default, **given}
        else:
            members[name] = given if given is not None else default
    return members


async def open_precomputed(spec: Mapping[str, Any], kv: KvStore, options: OpenOptions) -> PrecomputedArray:
    """Open (or create, per ``options``) the scale ``spec`` names in the volume at ``kv``."""
    members = _spec_members(spec)
    url = url_of(kv)
    if options.delete_existing:
        await kv.delete_range("")
    for _attempt in range(_INFO_ATTEMPTS):
        res = await kv.read(INFO_KEY)
        try:
            info = None if res.state == "missing" else MultiscaleMetadata.decode(bytes(res.value))
        except (InvalidSpecError, UnsupportedError) as e:
            raise type(e)(f"{e} (in {INFO_KEY} at {url})") from None
        if info is None and not options.create:
            raise NotFoundError(f"{DRIVER} volume not found: no {INFO_KEY} at {url}")
        try:
            resolved, changed = resolve_scale(info, open=options.open, create=options.create, **members)
        except NotFoundError as e:
            raise NotFoundError(f"{e} (volume at {url})") from None
        gen = res.generation
        if changed:
            try:  # create-only for a new volume, compare-and-swap when adding a scale
                gen = await kv.write(INFO_KEY, resolved.info.encode(), if_equal=res.generation)
            except ConditionFailedError:
                continue  # someone else changed the info: resolve again against theirs
        return PrecomputedArray(volume_kvstore=kv, resolved=resolved, info_generation=gen,
                                cache_pool=options.cache_pool, budget=options.budget)
    raise ConditionFailedError(f"{DRIVER} volume at {url}: the info kept changing while opening")


# -- tsp.open keyword options --------------------------------------------------------------------
def encoding_members(compression: Any) -> dict[str, Any]:
    """``compression=`` (see :func:`build_metadata`) as ``scale_metadata`` members:
    ``encoding`` and its options."""
    if compression is None:
        return {"encoding": "raw"}
    name, level = (compression, None) if isinstance(compression, str) else tuple(compression)
    options: dict[str, Any] = {"encoding": name}
    if name == "jpeg" and level is not None:
        options["jpeg_quality"] = level
    elif name == "png" and level is not None:
        options["png_level"] = level
    elif name == "compressed_segmentation":
        options["compressed_segmentation_block_size"] = list(level) if level is not None else [8, 8, 8]
    elif level is not None or name not in ("raw", "jpeg", "png", "compresso"):
        raise InvalidArgumentError(f"{DRIVER}: compression must be one of raw, jpeg[, quality], png[, level], "
                                   f"compressed_segmentation[, block size] or compresso, got {compression!r}")
    return options


def build_metadata(o: MetadataOptions) -> dict[str, Any]:
    """Spec members for ``tsp.open(..., driver="neuroglancer_precomputed", create=True)``.

    ``shape`` is [x, y, z, channel]; ``chunks`` [x, y, z] (or with the channel
    count last); ``compression`` the encoding (``"raw"`` by default, ``("jpeg",
    quality)``, ``("png", level)``, ``("compressed_segmentation", block)`` with
    8^3 blocks by default, ``"compresso"``); ``shards`` [x, y, z] voxels per
    shard, a power-of-two multiple of ``chunks`` that is a box of the grid
    (identity hash, gzip-encoded minishard indexes). The volume is a
    ``segmentation`` for the label encodings, else an ``image``; resolution 1 nm.
    """
    shape = [int(s) for s in o.shape]
    if len(shape) != 4:
        raise InvalidArgumentError(f"{DRIVER}: shape must be [x, y, z, channel], got {shape}")
    dtype = np.dtype(o.dtype)
    data_type = next((n for n, d in DATA_TYPES.items() if d == dtype.newbyteorder("<")), None)
    if data_type is None:
        raise UnsupportedError(f"{DRIVER}: data type {dtype} is not supported "
                               f"(supported: {', '.join(DATA_TYPES)})")
    if o.codecs is not None:
        raise InvalidArgumentError(f"{DRIVER}: codecs= does not apply; give compression= (the encoding)")
    if o.fill_value not in (None, 0):
        raise InvalidArgumentError(f"{DRIVER}: the fill value is always 0, got {o.fill_value!r}")
    if o.dimension_names is not None and tuple(o.dimension_names) != LABELS:
        raise InvalidArgumentError(f"{DRIVER}: dimensions are {list(LABELS)}, got {list(o.dimension_names)}")
    options = encoding_members(o.compression)
    encoding = options["encoding"]
    chunks = [int(c) for c in o.chunks] if o.chunks is not None else [min(64, s) or 1 for s in shape[:3]]
    if len(chunks) == 4 and chunks[3] == shape[3]:
        chunks = chunks[:3]
    if len(chunks) != 3:
        raise InvalidArgumentError(f"{DRIVER}: chunks must be [x, y, z], got {chunks}")
    scale: dict[str, Any] = {"size": shape[:3], "chunk_size": chunks, "resolution": [1, 1, 1], **options}
    if o.shards is not None:
        shards = [int(s) for s in o.shards][:3]
        if len(shards) != 3 or any(s % c for s, c in zip(shards, chunks)):
            raise InvalidArgumentError(f"{DRIVER}: shards must be [x, y, z], multiples of chunks {chunks}, "
                                       f"got {list(o.shards)}")
        grid = [-(-s // c) for s, c in zip(shape, chunks)]
        scale["sharding"] = sharding_for(grid, [s // c for s, c in zip(shards, chunks)],
                                         data_encoding="gzip" if encoding == "raw" else "raw").to_json()
    kind = "segmentation" if encoding in ("compressed_segmentation", "compresso") else "image"
    return {"multiscale_metadata": {"type": kind, "data_type": data_type, "num_channels": shape[3]},
            "scale_metadata": scale}


def _is_volume(raw: Buffer) -> bool:
    """An ``info`` with ``scales`` (not a mesh or skeleton info, nor another format's file);
    opening it reports any problem with the document."""
    try:
        j = json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(j, dict) and "scales" in j


register_array_format(ArrayFormat(
    driver=DRIVER, probe_key=INFO_KEY, open=open_precomputed, build_metadata=build_metadata,
    is_array=_is_volume, spec_fields=frozenset(_SPEC_MEMBERS),
))
