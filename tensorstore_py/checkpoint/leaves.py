"""Saved array leaves as TensorStore views (what ``open_array`` and the CLI read).

A step's manifest lists every leaf; an *array* leaf has a ``key`` (its folder in
the step) and its layout. Leaves of at least ``SaveOptions.zarr_metadata_min_bytes``
carry a ``zarr.json`` and open as any zarr v3 array; smaller ones are described
by the manifest alone, and their zarr v3 metadata is rebuilt from it (raw
little-endian chunks, default key encoding: layout.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tensorstore_py.checkpoint.layout import zarr3_metadata
from tensorstore_py.core.errors import DataCorruptionError
from tensorstore_py.drivers.dtypes import dtype_from_v3
from tensorstore_py.drivers.zarr3 import Zarr3Array
from tensorstore_py.kvstore.base import Generation, KvStore
from tensorstore_py.opening import open as ts_open
from tensorstore_py.tensorstore import TensorStore

__all__ = ["array_leaves", "open_leaf"]


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
    return TensorStore(Zarr3Array.from_metadata(meta, kv, Generation.NO_VALUE))
