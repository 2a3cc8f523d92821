"""Finding the newest version: the ``latest`` hint and the probe of commit records.

Versions are dense (``commits/1`` .. ``commits/n``), so the newest is found by
probing which commit records exist (FORMAT.md §6.1). The ``latest`` hint only
shortens that probe: it may be missing, damaged or behind, never trusted alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

from tensorstore_py.core.errors import DataCorruptionError, StorageError
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.versioned.format import HINT_NAME, MAGIC_HINT, commit_name, frame, unframe

__all__ = ["probe_newest", "read_hint", "write_hint"]


async def write_hint(base: KvStore, version: int) -> None:
    """Rewrite the ``latest`` hint to name ``version``, if its commit record is
    still there: a trailing rewrite that fires after the store was deleted
    (and maybe recreated at the same place) writes nothing into it."""
    with contextlib.suppress(Exception):
        if version > 0 and (await base.read(commit_name(version))).state != "value":
            return
        await base.write(HINT_NAME, frame(MAGIC_HINT, {"version": version}))


async def read_hint(base: KvStore) -> int:
    """The version the ``latest`` hint names (0 when it is missing, damaged or unreadable)."""
    try:
        res = await base.read(HINT_NAME)
        if res.state != "value":
            return 0
        body = unframe(MAGIC_HINT, res.value, HINT_NAME)
        v = body.get("version") if isinstance(body, dict) else None
        return v if isinstance(v, int) and v > 0 else 0
    except (DataCorruptionError, StorageError):
        return 0  # the hint is only a hint


async def probe_newest(exists: Callable[[int], Awaitable[bool]], known: int, hint: int = 0) -> int:
    """The newest version, probing commit records as FORMAT.md §6.1 says.

    ``exists(v)`` tells whether ``commits/<v>`` exists (version 0 always does);
    ``known`` is a version known to exist and ``hint`` one that may (the
    ``latest`` hint). Versions are dense, so a galloping search upwards from
    the higher of the two, then a bisection, finds the newest in O(log n) probes.
    """
    lo = known
    if hint > lo and await exists(hint):
        lo = hint
    step = 1
    while await exists(lo + step):
        lo += step
        step *= 2
    hi = lo + step  # missing
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if await exists(mid):
            lo = mid
        else:
            hi = mid
    return lo
