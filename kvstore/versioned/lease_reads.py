"""Leases as a garbage collector reads them (FORMAT.md §9.1, §9.3): the store's
clock (:func:`store_now`), the live leases of a store (:func:`read_leases`:
which versions readers pin, from when writers' objects are kept) and the
deletion of expired ones (:func:`delete_expired`). The owner's side, and the
lease object's format, is :mod:`.leases`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tensorstore_py.core.errors import (
    ConditionFailedError,
    DataCorruptionError,
    ReadOnlyError,
    UnsupportedError,
)
from tensorstore_py.kvstore.base import Generation, KeyInfo, KvStore
from tensorstore_py.kvstore.versioned.format import unframe
from tensorstore_py.kvstore.versioned.leases import (
    CLOCK_PREFIX,
    IO_ERRORS,
    LEASES_PREFIX,
    MAGIC_LEASE,
    SLACK,
    TTL,
    LeaseKeeper,
    lease_clock,
    owner_gone,
)

__all__ = ["Leases", "delete_expired", "read_leases", "store_now"]


async def store_now(base: KvStore) -> tuple[float, str]:
    """The store's time now and where it came from (``"store"``, or ``"host"``
    when the store can not tell: read-only, or no modification times)."""
    name = f"{CLOCK_PREFIX}{uuid.uuid4().hex}"
    try:
        await base.write(name, b"", if_equal=Generation.NO_VALUE)
        try:
            infos = await base.list_info(name)
        finally:
            await base.delete(name)
        mtime = next((i.mtime for i in infos if i.key == name), None)
        if mtime is not None:
            return mtime, "store"
    except (ReadOnlyError, UnsupportedError, *IO_ERRORS):
        pass
    return time.time(), "host"


@dataclass(frozen=True)
class Leases:
    """The live leases of a store as a collector sees them.

    ``pinned``: versions live readers pin. ``protect_from``: store time from
    which unreferenced objects are kept for live writers (None: no writer;
    ``-inf``: a writer of unknown age, keep them all). ``expired``: lease
    objects older than their ``ttl`` (a collector may delete them; leases of
    gone processes of this machine are ignored at once, deleted when expired).
    """

    pinned: frozenset[int] = frozenset()
    protect_from: float | None = None
    live: int = 0
    expired: tuple[str, ...] = ()
    #: the generation of each expired lease as read (deleted only if unchanged)
    expired_generations: tuple[Generation, ...] = ()

    def merge(self, later: Leases) -> Leases:
        """What two reads of the leases protect together (the expired leases
        are the later read's: one refreshed in between is live)."""
        starts = [s for s in (self.protect_from, later.protect_from) if s is not None]
        return Leases(self.pinned | later.pinned, min(starts) if starts else None,
                      max(self.live, later.live), later.expired, later.expired_generations)

    def protects(self, mtime: float | None) -> bool:
        """Whether an unreferenced object modified at ``mtime`` belongs to a live writer."""
        if self.protect_from is None:
            return False
        return mtime is None or mtime >= self.protect_from


def _decode(data: Any, name: str) -> dict[str, Any] | None:
    try:
        body = unframe(MAGIC_LEASE, data, name)
    except DataCorruptionError:
        return None
    return body if isinstance(body, dict) else None


async def read_leases(base: KvStore, now: float, own: LeaseKeeper | None) -> Leases:
    """Every live lease of ``base`` (this process's from ``own``, in memory)."""
    pinned: set[int] = set()
    starts: list[float] = []
    if own is not None:
        pinned |= own.pinned()
        since = own.writing_since()
        if since is not None:
            starts.append(now - (lease_clock() - since) - SLACK)
    infos = [
        i for i in await base.list_info(LEASES_PREFIX)
        if i.key != (own.name if own is not None else None) and len(i.key) == len(LEASES_PREFIX) + 32
    ]

    async def body(name: str) -> tuple[Generation | None, dict[str, Any] | None]:
        res = await base.read(name)
        if res.state != "value":
            return None, None
        return res.generation, _decode(res.value, name)

    async def still(info: KeyInfo) -> bool:
        """Whether ``info`` (listed before its body was read) is still the lease's
        state now, after the read: then the generation read is the expired one."""
        again = [i for i in await base.list_info(info.key) if i.key == info.key]
        return bool(again) and again[0].mtime == info.mtime

    live = 0
    expired: list[tuple[str, Generation]] = []
    for info, (gen, b) in zip(infos, await asyncio.gather(*(body(i.key) for i in infos))):
        if gen is None:
            continue  # released meanwhile
        age = None if info.mtime is None else now - info.mtime
        ttl = b.get("ttl") if b is not None else None
        ttl = float(ttl) if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) else TTL
        if age is not None and age > ttl:
            if await still(info):
                expired.append((info.key, gen))  # not refreshed in time: the owner is gone
                continue
            b = None  # refreshed while we read it: live, content unknown
        if b is not None and owner_gone(b):
            continue  # ignored; the object ages out like any other lease
        live += 1
        if b is None:  # unreadable: it may be a writer's; pins unknown
            starts.append(float("-inf"))
            continue
        pinned |= {v for v in b.get("versions") or [] if isinstance(v, int)}
        if b.get("writing"):
            wf = b.get("writing_for")
            wf = float(wf) if isinstance(wf, (int, float)) else float("inf")
            starts.append(float("-inf") if info.mtime is None else info.mtime - wf - SLACK)
    return Leases(frozenset(pinned), min(starts) if starts else None, live,
                  tuple(n for n, _ in expired), tuple(g for _, g in expired))


async def delete_expired(base: KvStore, leases: Leases) -> None:
    """Delete the expired leases ``leases`` found, each only if unchanged since
    it was read (an owner that refreshed it late keeps it); stores without
    conditional deletes delete it anyway (it protected nothing any more)."""

    async def one(name: str, gen: Generation) -> None:
        try:
            await base.delete(name, if_equal=gen)
        except ConditionFailedError:
            pass  # rewritten by its owner since: live again
        except UnsupportedError:
            await base.delete(name)

    await asyncio.gather(*(one(n, g) for n, g in zip(leases.expired, leases.expired_generations)))
