"""One-checkpoint functions, :func:`save` and :func:`restore`, and the shared :class:`Root`."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Union

from tensorstore_py.checkpoint.assembly import Assemble
from tensorstore_py.checkpoint.attempts import next_namespace, publish_failure
from tensorstore_py.checkpoint.coordination import Coordinator
from tensorstore_py.checkpoint.inflight import track
from tensorstore_py.checkpoint.interop import restore_foreign_root
from tensorstore_py.checkpoint.leaves import array_leaves, open_leaf
from tensorstore_py.checkpoint.restoring import ReadStats, restore_step
from tensorstore_py.checkpoint.saving import SaveOptions, Snapshot, default_coordinator, run_save, snapshot
from tensorstore_py.checkpoint.storage import StepInfo, StepStore, check_step, checked_metrics
from tensorstore_py.core.errors import NotFoundError
from tensorstore_py.core.future import Future, spawn
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.registry import require_conditional_writes
from tensorstore_py.kvstore.versioned.leases import Hold
from tensorstore_py.kvstore.versioned.staging import protect
from tensorstore_py.progress import ProgressArg, reporter
from tensorstore_py.tensorstore import TensorStore

__all__ = ["Root", "RootLike", "leaf_paths", "open_array", "open_leaf", "open_root", "restore", "save"]

RootLike = Union[str, Mapping[str, Any], KvStore]  # noqa: UP007 (a runtime alias)

def open_root(root: RootLike) -> KvStore:
    """The kvstore of a checkpoint root (URL, spec dict or an open KvStore)."""
    if isinstance(root, KvStore):
        return root
    if isinstance(root, str) and "://" in root and not root.endswith("/") and "@" not in root.rsplit("/", 1)[-1]:
        root = root + "/"
    return KvStore.open(root).result()


def _release(hold: Future[Hold]) -> None:
    """Release the writer lease ``hold`` resolves to, whenever it does (a failed
    registration is left to the save, whose own registration meets it)."""

    def done(f: Future[Hold]) -> None:
        if not f.cancelled() and f.exception() is None:
            f.result().release()

    hold.add_done_callback(done)


class Root:
    """An open checkpoint root: its step store and its coordinator."""

    def __init__(self, root: RootLike, *, coordinator: Coordinator | None = None) -> None:
        self.store = StepStore(open_root(root))
        self.kv = self.store.kv
        self.coordinator = coordinator

    def _coordinator(self) -> Coordinator:
        return self.coordinator if self.coordinator is not None else default_coordinator()

    def save(
        self,
        step: int,
        tree: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        options: SaveOptions | None = None,
        on_commit: Callable[[StepInfo], Awaitable[Any]] | None = None,
        progress: ProgressArg = None,
    ) -> Future[StepInfo]:
        check_step(step)
        # named by the step and its attempt, before anything can fail (attempts.py)
        namespace = next_namespace(step)
        options = options or SaveOptions()
        coord = self._coordinator()
        what = f"checkpoint step {step} at {self.kv!r}"
        try:
            require_conditional_writes(self.kv, f"checkpoint save of step {step}")
            metrics = checked_metrics(step, metrics)
            snap, read_version, hold = self._stage(step, tree, coord, options)
        except BaseException as e:
            if coord.process_count > 1:  # the others must not wait for this process's part
                told = spawn(publish_failure(coord, namespace, e, options.commit_timeout))
                track(told, what=f"the failure report of {what}", exit_timeout=options.exit_timeout)
            raise
        bar = reporter(progress, f"checkpoint save of step {step}")
        if bar is not None:
            docs = sum(len(json.dumps(doc).encode()) for doc in snap.zarr_json.values())
            bar.set_total(snap.chunk_bytes() + docs)
        fut = spawn(
            run_save(
                self.store, step, snap, coordinator=coord, namespace=namespace,
                metrics=metrics, options=options, on_commit=on_commit, progress=bar,
                read_version=read_version,
            )
        )
        fut.add_done_callback(lambda _f: snap.release())
        fut.add_done_callback(lambda _f: _release(hold))
        track(fut, what=what, exit_timeout=options.exit_timeout)
        if bar is not None:
            fut.add_done_callback(lambda f: bar.close(failed=f.cancelled() or f.exception() is not None))
        # "pinned_host" staging: the writes copy the last chunks off the caller's
        # arrays; return once they are no longer needed (or the save failed)
        snap.staged.wait()
        return fut

    def _stage(
        self, step: int, tree: Any, coord: Coordinator, options: SaveOptions
    ) -> tuple[Snapshot, int, Future[Hold]]:
        """The tree staged, the version in which ``step`` was found absent
        (ConditionFailedError if it exists) and this process's writer lease.

        The store is asked about the step, and the lease written, while the tree
        is staged: the caller waits for the longest of the three, not for their
        sum (on an object store each is a round trip or two). The lease makes the
        transaction's own registration find it in place; released when the save
        ends."""
        unsaved = spawn(self.store.unsaved_version(step))
        hold = protect(self.kv)
        try:
            snap = snapshot(
                tree, process_index=coord.process_index, process_count=coord.process_count,
                options=options,
            )
        except BaseException:
            unsaved.cancel()
            _release(hold)
            raise
        try:
            read_version = unsaved.result()
        except BaseException:
            snap.release()
            _release(hold)
            raise
        return snap, read_version, hold

    def restore(
        self,
        step: int | None,
        target: Any = None,
        *,
        max_bytes_in_flight: int = 512 << 20,
        stats: ReadStats | None = None,
        progress: ProgressArg = None,
        cast: bool = False,
        assemble: Assemble = "auto",
    ) -> Any:
        bar = reporter(progress, "checkpoint restore")
        try:
            out = restore_step(
                self.store, step, target, max_bytes_in_flight=max_bytes_in_flight, stats=stats,
                progress=bar, cast=cast, assemble=assemble,
            )
        except BaseException:
            if bar is not None:
                bar.close(failed=True)
            raise
        if bar is not None:
            bar.close()
        return out


def save(
    root: RootLike,
    tree: Any,
    *,
    step: int = 0,
    metrics: Mapping[str, Any] | None = None,
    coordinator: Coordinator | None = None,
    options: SaveOptions | None = None,
    progress: ProgressArg = None,
) -> Future[StepInfo]:
    """Save ``tree`` as ``step`` under ``root``; returns a Future of its :class:`StepInfo`.

    When this returns the caller may change, donate or delete its arrays: what is
    saved has been staged (``options.staging``: a device-side snapshot, pinned or
    ordinary host memory; see :class:`SaveOptions`); the copy to the host, writing
    and the commit continue in the background.
    The step becomes visible atomically (one commit) when the Future completes,
    or never. In a multi-process JAX job every process calls it with the same
    arguments. Raises :class:`ConditionFailedError` if ``step`` already exists, and
    :class:`UnsupportedError` (before anything is copied or written) when the
    root's store can not do create-only writes (an fsspec URL).

    A process that fails during the save (here or in the background) tells the
    others, which raise :class:`ParticipantFailedError` naming it at once rather
    than after ``options.commit_timeout``. A save still in flight when the
    interpreter exits gets up to ``options.exit_timeout`` seconds to commit; then
    it is abandoned with a warning (nothing of it visible). See docs/CHECKPOINTS.md.

    ``progress``: True draws a bar on stderr when it is a terminal (else prints
    one summary line when the save ends); a callable is called with ``(bytes
    written, bytes to write)`` as this process's chunks are stored.
    """
    return Root(root, coordinator=coordinator).save(
        step, tree, metrics=metrics, options=options, progress=progress
    )


def restore(
    root: RootLike,
    *,
    step: int | None = None,
    target: Any = None,
    max_bytes_in_flight: int = 512 << 20,
    stats: ReadStats | None = None,
    progress: ProgressArg = None,
    cast: bool = False,
    assemble: Assemble = "auto",
) -> Any:
    """Restore ``step`` (default: the newest) from ``root``.

    ``target=None`` returns the stored tree with numpy leaves; otherwise the
    result has the target's structure, and each target leaf that is a
    ``jax.Array`` or ``jax.ShapeDtypeStruct`` becomes a ``jax.Array`` with the
    target's sharding, read only where this process's devices need it. Raises
    :class:`NotFoundError` for a missing step or leaf. ``max_bytes_in_flight``
    bounds the read buffers held at once. ``assemble`` says where the block of
    each device is put together: ``"host"`` (then transferred; host memory peaks
    near the restored size plus the budget, and on CPU devices the host blocks
    become the arrays without a copy), ``"device"`` (each piece is transferred as
    soon as it is read and written into the block on the device: host memory
    holds only the budget) or ``"auto"`` (the device for accelerators, the host
    for CPU devices).

    A target leaf of another dtype than the saved one (a float32 target for a
    bfloat16 leaf) raises :class:`InvalidArgumentError` before anything is read,
    unless ``cast=True`` asks for the conversion (numpy ``astype``). ``progress``:
    True draws a bar (a summary line when stderr is not a terminal); a callable
    is called with ``(bytes read, bytes to read)``.

    Foreign checkpoints are read too (read-only), when ``root`` holds no native
    step: an Orbax step folder, or an Orbax run folder (``step`` or its newest
    step); a ``.safetensors`` file URL or a Hugging Face folder (see
    :func:`restore_safetensors` for key mapping). docs/CHECKPOINTS.md lists what
    is supported.
    """
    from_url = isinstance(root, str)
    if from_url and str(root).rstrip("/").endswith(".safetensors"):
        return restore_foreign_root(root, None, step, target, cast=cast,
                                    max_bytes_in_flight=max_bytes_in_flight, stats=stats)[1]
    r = Root(root)
    try:
        return r.restore(
            step, target, max_bytes_in_flight=max_bytes_in_flight, stats=stats, progress=progress,
            cast=cast, assemble=assemble,
        )
    except NotFoundError:
        found, tree = restore_foreign_root(root, r.kv, step, target, cast=cast,
                                           max_bytes_in_flight=max_bytes_in_flight, stats=stats)
        if not found:
            raise
        return tree


def leaf_paths(root: RootLike, *, step: int | None = None) -> Future[list[str]]:
    """The paths (``jax.tree_util.keystr`` style) of the array leaves of ``step``
    (default: the newest)."""

    store = StepStore(open_root(root))

    async def run() -> list[str]:
        _step, manifest, _view = await store.open_step(step)
        return [leaf["path"] for leaf in array_leaves(manifest)]

    return spawn(run())


def open_array(root: RootLike, path: str, *, step: int | None = None) -> Future[TensorStore]:
    """One saved array leaf of ``step`` (default: the newest) as a read-only TensorStore.

    The view is lazy and pinned to the snapshot the step was read from: slicing
    it reads only the chunks the slice needs (e.g. one row of a 10 GiB
    embedding table), and a later save or retention can not change what it
    sees (retention may delete its bytes: a read then fails, never mixes).
    ``path`` is the leaf's path as :func:`leaf_paths` lists it, e.g.
    ``"['params']['w1']"``. Raises :class:`NotFoundError` for an unknown path.
    """

    store = StepStore(open_root(root))

    async def run() -> TensorStore:
        step_, manifest, view = await store.open_step(step)
        leaves = array_leaves(manifest)
        for leaf in leaves:
            if leaf.get("path") == path:
                return await open_leaf(view.with_path(leaf["key"]), leaf)
        known = ", ".join(str(leaf.get("path")) for leaf in leaves[:20])
        raise NotFoundError(f"checkpoint step {step_} has no array leaf {path!r}; leaves: {known}")

    return spawn(run())
