"""Leases: what a running process asks garbage collection to leave alone (FORMAT.md §9.3).

A process keeps ONE lease object ``leases/<hex32>`` per versioned store while
it needs one, written (overwritten) by a :class:`LeaseKeeper`:

* while it *writes* (an open transaction that staged a change, a write outside
  a transaction, a commit), the lease says so, with ``writing_for`` = seconds
  since its oldest running writer started. A collector keeps every unreferenced
  object modified after ``mtime(lease) - writing_for - SLACK`` (store times), so
  a transaction open for hours keeps the data it wrote at its start;
* while it *reads* a pinned version (a snapshot, a checkpoint restore, an
  ``open_array`` view), the lease lists that version in ``versions``: prompt
  reclaim leaves a deleted version that a live lease names alone.

Ages are measured by the STORE's clock, never by a host's: a collector learns
"now" by creating a probe object and reading its modification time back
(:func:`.lease_reads.store_now`, the collector's side of leases). A lease is
live while its age is at most its ``ttl``; the keeper rewrites it every
:data:`REFRESH` seconds while needed, rewrites it promptly (after
:data:`LINGER`) when what it claims shrinks, and deletes it when nothing is
left -- except that a ``writing`` claim outlives the last writer by
:data:`WRITER_LINGER` (rewritten meanwhile only to stay within ``TTL / 2``), so
that the next writer of a process that commits periodically finds it and
writes nothing first. A lease whose owner is a process of this very machine
that has exited counts as dead at once (same host name, boot id and pid
namespace; the pid is gone, a zombie, or another process now).

A writer's registration (:meth:`LeaseKeeper.write_hold`) returns only once the
lease object on the store says ``writing``: a lease write that fails raises
:class:`~tensorstore_py.errors.StorageError` (the writer does not start). A
release never races a registration: while the lease object is being deleted
or rewritten to claim less, nothing counts as durable, so a writer or reader
registering in that window waits and writes it again. A reader's pin
(:meth:`LeaseKeeper.pin`) is best effort where the write fails (read-only
credentials are common for readers): it reads on without a lease, and a read
of a version reclaimed meanwhile raises SnapshotExpiredError, never wrong
bytes. A store that refuses the write as such (read only) gets no lease. The
backstop for writers is the commit's own check (``data.require_present``):
every data object the commit is about to reference for the first time must
still exist right before its commit record, or the commit is refused -- unless
the keeper vouches for it (:meth:`LeaseKeeper.unvouched`): on a store whose
modification times one clock stamps, an object whose write began while this
lease already said ``writing``, and which has said so without a lapse ever
since, can not have been collected (docs/FORMAT.md §9.3).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tensorstore_py.core.errors import ReadOnlyError, StorageError, UnsupportedError
from tensorstore_py.core.future import get_loop, in_loop_thread, run_sync
from tensorstore_py.core.pools import at_exit_before_pools
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.versioned.format import FORMAT, frame, new_name

__all__ = [
    "LEASES_PREFIX", "LINGER", "MAGIC_LEASE", "REFRESH", "SLACK", "TTL", "WRITER_LINGER",
    "Hold", "LeaseKeeper", "lease_clock",
]

log = logging.getLogger("tensorstore_py.kvstore.versioned")

MAGIC_LEASE = b"TSE1"
LEASES_PREFIX = "leases/"
#: the transient probe objects of :func:`.lease_reads.store_now` are ``gc/clock-<hex32>``
CLOCK_PREFIX = "gc/clock-"
#: seconds a lease stays live after its last write (written into each lease)
TTL = 300.0
#: seconds between two rewrites of a lease that is still needed
REFRESH = 60.0
#: seconds a keeper waits before writing a lease that claims less (batches releases)
LINGER = 1.0
#: seconds a lease that says ``writing`` keeps saying so after the last writer of
#: its process ended, so that a process committing again within that time (a
#: checkpoint every minute or two, a service writing now and then) registers its
#: writer without a lease write: one sequential round trip less per commit, and
#: no delete after it. Meanwhile the lease is rewritten only when it would
#: otherwise turn ``TTL / 2`` old within the linger, before the next refresh (a
#: registration would have to write it then): with the defaults, only after a
#: writer that ran past its last refresh by over 30 s. Commits further apart pay
#: the round trip, small next to their interval; and under TTL, a lingering
#: claim protects no longer than the claim of a writer that crashed right after
#: its commit: a collector in another process keeps the young unreferenced
#: objects it covers at most this much longer (FORMAT.md §9.3, "The writer linger").
WRITER_LINGER = 120.0
#: seconds subtracted from a writer's start: write latency and clock granularity
SLACK = 60.0
#: seconds between two tries of a refresh that failed
RETRY = 5.0
#: a lease vouches for its writers' objects only while each rewrite landed within
#: this fraction of the ttl after the previous one started (host and store clocks
#: may tick at slightly different rates), and the newest started within half the
#: ttl (the commit record still has that long to land)
VOUCH = 0.8

#: what a failed lease write or delete raises
IO_ERRORS = (StorageError, OSError, TimeoutError)


def lease_clock() -> float:
    """Seconds on the host clock that leases are timed by: one that keeps
    counting while the host is suspended (``CLOCK_BOOTTIME`` on Linux;
    ``time.monotonic()`` elsewhere). ``time.monotonic()`` stands still on Linux
    while the machine sleeps, and the store's clock does not: after a laptop or
    VM resumes, a lease that expired on the store meanwhile would look fresh,
    be vouched for (:meth:`LeaseKeeper.vouches`) and not be rewritten before a
    writer's first object. Writers record when their objects' writes started
    on this clock."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is None:
        return time.monotonic()
    return time.clock_gettime(boottime)


# -- who owns a lease ------------------------------------------------------------------
def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid`` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        rest = data[data.rindex(b")") + 2:].split()
        return rest[0].decode(), int(rest[19])
    except (OSError, ValueError, IndexError):
        return None


_me: tuple[int, dict[str, Any]] | None = None


def identity() -> dict[str, Any]:
    """This process as a lease names it: host, boot id, pid namespace, pid, start time."""
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:
        try:
            pidns: int | None = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            pidns = None
        st = _proc_state(pid)
        _me = (pid, {
            "host": socket.gethostname(), "boot": _read_text("/proc/sys/kernel/random/boot_id"),
            "pidns": pidns, "pid": pid, "start": st[1] if st else None,
        })
    return _me[1]


def owner_gone(body: dict[str, Any]) -> bool:
    """True when the lease's owner is a process of this machine that no longer runs.

    Only decided for leases written on this machine (same host name, boot id and
    pid namespace, so a pid means the same process table); False otherwise.
    """
    me = identity()
    if not me["boot"] or any(body.get(f) != me[f] for f in ("host", "boot", "pidns")):
        return False
    pid = body.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return False
    st = _proc_state(pid)
    if st is None:
        return True  # /proc works here (we have a boot id): no such process
    state, start = st
    return state in ("Z", "X") or (body.get("start") is not None and body.get("start") != start)


# -- the owner's side ------------------------------------------------------------------
@dataclass(frozen=True)
class _Durable:
    """What the lease object says, as last written successfully."""

    versions: frozenset[int]
    writing: bool
    at: float  # lease_clock() when that write started


class Hold:
    """One registration with a :class:`LeaseKeeper` (a pinned version or a
    running writer); :meth:`release` (idempotent, any thread) ends it, as does
    garbage collection of the hold."""

    __slots__ = ("__weakref__", "_keeper", "_kind", "_key", "_done")

    def __init__(self, keeper: LeaseKeeper, kind: str, key: int) -> None:
        self._keeper = keeper
        self._kind = kind
        self._key = key
        self._done = False

    def release(self) -> None:
        if self._done:
            return
        self._done = True
        self._keeper._release(self._kind, self._key)

    def __del__(self) -> None:
        if not sys.is_finalizing():
            with contextlib.suppress(Exception):
                self.release()


_keepers: weakref.WeakSet[LeaseKeeper] = weakref.WeakSet()


class LeaseKeeper:
    """This process's lease on one versioned store (one per ``VersionedRoot``).

    :meth:`pin` and :meth:`write_hold` register a need and return once the
    lease object says so (written now unless a fresh write already covers it);
    ``write_hold`` raises StorageError when it can not be written (``pin``
    logs it and reads on: see the module doc); releases are written lazily
    (after :data:`LINGER`).
    ``_durable`` is what the lease object is guaranteed to claim: while a write
    that claims less, or the delete, is in flight, the store may hold either
    content, so it is the lesser of the two (None during a delete).
    """

    def __init__(self, base: KvStore) -> None:
        self.base = base
        self._mutex = threading.Lock()
        self._reset()
        _keepers.add(self)

    def _reset(self) -> None:
        self.name = new_name(LEASES_PREFIX.rstrip("/"))
        self._pins: Counter[int] = Counter()
        self._writers: dict[int, tuple[float, Callable[[], bool] | None]] = {}
        self._next = 0
        # lease_clock() when the last running writer ended (the writer linger
        # counts from there); the timer that ends the linger
        self._idle_since: float | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._durable: _Durable | None = None
        self._lock: asyncio.Lock | None = None
        self._refresher: asyncio.Future[None] | None = None
        self._sync_armed = False
        self._retry = False  # the last refresh failed: the next comes after RETRY
        self.disabled = False  # the store refused a lease write (read-only)
        # the lease object has said ``writing`` without a lapse since _chain
        # (lease_clock(); None: it does not now); _last: when the newest
        # successful write saying so started
        self._chain: float | None = None
        self._last = 0.0

    def __repr__(self) -> str:
        return f"LeaseKeeper({self.base!r}, {self.name!r})"

    # -- what this process needs (read by an in-process collector directly) ---------
    def pinned(self) -> set[int]:
        with self._mutex:
            return {v for v, n in self._pins.items() if n > 0}

    def writing_since(self) -> float | None:
        """``lease_clock()`` at which the oldest running writer started (None: none).

        The lingering ``writing`` claim of the lease object (:data:`WRITER_LINGER`)
        is not a running writer: a collector in this process reads this, and
        rightly ignores the claim. It covers no object a running writer of this
        process needs: a writer registers here before its first object, so one
        that registers after the collector read this writes every object after
        the collector's "now" (young, never deleted); the objects of writers
        that ended are referenced by their commits or are garbage.
        """
        with self._mutex:
            for key, (_t, alive) in list(self._writers.items()):
                if alive is not None and not alive():
                    self._drop_writer(key)
            return min((t for t, _ in self._writers.values()), default=None)

    def _drop_writer(self, key: int) -> None:
        """(Under the mutex) forget a writer; the linger starts when the last goes."""
        if self._writers.pop(key, None) is not None and not self._writers:
            self._idle_since = lease_clock()

    # -- registering ------------------------------------------------------------------
    async def pin(self, version: int) -> Hold:
        """Pin ``version`` for reading: prompt reclaim leaves it alone while held."""
        with self._mutex:
            self._pins[version] += 1
        hold = Hold(self, "pin", version)
        try:
            await self._ensure(lambda d: version in d.versions, strict=False)
        except BaseException:
            hold.release()
            raise
        return hold

    async def write_hold(self, alive: Callable[[], bool] | None = None) -> Hold:
        """Register a running writer (``alive()``, if given, ends it when False)."""
        with self._mutex:
            self._next += 1
            key = self._next
            self._writers[key] = (lease_clock(), alive)
        hold = Hold(self, "writer", key)
        try:
            await self._ensure(lambda d: d.writing, strict=True)
        except BaseException:
            hold.release()
            raise
        return hold

    def vouches(self, started: float) -> bool:
        """Whether an object of a running writer, whose write started at
        ``started`` (``lease_clock()``), is certainly still on the store.

        True when the store's modification times come from one clock
        (``KvStore.single_clock``) and the lease object has said ``writing``
        without a lapse from before ``started`` until now, the newest write
        within half the ttl: every collector that ran meanwhile saw a live
        lease protecting the object (docs/FORMAT.md §9.3, §9.5). A writer asks
        right before its commit record; False means "check it".
        """
        if self.disabled or not getattr(self.base, "single_clock", False):
            return False
        chain = self._chain
        return chain is not None and chain <= started and lease_clock() - self._last < TTL / 2

    def unvouched(self, written: dict[str, float]) -> list[str]:
        """The objects of ``written`` (name -> when its write started) that
        :meth:`vouches` can not vouch for, sorted: those the pre-commit check reads."""
        return sorted(name for name, started in written.items() if not self.vouches(started))

    @contextlib.asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        """``async with keeper.writing():`` -- a writer for the block's duration."""
        hold = await self.write_hold()
        try:
            yield
        finally:
            hold.release()

    def _release(self, kind: str, key: int) -> None:
        with self._mutex:
            if kind == "pin":
                self._pins[key] -= 1
                if self._pins[key] <= 0:
                    del self._pins[key]
            else:
                self._drop_writer(key)
        if self._durable is None:
            return
        if in_loop_thread():
            self._arm_sync()
        else:
            get_loop().call_soon_threadsafe(self._arm_sync)

    # -- writing the lease ----------------------------------------------------------------
    def _fresh(self, d: _Durable | None) -> bool:
        return d is not None and lease_clock() - d.at < TTL / 2

    async def _ensure(self, covered: Callable[[_Durable], bool], *, strict: bool) -> None:
        d = self._durable
        if self.disabled or (self._fresh(d) and covered(d)):  # type: ignore[arg-type]
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            d = self._durable
            if self.disabled or (self._fresh(d) and covered(d)):  # type: ignore[arg-type]
                return
            await self._write(strict=strict)

    def _linger_end(self, d: _Durable | None) -> float | None:
        """When the lingering ``writing`` claim of ``d`` ends (``lease_clock()``,
        :data:`WRITER_LINGER` after the last writer ended), or None: no claim
        lingers (a writer runs, or none ran, or ``d`` says ``writing`` no more)."""
        idle = self._idle_since
        if d is None or not d.writing or idle is None or self.writing_since() is not None:
            return None
        return idle + WRITER_LINGER

    def _lingering(self, d: _Durable | None) -> bool:
        end = self._linger_end(d)
        return end is not None and lease_clock() < end

    def _body(self) -> tuple[dict[str, Any], frozenset[int], bool]:
        versions = frozenset(self.pinned())
        since = self.writing_since()
        # a rewrite while the claim lingers (a pin changed, or it was getting
        # old) keeps it, writing_for 0: it then protects what is modified after
        # mtime(lease) - SLACK
        writing = since is not None or self._lingering(self._durable)
        body = {
            "format": FORMAT, **identity(), "ttl": TTL, "versions": sorted(versions),
            "writing": writing,
            "writing_for": 0.0 if since is None else max(0.0, lease_clock() - since),
        }
        return body, versions, writing

    async def _write(self, *, strict: bool) -> None:
        """Write the lease as the needs are now. ``strict``: a failed write
        raises StorageError (a registration must not return without its lease);
        otherwise (a refresh) it is logged and retried after :data:`RETRY`."""
        t0 = lease_clock()
        body, versions, writing = self._body()
        d = self._durable
        if d is not None:
            # in flight, the store holds the old content or the new: claim only both
            self._durable = _Durable(d.versions & versions, d.writing and writing, d.at)
        if not writing:
            self._chain = None  # the store may say "not writing" from here on
        try:
            await self.base.write(self.name, frame(MAGIC_LEASE, body))
        except (ReadOnlyError, UnsupportedError):
            self.disabled = True  # nothing can be written here: no writer to protect
            return
        except IO_ERRORS as e:
            if strict:
                raise StorageError(
                    f"could not write lease {self.name!r} on {self.base!r} (garbage collection "
                    f"would not know this process needs its objects): {e}"
                ) from e
            log.warning("could not write lease %s on %r: %s", self.name, self.base, e)
            self._retry = True
            return
        self._retry = False
        self._durable = _Durable(versions, writing, t0)
        if writing:
            t1 = lease_clock()
            # stamped by t1; the previous write's lease lived until _last + ttl
            if self._chain is None or d is None or not d.writing or t1 - self._last > TTL * VOUCH:
                self._chain = t1
            self._last = t0
        if self._refresher is None:
            self._refresher = asyncio.ensure_future(self._refresh())

    def _arm_sync(self) -> None:
        """(Loop thread) write what the lease claims after LINGER, once."""
        if self._sync_armed or self._durable is None:
            return
        self._sync_armed = True
        loop = asyncio.get_running_loop()
        loop.call_later(LINGER, lambda: asyncio.ensure_future(self._sync()))

    async def _sync(self, *, refresh: bool = False) -> None:
        """Bring the lease object in line with the needs: delete it when there
        are none (a ``writing`` claim: once its linger ended), rewrite it when it
        claims more than needed, on refresh while needed, and when a lingering
        claim would otherwise turn ``TTL / 2`` old within its linger."""
        self._sync_armed = False
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            d = self._durable
            if d is None:
                return
            versions, writers = frozenset(self.pinned()), self.writing_since() is not None
            lingering = self._lingering(d)
            if lingering:
                self._arm_linger_end()
            writing = writers or lingering
            if not versions and not writing:
                # nothing counts as durable from here on: a registration arriving
                # while the delete is in flight waits for the lock and writes anew
                self._durable = None
                self._chain = None
                try:
                    await self.base.delete(self.name)
                except IO_ERRORS as e:
                    # harmless: a lease nobody refreshes expires after its TTL
                    log.debug("could not delete lease %s on %r (it expires in %g s): %s",
                              self.name, self.base, TTL, e)
            elif (refresh and (versions or writers or (lingering and self._stale_in_linger(d)))
                  or versions != d.versions or writing != d.writing):
                await self._write(strict=False)

    def _stale_in_linger(self, d: _Durable) -> bool:
        """Whether the lingering claim ``d`` turns ``TTL / 2`` old before the
        linger ends and before the next refresh: only then is it rewritten (a
        registration would have to write it), not at every refresh."""
        end = self._linger_end(d)
        stale = d.at + TTL / 2
        next_refresh = lease_clock() + (RETRY if self._retry else REFRESH)
        return end is not None and stale < end and stale <= next_refresh

    def _arm_linger_end(self) -> None:
        """(Loop thread) bring the lease in line with the needs when the
        lingering claim ends (it is deleted then, or rewritten without it)."""
        end = self._linger_end(self._durable)
        if end is None:
            return
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        self._linger_timer = asyncio.get_running_loop().call_later(
            max(0.0, end - lease_clock()), lambda: asyncio.ensure_future(self._sync()))

    async def _refresh(self) -> None:
        try:
            while self._durable is not None:
                await asyncio.sleep(RETRY if self._retry else REFRESH)
                await self._sync(refresh=True)
        finally:
            self._refresher = None

    async def release_all(self) -> None:
        """Delete the lease object now (process exit), a lingering claim too."""
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self._durable is not None:
            self._chain = None
            with contextlib.suppress(Exception):
                await self.base.delete(self.name)
            self._durable = None


def _after_fork_in_child() -> None:
    # the parent's lease is the parent's: the child starts without one
    for k in list(_keepers):
        k._mutex = threading.Lock()
        k._reset()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _release_at_exit() -> None:
    live = [k for k in list(_keepers) if k._durable is not None]
    if not live:
        return

    async def run() -> None:
        await asyncio.gather(*(k.release_all() for k in live))

    with contextlib.suppress(Exception):
        run_sync(run(), timeout=2.0)


at_exit_before_pools(_release_at_exit)
