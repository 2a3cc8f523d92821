"""Read-modify-write of one stored value: how often a lost race is retried.

A partial-chunk write (and a resize's metadata update) reads the value, changes
it and writes it back on condition that its generation is unchanged. Losing
that race means another writer got there first: read and merge again after a
full-jitter backoff (up to 1 ms, doubling to at most 50 ms) that spreads the
competing writers out. The async engine and the blocking fast path share it.
"""

from __future__ import annotations

from tensorstore_py.core.errors import ConditionFailedError
from tensorstore_py.core.retry import RetryPolicy

__all__ = ["RMW_RETRY", "rmw_lost"]

#: attempts (the first included) and backoff: ``RMW_RETRY.delay(attempt)``
#: seconds after losing attempt number ``attempt`` (1, 2, ...)
RMW_RETRY = RetryPolicy(max_attempts=200, initial_delay=0.001, max_delay=0.05)


def rmw_lost(key: str) -> ConditionFailedError:
    """The error once every attempt to update chunk ``key`` lost its race."""
    return ConditionFailedError(
        f"chunk {key!r}: read-modify-write lost the race {RMW_RETRY.max_attempts} times"
    )
