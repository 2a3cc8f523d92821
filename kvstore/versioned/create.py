"""Creating objects: what an "already exists" answer to a create-only write means.

Everything the versioned store writes is created once and never overwritten
(docs/FORMAT.md), with a create-only write. When such a write fails with an
I/O error, the object may or may not have landed, so it is retried, and the
retry may find the object there. Whether an object found there is ours depends
on how its name was chosen; the caller says so with ``exists``:

``"ours"``
    The name is fresh (a random 128-bit name from :func:`format.new_name`) and
    never reused, so only this call can have written it: an existing object is
    an earlier attempt of ours whose response was lost. Success.
``"compare"``
    The name comes from an id the caller was given (a transaction id), so an
    existing object may be someone else's: it is ours only if it holds exactly
    ``data`` (read back and compared).
``"refuse"``
    The location must be empty (a copy into a new place): an object found by
    the first attempt is someone else's. Only after an attempt of ours failed
    with an I/O error can it be ours, and then only if it holds exactly ``data``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from tensorstore_py.core.errors import ConditionFailedError
from tensorstore_py.core.retry import RetryPolicy
from tensorstore_py.kvstore.base import Buffer, Generation, KvStore

__all__ = ["ONCE", "RETRY", "Exists", "create_fresh_blocking", "create_object"]

Exists = Literal["ours", "compare", "refuse"]

#: retries of a create that fails with an I/O error: 4 attempts, with waits of
#: 20, 40 and 80 ms on average between them (full jitter)
RETRY = RetryPolicy(max_attempts=4, initial_delay=0.04, max_delay=4.0)
#: one attempt, no retry
ONCE = RetryPolicy(max_attempts=1)


async def create_object(
    store: KvStore, name: str, data: Buffer, *, exists: Exists, retry: RetryPolicy = RETRY
) -> bool:
    """Create ``name`` holding ``data`` with a create-only write.

    I/O errors (``OSError``, ``TimeoutError``) are retried per ``retry``; the
    last one is raised when the attempts are used up. Returns True when
    ``name`` now holds ``data`` written by this call (now, or by an earlier
    attempt whose response was lost), False when an object that is not ours
    was already there (never for ``exists="ours"``; see the module doc).
    """
    failed = False  # an attempt failed with an I/O error: it may have landed
    for attempt in range(1, retry.max_attempts + 1):
        try:
            await store.write(name, data, if_equal=Generation.NO_VALUE)
            return True
        except ConditionFailedError:
            break
        except (TimeoutError, OSError):
            if attempt == retry.max_attempts:
                raise
            failed = True
            await asyncio.sleep(retry.delay(attempt))
    if exists == "ours":
        return True
    if exists == "refuse" and not failed:
        return False
    res = await store.read(name)
    return res.state == "value" and bytes(res.value) == bytes(data)


def create_fresh_blocking(store: KvStore, name: str, data: Any) -> None:
    """:func:`create_object` with ``exists="ours"`` and one attempt, for a pool
    thread of a ``blocking_io`` store (``name`` relative to the store's path)."""
    try:
        store._write_blocking(store._full(name), data, Generation.NO_VALUE)
    except ConditionFailedError:
        pass  # a fresh name exists only if we wrote it
