"""The local tier of a checkpoint manager: fast saves, background promotion.

A manager with a local tier (``CheckpointManager(root, local=...)``) keeps two
kinds of roots:

* the **local tier**: one versioned checkpoint root per process (a RAM disk or a
  local NVMe; with several processes, ``process_<i>/`` under the URL given).
  Every save commits this process's *part* there: the step record, the
  manifest, every region of its addressable shards (replicas included, each
  region once) and every numpy leaf -- all it needs to restore the step with
  the save's sharding -- and ``<step>/part.json`` (which process, of how many;
  which leaves every process holds whole; which chunks are replicas another
  process owns). One single-process commit per part: whole or absent.
  A step is *complete locally* when every process's part is there.
* the **persistent tier**: the manager's ``root``. A promoted step is copied
  there from the local parts' committed bytes (each process reads its part
  back and writes what it owns; process 0 writes the record, manifest and
  zarr metadata) as ONE commit, multi-writer across processes, exactly as a
  save straight to the root would be: readers of the root see it whole or not
  at all.

Restoring picks the newest step that every process can read: from its own
local part, else from the persistent copy (see :func:`choose_step`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from tensorstore_py.checkpoint.api import RootLike, open_root
from tensorstore_py.checkpoint.attempts import publish_failure
from tensorstore_py.checkpoint.coordination import Coordinator
from tensorstore_py.checkpoint.dedup import DIGESTS_DIR, Incremental, load_previous, parse_document
from tensorstore_py.checkpoint.inflight import track
from tensorstore_py.checkpoint.jax_adapter import is_jax_array
from tensorstore_py.checkpoint.layout import LeafLayout, chunk_key, chunks_overlapping, region_of_index
from tensorstore_py.checkpoint.prng import is_prng_key, key_data
from tensorstore_py.checkpoint.pytree import flatten
from tensorstore_py.checkpoint.saving import (
    SaveOptions,
    Snapshot,
    _Chunk,
    _write_chunks,
    run_save,
    snapshot,
    write_documents,
)
from tensorstore_py.checkpoint.storage import (
    StepInfo,
    StepStore,
    check_step,
    checked_metrics,
    record_key,
    step_dir,
)
from tensorstore_py.core.errors import ConditionFailedError, DataCorruptionError
from tensorstore_py.core.future import Future, run_sync, spawn
from tensorstore_py.kvstore.base import Generation, KvStore
from tensorstore_py.kvstore.registry import require_conditional_writes
from tensorstore_py.kvstore.transaction import Transaction

__all__ = [
    "PART_KEY", "LocalTier", "choose_step", "mark_promoted", "promote", "read_part", "wants_promotion",
]

log = logging.getLogger("tensorstore_py.checkpoint")

#: the key (under a step's folder) naming which process's part a local step is
PART_KEY = "part.json"
PART_FORMAT = "tensorstore_py.checkpoint.part/1"


def _ownership(tree: Any, leaves: list[dict[str, Any]], process_count: int) -> tuple[list[str], list[str]]:
    """``(shared leaf keys, replica chunk keys)`` of a local part: the leaves every
    process holds whole (numpy leaves, jax arrays living on one process alone:
    process 0 promotes them) and the chunks of this process's replicas with
    ``replica_id != 0`` (another process promotes them)."""
    pairs, _ = flatten(tree)
    shared: list[str] = []
    replicas: list[str] = []
    for i, (_path, leaf) in enumerate(pairs):
        key = f"a/{i}"
        if isinstance(leaf, (np.ndarray, np.generic)) or (
            is_jax_array(leaf) and process_count > 1 and leaf.is_fully_addressable
        ):
            shared.append(key)
        elif is_jax_array(leaf) and process_count > 1:
            if is_prng_key(leaf):
                _impl, leaf = key_data(leaf)
            cshape = next(tuple(e["chunk_shape"]) for e in leaves if e.get("key") == key)
            owned = {region_of_index(sh.index, tuple(leaf.shape)) for sh in leaf.addressable_shards
                     if sh.replica_id == 0}
            for sh in leaf.addressable_shards:
                region = region_of_index(sh.index, tuple(leaf.shape))
                if region not in owned:
                    replicas.extend(chunk_key(key, g) for g, _ in chunks_overlapping(region, cshape))
    return shared, sorted(set(replicas))


class LocalTier:
    """This process's local checkpoint root (see the module docstring)."""

    def __init__(self, local: RootLike, *, process_index: int, process_count: int) -> None:
        kv = open_root(local)
        if process_count > 1:
            kv = kv.with_path(f"process_{process_index}/")
        require_conditional_writes(kv, "a checkpoint local tier")
        self.store = StepStore(kv)
        self.kv = self.store.kv
        self.process_index = process_index
        self.process_count = process_count
        #: the sets of foreign parts already warned about (:meth:`steps`)
        self._warned: set[Any] = set()

    def save(
        self,
        step: int,
        tree: Any,
        *,
        metrics: Mapping[str, Any],
        options: SaveOptions,
        on_commit: Callable[[StepInfo], Awaitable[Any]] | None = None,
        persist: bool = False,
    ) -> Future[StepInfo]:
        """Commit this process's part of ``step`` (one single-process commit);
        ``persist`` is recorded in the part (its promotion was asked for: a
        restarted manager finishes it, :func:`wants_promotion`);
        returns once staged (as :meth:`Root.save`), the rest in the background.
        Raises :class:`ConditionFailedError` if this process's part exists. A
        part of ``step`` saved by another process layout (:meth:`steps`), which
        no process of this job restores, is deleted first (one commit, with a
        warning): a job restarted with another process count saves the steps
        the old job saved again."""
        check_step(step)
        metrics = checked_metrics(step, metrics)
        if run_sync(self.kv.read(record_key(step))).state == "value":
            run_sync(self._replace_foreign(step))
        n = self.process_count
        if n > 1 and options.pack_small_leaves:
            # a pack mixes leaves of several owners, and a promotion has each
            # process write only what it owns: multi-process parts keep one
            # chunk key per leaf
            options = dataclasses.replace(options, pack_small_leaves=False)
        # process_index=0: every process keeps the numpy leaves too, and every
        # replica it holds (it restores them locally)
        snap = snapshot(tree, process_index=0, process_count=n, options=options, replicas=True)
        shared, replicas = _ownership(tree, snap.leaves, n)
        part = {"format": PART_FORMAT, "process_index": self.process_index, "process_count": n,
                "shared": shared, "replicas": replicas, "persist": bool(persist)}
        fut = spawn(self._commit(step, snap, part, metrics, options, on_commit))
        fut.add_done_callback(lambda _f: snap.release())
        track(fut, what=f"checkpoint step {step} in the local tier {self.kv!r}", exit_timeout=options.exit_timeout)
        snap.staged.wait()
        return fut

    async def _replace_foreign(self, step: int) -> None:
        """Delete the part of ``step`` when another process layout saved it;
        :class:`ConditionFailedError` when it is this process's own."""
        part = await _part(self.kv, step)
        layout = None if part is None else (int(part["process_index"]), int(part["process_count"]))
        if layout is None or layout == (self.process_index, self.process_count):
            raise ConditionFailedError(f"checkpoint step {step} already exists in the local tier {self.kv!r}")
        log.warning("checkpoint local tier %r: step %d holds a part saved as process %d of %d; this is "
                    "process %d of %d, which never restores it: it is deleted and the step saved again",
                    self.kv, step, layout[0], layout[1], self.process_index, self.process_count)
        await self.store.delete_steps([step])

    async def _commit(
        self, step: int, snap: Snapshot, part: dict[str, Any], metrics: dict[str, Any], options: SaveOptions,
        on_commit: Callable[[StepInfo], Awaitable[Any]] | None,
    ) -> StepInfo:
        txn = Transaction(message=f"checkpoint step {step} (local part {self.process_index})",
                          metadata={"checkpoint_step": step})
        view = self.kv.with_transaction(txn)
        started = time.time()
        record = StepInfo(step=step, time=started, metrics=metrics, process_count=self.process_count,
                          nbytes=snap.nbytes)
        try:
            await view.write(record_key(step), json.dumps(record.to_json()).encode(),
                             if_equal=Generation.NO_VALUE)
            await view.write(f"{step_dir(step)}/{PART_KEY}", json.dumps(part).encode())
            incremental = await self._incremental(view, step, snap, options)
            await _write_chunks(view.with_path(step_dir(step)), snap, options, incremental=incremental)
            # after the chunks: packed leaves' checksums are known once their packs are filled
            await write_documents(view, step, snap, incremental, self.process_index, manifest=True)
            committed = await txn.commit()
            if incremental is not None:
                incremental.remember()
        except BaseException:
            if txn.state == "open":
                txn.abort()
            raise
        info = StepInfo(step=step, time=started, metrics=metrics, process_count=self.process_count,
                        nbytes=snap.nbytes, version=committed.version)
        if on_commit is not None:
            await on_commit(info)
        return info

    async def _incremental(
        self, view: KvStore, step: int, snap: Snapshot, options: SaveOptions
    ) -> Incremental | None:
        """An incremental local save (``options.incremental``) links the chunks equal
        to this process's previous part and records every chunk's digest, which
        the promotion of the step then uses instead of hashing (dedup.py)."""
        if not options.incremental:
            return None
        previous = await load_previous(view, step, snap.leaves)
        return Incremental(view, step, self.process_index, previous, root_id=repr(self.kv), arrays=snap.arrays)

    async def steps(self) -> list[int]:
        """This process's committed parts of the current process layout, ascending.
        Parts saved by a job of another process count (or as another process)
        are left out, with a warning (logger ``tensorstore_py.checkpoint``, once
        per set of such parts) naming them: they are neither restored nor
        promoted, and local retention does not count them."""
        snap = await self.store.snapshot()
        out = []
        foreign: dict[tuple[int, int], list[int]] = {}
        for s in await self.store.list_steps(snap):
            part = await _part(snap, s)
            layout = (self.process_index, self.process_count) if part is None else \
                (int(part["process_index"]), int(part["process_count"]))
            if layout == (self.process_index, self.process_count):
                out.append(s)
            else:
                foreign.setdefault(layout, []).append(s)
        if foreign:
            self._warn_foreign(foreign)
        return out

    def _warn_foreign(self, foreign: dict[tuple[int, int], list[int]]) -> None:
        key = tuple(sorted((k, tuple(v)) for k, v in foreign.items()))
        if key in self._warned:
            return
        self._warned.add(key)
        found = "; ".join(f"steps {v} as process {i} of {n}" for (i, n), v in sorted(foreign.items()))
        log.warning("checkpoint local tier %r holds parts saved by another process layout (%s); this is "
                    "process %d of %d: they are ignored (not restored, promoted or retained)",
                    self.kv, found, self.process_index, self.process_count)


async def _part(view: KvStore, step: int) -> dict[str, Any] | None:
    r = await view.read(f"{step_dir(step)}/{PART_KEY}")
    if r.state != "value":
        return None  # a whole single-process step (e.g. copied in by hand)
    part = json.loads(bytes(r.value))
    if not isinstance(part, dict) or part.get("format") != PART_FORMAT:
        raise DataCorruptionError(f"checkpoint step {step}: {PART_KEY!r} has format "
                                  f"{part.get('format') if isinstance(part, dict) else part!r}, "
                                  f"expected {PART_FORMAT!r}")
    return part


async def wants_promotion(local: LocalTier, step: int) -> bool:
    """Whether the save of this process's part of ``step`` asked for its
    promotion (``part.json`` ``persist``) and no promotion of it ended yet
    (``promoted``, :func:`mark_promoted`); False for a part that records none.
    So a step deleted at the root after its promotion is not promoted again."""
    part = await _part(local.store.kv, step)
    return bool(part is not None and part.get("persist") is True and not part.get("promoted"))


async def mark_promoted(local: LocalTier, step: int) -> None:
    """Record in this process's part of ``step`` that its promotion committed
    (``part.json`` ``promoted``: one commit of the local tier, conditional on
    the part being unchanged; nothing when the part is gone). Best effort: a
    failure is logged, and only costs a promotion resumed by a later restore
    when the root no longer holds the step."""
    key = f"{step_dir(step)}/{PART_KEY}"
    try:
        r = await local.kv.read(key)
        if r.state != "value":
            return
        part = json.loads(bytes(r.value))
        if not isinstance(part, dict) or part.get("format") != PART_FORMAT:
            return
        part["promoted"] = True
        await local.kv.write(key, json.dumps(part).encode(), if_equal=r.generation)
    except ConditionFailedError:
        return  # the part was deleted meanwhile (retention, delete)
    except Exception as e:
        log.warning("checkpoint step %d: its promotion is not recorded in the local tier %r: %s: %s",
                    step, local.kv, type(e).__name__, e)


async def read_part(store: StepStore, step: int) -> tuple[StepInfo, dict[str, Any], dict[str, Any], KvStore]:
    """``(record, manifest, part, pinned view of the step's keys)`` of a local part."""
    snap = await store.snapshot()
    info = await store.record(step, snap)
    manifest = await store.manifest(step, snap)
    part = await _part(snap, step) or {"process_index": 0, "process_count": 1, "shared": []}
    return info, manifest, part, snap.with_path(step_dir(step))


async def promote(
    local: LocalTier,
    persistent: StepStore,
    step: int,
    *,
    coordinator: Coordinator,
    namespace: str,
    options: SaveOptions,
    on_commit: Callable[[StepInfo], Awaitable[Any]] | None = None,
) -> StepInfo:
    """Copy the committed local step ``step`` to ``persistent`` as ONE commit
    (multi-writer across processes, as a save is: every process calls this with
    the same arguments). The bytes come from the local tier, not from the
    devices; each is written as stored (compressed chunks stay compressed).

    Each process writes the chunks it owns (those a save straight to the root
    would have it write); process 0 writes the record (with the step's metrics),
    the manifest and the zarr metadata. Nothing of the step is visible in
    ``persistent`` until the commit; a failure or a cancellation leaves it absent.
    A process that can not read its part tells the others (they raise
    :class:`ParticipantFailedError` at once instead of waiting for their
    ``commit_timeout``)."""
    try:
        info, manifest, part, view = await read_part(local.store, step)
    except BaseException as e:
        if coordinator.process_count > 1:
            await publish_failure(coordinator, namespace, e, options.commit_timeout)
        raise
    p = coordinator.process_index
    shared = set(part.get("shared", []))
    replicas = set(part.get("replicas", []))
    listed = await view.list("")
    keys = [k for k in listed if k not in ("manifest.json", PART_KEY) and not k.startswith(f"{DIGESTS_DIR}/")]
    digests, heads = await _part_digests(view, [k for k in listed if k.startswith(f"{DIGESTS_DIR}/")])
    compressed = {e["key"] for e in manifest["leaves"] if e.get("codecs")}
    snap = Snapshot(structure=manifest["tree"], leaves=manifest["leaves"], nbytes=info.nbytes)
    # a chunk's bytes in flight: its leaf's full chunk (compressed ones are at most that)
    sizes = {
        e["key"]: (lay := LeafLayout.from_json(e)).dtype.itemsize * int(math.prod(lay.chunk_shape))
        for e in manifest["leaves"] if e.get("kind") != "python"
    }
    for k in keys:
        leaf = "/".join(k.split("/")[:2])  # "a/<i>/c/..." or "a/<i>/zarr.json"
        if k.endswith("zarr.json"):
            if p == 0:
                snap.zarr_json[k] = json.loads(bytes(await _read(view, k)))
            continue
        if (p != 0 and leaf in shared) or k in replicas:
            continue
        # a compressed chunk is copied as stored: its digest (of the raw bytes) is
        # the local part's, or none (hashing the stored bytes would record a wrong one)
        snap.chunks.append(_Chunk(k, None, max(1, sizes.get(leaf, 1 << 20)), read=_reader(view, k),
                                  unhashed=leaf in compressed and k not in digests))
    snap.staged.set()
    try:
        return await run_save(
            persistent, step, snap, coordinator=coordinator, namespace=namespace,
            metrics=dict(info.metrics), options=options, on_commit=on_commit, digests=digests, heads=heads,
        )
    finally:
        snap.release()


async def _part_digests(view: KvStore, names: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """chunk key -> digest, and chunk key -> head digest (dedup.py), recorded by
    the local part's save (none for a part saved without incremental saves, or
    by a version that recorded none)."""
    out: dict[str, str] = {}
    heads: dict[str, str] = {}
    for name in names:
        if name.endswith(".json"):
            digests, part_heads = parse_document(bytes(await _read(view, name)), view.path + name)
            out.update(digests)
            heads.update(part_heads)
    return out, heads


async def _read(view: KvStore, key: str) -> Any:
    r = await view.read(key)
    if r.state != "value":
        raise DataCorruptionError(f"checkpoint local part: key {view.path + key!r} is missing from {view!r}")
    return r.value


def _reader(view: KvStore, key: str) -> Callable[[], Awaitable[np.ndarray]]:
    """Reads one stored chunk back, its crc32c checked (the versioned store reads
    a large value and checks it in one call of the I/O pool): its bytes as
    written, not copied again. As many run at once as the save's byte budget
    and the I/O pool (sized from the CPUs) allow."""

    async def read() -> np.ndarray:
        return np.frombuffer(await _read(view, key), dtype=np.uint8)

    return read


def choose_step(
    coordinator: Coordinator | None, local: list[int], persistent: list[int], *, key: str, timeout: float
) -> tuple[int | None, bool]:
    """The newest step every process can restore, and whether this process reads
    it locally: a step whose part every process holds locally, or a persistent
    step (a process without its part reads the persistent copy). Processes
    agree through ``coordinator`` (each publishes its local steps under ``key``)."""
    common = set(local)
    if coordinator is not None and coordinator.process_count > 1:
        p, n = coordinator.process_index, coordinator.process_count
        coordinator.publish(f"{key}/{p}", json.dumps(local))
        for q in range(n):
            if q != p:
                common &= set(json.loads(coordinator.wait_for(f"{key}/{q}", timeout)))
    candidates = common | set(persistent)
    if not candidates:
        return None, False
    step = max(candidates)
    return step, step in local
