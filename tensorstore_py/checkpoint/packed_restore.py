"""Restoring packed small leaves whole (packing.py): per pack ONE read, each
leaf a view of it checked against its crc32c, placed in batches.

A restore takes this path for every packed leaf that it wants whole on one
device assembled on the host (a one-device jax target: the small leaves of a
CPU restore, or any with ``assemble="host"``), or as a numpy array. Compared
with the general planner (restoring.py: a request, a chunk read and a delivery
object per leaf) it costs one pass over the leaves: the packs are read in
batches of about a quarter of the restore's bytes-in-flight budget, each batch
handed whole to the caller's ``deliver`` on an I/O thread (one batched transfer
to the devices) while the next batch is read. The views given to ``deliver``
share the read buffers: ``deliver`` must copy what it keeps (packed leaves are
small), so that a buffer is never aliased by a restored array once
``deliver`` returns.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from tensorstore_py.checkpoint.jax_adapter import put_blocks
from tensorstore_py.checkpoint.layout import LeafLayout
from tensorstore_py.checkpoint.packing import check_leaf
from tensorstore_py.checkpoint.storage import read_spans
from tensorstore_py.core.budget import ByteBudget, run_bounded
from tensorstore_py.core.errors import DataCorruptionError
from tensorstore_py.core.pools import run_io
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.progress import Progress

__all__ = ["PackSpan", "PackedTargets", "leaf_views", "one_device", "plan_pack_reads", "restore_packed"]

_LITTLE = sys.byteorder == "little"
#: a batch of pack reads holds about this share of the budget (several in flight)
_BATCH_SHARE = 4


class _Counts(Protocol):
    bytes_read: int
    bytes_needed: int
    requests: int


#: one read: (pack key, [indices of its leaves], start, stop)
PackSpan = tuple[str, list[int], int, int]


def plan_pack_reads(layouts: list[LeafLayout]) -> list[PackSpan]:
    """Per pack the span that its leaves among ``layouts`` need (one read each)."""
    by_pack: dict[str, list[int]] = {}
    for i, lay in enumerate(layouts):
        assert lay.packed is not None
        by_pack.setdefault(lay.packed[0], []).append(i)
    out: list[PackSpan] = []
    for key, idx in by_pack.items():
        lo = min(layouts[i].packed[1] for i in idx)  # type: ignore[index]
        hi = max(layouts[i].packed[1] + layouts[i].nbytes for i in idx)  # type: ignore[index]
        out.append((key, idx, lo, hi))
    return out


def leaf_views(buf: Any, lo: int, layouts: list[LeafLayout]) -> list[np.ndarray]:
    """Read-only arrays (stored dtype, little endian) of the packed leaves
    ``layouts`` in ``buf``, the bytes of their pack from offset ``lo``; each
    checked against its crc32c (:class:`ChecksumError` naming the leaf)."""
    mv = memoryview(buf).cast("B")
    out = []
    for lay in layouts:
        packed = lay.packed
        assert packed is not None
        start = packed[1] - lo
        n = lay.nbytes
        check_leaf(packed, lay.key, mv[start:start + n])
        dt = lay.dtype if _LITTLE or lay.dtype.itemsize == 1 else lay.dtype.newbyteorder("<")
        out.append(np.frombuffer(mv, dtype=dt, count=n // dt.itemsize, offset=start).reshape(lay.shape))
    return out


async def restore_packed(
    data: KvStore,
    layouts: list[LeafLayout],
    deliver: Callable[[list[int], list[np.ndarray]], None],
    *,
    max_bytes_in_flight: int,
    counts: _Counts,
    progress: Progress | None = None,
) -> None:
    """Read the packed leaves ``layouts`` whole from ``data`` (the step's keys)
    and call ``deliver(indices, views)`` (blocking, on an I/O thread) once per
    batch of packs, ``views[k]`` being leaf ``layouts[indices[k]]`` (module
    docstring: ``deliver`` copies what it keeps). Raises
    :class:`DataCorruptionError` naming the pack when it is missing or short,
    :class:`ChecksumError` naming the first leaf whose bytes do not match."""
    spans = plan_pack_reads(layouts)
    limit = max(max_bytes_in_flight // _BATCH_SHARE, 1 << 20)
    batches: list[list[PackSpan]] = []
    cur: list[PackSpan] = []
    acc = 0
    for sp in spans:
        if cur and acc + (sp[3] - sp[2]) > limit:
            batches.append(cur)
            cur, acc = [], 0
        cur.append(sp)
        acc += sp[3] - sp[2]
    if cur:
        batches.append(cur)
    for lay in layouts:
        counts.bytes_needed += lay.nbytes
    if progress is not None:
        progress.add_total(sum(lay.nbytes for lay in layouts))

    async def batch(group: list[PackSpan]) -> None:
        bufs = await read_spans(data, [(key, lo, hi, False) for key, _idx, lo, hi in group])
        counts.requests += 1
        indices: list[int] = []
        views: list[np.ndarray] = []
        for (key, idx, lo, hi), buf in zip(group, bufs):
            if len(buf) != hi - lo:
                raise DataCorruptionError(
                    f"checkpoint pack {key!r}: read {len(buf)} bytes, expected {hi - lo} (offset {lo})"
                )
            members = [layouts[i] for i in idx]
            views += leaf_views(buf, lo, members)
            indices += idx
            got = sum(lay.nbytes for lay in members)
            counts.bytes_read += got
            if progress is not None:
                progress.advance(got)
        await run_io(deliver, indices, views)

    await run_bounded(batches, batch, budget=ByteBudget(max_bytes_in_flight),
                      cost=lambda g: sum(hi - lo for _k, _i, lo, hi in g))


def one_device(sharding: Any) -> bool:
    """A sharding whose one device holds the whole array."""
    try:
        return len(sharding.device_set) == 1
    except Exception:
        return False


class PackedTargets:
    """The packed leaves a restore reads whole and where each goes; its
    :meth:`place` is the ``deliver`` of :func:`restore_packed`."""

    def __init__(self) -> None:
        self.layouts: list[LeafLayout] = []
        #: per leaf: its dtype (the target's) and its one-device sharding (None: numpy)
        self.to: list[tuple[np.dtype, Any]] = []
        self.out: list[Any] = []  # the restored arrays

    def add(self, leaf: LeafLayout, dtype: np.dtype, sharding: Any) -> int:
        self.layouts.append(leaf)
        self.to.append((dtype, sharding))
        self.out.append(None)
        return len(self.layouts) - 1

    def place(self, indices: list[int], views: list[np.ndarray]) -> None:
        """Views of read buffers as arrays of their own:
        numpy copies, or jax arrays put by ONE batched transfer, waited for, that
        never alias the buffers (on CPU devices ``device_put`` may)."""
        on_dev: list[int] = []
        blocks: list[np.ndarray] = []
        shardings: list[Any] = []
        for i, v in zip(indices, views):
            dtype, sharding = self.to[i]
            a = _as_dtype(v, dtype)
            if sharding is not None:
                on_dev.append(i)
                blocks.append(a)
                shardings.append(sharding)
            else:
                self.out[i] = a.copy() if a is v else a
        if blocks:
            for i, x in zip(on_dev, put_blocks(blocks, shardings, copy=True)):
                self.out[i] = x


def _as_dtype(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a`` (stored bytes, little endian) in native byte order as ``dtype``
    (numpy ``astype``: the restore's ``cast``); ``a`` itself when it is that already."""
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    return a if a.dtype == dtype else a.astype(dtype)
