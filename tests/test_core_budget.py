"""core.budget.ByteBudget: bounded, first come first served, callback-safe release."""

from __future__ import annotations

import asyncio

import pytest

from tensorstore_py.core.budget import ByteBudget, run_bounded
from tensorstore_py.core.future import run_sync


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_an_oversized_request_is_admitted_alone() -> None:
    async def go() -> list[str]:
        budget = ByteBudget(100)
        order: list[str] = []
        assert await budget.acquire(30) == 30

        async def take(name: str, n: int) -> None:
            await budget.acquire(n)
            order.append(name)

        big = asyncio.ensure_future(take("big", 250))
        await _settle()
        assert order == []  # waits for the 30 bytes held
        budget.release(30)
        await _settle()
        assert order == ["big"] and budget.used == 250
        small = asyncio.ensure_future(take("small", 1))
        await _settle()
        assert order == ["big"]  # nothing shares the budget with it
        budget.release(250)
        await asyncio.gather(big, small)
        return order

    assert run_sync(go()) == ["big", "small"]


def test_waiters_are_admitted_in_arrival_order() -> None:
    """A large waiting request is not overtaken by later small ones that would fit."""

    async def go() -> list[str]:
        budget = ByteBudget(100)
        order: list[str] = []
        await budget.acquire(60)

        async def take(name: str, n: int) -> None:
            await budget.acquire(n)
            order.append(name)

        tasks = [asyncio.ensure_future(take("large", 80))]
        await _settle()
        tasks += [asyncio.ensure_future(take(f"small{i}", 10)) for i in range(3)]
        await _settle()
        assert order == []  # 60 + 10 would fit, but "large" came first
        budget.release(60)
        await _settle()
        assert order == ["large", "small0", "small1"] and budget.used == 100
        budget.release(80)
        await asyncio.gather(*tasks)
        return order

    assert run_sync(go()) == ["large", "small0", "small1", "small2"]


def test_release_from_a_done_callback() -> None:
    async def go() -> int:
        budget = ByteBudget(10)
        held = await budget.acquire(10)
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda _f: budget.release(held))
        waiter = asyncio.ensure_future(budget.acquire(5))
        await _settle()
        assert not waiter.done()
        fut.set_result(None)
        return await asyncio.wait_for(waiter, 5)

    assert run_sync(go()) == 5


def test_a_cancelled_waiter_holds_nothing_and_unblocks_the_rest() -> None:
    async def go() -> None:
        budget = ByteBudget(100)
        await budget.acquire(50)
        blocked = asyncio.ensure_future(budget.acquire(90))  # head of the queue
        await _settle()
        behind = asyncio.ensure_future(budget.acquire(40))  # fits, but waits its turn
        await _settle()
        assert not behind.done()
        blocked.cancel()
        assert await asyncio.wait_for(behind, 5) == 40
        assert budget.used == 90
        with pytest.raises(asyncio.CancelledError):
            await blocked

        # admitted and cancelled before it ran: the bytes come back
        budget.release(90)
        assert budget.used == 0
        await budget.acquire(100)
        granted = asyncio.ensure_future(budget.acquire(10))
        await _settle()
        budget.release(100)  # admits `granted` ...
        granted.cancel()  # ... which is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await granted
        assert budget.used == 0

    run_sync(go())


def test_run_bounded_never_holds_more_than_the_limit() -> None:
    async def go() -> int:
        budget = ByteBudget(100)
        peak = 0

        async def one(n: int) -> None:
            nonlocal peak
            peak = max(peak, budget.used)
            await asyncio.sleep(0.001 * (n % 3))

        await run_bounded(range(200), one, budget=budget, cost=lambda n: 1 + n % 40)
        assert budget.used == 0
        return peak

    assert 0 < run_sync(go()) <= 100
