"""How the processes of a multi-process save name it, and tell each other that it failed.

**Names.** Each save's coordination keys live under a namespace that every
process derives from what it knows before anything can fail: the step and the
attempt, the number of save calls for that step this process has made
(``tsp/checkpoint/step-<step>-attempt-<k>``). Every process of a job makes the
same save calls, so a save that fails on one process only (a device out of
memory during staging, decided per process by ``staging="auto"``) leaves every
process at the same attempt, and the next save (of another step, or a retry of
this one) meets its peers.

**Failures.** A process that fails before its part is delivered publishes its
failure where the others wait, so that they fail fast with a
:class:`ParticipantFailedError` naming it and its error, instead of waiting for
``commit_timeout``:

* process 0, before it has published the transaction id: under
  ``<namespace>/txn`` (where every other process waits first);
* any other process: under the transaction's fragment key
  (``tsp/<txn_id>/fragment/<i>``, where process 0 waits for its part), after
  learning the transaction id from ``<namespace>/txn``. Process 0 then records the
  failure of the transaction and every other process hears it from the result.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

from tensorstore_py.checkpoint.coordination import Coordinator
from tensorstore_py.core.errors import DataCorruptionError, ParticipantFailedError
from tensorstore_py.core.pools import run_io
from tensorstore_py.kvstore.versioned.fragments import fragment_key, participant_failure

__all__ = ["next_namespace", "publish_failure", "txn_id_from"]

_lock = threading.Lock()
_attempts: dict[int, int] = {}


def next_namespace(step: int) -> str:
    """The coordination namespace of this process's next save of ``step`` (advances
    the attempt count of ``step``: call it once per save, before anything can fail)."""
    with _lock:
        k = _attempts[step] = _attempts.get(step, 0) + 1
    return f"tsp/checkpoint/step-{step}-attempt-{k}"


def txn_id_from(value: str, namespace: str, count: int) -> str:
    """The transaction id process 0 published under ``<namespace>/txn``; raises
    :class:`ParticipantFailedError` when it published its failure there instead."""
    if not value.startswith("{"):
        return value
    try:
        body = json.loads(value)["failed"]
        error, message = str(body["error"]), str(body["message"])
    except (ValueError, KeyError, TypeError):
        raise DataCorruptionError(f"{namespace}/txn holds neither a transaction id nor a failure: "
                                  f"{value!r:.200}") from None
    raise ParticipantFailedError(
        f"checkpoint save {namespace}: process 0 of {count} failed before the commit "
        f"({error}: {message}); nothing was committed",
        process_index=0, cause=error,
    )


async def publish_failure(
    coordinator: Coordinator, namespace: str, error: BaseException, timeout: float, txn_id: str | None = None
) -> None:
    """Tell the other processes that this one's part of the save in ``namespace``
    failed with ``error`` (see the module docstring). Best effort: a key already
    published (the part was delivered) or a coordinator that fails is ignored;
    the others then fall back to ``commit_timeout``. Waits for the transaction id
    (up to ``timeout`` s) when this process is not process 0 and ``txn_id`` is
    not known yet."""
    p = coordinator.process_index
    with contextlib.suppress(Exception):
        if p == 0 and txn_id is None:
            await run_io(coordinator.publish, f"{namespace}/txn", participant_failure(0, error))
            return
        if txn_id is None:
            deadline = time.monotonic() + timeout
            value = await run_io(coordinator.wait_for, f"{namespace}/txn", max(1.0, deadline - time.monotonic()))
            if value.startswith("{"):
                return  # process 0 failed too: nobody waits for this part
            txn_id = value
        if p > 0:
            await run_io(coordinator.publish, fragment_key(txn_id, p), participant_failure(p, error))

