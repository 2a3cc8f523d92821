"""Commands between tensorstore_py checkpoints and other tools' formats:
``export --format safetensors`` and ``convert`` (an Orbax run into a checkpoint)."""

from __future__ import annotations

import os
from typing import Any

from tensorstore_py.checkpoint.api import open_root, save
from tensorstore_py.checkpoint.orbax_import import list_orbax_steps, open_orbax_step, restore_orbax
from tensorstore_py.checkpoint.safetensors_export import export_safetensors
from tensorstore_py.checkpoint.storage import StepStore
from tensorstore_py.core.errors import InvalidArgumentError, NotFoundError
from tensorstore_py.core.pools import run_io
from tensorstore_py.kvstore.base import KvStore

__all__ = ["convert", "export_to_safetensors"]


def _dir(url: str) -> str:
    if "://" not in url:
        os.makedirs(url, exist_ok=True)
        url = "file://" + os.path.abspath(url)
    return url if url.endswith("/") else url + "/"


async def export_to_safetensors(root: str, step: int | None, dest: str, *, max_shard_bytes: int) -> dict[str, Any]:
    """``export --format safetensors``: see :func:`export_safetensors`."""
    store = StepStore(await run_io(open_root, _dir(root) if "://" not in root else root))
    out = await KvStore.open(_dir(dest))
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
    out_root = _dir(dest)
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
