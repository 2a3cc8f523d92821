"""safetensors in and out: restore a file or a sharded Hugging Face folder into any
target; write a checkpoint step as safetensors files.

Reading is native (no dependency): each file's header is read with two small
ranged reads, then only the bytes of the regions this process's devices need. A
tensor's bytes are C-order, so a block that is a run of whole rows is one
contiguous range; a block that is not (a column split) is read row by row
(adjacent rows coalesced by the store) whenever the bounding range would hold
more than 10% more bytes than the block. Works on every store that can read
byte ranges (file, memory, gs, s3, http).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from tensorstore_py.checkpoint.foreign import ForeignLeaf, dotted_name, restore_foreign
from tensorstore_py.checkpoint.layout import Region, c_strides, region_shape, span_in_chunk
from tensorstore_py.checkpoint.restoring import ReadStats
from tensorstore_py.checkpoint.safetensors_format import (
    INDEX_NAME,
    SINGLE_NAME,
    TensorEntry,
    header_length,
    parse_header,
)
from tensorstore_py.checkpoint.safetensors_local import LocalBlock, pieces, read_local_blocks
from tensorstore_py.core.budget import ByteBudget, run_bounded
from tensorstore_py.core.buffers import mapped_empty
from tensorstore_py.core.errors import DataCorruptionError, NotFoundError
from tensorstore_py.core.future import run_sync
from tensorstore_py.core.pools import run_io
from tensorstore_py.core.ranges import ByteRange
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.file import FileKvStore

__all__ = ["KeyMap", "SafetensorsSource", "is_safetensors", "open_safetensors", "restore_safetensors"]

#: target name -> name in the files: a function, or a mapping (names it lacks stay as they are)
KeyMap = Union[Callable[[str], str], Mapping[str, str]]  # noqa: UP007 (a runtime alias)
SourceLike = Union[str, KvStore]  # noqa: UP007
_SLACK = 1.1  # read a block's bounding range when it holds at most 10% more than the block


@dataclass
class SafetensorsSource:
    """The tensors of one safetensors file or Hugging Face folder (headers read)."""

    where: str
    kv: KvStore  # the folder
    tensors: dict[str, tuple[str, TensorEntry]]  # name -> (file key, entry)
    metadata: dict[str, str]

    def leaves(self) -> list[ForeignLeaf]:
        return [ForeignLeaf(n, e.shape, e.dtype) for n, (_k, e) in self.tensors.items()]


def is_safetensors(url: str) -> bool:
    """True for a URL naming a ``.safetensors`` file (no I/O)."""
    return url.rstrip("/").endswith(".safetensors")


async def _json(kv: KvStore, key: str, where: str) -> Any:
    r = await kv.read(key)
    if r.state != "value":
        return None
    try:
        return json.loads(bytes(r.value))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataCorruptionError(f"{where}/{key}: not JSON: {e}") from None


async def _header(kv: KvStore, key: str, where: str) -> tuple[list[TensorEntry], dict[str, str]]:
    r = await kv.read(key, byte_range=ByteRange(0, 8))
    if r.state != "value":
        raise NotFoundError(f"{where}: no safetensors file {key!r}")
    n = header_length(bytes(r.value), where=f"{where}/{key}")
    r = await kv.read(key, byte_range=ByteRange(8, 8 + n))
    if r.state != "value" or len(r.value) != n:
        raise DataCorruptionError(f"{where}/{key}: safetensors header of {n} bytes is cut short")
    return parse_header(bytes(r.value), where=f"{where}/{key}")


async def open_safetensors(source: SourceLike) -> SafetensorsSource:
    """Read the header(s) of a ``.safetensors`` file URL, or of a folder holding
    ``model.safetensors.index.json`` (every file it names) or ``model.safetensors``."""
    if isinstance(source, KvStore):
        kv, where, files = source, repr(source), None
    elif is_safetensors(source):
        folder, _, name = source.rstrip("/").rpartition("/")
        kv = await KvStore.open(_folder_url(folder)) if folder else await KvStore.open("file://./")
        where, files = folder, [name]
    else:
        kv = await KvStore.open(_folder_url(source))
        where, files = source.rstrip("/"), None
    weight_map: dict[str, str] | None = None
    if files is None:
        index = await _json(kv, INDEX_NAME, where)
        if index is not None:
            weight_map = dict(index.get("weight_map") or {})
            files = sorted(set(weight_map.values()))
        else:
            files = [SINGLE_NAME]
    headers = await asyncio.gather(*(_header(kv, f, where) for f in files))
    tensors: dict[str, tuple[str, TensorEntry]] = {}
    metadata: dict[str, str] = {}
    for f, (entries, meta) in zip(files, headers):
        metadata.update(meta)
        for e in entries:
            if e.name in tensors:
                raise DataCorruptionError(f"{where}: tensor {e.name!r} is in both {tensors[e.name][0]} and {f}")
            tensors[e.name] = (f, e)
    if weight_map is not None:
        for name, f in weight_map.items():
            if tensors.get(name, (None,))[0] != f:
                raise DataCorruptionError(f"{where}/{INDEX_NAME}: names {name!r} in {f!r}, whose header lacks it")
    return SafetensorsSource(where, kv, tensors, metadata)


def _folder_url(url: str) -> str:
    if "://" not in url:  # a plain path names a local folder
        url = "file://" + os.path.abspath(url)
    return url if url.endswith("/") else url + "/"


async def read_tensor_regions(
    src: SafetensorsSource,
    leaves: list[ForeignLeaf],
    requests: list[tuple[int, Region]],
    *,
    max_bytes_in_flight: int,
    stats: ReadStats,
) -> list[np.ndarray]:
    """Each ``(leaf index, region)`` as a C-order array, reading only its bytes
    (files on a local disk: :mod:`~tensorstore_py.checkpoint.safetensors_local`)."""
    if isinstance(src.kv, FileKvStore):
        return await run_io(_read_local, src, leaves, requests, stats)
    out: list[np.ndarray | None] = [None] * len(requests)

    def cost(k: int) -> int:
        leaf = leaves[requests[k][0]]
        return math.prod(region_shape(requests[k][1])) * leaf.dtype.itemsize

    async def one(k: int) -> None:
        i, region = requests[k]
        key, e = src.tensors[leaves[i].name]
        dt, shape = e.dtype, e.shape
        rshape = region_shape(region)
        stats.bytes_needed += cost(k)
        if math.prod(rshape) == 0:
            out[k] = np.empty(rshape, dt)
            return
        parts = pieces(region, shape, dt.itemsize) if shape else [region]
        spans = [span_in_chunk(p, (0,) * len(shape), shape, dt.itemsize) if shape else (0, dt.itemsize)
                 for p in parts]
        # merge neighbouring pieces only while the gaps read stay within the 10% slack
        gap = int(cost(k) * (_SLACK - 1) / len(spans)) if len(spans) > 1 else 0
        res = await src.kv.read_ranges(key, [ByteRange(e.start + a, e.start + b) for a, b in spans],
                                       coalesce_gap=gap)
        if res.state != "value":
            raise NotFoundError(f"{src.where}: safetensors file {key!r} disappeared while reading")
        stats.requests += 1
        strides = tuple(s * dt.itemsize for s in c_strides(shape))
        dst = mapped_empty(rshape, dt) if len(parts) > 1 else None
        for p, (a, b), buf in zip(parts, spans, res.values):
            if len(buf) != b - a:
                raise DataCorruptionError(
                    f"{src.where}/{key}: tensor {e.name!r} cut short (read {len(buf)} bytes of {b - a})"
                )
            stats.bytes_read += len(buf)
            view = np.ndarray(region_shape(p), dtype=dt, buffer=buf, strides=strides)
            if dst is None:
                out[k] = view
            else:
                dst[tuple(slice(x - r0, y - r0) for (x, y), (r0, _) in zip(p, region))] = view
        if dst is not None:
            out[k] = dst

    await run_bounded(range(len(requests)), one, budget=ByteBudget(max_bytes_in_flight), cost=cost)
    return out  # type: ignore[return-value]


def _read_local(src: SafetensorsSource, leaves: list[ForeignLeaf], requests: list[tuple[int, Region]],
                stats: ReadStats) -> list[np.ndarray]:
    blocks = []
    for i, region in requests:
        key, e = src.tensors[leaves[i].name]
        out = mapped_empty(region_shape(region), e.dtype)  # page-aligned: device_put on CPU aliases it
        stats.bytes_needed += out.nbytes
        blocks.append(LocalBlock(src.kv._full(key), e, region, out))
    read_local_blocks(blocks, where=src.where, stats=stats)
    return [b.out for b in blocks]


def restore_safetensors(
    source: SourceLike,
    *,
    target: Any = None,
    key_map: KeyMap | None = None,
    cast: bool = False,
    max_bytes_in_flight: int = 512 << 20,
    stats: ReadStats | None = None,
) -> Any:
    """Restore a safetensors file (URL ending ``.safetensors``) or a Hugging Face
    folder (``model.safetensors.index.json`` or ``model.safetensors``) on any store.

    ``target=None`` returns ``{name: numpy array}`` (what
    ``safetensors.numpy.load_file`` returns). Otherwise every target leaf is
    matched by its dotted name (``{"model": {"embed": ...}}`` -> ``"model.embed"``;
    a flat dict's keys are the names), passed through ``key_map`` when given;
    names, shapes and dtypes are checked for every leaf before any tensor byte is
    read (NotFoundError / InvalidArgumentError name the file and tensor; dtypes
    convert only with ``cast=True``). ``jax.Array``/``ShapeDtypeStruct`` leaves
    come back with the target's sharding, each process reading only the bytes of
    its own devices' blocks. Read-only; nothing is retried beyond the store's own
    retries. ``stats`` counts tensor bytes read and needed (headers not counted).
    """
    src = run_sync(open_safetensors(source))
    leaves = src.leaves()
    index = {leaf.name: i for i, leaf in enumerate(leaves)}
    st = stats if stats is not None else ReadStats()

    def lookup(path: str) -> int | None:
        name = dotted_name(path)
        if callable(key_map):
            name = key_map(name)
        elif key_map is not None:
            name = key_map.get(name, name)
        return index.get(name)

    def read(requests: list[tuple[int, Region]]) -> list[np.ndarray]:
        if isinstance(src.kv, FileKvStore):
            return _read_local(src, leaves, requests, st)
        return run_sync(read_tensor_regions(src, leaves, requests, max_bytes_in_flight=max_bytes_in_flight, stats=st))

    def build(arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
        return {leaf.name: _writable(a) for leaf, a in zip(leaves, arrays)}

    return restore_foreign(f"safetensors {src.where}", leaves, read, target, lookup=lookup, build=build, cast=cast)


def _writable(a: np.ndarray) -> np.ndarray:
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    return a if a.flags.writeable else a.copy()
