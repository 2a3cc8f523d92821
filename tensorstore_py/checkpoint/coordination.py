"""How the processes of one save agree: the coordination-object protocol.

The versioned store's multi-writer commit (docs/FORMAT.md §7.1) needs a
barrier / broadcast service with two blocking calls, ``publish(key, value)`` and
``wait_for(key, timeout) -> value``. A checkpoint :class:`Coordinator` is such
an object that also knows the process's index and the process count; the
checkpoint layer uses it for the transaction id (process 0 -> all) and the
"retention done" signal, and hands it to the transaction for the fragments.

:class:`JaxCoordinator` implements it with ``jax.distributed``'s key-value store
(made by :func:`tensorstore_py.checkpoint.jax_adapter.distributed_coordinator`);
MPI, torch.distributed or a Redis can implement the same four members. Keys are
unique per save, so each key is published once.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol, runtime_checkable

from tensorstore_py.core.errors import DeadlineExceededError, InvalidArgumentError
from tensorstore_py.kvstore.transaction import Barrier

__all__ = ["ABANDONED", "Coordinator", "JaxCoordinator", "SingleProcess"]

#: set at interpreter exit when saves in flight are abandoned (inflight.py):
#: :meth:`JaxCoordinator.wait_for` then gives up within :data:`WAIT_SLICE` seconds
ABANDONED = threading.Event()

#: a JaxCoordinator waits in slices this long, to notice :data:`ABANDONED`
WAIT_SLICE = 1.0


@runtime_checkable
class Coordinator(Barrier, Protocol):
    """The processes of one job (blocking calls, made from worker threads)."""

    process_index: int
    process_count: int

    def publish(self, key: str, value: str) -> None:
        """Make ``value`` visible under ``key`` to every process."""

    def wait_for(self, key: str, timeout: float) -> str:
        """The value of ``key`` once published; raise on ``timeout`` seconds."""


class SingleProcess:
    """The coordinator of a one-process job."""

    process_index = 0
    process_count = 1

    def publish(self, key: str, value: str) -> None:
        return None

    def wait_for(self, key: str, timeout: float) -> str:
        raise InvalidArgumentError(f"single-process coordinator has no peers to wait for ({key!r})")


class JaxCoordinator:
    """Coordination through ``jax.distributed``'s key-value store."""

    def __init__(self, client: Any, process_index: int, process_count: int) -> None:
        self.client = client
        self.process_index = process_index
        self.process_count = process_count

    def publish(self, key: str, value: str) -> None:
        self.client.key_value_set(key, value)

    def wait_for(self, key: str, timeout: float) -> str:
        """Waits in slices of :data:`WAIT_SLICE` seconds, so that a save abandoned
        at interpreter exit does not hold the exit for the whole ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            step = min(WAIT_SLICE, max(0.0, deadline - time.monotonic()))
            try:
                return str(self.client.blocking_key_value_get(key, max(1, int(step * 1000))))
            except Exception as e:  # jaxlib raises its own error type on a deadline
                text = str(e)
                if "DEADLINE" not in text.upper() and "timed out" not in text.lower():
                    raise
                if ABANDONED.is_set():
                    raise DeadlineExceededError(
                        f"jax.distributed key {key!r}: the wait was abandoned at interpreter exit"
                    ) from e
                if time.monotonic() >= deadline:
                    raise DeadlineExceededError(
                        f"jax.distributed key {key!r} not published within {timeout} s"
                    ) from e

    def __repr__(self) -> str:
        return f"JaxCoordinator(process {self.process_index} of {self.process_count})"
