"""Saved array leaves as TensorStore views (what ``open_array`` and the CLI read).

A step's manifest lists every leaf; an *array* leaf has a ``key`` (its folder in
the step) and its layout. Leaves of at least ``SaveOptions.zarr_metadata_min_bytes``
carry a ``zarr.json`` and open as any zarr v3 array; smaller ones are described
by the manifest alone, and their zarr v3 metadata is rebuilt from it (raw
little-endian chunks, default key encoding: layout.py). A leaf packed with others
(``"packed"``: packing.py) is read from its pack when opened (it is small: less
than ``packing.PACK_LEAF_BYTES``), checked against its crc32c, and served from
memory as a read-only zarr v3 array of one chunk.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from tensorstore_py.checkpoint.layout import LeafLayout, zarr3_metadata
from tensorstore_py.checkpoint.packing import check_leaf
from tensorstore_py.core.errors import DataCorruptionError
from tensorstore_py.drivers.dtypes import dtype_from_v3
from tensorstore_py.drivers.zarr3 import Zarr3Array
from tensorstore_py.kvstore.base import ByteRange, Generation, KvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.opening import open as ts_open
from tensorstore_py.tensorstore import TensorStore

__all__ = ["array_leaves", "open_leaf", "packed_chunk", "read_pack_leaves", "read_packed"]


def array_leaves(manifest: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The manifest entries of the leaves stored as arrays (python scalars live in
    the manifest itself)."""
    return [leaf for leaf in manifest["leaves"] if isinstance(leaf, dict) and "key" in leaf]


async def open_leaf(kv: KvStore, leaf: Mapping[str, Any]) -> TensorStore:
    """Open the array leaf stored at ``kv`` (a step's leaf folder) as a TensorStore.

    Raises :class:`DataCorruptionError` when a leaf without ``zarr.json`` has a
    malformed manifest entry.
    """
    if (await kv.read("zarr.json")).state == "value":
        return await ts_open({"driver": "zarr3", "kvstore": kv})
    try:
        meta = zarr3_metadata(
            dtype_from_v3(leaf["dtype"]),
            tuple(int(n) for n in leaf["shape"]),
            tuple(int(n) for n in leaf["chunk_shape"]),
            list(leaf.get("codecs") or ()),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise DataCorruptionError(
            f"checkpoint leaf {leaf.get('path')!r}: malformed manifest entry: {e}"
        ) from None
    if leaf.get("packed") is not None:
        return await _open_packed(kv, leaf, meta)
    return TensorStore(Zarr3Array.from_metadata(meta, kv, Generation.NO_VALUE))


def packed_chunk(leaf: Mapping[str, Any]) -> str:
    """The zarr v3 key, in its leaf folder, of a packed leaf's one chunk (``c/0/0``)."""
    return "c" + "/0" * len(leaf["shape"])


async def read_packed(step: KvStore, leaf: Mapping[str, Any]) -> bytes:
    """The stored bytes of the packed leaf ``leaf`` (its one chunk), read from its
    pack in ``step`` (a view of the step's keys) and checked against its crc32c.
    Raises :class:`DataCorruptionError` naming the leaf and the pack."""
    layout = LeafLayout.from_json(dict(leaf))  # DataCorruptionError for a malformed "packed"
    if layout.packed is None:
        raise DataCorruptionError(f"checkpoint leaf {leaf.get('path')!r} is not packed")
    pack, offset, _crc = layout.packed
    res = await step.read(pack, byte_range=ByteRange(offset, offset + layout.nbytes))
    if res.state != "value" or len(res.value) != layout.nbytes:
        raise DataCorruptionError(
            f"checkpoint leaf {leaf.get('path')!r}: its pack {step.path + pack!r} at {step!r} is "
            f"missing or short (expected {layout.nbytes} bytes at offset {offset})"
        )
    check_leaf(layout.packed, layout.key, res.value)
    return bytes(res.value)


async def read_pack_leaves(step: KvStore, leaves: Sequence[Mapping[str, Any]], *,
                           check: bool = True) -> list[bytes]:
    """The stored bytes of the packed leaves ``leaves``, all in ONE pack of ``step``
    (a view of the step's keys), read with ONE read of the byte range they span
    and each checked against its crc32c (in the order given; ``check=False``
    leaves that to the caller: :func:`packing.check_leaf`).

    Raises :class:`DataCorruptionError` naming the leaf and the pack when the
    pack is missing or short, :class:`ChecksumError` (one of them) naming the
    first leaf whose bytes do not match."""
    if not leaves:
        return []
    try:
        layouts = [LeafLayout.from_json(dict(leaf)) for leaf in leaves]  # malformed "packed": DataCorruptionError
    except (KeyError, TypeError, ValueError) as e:
        raise DataCorruptionError(f"checkpoint leaves of a pack: malformed manifest entry: {e}") from None
    packs = {lay.packed[0] if lay.packed is not None else None for lay in layouts}
    if len(packs) != 1 or None in packs:
        raise ValueError(f"read_pack_leaves: leaves of one pack expected, got packs {sorted(map(str, packs))}")
    pack = str(packs.pop())
    lo = min(lay.packed[1] for lay in layouts)  # type: ignore[index]
    hi = max(lay.packed[1] + lay.nbytes for lay in layouts)  # type: ignore[index]
    res = await step.read(pack, byte_range=ByteRange(lo, hi))
    if res.state != "value" or len(res.value) != hi - lo:
        got = "missing" if res.state != "value" else f"{len(res.value)} bytes"
        raise DataCorruptionError(
            f"checkpoint leaf {leaves[0].get('path')!r}: its pack {step.path + pack!r} at {step!r} is "
            f"missing or short (expected {hi - lo} bytes at offset {lo}, found {got})"
        )
    mv = memoryview(res.value).cast("B")
    out = []
    for lay in layouts:
        assert lay.packed is not None
        part = mv[lay.packed[1] - lo: lay.packed[1] - lo + lay.nbytes]
        if check:
            check_leaf(lay.packed, lay.key, part)
        out.append(bytes(part))
    return out


async def _open_packed(kv: KvStore, leaf: Mapping[str, Any], meta: dict[str, Any]) -> TensorStore:
    """The packed leaf whose folder view is ``kv``, read from its pack (a key of
    the step, above the leaf's folder) into a read-only one-chunk array."""
    step = copy.copy(kv)
    step.path = kv.path.removesuffix(str(leaf["key"]).strip("/") + "/")
    # frozen: the view pickles with its bytes (at most PACK_LEAF_BYTES), so Dask's
    # process and distributed schedulers read it too
    mem = MemoryKvStore.frozen({packed_chunk(leaf): await read_packed(step, leaf)})
    return TensorStore(Zarr3Array.from_metadata(meta, mem, Generation.NO_VALUE))
