"""Reading a checkpoint root's steps and manifests (layout: checkpoint/storage.py).

Only plain reads of the documented keys, so this works on any store that can
read, including ``http(s)://``:

    steps/<step:012d>                 step record (JSON)
    <step:012d>/manifest.json         tree structure + every leaf's layout
    <step:012d>/a/<i>/zarr.json ...   each array leaf is a zarr v3 array
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from tensorstore_py.checkpoint.leaves import array_leaves
from tensorstore_py.checkpoint.leaves import open_leaf as checkpoint_open_leaf
from tensorstore_py.checkpoint.storage import list_steps, record_key
from tensorstore_py.commands.target import Target, checkpoint_format_version, step_prefix
from tensorstore_py.core.errors import DataCorruptionError, NotFoundError, UnsupportedError
from tensorstore_py.kvstore.base import KvStore

__all__ = [
    "StepRow",
    "array_leaves",
    "list_steps",
    "pick_step",
    "read_manifest",
    "step_records",
    "step_versions",
]

#: checkpoint format versions this reader understands
_KNOWN_FORMAT = 1


@dataclass(frozen=True)
class StepRow:
    """One step as ``ls`` shows it."""

    step: int
    time: float
    nbytes: int
    metrics: dict[str, Any] = field(default_factory=dict)
    process_count: int = 1
    version: int | None = None
    write_id: str = ""
    message: str = ""


def _check_format(fmt: Any, where: str) -> None:
    n = checkpoint_format_version(fmt)
    if n is not None and n > _KNOWN_FORMAT:
        raise UnsupportedError(
            f"{where}: written with checkpoint format {fmt!r}, this tensorstore_py reads format "
            f"{_KNOWN_FORMAT}: upgrade tensorstore_py (pip install -U tensorstore_py)"
        )
    if n is None:
        raise DataCorruptionError(f"{where}: unknown checkpoint format {fmt!r}")


async def _json(store: KvStore, key: str, what: str) -> dict[str, Any] | None:
    res = await store.read(key)
    if res.state != "value":
        return None
    try:
        doc = json.loads(bytes(res.value))
    except ValueError as e:
        raise DataCorruptionError(f"{what} {key!r} is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise DataCorruptionError(f"{what} {key!r} is not a JSON object")
    return doc


async def step_versions(target: Target) -> dict[int, Any]:
    """step -> the VersionInfo of the commit that published it (newest wins)."""
    if target.head is None:
        return {}
    out: dict[int, Any] = {}
    for info in await target.head.versions():
        s = info.metadata.get("checkpoint_step") if isinstance(info.metadata, dict) else None
        if isinstance(s, int) and (target.version is None or info.version <= target.version):
            out[s] = info
    return out


async def step_records(target: Target) -> list[StepRow]:
    store = target.store
    steps = await list_steps(store)
    docs = await asyncio.gather(*(_json(store, record_key(s), "step record") for s in steps))
    versions = await step_versions(target)
    rows = []
    for s, doc in zip(steps, docs):
        if doc is None:
            continue
        _check_format(doc.get("format"), f"{target.url}: step {s} record")
        info = versions.get(s)
        rows.append(StepRow(
            step=s, time=float(doc.get("time") or 0.0), nbytes=int(doc.get("nbytes") or 0),
            metrics=dict(doc.get("metrics") or {}), process_count=int(doc.get("process_count") or 1),
            version=info.version if info else None, write_id=info.write_id if info else "",
            message=info.message if info else "",
        ))
    return rows


async def pick_step(target: Target, step: int | None) -> int:
    """``step`` if it exists, else NotFoundError listing the steps; None -> latest."""
    steps = await list_steps(target.store)
    if not steps:
        raise NotFoundError(f"{target.url}: the checkpoint has no steps")
    if step is None:
        return steps[-1]
    if step not in steps:
        shown = ", ".join(map(str, steps[-20:]))
        raise NotFoundError(f"{target.url}: step {step} not found; available steps: {shown}")
    return step


async def read_manifest(target: Target, step: int) -> dict[str, Any]:
    key = step_prefix(step) + "manifest.json"
    doc = await _json(target.store, key, "checkpoint manifest")
    if doc is None:
        raise DataCorruptionError(f"{target.url}: step {step}: manifest {key!r} is missing")
    _check_format(doc.get("format"), f"{target.url}: step {step} manifest")
    leaves = doc.get("leaves")
    if not isinstance(leaves, list):
        raise DataCorruptionError(f"{target.url}: step {step}: manifest has no 'leaves' list")
    return doc


async def open_leaf(kv: KvStore, leaf: dict[str, Any]) -> tuple[Any, bool]:
    """Open an array leaf stored at ``kv`` as a TensorStore; returns ``(ts, has_zarr_json)``."""
    has_json = (await kv.read("zarr.json")).state == "value"
    return await checkpoint_open_leaf(kv, leaf), has_json
