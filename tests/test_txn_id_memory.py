"""A transaction id is an idempotency key for as long as the version it committed
is retained: garbage collection (full or prompt) keeps what answers "did this id
commit?" (``txns/<id>/result``, or the attempt records while no result was
written), and a commit whose result write failed leaves its attempts in place.
Once retention deleted that version, a full collection forgets the id."""

from __future__ import annotations

import threading
from typing import Any

import tensorstore_py as tsp
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.gc import gc, reclaim
from tensorstore_py.kvstore.versioned.staging import StagedChanges, commit_staged, stage

T = 60


def _multi_writer(kv: VersionedKvStore, txn_id: str, writes: list[dict[str, bytes]]) -> list[int | None]:
    """Every process of a multi-writer transaction (one thread each); their versions."""
    got: list[int | None] = [None] * len(writes)

    def run(i: int) -> None:
        txn = tsp.Transaction(txn_id=txn_id, process_index=i, process_count=len(writes), timeout=30)
        v = kv.with_transaction(txn)
        for k, value in writes[i].items():
            v.write(k, value).result(T)
        got[i] = txn.commit().result(T).version

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(writes))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(T)
    return got


def _part(kv: VersionedKvStore, writes: dict[str, bytes]) -> StagedChanges:
    txn = tsp.Transaction()
    v = kv.with_transaction(txn)
    for k, value in writes.items():
        v.write(k, value).result(T)
    return stage(txn, kv).result(T)


def _txn_versions(kv: VersionedKvStore, txn_id: str) -> list[int]:
    newest = kv.newest_version().result(T)
    return [v for v in range(1, newest + 1) if kv.commit_details(v).result(T).txn_id == txn_id]


def test_multi_writer_rerun_after_a_full_gc_without_grace_commits_once() -> None:
    kv = VersionedKvStore(MemoryKvStore())
    writes = [{"p0": b"a" * 100}, {"p1": b"b" * 5000}]
    assert _multi_writer(kv, "step-1", writes) == [1, 1]
    kv.write("p0", b"other").result(T)  # another writer, after it
    gc(kv, grace=0, dry_run=False).result(T)
    assert kv.base.read("txns/step-1/result").result(T).state == "value"
    # the job runs again with the same id and the same writes: the same commit
    assert _multi_writer(kv, "step-1", writes) == [1, 1]
    assert kv.newest_version().result(T) == 2 and _txn_versions(kv, "step-1") == [1]
    assert kv.read("p0").result(T).value == b"other"  # not reverted by a second commit


def test_staged_rerun_after_prompt_reclaim_commits_once() -> None:
    kv = VersionedKvStore(MemoryKvStore())
    first = commit_staged(kv, [_part(kv, {"c/0": b"1" * 10}), _part(kv, {"c/1": b"1" * 3000})],
                          txn_id="ingest-1").result(T)
    kv.write("c/0", b"other").result(T)
    # what checkpoint retention runs after every save (with a full sweep, too)
    reclaim(kv, grace=0, sweep_interval=0).result(T)
    assert kv.base.read("txns/ingest-1/result").result(T).state == "value"
    # parts recomputed from the newer version (a re-run after KilledWorker)
    again = commit_staged(kv, [_part(kv, {"c/0": b"1" * 10}), _part(kv, {"c/1": b"1" * 3000})],
                          txn_id="ingest-1").result(T)
    assert (again.version, again.write_id) == (first.version, first.write_id)
    assert _txn_versions(kv, "ingest-1") == [first.version]
    assert kv.read("c/0").result(T).value == b"other"


def _commit_losing_the_result(mem: MemoryKvStore, txn_id: str) -> int | None:
    """A staged commit whose ``result`` write fails (the commit record landed)."""
    lossy = FaultKvStore(mem)
    lossy.inject(op="write", key_pattern="txns/*/result")
    kv = VersionedKvStore(lossy)
    return commit_staged(kv, [_part(kv, {"k": b"v" * 2000})], txn_id=txn_id).result(T).version


def test_a_lost_result_write_leaves_the_attempts_that_find_the_commit() -> None:
    mem = MemoryKvStore()
    assert _commit_losing_the_result(mem, "ingest-2") == 1
    assert mem.list("txns/").result(T) == ["txns/ingest-2/attempts/000001"]
    kv = VersionedKvStore(mem)
    kv.write("k", b"other").result(T)
    again = commit_staged(kv, [_part(kv, {"k": b"v" * 2000})], txn_id="ingest-2").result(T)
    assert again.version == 1 and _txn_versions(kv, "ingest-2") == [1]
    assert kv.read("k").result(T).value == b"other"
    assert mem.list("txns/").result(T) == ["txns/ingest-2/result"]  # repaired, then cleaned


def test_gc_keeps_the_attempts_of_a_retained_commit_without_result() -> None:
    mem = MemoryKvStore()
    assert _commit_losing_the_result(mem, "ingest-3") == 1
    kv = VersionedKvStore(mem)
    kv.write("k", b"other").result(T)
    rep = gc(kv, grace=0, dry_run=False).result(T)
    assert not [n for n in rep.deleted if n.startswith("txns/")]
    assert mem.list("txns/").result(T) == ["txns/ingest-3/attempts/000001"]
    again = commit_staged(kv, [_part(kv, {"k": b"v" * 2000})], txn_id="ingest-3").result(T)
    assert again.version == 1 and _txn_versions(kv, "ingest-3") == [1]
    assert kv.read("k").result(T).value == b"other"


def test_the_id_is_forgotten_once_its_version_is_deleted_and_collected() -> None:
    """The end of the window, as docs/FORMAT.md §9 states it."""
    kv = VersionedKvStore(MemoryKvStore())
    commit_staged(kv, [_part(kv, {"k": b"1"})], txn_id="ingest-4").result(T)
    kv.write("k", b"2").result(T)
    kv.delete_versions([1]).result(T)
    rep: Any = gc(kv, grace=0, dry_run=False).result(T)
    assert "txns/ingest-4/result" in rep.deleted
    again = commit_staged(kv, [_part(kv, {"k": b"1"})], txn_id="ingest-4").result(T)
    assert again.version == 4 and _txn_versions(kv, "ingest-4") == [1, 4]  # 3: the deletion
