"""Garbage collection racing writers, leases and skewed clocks (docs/FORMAT.md §9.3, §9.5).

Races are driven deterministically: a wrapper store runs a hook (a coroutine,
on the event loop) right before a chosen call reaches the real store, so the
collector or the lease keeper stands still at exactly that point while the
test commits, registers or releases.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import tensorstore_py as tsp
from tensorstore_py.core.future import get_loop
from tensorstore_py.errors import DataCorruptionError, StorageError
from tensorstore_py.kvstore.base import Buffer, ByteRange, Generation, KeyInfo, KvStore, ReadResult
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned import leases as _leases
from tensorstore_py.kvstore.versioned.format import unframe
from tensorstore_py.kvstore.versioned.gc import gc
from tensorstore_py.kvstore.versioned.leases import MAGIC_LEASE
from tensorstore_py.kvstore.versioned.verify import verify

T = 60
# these races wait for a released writer's lease to be deleted (or rewritten):
# without the writer linger, as in the tests of the linger itself
pytestmark = pytest.mark.usefixtures("no_writer_linger")
Hook = Callable[[], Awaitable[None]]


class Paused(FaultKvStore):
    """Runs ``hook`` once, right before the first call ``op`` on a key matching
    ``pattern`` (listings pass their prefix) reaches the base store -- the
    first one after a call matching ``after`` (``"op pattern"``), if given."""

    def __init__(self, base: KvStore) -> None:
        super().__init__(base)
        self.hooks: list[tuple[str, str, Hook, str | None]] = []
        self.seen: list[str] = []
        self.fired: list[str] = []

    def pause(self, op: str, pattern: str, hook: Hook, *, after: str | None = None) -> None:
        self.hooks.append((op, pattern, hook, after))

    async def _hook(self, op: str, key: str) -> None:
        call = f"{op} {key}"
        for i, (o, pattern, hook, after) in enumerate(self.hooks):
            armed = after is None or any(fnmatch.fnmatchcase(c, after) for c in self.seen)
            if armed and o == op and fnmatch.fnmatchcase(key, pattern):
                del self.hooks[i]
                self.fired.append(call)
                await hook()
                break
        self.seen.append(call)

    async def _read(self, key: str, byte_range: ByteRange | None, if_not_equal: Generation | None) -> ReadResult:
        await self._hook("read", key)
        return await super()._read(key, byte_range, if_not_equal)

    async def _write(self, key: str, value: Buffer, if_equal: Generation | None) -> Generation:
        await self._hook("write", key)
        return await super()._write(key, value, if_equal)

    async def _delete(self, key: str, if_equal: Generation | None) -> None:
        await self._hook("delete", key)
        await super()._delete(key, if_equal)

    async def _list_info(self, prefix: str) -> list[KeyInfo]:
        await self._hook("list", prefix)
        return await self.base.list_info(prefix)


async def _no_leases(base: KvStore) -> None:
    """Wait until no lease object is left (a released keeper deletes its own)."""
    deadline = time.monotonic() + 10
    while await base.list("leases/"):
        assert time.monotonic() < deadline, "the lease was never released"
        await asyncio.sleep(0.02)


def _data(base: KvStore) -> set[str]:
    return set(base.list("data/").result(T))


# -- item 3: the collector reads the writers' leases before the newest version --------------
@pytest.mark.parametrize("after", [None, "read commits/*"], ids=["first-lease-read", "after-newest"])
def test_a_long_transaction_that_commits_while_gc_runs_keeps_its_data(
        tmp_path: Path, after: str | None) -> None:
    """A transaction older than the grace commits and drops its lease while a
    collector is between its reads (before it lists the leases; after it
    found the newest version): its data objects must survive."""
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    txn = tsp.Transaction()
    big = os.urandom(300_000)
    kv.with_transaction(txn).write("big", big).result(T)  # its own data object, lease held
    (mine,) = _data(base)
    time.sleep(0.05)  # older than the grace of 0 s below

    async def commit_and_leave() -> None:
        assert (await txn.commit()).version == 2
        await _no_leases(base)

    collector = Paused(FileKvStore(path=str(tmp_path)))  # another root: sees leases on the store only
    collector.pause("list", "leases/", commit_and_leave, after=after)
    rep = gc(collector, grace=0, dry_run=False).result(T)
    assert collector.fired, "the collector never reached the pause"
    assert mine not in rep.deleted, rep.summary()
    assert base.read(mine).result(T).state == "value"
    assert bytes(kv.read("big").result(T).value) == big
    assert verify(kv).result(T) == []


def test_a_fragment_merged_while_gc_runs_keeps_its_data(tmp_path: Path) -> None:
    """A participant's fragment is listed, then merged and deleted by process 0
    before the collector reads it: the version it became is marked instead."""
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    txns = [tsp.Transaction(txn_id="late", process_index=i, process_count=3, timeout=30) for i in range(3)]
    # process 0 only reads (no writer lease): it opens the attempt, then waits to merge
    assert bytes(kv.with_transaction(txns[0]).read("a").result(T).value) == b"1"
    fut0 = txns[0].commit()
    big = os.urandom(300_000)
    kv.with_transaction(txns[1]).write("p1", big).result(T)
    assert txns[1].commit(wait=False).result(T).version is None  # delivered, lease dropped
    (p1_data,) = _data(base)
    asyncio.run_coroutine_threadsafe(_no_leases(base), get_loop()).result(T)
    old = time.time() - 7200  # participant 1 wrote its data 2 h ago; its fragment is young
    os.utime(tmp_path / p1_data, (old, old))

    async def merge() -> None:
        await kv.with_transaction(txns[2]).write("p2", b"2")
        await txns[2].commit(wait=False)
        assert (await fut0).version == 2
        await _no_leases(base)

    collector = Paused(FileKvStore(path=str(tmp_path)))
    collector.pause("read", "txns/late/*-*/000001", merge)
    rep = gc(collector, grace=3600, dry_run=False).result(T)
    assert collector.fired, "the collector never read the fragment"
    assert p1_data not in rep.deleted, rep.summary()
    assert bytes(kv.read("p1").result(T).value) == big
    assert verify(kv).result(T) == []


# -- item 4: registration never returns without a durable lease -------------------------------
def _lease_bodies(base: KvStore) -> list[dict[str, Any]]:
    out = []
    for name in base.list("leases/").result(T):
        res = base.read(name).result(T)
        if res.state == "value":
            out.append(unframe(MAGIC_LEASE, res.value, name))
    return out


@pytest.mark.parametrize("linger", [0.0, 0.5], ids=["at-release", "after-writer-linger"])
def test_a_writer_registering_while_the_lease_is_deleted_gets_a_lease(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linger: float) -> None:
    monkeypatch.setattr(_leases, "WRITER_LINGER", linger)  # the delete comes after it
    inner = FileKvStore(path=str(tmp_path))
    base = Paused(inner)
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    t1 = tsp.Transaction()
    kv.with_transaction(t1).write("x", b"x").result(T)
    assert [b["writing"] for b in _lease_bodies(inner)] == [True]
    t2 = tsp.Transaction()
    state: dict[str, Any] = {}

    async def register_meanwhile() -> None:
        # the last writer ended: the keeper is deleting its lease right now
        state["write"] = asyncio.ensure_future(kv.with_transaction(t2).write("y", os.urandom(300_000)))
        await asyncio.sleep(0.2)
        state["returned_during_delete"] = state["write"].done()

    base.pause("delete", "leases/*", register_meanwhile)
    t1.abort()  # releases the only writer
    deadline = time.monotonic() + 10
    while "write" not in state:
        assert time.monotonic() < deadline, "the lease was never deleted"
        time.sleep(0.02)
    asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(state["write"]), T),
                                     get_loop()).result(T)
    assert not state["returned_during_delete"]
    bodies = _lease_bodies(inner)  # t2 is open and has written: its lease must be on the store
    assert [b["writing"] for b in bodies] == [True], bodies
    assert t2.commit().result(T).version == 2


def test_a_lease_write_that_fails_stops_the_writer(tmp_path: Path) -> None:
    inner = FileKvStore(path=str(tmp_path))
    base = FaultKvStore(inner)
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    asyncio.run_coroutine_threadsafe(_no_leases(inner), get_loop()).result(T)
    base.inject(op="write", key_pattern="leases/*", error=StorageError)  # every lease write fails
    before = _data(inner)
    with pytest.raises(StorageError, match="could not write lease 'leases/[0-9a-f]{32}'"):
        with tsp.Transaction() as txn:
            kv.with_transaction(txn).write("big", os.urandom(300_000)).result(T)
    assert _data(inner) == before  # nothing written without a lease
    assert inner.list("leases/").result(T) == []
    base.clear()
    with tsp.Transaction() as txn:  # the store works again: so does the writer
        kv.with_transaction(txn).write("big", b"b" * 300_000).result(T)
    assert bytes(kv.read("big").result(T).value) == b"b" * 300_000


def test_a_young_data_object_that_vanished_refuses_the_commit(tmp_path: Path) -> None:
    """A collector with grace 0 that missed the lease takes seconds-old data:
    the commit is refused, nothing visible."""
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    txn = tsp.Transaction()
    kv.with_transaction(txn).write("big", os.urandom(300_000)).result(T)
    (victim,) = _data(base)
    base.delete(victim).result(T)
    with pytest.raises(DataCorruptionError, match="this transaction wrote are gone.*nothing was committed"):
        txn.commit().result(T)
    assert kv.newest_version().result(T) == 1
    assert verify(kv).result(T) == []


# -- item 5: ages come from the filesystem's clock, not the writing host's -----------------------
_SKEWED_WRITER = textwrap.dedent("""
    import os, sys, time
    skew = float(os.environ["TSP_TEST_CLOCK_SKEW"])  # this process's clock runs behind
    real_ns, real = time.time_ns, time.time
    time.time_ns = lambda: real_ns() + int(skew * 1e9)
    time.time = lambda: real() + skew
    import tensorstore_py as tsp
    from tensorstore_py.kvstore.file import FileKvStore
    from tensorstore_py.kvstore.versioned import VersionedKvStore
    kv = VersionedKvStore(FileKvStore(path=sys.argv[1]))
    txn = tsp.Transaction()
    kv.with_transaction(txn).write("big", bytes(range(256)) * 1200).result(60)
    print("ready", flush=True)
    sys.stdin.readline()
    print("committed", txn.commit().result(60).version, flush=True)
""")


def test_a_writer_whose_clock_is_15_minutes_behind_keeps_its_lease_and_data(tmp_path: Path) -> None:
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    env = {**os.environ, "TSP_TEST_CLOCK_SKEW": str(-15 * 60)}
    p = subprocess.Popen([sys.executable, "-c", _SKEWED_WRITER, str(tmp_path)], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.stderr else ""
        (written,) = _data(base)
        rep = gc(kv, grace=600, dry_run=False).result(T)  # grace 10 min
        assert rep.expired_leases == () and rep.leases == 1, rep
        assert written not in rep.deleted and rep.deleted == (), rep.deleted
        p.stdin.write("\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=T)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert out.split() == ["committed", "2"]
    assert bytes(kv.read("big").result(T).value) == bytes(range(256)) * 1200
    assert verify(kv).result(T) == []


def test_file_stamps_come_from_the_filesystem_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Create-only writes and overwrites alike: a host clock an hour off does
    not show in the modification times the store reports."""
    base = FileKvStore(path=str(tmp_path))
    real_ns = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real_ns() - 3600 * 10**9)
    base.write("k", b"1", if_equal=Generation.NO_VALUE).result(T)
    base.write("o", b"1").result(T)
    base.write("o", b"2").result(T)
    monkeypatch.undo()
    now = time.time()
    infos = {i.key: i.mtime for i in base.list_info().result(T)}
    assert set(infos) == {"k", "o"}
    assert all(m is not None and abs(now - m) < 60 for m in infos.values()), infos


# -- siblings: writes outside a transaction, expired leases refreshed late ---------------------
def test_a_single_write_whose_data_vanished_before_its_record_is_refused(tmp_path: Path) -> None:
    inner = FileKvStore(path=str(tmp_path))
    base = Paused(inner)
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)

    async def collector_without_lease() -> None:
        for name in await inner.list("data/"):
            await inner.delete(name)

    # data written, record not yet: right before the pre-commit check reads the data
    # object back (the upload runs beside the commit's nodes, so a pause at the node
    # write may come before the data object exists)
    base.pause("read", "data/*", collector_without_lease)
    with pytest.raises(DataCorruptionError, match="this batch wrote are gone.*nothing was committed"):
        kv.write("big", os.urandom(300_000)).result(T)
    assert base.fired
    assert kv.newest_version().result(T) == 1
    assert kv.read("big").result(T).state == "missing"
    assert verify(kv).result(T) == []


def test_an_expired_lease_refreshed_while_gc_reads_it_is_not_deleted(tmp_path: Path) -> None:
    from tensorstore_py.kvstore.versioned.format import frame
    from tensorstore_py.kvstore.versioned.leases import TTL

    inner = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(inner)
    kv.write("a", b"1").result(T)
    name = "leases/" + "78" * 16  # a writer elsewhere whose refresh came late
    body = {"format": 2, "host": "elsewhere", "pid": 1, "ttl": TTL, "versions": [], "writing": True,
            "writing_for": 5.0}
    inner.write(name, frame(MAGIC_LEASE, body)).result(T)
    old = time.time() - TTL - 60
    os.utime(tmp_path / name, (old, old))

    async def refresh() -> None:
        await inner.write(name, frame(MAGIC_LEASE, {**body, "writing_for": 400.0}))

    collector = Paused(FileKvStore(path=str(tmp_path)))
    # between the listing and the read of its body, the last time the collector reads the leases
    collector.pause("read", name, refresh, after="read commits/*")
    rep = gc(collector, grace=0, dry_run=False).result(T)
    assert collector.fired
    assert inner.read(name).result(T).state == "value", rep
    assert rep.expired_leases == () and rep.leases >= 1  # live again


def test_a_reader_whose_lease_can_not_be_written_reads_on(tmp_path: Path) -> None:
    """Read-only credentials: a pinned snapshot works without a lease."""
    inner = FileKvStore(path=str(tmp_path))
    VersionedKvStore(inner).write("a", b"1").result(T)
    asyncio.run_coroutine_threadsafe(_no_leases(inner), get_loop()).result(T)
    base = FaultKvStore(inner)
    base.inject(op="write", key_pattern="leases/*", error=StorageError)
    snap = VersionedKvStore(base).snapshot(1)
    assert bytes(snap.read("a").result(T).value) == b"1"
    assert inner.list("leases/").result(T) == []


def test_a_coordinator_that_wrote_nothing_keeps_its_nodes_until_its_record(tmp_path: Path) -> None:
    """Process 0 of a multi-writer transaction that only read writes the merged
    tree's nodes, then its commit record: a collector running in between (grace
    0) must not take the nodes (the commit holds a writer lease)."""
    inner = FileKvStore(path=str(tmp_path))
    base = Paused(inner)
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    txns = [tsp.Transaction(txn_id="reader0", process_index=i, process_count=2, timeout=30) for i in range(2)]
    assert bytes(kv.with_transaction(txns[0]).read("a").result(T).value) == b"1"
    reports = []

    async def collect_between_nodes_and_record() -> None:
        await asyncio.sleep(1.5)  # participant 1's lease is released by now
        reports.append(await gc(FileKvStore(path=str(tmp_path)), grace=0, dry_run=False))

    base.pause("write", "commits/00000000000000000002", collect_between_nodes_and_record)
    fut0 = txns[0].commit()
    kv.with_transaction(txns[1]).write("p1", b"x" * 1000).result(T)
    txns[1].commit(wait=False).result(T)
    assert fut0.result(T).version == 2
    assert reports, "the collector never ran"
    assert not [n for n in reports[0].deleted if n.startswith("nodes/")], reports[0].summary()
    assert bytes(kv.read("p1").result(T).value) == b"x" * 1000
    assert verify(kv).result(T) == []
