"""Values: where they are stored (inline, packed, alone) and reading them back.

* values of at most :data:`INLINE_MAX` bytes live inside the index leaf;
* values of at least :data:`LARGE_MIN` bytes are written alone, immediately
  (a transaction never holds a large value in memory until its commit);
* everything in between is staged in memory and packed many to one data
  object at commit, or when the staging buffer passes :data:`STAGING_MAX`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensorstore_py.kvstore.base import Buffer, ByteRange, Generation, ReadResult
from tensorstore_py.kvstore.versioned.format import (
    Entry,
    InlineEntry,
    RefEntry,
    crc32c,
    new_name,
    new_stamp,
)

from tensorstore_py.errors import ChecksumError, DataCorruptionError
from tensorstore_py.future import run_cpu

__all__ = ["INLINE_MAX", "LARGE_MIN", "STAGING_MAX", "Pending", "Staged", "make_entry", "pack", "read_entry"]

INLINE_MAX = 128
LARGE_MIN = 256 * 1024
STAGING_MAX = 16 * 1024 * 1024
#: a packed data object is cut at this size
PACK_MAX = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True, eq=False)
class Pending:
    """A small value waiting in memory to be packed into a data object."""

    stamp: bytes
    value: bytes


#: what a transaction holds for a written key: an entry, a pending value, or None (deleted)
Staged = Entry | Pending | None


def _crc_of(value: Any) -> int:
    return crc32c(value)


async def make_entry(root: Any, value: Buffer) -> Entry | Pending:
    """Inline, pending, or (for a large value) written now to its own object."""
    n = len(memoryview(value).cast("B")) if not isinstance(value, bytes) else len(value)
    stamp = new_stamp()
    if n <= INLINE_MAX:
        return InlineEntry(stamp, bytes(value))
    if n < LARGE_MIN:
        return Pending(stamp, bytes(value))
    # large values: checksum off the loop (crc32c releases the GIL), then write alone
    crc = await run_cpu(_crc_of, value)
    name = new_name("data")
    await root.write_new(name, value)
    return RefEntry(stamp, name, 0, n, crc)


async def pack(root: Any, items: list[Pending]) -> list[RefEntry]:
    """Write ``items`` packed into as few data objects as possible; their entries."""
    out: list[RefEntry] = []
    objects: list[tuple[str, bytes]] = []
    i = 0
    while i < len(items):
        name = new_name("data")
        parts: list[bytes] = []
        size = 0
        while i < len(items) and (not parts or size + len(items[i].value) <= PACK_MAX):
            p = items[i]
            out.append(RefEntry(p.stamp, name, size, len(p.value), crc32c(p.value)))
            parts.append(p.value)
            size += len(p.value)
            i += 1
        objects.append((name, b"".join(parts)))
    await root.write_all(objects)
    return out


def staged_generation(staged: Staged) -> Generation:
    return Generation.NO_VALUE if staged is None else Generation(staged.stamp)


def _sub_range(length: int, byte_range: ByteRange) -> tuple[int, int]:
    """[start, stop) of ``byte_range`` within a value of ``length`` bytes (clipped)."""
    if byte_range.start < 0:
        return max(0, length + byte_range.start), length
    start = min(byte_range.start, length)
    stop = length if byte_range.stop is None else min(byte_range.stop, length)
    return start, max(start, stop)


async def read_entry(
    root: Any,
    key: str,
    entry: Staged,
    byte_range: ByteRange | None,
    if_not_equal: Generation | None,
) -> ReadResult:
    """Read the value an entry points to, checking its crc32c when read whole."""
    if entry is None:
        return ReadResult.missing()
    gen = Generation(entry.stamp)
    if if_not_equal is not None and if_not_equal == gen:
        return ReadResult("unchanged", b"", gen)
    if isinstance(entry, (InlineEntry, Pending)):
        value = entry.value
        return ReadResult("value", value if byte_range is None else bytes(byte_range.apply(value)), gen)
    if byte_range is None:
        start, stop = 0, entry.length
    else:
        start, stop = _sub_range(entry.length, byte_range)
    if stop == start:
        return ReadResult("value", b"", gen)
    res = await root.base.read(entry.object, byte_range=ByteRange(entry.offset + start, entry.offset + stop))
    if res.state != "value":
        raise DataCorruptionError(
            f"versioned store {root.base!r}: key {key!r}: data object {entry.object!r} is missing"
        )
    value = res.value
    if len(value) != stop - start:
        raise DataCorruptionError(
            f"versioned store {root.base!r}: key {key!r}: data object {entry.object!r} is truncated "
            f"(expected {stop - start} bytes at offset {entry.offset + start}, got {len(value)})"
        )
    if byte_range is None:
        crc = await run_cpu(_crc_of, value) if len(value) >= LARGE_MIN else crc32c(value)
        if crc != entry.crc:
            raise ChecksumError(
                f"versioned store {root.base!r}: key {key!r}: crc32c mismatch in data object "
                f"{entry.object!r} at offset {entry.offset} (stored {entry.crc:#010x}, computed {crc:#010x})"
            )
    return ReadResult("value", value, gen)
