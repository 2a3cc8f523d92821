"""Thread pools for blocking I/O and GIL-releasing CPU work, sized from the CPUs
this process may use.

Blocking file I/O and codec work (compressors, checksums and numpy copies
release the GIL) never run on the event loop: they run here. The pools are
process-wide, created on first use, and recreated after ``os.fork()`` (the
parent's worker threads do not exist in a child).

Sizes (:class:`Concurrency`): ``cpu`` threads for codec work, one per CPU this
process may use (``os.sched_getaffinity``, so a container or ``taskset`` limit
is honoured); ``io`` threads for blocking I/O, ``max(32, 4 * cpus)`` (calls that
wait on a disk or fsync hold a thread without using a CPU); :data:`COPY_THREADS`
threads for copies that allocate large host buffers (:func:`run_copy`). A Context may ask
for other sizes (``data_copy_concurrency`` / ``file_io_concurrency``): each
distinct size gets a pool of its own, shared by every array that asks for it.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["COPY_THREADS", "Concurrency", "at_exit_before_pools", "available_cpus", "copy_pool", "cpu_pool",
           "io_pool", "run_copy", "run_cpu", "run_in", "run_io"]

T = TypeVar("T")

_pools: dict[tuple[str, int], concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_default: Concurrency | None = None  # Concurrency.default(), once per process
#: the least number of I/O threads (blocking calls mostly wait, they need no CPU)
MIN_IO_THREADS = 32
#: threads of the pool for copies that allocate large host buffers (:func:`copy_pool`)
COPY_THREADS = 4


def available_cpus() -> int:
    """The number of CPUs this process may run on (its affinity mask, not the
    machine's core count: a container or ``taskset`` may allow fewer)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class Concurrency:
    """How many threads chunk work may use: ``cpu`` for codec work (encode,
    decode, copies), ``io`` for blocking I/O calls. :meth:`default` derives both
    from :func:`available_cpus`."""

    cpu: int
    io: int

    @classmethod
    def default(cls, cpu: int | None = None, io: int | None = None) -> Concurrency:
        """The defaults (``cpu`` = usable CPUs, ``io`` = max(32, 4 x CPUs), taken
        once per process), with ``cpu`` / ``io`` replacing them where given."""
        global _default
        base = _default
        if base is None:
            cpus = available_cpus()
            base = _default = cls(cpu=cpus, io=max(MIN_IO_THREADS, 4 * cpus))
        if cpu is None and io is None:
            return base
        return cls(cpu=max(1, cpu or base.cpu), io=max(1, io or base.io))

    def cpu_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return _pool("cpu", self.cpu)

    def io_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return _pool("io", self.io)


def _pool(name: str, workers: int) -> concurrent.futures.ThreadPoolExecutor:
    key = (name, workers)
    pool = _pools.get(key)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(key)
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"tsp-{name}")
                _pools[key] = pool
    return pool


def io_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The default pool for blocking I/O (file reads/writes, fsync)."""
    return Concurrency.default().io_pool()


def cpu_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The default pool for codec work (compressors release the GIL): one thread per usable CPU."""
    return Concurrency.default().cpu_pool()


def copy_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The pool for copies that allocate large, short-lived host buffers (a
    chunk copied off a device): :data:`COPY_THREADS` threads, whatever the
    CPUs or the I/O pool's size.

    Why a pool of its own: the C allocator gives each thread that allocates an
    arena of its own (up to 8 per CPU), and memory freed into an arena stays
    with the process for that arena's next allocations (buffers of a few MiB
    are past the allocator's adaptive mmap threshold once one was freed). Run
    on the I/O pool, whose threads multiply whenever a burst of blocking calls
    needs them (a restore, a commit's presence checks), the copies of one
    bounded stream of chunks land in ever more arenas and the process keeps up
    to one chunk per arena; here they reuse the memory of at most
    :data:`COPY_THREADS` arenas.
    """
    return _pool("copy", COPY_THREADS)


async def run_in(pool: concurrent.futures.Executor, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on ``pool`` from the loop."""
    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


async def run_io(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking ``fn(*args)`` on the default I/O pool from the loop."""
    return await run_in(io_pool(), fn, *args)


async def run_copy(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking ``fn(*args)``, a copy that allocates a large host buffer, on
    :func:`copy_pool` from the loop."""
    return await run_in(copy_pool(), fn, *args)


async def run_cpu(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` (GIL-releasing work) on the default CPU pool from the loop."""
    return await run_in(cpu_pool(), fn, *args)


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
    global _pools_lock, _default
    _default = None  # the child may run on other CPUs
    _pools.clear()  # the parent's worker threads do not exist in the child
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_pools_after_fork)
