"""Isolation levels: snapshot (the default) lets write skew commit; serializable does not."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from _multiwriter import in_threads

import tensorstore_py as tsp
from tensorstore_py.errors import ConflictError, InvalidArgumentError, UnsupportedError
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore

T = 60


@pytest.fixture
def kv() -> VersionedKvStore:
    kv = VersionedKvStore(MemoryKvStore()).with_path("ward/")
    kv.write("alice", b"on").result(T)
    kv.write("bob", b"on").result(T)
    return kv  # type: ignore[return-value]


def _sign_off_both(kv: VersionedKvStore, isolation: Any) -> list[Any]:
    """The two doctors of docs/TRANSACTIONS.md: each checks the other is on call
    and signs off; both read before either commits."""
    t1, t2 = tsp.Transaction(isolation=isolation), tsp.Transaction(isolation=isolation)
    v1, v2 = kv.with_transaction(t1), kv.with_transaction(t2)
    assert v1.read("bob").result(T).value == b"on"
    assert v2.read("alice").result(T).value == b"on"
    v1.write("alice", b"off").result(T)
    v2.write("bob", b"off").result(T)
    out: list[Any] = []
    for t in (t1, t2):
        try:
            out.append(t.commit().result(T))
        except ConflictError as e:
            out.append(e)
    return out


def test_write_skew_commits_under_snapshot_isolation(kv: VersionedKvStore) -> None:
    res = _sign_off_both(kv, "snapshot")
    assert [r.version for r in res] == [3, 4]
    assert kv.read("alice").result(T).value == kv.read("bob").result(T).value == b"off"  # nobody on call


def test_write_skew_is_refused_under_serializable_isolation(kv: VersionedKvStore) -> None:
    first, second = _sign_off_both(kv, "serializable")
    assert first.version == 3
    assert isinstance(second, ConflictError) and second.key == "ward/alice"
    assert "'ward/alice'" in str(second) and "read" in str(second)
    assert kv.read("bob").result(T).value == b"on"  # someone stays on call
    # the retry sees alice already off and keeps bob on
    with tsp.Transaction(isolation="serializable") as txn:
        v = kv.with_transaction(txn)
        if v.read("alice").result(T).value == b"on":
            v.write("bob", b"off").result(T)
    assert kv.read("bob").result(T).value == b"on"


def test_serializable_reads_that_found_nothing_and_listed_prefixes(kv: VersionedKvStore) -> None:
    # a read of a missing key: another transaction creating it conflicts
    t = tsp.Transaction(isolation="serializable")
    v = kv.with_transaction(t)
    assert v.read("carol").result(T).state == "missing"
    v.write("alice", b"off").result(T)
    kv.write("carol", b"on").result(T)
    with pytest.raises(ConflictError, match="carol") as info:
        t.commit().result(T)
    assert info.value.key == "ward/carol"
    # a listed prefix: a key inserted under it conflicts (a phantom)
    t = tsp.Transaction(isolation="serializable")
    v = kv.with_transaction(t)
    assert v.list("d").result(T) == []
    v.write("alice", b"off").result(T)
    kv.write("dave", b"on").result(T)
    with pytest.raises(ConflictError, match="prefix 'ward/d'"):
        t.commit().result(T)
    # changes outside what was read rebase as under snapshot isolation
    t = tsp.Transaction(isolation="serializable")
    v = kv.with_transaction(t)
    assert v.read("bob").result(T).value == b"on"
    assert v.list("x").result(T) == []
    v.write("alice", b"off").result(T)
    kv.write("erin", b"on").result(T)
    kv.write("yann", b"on").result(T)
    assert t.commit().result(T).version == kv.newest_version().result(T)
    assert kv.read("alice").result(T).value == b"off"


def test_serializable_read_only_transaction_and_bad_level(kv: VersionedKvStore) -> None:
    with tsp.Transaction(isolation="serializable") as t:
        assert kv.with_transaction(t).read("alice").result(T).value == b"on"
        kv.write("alice", b"off").result(T)  # nothing written by t: nothing to check
    assert t.commit().result(T).version == 2
    with pytest.raises(InvalidArgumentError, match="isolation"):
        tsp.Transaction(isolation="linearizable")  # type: ignore[arg-type]


def test_plain_store_serializes_its_one_key_and_refuses_unchecked_reads(tmp_path: Any) -> None:
    plain = FileKvStore(path=str(tmp_path))
    plain.write("x", b"0").result(T)
    plain.write("y", b"0").result(T)
    # a read-modify-write of the one key is a compare-and-swap: serializable as is
    with tsp.Transaction(isolation="serializable") as t:
        v = plain.with_transaction(t)
        v.write("x", b"%d" % (int(v.read("x").result(T).value) + 1)).result(T)
    assert plain.read("x").result(T).value == b"1"
    # reading another key can not be checked atomically with the write
    t = tsp.Transaction(isolation="serializable")
    v = plain.with_transaction(t)
    assert v.read("y").result(T).value == b"0"
    v.write("x", b"2").result(T)
    with pytest.raises(UnsupportedError, match="'y'"):
        t.commit().result(T)
    assert plain.read("x").result(T).value == b"1"
    with tsp.Transaction() as t:  # under snapshot isolation it commits (documented)
        v = plain.with_transaction(t)
        assert v.read("y").result(T).value == b"0"
        v.write("x", b"2").result(T)
    assert plain.read("x").result(T).value == b"2"


def test_multi_writer_serializable_checks_every_participants_reads() -> None:
    kv = VersionedKvStore(MemoryKvStore())
    kv.write("config", b"v1").result(T)
    pinned = threading.Barrier(2)

    def run(i: int) -> Any:
        txn = tsp.Transaction(txn_id="s1", process_index=i, process_count=2, timeout=30,
                              isolation="serializable")
        v = kv.with_transaction(txn)
        if i == 1:  # participant 1 reads what process 0 never looks at
            assert v.read("config").result(T).value == b"v1"
        v.write(f"shard{i}", b"data").result(T)
        pinned.wait(30)
        if i == 0:
            kv.write("config", b"v2").result(T)  # after both read
        return txn.commit().result(T)

    out = in_threads(2, run)
    assert all(isinstance(r, ConflictError) for r in out), out
    assert "'config'" in str(out[0])
    assert kv.list().result(T) == ["config"]


# -- chunks are never committed over metadata another writer changed ---------------------------------
def _recreated(url: str) -> None:
    """Another writer replaces the array by one of another dtype and chunk shape."""
    tsp.open(url, create=True, delete_existing=True, shape=(8,), dtype="float64", chunks=(8,)).result(T)


def test_a_transaction_never_commits_chunks_over_changed_metadata(tmp_path: Any) -> None:
    # under snapshot isolation too: the chunks were encoded by the metadata the view read
    url = f"versioned+file://{tmp_path}/"
    ts = tsp.open(url, create=True, shape=(8,), dtype="int32", chunks=(4,)).result(T)
    txn = tsp.Transaction()
    ts.with_transaction(txn).write(np.arange(8, dtype="int32")).result(T)
    _recreated(url)
    with pytest.raises(ConflictError, match="'zarr.json'"):
        txn.commit().result(T)
    again = tsp.open(url).result(T)
    assert again.dtype == np.float64
    np.testing.assert_array_equal(again.read().result(T), np.zeros(8))  # no int32 chunk under it
    assert again.kvstore.list().result(T) == ["zarr.json"]


def test_multi_writer_chunks_are_never_committed_over_changed_metadata(tmp_path: Any) -> None:
    url = f"versioned+file://{tmp_path}/"
    tsp.open(url, create=True, shape=(8,), dtype="int32", chunks=(4,)).result(T)
    written = threading.Barrier(2)

    def run(i: int) -> Any:
        ts = tsp.open(url).result(T)
        txn = tsp.Transaction(txn_id="m1", process_index=i, process_count=2, timeout=30)
        ts.with_transaction(txn)[4 * i:4 * i + 4].write(np.full(4, i + 1, dtype="int32")).result(T)
        written.wait(30)
        if i == 0:
            _recreated(url)  # after both wrote their chunks
        try:
            return txn.commit().result(T)
        except ConflictError as e:
            return e

    out = in_threads(2, run)
    assert all(isinstance(r, ConflictError) for r in out), out
    assert "'zarr.json'" in str(out[0])
    np.testing.assert_array_equal(tsp.open(url).result(T).read().result(T), np.zeros(8))
