"""A versioned store's history: its versions, tags and deletions, each a commit.

:class:`VersionHistory` holds the methods of
:class:`~tensorstore_py.kvstore.versioned.store.VersionedKvStore` that read or
edit the version history rather than keys: ``newest_version``, ``versions``,
``find_write_id``, ``tags``, ``tag``, ``delete_tag``, ``delete_versions`` and
``gc``. Tag and deletion edits are commits of their own (``kind`` "tag" or
"delete_versions"): atomic, and visible once their Future resolves.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

from tensorstore_py.core.errors import CommitOutcomeUnknownError, InvalidArgumentError, NotFoundError
from tensorstore_py.core.future import Future, spawn
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.participant import CommitInfo
from tensorstore_py.kvstore.versioned.format import CommitRecord, commit_name, ranges_add, ranges_contain
from tensorstore_py.kvstore.versioned.gc import DEFAULT_GRACE, DEFAULT_READ_GRACE, GcReport
from tensorstore_py.kvstore.versioned.gc import gc as collect_garbage
from tensorstore_py.kvstore.versioned.root import Plan, RootView, VersionedRoot

__all__ = ["VersionHistory", "VersionInfo", "check_tag"]

_TAG_RE = re.compile(r"[A-Za-z_.\-][A-Za-z0-9_.\-]{0,127}\Z")


@dataclass(frozen=True)
class VersionInfo:
    """One committed version: number, commit time (Unix seconds), write-id, message, metadata."""

    version: int
    time: float
    write_id: str
    message: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


def check_tag(name: str) -> str:
    if not isinstance(name, str) or not _TAG_RE.match(name) or name in (".", ".."):
        raise InvalidArgumentError(
            f"tag name {name!r} must be 1 to 128 characters from [A-Za-z0-9_.-], not starting with a digit"
        )
    return name


class VersionHistory(KvStore, RootView):
    """The version-history methods of a versioned store (see the module docstring)."""

    _root: VersionedRoot

    def newest_version(self) -> Future[int]:
        """The newest committed version (0 for an empty store)."""
        return spawn(self._root.newest())

    def find_write_id(
        self, write_id: str | CommitOutcomeUnknownError, *, since: int | None = None,
        version: int | None = None,
    ) -> Future[int | None]:
        """Did the commit stamped ``write_id`` land, and as which version?

        The answer to :class:`~tensorstore_py.errors.CommitOutcomeUnknownError`:
        pass the error itself (``kv.find_write_id(err)``), or its ``write_id``
        (a transaction's is ``txn.write_id``) and the ``version`` it was
        attempted as. Returns the version it committed as, or None when it did
        not commit and never will: a commit record can only land as the
        version its writer attempted, so "not found" is final once a version at
        or above that one exists. Until then (the attempt's request may still
        be in flight) it raises CommitOutcomeUnknownError again rather than
        answer None. Without a known ``version`` (a plain write-id string) None
        only means "not committed as of the newest version now".

        Scans commit records down from the newest version, so a recent commit
        costs a few reads; ``since`` (a version older than the commit, e.g. the
        one the transaction read) bounds the scan to versions above it.
        """
        if isinstance(write_id, CommitOutcomeUnknownError):
            version = write_id.version if version is None else version
            write_id = write_id.write_id  # type: ignore[assignment]
        if not isinstance(write_id, str) or not write_id:
            raise InvalidArgumentError(f"find_write_id: write_id must be a non-empty string, got {write_id!r}")
        if since is not None and (isinstance(since, bool) or not isinstance(since, int) or since < 0):
            raise InvalidArgumentError(f"find_write_id: since must be a version >= 0, got {since!r}")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
            raise InvalidArgumentError(f"find_write_id: version must be a version >= 1, got {version!r}")
        wid: str = write_id

        async def run() -> int | None:
            rec = await self._root.find_record(lambda r: r.write_id == wid, since or 0)
            if rec is not None:
                return rec.version
            if version is not None and self._root.known < version:
                raise CommitOutcomeUnknownError(
                    f"versioned store {self._root.base!r}: the commit with write-id {wid} is not "
                    f"among versions up to {self._root.known}, but it can still land as version "
                    f"{version}, which does not exist yet; ask again later (the answer is final "
                    f"once version {version} exists)",
                    write_id=wid, key=commit_name(version), version=version,
                )
            return None

        return spawn(run())

    def versions(self) -> Future[list[VersionInfo]]:
        """Every retained (not deleted) version, oldest first."""
        return spawn(self._versions())

    async def _versions(self) -> list[VersionInfo]:
        n = await self._root.newest()
        newest = await self._root.record_at(n)
        deleted = newest.deleted if newest else []
        sem = asyncio.Semaphore(64)

        async def one(v: int) -> CommitRecord | None:
            async with sem:
                return await self._root.record_at(v)

        recs = await asyncio.gather(*(one(v) for v in range(1, n + 1) if not ranges_contain(deleted, v)))
        return [
            VersionInfo(r.version, r.time, r.write_id, r.message, dict(r.metadata))
            for r in recs if r is not None
        ]

    def tags(self) -> Future[dict[str, int]]:
        """All tags (name -> version) as of the newest version."""

        async def run() -> dict[str, int]:
            rec = await self._root.record_at(await self._root.newest())
            return dict(rec.tags) if rec else {}

        return spawn(run())

    def tag(self, name: str, version: int | None = None, *, message: str = "") -> Future[CommitInfo]:
        """Name ``version`` (default: the newest) ``name``, as a commit."""
        check_tag(name)
        self._check_writable("tag", name)

        async def edit(parent: CommitRecord) -> tuple[dict[str, int], list[list[int]]]:
            v = parent.version if version is None else version
            if not 1 <= v <= parent.version or ranges_contain(parent.deleted, v):
                raise NotFoundError(f"tag {name!r}: version {v} does not exist or was deleted")
            return {**parent.tags, name: v}, parent.deleted

        return spawn(self._meta_commit("tag", edit, message), cancel_reports_outcome=True)

    def delete_tag(self, name: str, *, message: str = "") -> Future[CommitInfo]:
        """Remove tag ``name``, as a commit (NotFoundError if there is none)."""
        self._check_writable("delete_tag", name)

        async def edit(parent: CommitRecord) -> tuple[dict[str, int], list[list[int]]]:
            if name not in parent.tags:
                raise NotFoundError(f"delete_tag: no tag {name!r}")
            return {k: v for k, v in parent.tags.items() if k != name}, parent.deleted

        return spawn(self._meta_commit("tag", edit, message), cancel_reports_outcome=True)

    def delete_versions(self, versions: list[int], *, message: str = "") -> Future[CommitInfo]:
        """Mark ``versions`` deleted, as a commit; GC may then reclaim their data.

        The newest version and tagged versions can not be deleted.
        """
        self._check_writable("delete_versions", str(versions))
        vs = [int(v) for v in versions]

        async def edit(parent: CommitRecord) -> tuple[dict[str, int], list[list[int]]]:
            tagged = {v: t for t, v in parent.tags.items()}
            for v in vs:
                if not 1 <= v < parent.version:
                    raise InvalidArgumentError(
                        f"delete_versions: version {v} is not an existing version older than the "
                        f"newest ({parent.version})"
                    )
                if v in tagged:
                    raise InvalidArgumentError(
                        f"delete_versions: version {v} is tagged {tagged[v]!r}; delete the tag first"
                    )
            return parent.tags, ranges_add(parent.deleted, vs)

        return spawn(self._meta_commit("delete_versions", edit, message), cancel_reports_outcome=True)

    def gc(
        self, *, grace: float | None = None, dry_run: bool = True, reclaim_deleted: bool = False,
        read_grace: float = DEFAULT_READ_GRACE,
    ) -> Future[GcReport]:
        """Garbage-collect objects no retained version references (FORMAT.md §9).

        Same as :func:`tensorstore_py.kvstore.versioned.gc.gc` on this store:
        only unreferenced objects older than ``grace`` seconds (default: the gc
        module's, hours) and not claimed by a live writer's lease go, so a
        writer in flight is never robbed; ``dry_run`` (the default) deletes
        nothing and reports what would go.
        """
        if grace is None:
            grace = DEFAULT_GRACE
        return collect_garbage(self, grace=grace, dry_run=dry_run, reclaim_deleted=reclaim_deleted,
                               read_grace=read_grace)

    async def _meta_commit(self, kind: str, edit: Any, message: str) -> CommitInfo:
        """Commit a ``tag`` / ``delete_versions`` edit (cancelled once its record
        was sent: CommitOutcomeUnknownError, as ``VersionedRoot.commit`` says)."""
        async def plan(parent: CommitRecord | None) -> Plan:
            if parent is None:
                raise NotFoundError(f"{kind}: the versioned store over {self.base!r} has no versions")
            tags, deleted = await edit(parent)
            return Plan([], kind=kind, message=message, tags=tags, deleted=deleted)

        rec = await self._root.commit(plan)
        assert rec is not None
        return CommitInfo(version=rec.version, write_id=rec.write_id, time=rec.time)
