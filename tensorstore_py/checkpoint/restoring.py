"""Restoring one step: plan the regions this process needs, read each byte once.

For every requested ``(leaf, region)`` the overlapping chunks are found; for each
chunk the requests of all local devices are merged into one bounding box and
only the contiguous byte span holding that box is read (the whole chunk — and
then its crc32c is checked by the versioned store — when the target sharding
matches the saved one). A region that is exactly one chunk is returned as a view
of the read buffer, without a copy.

Blocks for ``jax.Array`` targets are put together where ``assemble`` says
(assembly.py): in host memory and then transferred (``"host"``; zero-copy on
CPU devices), or on the device itself, each piece transferred as soon as it is
read while the next spans are being read (``"device"``; host memory then holds
only the read buffers in flight). ``"auto"`` picks the device for accelerators.

Everything is read from one snapshot (the newest version when the restore
starts), so a concurrent save or deletion can not mix steps. Reads run under a
bytes-in-flight budget. A chunk of 1 MiB or more lands where it is needed: a
chunk that is exactly its request's block is read (or decoded) straight into
that block, one that fills whole rows of its request's host result straight
into those rows; any other is read into a slot of the shared host pool
(hostpool.py: equal-size buffers within the budget, reused across restores and
saves), delivered from there and its slot given back once every copy or device
transfer from it is complete. No result views a slot. A compressed chunk
counts its stored bytes against the budget beside its slot.

A target leaf of another dtype than the stored one is an error unless the
caller asks for the conversion (``cast=True``: numpy ``astype``), checked for
every leaf before anything is read.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.assembly import (
    Assemble,
    DeviceBlock,
    assemble_on_device,
    check_assemble,
    put_whole_blocks,
)
from tensorstore_py.checkpoint.chunk_landing import (
    ChunkRead,
    Request,
    deliver,
    destinations,
    lease_slots,
    little_endian,
    plan_buffers,
)
from tensorstore_py.checkpoint.compression import chunk_codec
from tensorstore_py.checkpoint.entries import scalar_value
from tensorstore_py.checkpoint.jax_adapter import (
    assemble_all,
    global_array,
    is_sharded_target,
    target_regions,
)
from tensorstore_py.checkpoint.layout import (
    LeafLayout,
    Region,
    chunk_key,
    chunks_overlapping,
    region_shape,
    span_in_chunk,
)
from tensorstore_py.checkpoint.packed_restore import PackedTargets, one_device, restore_packed
from tensorstore_py.checkpoint.packing import check_leaf
from tensorstore_py.checkpoint.prng import from_key_data, is_prng_key
from tensorstore_py.checkpoint.pytree import flatten_target, unflatten
from tensorstore_py.checkpoint.storage import StepStore, read_spans
from tensorstore_py.core.budget import ByteBudget, run_bounded
from tensorstore_py.core.buffers import mapped_empty
from tensorstore_py.core.errors import DataCorruptionError, InvalidArgumentError, NotFoundError
from tensorstore_py.core.future import run_sync
from tensorstore_py.core.gcpause import gc_paused
from tensorstore_py.core.pools import run_cpu, run_io
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.progress import Progress

__all__ = ["ReadStats", "read_regions", "restore_step"]


@dataclass
class ReadStats:
    """What a restore read (chunk bytes; index and metadata reads not counted)."""

    bytes_read: int = 0
    bytes_needed: int = 0
    requests: int = 0


async def read_regions(
    data: KvStore,
    requests: list[tuple[LeafLayout, Region]],
    *,
    max_bytes_in_flight: int = 512 << 20,
    stats: ReadStats | None = None,
    progress: Progress | None = None,
    sinks: list[DeviceBlock | None] | None = None,
) -> list[np.ndarray | None]:
    """Read each ``(leaf, region)`` from ``data`` (the step's keys); C-order arrays.
    ``progress`` gets the bytes to read as its total and advances as they arrive.

    A request with a sink (``sinks[i]``) gets its pieces delivered to it as they
    are read (each ``put`` waits for its transfer, inside the budget) and None
    in the result.
    """
    stats = stats if stats is not None else ReadStats()
    reqs = [Request(leaf, region) for leaf, region in requests]
    for r, sink in zip(reqs, sinks or []):
        r.sink = sink
    chunk_reads: dict[tuple[str, tuple[int, ...]], ChunkRead] = {}
    for r in reqs:
        leaf = r.leaf
        shape = region_shape(r.region)
        stats.bytes_needed += math.prod(shape) * leaf.dtype.itemsize
        if math.prod(shape) == 0:
            r.out = np.empty(shape, dtype=little_endian(leaf.dtype))
            continue
        if leaf.chunk_shape == leaf.shape and all(lo == 0 and hi == n for (lo, hi), n in zip(r.region, shape)):
            overlaps = [((0,) * len(shape), r.region)]  # the whole leaf, one chunk (every small leaf)
        else:
            overlaps = chunks_overlapping(r.region, leaf.chunk_shape) if leaf.shape else [((), ())]
        for grid, ov in overlaps:
            cr = chunk_reads.get((leaf.key, grid))
            if cr is None:
                cr = chunk_reads[(leaf.key, grid)] = ChunkRead(leaf, grid, [])
            cr.consumers.append((r, ov))
        if len(overlaps) == 1 and region_shape(overlaps[0][1]) == tuple(leaf.chunk_shape):
            r.direct = True
        elif r.sink is None:
            # a mapping in 4 KiB pages from 4 MiB on (core/buffers.py)
            r.out = mapped_empty(shape, little_endian(leaf.dtype))
    codecs: dict[str, Any] = {}  # leaf key -> its compressor (compressed leaves only)
    for cr in chunk_reads.values():
        cs = cr.leaf.chunk_shape
        if cr.leaf.codecs:
            # a compressed chunk is read and decoded whole
            if cr.leaf.key not in codecs:
                codecs[cr.leaf.key] = chunk_codec(list(cr.leaf.codecs), cr.leaf.dtype, cs,
                                                  where=f"checkpoint leaf {cr.leaf.key!r}")
            cr.span = (0, math.prod(cs) * cr.leaf.dtype.itemsize)
            continue
        if not cs:
            cr.span = (0, cr.leaf.dtype.itemsize)
            continue
        if len(cr.consumers) == 1 and cr.consumers[0][0].direct:
            cr.span = (0, math.prod(cs) * cr.leaf.dtype.itemsize)  # the whole chunk
            continue
        union = tuple(
            (min(ov[d][0] for _, ov in cr.consumers), max(ov[d][1] for _, ov in cr.consumers))
            for d in range(len(cs))
        )
        origin = tuple(g * c for g, c in zip(cr.grid, cs))
        cr.span = span_in_chunk(union, origin, cs, cr.leaf.dtype.itemsize)

    pool = plan_buffers(list(chunk_reads.values()), max_bytes_in_flight)

    def size(crs: list[ChunkRead]) -> int:
        return sum(cr.span[1] - cr.span[0] for cr in crs)

    def cost(crs: list[ChunkRead]) -> int:
        # a compressed chunk decoded into a slot holds its stored bytes beside the slot
        return size(crs) + sum(cr.span[1] for cr in crs if cr.lands == "slot" and cr.leaf.key in codecs)

    async def decoded(cr: ChunkRead, dest: memoryview | None) -> Any:
        key = chunk_key(cr.leaf.key, cr.grid)
        stored = (await read_spans(data, [(key, 0, 0, True)], whole=True))[0]
        stats.bytes_read += len(stored)
        if progress is not None:
            progress.advance(cr.span[1])
        full = cr.span[1]
        codec = codecs[cr.leaf.key]
        return await run_cpu(lambda: codec.decode(stored, key=key, size=full, limit=full, out=dest))

    async def batch(crs: list[ChunkRead]) -> None:
        lease = await lease_slots(pool, crs)
        try:
            await batch_in(crs, destinations(crs, lease))
        finally:
            if lease is not None:
                lease.release()  # every delivery (copy or transfer) is done

    async def batch_in(crs: list[ChunkRead], dests: dict[int, memoryview]) -> None:
        packed = [cr for cr in crs if cr.leaf.key in codecs]
        if packed:  # decoded in parallel on the CPU pool
            crs = [cr for cr in crs if cr.leaf.key not in codecs]
            got = await asyncio.gather(*(decoded(cr, dests.get(id(cr))) for cr in packed))
            for cr, buf in zip(packed, got):
                key = chunk_key(cr.leaf.key, cr.grid)
                if len(buf) != cr.span[1]:
                    raise DataCorruptionError(
                        f"checkpoint chunk {key!r}: decodes to {len(buf)} bytes, expected {cr.span[1]}"
                    )
                await deliver(cr, buf)
            if not crs:
                return
        packed = [cr for cr in crs if cr.leaf.packed is not None]
        if packed:
            crs = [cr for cr in crs if cr.leaf.packed is None]
            await _read_packed(data, packed, stats, progress)
            if not crs:
                return
        spans = []
        for cr in crs:
            full = math.prod(cr.leaf.chunk_shape) * cr.leaf.dtype.itemsize
            spans.append((chunk_key(cr.leaf.key, cr.grid), cr.span[0], cr.span[1], cr.span == (0, full)))
        into = [dests.get(id(cr)) for cr in crs]
        bufs = await read_spans(data, spans, into=into if any(d is not None for d in into) else None)
        stats.requests += 1
        for cr, buf, (key, a, b, _w) in zip(crs, bufs, spans):
            if len(buf) != b - a:
                raise DataCorruptionError(
                    f"checkpoint chunk {key!r}: read {len(buf)} bytes, expected {b - a}"
                )
            stats.bytes_read += len(buf)
            if progress is not None:
                progress.advance(len(buf))
            await deliver(cr, buf)

    # batches of about a quarter of the budget: large enough to coalesce many small
    # chunks into few requests, small enough to keep several in flight
    limit = max(max_bytes_in_flight // 4, 1 << 20)
    # and at most a quarter of the pool's slots each (at least one), so that
    # several batches share the slots and none waits for more than exist
    slots_limit = max(1, pool.capacity // 4) if pool is not None else 0
    batches: list[list[ChunkRead]] = []
    cur: list[ChunkRead] = []
    acc = slots = 0
    for cr in chunk_reads.values():
        n = cr.span[1] - cr.span[0]
        in_slot = cr.lands == "slot"
        if cur and (acc + n > limit or (in_slot and slots + 1 > slots_limit)):
            batches.append(cur)
            cur, acc, slots = [], 0, 0
        cur.append(cr)
        acc += n
        slots += in_slot
    if cur:
        batches.append(cur)
    if progress is not None:
        progress.add_total(sum(size(b) for b in batches))
    try:
        await run_bounded(batches, batch, budget=ByteBudget(max_bytes_in_flight), cost=cost)
    finally:
        if pool is not None:
            # a restore is rare and the job that follows wants its memory: the free
            # slots go back to the system (saves keep theirs, they come again)
            pool.trim()
    return [r.out for r in reqs]


async def _read_packed(
    data: KvStore, crs: list[ChunkRead], stats: ReadStats, progress: Progress | None
) -> None:
    """Read the chunks of packed leaves (packing.py): per pack ONE read of the
    bytes that these leaves need, each leaf's part a view of it; a leaf read
    whole is checked against its crc32c."""
    by_pack: dict[str, list[ChunkRead]] = {}
    for cr in crs:
        assert cr.leaf.packed is not None
        by_pack.setdefault(cr.leaf.packed[0], []).append(cr)
    spans = []
    for key, members in by_pack.items():
        lo = min(cr.leaf.packed[1] + cr.span[0] for cr in members)  # type: ignore[index]
        hi = max(cr.leaf.packed[1] + cr.span[1] for cr in members)  # type: ignore[index]
        spans.append((key, lo, hi, False))
    bufs = await read_spans(data, spans)
    stats.requests += 1
    whole: list[tuple[DeviceBlock, np.ndarray]] = []  # leaves assembled on a device, whole
    for (key, lo, hi, _w), buf, members in zip(spans, bufs, by_pack.values()):
        if len(buf) != hi - lo:
            raise DataCorruptionError(f"checkpoint pack {key!r}: read {len(buf)} bytes, expected {hi - lo}")
        mv = memoryview(buf).cast("B")
        for cr in members:
            packed = cr.leaf.packed
            assert packed is not None
            part = mv[packed[1] + cr.span[0] - lo: packed[1] + cr.span[1] - lo]
            # the bytes of the leaves (padding between them is read like a coalescing gap)
            stats.bytes_read += len(part)
            if progress is not None:
                progress.advance(len(part))
            if cr.span == (0, cr.leaf.nbytes):
                check_leaf(packed, cr.leaf.key, part)
            sinks = [req.sink for req, _ov in cr.consumers if req.sink is not None and req.direct]
            if sinks and len(sinks) == len(cr.consumers):
                view = np.frombuffer(part, dtype=little_endian(cr.leaf.dtype)).reshape(cr.leaf.chunk_shape)
                whole += [(sink, view) for sink in sinks]
                continue
            await deliver(cr, part)
    if whole:
        await run_io(put_whole_blocks, whole)  # ONE transfer for the batch's small leaves


@gc_paused()
def restore_step(
    store: StepStore,
    step: int | None,
    target: Any,
    *,
    max_bytes_in_flight: int = 512 << 20,
    stats: ReadStats | None = None,
    progress: Progress | None = None,
    cast: bool = False,
    assemble: Assemble = "auto",
) -> Any:
    """Restore ``step`` (None: the newest) into the shape of ``target`` (None: numpy).

    A target leaf whose dtype differs from the stored one raises
    InvalidArgumentError (before anything is read) unless ``cast`` is True.

    Blocking (call from a user thread). Planning and the final JAX calls run in
    the calling thread; the reads run on the library's event loop, and with
    device assembly the transfers of pieces run on I/O threads as they arrive.
    The garbage collector is paused meanwhile (core/gcpause.py: a few objects
    per leaf, thousands of leaves).
    """
    check_assemble(assemble)
    step, manifest, data = run_sync(store.open_step(step))
    entries = manifest["leaves"]
    sinks: list[DeviceBlock | None] = []
    # packed leaves wanted whole on the host or on one device: packed_restore.py
    packed = PackedTargets()
    counts = stats if stats is not None else ReadStats()

    def read(requests: list[tuple[LeafLayout, Region]]) -> list[np.ndarray | None]:
        async def both() -> list[np.ndarray | None]:
            if packed.layouts:
                await restore_packed(data, packed.layouts, packed.place, max_bytes_in_flight=max_bytes_in_flight,
                                     counts=counts, progress=progress)
            return await read_regions(
                data, requests, max_bytes_in_flight=max_bytes_in_flight, stats=counts, progress=progress,
                sinks=sinks,
            )
        return run_sync(both())

    if target is None:
        requests: list[tuple[LeafLayout, Region]] = []
        slots: list[int] = []
        for e in entries:
            if e["kind"] != "python":
                leaf = LeafLayout.from_json(e)
                if leaf.packed is not None:
                    slots.append(~packed.add(leaf, leaf.dtype.newbyteorder("="), None))
                    continue
                slots.append(len(requests))
                requests.append((leaf, tuple((0, n) for n in leaf.shape)))
        read_out = read(requests)
        stored = iter(slots)
        values: list[Any] = []
        for e in entries:
            if e["kind"] == "python":
                values.append(scalar_value(e["value"]))
            else:
                k = next(stored)
                a = packed.out[~k] if k < 0 else _native(read_out[k])  # type: ignore[arg-type]
                if "prng" in e:
                    a = from_key_data(a, e["prng"], None, f"checkpoint step {step}: leaf {e['path']}")
                values.append(a[()] if e["kind"] == "numpy_scalar" else a)
        return unflatten(manifest["tree"], values)

    by_path = {e["path"]: e for e in entries}
    pairs, rebuild = flatten_target(target)
    requests = []
    plans: list[tuple[str, Any]] = []
    regions_cache: dict[Any, Any] = {}
    where_cache: dict[Any, bool] = {}
    for path, t in pairs:
        e = by_path.get(path)
        if e is None:
            raise NotFoundError(
                f"checkpoint step {step}: no leaf {path or '<root>'} (the target asks for it); "
                f"stored leaves: {sorted(by_path)[:10]}{' ...' if len(by_path) > 10 else ''}"
            )
        if e["kind"] == "python":
            plans.append(("value", scalar_value(e["value"])))
            continue
        leaf = LeafLayout.from_json(e)
        if is_prng_key(t):  # rebuilt from its key data (prng.py)
            where = f"checkpoint step {step}: leaf {path}"
            plans.append(("prng", (len(requests), e.get("prng"), t, where)))
            requests.append((leaf, tuple((0, n) for n in leaf.shape)))
            sinks.append(None)
            continue
        tshape = getattr(t, "shape", None)
        if tshape is not None and tuple(tshape) != leaf.shape:
            raise InvalidArgumentError(
                f"checkpoint step {step}: leaf {path} has shape {leaf.shape}, the target "
                f"expects {tuple(tshape)}"
            )
        tdtype = np.dtype(t.dtype) if hasattr(t, "dtype") else leaf.dtype
        if not cast and tdtype.newbyteorder("=") != leaf.dtype.newbyteorder("="):
            raise InvalidArgumentError(
                f"checkpoint step {step}: leaf {path} is stored as {leaf.dtype}, the target asks "
                f"for {tdtype}; pass cast=True to convert it (numpy astype: narrowing rounds or "
                f"wraps), or give a target of dtype {leaf.dtype}"
            )
        if is_sharded_target(t):
            sharding, dev_regions = target_regions(t, regions_cache)
            on_device = where_cache.get(sharding)
            if on_device is None:  # many leaves share a sharding
                on_device = where_cache[sharding] = assemble_on_device(assemble, sharding)
            if leaf.packed is not None and not on_device and len(dev_regions) == 1 and one_device(sharding):
                plans.append(("packed", (packed.add(leaf, tdtype, sharding), False)))
                continue
            uniq: dict[Region, int] = {}
            for d, reg in dev_regions:
                if reg not in uniq:  # several local devices, one read
                    uniq[reg] = len(requests)
                    requests.append((leaf, reg))
                    sinks.append(DeviceBlock(d, region_shape(reg), tdtype) if on_device else None)
            kind = "device" if on_device else "jax"
            plans.append((kind, (t, sharding, [(d, uniq[reg]) for d, reg in dev_regions], tdtype)))
        elif leaf.packed is not None:
            plans.append(("packed", (packed.add(leaf, tdtype, None), isinstance(t, np.generic))))
        else:
            plans.append(("numpy", (len(requests), tdtype, isinstance(t, np.generic))))
            requests.append((leaf, tuple((0, n) for n in leaf.shape)))
            sinks.append(None)
    arrays = read(requests)
    values = []
    to_place: list[tuple[int, Any, Any, list[tuple[Any, np.ndarray]]]] = []
    assembled: list[tuple[int, Any, Any, list[Any]]] = []
    for kind, p in plans:
        if kind == "value":
            values.append(p)
        elif kind == "prng":
            i, prng, t, where = p
            if not isinstance(prng, dict):
                raise InvalidArgumentError(f"{where}: the target asks for PRNG keys {t.dtype}, the "
                                           f"step stores an array of {arrays[i].dtype}")  # type: ignore[union-attr]
            values.append(from_key_data(_native(arrays[i]), prng, t, where))  # type: ignore[arg-type]
        elif kind == "packed":
            i, scalar = p
            values.append(packed.out[i][()] if scalar else packed.out[i])
        elif kind == "numpy":
            i, tdtype, scalar = p
            a = _native(_cast(arrays[i], tdtype))  # type: ignore[arg-type]
            values.append(a[()] if scalar else a)
        elif kind == "device":
            t, sharding, devs, _tdtype = p
            blocks = []
            for d, i in devs:
                sink = sinks[i]
                assert sink is not None
                blocks.append(sink.result() if d == sink.device else sink.to(d))
            assembled.append((len(values), t, sharding, blocks))
            values.append(None)
        else:
            t, sharding, devs, tdtype = p
            converted: dict[int, np.ndarray] = {}
            for _d, i in devs:
                if i not in converted:
                    converted[i] = _cast(arrays[i], tdtype)  # type: ignore[arg-type]
            to_place.append((len(values), t, sharding, [(d, converted[i]) for d, i in devs]))
            values.append(None)
    if to_place:
        placed = assemble_all([(t, s, blocks) for _, t, s, blocks in to_place])
        for (slot, *_), arr in zip(to_place, placed):
            values[slot] = arr
    for slot, t, sharding, blocks in assembled:
        values[slot] = global_array(t, sharding, blocks)
    return rebuild(values)


def _native(a: np.ndarray) -> np.ndarray:
    """Native byte order and writable (a view of an immutable read buffer is copied)."""
    if not a.dtype.isnative:
        return a.astype(a.dtype.newbyteorder("="))
    return a if a.flags.writeable else a.copy()


def _cast(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    return a if a.dtype == dtype else a.astype(dtype)
