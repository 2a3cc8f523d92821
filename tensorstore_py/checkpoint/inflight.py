"""Saves in flight, and what becomes of them when the interpreter exits.

A save's copies, writes and commit run on the library's event loop after
``save()`` returned; that loop runs on a daemon thread, which nothing waits for.
Every save in flight is registered here, and at interpreter exit (the main
thread returns or calls ``sys.exit``; before the thread pools stop and before
leases are released) each one is given up to its ``SaveOptions.exit_timeout``
seconds, counted from the start of the exit, to commit. Waiting is logged
(logger ``tensorstore_py.checkpoint``). A save still running after that is
abandoned: it is cancelled, its transaction aborted (nothing of it becomes
visible: the step is absent, or whole if its commit record was already being
written), the other processes of a multi-process save are told, and a warning
names the step. Objects it wrote are unreferenced and garbage collection
deletes them. The interpreter then exits normally; a save never makes it abort.

``os._exit``, signals and crashes skip this: the step is then absent or whole,
never partial (the commit is one atomic write).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

# imported first so that its exit hook (releasing leases) is registered before
# ours, and therefore runs after ours: a save still commits under its leases
import tensorstore_py.kvstore.versioned.leases  # noqa: F401
from tensorstore_py.checkpoint.coordination import ABANDONED
from tensorstore_py.core.errors import DeadlineExceededError
from tensorstore_py.core.future import Future
from tensorstore_py.core.pools import at_exit_before_pools

__all__ = ["ABANDON_GRACE", "finish_at_exit", "track"]

log = logging.getLogger("tensorstore_py.checkpoint")

#: seconds an abandoned save is given to abort (and tell its peers) after it is cancelled
ABANDON_GRACE = 10.0


@dataclass(frozen=True, slots=True)
class _InFlight:
    what: str  # "checkpoint step 7 at <store>"
    future: Future[Any]
    exit_timeout: float


_lock = threading.Lock()
_inflight: dict[int, _InFlight] = {}


def track(future: Future[Any], *, what: str, exit_timeout: float) -> None:
    """Register background work of a save (``what`` names it in messages) until it ends."""
    entry = _InFlight(what, future, exit_timeout)
    with _lock:
        _inflight[id(entry)] = entry

    def done(_f: Future[Any]) -> None:
        with _lock:
            _inflight.pop(id(entry), None)

    future.add_done_callback(done)


def _wait(entry: _InFlight, deadline: float) -> bool:
    """True when ``entry`` ended by ``deadline`` (successfully or not: a failure is logged)."""
    try:
        entry.future.result(timeout=max(0.0, deadline - time.monotonic()))
    except DeadlineExceededError:
        if not entry.future.done():
            return False
        log.warning("%s failed while the interpreter exited", entry.what, exc_info=True)
    except BaseException as e:  # the save's own error: nobody else will see it now
        log.warning("%s failed while the interpreter exited: %s: %s", entry.what, type(e).__name__, e)
    else:
        log.info("%s finished at interpreter exit", entry.what)
    return True


def finish_at_exit() -> None:
    """Wait for every save in flight (each up to its ``exit_timeout``), then abandon
    those still running (see the module docstring). Never raises."""
    with _lock:
        # a future's done-callbacks run after its waiters wake: one that a caller
        # has just waited for may still be listed, and is not in flight
        entries = [e for e in _inflight.values() if not e.future.done()]
    if not entries:
        return
    start = time.monotonic()
    for e in entries:
        log.warning("interpreter exiting while %s is in flight: waiting up to %s s for it "
                    "(SaveOptions.exit_timeout)", e.what, e.exit_timeout)
    late = [e for e in entries if not _wait(e, start + e.exit_timeout)]
    if late:
        ABANDONED.set()  # coordination waits on I/O threads end too (the pools are joined next)
    for e in late:
        e.future.cancel()
    grace = time.monotonic() + ABANDON_GRACE
    for e in late:
        try:
            e.future.result(timeout=max(0.0, grace - time.monotonic()))
        except BaseException:  # cancelled, as asked (or it failed while aborting)
            pass
        log.warning("%s was abandoned at interpreter exit: it did not finish within exit_timeout=%s s; "
                    "its transaction was aborted, so the step is absent (or whole, if its commit was "
                    "already being written), never partial; garbage collection deletes what it wrote",
                    e.what, e.exit_timeout)


at_exit_before_pools(finish_at_exit)
