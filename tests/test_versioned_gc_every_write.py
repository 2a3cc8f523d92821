"""A collector with grace 0 run right before EVERY base-store write of a commit
(its lease, the large value uploaded beside the commit, the packed values, the
tree nodes written beside the probe, the commit record, the hint) takes nothing
the commit needs: the commit lands and every value reads back (docs/FORMAT.md
§9.3, §9.5). The collector is another root of the same folder, so it sees the
writer only through the lease object on the store; the writer's store has no
blocking I/O, so large values upload beside the commit's nodes.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tensorstore_py as tsp
from tensorstore_py.kvstore.base import Buffer, Generation
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned import leases as _leases
from tensorstore_py.kvstore.versioned.gc import gc
from tensorstore_py.kvstore.versioned.verify import verify

T = 60
BIG = os.urandom(300_000)  # uploaded alone, beside the commit
MID = os.urandom(5_000)  # packed into a data object at commit


class CollectedBeforeWrite(FaultKvStore):
    """Runs a collector (grace 0, deleting) on ``folder`` right before write
    number ``at`` (0-based, counted from :meth:`arm`, the ``latest`` hint's
    background rewrites not counted) reaches the store, once every earlier
    write has landed (so each is old to the collector)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(FileKvStore(path=str(folder)))
        self.folder = folder
        self.at: int | None = None
        self.writes: list[str] = []
        self.landed = 0
        self.deleted: tuple[str, ...] = ()

    def arm(self, at: int | None) -> None:
        self.at, self.writes, self.landed = at, [], 0

    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        if key == "latest":  # the hint is rewritten in the background, whenever
            return await super()._write(key, value, if_equal)
        if self.at is not None and len(self.writes) == self.at:
            while self.landed < len(self.writes):  # every earlier write has landed (or failed)
                await asyncio.sleep(0.005)
            rep = await gc(FileKvStore(path=str(self.folder)), grace=0, dry_run=False)
            self.deleted = rep.deleted
        self.writes.append(key.split("/")[0])
        try:
            return await super()._write(key, value, if_equal)
        finally:
            self.landed += 1


def _single_writes(kv: Any) -> None:
    # one after another: each its own commit (batches of concurrent writes depend on timing)
    for k, v in (("big", BIG), ("mid", MID), ("small", b"s")):
        kv.write(k, v).result(T)


def _transaction(kv: Any) -> None:
    txn = tsp.Transaction()
    view = kv.with_transaction(txn)
    for k, v in (("big", BIG), ("mid", MID), ("small", b"s")):
        view.write(k, v).result(T)
    txn.commit().result(T)


def _warm(folder: Path, lease: str) -> tuple[CollectedBeforeWrite, Any]:
    """A store with one version that this process knows (the commit speculates);
    ``lease``: "held" (the writer linger keeps it) or "gone" (the commit writes it)."""
    store = CollectedBeforeWrite(folder)
    kv = VersionedKvStore(store)
    kv.write("warm", b"w").result(T)
    deadline = time.monotonic() + 10
    while lease == "gone" and any(p.is_file() for p in (folder / "leases").iterdir()):
        assert time.monotonic() < deadline, "the lease was never deleted"
        time.sleep(0.02)
    return store, kv


@pytest.mark.parametrize("lease", ["held", "gone"])
@pytest.mark.parametrize("commit", [_single_writes, _transaction], ids=["writes", "transaction"])
def test_a_collector_before_any_write_of_a_commit_takes_nothing_it_needs(
        tmp_path: Path, commit: Callable[[Any], None], lease: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if lease == "gone":  # a released writer's lease goes at once
        monkeypatch.setattr(_leases, "WRITER_LINGER", 0.0)
        monkeypatch.setattr(_leases, "LINGER", 0.02)
    store, kv = _warm(tmp_path / "count", lease)
    store.arm(None)
    commit(kv)
    kinds = store.writes
    assert {"data", "nodes", "commits"} <= set(kinds), kinds
    assert ("leases" in kinds) == (lease == "gone"), kinds
    for at in range(len(kinds)):
        folder = tmp_path / f"at{at}"
        store, kv = _warm(folder, lease)
        store.arm(at)
        commit(kv)  # lands: a refused commit (DataCorruptionError) fails the test
        assert len(store.writes) > at, (at, store.writes)
        reader = VersionedKvStore(FileKvStore(path=str(folder)))
        got = {k: bytes(reader.read(k).result(T).value) for k in ("warm", "big", "mid", "small")}
        assert got == {"warm": b"w", "big": BIG, "mid": MID, "small": b"s"}, (at, kinds[at])
        assert verify(reader).result(T) == [], (at, kinds[at], store.deleted)
