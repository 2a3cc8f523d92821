"""``ls`` and ``verify`` of a checkpoint with a local tier (``--local URL``).

The local tier of a manager (checkpoint/tiers.py) is one checkpoint root per
process: the URL itself for a one-process job, ``process_<i>/`` under it for
several. ``ls`` lists each step once with the tiers holding it: ``local`` when
every process's part is there (``local i/n`` when only some are), ``persistent``
when the root holds it. ``verify`` checks the root and every local part;
``gc --local`` collects the root and each of :func:`local_parts` (``cli.py``).
"""

from __future__ import annotations

import json
from typing import Any

from tensorstore_py.checkpoint.storage import StepStore, list_steps, step_dir
from tensorstore_py.checkpoint.tiers import PART_KEY
from tensorstore_py.commands import checks, inspect
from tensorstore_py.commands.problems import VerifyReport
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.progress import Progress

__all__ = ["local_parts", "ls_tiers", "verify_tiers"]


def _join(url: str, sub: str) -> str:
    return url.rstrip("/") + "/" + sub


async def _open(url: str) -> KvStore:
    """The store of a root URL or path (a folder: with its trailing slash)."""
    return await KvStore.open(url if url.endswith("/") else url + "/")


async def local_parts(local: str) -> list[str]:
    """The URLs of the local parts' roots under ``local`` (itself, or ``process_<i>/``)."""
    kv = await _open(local)
    # both: a one-process job's part root and, below it, a multi-process job's
    # (a job run again with another process count keeps its old parts)
    own = [local] if await list_steps(StepStore(kv).kv) else []
    listing = await kv.list_folder("")
    found = [k.rstrip("/") for k in listing.folders if k.rstrip("/").startswith("process_")]
    found.sort(key=lambda name: int(name.split("_", 1)[1]) if name.split("_", 1)[1].isdigit() else -1)
    return own + [_join(local, name) + "/" for name in found]


async def _part_steps(url: str) -> dict[int, int]:
    """step -> the process count its part says (1 for a whole one-process step)."""
    store = StepStore(await _open(url))
    snap = await store.snapshot()
    out = {}
    for s in await store.list_steps(snap):
        r = await snap.read(f"{step_dir(s)}/{PART_KEY}")
        out[s] = int(json.loads(bytes(r.value)).get("process_count", 1)) if r.state == "value" else 1
    return out


async def ls_tiers(url: str, local: str) -> dict[str, Any]:
    """``ls`` of the root, each step row with ``tiers`` (and ``local_parts``: parts
    found / processes), plus the steps found only in the local tier."""
    out = await inspect.ls(url)
    rows = {r["step"]: r for r in out.get("steps", [])}
    for r in rows.values():
        r["tiers"] = ["persistent"]
    parts = await local_parts(local)
    held: dict[int, list[int]] = {}
    first: dict[int, str] = {}  # step -> a part holding it (for its record)
    for p in parts:
        for s, n in (await _part_steps(p)).items():
            held.setdefault(s, []).append(n)
            first.setdefault(s, p)
    for s, counts in held.items():
        # complete for a job of n processes when n parts of that layout are there
        complete = [c for c in set(counts) if counts.count(c) >= c]
        n = max(complete or counts)
        row = rows.get(s)
        if row is None:
            info = await StepStore(await _open(first[s])).record(s)
            row = rows[s] = {"step": s, "time": info.time, "nbytes": info.nbytes, "version": None,
                             "write_id": None, "message": None, "metrics": info.metrics,
                             "process_count": n, "readable_version": None, "retired": False, "tiers": []}
        row["local_parts"] = [counts.count(n), n]
        row["local_process_count"] = n
        row["tiers"] = (["local"] if complete else [f"local {counts.count(n)}/{n}"]) + row["tiers"]
    out["steps"] = [rows[s] for s in sorted(rows)]
    out["local"] = local
    out["local_roots"] = parts
    out["local_notes"] = _layout_notes(held)
    return out


def _layout_notes(held: dict[int, list[int]]) -> list[str]:
    """A note when the local tier holds parts of jobs of different process counts:
    a manager restores, promotes and retains only the parts of its own."""
    by_count: dict[int, list[int]] = {}
    for s, counts in held.items():
        for n in set(counts):
            by_count.setdefault(n, []).append(s)
    if len(by_count) < 2:
        return []
    return [f"steps {sorted(steps)}: local parts of a job of {n} process(es)" for n, steps in sorted(by_count.items())] + [
        "a manager restores, promotes and retains only the local parts of its own process count"
    ]


async def verify_tiers(
    url: str, local: str, *, step: int | None = None, progress: Progress | None = None
) -> list[VerifyReport]:
    """``verify`` of the root and of every local part (a part's absent regions,
    held by other processes, are not problems)."""
    reports = [await checks.verify(url, step=step, progress=progress)]
    for p in await local_parts(local):
        steps = await _part_steps(p)
        if step is not None and step not in steps:
            continue
        reports.append(await checks.verify(p, step=step, progress=progress))
    return reports
