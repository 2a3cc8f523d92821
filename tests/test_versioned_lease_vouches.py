"""The pre-commit check where the writer's lease vouches for its data (docs/FORMAT.md §9.3).

On a store whose modification times one clock stamps (gcs, s3), a commit does
not read back the data objects it wrote under a lease that has said
``writing`` without a lapse since: every collector saw that lease. Where the
lease lapsed (not refreshed within its ttl), or is stale when the commit
record is due, the objects are read back, and a commit whose objects a
collector took meanwhile is refused, nothing visible.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
from test_versioned_gc_races import Paused

import tensorstore_py as tsp
from tensorstore_py.errors import DataCorruptionError
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned import leases as _leases
from tensorstore_py.kvstore.versioned.gc import gc
from tensorstore_py.kvstore.versioned.verify import verify
from tensorstore_py.testing.shaping_proxy import ShapingProxy

T = 60


class OneClockPaused(Paused):
    """The race wrapper over a gcs store: modification times are still the server's."""

    single_clock = True


def _stores(gcs_emulator: Any, prefix: str) -> tuple[Any, Any]:
    """(the writer's base store, a collector's view of the same objects: another root)."""
    bucket = gcs_emulator.create_bucket()
    spec = gcs_emulator.spec(bucket, path=prefix)
    writer = tsp.KvStore.open(spec).result(T)
    collector = Paused(tsp.KvStore.open(spec).result(T))  # another spec: another root, no shared lease
    return writer, collector


def _data(base: Any) -> set[str]:
    return set(base.list("data/").result(T))


def _collected_while_a_write_stalls(gcs_emulator: Any, prefix: str, after_stall: Callable[[], None]) -> None:
    """A write outside a transaction stalls 2 s between its tree nodes and its
    record (``after_stall()`` runs at the end of the stall); a collector of
    another root, grace 0, runs then and takes the data object. The write must
    fail as refused, nothing committed, the object's key missing."""
    bucket = gcs_emulator.create_bucket()
    spec = gcs_emulator.spec(bucket, path=prefix)
    base = OneClockPaused(tsp.KvStore.open(spec).result(T))
    collector = Paused(tsp.KvStore.open({**spec, "concurrency": 8}).result(T))  # another root
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    deleted: list[str] = []

    async def stall_and_collect() -> None:
        await asyncio.sleep(2.0)
        after_stall()
        rep = await gc(collector, grace=0, dry_run=False)
        deleted.extend(rep.deleted)

    base.pause("write", "nodes/*", stall_and_collect)  # data written, record not yet
    with pytest.raises(DataCorruptionError, match="this batch wrote are gone.*nothing was committed"):
        kv.write("big", os.urandom(300_000)).result(T)
    assert base.fired and [n for n in deleted if n.startswith("data/")], deleted
    assert kv.newest_version().result(T) == 1
    assert kv.read("big").result(T).state == "missing"


def test_a_lease_that_lapsed_after_the_write_does_not_vouch_for_it(
        gcs_emulator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease is not refreshed within its ttl after the data object's write: a
    collector takes the object; the lease written again at commit is fresh, but
    it lapsed in between, so the object is read back and the commit refused."""
    monkeypatch.setattr(_leases, "TTL", 1.5)
    monkeypatch.setattr(_leases, "REFRESH", 1000.0)  # no refresh: the lease lapses
    base, collector = _stores(gcs_emulator, "lapse/")
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    txn = tsp.Transaction()
    kv.with_transaction(txn).write("big", os.urandom(300_000)).result(T)
    (victim,) = _data(base)
    time.sleep(2.0)  # past the ttl by the server's clock
    rep = gc(collector, grace=0, dry_run=False).result(T)
    assert victim in rep.deleted, rep.summary()
    with pytest.raises(DataCorruptionError, match="this transaction wrote are gone.*nothing was committed"):
        txn.commit().result(T)
    assert kv.newest_version().result(T) == 1
    assert kv.read("big").result(T).state == "missing"
    assert verify(kv).result(T) == []


def test_a_lease_gone_stale_before_the_record_does_not_vouch(
        gcs_emulator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write outside a transaction (group commit) stalls between its tree nodes
    and its record for longer than the ttl, and a collector takes its data
    object meanwhile: the lease held without a gap until the stall, but it is
    stale when the record is due, so the object is read back: refused."""
    monkeypatch.setattr(_leases, "TTL", 1.5)
    monkeypatch.setattr(_leases, "REFRESH", 1000.0)
    _collected_while_a_write_stalls(gcs_emulator, "stale/", lambda: None)


def test_a_collector_racing_a_leased_commit_keeps_its_data_unread(gcs_emulator: Any) -> None:
    """The lease holds: a collector with grace 0 running between the data's upload
    and the commit keeps the object, and the commit reads none of it back."""
    bucket = gcs_emulator.create_bucket()
    spec = gcs_emulator.spec(bucket, path="held/")
    collector = Paused(tsp.KvStore.open(spec).result(T))
    with ShapingProxy(gcs_emulator.endpoint) as proxy:
        base = tsp.KvStore.open({**spec, "endpoint": proxy.endpoint}).result(T)
        kv = VersionedKvStore(base)
        kv.write("a", b"1").result(T)
        txn = tsp.Transaction()
        big = os.urandom(300_000)
        kv.with_transaction(txn).write("big", big).result(T)
        (mine,) = _data(base)
        time.sleep(0.05)  # older than the grace of 0 s
        rep = gc(collector, grace=0, dry_run=False).result(T)
        assert mine not in rep.deleted and rep.leases >= 1, rep.summary()
        proxy.reset_counters()
        assert txn.commit().result(T).version == 2
        reads = [line for line, _, _ in proxy.request_log() if line.startswith("GET") and "data%2F" in line]
        assert reads == []  # no presence check of the data object
        assert bytes(kv.read("big").result(T).value) == big
        assert verify(kv).result(T) == []


class _SuspendedHost:
    """The leases module's view of ``time`` on a host that was suspended for
    ``slept`` seconds: ``time.monotonic()`` did not count them (Linux's
    CLOCK_MONOTONIC stands still while the machine sleeps), CLOCK_BOOTTIME did,
    and so did the store's clock."""

    CLOCK_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)

    def __init__(self) -> None:
        self.slept = 0.0

    def monotonic(self) -> float:
        return time.monotonic() - self.slept

    def clock_gettime(self, clock: int) -> float:
        return time.clock_gettime(clock)


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME"), reason="a clock that counts suspend: Linux")
def test_a_lease_that_expired_while_the_host_was_suspended_does_not_vouch(
        gcs_emulator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host sleeps (a laptop's lid, a paused VM) between a write outside a
    transaction's tree nodes and its record, longer than the lease's ttl; a
    collector takes the data object meanwhile. The lease is stale by the
    store's clock and by the clock that counts the sleep, though not by
    time.monotonic(): the object is read back and the commit refused."""
    monkeypatch.setattr(_leases, "TTL", 1.5)
    monkeypatch.setattr(_leases, "REFRESH", 1000.0)
    host = _SuspendedHost()
    monkeypatch.setattr(_leases, "time", host)

    def suspended() -> None:
        host.slept += 2.0  # the host was suspended all that time

    _collected_while_a_write_stalls(gcs_emulator, "suspended/", suspended)
