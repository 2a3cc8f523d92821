"""Finding a foreign checkpoint where a tensorstore_py root was expected.

:func:`restore` and :class:`CheckpointManager` try the native layout first (no
extra request on the native path); when it holds no such step they look for, in
one round of concurrent reads: an Orbax step or item (``_CHECKPOINT_METADATA``,
``_METADATA``), a Hugging Face folder (``model.safetensors.index.json``,
``model.safetensors``); a URL ending ``.safetensors`` is read as a file at once.
An Orbax run folder (``<step>/_CHECKPOINT_METADATA``) is found by listing it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tensorstore_py.checkpoint.orbax_import import list_orbax_steps, open_orbax_step, restore_orbax
from tensorstore_py.checkpoint.restoring import ReadStats
from tensorstore_py.checkpoint.safetensors_format import INDEX_NAME, SINGLE_NAME
from tensorstore_py.checkpoint.safetensors_io import is_safetensors, restore_safetensors
from tensorstore_py.core.errors import NotFoundError
from tensorstore_py.core.future import run_sync
from tensorstore_py.core.ranges import ByteRange
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore

__all__ = ["base_of", "foreign_steps", "restore_foreign_root"]


def url_of(root: Any) -> str | None:
    return root if isinstance(root, str) else None


def base_of(kv: KvStore) -> KvStore:
    """The plain store under a root (the versioned adapter's base)."""
    return kv.base if isinstance(kv, VersionedKvStore) and kv.version is None else kv


async def _exists(kv: KvStore, key: str) -> bool:
    try:
        return (await kv.read(key, byte_range=ByteRange(0, 0))).state == "value"
    except NotFoundError:
        return False


async def foreign_steps(kv: KvStore) -> list[int]:
    """The steps of an Orbax run folder at ``kv`` (empty when it is not one)."""
    return await list_orbax_steps(base_of(kv))


def restore_foreign_root(
    root: Any,
    kv: KvStore | None,
    step: int | None,
    target: Any,
    *,
    cast: bool,
    max_bytes_in_flight: int,
    stats: ReadStats | None,
) -> tuple[bool, Any]:
    """``(True, tree)`` when ``root`` is a foreign checkpoint, else ``(False, None)``."""
    url = url_of(root)
    if url is not None and is_safetensors(url):
        return True, restore_safetensors(url, target=target, cast=cast,
                                         max_bytes_in_flight=max_bytes_in_flight, stats=stats)
    if kv is None:
        return False, None
    base = base_of(kv)
    where = url or repr(base)

    async def sniff() -> tuple[Any, bool]:
        here = base.with_path(f"{step}/") if step is not None else base
        found, index, single = await asyncio.gather(
            open_orbax_step(here, f"{where.rstrip('/')}/{step}" if step is not None else where),
            _exists(base, INDEX_NAME), _exists(base, SINGLE_NAME),
        )
        return found, index or single

    found, hf = run_sync(sniff())
    if found is None and step is None:
        steps = run_sync(list_orbax_steps(base))
        if steps:
            found = run_sync(open_orbax_step(base.with_path(f"{steps[-1]}/"), f"{where.rstrip('/')}/{steps[-1]}"))
    if found is not None:
        return True, restore_orbax(found, target, cast=cast, max_bytes_in_flight=max_bytes_in_flight, stats=stats)
    if hf and step is None:
        return True, restore_safetensors(base, target=target, cast=cast,
                                         max_bytes_in_flight=max_bytes_in_flight, stats=stats)
    return False, None

