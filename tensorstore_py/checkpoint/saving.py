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
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.attempts import publish_failure, txn_id_from
from tensorstore_py.checkpoint.chunk_writes import Chunk as _Chunk
from tensorstore_py.checkpoint.chunk_writes import write_chunks
from tensorstore_py.checkpoint.compression import Compression, check_compression, chunk_codec, codecs_json
from tensorstore_py.checkpoint.coordination import Coordinator, SingleProcess
from tensorstore_py.checkpoint.dedup import Incremental, digests_key, load_previous
from tensorstore_py.checkpoint.entries import check_storable, scalar_json
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
from tensorstore_py.checkpoint.packing import Member, Pack, is_packable, packable_host, plan_packs
from tensorstore_py.checkpoint.prng import is_prng_key, key_data
from tensorstore_py.checkpoint.pytree import flatten
from tensorstore_py.checkpoint.staging import (
    Staging,
    check_staging,
    choose_staging,
    chunk_fetcher,
    chunk_filler,
    fills_on_host,
    shard_fetcher,
    stage,
)
from tensorstore_py.checkpoint.storage import StepInfo, StepStore, record_key, step_dir
from tensorstore_py.core.errors import ConditionFailedError, InvalidArgumentError
from tensorstore_py.core.gcpause import gc_paused
from tensorstore_py.core.pools import run_io
from tensorstore_py.kvstore.base import Generation, KvStore
from tensorstore_py.kvstore.transaction import Transaction
from tensorstore_py.kvstore.versioned.staging import read_from
from tensorstore_py.progress import Progress

__all__ = ["MANIFEST_FORMAT", "SaveOptions", "run_save", "snapshot", "write_documents"]

MANIFEST_FORMAT = "tensorstore_py.checkpoint.manifest/1"
#: the format of a manifest with compressed leaves (entries with ``codecs``);
#: steps without compression keep format 1, which every reader reads
MANIFEST_FORMAT_CODECS = "tensorstore_py.checkpoint.manifest/2"
#: the format of a manifest with packed leaves (entries with ``packed``: packing.py)
MANIFEST_FORMAT_PACKED = "tensorstore_py.checkpoint.manifest/3"


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
    #: pack small leaves (raw, one chunk, under 64 KiB, written by process 0)
    #: into shared values of about 4 MiB: one write and one read per pack
    #: instead of one per leaf (packing.py). Such a step's manifest is format 3,
    #: which versions of this library before packing can not read; False keeps
    #: one chunk key per leaf (formats 1 and 2)
    pack_small_leaves: bool = True
    #: incremental saves: a chunk whose bytes equal the previous step's chunk at the
    #: same place of the same leaf (equal xxh3_128 digests) is linked to that
    #: step's stored value instead of written again. Hashing costs a few percent
    #: of a full save (dedup.py), so it is on by default
    incremental: bool = True

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
    #: leaf key -> (path, jax.Array) of the jax leaves: an incremental save links
    #: the chunks of an array it saved last time without reading them (dedup.py)
    arrays: dict[str, tuple[str, Any]] = field(default_factory=dict)
    #: small leaves packed together (packing.py): one value each, written with the chunks
    packs: list[Pack] = field(default_factory=list)

    def manifest(self) -> dict[str, Any]:
        """The step manifest; complete once the packs are written (their leaves'
        crc32c are recorded as they are filled)."""
        fmt = (
            MANIFEST_FORMAT_PACKED if self.packs
            else MANIFEST_FORMAT_CODECS if any("codecs" in e for e in self.leaves) else MANIFEST_FORMAT
        )
        return {"format": fmt, "tree": self.structure, "leaves": self.leaves}

    def chunk_bytes(self) -> int:
        """Bytes of array data this process writes (chunks and packed leaves)."""
        return sum(c.nbytes for c in self.chunks) + sum(m.nbytes for p in self.packs for m in p.members)

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
        self.packs = []
        self.arrays = {}
        self.staged.set()


@gc_paused()
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

    Runs with the garbage collector paused (core/gcpause.py): a few objects per
    leaf, thousands of leaves.
    """
    pairs, structure = flatten(tree)
    snap = Snapshot(structure=structure, leaves=[])
    # (leaf key, region, chunk shape, dtype, single-device array): staged together below
    on_devices: list[tuple[str, Region, tuple[int, ...], np.dtype, Any]] = []
    leaf_codec: dict[str, Any] = {}  # leaf key -> its compressor (compressed leaves only)
    # leaf key -> its manifest entry, for the leaves packed with others (packing.py)
    packable: dict[str, dict[str, Any]] = {}
    members: list[Member] = []
    kinds: dict[tuple[Any, ...], _LeafKind] = {}
    for i, (path, leaf) in enumerate(pairs):
        entry: dict[str, Any] = {"path": path}
        if isinstance(leaf, (bool, int, float, complex, str, bytes)) and not isinstance(leaf, np.generic):
            entry["kind"] = "python"
            entry["value"] = scalar_json(leaf)
            snap.leaves.append(entry)
            continue
        if is_prng_key(leaf):  # stored as its key data (prng.py)
            entry["prng"], leaf = key_data(leaf)
        on_jax = is_jax_array(leaf)
        process_local = on_jax and process_count > 1 and leaf.is_fully_addressable
        parts: list[tuple[Region, Any]]
        if on_jax and not process_local:
            shape, dtype, shard_shape, parts, sharding = shards_to_save(leaf, replicas=replicas)
            v3 = check_storable(path, dtype)
            entry["kind"] = "jax"
            if sharding is not None:
                entry["sharding"] = sharding
        elif isinstance(leaf, (np.ndarray, np.generic)) or process_local:
            arr = np.asarray(leaf)
            v3 = check_storable(path, arr.dtype)  # before copying it
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
        key = f"a/{i}"
        if on_jax:
            snap.arrays[key] = (path, leaf)
        kind = kinds.get((shape, dtype, shard_shape))
        if kind is None:  # thousands of leaves share a few shapes and dtypes
            kind = kinds[(shape, dtype, shard_shape)] = _LeafKind.of(
                tuple(shape), dtype, tuple(shard_shape), options, process_index)
        cshape, codecs, nbytes = kind.chunk_shape, kind.codecs, kind.nbytes
        # the JSON lists of a kind are shared by its leaves' entries (never changed)
        entry.update(dtype=v3, shape=kind.shape_json, chunk_shape=kind.chunk_shape_json, key=key)
        if codecs:
            entry["codecs"] = codecs
            leaf_codec[key] = chunk_codec(codecs, dtype, cshape, where=f"checkpoint leaf {path}")
        snap.leaves.append(entry)
        snap.nbytes += nbytes
        if kind.zarr_json:
            snap.zarr_json[f"{key}/zarr.json"] = zarr3_metadata(dtype, tuple(shape), cshape, codecs)
        elif kind.packable and len(parts) == 1 and parts[0][0] == kind.whole:
            packable[key] = entry  # one whole chunk, written by this process alone
        for region, part in parts:
            if isinstance(part, np.ndarray):
                if key in packable and packable_host(part, cshape):
                    members.append(Member(entry, nbytes, dtype.itemsize, data=part))
                    continue
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
        pack_entry = packable.get(key)
        if isinstance(src, np.ndarray):
            if pack_entry is not None and packable_host(src, cshape):
                members.append(Member(pack_entry, src.nbytes, dtype.itemsize, data=src))
                continue
            _add_host_chunks(snap, key, src, region, cshape, dtype, leaf_codec.get(key))
            continue
        if pack_entry is not None and not staged.streamed:
            # our device snapshot: copied to the host with the rest of its pack, in one transfer
            members.append(Member(pack_entry, int(src.nbytes), dtype.itemsize, src=src))
            continue
        size = int(math.prod(cshape)) * dtype.itemsize
        grid_subs = chunks_overlapping(region, cshape)
        if staged.streamed and fills_on_host(src):
            _add_filled_chunks(snap, key, src, region, grid_subs, cshape, dtype, leaf_codec.get(key))
            continue
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
    snap.packs = plan_packs(members)
    if snap.unstaged == 0:
        snap.staged.set()
    return snap


@dataclass(frozen=True, slots=True)
class _LeafKind:
    """What leaves of one shape, dtype and shard shape share in a save."""

    chunk_shape: tuple[int, ...]
    shape_json: list[int]
    chunk_shape_json: list[int]
    codecs: list[dict[str, Any]]
    nbytes: int
    #: the region of the whole leaf
    whole: Region
    #: leaves of this kind get a zarr.json (process 0)
    zarr_json: bool
    #: a leaf of this kind whose one part is the whole leaf is packed (packing.py)
    packable: bool

    @staticmethod
    def of(shape: tuple[int, ...], dtype: np.dtype, shard_shape: tuple[int, ...], options: SaveOptions,
           process_index: int) -> _LeafKind:
        cshape = chunk_shape_for(shard_shape, dtype.itemsize, target_bytes=options.target_chunk_bytes)
        codecs = codecs_json(options.compression, dtype)
        nbytes = int(math.prod(shape)) * dtype.itemsize
        zarr_json = process_index == 0 and nbytes >= options.zarr_metadata_min_bytes
        packable = (
            not zarr_json and cshape == shape and options.pack_small_leaves
            and is_packable(nbytes, compressed=bool(codecs), process_index=process_index)
        )
        return _LeafKind(cshape, list(shape), list(cshape), codecs, nbytes, tuple((0, n) for n in shape),
                         zarr_json, packable)


def _add_filled_chunks(
    snap: Snapshot, key: str, src: Any, region: Region, grid_subs: list[tuple[tuple[int, ...], Region]],
    cshape: tuple[int, ...], dtype: np.dtype, codec: Any,
) -> None:
    """The chunks of a streamed shard on a CPU device: each copied from a
    zero-copy view of the shard into a slot of the host pool when its write
    starts (chunk_writes.py), so the save's host copies are the pool's slots."""
    size = int(math.prod(cshape)) * dtype.itemsize
    for grid, sub in grid_subs:
        snap.chunks.append(_Chunk(chunk_key(key, grid), None, size, reads_caller=True, codec=codec,
                                  fill=chunk_filler(src, region, sub, cshape), shape=cshape, dtype=dtype))
        snap.unstaged += 1


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


async def _write_chunks(
    view: KvStore, snap: Snapshot, options: SaveOptions, progress: Progress | None = None, *,
    incremental: Incremental | None = None,
) -> None:
    """Write ``snap``'s chunks, packs and zarr.json documents into ``view`` (the
    step's folder) under the save's budget (chunk_writes.py); with
    ``incremental``, chunks equal to the previous step's are linked (dedup.py),
    without it every chunk is written."""
    chunks, snap.chunks = snap.chunks, []
    chunks += [_Chunk("", None, pk.nbytes, pack=pk) for pk in snap.packs]
    await write_chunks(
        view, chunks, snap.zarr_json, max_bytes_in_flight=options.max_bytes_in_flight,
        chunk_staged=snap.chunk_staged, progress=progress, incremental=incremental,
    )


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
    digests: Mapping[str, str] | None = None,
    heads: Mapping[str, str] | None = None,
    read_version: int | None = None,
) -> StepInfo:
    """Phases 2 and 3 (background). Raises ConditionFailedError if ``step`` exists.
    ``progress`` advances with the bytes of each chunk written. The caller
    releases the snapshot (:meth:`Snapshot.release`) when this ends, however it
    ends. ``digests``: chunk key -> digest of chunks whose digests are known
    (a promotion: the local part's), not hashed again, and linked without
    being read when equal to the previous step's; ``heads``: their head
    digests (dedup.py), recorded with them. ``read_version``: the version the
    caller found the step absent in (``StepStore.unsaved_version``); a
    single-process save reads that version rather than looking up the newest
    again (one round trip less; the commit still checks every version after
    it, and the step record is created only if absent)."""
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
        if n == 1 and read_version is not None:
            await read_from(txn, store.kv, read_version)
        # the step's create-only record and the previous step's digests are read
        # at once: both wait on the version the transaction pins, not on each other
        incremental = await _begin(view, store, step, snap, options, p, n, metrics, started, digests, heads)
        step_view = view.with_path(step_dir(step))
        await _write_chunks(step_view, snap, options, progress, incremental=incremental)
        await write_documents(view, step, snap, incremental, p, manifest=p == 0)
        committing = True
        committed = await txn.commit()
        if incremental is not None:
            incremental.remember()
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


async def _begin(
    view: KvStore, store: StepStore, step: int, snap: Snapshot, options: SaveOptions, p: int, n: int,
    metrics: dict[str, Any], started: float, digests: Mapping[str, str] | None,
    heads: Mapping[str, str] | None,
) -> Incremental | None:
    """Process 0 stages the step's record (create-only: a step is saved once; a
    racing save fails at commit) while every process loads what an incremental
    save may link (dedup.py): concurrently, both read the pinned version only.
    ConditionFailedError if the step exists."""

    async def create_record() -> None:
        if p != 0:
            return
        record = StepInfo(step=step, time=started, metrics=metrics, process_count=n,
                          nbytes=snap.nbytes)
        try:
            await view.write(record_key(step), json.dumps(record.to_json()).encode(), if_equal=Generation.NO_VALUE)
        except ConditionFailedError as e:
            raise ConditionFailedError(f"checkpoint step {step} already exists at {store.kv!r}") from e

    async def previous() -> Incremental | None:
        if not options.incremental:
            return None
        prev = await load_previous(view, step, snap.leaves)
        return Incremental(view, step, p, prev, root_id=repr(store.kv), arrays=snap.arrays,
                           known=dict(digests or {}), known_heads=dict(heads or {}))

    created, loaded = await asyncio.gather(create_record(), previous(), return_exceptions=True)
    for outcome in (created, loaded):  # the record's error first: "the step exists" explains the other
        if isinstance(outcome, BaseException):
            raise outcome
    return loaded  # type: ignore[return-value]


async def write_documents(
    view: KvStore, step: int, snap: Snapshot, incremental: Incremental | None, p: int, *, manifest: bool
) -> None:
    """After the chunks: process ``p``'s digests and (``manifest``) the step manifest,
    written concurrently (a large one is its own data object, made durable as
    it is written). The manifest comes after the chunks: packed leaves'
    checksums are known once their packs are filled."""
    writes = []
    if incremental is not None and incremental.digests:
        writes.append(view.write(f"{step_dir(step)}/{digests_key(p)}", incremental.document()))
    if manifest:
        writes.append(view.write(f"{step_dir(step)}/manifest.json", json.dumps(snap.manifest()).encode()))
    await asyncio.gather(*writes)


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
