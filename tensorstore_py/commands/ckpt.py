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
from tensorstore_py.checkpoint.storage import STEPS_PREFIX, list_steps, record_key
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
_KNOWN_FORMAT = 3  # manifests: 2 names compressed leaves (codecs), 3 packed ones; records are still 1
#: commit records read (newest first) to find the commit that published a step
#: whose version retention has retired
PUBLISHER_SCAN = 512


@dataclass(frozen=True)
class StepRow:
    """One step as ``ls`` shows it.

    ``version``, ``write_id``, ``message``: the commit that published the step
    (None / "" when it could not be found); ``retired``: retention has deleted
    that version since (the step is unchanged in the versions after it);
    ``readable_version``: the oldest retained version holding the step (what
    ``--at`` takes; the publishing version unless it was retired).
    ``bytes_added``: see the field.
    """

    step: int
    time: float
    nbytes: int
    metrics: dict[str, Any] = field(default_factory=dict)
    process_count: int = 1
    version: int | None = None
    write_id: str = ""
    message: str = ""
    readable_version: int | None = None
    retired: bool = False
    #: bytes of the step's values that no older listed step references: what the
    #: step added to storage (an incremental save links unchanged chunks); None
    #: where the store is not versioned
    bytes_added: int | None = None


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
    published = await step_versions(target)
    retired = [s for s in steps if s not in published]
    readable = await _readable_versions(target, retired)
    publishers = await _retired_publishers(target, readable)
    added = await _bytes_added(target, steps)
    rows = []
    for s, doc in zip(steps, docs):
        if doc is None:
            continue
        _check_format(doc.get("format"), f"{target.url}: step {s} record")
        info = published.get(s) or publishers.get(s)
        rows.append(StepRow(
            step=s, time=float(doc.get("time") or 0.0), nbytes=int(doc.get("nbytes") or 0),
            metrics=dict(doc.get("metrics") or {}), process_count=int(doc.get("process_count") or 1),
            version=info.version if info else None, write_id=info.write_id if info else "",
            message=info.message if info else "",
            readable_version=published[s].version if s in published else readable.get(s),
            retired=s not in published, bytes_added=added.get(s),
        ))
    return rows


async def _bytes_added(target: Target, steps: list[int]) -> dict[int, int]:
    """step -> bytes of its values (data object spans and inline values) that no
    older step of ``steps`` references (one index scan per step)."""
    head = target.head
    if head is None or not steps:
        return {}
    entries = await asyncio.gather(*(head.entries(step_prefix(s), version=target.version) for s in steps))
    seen: set[tuple[str, int, int]] = set()
    out: dict[int, int] = {}
    for s, infos in zip(steps, entries):
        n = 0
        mine = set()
        for e in infos:
            if e.object is None:
                n += e.size
                continue
            span = (e.object, e.offset, e.size)
            if span not in seen and span not in mine:
                n += e.size
                mine.add(span)
        seen |= mine
        out[s] = n
    return out


async def _readable_versions(target: Target, steps: list[int]) -> dict[int, int]:
    """step -> the oldest retained version holding it, for steps whose publishing
    version was retired (one index listing per retained version, oldest first,
    until every step is placed)."""
    head = target.head
    if head is None or not steps:
        return {}
    out: dict[int, int] = {}
    todo = set(steps)
    for info in await head.versions():
        if not todo or (target.version is not None and info.version > target.version):
            break
        for e in await head.entries(STEPS_PREFIX, version=info.version):
            name = e.key[len(STEPS_PREFIX):]
            if name.isdigit() and int(name) in todo:
                out[int(name)] = info.version
                todo.discard(int(name))
    return out


async def _retired_publishers(target: Target, readable: dict[int, int]) -> dict[int, Any]:
    """step -> the (retired) commit that published it: the newest commit below the
    step's readable version whose metadata names the step, looking at most
    :data:`PUBLISHER_SCAN` records back."""
    head = target.head
    if head is None or not readable:
        return {}
    out: dict[int, Any] = {}
    top = max(readable.values()) - 1
    stop = max(0, top - PUBLISHER_SCAN)
    batch = 32
    for hi in range(top, stop, -batch):
        versions = range(hi, max(stop, hi - batch), -1)
        for rec in await asyncio.gather(*(head.commit_details(v) for v in versions)):
            s = rec.metadata.get("checkpoint_step") if isinstance(rec.metadata, dict) else None
            if isinstance(s, int) and s in readable and s not in out and rec.version < readable[s]:
                out[s] = rec
        if len(out) == len(readable):
            break
    return out


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
