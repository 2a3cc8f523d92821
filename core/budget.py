"""Bounded concurrency for chunk work: a bytes-in-flight budget plus a task cap.

Defaults grow with the CPUs this process may use (``pools.available_cpus``):
:func:`default_bytes_in_flight` is ``max(256 MiB, 16 MiB x CPUs)`` and
:func:`default_max_tasks` ``max(64, 4 x CPUs)``, so that every core has chunks to work
on; a Context may set the byte limit and the thread counts.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from tensorstore_py.core.pools import Concurrency, available_cpus

__all__ = ["DEFAULT_BYTES_IN_FLIGHT", "ByteBudget", "default_bytes_in_flight", "default_max_tasks", "run_bounded"]

T = TypeVar("T")

#: the least default byte budget (what 16 CPUs get; more CPUs get more)
DEFAULT_BYTES_IN_FLIGHT = 256 << 20
_BYTES_PER_CPU = 16 << 20
# Enough outstanding chunk operations to keep the I/O and CPU pools busy.
MAX_TASKS = 64


def default_bytes_in_flight() -> int:
    """The byte budget of an array opened without one: ``max(256 MiB, 16 MiB x CPUs)``."""
    return max(DEFAULT_BYTES_IN_FLIGHT, _BYTES_PER_CPU * available_cpus())


def default_max_tasks() -> int:
    """The most chunk operations one request keeps in flight: ``max(64, 4 x CPUs)``."""
    return max(MAX_TASKS, 4 * available_cpus())


class ByteBudget:
    """An asyncio semaphore counted in bytes, shared by the tasks of one event loop.

    Guarantees:

    * Bounded: the bytes held never exceed ``limit``, except by one request
      larger than the whole budget, which is admitted alone once nothing else is
      held (so it neither waits forever nor shares the budget with others).
    * First come, first served: waiting requests are admitted in arrival order
      and a new request never overtakes a waiting one, so a large request is not
      starved by a stream of small ones.
    * :meth:`release` is synchronous and never blocks, so it may be called from
      a done-callback (a task cancelled before it started still gives back what
      was taken for it).
    * A request cancelled while waiting holds nothing afterwards.

    ``concurrency``: the threads the work it bounds may use (see
    :class:`~tensorstore_py.core.pools.Concurrency`; the defaults when None).
    """

    def __init__(self, limit: int, *, concurrency: Concurrency | None = None) -> None:
        self.limit = max(1, int(limit))
        self.concurrency = concurrency or Concurrency.default()
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    async def acquire(self, n: int) -> int:
        """Wait until ``n`` bytes may be held; returns what was taken (release that)."""
        n = max(0, int(n))
        if n == 0:
            return 0
        if not self._waiters and self._fits(n):
            self.used += n
            return n
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)  # admitted just as it was cancelled: give it back
            else:
                fut.cancel()
                self._admit()  # it may have held back the requests behind it
            raise
        return n

    def release(self, n: int) -> None:
        """Give back ``n`` bytes and admit the waiting requests that now fit."""
        self.used -= n
        self._admit()

    def _admit(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if not self._fits(n):
                return
            self._waiters.popleft()
            self.used += n
            fut.set_result(None)


async def run_bounded(
    items: Iterable[T],
    fn: Callable[[T], Awaitable[None]],
    *,
    budget: ByteBudget,
    cost: int | Callable[[T], int],
    max_tasks: int | None = None,
) -> None:
    """Run ``fn(item)`` for every item concurrently, within ``budget``.

    At most ``max_tasks`` (default :func:`default_max_tasks`) run at once. The first
    failure cancels the rest and is raised (after they stop).
    """
    limit = max_tasks if max_tasks is not None else default_max_tasks()
    tasks: set[asyncio.Task[None]] = set()
    failed: list[BaseException] = []

    def done(t: asyncio.Task[None], held: int) -> None:
        budget.release(held)  # here, not in the task: it may be cancelled unstarted
        tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            failed.append(t.exception())  # type: ignore[arg-type]

    try:
        for item in items:
            if failed:
                break
            if len(tasks) >= limit:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                if failed:
                    break
            held = await budget.acquire(cost(item) if callable(cost) else cost)
            t = asyncio.ensure_future(fn(item))
            tasks.add(t)
            t.add_done_callback(functools.partial(done, held=held))
        while tasks and not failed:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        if tasks:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    if failed:
        raise failed[0]
