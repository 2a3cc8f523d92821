"""Finding the newest version: the ``latest`` hint and the probe of commit records.

Versions are dense (``commits/1`` .. ``commits/n``), so the newest is found by
probing which commit records exist (FORMAT.md §6.1). The ``latest`` hint only
shortens that probe: it may be missing, damaged or behind, never trusted alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Awaitable, Callable

from tensorstore_py.core.errors import DataCorruptionError, StorageError
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.versioned.format import HINT_NAME, MAGIC_HINT, commit_name, frame, unframe

__all__ = ["HINT_INTERVAL", "HintWriter", "probe_newest", "read_hint", "write_hint"]

#: least seconds between two rewrites of the ``latest`` hint by one process
HINT_INTERVAL = 1.0


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
    A hint is checked together with the version above it: a hint that names
    the newest version (the usual case) costs one round trip.
    """
    lo = known
    if hint > lo:
        here, above = await asyncio.gather(exists(hint), exists(hint + 1))
        if here:
            if not above:
                return hint
            lo = hint + 1
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


class HintWriter:
    """Rewrites one store's ``latest`` hint in the background after commits, at
    most once per HINT_INTERVAL seconds (object stores rate-limit rewrites of
    one object). A commit inside the interval schedules one trailing rewrite,
    so the hint ends up naming the newest version this process committed
    (``verify`` uses that to notice a deleted newest record)."""

    def __init__(self, base: KvStore) -> None:
        self.base = base
        self._task: asyncio.Future[None] | None = None
        self._time = -HINT_INTERVAL
        self._later = False  # a rewrite is due when the interval has passed
        self._known = [0]  # what it will say (shared with the pending rewrite)

    def note(self, version: int) -> None:
        """(Loop thread) ``version`` was committed: rewrite the hint, now or later."""
        now = time.monotonic()
        self._known[0] = version
        if self._task is not None or now - self._time < HINT_INTERVAL:
            if not self._later:
                self._later = True
                delay = max(0.05, self._time + HINT_INTERVAL - now)
                # weakly: a writer lives only as long as its root, and a root only
                # as long as its users (get_root must not hand a stale root to a
                # store recreated at the same place); if it is gone by then, its
                # last known version is written anyway
                asyncio.get_running_loop().call_later(delay, _hint_due, weakref.ref(self), self.base, self._known)
            return
        self._time = now
        self._task = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        try:
            await write_hint(self.base, self._known[0])
        finally:
            self._task = None

    def reset_after_fork(self) -> None:
        # asyncio objects belong to the parent's loop, which does not exist here
        self._task = None
        self._later = False


def _hint_due(ref: weakref.ref[HintWriter], base: KvStore, known: list[int]) -> None:
    writer = ref()
    if writer is not None:
        writer._later = False
        writer.note(known[0])
    else:
        asyncio.ensure_future(write_hint(base, known[0]))
