"""Saving one step: staging (blocking), then background writes and one commit.

Phases:

1. *Staging* (:func:`snapshot`, in the caller's thread, before ``save``
   returns): the tree is flattened, every leaf gets its layout, and the chunks
   this process must write (``jax.Array`` shards with ``replica_id == 0`` that
   are addressable here; numpy leaves on process 0 only) are taken out of the
   caller's reach: numpy leaves are copied; jax shards are staged as
   ``SaveOptions.staging`` says (staging.py: a host view or copy, a device-side
   snapshot, or one batched copy into pinned host memory within the host
   staging limit, streamed copies beyond it). ``save`` returns when the
   caller's arrays are no longer needed (:attr:`Snapshot.staged`); after that
   the caller may mutate or donate them.
2. *Write* (:func:`run_save`, background): one transaction on the root's
   versioned store — multi-writer when there are several processes. Chunks are
   written under a bytes-in-flight budget; a chunk staged on the device is
   copied to (pinned) host memory inside that budget (a streamed pinned save
   copies a shard that fits the budget whole and cuts it on the host), so the
   copy of one piece overlaps the writes of others, and each chunk's host
   memory is released as soon as it is stored (one data object, fsync'ed once,
   per chunk).
3. *Commit*: the transaction's commit publishes the step atomically (process 0
   merges every process's fragment into ONE version). Process 0 then applies
   retention and tells the others, so that when any process's save completes,
   every process lists the same steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.attempts import publish_failure, txn_id_from
from tensorstore_py.checkpoint.compression import Compression, check_compression, chunk_codec, codecs_json
from tensorstore_py.checkpoint.coordination import Coordinator, SingleProcess
from tensorstore_py.checkpoint.jax_adapter import distributed_coordinator, is_jax_array, shards_to_save
from tensorstore_py.checkpoint.layout import (
    DEFAULT_TARGET_CHUNK_BYTES,
    Region,
    chunk_key,
    chunk_shape_for,
    chunks_overlapping,
    host_copy,
    zarr3_metadata,
)
from tensorstore_py.checkpoint.prng import is_prng_key, key_data
from tensorstore_py.checkpoint.pytree import flatten
from tensorstore_py.checkpoint.staging import (
    Staging,
    check_staging,
    choose_staging,
    chunk_fetcher,
    shard_fetcher,
    stage,
)
from tensorstore_py.checkpoint.storage import StepInfo, StepStore, record_key, step_dir
from tensorstore_py.core.budget import MAX_TASKS, ByteBudget, run_bounded
from tensorstore_py.core.errors import ConditionFailedError, InvalidArgumentError
from tensorstore_py.core.pools import run_copy, run_cpu, run_io
from tensorstore_py.drivers.dtypes import dtype_to_v3, is_variable_length
from tensorstore_py.kvstore.base import Generation, KvStore
from tensorstore_py.kvstore.transaction import Transaction
from tensorstore_py.progress import Progress

__all__ = ["MANIFEST_FORMAT", "SaveOptions", "run_save", "snapshot"]

MANIFEST_FORMAT = "tensorstore_py.checkpoint.manifest/1"
#: the format of a manifest with compressed leaves (entries with ``codecs``);
#: steps without compression keep format 1, which every reader reads
MANIFEST_FORMAT_CODECS = "tensorstore_py.checkpoint.manifest/2"

#: concurrent chunk tasks of a streamed save (each holds its share of the budget)
MAX_STREAMED_TASKS = 4096


@dataclass(frozen=True, slots=True)
class SaveOptions:
    """Tuning of a save. Sizes in bytes, times in seconds."""

    #: chunks of a shard are at most this large (shards are split along leading axes)
    target_chunk_bytes: int = DEFAULT_TARGET_CHUNK_BYTES
    #: leaves at least this large also get a ``zarr.json``, so the array layer (or
    #: any zarr v3 reader over the versioned store) opens them as zarr v3 arrays;
    #: smaller ones are described by the step manifest alone (one key fewer each,
    #: which matters for thousands of small leaves)
    zarr_metadata_min_bytes: int = 1 << 20
    #: bytes handed to the store at once; 1 GiB keeps a local disk busy (512 MiB
    #: left it idle between waves). With "device" staging (and streamed
    #: "pinned_host" staging) this is also all the host memory the writes hold:
    #: chunks are copied off the device inside this budget. With "host" staging
    #: chunks are views of the host copy, so it bounds the store's work in
    #: progress, not new host memory
    max_bytes_in_flight: int = 1 << 30
    #: host staging limit of "pinned_host" staging, separate from the write
    #: budget: a state this process saves of at most this many bytes is copied
    #: off the devices at once (one batched copy; save() blocks for the copy
    #: alone), a larger one streams under ``max_bytes_in_flight`` (logged).
    #: None: half of the host's available RAM when the save starts
    #: (staging.default_staging_bytes)
    max_staging_bytes: int | None = None
    #: how long the processes of a multi-process save wait for each other
    commit_timeout: float = 600.0
    #: how long a save still in flight when the interpreter exits may take to
    #: commit before it is abandoned (aborted, with a warning; inflight.py)
    exit_timeout: float = 300.0
    #: where jax shards are staged before ``save()`` returns: "auto", "device"
    #: (a device-side snapshot streamed to the host in the background),
    #: "pinned_host" (chunk by chunk into pinned host memory) or "host" (all
    #: of it in host memory; a zero-copy view on CPU devices). See staging.py
    staging: Staging = "auto"
    #: chunk compression: None (raw chunks), "zstd" or "zstd-bitshuffle" (blosc:
    #: bit shuffle + zstd, for floats); encoded in the background, described in
    #: each leaf's zarr v3 metadata. See compression.py for the choice of default
    compression: Compression = None

    def __post_init__(self) -> None:
        check_staging(self.staging)
        check_compression(self.compression)
        if self.max_staging_bytes is not None and (
            isinstance(self.max_staging_bytes, bool) or not isinstance(self.max_staging_bytes, int)
            or self.max_staging_bytes < 0
        ):
            raise InvalidArgumentError(
                f"SaveOptions.max_staging_bytes must be an int >= 0 or None; got {self.max_staging_bytes!r}"
            )


@dataclass(slots=True)
class _Chunk:
    key: str
    data: np.ndarray | None  # C-contiguous chunk, full chunk shape
    nbytes: int
    #: a chunk staged on a device: copies it to the host (blocking, on an I/O thread)
    fetch: Callable[[], np.ndarray] | None = None
    #: the fetch reads the caller's array (streamed "pinned_host" staging)
    reads_caller: bool = False
    #: a whole shard fetched at once and cut into chunks on the host: per chunk
    #: its key and how to cut it from the fetched shard (``key`` is then unused)
    cuts: list[tuple[str, Callable[[np.ndarray], np.ndarray]]] | None = None
    #: small host chunks written by one task, one after the other (``key`` unused)
    batch: list[_Chunk] | None = None
    #: the leaf's compressor (None: raw chunks)
    codec: Any = None


@dataclass(slots=True)
class Snapshot:
    """What one process saves: the manifest (same on every process) and its chunks."""

    structure: dict[str, Any]
    leaves: list[dict[str, Any]]
    chunks: list[_Chunk] = field(default_factory=list)
    zarr_json: dict[str, dict[str, Any]] = field(default_factory=dict)  # process 0 writes
    nbytes: int = 0
    #: the staging mode used for jax shards ("auto" resolved)
    staging: str = "host"
    #: set once no chunk needs the caller's arrays any more (or the save ended)
    staged: threading.Event = field(default_factory=threading.Event)
    #: chunks still to be copied from the caller's arrays
    unstaged: int = 0
    #: what staging holds for the chunks' views (pinned copies), dropped on release
    holds: list[Any] = field(default_factory=list)

    def manifest(self) -> dict[str, Any]:
        fmt = MANIFEST_FORMAT_CODECS if any("codecs" in e for e in self.leaves) else MANIFEST_FORMAT
        return {"format": fmt, "tree": self.structure, "leaves": self.leaves}

    def chunk_staged(self) -> None:
        """One chunk that read the caller's array is off the device."""
        self.unstaged -= 1
        if self.unstaged <= 0:
            self.staged.set()

    def release(self) -> None:
        """The save ended (committed or failed): drop what is staged (device memory)
        and release a caller still waiting for the staging."""
        self.chunks = []
        self.holds = []
        self.staged.set()


def _scalar_json(x: Any) -> dict[str, Any]:
    if isinstance(x, bool):
        return {"py": "bool", "v": x}
    if isinstance(x, int):
        return {"py": "int", "v": str(x)}  # str: JSON readers lose big ints
    if isinstance(x, float):
        return {"py": "float", "v": repr(x)}
    if isinstance(x, complex):
        return {"py": "complex", "v": [repr(x.real), repr(x.imag)]}
    if isinstance(x, str):
        return {"py": "str", "v": x}
    return {"py": "bytes", "v": bytes(x).hex()}


_STORABLE: dict[np.dtype, str] = {}  # dtype -> its zarr v3 name, for the dtypes checked once


def _check_storable(path: str, dtype: Any) -> str:
    """The zarr v3 name of ``dtype``; InvalidArgumentError unless leaves of
    ``dtype`` can be stored as raw chunks."""
    dtype = np.dtype(dtype)
    name = _STORABLE.get(dtype)
    if name is not None:
        return name
    try:
        name = dtype_to_v3(dtype)
        ok = not is_variable_length(dtype)  # raw bytes: no strings or objects (pointers)
    except Exception:
        ok = False
    if ok and name is not None:
        _STORABLE[dtype] = name
        return name
    raise InvalidArgumentError(
        f"checkpoint leaf {path}: dtype {dtype} can not be stored (expected bool, "
        "integer, float, complex, bfloat16, float8, datetime64/timedelta64 or fixed-size "
        "U/S/V)"
    )


def snapshot(
    tree: Any, *, process_index: int, process_count: int = 1, options: SaveOptions, replicas: bool = False
) -> Snapshot:
    """Phase 1: flatten, lay out and stage what this process writes.

    Every leaf is checked before anything is copied. Returns with
    :attr:`Snapshot.staged` set, except with streamed ``"pinned_host"`` staging
    (the state exceeds ``max_staging_bytes``), where the chunks are copied off
    the device by the writes (:func:`run_save`) and the caller waits for
    ``staged`` before it may change its arrays.

    ``replicas=True`` (a local tier's part): every addressable region of a
    ``jax.Array`` is staged, not only those with ``replica_id == 0``.

    In a multi-process job a ``jax.Array`` that lives on this process alone
    (fully addressable, e.g. a step counter made with ``jnp.int32``) is taken
    to be the same on every process, like a numpy leaf, and process 0 writes it.
    """
    pairs, structure = flatten(tree)
    snap = Snapshot(structure=structure, leaves=[])
    # (leaf key, region, chunk shape, dtype, single-device array): staged together below
    on_devices: list[tuple[str, Region, tuple[int, ...], np.dtype, Any]] = []
    leaf_codec: dict[str, Any] = {}  # leaf key -> its compressor (compressed leaves only)
    for i, (path, leaf) in enumerate(pairs):
        entry: dict[str, Any] = {"path": path}
        if isinstance(leaf, (bool, int, float, complex, str, bytes)) and not isinstance(leaf, np.generic):
            entry["kind"] = "python"
            entry["value"] = _scalar_json(leaf)
            snap.leaves.append(entry)
            continue
        if is_prng_key(leaf):  # stored as its key data (prng.py)
            entry["prng"], leaf = key_data(leaf)
        process_local = is_jax_array(leaf) and process_count > 1 and leaf.is_fully_addressable
        parts: list[tuple[Region, Any]]
        if is_jax_array(leaf) and not process_local:
            shape, dtype, shard_shape, parts, sharding = shards_to_save(leaf, replicas=replicas)
            v3 = _check_storable(path, dtype)
            entry["kind"] = "jax"
            if sharding is not None:
                entry["sharding"] = sharding
        elif isinstance(leaf, (np.ndarray, np.generic)) or process_local:
            arr = np.asarray(leaf)
            v3 = _check_storable(path, arr.dtype)  # before copying it
            shape, dtype, shard_shape = arr.shape, arr.dtype, arr.shape
            entry["kind"] = (
                "jax" if process_local else "numpy" if isinstance(leaf, np.ndarray) else "numpy_scalar"
            )
            # numpy leaves are the same on every process: process 0 stores them
            parts = (
                [(tuple((0, n) for n in shape), host_copy(arr))]
                if process_index == 0 else []
            )
        else:
            raise InvalidArgumentError(
                f"checkpoint leaf {path or '<root>'}: unsupported type {type(leaf).__name__}; "
                "expected jax.Array, numpy array/scalar or python scalar"
            )
        dtype = np.dtype(dtype)
        cshape = chunk_shape_for(tuple(shard_shape), dtype.itemsize, target_bytes=options.target_chunk_bytes)
        key = f"a/{i}"
        entry.update(dtype=v3, shape=list(shape), chunk_shape=list(cshape), key=key)
        codecs = codecs_json(options.compression, dtype)
        if codecs:
            entry["codecs"] = codecs
            leaf_codec[key] = chunk_codec(codecs, dtype, cshape, where=f"checkpoint leaf {path}")
        snap.leaves.append(entry)
        nbytes = int(math.prod(shape)) * dtype.itemsize
        snap.nbytes += nbytes
        if process_index == 0 and nbytes >= options.zarr_metadata_min_bytes:
            snap.zarr_json[f"{key}/zarr.json"] = zarr3_metadata(dtype, tuple(shape), cshape, codecs)
        for region, part in parts:
            if isinstance(part, np.ndarray):
                _add_host_chunks(snap, key, part, region, cshape, dtype, leaf_codec.get(key))
            else:
                on_devices.append((key, region, cshape, dtype, part))
    shards = [p[-1] for p in on_devices]
    staged = stage(
        shards, choose_staging(options.staging, shards), staging_limit=options.max_staging_bytes
    )
    snap.staging = staged.mode
    snap.holds = staged.keep or []
    for (key, region, cshape, dtype, _), src in zip(on_devices, staged.sources):
        if isinstance(src, np.ndarray):
            _add_host_chunks(snap, key, src, region, cshape, dtype, leaf_codec.get(key))
            continue
        size = int(math.prod(cshape)) * dtype.itemsize
        grid_subs = chunks_overlapping(region, cshape)
        if staged.streamed and int(src.nbytes) <= options.max_bytes_in_flight:
            # the whole shard in one copy, cut on the host: no slices on the device
            cuts = [
                (chunk_key(key, grid), _cutter(region, sub, cshape, dtype)) for grid, sub in grid_subs
            ]
            snap.chunks.append(_Chunk("", None, size * len(cuts), shard_fetcher(src), True, cuts,
                                      codec=leaf_codec.get(key)))
            snap.unstaged += 1
            continue
        for grid, sub in grid_subs:
            box = None if sub == region else tuple((lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(sub, region))
            fetch = _fetch_chunk(chunk_fetcher(src, box), sub, cshape, dtype)
            snap.chunks.append(_Chunk(chunk_key(key, grid), None, size, fetch, staged.streamed,
                                      codec=leaf_codec.get(key)))
            snap.unstaged += staged.streamed
    if snap.unstaged == 0:
        snap.staged.set()
    return snap


def _cutter(
    region: Region, sub: Region, cshape: tuple[int, ...], dtype: np.dtype
) -> Callable[[np.ndarray], np.ndarray]:
    return lambda host: _chunk_data(host, region, sub, cshape, dtype)


def _add_host_chunks(
    snap: Snapshot, key: str, host: np.ndarray, region: Region, cshape: tuple[int, ...], dtype: np.dtype,
    codec: Any = None,
) -> None:
    if host.shape == cshape and host.flags.c_contiguous and host.dtype.byteorder != ">":
        # the region is one whole chunk (every small leaf): the host array is its data
        grid = tuple(lo // c for (lo, _), c in zip(region, cshape))
        snap.chunks.append(_Chunk(chunk_key(key, grid), host, host.nbytes, codec=codec))
        return
    for grid, sub in chunks_overlapping(region, cshape):
        data = _chunk_data(host, region, sub, cshape, dtype)
        snap.chunks.append(_Chunk(chunk_key(key, grid), data, data.nbytes, codec=codec))


def _fetch_chunk(
    fetch: Callable[[], np.ndarray], sub: Region, cshape: tuple[int, ...], dtype: np.dtype
) -> Callable[[], np.ndarray]:
    """``fetch`` (the host copy of the box ``sub``) as a full, padded chunk."""
    return lambda: _chunk_data(fetch(), sub, sub, cshape, dtype)


def _chunk_data(
    host: np.ndarray, region: Region, sub: Region, cshape: tuple[int, ...], dtype: np.dtype
) -> np.ndarray:
    """The chunk covering ``sub`` (full chunk shape, zero padded at array edges)."""
    view = host[tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(sub, region))]
    if tuple(hi - lo for lo, hi in sub) == cshape:
        data = view if view.flags.c_contiguous else np.ascontiguousarray(view)
    else:
        data = np.zeros(cshape, dtype=dtype)
        data[tuple(slice(0, hi - lo) for lo, hi in sub)] = view
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    return data


def _bytes(a: np.ndarray) -> memoryview:
    return a.reshape(-1).view(np.uint8).data


async def _write_chunks(
    view: KvStore, snap: Snapshot, options: SaveOptions, progress: Progress | None = None
) -> None:
    """Write the snapshot's chunks (and zarr.json documents) under the bytes-in-flight
    budget, copying each chunk staged on a device to the host first (inside the
    budget), and dropping each chunk's host copy as soon as it is stored."""

    async def one(c: _Chunk) -> None:
        if c.fetch is not None:
            fetch, c.fetch = c.fetch, None
            # device -> (pinned) host, inside the budget, on the few threads of the
            # copy pool: the host memory of freed chunks is reused, not kept per
            # I/O thread (core/pools.py copy_pool)
            c.data = await run_copy(fetch)
            del fetch  # the last reference to the staged shard may go now
            if c.reads_caller:
                snap.chunk_staged()
        if c.cuts is not None:
            await _write_cuts(view, c, progress)
            return
        if c.batch is not None:
            batch, c.batch = c.batch, None
            for b in batch:
                assert b.data is not None
                await view.write(b.key, await _encoded(b.data, b.codec))
                if progress is not None:
                    progress.advance(b.nbytes)
            return
        assert c.data is not None
        await view.write(c.key, await _encoded(c.data, c.codec))
        c.data = None  # release the host copy as soon as it is stored
        if progress is not None:
            progress.advance(c.nbytes)

    chunks, snap.chunks = snap.chunks, []
    for k, doc in snap.zarr_json.items():
        body = np.frombuffer(json.dumps(doc).encode(), dtype=np.uint8)
        chunks.append(_Chunk(k, body, body.nbytes))
    # chunks staged on a device leave it as fast as the budget allows, not only as
    # fast as the chunks before them are written (a "pinned_host" caller waits for
    # the last one): the budget bounds them, the task cap is raised
    streamed = any(c.fetch is not None for c in chunks)
    chunks = _batch_small(chunks)
    await run_bounded(
        chunks, one, budget=ByteBudget(options.max_bytes_in_flight), cost=lambda c: c.nbytes,
        max_tasks=max(MAX_TASKS, min(len(chunks), MAX_STREAMED_TASKS)) if streamed else MAX_TASKS,
    )


#: host chunks below this size are written in batches (the versioned store packs
#: them into shared data objects: what costs is the task per chunk, not the bytes)
SMALL_CHUNK_BYTES = 64 << 10
#: bytes of small chunks one task writes
SMALL_BATCH_BYTES = 4 << 20


def _batch_small(chunks: list[_Chunk]) -> list[_Chunk]:
    """``chunks`` with the small ones already on the host grouped into batches."""
    out: list[_Chunk] = []
    cur: list[_Chunk] = []
    acc = 0
    for c in chunks:
        if c.fetch is not None or c.data is None or c.nbytes >= SMALL_CHUNK_BYTES:
            out.append(c)
            continue
        cur.append(c)
        acc += c.nbytes
        if acc >= SMALL_BATCH_BYTES:
            out.append(_Chunk("", None, acc, batch=cur))
            cur, acc = [], 0
    if cur:
        out.append(_Chunk("", None, acc, batch=cur) if len(cur) > 1 else cur[0])
    return out


_ENCODE_IN_POOL = 256 << 10


async def _encoded(data: np.ndarray, codec: Any) -> Any:
    """The stored bytes of a chunk: raw, or compressed by ``codec`` (on the CPU
    pool for large chunks: the codecs release the GIL)."""
    if codec is None:
        return _bytes(data)
    if data.nbytes >= _ENCODE_IN_POOL:
        return await run_cpu(codec.encode, _bytes(data))
    return codec.encode(_bytes(data))


async def _write_cuts(view: KvStore, c: _Chunk, progress: Progress | None) -> None:
    """Write the chunks cut from a whole shard fetched to the host (``c.data``)."""
    host, cuts, c.data, c.cuts = c.data, c.cuts or [], None, None
    assert host is not None

    async def put(key: str, cut: Callable[[np.ndarray], np.ndarray]) -> None:
        data = cut(host)
        await view.write(key, await _encoded(data, c.codec))
        if progress is not None:
            progress.advance(data.nbytes)

    await asyncio.gather(*(put(k, cut) for k, cut in cuts))


async def run_save(
    store: StepStore,
    step: int,
    snap: Snapshot,
    *,
    coordinator: Coordinator,
    namespace: str,
    metrics: dict[str, Any],
    options: SaveOptions,
    on_commit: Callable[[StepInfo], Awaitable[Any]] | None = None,
    progress: Progress | None = None,
) -> StepInfo:
    """Phases 2 and 3 (background). Raises ConditionFailedError if ``step`` exists.
    ``progress`` advances with the bytes of each chunk written. The caller
    releases the snapshot (:meth:`Snapshot.release`) when this ends, however it
    ends."""
    p, n = coordinator.process_index, coordinator.process_count
    timeout = options.commit_timeout
    if n > 1:
        # one fresh id per attempt: a retried save never meets an old attempt's fragments
        if p == 0:
            txn_id = f"ckpt-{step}-{uuid.uuid4().hex}"
            await run_io(coordinator.publish, f"{namespace}/txn", txn_id)
        else:
            txn_id = txn_id_from(await run_io(coordinator.wait_for, f"{namespace}/txn", timeout), namespace, n)
        txn = Transaction(
            txn_id=txn_id, process_index=p, process_count=n, timeout=timeout,
            coordinator=coordinator, message=f"checkpoint step {step}",
            metadata={"checkpoint_step": step},
        )
    else:
        txn = Transaction(message=f"checkpoint step {step}", metadata={"checkpoint_step": step})
    view = store.kv.with_transaction(txn)
    started = time.time()
    committing = False
    try:
        if p == 0:
            record = StepInfo(step=step, time=started, metrics=metrics, process_count=n, nbytes=snap.nbytes)
            try:  # create-only: a step is saved once (a racing save fails at commit)
                await view.write(record_key(step), json.dumps(record.to_json()).encode(),
                                 if_equal=Generation.NO_VALUE)
            except ConditionFailedError as e:
                raise ConditionFailedError(
                    f"checkpoint step {step} already exists at {store.kv!r}"
                ) from e
            await view.write(f"{step_dir(step)}/manifest.json", json.dumps(snap.manifest()).encode())
        await _write_chunks(view.with_path(step_dir(step)), snap, options, progress)
        committing = True
        committed = await txn.commit()
    except BaseException as e:
        if txn.state == "open":
            txn.abort()
        if p == 0 and n > 1 and not committing:
            # the coordinator gives up before the commit: tell the others now
            # (the multi-writer result message, docs/FORMAT.md §7) instead of
            # letting them wait for their timeout
            await _publish_failure(coordinator, txn, e)
        elif p > 0 and not committing:  # process 0 waits for this part: tell it (attempts.py)
            await publish_failure(coordinator, namespace, e, timeout, txn_id=txn.txn_id)
        raise
    info = StepInfo(
        step=step, time=started if p == 0 else committed.time, metrics=metrics, process_count=n,
        nbytes=snap.nbytes, version=committed.version,
    )
    # retention runs before the others are released, so that after any process's
    # save completes every process lists the same steps
    error: BaseException | None = None
    if p == 0:
        if on_commit is not None:
            try:
                await on_commit(info)
            except Exception as e:
                error = e
        if n > 1:
            await run_io(coordinator.publish, f"{namespace}/done", "ok" if error is None else repr(error))
        if error is not None:
            raise error
    else:
        await run_io(coordinator.wait_for, f"{namespace}/done", timeout)
    return info


async def _publish_failure(coordinator: Coordinator, txn: Transaction, error: BaseException) -> None:
    body = {
        "format": 1, "txn_id": txn.txn_id, "version": None, "write_id": None, "time": time.time(),
        "error": type(error).__name__, "message": str(error) or "process 0 abandoned the save (cancelled)",
    }
    with contextlib.suppress(Exception):  # best effort: else the others time out
        await run_io(coordinator.publish, f"tsp/{txn.txn_id}/result", json.dumps(body))
    with contextlib.suppress(Exception):  # those still waiting for process 0's attempt (if not opened)
        await run_io(coordinator.publish, f"tsp/{txn.txn_id}/attempt", json.dumps({"result": body}))


def default_coordinator() -> Coordinator:
    return distributed_coordinator() or SingleProcess()
