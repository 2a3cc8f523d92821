"""Garbage collection and retention of the versioned store (FORMAT.md §9)."""

from __future__ import annotations

import os
import time
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
from tensorstore_py.errors import DataCorruptionError, InvalidArgumentError, NotFoundError
from tensorstore_py.kvstore.base import KvStore
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
    # attempts and fragments are deleted once merged)
    finished = {n for n in before if n.startswith("txns/")}
    assert len(finished) == (0 if parts == 1 else 3)

    young = gc(kv).result(T)  # default grace: everything is young, nothing goes
    assert young.dry_run and young.deleted == ()
    # (data named by a live fragment count as referenced, not as young)
    assert {n for n in orphans if not n.startswith("data/")} <= set(young.kept_young)
    assert set(young.kept_young) <= orphans | finished
    dry = gc(kv, grace=0).result(T)
    assert set(dry.deleted) == orphans | finished and dry.reclaimed == ()
    assert dry.deleted_bytes == sum(os.path.getsize(os.path.join(root, n)) for n in orphans | finished)
    assert set(base.list().result(T)) >= orphans  # a dry run deletes nothing

    done = gc(kv, grace=0, dry_run=False).result(T)
    assert set(done.deleted) == orphans | finished and not done.dry_run
    after = _objects(base)
    assert _collectable(set(after)) == _collectable(set(before)) - finished
    for name, data in before.items():  # committed objects untouched, byte for byte
        if name != "latest" and name not in finished:
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
    rep = gc(kv, grace=0, dry_run=False).result(T)
    assert set(rep.deleted) == {"txns/step-1/result"}
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
