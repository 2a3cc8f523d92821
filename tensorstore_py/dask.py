"""Dask: read views as dask arrays; write dask arrays with ONE atomic commit.

::

    import tensorstore_py as tsp
    import tensorstore_py.dask as tspd

    vol = tsp.open("versioned+file:///data/run/").result()
    arr = tspd.to_dask(vol)                     # chunks = the stored chunks (shards)
    info = tspd.store(arr * 2, out_view)        # one version for the whole graph

Needs the ``dask`` extra (``pip install "tensorstore_py[dask]"``); works with
every Dask scheduler, since views pickle as their spec (threads, processes,
``dask.distributed``).

:func:`to_dask`
    Dask chunks are exactly the stored chunks as the view sees them (shards
    where sharded; through steps, flips, transposes, new axes and translations):
    each task reads whole stored chunks, lazily, through the pickled view. A
    view of a versioned store that is not pinned is pinned to its newest version
    when the array is built, so every task reads the same snapshot; that
    snapshot (or the view's own pinned version) is checked and *leased* by this
    process while the dask array (or a graph made from it) lives, and the tasks
    of every scheduler (threads, processes, ``dask.distributed``) read it even
    after retention deleted it, as long as that lease holds its objects.

:func:`store`
    Every task writes a region made of whole stored write chunks (shards), so no
    two tasks ever touch one chunk. A dask array whose blocks cut a chunk is
    *realigned* (``realign=True``, the default: ``dask.array.rechunk`` moves each
    block boundary up to the next chunk boundary) or *refused*
    (``realign=False``: InvalidArgumentError naming the dimension and boundary).

    On a **versioned store** the graph publishes exactly ONE version: each task
    writes its chunks in its own transaction and *stages* them
    (:mod:`tensorstore_py.kvstore.versioned.staging`): its data objects are
    durable, and its result is the list of changes (key -> index entry, about
    100 bytes per chunk). A final task commits all of them in one commit. So
    nothing is visible before that commit, a graph that fails commits nothing,
    and a task that Dask re-ran (its worker was killed) contributes exactly the
    changes of the run whose result Dask kept: the data of lost runs is never
    referenced (gc reclaims it after its grace period).

    * The graph is ONE transaction that reads one version: ``read_version``
      if given, else the oldest version that a :func:`to_dask` array of the
      same store in ``source``'s graph pinned (also in an optimized graph),
      else the newest version when :func:`store` is called. A chunk that a
      version after it changed fails the commit with ConflictError
      (``store(to_dask(v) + 1, v)`` never overwrites a concurrent change; a
      persisted source no longer holds its graph: pass ``read_version``).
    * The process that calls :func:`store` holds a writer lease from then until
      the commit ends (``compute=True``), or, with ``compute=False``, until the
      commit's outcome is recorded in the store (looked up every few seconds;
      a graph that fails before its commit task keeps it until this process
      exits); garbage collection in any process keeps the staged data
      meanwhile (the lease expires a lease TTL after that process dies), and
      the commit refuses (DataCorruptionError, nothing visible) to publish a
      staged data object that is gone.
    * The commit carries a transaction id (``txn_id``), which commits at most
      once: a re-run commit task, tasks recomputed after the commit landed, or
      ``store`` called again with the same ``txn_id`` return the version it
      committed instead of committing again, for as long as that version is
      retained (whatever the grace period of any collector); once retention
      deleted it, until a full garbage collection finds the id's
      ``txns/<txn_id>/result`` older than its grace period (docs/FORMAT.md
      §7.5). A call with the id after that commits again.

    On any **other store** each chunk is replaced atomically as the task writes
    it; the write as a whole is not atomic (a failed graph leaves the chunks of
    the tasks that ran).
"""

from __future__ import annotations

import itertools
import re
import uuid
from collections.abc import Iterator
from typing import Any, Literal, cast

import numpy as np

from tensorstore_py.core.errors import InvalidArgumentError, ReadOnlyError
from tensorstore_py.kvstore.ids import check_id
from tensorstore_py.kvstore.transaction import CommitInfo, Transaction
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.staging import (
    StagedChanges,
    commit_staged,
    history_id,
    protect,
    read_from,
    release_when_decided,
    stage,
)
from tensorstore_py.tensorstore import TensorStore

try:
    import dask
    import dask.array as da
    from dask.highlevelgraph import MaterializedLayer
except ImportError as e:  # the optional extra
    raise ImportError(
        f'tensorstore_py.dask needs dask ({e.name} is missing): pip install "tensorstore_py[dask]"'
    ) from e

__all__ = ["storage_chunks", "store", "to_dask"]

Chunks = tuple[tuple[int, ...], ...]


# -- chunk grids as a view sees them --------------------------------------------------------
def _dim_chunks(k0: int, stride: int, n: int, c: int) -> tuple[int, ...]:
    """Run lengths of view positions ``0..n-1`` (stored index ``k0 + stride * p``)
    that fall in the same stored chunk of size ``c``."""
    if n == 0:
        return (0,)
    if abs(stride) >= c:
        return (1,) * n  # consecutive positions always lie in different chunks
    bounds = [0]
    if stride > 0:
        j = k0 // c + 1  # the next chunk's index: it starts at stored index j * c
        while (p := -(-(j * c - k0) // stride)) < n:
            bounds.append(p)
            j += 1
    else:
        j = k0 // c  # this chunk's index: we leave it below stored index j * c
        while (p := (k0 - j * c) // -stride + 1) < n:
            bounds.append(p)
            j -= 1
    bounds.append(n)
    return tuple(b - a for a, b in itertools.pairwise(bounds))


def storage_chunks(view: TensorStore, kind: Literal["write", "read"] = "write") -> Chunks:
    """The stored chunk grid as ``view`` sees it, in dask's ``chunks`` form.

    ``kind="write"``: the unit written atomically (the shard when sharded);
    ``"read"``: the smallest unit read alone (the inner chunk). New axes are one
    chunk; a dimension of length 0 is ``(0,)``.
    """
    drv = view.driver
    grid = drv.write_chunk_shape if kind == "write" else drv.read_chunk_shape
    t = view.transform
    lo, shape = t.domain.inclusive_min, t.domain.shape
    out: list[tuple[int, ...]] = [(n,) for n in shape]
    for b, m in enumerate(t.output):
        d = m.input_dimension
        if d is not None:
            out[d] = _dim_chunks(m.offset + m.stride * lo[d], m.stride, shape[d], grid[b])
    return tuple(out)


#: the name of a :func:`to_dask` array of a versioned store (and of the key holding its
#: view, ``original-<name>``): which history, which version
_READ_NAME = re.compile(r"^(?:original-)?tensorstore-[0-9a-f]{32}-([0-9a-f]{16})-at-(\d+)$")


def _pinned(view: TensorStore) -> tuple[TensorStore, str]:
    """``view`` reading a checked, leased snapshot when it reads a versioned store
    (a live store: its newest version), and the dask name of its array."""
    kv = view.kvstore
    name = f"tensorstore-{uuid.uuid4().hex}"
    if not isinstance(kv, VersionedKvStore):
        return view, name
    if kv.version is not None and (kv._hold is not None or kv._leased_elsewhere):
        snap = kv  # already checked and leased
    else:
        want = kv.newest_version().result() if kv.version is None and kv.tag_name is None else kv.version
        snap = kv.open_snapshot(cast("int | str", kv.tag_name if want is None else want)).result()
    assert snap.version is not None
    out = TensorStore(view.driver.with_kvstore(snap), view.transform, view._context)
    return out, f"{name}-{history_id(snap)}-at-{snap.version}"


def _graph_names(source: da.Array) -> Iterator[str]:
    """The names in ``source``'s graph that can name a :func:`to_dask` array: its
    layers, and the string keys of materialized layers (``dask.optimize`` fuses
    a to_dask layer into its consumers and keeps only the ``original-`` key of
    its view)."""
    graph = source.__dask_graph__()
    layers = getattr(graph, "layers", None)
    if layers is None:  # a plain dict graph
        yield from (k for k in graph if isinstance(k, str))
        return
    for name, layer in layers.items():
        yield str(name)
        if isinstance(layer, MaterializedLayer):
            yield from (k for k in layer if isinstance(k, str))


def _read_version(source: da.Array, hist: str) -> int | None:
    """The oldest version of history ``hist`` that a :func:`to_dask` array in
    ``source``'s graph reads (None: none does)."""
    found = [int(m.group(2)) for n in _graph_names(source) if (m := _READ_NAME.match(n)) and m.group(1) == hist]
    return min(found, default=None)


# -- reading ----------------------------------------------------------------------------------
def to_dask(view: TensorStore, *, chunks: Literal["write", "read"] = "write") -> da.Array:
    """A lazy dask array of ``view`` whose chunks are the stored chunks (see the module doc).

    ``chunks="read"`` uses the inner chunks of a sharded array (more, smaller tasks).
    """
    if not isinstance(view, TensorStore):
        raise InvalidArgumentError(f"to_dask needs a TensorStore view, got {type(view).__name__}")
    src, name = _pinned(view)
    return cast(da.Array, da.from_array(
        src, chunks=storage_chunks(src, chunks), name=name,
        asarray=True, lock=False, fancy=False, meta=np.empty((0,) * src.ndim, src.dtype),
    ))


# -- writing ----------------------------------------------------------------------------------
def _boundaries(chunks: tuple[int, ...]) -> list[int]:
    return list(itertools.accumulate(chunks))[:-1]


def _aligned(source: da.Array, grid: Chunks, realign: bool) -> da.Array:
    """``source`` with every block boundary on a stored chunk boundary."""
    want: list[tuple[int, ...]] = []
    for d, (have, cells) in enumerate(zip(source.chunks, grid)):
        if any(np.isnan(c) for c in have):
            raise InvalidArgumentError(
                f"store: dimension {d} of the dask array has unknown chunk sizes; call "
                f"compute_chunk_sizes() first"
            )
        stored = _boundaries(cells)
        allowed = set(stored)
        bad = [b for b in _boundaries(have) if b not in allowed]
        if not bad:
            want.append(have)
            continue
        if not realign:
            raise InvalidArgumentError(
                f"store: dimension {d}: a dask block boundary at {bad[0]} cuts a stored chunk "
                f"(chunk boundaries there: {stored[:8]}{' ...' if len(stored) > 8 else ''}); "
                f"rechunk to whole chunks (tensorstore_py.dask.storage_chunks) or pass realign=True"
            )
        n = sum(have)
        ends = sorted({next((s for s in stored if s >= b), n) for b in _boundaries(have)} | {n})
        want.append(tuple(b - a for a, b in itertools.pairwise([0, *ends]) if b > a))
    want_t = tuple(want)
    return source if want_t == source.chunks else source.rechunk(want_t)


def _write_block(view: TensorStore, region: tuple[slice, ...], block: np.ndarray) -> None:
    view[region].write(block).result()


def _stage_block(view: TensorStore, region: tuple[slice, ...], block: np.ndarray, base: int) -> StagedChanges:
    txn = Transaction()
    kv: VersionedKvStore = view.kvstore  # type: ignore[assignment]
    read_from(txn, kv, base).result()  # the graph's one read version: conflicts count from it
    view.with_transaction(txn)[region].write(block).result()
    return stage(txn, kv).result()


def _commit(view: TensorStore, parts: list[StagedChanges], txn_id: str, message: str,
            metadata: dict[str, Any]) -> CommitInfo:
    return commit_staged(view.kvstore, parts, txn_id=txn_id, message=message,  # type: ignore[arg-type]
                         metadata=metadata).result()


def _done(_results: list[None]) -> None:
    return None


def store(
    source: da.Array,
    view: TensorStore,
    *,
    realign: bool = True,
    compute: bool = True,
    txn_id: str | None = None,
    message: str = "",
    metadata: dict[str, Any] | None = None,
    read_version: int | None = None,
) -> CommitInfo | None | Any:
    """Write the dask array ``source`` into ``view`` (same shape; dtype cast by
    numpy ``same_kind`` rules), one task per block (see the module doc).

    Returns the :class:`CommitInfo` of the one new version on a versioned store
    (with a ``txn_id`` that committed before: that version), None on other
    stores; with ``compute=False``, a ``dask.delayed`` object that does the work
    when computed and returns the same. ``txn_id`` (default: a fresh one),
    ``message`` and ``metadata`` go into the commit record. Argument errors
    (shape, dtype, alignment, a read-only view) are raised here, before any task
    runs. On a versioned store, this process holds a writer lease for the
    staged data until the commit ends (``compute=False``: until its outcome is
    recorded in the store); see the module doc.

    ``read_version`` (versioned stores only): the version of ``view``'s history
    that ``source`` was computed from; every task reads it, and a chunk that a
    later version changed fails the commit with ConflictError. Default: the
    oldest version a :func:`to_dask` array of that history in ``source``'s
    graph reads, else the newest version now. Pass it when ``source`` no
    longer holds its graph (``persist()``, ``da.from_array`` of computed data).
    """
    if not isinstance(view, TensorStore):
        raise InvalidArgumentError(f"store needs a TensorStore view, got {type(view).__name__}")
    if not isinstance(source, da.Array):
        raise InvalidArgumentError(f"store needs a dask array, got {type(source).__name__}")
    if tuple(source.shape) != tuple(view.shape):
        raise InvalidArgumentError(
            f"store: the dask array has shape {source.shape}, the view {view.shape} (domain {view.domain})"
        )
    if not np.can_cast(source.dtype, view.dtype, "same_kind"):
        raise InvalidArgumentError(
            f"store: cannot cast the dask array's dtype {source.dtype} to the view's {view.dtype} under "
            f"numpy 'same_kind' rules; astype() first"
        )
    kv = view.kvstore
    if kv.read_only:
        raise ReadOnlyError(f"store: {view!r} is read-only")
    versioned = isinstance(kv, VersionedKvStore)
    if read_version is not None and (
        not versioned or not isinstance(read_version, int) or isinstance(read_version, bool) or read_version < 0
    ):
        raise InvalidArgumentError(
            f"store: read_version must be an int >= 0 on a versioned store, got {read_version!r} for {view!r}"
        )
    txn_id = check_id("store: txn_id", txn_id) if txn_id is not None else f"dask-{uuid.uuid4().hex}"
    source = _aligned(source, storage_chunks(view, "write"), realign)
    blocks = source.to_delayed().reshape(-1)
    starts = [[0, *itertools.accumulate(c)] for c in source.chunks]
    task = dask.delayed(_stage_block if versioned else _write_block, pure=False)
    view_d = dask.delayed(view, name=f"tensorstore-view-{uuid.uuid4().hex}")
    extra: tuple[int, ...] = ()
    if versioned:
        base = read_version if read_version is not None else _read_version(source, history_id(kv))  # type: ignore[arg-type]
        extra = (kv.newest_version().result() if base is None else base,)  # type: ignore[attr-defined]
    results = []
    for blk, idx in zip(blocks, itertools.product(*(range(len(c)) for c in source.chunks))):
        region = tuple(slice(s[i], s[i + 1]) for s, i in zip(starts, idx))
        results.append(task(view_d, region, blk, *extra))
    if not versioned:
        final = dask.delayed(_done, pure=False)(results)
        return final.compute() if compute else final
    final = dask.delayed(_commit, pure=False)(view_d, results, txn_id, message, dict(metadata or {}))
    # the staged data outlives each task's transaction: this process's lease keeps it
    hold = protect(kv).result()  # type: ignore[arg-type]
    if not compute:
        # whoever computes it, and wherever: held until the commit's outcome is in the store
        release_when_decided(kv, txn_id, hold)  # type: ignore[arg-type]
        return final
    try:
        return final.compute()
    finally:
        hold.release()
