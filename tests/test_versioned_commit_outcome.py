"""A commit whose record write can not be confirmed: CommitOutcomeUnknownError, find_write_id.

Faults come from the ``fault`` wrapper store: every write of ``commits/`` fails
before it reaches the store, or lands and loses its answer (with the read-backs
of the record failing too, so nothing tells).
"""

from __future__ import annotations

from typing import Any

import pytest
from _multiwriter import in_threads, staged

import tensorstore_py as tsp
from tensorstore_py.core.retry import RetryPolicy
from tensorstore_py.errors import (
    CommitOutcomeUnknownError,
    ConditionFailedError,
    InvalidArgumentError,
    StorageError,
)
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned import root as root_module
from tensorstore_py.kvstore.versioned.format import commit_name

T = 60


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    # the same loop as in production, with millisecond waits
    monkeypatch.setattr(root_module, "PUBLISH_RETRY", RetryPolicy(max_attempts=4, initial_delay=0.002))


def _one_version_over_faults() -> tuple[MemoryKvStore, FaultKvStore, VersionedKvStore]:
    """A versioned store over a fault-injecting wrapper of a memory store, with
    one version (``a`` = ``1``): the memory store, the wrapper, the store."""
    mem = MemoryKvStore()
    fault = FaultKvStore(mem)
    kv = VersionedKvStore(fault)
    kv.write("a", b"1").result(T)
    return mem, fault, kv


def _unknown(fut: Any) -> CommitOutcomeUnknownError:
    with pytest.raises(StorageError) as info:
        fut.result(T)
    err = info.value
    # exactly the distinct error: never a plain StorageError, never a ConditionFailedError
    assert type(err) is CommitOutcomeUnknownError, repr(err)
    assert not isinstance(err, ConditionFailedError)
    return err


def test_commit_record_write_that_never_lands() -> None:
    mem, fault, kv = _one_version_over_faults()
    fault.inject(op="write", key_pattern="commits/*")  # every one fails before reaching the store
    txn = tsp.Transaction()
    kv.with_transaction(txn).write("a", b"2").result(T)
    err = _unknown(txn.commit())
    assert err.write_id == txn.write_id and err.key == commit_name(2)
    assert "find_write_id" in str(err)
    # outside transactions (group commit) too
    err2 = _unknown(kv.write("b", b"1"))
    assert err2.write_id and err2.write_id != txn.write_id
    fault.clear()
    assert kv.find_write_id(err.write_id).result(T) is None  # it did not commit
    assert kv.find_write_id(err2.write_id).result(T) is None
    assert kv.read("a").result(T).value == b"1" and kv.newest_version().result(T) == 1
    kv.write("a", b"3").result(T)  # and the store works on
    assert kv.newest_version().result(T) == 2


def test_commit_record_that_landed_but_can_not_be_confirmed() -> None:
    mem, fault, kv = _one_version_over_faults()
    txn = tsp.Transaction()
    kv.with_transaction(txn).write("a", b"2").result(T)
    # the record lands but every answer is lost; every read of it fails as well
    # (the commit's probe reads its parent, commits/1, not the version above it)
    fault.inject(op="write", key_pattern="commits/*", after_effect=True)
    fault.inject(op="read", key_pattern=commit_name(2), times=10**6)
    err = _unknown(txn.commit())
    assert err.write_id == txn.write_id
    # one write landed (the retries found it there), no read-back could tell whose it is
    assert fault.faults["write"] == 1 and fault.faults["read"] >= 4
    fault.clear()
    fresh = VersionedKvStore(mem)  # another process asks
    assert fresh.find_write_id(err.write_id).result(T) == 2
    assert fresh.find_write_id(err.write_id, since=1).result(T) == 2
    assert fresh.find_write_id(err.write_id, since=2).result(T) is None  # since bounds the scan
    assert fresh.read("a").result(T).value == b"2"


def test_find_write_id_of_a_recent_commit_reads_few_records() -> None:
    mem = MemoryKvStore()
    kv = VersionedKvStore(mem)
    infos = []
    for i in range(100):
        with tsp.Transaction() as txn:
            kv.with_transaction(txn).write("k", b"%d" % i).result(T)
        infos.append(txn.commit().result(T))
    counted = FaultKvStore(mem)
    fresh = VersionedKvStore(counted)
    assert fresh.find_write_id(infos[-2].write_id).result(T) == 99
    assert counted.calls["read"] < 40, counted.calls  # not all 100 records
    assert fresh.find_write_id(infos[0].write_id).result(T) == 1
    assert fresh.find_write_id("f" * 32).result(T) is None
    with pytest.raises(InvalidArgumentError):
        fresh.find_write_id("")
    with pytest.raises(InvalidArgumentError):
        fresh.find_write_id("ab", since=-1)


def test_multi_writer_participants_hear_the_unknown_outcome_and_a_rerun_commits_once() -> None:
    mem = MemoryKvStore()
    lossy = FaultKvStore(mem)
    lossy.inject(op="write", key_pattern="commits/*")
    stores = [VersionedKvStore(lossy), VersionedKvStore(mem)]  # process 0's store fails

    def run(stores: list[VersionedKvStore], value: bytes) -> list[Any]:
        return in_threads(2, lambda i: staged(stores[i], "step-9", i, 2, {f"p{i}": value},
                                              timeout=30).commit().result(T))

    res = run(stores, b"x")
    assert all(type(r) is CommitOutcomeUnknownError for r in res), res
    assert res[0].write_id and res[1].write_id == res[0].write_id  # the record's write-id
    kv = VersionedKvStore(mem)
    assert kv.find_write_id(res[0].write_id).result(T) is None
    # the job runs again with the same transaction id: it commits once
    res = run([VersionedKvStore(mem), VersionedKvStore(mem)], b"x")
    assert [r.version for r in res] == [1, 1], res
    assert kv.list().result(T) == ["p0", "p1"]


def test_find_write_id_answers_none_only_once_it_is_final() -> None:
    """A commit record can only land as the version it was attempted at, and a
    delayed request may still land it: "not found" is final only once that
    version exists. Asked with the error, find_write_id raises the unknown
    outcome again until then, and answers None (final) after."""
    mem, fault, kv = _one_version_over_faults()
    fault.inject(op="write", key_pattern="commits/*")
    txn = tsp.Transaction()
    kv.with_transaction(txn).write("a", b"2").result(T)
    err = _unknown(txn.commit())
    assert err.version == 2 and err.write_id == txn.write_id
    fault.clear()
    again = _unknown(kv.find_write_id(err))
    assert again.write_id == err.write_id and again.version == 2 and "version 2" in str(again)
    _unknown(kv.find_write_id(err.write_id, version=2))
    # without the attempted version only "not among the versions so far" can be said
    assert kv.find_write_id(err.write_id).result(T) is None
    other = VersionedKvStore(mem)
    other._root = type(other._root)(mem)  # another process
    other.write("b", b"x").result(T)  # version 2 exists now: it is not ours
    assert kv.find_write_id(err).result(T) is None
    assert kv.find_write_id(err, since=1).result(T) is None
    with pytest.raises(InvalidArgumentError):
        kv.find_write_id(err.write_id, version=0)


def test_a_commit_cancelled_after_its_record_was_sent_has_an_unknown_outcome() -> None:
    """Cancelling the commit Future while the commit record write is in flight:
    the record may still land, so the transaction is not "failed" (nor the
    Future merely cancelled) but its outcome is unknown:
    CommitOutcomeUnknownError with the write-id and the version it can land as."""
    import time

    mem, fault, kv = _one_version_over_faults()
    fault.inject(op="write", key_pattern="commits/*", error=None, latency=2.0)  # a slow record write
    txn = tsp.Transaction()
    kv.with_transaction(txn).write("a", b"2").result(T)
    fut = txn.commit()
    deadline = time.monotonic() + 10
    while not fault.faults["write"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fut.cancel()
    err = _unknown(fut)
    assert err.write_id == txn.write_id and txn.state == "unknown"
    fault.clear()
    # here the cancellation stopped the write before the store: it did not land,
    # which is final only once version 2 exists
    _unknown(kv.find_write_id(err.write_id, version=2))
    kv.write("b", b"x").result(T)
    assert kv.find_write_id(err.write_id, version=2).result(T) is None
    assert kv.read("a").result(T).value == b"1"


def test_a_commit_cancelled_before_its_record_was_sent_failed() -> None:
    """Cancelled while its data is written, before anything can make it
    visible: a plain cancellation, the transaction failed, nothing committed."""
    import concurrent.futures
    import time

    mem, fault, kv = _one_version_over_faults()
    fault.inject(op="write", key_pattern="nodes/*", error=None, latency=2.0)
    txn = tsp.Transaction()
    kv.with_transaction(txn).write("a", b"2").result(T)
    fut = txn.commit()
    deadline = time.monotonic() + 10
    while not fault.faults["write"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fut.cancel()
    with pytest.raises(concurrent.futures.CancelledError):
        fut.result(T)
    assert txn.state == "failed"
    time.sleep(2.2)
    assert kv.newest_version().result(T) == 1 and kv.read("a").result(T).value == b"1"


def _until_faulted(fault: FaultKvStore) -> None:
    import time

    deadline = time.monotonic() + 10
    while not fault.faults["write"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fault.faults["write"]


def test_a_write_cancelled_before_its_commit_record_was_sent_is_not_committed() -> None:
    """A write outside a transaction, cancelled while its batch writes its tree
    nodes: a plain cancellation, and nothing of it is visible; the write queued
    beside it in the same batch commits."""
    import concurrent.futures
    import time

    mem, fault, kv = _one_version_over_faults()
    fault.inject(op="write", key_pattern="nodes/*", error=None, latency=1.0, times=1)
    mine, other = kv.write("mine", b"cancelled"), kv.write("other", b"kept")
    _until_faulted(fault)
    assert mine.cancel()
    with pytest.raises(concurrent.futures.CancelledError):
        mine.result(T)
    assert isinstance(other.result(T), tsp.Generation)
    time.sleep(0.5)  # anything still in flight has landed
    reader = VersionedKvStore(mem)
    assert reader.newest_version().result(T) == 2
    assert reader.read("mine").result(T).state == "missing"
    assert reader.read("other").result(T).value == b"kept"


def test_a_write_cancelled_while_queued_behind_a_commit_is_not_committed() -> None:
    import concurrent.futures
    import time

    mem, fault, kv = _one_version_over_faults()
    fault.inject(op="write", key_pattern="commits/*", error=None, latency=1.0, times=1)
    first = kv.write("first", b"1")
    _until_faulted(fault)  # the first batch's record is in flight: the next write queues
    mine = kv.write("mine", b"cancelled")
    assert mine.cancel()
    with pytest.raises(concurrent.futures.CancelledError):
        mine.result(T)
    first.result(T)
    kv.write("later", b"x").result(T)
    reader = VersionedKvStore(mem)
    assert reader.newest_version().result(T) == 3
    assert reader.read("mine").result(T).state == "missing"
    time.sleep(0.2)
    assert reader.read("mine").result(T).state == "missing"


def test_a_write_cancelled_after_its_commit_record_was_sent_has_an_unknown_outcome() -> None:
    mem, fault, kv = _one_version_over_faults()
    fault.inject(op="write", key_pattern="commits/*", error=None, latency=1.0, times=1)
    mine = kv.write("mine", b"2")
    _until_faulted(fault)
    assert mine.cancel()
    err = _unknown(mine)
    assert err.version == 2 and err.key == commit_name(2)
    # the record was sent and lands: find_write_id says so
    import time

    time.sleep(1.2)
    assert kv.find_write_id(err).result(T) == 2
    assert VersionedKvStore(mem).read("mine").result(T).value == b"2"


@pytest.mark.parametrize("edit", ["tag", "delete_versions", "commit_staged"])
def test_a_tag_deletion_or_staged_commit_cancelled_after_its_record_was_sent_has_an_unknown_outcome(
        edit: str) -> None:
    """As for a transaction's commit: the Future raises CommitOutcomeUnknownError,
    never a plain cancellation, once the record may land."""
    import time

    from tensorstore_py.kvstore.versioned.staging import commit_staged, stage

    mem, fault, kv = _one_version_over_faults()
    kv.write("a", b"2").result(T)
    fault.inject(op="write", key_pattern="commits/*", error=None, latency=1.0, times=1)
    if edit == "commit_staged":
        txn = tsp.Transaction()
        kv.with_transaction(txn).write("s", b"staged").result(T)
        part = stage(txn, kv).result(T)
    fut = (kv.tag("t", 1) if edit == "tag" else kv.delete_versions([1]) if edit == "delete_versions"
           else commit_staged(kv, [part]))
    _until_faulted(fault)
    assert fut.cancel()
    err = _unknown(fut)
    assert err.version == 3 and err.key == commit_name(3)
    # here the cancellation stopped the record's write before the store: it did
    # not land, which is final only once version 3 exists
    time.sleep(1.2)
    _unknown(kv.find_write_id(err))
    kv.write("b", b"x").result(T)
    assert kv.find_write_id(err).result(T) is None
    assert VersionedKvStore(mem).commit_details(3).result(T).kind == "data"
