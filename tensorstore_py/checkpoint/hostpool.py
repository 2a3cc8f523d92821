"""One pool of equal-size host buffers, shared by checkpoint saves and restores.

A restore reads each chunk that is not exactly one block of its target into a
*slot* of this pool (the store reads into the slot itself where it can: the
file store's ``preadv``), decodes or copies it into its block or sends it to its
device from there, and gives the slot back; a streamed ``"pinned_host"`` save
copies each chunk off CPU devices into a slot and writes it from there.

Guarantees:

* **Bounded.** A pool holds at most ``limit // slot_bytes`` slots at once (at
  least one). A caller that needs slots waits (first come, first served) until
  enough are free instead of allocating past the limit; a request for more
  slots than the limit holds is admitted alone, once nothing else is held.
* **Lazy and reused.** Slots are made on first need, never more than the limit
  holds (counting the host copies held elsewhere: free slots are returned to
  the system as those take their place), and kept after use: later saves and restores with the same slot size
  reuse them instead of asking the system for fresh memory each time. Every
  slot of one pool has the same size (a multiple of :data:`SLOT_GRANULE`), so
  buffers never fragment into odd sizes as an allocator's power-of-two size
  classes do. Slots are private anonymous mappings (page-aligned), returned to
  the system when a pool is trimmed (:func:`trim_pools`, or a pool of another
  slot size becoming the shared one).
* **A slot never backs a result.** Nothing a restore returns views a slot:
  blocks are copies, and a slot is released only once the device transfer that
  reads it has completed and no device buffer aliases it (on CPU devices
  ``jax.device_put`` may alias an aligned host buffer instead of copying it, so
  a slot goes to a CPU device as a copy: :func:`device_put_copy`).

Pinned memory: JAX offers no way to register memory we own as pinned, nor to
copy a device buffer into a caller's host buffer. On accelerators the slots are
therefore ordinary (pageable) host memory that a restore's host-to-device copies
read from, and a save's device-to-host copies land in JAX's own pinned host
buffers (``memory_kind="pinned_host"``, which JAX's allocator keeps for reuse);
those copies are *accounted* against this pool's limit (:meth:`HostPool.acquire`
with ``buffers=False``) without slots of ours, so the save's host memory stays
within the same budget.

Within one process there is one shared pool per slot size (:func:`shared_pool`);
its limit is the budget of the save or restore that last asked for it.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from collections import deque
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.jax_adapter import jax_module
from tensorstore_py.core.buffers import mapped_empty

__all__ = ["SLOT_GRANULE", "HostLease", "HostPool", "device_put_copy", "shared_pool", "slot_bytes_for", "trim_pools"]

#: slot sizes are multiples of this (chunks of nearly the same size share a pool)
SLOT_GRANULE = 1 << 20


def slot_bytes_for(nbytes: int) -> int:
    """The slot size that holds ``nbytes``: rounded up to :data:`SLOT_GRANULE`."""
    return max(1, math.ceil(max(1, int(nbytes)) / SLOT_GRANULE)) * SLOT_GRANULE


class HostLease:
    """Slots held by one piece of work; :meth:`release` gives them back (once)."""

    __slots__ = ("_pool", "buffers", "count")

    def __init__(self, pool: HostPool, count: int, buffers: list[np.ndarray]) -> None:
        self._pool: HostPool | None = pool
        self.count = count
        #: the slots' memory (uint8, ``slot_bytes`` each); empty for an accounting-only lease
        self.buffers = buffers

    def array(self, shape: tuple[int, ...], dtype: Any, index: int = 0) -> np.ndarray:
        """A C-order array of ``shape`` over the start of slot ``index``."""
        dt = np.dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        return self.buffers[index][:n].view(dt).reshape(shape)

    def release(self) -> None:
        """Give the slots back (they are reused; nothing may read them after this)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._release(self)


class HostPool:
    """Equal-size page-aligned host buffers, made lazily up to a limit and reused.

    Thread-safe: :meth:`acquire` is a coroutine of any event loop, releases may
    come from any thread.
    """

    def __init__(self, slot_bytes: int, limit_bytes: int) -> None:
        self.slot_bytes = slot_bytes_for(slot_bytes)
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []
        self._waiters: deque[tuple[int, bool, asyncio.Future[HostLease]]] = deque()
        #: slots held now (with or without buffers of ours)
        self.held = 0
        #: buffers that exist now (free or held)
        self.made = 0
        #: buffers made over the pool's life (reuse keeps this small)
        self.made_total = 0
        #: slots held without buffers of ours (JAX's pinned copies)
        self.held_elsewhere = 0
        self.capacity = 1
        self.set_limit(limit_bytes)

    def set_limit(self, limit_bytes: int) -> None:
        """At most ``limit_bytes // slot_bytes`` slots (at least one) from now on;
        free buffers beyond that are returned to the system."""
        with self._lock:
            self.capacity = max(1, int(limit_bytes) // self.slot_bytes)
            self._shed_locked()
            ready = self._admit_locked()
        _wake(ready)

    def trim(self) -> None:
        """Return the free buffers to the system (held ones stay with their leases)."""
        with self._lock:
            self.made -= len(self._free)
            self._free.clear()

    async def acquire(self, count: int = 1, *, buffers: bool = True) -> HostLease:
        """Wait until ``count`` slots may be held, then hold them. ``buffers=False``
        holds the slots' share of the limit without memory of ours (host copies
        that JAX allocates)."""
        count = max(1, int(count))
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._waiters and self._fits(count):
                return self._take_locked(count, buffers)
            fut: asyncio.Future[HostLease] = loop.create_future()
            self._waiters.append((count, buffers, fut))
        try:
            return await fut
        except BaseException:
            with self._lock:
                if fut.done() and not fut.cancelled():
                    lease = fut.result()  # admitted just as it was cancelled: give it back
                else:
                    lease = None
                    fut.cancel()
                ready = self._admit_locked()
            _wake(ready)
            if lease is not None:
                lease.release()
            raise

    def _fits(self, count: int) -> bool:
        return self.held == 0 or self.held + count <= self.capacity

    def _take_locked(self, count: int, buffers: bool) -> HostLease:
        self.held += count
        bufs: list[np.ndarray] = []
        if buffers:
            for _ in range(count):
                if self._free:
                    bufs.append(self._free.pop())
                else:
                    bufs.append(mapped_empty(self.slot_bytes))
                    self.made += 1
                    self.made_total += 1
        else:
            self.held_elsewhere += count
            self._shed_locked()  # host memory elsewhere takes the place of free slots
        return HostLease(self, count, bufs)

    def _shed_locked(self) -> None:
        """Drop free buffers while the pool's buffers and the memory held
        elsewhere together exceed the limit."""
        while self._free and self.made + self.held_elsewhere > self.capacity:
            self._free.pop()
            self.made -= 1

    def _release(self, lease: HostLease) -> None:
        with self._lock:
            self.held -= lease.count
            if not lease.buffers:
                self.held_elsewhere -= lease.count
            self._free.extend(lease.buffers)
            lease.buffers = []
            self._shed_locked()  # over the limit (a smaller budget since): let them go
            ready = self._admit_locked()
        _wake(ready)

    def _admit_locked(self) -> list[tuple[asyncio.Future[HostLease], HostLease]]:
        ready = []
        while self._waiters:
            count, buffers, fut = self._waiters[0]
            if fut.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if not self._fits(count):
                break
            self._waiters.popleft()
            ready.append((fut, self._take_locked(count, buffers)))
        return ready


def _wake(ready: list[tuple[asyncio.Future[HostLease], HostLease]]) -> None:
    for fut, lease in ready:
        def settle(fut: asyncio.Future[HostLease] = fut, lease: HostLease = lease) -> None:
            if fut.done():  # cancelled meanwhile: the slots go back
                lease.release()
            else:
                fut.set_result(lease)
        try:
            fut.get_loop().call_soon_threadsafe(settle)
        except RuntimeError:  # its loop is closed: nobody waits any more
            lease.release()


_pools_lock = threading.Lock()
_pools: dict[int, HostPool] = {}


def shared_pool(slot_bytes: int, limit_bytes: int) -> HostPool:
    """The process's pool of slots of :func:`slot_bytes_for` ``(slot_bytes)``, its
    limit set to ``limit_bytes``. The free buffers of pools of other slot sizes
    are returned to the system (one size's buffers are kept at a time)."""
    size = slot_bytes_for(slot_bytes)
    with _pools_lock:
        pool = _pools.get(size)
        if pool is None:
            pool = _pools[size] = HostPool(size, limit_bytes)
        others = [p for s, p in _pools.items() if s != size]
        for s in [s for s, p in _pools.items() if s != size and p.held == 0]:
            del _pools[s]
    for p in others:
        p.trim()
    pool.set_limit(limit_bytes)
    return pool


def trim_pools() -> None:
    """Return every free slot of every shared pool to the system."""
    with _pools_lock:
        pools = list(_pools.values())
    for p in pools:
        p.trim()


def _forget_pools() -> None:
    # a forked child starts with no pools: waiters belong to the parent's loop
    global _pools_lock
    _pools_lock = threading.Lock()
    _pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def device_put_copy(piece: np.ndarray, device: Any) -> Any:
    """``piece`` on ``device`` as a buffer of the device's own, the transfer
    waited for: when this returns no device buffer reads ``piece``'s memory, so
    a slot it views may be reused. On CPU devices ``jax.device_put`` aliases an
    aligned host buffer (even with ``may_alias=False``, checked with JAX 0.10), so
    the piece is copied first and the copy becomes the array."""
    jax = jax_module()
    if getattr(device, "platform", None) == "cpu":
        copy = mapped_empty(piece.shape, piece.dtype)
        np.copyto(copy, piece)
        piece = copy
    placed = jax.device_put(piece, device)
    placed.block_until_ready()
    return placed
