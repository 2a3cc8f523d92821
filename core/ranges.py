"""Byte ranges of stored values and the buffers that hold them.

:class:`ByteRange` is the one value type for "bytes ``[start, stop)`` of a value,
or its last ``n`` bytes", used by every store and driver; :func:`coalesce`
groups nearby ranges into fewer requests.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from tensorstore_py.core.errors import InvalidArgumentError

__all__ = ["Buffer", "ByteRange", "coalesce"]

#: what stores accept and return as a value: any bytes-like object
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``[start, stop)`` of a value; ``start < 0`` with ``stop=None`` is a suffix.

    ``ByteRange(2, 10)`` is bytes 2..9, ``ByteRange(5)`` is from byte 5 to the end,
    ``ByteRange(-16)`` is the last 16 bytes. A range that extends past the end of
    the value is clipped; one that starts past the end reads as empty.
    """

    start: int = 0
    stop: int | None = None

    def __post_init__(self) -> None:
        # integers only (numpy integers are taken as ints): a float or a string
        # bound is the caller's mistake, reported as one, never truncated
        object.__setattr__(self, "start", _bound(self.start, "start", self))
        if self.stop is not None:
            object.__setattr__(self, "stop", _bound(self.stop, "stop", self))
        if self.start < 0 and self.stop is not None:
            raise InvalidArgumentError(
                f"byte range: a suffix (negative start {self.start}) takes no stop, got {self.stop}"
            )
        if self.stop is not None and self.stop < self.start:
            raise InvalidArgumentError(
                f"byte range: stop {self.stop} is before start {self.start}"
            )

    @staticmethod
    def of(r: slice | ByteRange | None) -> ByteRange | None:
        """Normalise ``slice(a, b)``, ``slice(-n, None)`` or a ByteRange; None = whole."""
        if r is None or isinstance(r, ByteRange):
            return r
        if isinstance(r, slice):
            if r.step not in (None, 1):
                raise InvalidArgumentError(f"byte range: step must be 1, got {r.step}")
            start = 0 if r.start is None else _bound(r.start, "start", r)
            stop = None if r.stop is None else _bound(r.stop, "stop", r)
            if start < 0 and stop is not None:
                raise InvalidArgumentError(
                    f"byte range {r}: a suffix range is slice(-n, None)"
                )
            if stop is not None and stop < 0:
                raise InvalidArgumentError(f"byte range {r}: negative stop")
            if start == 0 and stop is None:
                return None
            return ByteRange(start, stop)
        raise InvalidArgumentError(f"byte range must be a slice or ByteRange, got {r!r}")

    def clip(self, size: int) -> tuple[int, int]:
        """``(start, stop)`` of this range in a value of ``size`` bytes (clipped)."""
        if self.start < 0:
            return max(0, size + self.start), size
        stop = size if self.stop is None else min(self.stop, size)
        return min(self.start, size), stop

    def apply(self, data: Buffer) -> Buffer:
        """This range of ``data`` (clipped), without copying memoryviews."""
        start, stop = self.clip(len(data))
        return data[start:stop]


def _bound(value: Any, what: str, where: Any) -> int:
    """``value`` as an int, or InvalidArgumentError naming the range (bools,
    floats, strings and None are refused; numpy integers are accepted)."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"byte range {where!r}: {what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgumentError(
            f"byte range {where!r}: {what} must be an integer, got {type(value).__name__} {value!r}"
        ) from None


def coalesce(
    ranges: list[ByteRange], gap: int
) -> list[tuple[ByteRange, list[int]]]:
    """Group ranges into requests: bounded ranges closer than ``gap`` merge."""
    groups: list[tuple[ByteRange, list[int]]] = []
    bounded = sorted(
        (i for i, r in enumerate(ranges) if r.start >= 0 and r.stop is not None),
        key=lambda i: ranges[i].start,
    )
    cur_start = cur_stop = -1
    members: list[int] = []
    for i in bounded:
        r = ranges[i]
        assert r.stop is not None
        if members and r.start <= cur_stop + gap:
            cur_stop = max(cur_stop, r.stop)
            members.append(i)
        else:
            if members:
                groups.append((ByteRange(cur_start, cur_stop), members))
            cur_start, cur_stop, members = r.start, r.stop, [i]
    if members:
        groups.append((ByteRange(cur_start, cur_stop), members))
    for i, r in enumerate(ranges):
        if not (r.start >= 0 and r.stop is not None):
            groups.append((r, [i]))
    return groups
