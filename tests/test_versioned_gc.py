"""Garbage collection and retention of the versioned store (FORMAT.md §9)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _versioned_workload import (
    BASES,
    all_keys,
    check_version,
    fresh_versioned,
    open_base,
    run_writer,
    writes_until_commit_record,
)

import tensorstore_py as tsp
from tensorstore_py.errors import (
    DataCorruptionError,
    InvalidArgumentError,
    NotFoundError,
    SnapshotExpiredError,
)
from tensorstore_py.kvstore.base import KeyInfo, KvStore
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.gc import gc, reclaim
from tensorstore_py.kvstore.versioned.verify import verify

T = 60


def _objects(base: KvStore) -> dict[str, bytes]:
    """Every object of the store with its bytes."""
    return {k: bytes(base.read(k).result(T).value) for k in base.list().result(T)}


def _collectable(names: set[str]) -> set[str]:
    return {n for n in names if n.split("/", 1)[0] in ("nodes", "data", "changes", "txns")}


@pytest.mark.parametrize("parts", [1, 3])
def test_orphans_of_a_killed_writer_are_collected(tmp_path: Any, parts: int) -> None:
    root = str(tmp_path / "store")
    for c in range(3):
        assert run_writer(root, first_counter=c * 10, commits=1, parts=parts) == 0
    base = FileKvStore(path=root)
    before = _objects(base)
    # die just before the commit record lands: everything the writer wrote is an orphan
    k = writes_until_commit_record(root, str(tmp_path / "scratch"), parts=parts)
    assert run_writer(root, first_counter=100, commits=1, parts=parts, kill_at=k) == -9
    kv = fresh_versioned(root)
    assert kv.newest_version().result(T) == 3
    orphans = _collectable(set(base.list().result(T)) - set(before))
    assert any(n.startswith("data/") for n in orphans) and any(n.startswith("nodes/") for n in orphans)
    if parts > 1:
        assert any(n.startswith("txns/") for n in orphans)  # fragments without a result

    # finished multi-writer transactions leave their result behind (their
    # attempts and fragments are deleted once merged); it stays while the
    # version it names is retained: it answers "did this txn id commit?"
    finished = {n for n in before if n.startswith("txns/")}
    assert len(finished) == (0 if parts == 1 else 3)

    young = gc(kv).result(T)  # default grace: everything is young, nothing goes
    assert young.dry_run and young.deleted == ()
    # (data named by a live fragment count as referenced, not as young)
    assert {n for n in orphans if not n.startswith("data/")} <= set(young.kept_young)
    assert set(young.kept_young) <= orphans | finished
    dry = gc(kv, grace=0).result(T)
    assert set(dry.deleted) == orphans and dry.reclaimed == ()
    assert dry.deleted_bytes == sum(os.path.getsize(os.path.join(root, n)) for n in orphans)
    assert set(base.list().result(T)) >= orphans  # a dry run deletes nothing

    done = gc(kv, grace=0, dry_run=False).result(T)
    assert set(done.deleted) == orphans and not done.dry_run
    after = _objects(base)
    assert _collectable(set(after)) == _collectable(set(before))
    for name, data in before.items():  # committed objects untouched, byte for byte
        if name != "latest":
            assert after[name] == data, name
    kv = fresh_versioned(root)
    for v in range(1, 4):
        check_version(kv, v, all_keys(parts))
    assert verify(kv).result(T) == []
    assert gc(kv, grace=0).result(T).deleted == ()
    # and the store takes new commits
    assert run_writer(root, first_counter=200, commits=1, parts=parts) == 0
    assert fresh_versioned(root).newest_version().result(T) == 4


def test_young_orphans_are_kept_until_the_grace_period_passes(tmp_path: Any) -> None:
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    kv.write("a", b"x" * 1000).result(T)
    orphan = "data/" + "ab" * 16
    base.write(orphan, b"left by a writer in flight").result(T)
    rep = gc(kv, grace=3600, dry_run=False).result(T)
    assert rep.deleted == () and rep.kept_young == (orphan,)
    assert base.read(orphan).result(T).state == "value"
    time.sleep(0.3)
    rep = gc(kv, grace=0.2, dry_run=False).result(T)
    assert rep.deleted == (orphan,) and rep.deleted_bytes == 26
    assert base.read(orphan).result(T).state == "missing"
    assert kv.read("a").result(T).value == b"x" * 1000


def test_without_object_ages_everything_unreferenced_is_young(tmp_path: Any) -> None:
    # the fault wrapper lists without sizes or times: gc must assume "young"
    inner = FileKvStore(path=str(tmp_path))
    base = FaultKvStore(inner)
    kv = VersionedKvStore(base)
    kv.write("a", b"y" * 500).result(T)
    orphan = "nodes/" + "cd" * 16
    inner.write(orphan, b"junk").result(T)
    time.sleep(0.05)
    assert gc(kv, grace=0.01).result(T).kept_young == (orphan,)
    rep = gc(kv, grace=0, dry_run=False).result(T)
    assert rep.deleted == (orphan,) and rep.unknown_size == 1
    assert verify(kv).result(T) == []


def test_names_gc_does_not_own_are_never_touched(tmp_path: Any) -> None:
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    foreign = ["nodes/not-a-node", "data/README", "other/file", "txns/x/notes"]
    for n in foreign:
        base.write(n, b"keep me").result(T)
    rep = gc(kv, grace=0, dry_run=False, reclaim_deleted=True).result(T)
    assert rep.deleted == ()
    for n in foreign + ["latest", "commits/00000000000000000001"]:
        assert base.read(n).result(T).state == "value", n


def _step(kv: VersionedKvStore, step: int, size: int) -> None:
    with tsp.Transaction(metadata={"step": step}) as txn:
        t = kv.with_transaction(txn)
        t.write("params/big", os.urandom(size)).result(T)
        for j in range(20):
            t.write(f"params/small{j}", os.urandom(3000)).result(T)
        t.write("step", b"%d" % step).result(T)


def _stored_bytes(base: KvStore) -> int:
    return sum(i.size or 0 for i in base.list_info().result(T) if not i.key.startswith("commits/"))


@pytest.fixture(params=BASES)
def base(request: pytest.FixtureRequest, tmp_path: Any) -> KvStore:
    return open_base(request, tmp_path)


def test_three_saves_keep_two_leaves_the_bytes_of_two(base: KvStore) -> None:
    kv = VersionedKvStore(base)
    size = 400_000
    _step(kv, 1, size)
    one = _stored_bytes(base)
    _step(kv, 2, size)
    _step(kv, 3, size)
    assert _stored_bytes(base) > 2.9 * one
    kv.delete_versions([1]).result(T)
    rep = reclaim(kv).result(T)
    assert rep.reclaimed and set(rep.reclaimed) == set(rep.deleted)
    assert rep.deleted_bytes > size
    assert 1.9 * one < _stored_bytes(base) < 2.1 * one
    with pytest.raises(NotFoundError, match="deleted"):
        tsp.KvStore.open({"driver": "versioned", "base": base.spec(), "version": 1}).result(T)
    for v in (2, 3):
        assert kv.snapshot(v).read("step").result(T).value == b"%d" % v
    assert verify(kv).result(T) == []
    # idempotent: nothing left to reclaim
    assert reclaim(kv).result(T).deleted == ()


def test_tags_pin_versions_and_shared_objects_survive(tmp_path: Any) -> None:
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    kv.write("shared", os.urandom(300_000)).result(T)  # v1, kept by every later version
    for v in range(2, 6):
        kv.write("x", b"%d" % v * 200).result(T)
    kv.tag("best", 3).result(T)
    with pytest.raises(InvalidArgumentError, match="tagged"):
        kv.delete_versions([3]).result(T)
    kv.delete_versions([1, 2, 4]).result(T)
    rep = reclaim(kv).result(T)
    # v2 and v4 each had their own 'x' value and leaf; v1's tree is gone, its data is shared
    assert rep.by_kind.get("data", 0) == 2 and rep.by_kind.get("nodes", 0) >= 2
    best = tsp.KvStore.open({"driver": "versioned", "base": base.spec(), "tag": "best"}).result(T)
    assert best.read("x").result(T).value == b"3" * 200
    assert len(bytes(kv.read("shared").result(T).value)) == 300_000
    assert verify(kv).result(T) == []


def test_prompt_reclaim_never_robs_a_writer_in_flight(tmp_path: Any) -> None:
    """A transaction stages its data (large values land at once), versions are
    then committed, deleted and reclaimed under it; its commit still succeeds
    (rebased) and reads back whole."""
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    kv.write("a", os.urandom(300_000)).result(T)           # v1
    txn = tsp.Transaction()
    t = kv.with_transaction(txn)
    big = os.urandom(300_000)
    t.write("mine/big", big).result(T)                     # pinned to v1, data already written
    t.write("mine/small", b"s" * 1000).result(T)
    kv.write("a", os.urandom(300_000)).result(T)           # v2
    kv.write("b", os.urandom(5000)).result(T)              # v3
    kv.delete_versions([1, 2]).result(T)                   # v4: the txn's base is deleted
    rep = reclaim(kv, grace=3600).result(T)
    assert rep.reclaimed
    info = txn.commit().result(T)
    assert info.version == 5
    assert bytes(kv.read("mine/big").result(T).value) == big
    assert kv.read("mine/small").result(T).value == b"s" * 1000
    assert verify(kv).result(T) == []
    assert reclaim(kv, grace=3600).result(T).deleted == ()


def test_gc_refuses_to_collect_when_a_retained_version_is_damaged(tmp_path: Any) -> None:
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    for i in range(3):
        kv.write(f"k{i}", os.urandom(2000)).result(T)
    orphan = "data/" + "ef" * 16
    base.write(orphan, b"o").result(T)
    from tensorstore_py.kvstore.versioned.format import CommitRecord, commit_name

    rec = CommitRecord.decode(bytes(base.read(commit_name(3)).result(T).value), commit_name(3))
    assert rec.root is not None
    base.delete(rec.root).result(T)
    with pytest.raises(DataCorruptionError, match="missing"):
        gc(kv, grace=0, dry_run=False).result(T)
    assert base.read(orphan).result(T).state == "value"  # nothing was deleted
    problems = verify(kv).result(T)
    assert [p.object for p in problems] == [rec.root] and problems[0].kind == "missing"


def test_finished_multi_writer_transactions_are_cleaned_after_grace() -> None:
    base = MemoryKvStore()
    kv = VersionedKvStore(base)
    import threading

    def run(i: int) -> None:
        txn = tsp.Transaction(txn_id="step-1", process_index=i, process_count=2, timeout=30)
        kv.with_transaction(txn).write(f"p{i}", os.urandom(1000)).result(T)
        txn.commit().result(T)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for th in ts:
        th.start()
    for th in ts:
        th.join(T)
    assert set(base.list("txns/").result(T)) == {"txns/step-1/result"}  # fragments went at once
    assert gc(kv).result(T).deleted == ()
    # the result stays while version 1, which it names, is retained
    assert gc(kv, grace=0, dry_run=False).result(T).deleted == ()
    assert set(base.list("txns/").result(T)) == {"txns/step-1/result"}
    kv.write("later", b"x").result(T)
    kv.delete_versions([1]).result(T)
    rep = gc(kv, grace=0, dry_run=False).result(T)
    assert "txns/step-1/result" in rep.deleted
    assert base.list("txns/").result(T) == []
    assert len(bytes(kv.read("p1").result(T).value)) == 1000  # its data is committed: kept
    assert verify(kv).result(T) == []


def test_bad_arguments() -> None:
    kv = VersionedKvStore(MemoryKvStore())
    with pytest.raises(InvalidArgumentError, match="grace"):
        gc(kv, grace=-1)
    rep = gc(kv).result(T)
    assert rep.newest == 0 and rep.deleted == ()
    kv.write("a", b"1").result(T)
    rep = kv.gc().result(T)  # the store's method delegates to gc()
    assert rep.dry_run and rep.newest == 1 and rep.kept_reachable == 1  # the leaf


def test_list_info_reports_sizes_and_modification_times(base: KvStore) -> None:
    """The hook gc ages objects by (memory, file and gcs implement it)."""
    t0 = time.time() - 2  # GCS and file times may be coarser than ours
    base.write("a/x", b"12345").result(T)
    base.write("a/y", b"").result(T)
    base.write("b", b"zz").result(T)
    infos = base.list_info("a/").result(T)
    t1 = time.time() + 2
    assert [(i.key, i.size) for i in infos] == [("a/x", 5), ("a/y", 0)]
    assert all(i.mtime is not None and t0 <= i.mtime <= t1 for i in infos), infos
    sub = base.with_path("a")
    assert [i.key for i in sub.list_info().result(T)] == ["x", "y"]


# -- leases and the store's clock (issue 10, item 2) ----------------------------------------
class SkewedClock(FaultKvStore):
    """A store whose clock runs ``skew`` seconds behind this host's: every
    modification time it reports is that much earlier than this host's time."""

    def __init__(self, base: KvStore, skew: float) -> None:
        super().__init__(base, seed=int(skew))
        self.skew = skew

    async def _list_info(self, prefix: str) -> list[KeyInfo]:
        return [KeyInfo(i.key, i.size, None if i.mtime is None else i.mtime - self.skew)
                for i in await self.base.list_info(prefix)]


def _age(path: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


@pytest.mark.usefixtures("no_writer_linger")  # waits for the released writer's lease to go
def test_an_open_transaction_survives_gc_with_grace_zero(tmp_path: Any) -> None:
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    txn = tsp.Transaction()
    big = os.urandom(300_000)
    kv.with_transaction(txn).write("big", big).result(T)   # written to data/ now
    mine = {n for n in base.list("data/").result(T)}
    assert len(mine) == 1
    old = "data/" + "ab" * 16  # an orphan from long before the transaction started
    base.write(old, b"old").result(T)
    _age(os.path.join(str(tmp_path), old), 7200)
    time.sleep(0.05)  # the transaction's data is older than the grace of 0 s
    rep = gc(kv, grace=0, dry_run=False).result(T)
    assert rep.deleted == (old,)
    assert all(base.read(n).result(T).state == "value" for n in mine)
    assert txn.commit().result(T).version == 2
    assert bytes(kv.read("big").result(T).value) == big
    assert verify(kv).result(T) == []
    assert set(rep.kept_leased) == mine and rep.leases == 0  # our own lease counts in memory
    # the lease goes once nothing needs it any more
    deadline = time.time() + 10
    while base.list("leases/").result(T) and time.time() < deadline:
        time.sleep(0.05)
    assert base.list("leases/").result(T) == []


def test_ages_come_from_the_store_clock_not_the_host_clock(tmp_path: Any) -> None:
    inner = FileKvStore(path=str(tmp_path))
    base = SkewedClock(inner, skew=3 * 3600)  # the store's clock: 3 h behind this host's
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    txn = tsp.Transaction()
    big = os.urandom(300_000)
    kv.with_transaction(txn).write("big", big).result(T)  # a writer in flight
    fresh = "nodes/" + "cd" * 16  # just written by another writer in flight
    inner.write(fresh, b"node of a commit in flight").result(T)
    old = "data/" + "ef" * 16
    inner.write(old, b"old").result(T)
    _age(os.path.join(str(tmp_path), old), 5 * 3600)  # really 5 h old
    rep = gc(kv, grace=3600, dry_run=False).result(T)
    assert rep.deleted == (old,), rep.deleted  # host time would call everything 3 h old
    assert base.read(fresh).result(T).state == "value"
    assert txn.commit().result(T).version == 2
    assert bytes(kv.read("big").result(T).value) == big
    assert fresh in rep.kept_young and rep.clock == "store"


def test_a_commit_whose_data_vanished_is_refused_whatever_its_age(tmp_path: Any) -> None:
    """Seconds-old data objects are checked too: a collector with a short grace
    may take them."""
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    before = set(base.list("commits/").result(T))
    with pytest.raises(DataCorruptionError, match="nothing was committed"):
        with tsp.Transaction() as txn:
            t = kv.with_transaction(txn)
            t.write("big", os.urandom(300_000)).result(T)
            t.write("small", b"s" * 1000).result(T)
            (victim,) = base.list("data/").result(T)
            base.delete(victim).result(T)  # a collector that missed the lease
    assert set(base.list("commits/").result(T)) == before  # nothing visible
    assert kv.read("big").result(T).state == "missing"
    assert verify(kv).result(T) == []


def test_a_multi_writer_commit_whose_participants_data_vanished_is_refused(tmp_path: Any) -> None:
    """Process 0 checks the other participants' data objects too, however short
    the transaction: a participant that delivered its fragment no longer
    protects them (its lease is gone)."""
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    txns = [tsp.Transaction(txn_id="gone", process_index=i, process_count=3, timeout=30) for i in range(3)]
    kv.with_transaction(txns[0]).write("p0", b"0").result(T)
    fut0 = txns[0].commit()  # process 0 first: fragments belong to its attempt
    big = os.urandom(300_000)
    kv.with_transaction(txns[1]).write("p1", big).result(T)
    assert txns[1].commit(wait=False).result(T).version is None  # delivered; participant 2 holds the merge
    (victim,) = base.list("data/").result(T)
    base.delete(victim).result(T)  # a collector that no lease stopped
    kv.with_transaction(txns[2]).write("p2", b"2").result(T)
    fut2 = txns[2].commit()
    with pytest.raises(DataCorruptionError, match="of other participants.*nothing was committed"):
        fut0.result(T)
    with pytest.raises(tsp.TensorStoreError):
        fut2.result(T)
    assert kv.newest_version().result(T) == 1  # nothing visible
    assert kv.read("p1").result(T).state == "missing" and kv.read("p0").result(T).state == "missing"


def test_expired_leases_are_deleted_and_protect_nothing(tmp_path: Any) -> None:
    from tensorstore_py.kvstore.versioned.format import frame
    from tensorstore_py.kvstore.versioned.leases import MAGIC_LEASE, TTL

    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    stale = "leases/" + "12" * 16  # a writer elsewhere that died long ago
    base.write(stale, frame(MAGIC_LEASE, {"format": 2, "host": "elsewhere", "pid": 1, "ttl": TTL,
                                          "versions": [1], "writing": True, "writing_for": 9.0})).result(T)
    _age(os.path.join(str(tmp_path), stale), TTL + 60)
    orphan = "data/" + "34" * 16
    base.write(orphan, b"o").result(T)
    _age(os.path.join(str(tmp_path), orphan), 10)
    dry = gc(kv, grace=5).result(T)
    assert dry.deleted == (orphan,) and dry.expired_leases == (stale,) and dry.leases == 0
    assert base.read(stale).result(T).state == "value"  # a dry run deletes nothing
    gc(kv, grace=5, dry_run=False).result(T)
    assert base.read(stale).result(T).state == "missing"
    # a live lease of another process protects its writes (here: everything unreferenced)
    live = "leases/" + "56" * 16
    base.write(live, frame(MAGIC_LEASE, {"format": 2, "host": "elsewhere", "pid": 1, "ttl": TTL,
                                         "versions": [], "writing": True, "writing_for": 1e9})).result(T)
    base.write(orphan, b"o").result(T)
    _age(os.path.join(str(tmp_path), orphan), 10)
    rep = gc(kv, grace=5, dry_run=False).result(T)
    assert rep.deleted == () and rep.kept_leased == (orphan,) and rep.leases == 1


# -- readers of deleted versions (item 6) and the cost of a reclaim (item 9) ---------------------
def test_a_snapshot_lease_keeps_its_deleted_version_readable(tmp_path: Any) -> None:
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    for i in range(3):
        kv.write("k", b"%d" % i * 1000).result(T)  # packed: a data object per version
    snap = kv.snapshot(2)
    assert snap.read("k").result(T).value == b"1" * 1000  # first use: checked and leased
    kv.delete_versions([1, 2]).result(T)
    rep = reclaim(kv).result(T)
    assert snap.read("k").result(T).value == b"1" * 1000
    assert rep.deferred_versions == (2,) and rep.by_kind == {"data": 1, "nodes": 1}  # version 1's
    leases = base.list("leases/").result(T)
    assert len(leases) == 1  # what other processes' collectors see
    snap.close()
    rep = reclaim(kv).result(T)
    assert rep.deferred_versions == () and rep.by_kind == {"data": 1, "nodes": 1}  # version 2's
    with pytest.raises(SnapshotExpiredError, match="version 2 was deleted"):
        snap.read("k").result(T)
    assert kv.read("k").result(T).value == b"2" * 1000
    assert verify(kv).result(T) == []
    with pytest.raises(NotFoundError, match="deleted"):
        kv.open_snapshot(2).result(T)


def test_a_transaction_reading_a_reclaimed_base_gets_snapshot_expired(tmp_path: Any) -> None:
    from tensorstore_py.kvstore.versioned.tree import NodeCache

    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    kv.write("k", b"x" * 1000).result(T)
    kv.write("j", b"y" * 1000).result(T)
    txn = tsp.Transaction()
    t = kv.with_transaction(txn)
    assert t.read("k").result(T).value == b"x" * 1000  # pins version 2
    kv.write("k", b"z" * 1000).result(T)
    kv.delete_versions([2]).result(T)
    assert reclaim(kv).result(T).by_kind == {"nodes": 1}  # version 2's own index leaf
    kv._root.cache = NodeCache()  # evicted (or another process): the leaf must be read
    with pytest.raises(SnapshotExpiredError, match="version 2 was deleted"):
        t.read("j").result(T)
    txn.abort()


class _Reads(FaultKvStore):
    """Records the key of every read."""

    def __init__(self, base: KvStore) -> None:
        super().__init__(base, seed=7)
        self.keys: list[str] = []

    async def _read(self, key: str, byte_range: Any, if_not_equal: Any) -> Any:
        self.keys.append(key)
        return await super()._read(key, byte_range, if_not_equal)


def test_a_reclaim_reads_what_changed_not_the_history(tmp_path: Any) -> None:
    from tensorstore_py.kvstore.versioned.root import _roots

    base = _Reads(FileKvStore(path=str(tmp_path)))
    kv = VersionedKvStore(base)
    for i in range(40):
        kv.write(f"k{i % 3}", os.urandom(2000)).result(T)
        if i >= 2:
            kv.delete_versions([kv.newest_version().result(T) - 2]).result(T)
            reclaim(kv).result(T)
    n = kv.newest_version().result(T)
    kv.write("k0", os.urandom(2000)).result(T)
    kv.delete_versions([n - 1, n]).result(T)
    _roots.clear()  # a cold cache: every object counts
    kv = VersionedKvStore(base)
    base.keys.clear()
    rep = reclaim(kv).result(T)
    assert rep.reclaimed
    records = {int(k.split("/")[1]) for k in base.keys if k.startswith("commits/")}
    # finding the newest version (probing: O(log n) records) and the run: the two
    # newly deleted versions and their neighbours; nothing else of the history
    assert {n - 2, n - 1, n, n + 1} <= records
    assert len(records - set(range(n - 2, n + 4))) <= 2 * math.log2(n + 1) + 2, sorted(records)
    assert len(base.keys) < 30 + 2 * math.log2(n + 1), base.keys
    base.keys.clear()
    again = reclaim(kv).result(T)
    assert again.deleted == () and not any(k.startswith(("nodes/", "data/")) for k in base.keys)
    assert verify(kv).result(T) == []


def test_format_1_stores_without_a_watermark_are_reclaimed_once(tmp_path: Any) -> None:
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    for i in range(6):
        kv.write("k", b"%d" % i * 500).result(T)
    kv.delete_versions([1, 2, 3]).result(T)
    first = reclaim(kv).result(T)
    assert first.by_kind == {"data": 3, "nodes": 3}
    base.delete("gc/reclaimed").result(T)  # as a store collected by format-1 code
    kv.delete_versions([4]).result(T)
    again = reclaim(kv).result(T)
    assert again.by_kind == {"data": 1, "nodes": 1}  # the old versions' objects are gone already
    assert [v.version for v in kv.versions().result(T)] == [5, 6, 7, 8]
    assert kv.read("k").result(T).value == b"5" * 500
    assert verify(kv).result(T) == []


class _WithTemporaries(MemoryKvStore):
    """Stands in for the file store's side of issue 10 item 13: a base store
    that keeps temporaries of crashed writers beside its keys and sweeps them
    with ``sweep_temporaries(older_than, *, dry_run) -> Future[list[str]]``."""

    def __init__(self) -> None:
        super().__init__()
        self.temporaries: dict[str, float] = {}  # name -> change time
        self.calls: list[tuple[float, bool]] = []

    def sweep_temporaries(self, older_than: float, *, dry_run: bool = True) -> Any:
        from tensorstore_py.core.future import ready

        self.calls.append((older_than, dry_run))
        now = time.time()
        found = sorted(n for n, t in self.temporaries.items() if now - t >= older_than)
        if not dry_run:
            for n in found:
                del self.temporaries[n]
        return ready(found)


def test_gc_sweeps_the_base_stores_temporaries_older_than_grace_and_every_writer() -> None:
    base = _WithTemporaries()
    kv = VersionedKvStore(base)
    kv.write("a", b"1").result(T)
    base.temporaries = {"data/.__tsp__/x.1.tmp": time.time() - 30, "nodes/.__tsp__/y.2.tmp": time.time()}
    dry = gc(kv, grace=10).result(T)
    assert dry.temporaries == ("data/.__tsp__/x.1.tmp",) and base.calls == [(10.0, True)]
    assert len(base.temporaries) == 2
    txn = tsp.Transaction()  # a writer in flight: its temporaries are younger than it is
    kv.with_transaction(txn).write("big", os.urandom(300_000)).result(T)
    held = gc(kv, grace=10, dry_run=False).result(T)
    assert held.temporaries == () and base.calls[-1][0] >= 60  # older than the writer's start
    txn.commit().result(T)  # releases the writer
    done = gc(kv, grace=10, dry_run=False).result(T)
    assert done.temporaries == ("data/.__tsp__/x.1.tmp",) and base.calls[-1] == (10.0, False)
    assert list(base.temporaries) == ["nodes/.__tsp__/y.2.tmp"]
    assert gc(VersionedKvStore(MemoryKvStore())).result(T).temporaries == ()  # stores without it


def test_a_process_that_exits_leaves_no_lease_behind(tmp_path: Path) -> None:
    """Leases are released at interpreter exit while the I/O pools still run
    (they stop at threading shutdown, before atexit handlers)."""
    code = (
        "import sys, numpy as np, tensorstore_py as tsp\n"
        "root = sys.argv[1]\n"
        "tsp.checkpoint.save(f'file://{root}/', {'w': np.arange(10.)}, step=1).result()\n"
        "a = tsp.checkpoint.open_array(f'file://{root}/', \"['w']\", step=1).result()\n"
        "assert list(a[0:3].read().result()) == [0.0, 1.0, 2.0]\n"  # a reader lease is held here
    )
    root = tmp_path / "ckpt"
    p = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "cannot schedule new futures" not in p.stderr, p.stderr
    assert not [f for f in (root / "leases").glob("*") if f.is_file()]
