"""Where a restore's chunk reads land, and how their bytes reach the results.

A restore (``restoring.read_regions``) plans one :class:`ChunkRead` per stored
chunk it needs, each serving one or more :class:`Request` s (a leaf's region).
:func:`plan_buffers` decides where each chunk's bytes land:

* ``"store"``: a buffer of the store's (chunks under :data:`POOL_MIN_BYTES`);
* ``"result"``: a fresh block that IS its one request's result (the chunk is
  exactly that block);
* ``"rows"``: the contiguous bytes of its one request's host result that the
  chunk fills (whole rows): read or decoded straight into them, no copy;
* ``"slot"``: a slot of the shared host pool (hostpool.py), copied from by
  :func:`deliver` and given back once every copy or device transfer from it is
  complete. No result views a slot.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.assembly import DeviceBlock
from tensorstore_py.checkpoint.hostpool import HostLease, HostPool, shared_pool
from tensorstore_py.checkpoint.layout import LeafLayout, Region, c_strides, region_shape, span_in_chunk
from tensorstore_py.core.buffers import mapped_empty
from tensorstore_py.core.pools import run_cpu, run_io

__all__ = ["POOL_MIN_BYTES", "ChunkRead", "Request", "deliver", "destinations", "lease_slots",
           "little_endian", "own_copy", "plan_buffers"]

#: a copy of this many bytes or more into a result runs on the CPU pool
COPY_IN_POOL = 1 << 20


@dataclass
class Request:
    """One leaf's region a restore returns: into ``out`` (host), or to ``sink``."""

    leaf: LeafLayout
    region: Region
    out: np.ndarray | None = None  # allocated unless served directly by one chunk or a sink
    direct: bool = False
    sink: DeviceBlock | None = None  # assembled on a device instead


@dataclass
class ChunkRead:
    """One stored chunk a restore reads, and the requests it serves."""

    leaf: LeafLayout
    grid: tuple[int, ...]
    consumers: list[tuple[Request, Region]]  # (request, overlap in global coordinates)
    span: tuple[int, int] = (0, 0)
    #: where its bytes land (``plan_buffers``): "store" (a buffer of the store's:
    #: small chunks), "result" (the one request's own block), "rows" (the bytes
    #: of its request's result that it fills, contiguous there: :attr:`rows`) or
    #: "slot" (a slot of the host pool, given back once delivered)
    lands: str = "store"
    #: for ``lands == "rows"``: the part of the request's result the span fills
    rows: np.ndarray | None = None

    def into_result(self) -> bool:
        """The chunk is exactly the block of its one request (no device sink)."""
        return len(self.consumers) == 1 and self.consumers[0][0].direct and self.consumers[0][0].sink is None

    def rows_of_result(self) -> np.ndarray | None:
        """The part of its one request's host result that the chunk's span fills,
        where both are contiguous (the overlap is whole rows of the chunk and of
        the result, e.g. a chunk of rows of a block assembled on the host): the
        span is then read (or decoded) straight into it. None otherwise."""
        if len(self.consumers) != 1:
            return None
        req, ov = self.consumers[0]
        if req.sink is not None or req.out is None:
            return None
        part = req.out[tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(ov, req.region))]
        # the span covers exactly the overlap's elements (C order in the chunk)
        # and they are contiguous in the result: the same bytes in the same order
        if not part.flags.c_contiguous or part.nbytes != self.span[1] - self.span[0]:
            return None
        return part


def little_endian(dtype: np.dtype) -> np.dtype:
    """Stored bytes are little endian."""
    return dtype if sys.byteorder == "little" or dtype.itemsize == 1 else dtype.newbyteorder("<")


#: chunks this large or larger land in the result or in a slot of the host
#: pool (hostpool.py); smaller ones in buffers of the store, as before
POOL_MIN_BYTES = 1 << 20


def plan_buffers(crs: list[ChunkRead], budget: int) -> HostPool | None:
    """Decide where each chunk read lands (:attr:`ChunkRead.lands`) and return
    the shared host pool for those landing in slots (None: no slots needed).
    A chunk that is exactly its request's block is read (or decoded) straight
    into a fresh block, and one that fills contiguous bytes of its request's
    host result (whole rows) straight into them: that is host memory of the
    result, not of the restore. Packed leaves are read per pack, from the
    store's buffers."""
    largest = 0
    for cr in crs:
        n = cr.span[1] - cr.span[0]
        if cr.leaf.packed is not None or n < POOL_MIN_BYTES:
            continue
        if cr.into_result():
            cr.lands = "result"
            continue
        rows = cr.rows_of_result()
        if rows is not None:
            cr.lands, cr.rows = "rows", rows
            continue
        cr.lands = "slot"
        largest = max(largest, n)
    return shared_pool(largest, budget) if largest else None


async def lease_slots(pool: HostPool | None, crs: list[ChunkRead]) -> HostLease | None:
    """One slot for each chunk of the batch that lands in a slot, all at once
    (waits while the pool's slots are held by other batches)."""
    need = sum(cr.lands == "slot" for cr in crs)
    if not need or pool is None:
        return None
    return await pool.acquire(need)


def destinations(crs: list[ChunkRead], lease: HostLease | None) -> dict[int, memoryview]:
    """The buffer each chunk's bytes land in, by ``id``: a slot of ``lease`` or a
    fresh block for its request (set as that request's result)."""
    out: dict[int, memoryview] = {}
    slot = 0
    for cr in crs:
        n = cr.span[1] - cr.span[0]
        if cr.lands == "slot":
            assert lease is not None
            out[id(cr)] = lease.buffers[slot][:n].data
            slot += 1
        elif cr.lands == "result":
            block = mapped_empty(n)  # page-aligned: on CPU devices the array aliases it
            out[id(cr)] = block.data
        elif cr.lands == "rows":
            assert cr.rows is not None
            out[id(cr)] = cr.rows.reshape(-1).view(np.uint8).data
    return out


async def deliver(cr: ChunkRead, buf: Any) -> None:
    """Hand the chunk's bytes ``buf`` to its requests. A slot of the host pool
    (``cr.lands == "slot"``) is only ever copied from: no result views it."""
    if cr.lands == "rows":  # read or decoded into the result's rows already
        assert cr.rows is not None
        dest = cr.rows.reshape(-1).view(np.uint8)
        got = np.frombuffer(buf, np.uint8)
        if got.ctypes.data != dest.ctypes.data:  # a store or codec that kept its own buffer
            np.copyto(dest, got)
        return
    borrowed = cr.lands == "slot"
    leaf = cr.leaf
    dt = little_endian(leaf.dtype)
    cs = leaf.chunk_shape
    origin = tuple(g * c for g, c in zip(cr.grid, cs))
    strides = tuple(s * dt.itemsize for s in c_strides(cs))
    for req, ov in cr.consumers:
        start = span_in_chunk(ov, origin, cs, dt.itemsize)[0] if cs else 0
        view = np.ndarray(
            region_shape(ov), dtype=dt, buffer=buf, offset=start - cr.span[0], strides=strides
        )
        if req.sink is not None:
            dst = None if req.direct else tuple(
                slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(ov, req.region)
            )
            # to the device while other spans are read
            await run_io(req.sink.put, dst, view, borrowed)
            continue
        if req.direct:
            req.out = own_copy(view) if borrowed else view
            continue
        assert req.out is not None
        dst = tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(ov, req.region))
        if view.nbytes >= COPY_IN_POOL:
            await run_cpu(np.copyto, req.out[dst], view)
        else:
            req.out[dst] = view


def own_copy(view: np.ndarray) -> np.ndarray:
    out = mapped_empty(view.shape, view.dtype)
    np.copyto(out, view)
    return out
