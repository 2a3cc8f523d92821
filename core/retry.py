"""Retries with jittered exponential backoff: one policy, one loop.

Backoff is "full jitter" (a uniform delay in ``[0, min(max_delay,
initial_delay * 2**n))``), which spreads out clients that failed together.
See https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/.

:func:`with_retries` runs an attempt function until it succeeds, fails for good
(the caller's ``retry_on`` predicate says which failures are transient) or the
attempts are used up (then :class:`~tensorstore_py.errors.StorageError` names
what was being done, the attempt count and the last cause). A request whose
response was lost may still have taken effect: ``fn`` gets the attempt number so
a caller can tell a first-attempt failure from a possibly-landed retry.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tensorstore_py.core.errors import InvalidSpecError, StorageError

__all__ = ["DEFAULT_RETRY_POLICY", "RetryPolicy", "with_retries"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently to retry.

    ``max_attempts`` counts the first try: 1 disables retries.
    """

    max_attempts: int = 10
    initial_delay: float = 0.05
    max_delay: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise InvalidSpecError(
                f"retries: max_attempts must be an int >= 1, got {self.max_attempts!r}"
            )
        if not isinstance(self.initial_delay, (int, float)) or self.initial_delay < 0:
            raise InvalidSpecError(
                f"retries: initial_delay must be >= 0, got {self.initial_delay!r}"
            )
        if not isinstance(self.max_delay, (int, float)) or self.max_delay < self.initial_delay:
            raise InvalidSpecError(
                f"retries: max_delay must be >= initial_delay ({self.initial_delay}), "
                f"got {self.max_delay!r}"
            )

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1 = the first retry)."""
        # the exponent is capped: 2.0 ** 1024 overflows, and 2 ** 60 is past any max_delay
        cap = min(self.max_delay, self.initial_delay * (2.0 ** min(max(retry - 1, 0), 60)))
        return (rng or _rng).uniform(0.0, cap)

    def to_json(self) -> dict[str, Any]:
        return {
            "max_attempts": self.max_attempts,
            "initial_delay": self.initial_delay,
            "max_delay": self.max_delay,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any] | None) -> RetryPolicy:
        """Parse ``{"max_attempts": n, "initial_delay": s, "max_delay": s}`` (all optional)."""
        if value is None:
            return DEFAULT_RETRY_POLICY
        if not isinstance(value, Mapping):
            raise InvalidSpecError(
                f"retries must be an object like {{'max_attempts': 10}}, got {value!r}"
            )
        unknown = set(value) - {"max_attempts", "initial_delay", "max_delay"}
        if unknown:
            raise InvalidSpecError(f"retries: unknown fields {sorted(unknown)}")
        d = DEFAULT_RETRY_POLICY
        initial = value.get("initial_delay", d.initial_delay)
        return cls(
            max_attempts=value.get("max_attempts", d.max_attempts),
            initial_delay=initial,
            max_delay=value.get("max_delay", max(d.max_delay, initial)),
        )


DEFAULT_RETRY_POLICY = RetryPolicy()
_rng = random.Random()


async def with_retries(
    fn: Callable[[int], Awaitable[T]],
    *,
    what: str,
    policy: RetryPolicy = DEFAULT_RETRY_POLICY,
    retry_on: Callable[[BaseException], bool],
    failed: Exception | None = None,
) -> T:
    """Run ``fn(attempt)`` (attempt = 1, 2, ...) until it succeeds or fails for good.

    Failures for which ``retry_on`` is false propagate unchanged. Transient ones
    are retried after a jittered, exponentially growing delay (at least the
    server's Retry-After hint, capped at ``policy.max_delay``); after
    ``policy.max_attempts`` attempts a :class:`StorageError` naming ``what`` is
    raised from the last failure. ``failed``: the caller already made attempt 1
    itself and it failed with this (it is treated as ``fn(1)`` raising it).
    """
    attempt = 1
    while True:
        try:
            if failed is not None:
                first, failed = failed, None
                raise first
            return await fn(attempt)
        except Exception as e:
            if not retry_on(e):
                raise
            if attempt >= policy.max_attempts:
                raise StorageError(
                    f"{what}: failed after {attempt} attempt(s); last error: "
                    f"{type(e).__name__}: {e}"
                ) from e
            delay = policy.delay(attempt)
            hint = getattr(e, "retry_after", None)
            if hint is not None:
                delay = min(policy.max_delay, max(delay, hint))
            await asyncio.sleep(delay)
            attempt += 1
