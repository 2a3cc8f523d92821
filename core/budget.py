"""Bounded concurrency for chunk work: a bytes-in-flight budget plus a task cap."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

__all__ = ["DEFAULT_BYTES_IN_FLIGHT", "ByteBudget", "run_bounded"]

T = TypeVar("T")

DEFAULT_BYTES_IN_FLIGHT = 256 << 20
# Enough outstanding chunk operations to keep the I/O and CPU pools busy.
MAX_TASKS = 64


class ByteBudget:
    """An asyncio semaphore counted in bytes (all users on one event loop).

    A request larger than the whole budget is admitted alone, so nothing blocks
    forever; memory held by in-flight chunks stays near ``limit``.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(1, int(limit))
        self.used = 0
        self._waiters: list[asyncio.Future[None]] = []

    async def acquire(self, n: int) -> int:
        """Wait until ``n`` bytes fit (capped at the whole budget); returns what was taken."""
        n = min(max(0, n), self.limit)
        while self.used + n > self.limit:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
        self.used += n
        return n

    def release(self, n: int) -> None:
        """Give back ``n`` bytes (callable from callbacks: it never blocks)."""
        self.used -= n
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


async def run_bounded(
    items: Iterable[T],
    fn: Callable[[T], Awaitable[None]],
    *,
    budget: ByteBudget,
    cost: int | Callable[[T], int],
    max_tasks: int = MAX_TASKS,
) -> None:
    """Run ``fn(item)`` for every item concurrently, within ``budget``.

    The first failure cancels the rest and is raised (after they stop).
    """
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
            if len(tasks) >= max_tasks:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                if failed:
                    break
            held = await budget.acquire(cost(item) if callable(cost) else cost)
            t = asyncio.ensure_future(fn(item))
            tasks.add(t)
            t.add_done_callback(lambda t, held=held: done(t, held))
        while tasks and not failed:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        if tasks:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    if failed:
        raise failed[0]
