"""A manager's two tiers: local saves, promotions in the background, restores from either.

:class:`Tiers` is the part of :class:`CheckpointManager` that runs when it has a
local tier (``local=``); tiers.py holds the storage side (parts, promotion,
the choice of a step to restore).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from tensorstore_py.checkpoint.api import Root, RootLike
from tensorstore_py.checkpoint.attempts import next_namespace, publish_failure
from tensorstore_py.checkpoint.coordination import Coordinator
from tensorstore_py.checkpoint.inflight import track
from tensorstore_py.checkpoint.restoring import restore_step
from tensorstore_py.checkpoint.saving import SaveOptions, default_coordinator
from tensorstore_py.checkpoint.storage import StepInfo
from tensorstore_py.checkpoint.tiers import LocalTier, choose_step, mark_promoted, promote, wants_promotion
from tensorstore_py.core.errors import ConditionFailedError, DataCorruptionError, NotFoundError
from tensorstore_py.core.future import Future, ready, run_sync, spawn

__all__ = ["Tiers"]

log = logging.getLogger("tensorstore_py.checkpoint")

#: restores that agreed on a step, per root, in this process: every process
#: counts the same, so the coordination keys of each are new (a key is published once)
_restores: dict[str, itertools.count[int]] = {}
_restores_lock = threading.Lock()


class Tiers:
    """Saves to the local tier, promotions to the persistent one (``root``)."""

    def __init__(
        self, root: Root, local: RootLike, *, local_max_to_keep: int | None, persist_interval_steps: int | None,
        coordinator: Coordinator | None, read_grace: float,
    ) -> None:
        self.root = root
        self.coordinator = coordinator if coordinator is not None else default_coordinator()
        self.local = LocalTier(local, process_index=self.coordinator.process_index,
                               process_count=self.coordinator.process_count)
        self.local_max_to_keep = local_max_to_keep
        self.persist_interval_steps = persist_interval_steps
        self.read_grace = read_grace
        self.pending: Future[StepInfo] | None = None  # the local save in flight
        self.promotion: Future[StepInfo] | None = None  # the newest promotion scheduled
        self.unpromoted: set[int] = set()  # local steps whose promotion is scheduled, not ended
        #: where the last restore read this process's part: "local" or "persistent"
        self.restored_from: str | None = None
        self._tag = hashlib.sha1(repr(root.kv).encode()).hexdigest()[:12]

    def wants_persist(self, step: int) -> bool:
        n = self.persist_interval_steps
        return n is not None and step % n == 0

    def save(
        self, step: int, tree: Any, *, metrics: Mapping[str, Any], options: SaveOptions, persist: bool,
        on_persist: Callable[[StepInfo], Awaitable[Any]],
    ) -> Future[StepInfo]:
        """The local save of ``step``; with ``persist``, its promotion is scheduled
        after it (after the promotion before it: one at a time, in step order)."""
        if persist:
            self.unpromoted.add(step)
        try:
            fut = self.local.save(step, tree, metrics=metrics, options=options, on_commit=self._retain_local,
                                  persist=persist)
        except BaseException as e:
            self.unpromoted.discard(step)
            if persist and self.coordinator.process_count > 1:
                # the other processes promote this step: they hear of it at once
                # (and every process's next save of this step meets its peers')
                spawn(publish_failure(self.coordinator, next_namespace(step), e, options.commit_timeout))
            raise
        self.pending = fut
        if persist:
            self._schedule(step, fut, options, on_persist)
        return fut

    def _schedule(
        self, step: int, local: Future[StepInfo], options: SaveOptions,
        on_persist: Callable[[StepInfo], Awaitable[Any]], *, resumed: bool = False,
    ) -> None:
        prev = self.promotion
        namespace = next_namespace(step)

        async def run() -> StepInfo:
            try:
                if prev is not None:
                    with contextlib.suppress(BaseException):  # its own failure was logged
                        await prev
                try:
                    await local
                except BaseException as e:
                    # the other processes promote this step: they hear of it now,
                    # not after commit_timeout (their next promotions wait on this one)
                    if self.coordinator.process_count > 1:
                        await publish_failure(self.coordinator, namespace, e, options.commit_timeout)
                    raise
                try:
                    info = await promote(self.local, self.root.store, step, coordinator=self.coordinator,
                                         namespace=namespace, options=options, on_commit=on_persist)
                except ConditionFailedError:
                    if not resumed or step not in await self.root.store.list_steps():
                        raise
                    # a promotion resumed by a restore met the one it resumes (still
                    # running in another manager of this tier): the step is there
                    log.info("checkpoint step %d was promoted to %r meanwhile", step, self.root.kv)
                    info = await self.root.store.record(step)
                await mark_promoted(self.local, step)
                return info
            finally:
                self.unpromoted.discard(step)

        fut = spawn(run())
        track(fut, what=f"the promotion of checkpoint step {step} to {self.root.kv!r}",
              exit_timeout=options.exit_timeout)

        def report(f: Future[StepInfo]) -> None:
            if not f.cancelled() and f.exception() is not None:
                e = f.exception()
                log.warning("checkpoint step %d was not promoted to %r (it stays in the local tier): %s: %s",
                            step, self.root.kv, type(e).__name__, e)

        fut.add_done_callback(report)
        self.promotion = fut

    async def retain_local(self) -> None:
        """Delete this process's local parts beyond the newest ``local_max_to_keep``,
        except those whose promotion has not ended (one commit). Parts of another
        process layout are neither counted nor deleted (:meth:`LocalTier.steps`)."""
        n = self.local_max_to_keep
        if n is None:
            return
        steps = await self.local.steps()
        victims = [s for s in steps[:-n] if s not in self.unpromoted]
        await self.local.store.delete_steps(victims, read_grace=self.read_grace)

    def settle(self, step: int) -> None:
        """Wait for the local save and the promotion of ``step`` if they are in
        flight (their failures stay for :meth:`wait` to raise)."""
        fut, prom = self.pending, self.promotion
        for f in (fut, prom if step in self.unpromoted else None):
            if f is not None:
                with contextlib.suppress(Exception):
                    f.result()

    def delete_local(self, step: int) -> None:
        """Delete this process's local part of ``step`` (one commit of the local tier;
        nothing when it holds none)."""
        run_sync(self.local.store.delete_steps([step], read_grace=self.read_grace))

    async def _retain_local(self, info: StepInfo) -> None:
        """Local retention after each local commit (this process's parts); never raises."""
        try:
            await self.retain_local()
        except Exception as e:
            log.warning("checkpoint step %d is committed in the local tier %r, but local retention failed "
                        "(the next save retries it): %s: %s", info.step, self.local.kv, type(e).__name__, e)

    def wait(self) -> None:
        """Block until the local save and every scheduled promotion ended; re-raise
        the local save's error, else the newest promotion's."""
        fut, prom = self.pending, self.promotion
        try:
            if fut is not None:
                try:
                    fut.result()
                finally:
                    self.pending = None
        finally:
            if prom is not None:
                try:
                    prom.result()
                finally:
                    if self.promotion is prom:
                        self.promotion = None

    def _finish_promotion(
        self, step: int, options: SaveOptions, on_persist: Callable[[StepInfo], Awaitable[Any]] | None,
    ) -> None:
        """Promote ``step`` again when its save asked for it (see :meth:`restore`)."""
        if step in self.unpromoted or not (
            self.wants_persist(step) or run_sync(wants_promotion(self.local, step))
        ):
            return
        log.warning("checkpoint step %d is in the local tier %r but not at %r, and its save asked for its "
                    "promotion: promoting it again", step, self.local.kv, self.root.kv)
        self.unpromoted.add(step)

        async def noop(_info: StepInfo) -> None:
            return None

        self._schedule(step, ready(StepInfo(step=step, time=0.0)), options, on_persist or noop, resumed=True)

    def _drop_abandoned(self, step: int, local: list[int]) -> None:
        """Delete this process's local parts newer than ``step``, the step the
        processes agreed to restore (one commit of the local tier, with a warning).

        No process can restore such a part: ``step`` is the newest step that is
        complete locally or at the root, so another process lacks its part of
        any newer one (a replaced node) and the root lacks it. The job resumes
        from ``step`` and saves those step numbers again; a part kept from
        before would make ``latest_step``/``should_save`` skip them on this
        process only, and a later restore would combine it with the other
        processes' new parts of the same step. Parts whose promotion is still
        in flight are kept (the promotion reads them)."""
        stale = [s for s in local if s > step and s not in self.unpromoted]
        if not stale:
            return
        log.warning("checkpoint restore of step %d: this process's local parts of steps %s in %r are "
                    "incomplete (another process lacks its part, and %r does not hold them); the job "
                    "resumes from step %d, so they are deleted", step, stale, self.local.kv, self.root.kv,
                    step)
        run_sync(self.local.store.delete_steps(stale, read_grace=self.read_grace))

    def local_steps(self) -> list[int]:
        """This process's local parts (steps), ascending."""
        return run_sync(self.local.steps())

    def restore(
        self, step: int | None, target: Any, *, options: SaveOptions | None = None,
        on_persist: Callable[[StepInfo], Awaitable[Any]] | None = None, **kw: Any,
    ) -> Any:
        """Restore ``step`` (None: the newest every process can read, agreed through
        the coordinator) from this process's local part, else the persistent copy.

        With ``step=None``, a step read from the local parts whose save asked for
        its promotion (``persist``, the interval, a preemption) and that the
        root lacks -- the process ended before its promotion did -- is promoted
        again in the background, as the save would have (every process agrees
        on the step, so every process schedules it; ``options`` and
        ``on_persist`` as for :meth:`save`)."""
        chosen = step is None
        if chosen and self.pending is not None:
            # this process's local save in flight lands first, so that every
            # process lists it (each waits for its own) and no part of it is
            # taken for an abandoned one (:meth:`_drop_abandoned`); its error
            # stays for :meth:`wait`
            with contextlib.suppress(Exception):
                self.pending.result()
        local = self.local_steps()
        persistent = run_sync(self.root.store.list_steps())
        if step is None:
            with _restores_lock:
                k = next(_restores.setdefault(self._tag, itertools.count(1)))
            step, here = choose_step(
                self.coordinator, local, persistent, key=f"tsp/tiers/{self._tag}/restore/{k}",
                timeout=SaveOptions().commit_timeout,
            )
            if step is None:
                raise NotFoundError(f"no checkpoint steps in the local tier {self.local.kv!r} "
                                    f"or at {self.root.kv!r}")
            self._drop_abandoned(step, local)
        else:
            here = step in local
        if here:
            try:
                out = restore_step(self.local.store, step, target, **kw)
                self.restored_from = "local"
                if chosen and step not in persistent:
                    self._finish_promotion(step, options or SaveOptions(), on_persist)
                return out
            except DataCorruptionError as e:
                if step not in persistent:
                    raise
                # e.g. a replicated shard another process owns: read the persistent copy
                log.warning("checkpoint step %d: the local tier %r can not restore it (%s); reading %r",
                            step, self.local.kv, e, self.root.kv)
        if step not in persistent:
            raise NotFoundError(f"checkpoint step {step} is neither in the local tier {self.local.kv!r} "
                                f"nor at {self.root.kv!r}")
        out = restore_step(self.root.store, step, target, **kw)
        self.restored_from = "persistent"
        return out
