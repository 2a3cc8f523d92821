"""CheckpointManager: steps of one training run, with retention and async saves."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Mapping
from typing import Any, Literal, Self

from tensorstore_py.checkpoint.api import Root, RootLike
from tensorstore_py.checkpoint.assembly import Assemble
from tensorstore_py.checkpoint.coordination import Coordinator
from tensorstore_py.checkpoint.interop import foreign_steps, restore_foreign_root
from tensorstore_py.checkpoint.preemption import PreemptionWatch
from tensorstore_py.checkpoint.restoring import ReadStats
from tensorstore_py.checkpoint.saving import SaveOptions
from tensorstore_py.checkpoint.staging import warm_pinned
from tensorstore_py.checkpoint.storage import StepInfo
from tensorstore_py.checkpoint.tiered import Tiers
from tensorstore_py.core.errors import InvalidArgumentError, NotFoundError
from tensorstore_py.core.future import Future, ready, run_sync
from tensorstore_py.kvstore.versioned.gcreport import GcReport
from tensorstore_py.progress import ProgressArg

__all__ = ["CheckpointManager"]

log = logging.getLogger("tensorstore_py.checkpoint")


def _warm(nbytes: int) -> int:
    """Pin ``nbytes`` per local device ahead of the first save (only where JAX
    is imported already: a numpy-only program has nothing to stage)."""
    if nbytes <= 0 or "jax" not in sys.modules:
        return 0
    return warm_pinned(nbytes)


class CheckpointManager:
    """Save and restore the steps of one run under ``root``.

    Guarantees:

    * Every step is published by one atomic commit: :meth:`all_steps`,
      :meth:`latest_step` and :meth:`restore` never see a partial step, whichever
      process dies when.
    * :meth:`save` returns once what is saved has been staged (``options.staging``:
      a device-side snapshot, or copies in pinned or ordinary host memory); the
      copy to the host, writing and the commit run in the background (one save
      at a time: a new save first waits for the previous one, so at most one
      snapshot exists).
    * Retention runs after each commit, on process 0: with ``max_to_keep=n`` only
      the newest ``n`` steps remain — or, with ``best_metric``, the ``n`` best by
      that metric plus always the newest step. A deleted step disappears with
      one atomic delete and its bytes are freed immediately, except while a
      reader (a restore, an ``open_array`` view, in any process) still reads
      the version holding it: then a later retention frees them.
    * A save still in flight when the interpreter exits is given up to
      ``SaveOptions.exit_timeout`` seconds to commit, then abandoned with a
      warning (the step is absent, never partial); the process never aborts.
    * A save that committed reports success: retention is idempotent, and when
      it fails (another manager on the same root retaining at the same time, a
      store error) the failure is logged (logger ``tensorstore_py.checkpoint``)
      and the next save's retention catches up.

    ``warm_staging``: bytes of pinned host memory to pin on each local device
    now (e.g. the bytes of the state this process saves), so that the first
    save with ``"pinned_host"`` staging (chosen, or the fallback of
    ``"auto"`` when device memory is full) copies at PCIe speed instead of
    pinning pages as it copies; JAX's pinned allocator keeps that memory for
    every later save and restore. 0 (the default): pin on first use.

    In a multi-process JAX job (``jax.distributed`` initialised) every process
    creates the manager and calls :meth:`save` with the same steps; each writes
    only its own shards and process 0 commits.

    **Local tier** (``local=``, e.g. ``"file:///dev/shm/run/"``): every save
    commits this process's part to the local tier (one atomic commit there;
    with several processes each has ``process_<i>/`` under it) and returns as
    above; every ``persist_interval_steps``-th step, a ``save(...,
    persist=True)`` and a preemption save are then copied to ``root`` in the
    background, from the local tier's bytes, as ONE atomic commit there
    (retention of ``root`` as above, after it). ``persist_interval_steps=None``
    (the default): only those asked for. The local tier keeps the newest
    ``local_max_to_keep`` steps of this process (default 2; None: all) plus
    those whose promotion has not ended. :meth:`restore` takes the newest step
    every process can read, from its local part first, else from ``root``,
    and deletes this process's local parts newer than that step (no process
    can restore them; the job saves those steps again); when that step was
    read from the local parts, asked to be promoted and is absent from
    ``root`` (the process ended mid-promotion), it is promoted again;
    :meth:`wait_until_finished` and :meth:`close` wait for the promotions too
    (at interpreter exit a promotion gets ``SaveOptions.exit_timeout``, then is
    abandoned: absent from ``root``, never partial). See docs/CHECKPOINTS.md.

    **Preemption** (``save_on_preemption=True``): a SIGTERM handler is
    installed (chaining the previous one; put back by :meth:`close`) or, in a
    multi-controller JAX job with the preemption service (which catches SIGTERM
    itself), JAX's preemption sync point is asked at each :meth:`should_save`; after a notice
    :meth:`should_save` returns True and :meth:`save` saves that step whatever
    the interval and persists it; :attr:`reached_preemption` is True once it did.
    """

    def __init__(
        self,
        root: RootLike,
        *,
        max_to_keep: int | None = None,
        best_metric: str | None = None,
        best_mode: Literal["max", "min"] = "max",
        save_interval_steps: int = 1,
        coordinator: Coordinator | None = None,
        options: SaveOptions | None = None,
        read_grace: float = 0.0,
        warm_staging: int = 0,
        local: RootLike | None = None,
        local_max_to_keep: int | None = 2,
        persist_interval_steps: int | None = None,
        save_on_preemption: bool = False,
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise InvalidArgumentError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        if save_interval_steps < 1:
            raise InvalidArgumentError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        if best_mode not in ("max", "min"):
            raise InvalidArgumentError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
        if isinstance(read_grace, bool) or not isinstance(read_grace, (int, float)) or not read_grace >= 0:
            raise InvalidArgumentError(f"read_grace must be a number of seconds >= 0, got {read_grace!r}")
        if isinstance(warm_staging, bool) or not isinstance(warm_staging, int) or warm_staging < 0:
            raise InvalidArgumentError(f"warm_staging must be a number of bytes >= 0, got {warm_staging!r}")
        if local_max_to_keep is not None and local_max_to_keep < 1:
            raise InvalidArgumentError(f"local_max_to_keep must be >= 1 or None, got {local_max_to_keep}")
        if persist_interval_steps is not None and persist_interval_steps < 1:
            raise InvalidArgumentError(
                f"persist_interval_steps must be >= 1 or None, got {persist_interval_steps}"
            )
        self._root = Root(root, coordinator=coordinator)
        #: the local tier and its promotions (None without ``local=``)
        self._tiers = None if local is None else Tiers(
            self._root, local, local_max_to_keep=local_max_to_keep,
            persist_interval_steps=persist_interval_steps, coordinator=coordinator,
            read_grace=float(read_grace),
        )
        self._preemption = PreemptionWatch() if save_on_preemption else None
        self.max_to_keep = max_to_keep
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.save_interval_steps = save_interval_steps
        self.options = options or SaveOptions()
        #: seconds a deleted step's version stays readable for readers that hold
        #: no lease (restore and open_array hold one, so 0 is safe for them)
        self.read_grace = float(read_grace)
        self._pending: Future[StepInfo] | None = None
        self._lock = threading.Lock()
        #: bytes of pinned host memory pinned ahead for staging (``warm_staging``)
        self.warmed_bytes = _warm(warm_staging)

    @property
    def kvstore(self) -> Any:
        return self._root.kv

    # -- saving ----------------------------------------------------------------
    @property
    def reached_preemption(self) -> bool:
        """True once a preemption notice arrived (``save_on_preemption``) and a step
        was saved (and is being persisted) since: stop the loop. A notice that
        arrives after a save but before this check leaves it False until the
        next step is saved, so the step the loop stops at is always persisted."""
        return self._preemption is not None and self._preemption.notice.is_set() and self._preemption.saved

    def should_save(self, step: int) -> bool:
        """True when ``step`` falls on the save interval and is newer than every saved
        step, or when a preemption notice arrived (``save_on_preemption``; in a
        multi-controller job every process must call this at every step)."""
        latest = self.latest_step()
        if self._preemption is not None and self._preemption.reached(step):
            return latest is None or step > latest
        return step % self.save_interval_steps == 0 and (latest is None or step > latest)

    def save(
        self,
        step: int,
        tree: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
        progress: ProgressArg = None,
        persist: bool = False,
    ) -> Future[StepInfo | None]:
        """Save ``tree`` as ``step``; returns a Future of the commit record (with a
        local tier: of the local commit; ``persist=True`` also promotes the step
        to the persistent root in the background, as every
        ``persist_interval_steps``-th step and a preemption save are).

        Skipped (a done Future of None) when ``step`` is off the save interval and
        ``force`` is False. Blocks for the staging (:class:`SaveOptions`
        ``staging``) and for a previous save still in flight; the rest continues
        in the background. Raises :class:`ConditionFailedError` if the step
        exists. ``progress``: see :func:`tensorstore_py.checkpoint.save`.
        """
        preempted = self._preemption is not None and self._preemption.notice.is_set()
        if preempted:
            force = persist = True  # the job is going away: save this step, durably
        if not force and step % self.save_interval_steps != 0:
            return ready(None)
        if self.best_metric is not None and (metrics is None or self.best_metric not in metrics):
            raise InvalidArgumentError(
                f"step {step}: metrics must contain {self.best_metric!r} (best_metric)"
            )
        with self._lock:
            if self._tiers is not None:
                if self._tiers.pending is not None:
                    self._tiers.pending.result()  # one local save at a time
                fut = self._tiers.save(
                    step, tree, metrics=metrics or {}, options=self.options,
                    persist=persist or self._tiers.wants_persist(step), on_persist=self._after_commit,
                )
            else:
                self.wait_until_finished()
                fut = self._root.save(
                    step, tree, metrics=metrics, options=self.options, on_commit=self._after_commit,
                    progress=progress,
                )
                self._pending = fut
        if preempted:
            self._preemption.saved = True  # type: ignore[union-attr]
        return fut  # type: ignore[return-value]

    def wait_until_finished(self) -> None:
        """Block until the save in flight (if any) is committed -- with a local tier,
        and every promotion scheduled has ended -- ; re-raise its error."""
        if self._tiers is not None:
            self._tiers.wait()
        fut = self._pending
        if fut is not None:
            try:
                fut.result()
            finally:
                self._pending = None

    async def _after_commit(self, info: StepInfo) -> None:
        """Retention after the commit of ``info.step``; never raises (see the class doc)."""
        try:
            await self._retain()
        except Exception as e:
            log.warning("checkpoint step %d at %r is committed, but retention failed (the next "
                        "save retries it): %s: %s", info.step, self._root.kv, type(e).__name__, e)

    async def _retain(self) -> None:
        store = self._root.store
        steps = await store.list_steps()
        metrics: dict[int, dict[str, Any]] = {}
        if self.best_metric is not None and self.max_to_keep is not None and len(steps) > self.max_to_keep:
            for s in steps:
                metrics[s] = (await store.record(s)).metrics
        await store.delete_steps(self._to_delete(steps, metrics), read_grace=self.read_grace)

    def _to_delete(self, steps: list[int], metrics: dict[int, dict[str, Any]]) -> list[int]:
        n = self.max_to_keep
        if n is None or len(steps) <= n:
            return []
        if self.best_metric is None:
            return steps[:-n]
        key = self.best_metric
        sign = 1.0 if self.best_mode == "max" else -1.0

        def score(s: int) -> float:
            v = metrics.get(s, {}).get(key)
            return float("-inf") if v is None else sign * float(v)

        ranked = sorted(steps, key=lambda s: (score(s), s), reverse=True)
        keep = set(ranked[:n]) | {steps[-1]}
        return [s for s in steps if s not in keep]

    # -- listing and restoring -------------------------------------------------
    def all_steps(self) -> list[int]:
        """Every committed step, ascending (of an Orbax run folder: its finished steps;
        with a local tier: those of the root and this process's local parts)."""
        steps = run_sync(self._root.store.list_steps())
        if self._tiers is not None:
            return sorted(set(steps) | set(self._tiers.local_steps()))
        return steps if steps else run_sync(foreign_steps(self._root.kv))

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The step with the best ``best_metric`` (None without a metric or steps)."""
        if self.best_metric is None:
            return None
        steps = self.all_steps()
        if not steps:
            return None
        ms = {s: self.metrics(s) for s in steps}
        keep = self._to_delete(steps, ms)
        ranked = [s for s in steps if s not in keep and self.best_metric in ms[s]]
        if not ranked:
            return None
        pick = max if self.best_mode == "max" else min
        return pick(ranked, key=lambda s: float(ms[s][self.best_metric]))  # type: ignore[index]

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics saved with ``step`` (with a local tier: from the root, else
        from this process's local part)."""
        if self._tiers is not None and step not in run_sync(self._root.store.list_steps()):
            return run_sync(self._tiers.local.store.record(step)).metrics
        return run_sync(self._root.store.record(step)).metrics

    def restore(
        self,
        step: int | None = None,
        *,
        target: Any = None,
        max_bytes_in_flight: int = 512 << 20,
        stats: ReadStats | None = None,
        progress: ProgressArg = None,
        cast: bool = False,
        assemble: Assemble = "auto",
    ) -> Any:
        """Restore ``step`` (default: the latest); see :func:`tensorstore_py.checkpoint.restore`
        (a target leaf of another dtype needs ``cast=True``). Over an Orbax run folder
        it reads the Orbax step (read-only). With a local tier: ``step=None`` is the
        newest step every process can read (the processes agree on it), each
        process reading its local part, else the copy at the root; this
        process's local parts newer than it are deleted (docs/CHECKPOINTS.md)."""
        if self._tiers is not None:
            return self._tiers.restore(
                step, target, options=self.options, on_persist=self._after_commit,
                max_bytes_in_flight=max_bytes_in_flight, stats=stats, cast=cast, assemble=assemble,
            )
        try:
            return self._root.restore(
                step, target, max_bytes_in_flight=max_bytes_in_flight, stats=stats, progress=progress,
                cast=cast, assemble=assemble,
            )
        except NotFoundError:  # no such native step: an Orbax run folder?
            found, tree = restore_foreign_root(
                None, self._root.kv, step if step is not None else self.latest_step(), target,
                cast=cast, max_bytes_in_flight=max_bytes_in_flight, stats=stats,
            )
            if not found:
                raise
            return tree

    def delete(self, step: int) -> None:
        """Delete ``step`` now from every tier: one commit unpublishes it at the
        root, then its bytes are freed. With a local tier, the local save and a
        promotion of ``step`` still in flight end first (so the promotion can
        not publish the step again afterwards; their errors stay for
        :meth:`wait_until_finished`), then this process's local part is deleted too, by
        one commit of the local tier: call it on every process, as
        :meth:`save` (the root's deletion is idempotent). NotFoundError when no
        tier holds ``step``."""
        if self._tiers is not None:
            self._tiers.settle(step)
        if step not in self.all_steps():
            where = f"at {self._root.kv!r}" if self._tiers is None else \
                f"at {self._root.kv!r} or in the local tier {self._tiers.local.kv!r}"
            raise NotFoundError(f"checkpoint step {step} not found {where}")
        run_sync(self._root.store.delete_steps([step], read_grace=self.read_grace))
        if self._tiers is not None:
            self._tiers.delete_local(step)

    def gc(self, *, grace: float | None = None, dry_run: bool = True) -> dict[str, GcReport]:
        """Garbage-collect every tier: ``{"persistent": report}`` for the root and,
        with a local tier, ``"local"`` for this process's local root.

        Retention is caught up first (unless ``dry_run``): the root's
        (``max_to_keep`` / ``best_metric``) on process 0, and the local tier's
        (``local_max_to_keep``; a step whose promotion has not ended is kept).
        Then each tier's versioned store collects what no retained version
        references (``VersionedKvStore.gc``: only objects older than ``grace``
        seconds, default hours, that no live writer's lease claims, so a save
        or promotion in flight is never robbed; a chunk shared by kept steps
        stays). ``dry_run`` (the default) deletes nothing and reports what
        would go."""
        if not dry_run:
            if self._coordinator_index() == 0:
                run_sync(self._retain())
            if self._tiers is not None:
                run_sync(self._tiers.retain_local())
        out = {"persistent": self._root.kv.gc(grace=grace, dry_run=dry_run).result()}
        if self._tiers is not None:
            out["local"] = self._tiers.local.kv.gc(grace=grace, dry_run=dry_run).result()
        return out

    def _coordinator_index(self) -> int:
        if self._tiers is not None:
            return self._tiers.coordinator.process_index
        return self._root._coordinator().process_index

    def close(self) -> None:
        """Wait for the save (and promotions) in flight; put back the SIGTERM handler."""
        try:
            self.wait_until_finished()
        finally:
            if self._preemption is not None:
                self._preemption.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self._root.kv!r}, max_to_keep={self.max_to_keep})"
