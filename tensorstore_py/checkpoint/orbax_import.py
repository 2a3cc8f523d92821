"""Read-only restore of Orbax checkpoints (orbax-checkpoint's default layout).

An Orbax step folder holds ``_CHECKPOINT_METADATA`` (which handler wrote each
item) and one folder per item (``default`` for a single item), or the item itself
(``StandardCheckpointer``/``PyTreeCheckpointer``). An item holds ``_METADATA``
(the tree: each leaf's key path and value type) and an OCDBT key-value store
(``manifest.ocdbt``, ``d/``, ``ocdbt.process_N/`` for each writing process) whose
keys ``<param name>/...`` hold one zarr v2 (or zarr v3) array per leaf.

The tree metadata is read through tensorstore_py's own stores; the OCDBT store and
its zarr arrays are read with TensorStore (``pip install tensorstore``), the
reference reader of that format: orbax-checkpoint itself depends on it, so every
user with Orbax checkpoints already has it, with wheels for Linux, macOS and
Windows (x86-64 and arm64), and its C++ reader decodes and reads concurrently
without the GIL. A native OCDBT reader would duplicate a B-tree format that
Orbax's writer (TensorStore) may evolve; the price is that the array bytes are
read by TensorStore's own file/gs/s3/http drivers, not by a tensorstore_py store
(a ``memory://`` root, a fault-injecting wrapper or tensorstore_py credentials do
not apply to them: such a root raises UnsupportedError).

Each target leaf is read only where this process's devices need it (TensorStore
reads only the chunks overlapping each block). Leaves written by a custom type
handler, and items of handlers other than the standard and pytree ones, raise
UnsupportedError naming them.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.foreign import ForeignLeaf, dotted_name, restore_foreign
from tensorstore_py.checkpoint.layout import Region, region_shape
from tensorstore_py.checkpoint.restoring import ReadStats
from tensorstore_py.core.errors import DataCorruptionError, NotFoundError, UnsupportedError
from tensorstore_py.kvstore.base import KvStore

__all__ = ["OrbaxItem", "OrbaxStep", "list_orbax_steps", "open_orbax_step", "restore_orbax"]

CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
TREE_METADATA = "_METADATA"
_SUPPORTED_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler")
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
# a new empty value for each leaf: a restored tree owns its lists and dicts
_EMPTY_TYPES: dict[str, Callable[[], object]] = {
    "None": lambda: None, "Dict": dict, "List": list, "Tuple": tuple}


@dataclass
class OrbaxLeaf:
    keys: tuple[Any, ...]  # dict keys (str) and sequence indices (int)
    value_type: str

    @property
    def path(self) -> str:
        return "".join(f"[{k}]" if isinstance(k, int) else f"[{k!r}]" for k in self.keys)

    @property
    def name(self) -> str:
        return ".".join(str(k) for k in self.keys)


@dataclass
class OrbaxItem:
    """One item of a step: its tree metadata and where its OCDBT store is."""

    where: str
    kv: KvStore
    leaves: list[OrbaxLeaf]
    zarr3: bool


@dataclass
class OrbaxStep:
    where: str
    items: dict[str, OrbaxItem]  # "" for an item written at the step folder itself
    metadata: dict[str, Any]


async def _json(kv: KvStore, key: str, where: str) -> Any:
    r = await kv.read(key)
    if r.state != "value":
        return None
    try:
        return json.loads(bytes(r.value))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataCorruptionError(f"{where}/{key}: not JSON: {e}") from None


def _short(handler: Any) -> str:
    return str(handler).rsplit(".", 1)[-1]


async def _item(kv: KvStore, where: str) -> OrbaxItem:
    meta = await _json(kv, TREE_METADATA, where)
    if meta is None:
        raise NotFoundError(f"{where}: no Orbax tree metadata ({TREE_METADATA})")
    tree = meta.get("tree_metadata")
    if not isinstance(tree, dict):
        raise DataCorruptionError(f"{where}/{TREE_METADATA}: no 'tree_metadata' object")
    if not meta.get("use_ocdbt", True):
        raise UnsupportedError(
            f"{where}: an Orbax checkpoint written without OCDBT (use_ocdbt=False); only Orbax's "
            "default OCDBT layout is read"
        )
    leaves = []
    for entry in tree.values():
        keys: list[Any] = []
        for k in entry.get("key_metadata", []):
            keys.append(int(k["key"]) if k.get("key_type") == 1 else str(k["key"]))
        vt = (entry.get("value_metadata") or {}).get("value_type", "")
        if entry.get("value_metadata", {}).get("skip_deserialize"):
            vt = "None"
        if vt not in _ARRAY_TYPES and vt not in _EMPTY_TYPES:
            raise UnsupportedError(
                f"{where}: leaf {'.'.join(map(str, keys))} was written by a custom Orbax type "
                f"handler (value_type {vt!r}); only arrays, numpy and Python scalars are read"
            )
        leaves.append(OrbaxLeaf(tuple(keys), vt))
    return OrbaxItem(where, kv, leaves, bool(meta.get("use_zarr3", False)))


async def open_orbax_step(kv: KvStore, where: str | None = None) -> OrbaxStep | None:
    """The Orbax step (or lone item) at ``kv``, or None when it is not one."""
    where = where or repr(kv)
    ckpt, tree = await asyncio.gather(_json(kv, CHECKPOINT_METADATA, where), _json(kv, TREE_METADATA, where))
    if ckpt is None and tree is None:
        return None
    ckpt = ckpt or {}
    if tree is not None:
        return OrbaxStep(where, {"": await _item(kv, where)}, ckpt)
    handlers = ckpt.get("item_handlers")
    if not isinstance(handlers, dict) or not handlers:
        raise UnsupportedError(f"{where}: an Orbax step without item handlers in {CHECKPOINT_METADATA}")
    items = {}
    for name, handler in sorted(handlers.items()):
        if _short(handler) not in _SUPPORTED_HANDLERS:
            raise UnsupportedError(
                f"{where}: item {name!r} was written by {_short(handler)}; only items of "
                f"{' and '.join(_SUPPORTED_HANDLERS)} (pytrees of arrays) are read"
            )
        items[name] = await _item(kv.with_path(name + "/"), f"{where}/{name}")
    return OrbaxStep(where, items, ckpt)


async def list_orbax_steps(kv: KvStore) -> list[int]:
    """The steps of an Orbax run folder (``<step>/_CHECKPOINT_METADATA``), ascending."""
    try:
        keys = await kv.list()
    except UnsupportedError:
        return []
    steps = set()
    for key in keys:
        head, _, rest = key.partition("/")
        if rest == CHECKPOINT_METADATA and head.isdigit():
            steps.add(int(head))
    return sorted(steps)


# -- reading arrays (TensorStore) -------------------------------------------------
def _tensorstore() -> Any:
    try:
        import tensorstore  # optional: the reader of Orbax's OCDBT store
    except ImportError as e:
        raise UnsupportedError(
            "reading an Orbax checkpoint needs TensorStore (pip install tensorstore_py[orbax])"
        ) from e
    return tensorstore


def _ts_kvstore(kv: KvStore, where: str) -> Any:
    spec = kv.spec()
    drv = spec.get("driver")
    if drv == "file":
        return {"driver": "file", "path": spec.get("path", "")}
    if drv == "s3":
        out = {"driver": "s3", "bucket": spec["bucket"], "path": spec.get("path", "")}
        if spec.get("endpoint_url"):
            out["endpoint"] = spec["endpoint_url"]
        if spec.get("region"):
            out["aws_region"] = spec["region"]
        return out
    if drv == "gcs" and not spec.get("endpoint"):
        return {"driver": "gcs", "bucket": spec["bucket"], "path": spec.get("path", "")}
    if drv == "http":
        return {"driver": "http", "base_url": spec["base_url"], "path": spec.get("path", "")}
    raise UnsupportedError(
        f"{where}: Orbax arrays are read with TensorStore, which reads file, gs, s3 and http "
        f"locations; this one is a {drv!r} store ({spec})"
    )


def _read_arrays(item: OrbaxItem, leaves: list[ForeignLeaf], requests: list[tuple[int, Region]],
                 opened: list[Any], max_bytes_in_flight: int, stats: ReadStats) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    i = 0
    while i < len(requests):
        wave: list[Any] = []  # TensorStore's read futures
        acc = 0
        while i < len(requests) and (not wave or acc < max_bytes_in_flight):
            k, region = requests[i]
            acc += math.prod(region_shape(region)) * leaves[k].dtype.itemsize
            wave.append(opened[k][tuple(slice(a, b) for a, b in region)].read())
            i += 1
        for fut in wave:
            a = np.asarray(fut.result())
            stats.bytes_needed += a.nbytes
            stats.requests += 1
            out.append(a)
    return out


def restore_orbax(
    step: OrbaxStep,
    target: Any = None,
    *,
    cast: bool = False,
    max_bytes_in_flight: int = 512 << 20,
    stats: ReadStats | None = None,
) -> Any:
    """Restore an Orbax step; see :func:`tensorstore_py.checkpoint.restore`.

    A step of one item (``default``, or an item written at the step folder) gives
    that item's tree; a step of several items gives ``{item name: tree}``. Without
    a target, array leaves come back as numpy arrays and Orbax scalars as Python
    numbers; with one, the target's structure, shapes, dtypes and shardings.
    Read-only.
    """
    ts = _tensorstore()
    st = stats if stats is not None else ReadStats()
    ctx = ts.Context({"cache_pool": {"total_bytes_limit": 64 << 20}})
    names = list(step.items)
    if len(names) == 1 or names == ["default"]:
        return _restore_item(ts, ctx, step.items[names[0]], target, cast, max_bytes_in_flight, st)
    if target is not None and not (isinstance(target, dict) and set(target) <= set(names)):
        raise NotFoundError(
            f"{step.where}: a step of items {names}; give a target of the form {{item: tree}}"
        )
    return {
        n: _restore_item(ts, ctx, step.items[n], None if target is None else target[n], cast, max_bytes_in_flight, st)
        for n in names if target is None or n in target
    }


def open_arrays(item: OrbaxItem, ctx: Any = None) -> list[tuple[OrbaxLeaf, Any]]:
    """The array leaves of ``item`` opened (concurrently) as read-only TensorStore arrays."""
    ts = _tensorstore()
    ctx = ctx if ctx is not None else ts.Context({"cache_pool": {"total_bytes_limit": 64 << 20}})
    base = _ts_kvstore(item.kv, item.where)
    arrays = [leaf for leaf in item.leaves if leaf.value_type in _ARRAY_TYPES]
    futs = [
        ts.open({
            "driver": "zarr3" if item.zarr3 else "zarr",
            "kvstore": {"driver": "ocdbt", "base": base, "path": leaf.name + "/"},
            "open": True,
        }, read=True, context=ctx)
        for leaf in arrays
    ]
    opened = []
    for leaf, fut in zip(arrays, futs):
        try:
            opened.append((leaf, fut.result()))
        except Exception as e:  # TensorStore raises ValueError for a missing or bad array
            raise DataCorruptionError(f"{item.where}: array {leaf.name!r} can not be opened: {e}") from None
    return opened


def _restore_item(ts: Any, ctx: Any, item: OrbaxItem, target: Any, cast: bool,
                  max_bytes_in_flight: int, stats: ReadStats) -> Any:
    base = _ts_kvstore(item.kv, item.where)
    counter = f"/tensorstore/kvstore/{base['driver']}/bytes_read"
    before = _metric(ts, counter)  # OCDBT manifests, B-tree nodes and array metadata count too
    pairs = open_arrays(item, ctx)
    arrays = [leaf for leaf, _a in pairs]
    opened = [a for _leaf, a in pairs]
    leaves = [ForeignLeaf(leaf.name, tuple(a.shape), np.dtype(a.dtype.numpy_dtype)) for leaf, a in zip(arrays, opened)]
    by_path = {leaf.path: i for i, leaf in enumerate(arrays)}
    by_name = {leaf.name: i for i, leaf in enumerate(arrays)}

    def lookup(path: str) -> int | None:
        i = by_path.get(path)
        return i if i is not None else by_name.get(dotted_name(path))

    def read(requests: list[tuple[int, Region]]) -> list[np.ndarray]:
        return _read_arrays(item, leaves, requests, opened, max_bytes_in_flight, stats)

    def build(values: list[np.ndarray]) -> Any:
        it = iter(values)
        pairs: list[tuple[tuple[Any, ...], object]] = []
        for leaf in item.leaves:
            if leaf.value_type in _EMPTY_TYPES:
                pairs.append((leaf.keys, _EMPTY_TYPES[leaf.value_type]()))
            else:
                a = next(it)
                pairs.append((leaf.keys, a.item() if leaf.value_type == "scalar" else a))
        return _tree(pairs)

    out = restore_foreign(f"Orbax checkpoint {item.where}", leaves, read, target, lookup=lookup,
                          build=build, cast=cast)
    stats.bytes_read += _metric(ts, counter) - before
    return out


def _metric(ts: Any, name: str) -> int:
    """TensorStore's process-wide counter ``name`` (bytes its driver read, B-tree nodes
    included; other TensorStore reads in this process at the same time count too)."""
    for m in ts.experimental_collect_matching_metrics(name):
        if m.get("name") == name:
            return int(sum(v.get("value", 0) for v in m.get("values", [])))
    return 0


def _tree(pairs: Sequence[tuple[tuple[Any, ...], Any]]) -> Any:
    """Nested dicts (and lists for sequence keys) from ``(key path, value)`` pairs."""
    if len(pairs) == 1 and not pairs[0][0]:
        return pairs[0][1]
    root: dict[Any, Any] = {}
    for keys, value in pairs:
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out
