"""Thread pools for blocking I/O and GIL-releasing CPU work, sized from the CPUs
this process may use.

Blocking file I/O and codec work (compressors, checksums and numpy copies
release the GIL) never run on the event loop: they run here. The pools are
process-wide, created on first use, and recreated after ``os.fork()`` (the
parent's worker threads do not exist in a child).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["at_exit_before_pools", "available_cpus", "cpu_pool", "io_pool", "run_cpu", "run_io"]

T = TypeVar("T")

_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def available_cpus() -> int:
    """The number of CPUs this process may run on (its affinity mask, not the
    machine's core count: a container or ``taskset`` may allow fewer)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def _pool(name: str, workers: int) -> concurrent.futures.ThreadPoolExecutor:
    pool = _pools.get(name)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(name)
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"tsp-{name}")
                _pools[name] = pool
    return pool


def io_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for blocking I/O (file reads/writes, fsync)."""
    return _pool("io", 32)


def cpu_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for codec work (compressors release the GIL): one per usable CPU."""
    return _pool("cpu", max(2, available_cpus()))


async def run_io(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking ``fn(*args)`` on the I/O pool from the loop."""
    return await asyncio.get_running_loop().run_in_executor(io_pool(), fn, *args)


async def run_cpu(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` (GIL-releasing work) on the CPU pool from the loop."""
    return await asyncio.get_running_loop().run_in_executor(cpu_pool(), fn, *args)


def at_exit_before_pools(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit while the pools still take work.

    ``concurrent.futures`` stops its pools at threading shutdown, which comes
    before ``atexit`` handlers; work a library must finish at exit (releasing
    leases) registers here, the way ``concurrent.futures`` registers itself, and
    runs first (these hooks run last-registered first, and the pools' hook was
    registered when this module was imported).
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - not CPython >= 3.9
        atexit.register(fn)
    else:
        register(fn)


def _reset_pools_after_fork() -> None:
    global _pools_lock
    _pools.clear()  # the parent's worker threads do not exist in the child
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_pools_after_fork)
