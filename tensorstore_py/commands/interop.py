"""Commands between tensorstore_py checkpoints and other tools' formats:
``export --format safetensors`` and ``convert`` (an Orbax run into a checkpoint)."""

from __future__ import annotations

import json
import os
from typing import Any

from tensorstore_py.checkpoint.api import open_root, save
from tensorstore_py.checkpoint.orbax_import import (
    CHECKPOINT_METADATA,
    OrbaxItem,
    OrbaxStep,
    list_orbax_steps,
    open_arrays,
    open_orbax_step,
    restore_orbax,
)
from tensorstore_py.checkpoint.safetensors_export import export_safetensors
from tensorstore_py.checkpoint.storage import StepStore
from tensorstore_py.commands.export import _norm_path, parse_index
from tensorstore_py.commands.target import _FIRST_COMMIT
from tensorstore_py.core.errors import InvalidArgumentError, NotFoundError
from tensorstore_py.core.pools import run_io
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.versioned.root import read_hint

__all__ = ["convert", "export_to_safetensors", "orbax_cat", "orbax_info", "orbax_ls"]


def _dir(url: str, *, create: bool = False) -> str:
    if "://" not in url:
        if create:
            os.makedirs(url, exist_ok=True)
        url = "file://" + os.path.abspath(url)
    return url if url.endswith("/") else url + "/"


async def export_to_safetensors(root: str, step: int | None, dest: str, *, max_shard_bytes: int) -> dict[str, Any]:
    """``export --format safetensors``: see :func:`export_safetensors`."""
    store = StepStore(await run_io(open_root, _dir(root) if "://" not in root else root))
    out = await KvStore.open(_dir(dest, create=True))
    data = await export_safetensors(store, step, out, max_shard_bytes=max_shard_bytes)
    return {"root": root, "dest": dest, **data}


async def convert(src: str, dest: str) -> dict[str, Any]:
    """Turn the Orbax run folder ``src`` (or one Orbax step folder) into a tensorstore_py
    checkpoint root ``dest``: one atomic commit per step, oldest first. Steps that
    ``dest`` already holds are skipped, so an interrupted conversion resumes.
    Memory: one step at a time."""
    base = await KvStore.open(_dir(src))
    steps = await list_orbax_steps(base)
    single = None
    if not steps:
        single = await open_orbax_step(base, src)
        if single is None:
            raise NotFoundError(f"convert: {src} is neither an Orbax run folder (<step>/_CHECKPOINT_METADATA) "
                                "nor an Orbax step")
    out_root = _dir(dest, create=True)
    have = set(await StepStore(await run_io(open_root, out_root)).list_steps())
    done, skipped = [], []
    for s in steps or [0]:
        if s in have:
            skipped.append(s)
            continue
        step = single or await open_orbax_step(base.with_path(f"{s}/"), f"{src.rstrip('/')}/{s}")
        if step is None:
            raise InvalidArgumentError(f"convert: {src}/{s} is not an Orbax step")
        tree = await run_io(restore_orbax, step)
        await run_io(lambda t=tree, s=s: save(out_root, t, step=s).result())
        done.append(s)
    return {"src": src, "dest": dest, "converted": done, "skipped": skipped}


# -- ls / info / cat of Orbax folders -------------------------------------------------
async def _orbax(url: str, step: int | None) -> tuple[KvStore, list[int], OrbaxStep | None]:
    """(folder, the run's steps, the step asked for: ``step``, the newest, or the folder itself)."""
    base = await KvStore.open(_dir(url))
    if (await base.read(_FIRST_COMMIT)).state == "value" or await read_hint(base) > 0:
        return base, [], None  # a versioned store (a checkpoint root): not Orbax, never listed here
    steps = await list_orbax_steps(base)
    if steps and step is not None and step not in steps:
        raise NotFoundError(f"{url}: no Orbax step {step}; steps: {steps}")
    if steps:
        s = step if step is not None else steps[-1]
        return base, steps, await open_orbax_step(base.with_path(f"{s}/"), f"{url.rstrip('/')}/{s}")
    return base, steps, await open_orbax_step(base, url)


async def _step_row(base: KvStore, s: int) -> dict[str, Any]:
    r = await base.read(f"{s}/{CHECKPOINT_METADATA}")
    meta = json.loads(bytes(r.value)) if r.state == "value" else {}
    ns = meta.get("commit_timestamp_nsecs") or meta.get("init_timestamp_nsecs")
    return {"step": s, "time": ns / 1e9 if ns else None, "items": sorted(meta.get("item_handlers") or {}),
            "metrics": meta.get("metrics") or {}}


async def orbax_ls(url: str) -> dict[str, Any] | None:
    """An Orbax run's steps, or an Orbax step's items; None when ``url`` is neither."""
    base, steps, found = await _orbax(url, None)
    if steps:
        return {"url": url, "kind": "orbax run", "version": None,
                "steps": [await _step_row(base, s) for s in steps]}
    if found is None:
        return None
    return {"url": url, "kind": "orbax step", "version": None, "items": sorted(found.items)}


def _rows(item: OrbaxItem, prefix: str) -> list[dict[str, Any]]:
    rows = []
    for leaf, a in open_arrays(item):
        spec = a.spec().to_json()
        meta = spec.get("metadata", {})
        codecs = [c.get("name") or c.get("id") for c in meta.get("codecs", [])] or \
            [c for c in [(meta.get("compressor") or {}).get("id")] if c]
        rows.append({
            "path": prefix + leaf.path, "name": leaf.name, "shape": list(a.shape),
            "dtype": str(a.dtype.numpy_dtype), "chunk_shape": list(a.chunk_layout.read_chunk.shape or []),
            "shard_shape": None, "codecs": codecs, "nbytes": int(a.size) * a.dtype.numpy_dtype.itemsize,
            "stored_bytes": None, "compression_ratio": None, "sharding": None,
        })
    return rows


async def orbax_info(url: str, step: int | None) -> dict[str, Any] | None:
    """The arrays of an Orbax step (``step``, or the newest of a run); None when ``url``
    is no Orbax folder."""
    base, steps, found = await _orbax(url, step)
    if found is None:
        return None
    rows: list[dict[str, Any]] = []
    for name, item in found.items.items():
        prefix = "" if len(found.items) == 1 else f"[{name!r}]"
        rows.extend(await run_io(_rows, item, prefix))
    return {"url": url, "kind": "orbax step", "version": None,
            "step": (step if step is not None else steps[-1]) if steps else None, "arrays": rows, "scalars": []}


async def orbax_cat(url: str, array: str, *, index: str | None, step: int | None) -> Any:
    """The values of one array of an Orbax step, by leaf path (``['params']['w']``,
    ``params/w`` or Orbax's ``params.w``)."""
    idx = parse_index(index) if index else ()
    _base, _steps, found = await _orbax(url, step)
    if found is None:
        return None
    want = _norm_path(array)
    for item in found.items.values():
        for leaf in item.leaves:
            if want in (_norm_path(leaf.path), _norm_path(leaf.name.replace(".", "/")), leaf.name):
                ((_leaf, arr),) = await run_io(open_arrays, OrbaxItem(item.where, item.kv, [leaf], item.zarr3))
                return await run_io(_read, arr[idx] if idx else arr)
    names = [leaf.name for item in found.items.values() for leaf in item.leaves]
    raise NotFoundError(f"{url}: no Orbax array {array!r}; arrays: {names[:20]}")


def _read(view: Any) -> Any:
    return view.read().result()
