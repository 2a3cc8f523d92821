"""Small leaves packed together: one value, one transfer, one write and one read per pack.

A step of thousands of small leaves spends its time per leaf, not per byte: a
key, a task and an index entry each on save, a lookup and a delivery each on
restore. So process 0 packs every array leaf that

* is stored whole as one uncompressed chunk (``chunk_shape == shape``, no
  ``codecs``), of fewer than :data:`PACK_LEAF_BYTES` bytes, and
* is written by process 0 alone (a numpy leaf, or a jax leaf whose one shard
  with ``replica_id == 0`` is addressable there)

into *packs*: values ``p/<n>`` of the step of about :data:`PACK_BYTES` each,
holding the leaves' raw little-endian C-order bytes, each at an offset aligned
to its element size (at most :data:`PACK_ALIGN`). Each such leaf's manifest entry then names where it lies,
``"packed": {"key": "p/0", "offset": 4096, "crc32c": 1234}``, and it has no
chunk keys of its own (manifest format 3, docs/FORMAT.md and
docs/CHECKPOINTS.md). A restore reads the part of a pack that it needs with
one read (a whole pack: one read, checked against the pack's crc32c by the
versioned store) and checks every leaf it takes whole against the leaf's own
crc32c (:func:`check_leaf`).

Leaves staged on a device ("device" staging) are copied to the host by ONE
batched transfer per pack (``staging.host_copies``), not one per leaf.

What a pack write guarantees is what a chunk write does: the pack is written
inside the save's transaction, so the step's leaves become visible together at
its commit, or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.staging import host_copies
from tensorstore_py.core.errors import ChecksumError
from tensorstore_py.core.pools import run_copy
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.versioned.format import crc32c
from tensorstore_py.progress import Progress

__all__ = [
    "PACK_ALIGN",
    "PACK_BYTES",
    "PACK_LEAF_BYTES",
    "Member",
    "Pack",
    "check_leaf",
    "fill_pack",
    "is_packable",
    "packable_host",
    "plan_packs",
    "write_pack",
]

#: leaves smaller than this (stored whole as one raw chunk) are packed
PACK_LEAF_BYTES = 64 << 10
#: a pack holds about this many bytes (a new one starts when the next leaf would overflow it)
PACK_BYTES = 4 << 20
#: a leaf starts at a multiple of its element size in its pack, at most this
#: (aligned views on restore; little padding between tiny leaves)
PACK_ALIGN = 64
#: the step's keys of packs: ``p/0``, ``p/1``, ...
PACKS_PREFIX = "p/"


def is_packable(nbytes: int, *, compressed: bool, process_index: int) -> bool:
    """Whether a leaf stored whole as one chunk of ``nbytes`` is packed (module docstring)."""
    return process_index == 0 and not compressed and 0 < nbytes < PACK_LEAF_BYTES


@dataclass(slots=True)
class Member:
    """One leaf of a pack: its manifest entry (``"packed"`` is filled in by
    :func:`plan_packs` and :func:`fill_pack`) and its bytes, on the host
    (``data``: C-contiguous, little endian) or on a device (``src``: a
    single-device jax array, copied with the rest of the pack)."""

    entry: dict[str, Any]
    nbytes: int
    itemsize: int
    data: np.ndarray | None = None
    src: Any = None
    offset: int = 0


@dataclass(slots=True)
class Pack:
    """One value of packed leaves."""

    key: str
    members: list[Member] = field(default_factory=list)
    nbytes: int = 0


def plan_packs(members: list[Member]) -> list[Pack]:
    """Lay ``members`` out in packs, in order; records each leaf's pack key and
    offset in its manifest entry."""
    packs: list[Pack] = []
    cur: Pack | None = None
    for m in members:
        align = _alignment(m.itemsize)
        start = 0 if cur is None else -(-cur.nbytes // align) * align
        if cur is None or (cur.members and start + m.nbytes > PACK_BYTES):
            cur = Pack(f"{PACKS_PREFIX}{len(packs)}")
            packs.append(cur)
            start = 0
        m.offset = start
        m.entry["packed"] = {"key": cur.key, "offset": start}
        cur.members.append(m)
        cur.nbytes = start + m.nbytes
    return packs


def _alignment(itemsize: int) -> int:
    """The offset alignment of elements of ``itemsize`` bytes (natural, for powers of two)."""
    if itemsize <= 0 or itemsize & (itemsize - 1):
        return 1
    return min(itemsize, PACK_ALIGN)


def fill_pack(pack: Pack, hosts: list[np.ndarray | None]) -> np.ndarray:
    """The bytes of ``pack`` (``hosts[i]``: member ``i``'s host bytes when it had
    a ``src``), with each leaf's crc32c recorded in its manifest entry. Drops the
    members' host arrays. Runs on a worker thread (copies and checksums release
    the GIL)."""
    buf = np.zeros(pack.nbytes, np.uint8)
    for m, h in zip(pack.members, hosts):
        data = m.data if h is None else h
        if data is None:
            raise AssertionError(f"pack {pack.key}: leaf {m.entry.get('path')!r} has no bytes")
        if data.dtype.byteorder == ">":
            data = data.astype(data.dtype.newbyteorder("<"))
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        buf[m.offset:m.offset + m.nbytes] = raw
        m.entry["packed"]["crc32c"] = crc32c(raw)
        m.data = m.src = None
    return buf


def check_leaf(packed: tuple[str, int, int | None], leaf_key: str, raw: Any) -> None:
    """:class:`ChecksumError` (a DataCorruptionError) unless the whole packed leaf
    ``raw`` matches its crc32c."""
    key, offset, want = packed
    if want is None:
        return
    got = crc32c(raw)
    if got != want:
        raise ChecksumError(
            f"checkpoint leaf {leaf_key!r} (packed in {key!r} at offset {offset}): crc32c "
            f"{got:#010x}, expected {want:#010x}"
        )


def packable_host(host: np.ndarray, cshape: tuple[int, ...]) -> bool:
    """A host array that is a whole chunk (C order; :func:`fill_pack` stores it little endian)."""
    return host.shape == cshape and host.flags.c_contiguous


async def write_pack(view: KvStore, pack: Pack, progress: Progress | None) -> None:
    """Write one pack of small leaves: the leaves staged on a device
    come to the host in ONE batched transfer, the pack is filled and checksummed
    on a copy thread and written as one value."""
    srcs = [m.src for m in pack.members if m.src is not None]

    def fill() -> np.ndarray:
        copies = iter(host_copies(srcs) if srcs else [])
        return fill_pack(pack, [next(copies) if m.src is not None else None for m in pack.members])

    buf = await run_copy(fill)
    await view.write(pack.key, memoryview(buf.data))
    if progress is not None:
        progress.advance(sum(m.nbytes for m in pack.members))
    pack.members = []
