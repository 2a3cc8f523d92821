"""Transactions on the versioned store (and the one-key rule on other stores)."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.core.future import spawn
from tensorstore_py.errors import (
    ConditionFailedError,
    ConflictError,
    InvalidArgumentError,
    StorageError,
    UnsupportedError,
)
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore

T = 60


@pytest.fixture(params=["memory", "file", "gcs"])
def kv(request: pytest.FixtureRequest, tmp_path: Any) -> VersionedKvStore:
    if request.param == "memory":
        base: tsp.KvStore = MemoryKvStore()
    elif request.param == "file":
        base = FileKvStore(path=str(tmp_path / "root"))
    else:
        emu = request.getfixturevalue("gcs_emulator")
        base = tsp.KvStore.open(emu.spec(emu.create_bucket())).result(T)
    return VersionedKvStore(base)


def test_atomic_across_keys_and_read_your_writes(kv: VersionedKvStore) -> None:
    kv.write("old", b"o").result(T)
    kv.write("gone", b"g").result(T)
    txn = tsp.Transaction()
    v = kv.with_transaction(txn)
    v.write("a", b"1").result(T)
    v.write("b/c", b"x" * 5000).result(T)
    v.write("big", b"y" * 400_000).result(T)
    v.delete("gone").result(T)
    # the transaction sees its own writes and deletes, list included
    assert v.read("a").result(T).value == b"1"
    assert v.read("gone").result(T).state == "missing"
    assert v.list().result(T) == ["a", "b/c", "big", "old"]
    # nobody else sees anything yet
    assert kv.list().result(T) == ["gone", "old"]
    assert kv.read("a").result(T).state == "missing"
    before = kv.newest_version().result(T)
    info = txn.commit().result(T)
    assert info.version == before + 1 and txn.committed
    assert kv.list().result(T) == ["a", "b/c", "big", "old"]
    assert bytes(kv.read("big").result(T).value) == b"y" * 400_000
    # exactly one new version holds all of it
    assert kv.newest_version().result(T) == before + 1
    with pytest.raises(InvalidArgumentError, match="no longer open"):
        v.write("c", b"late")


def test_snapshot_isolation(kv: VersionedKvStore) -> None:
    kv.write("k", b"1").result(T)
    txn = tsp.Transaction()
    v = kv.with_transaction(txn)
    assert v.read("k").result(T).value == b"1"  # pins the version
    kv.write("k", b"2").result(T)
    kv.write("new", b"n").result(T)
    assert v.read("k").result(T).value == b"1"
    assert v.read("new").result(T).state == "missing"
    assert v.list().result(T) == ["k"]
    txn.abort()


def test_rebase_when_disjoint(kv: VersionedKvStore) -> None:
    kv.write("shared", b"s").result(T)
    txn = tsp.Transaction()
    v = kv.with_transaction(txn)
    v.write("mine", b"m").result(T)
    kv.write("theirs", b"t").result(T)  # commits after txn pinned its version
    info = txn.commit().result(T)
    assert info.version == 3
    assert kv.read("mine").result(T).value == b"m"
    assert kv.read("theirs").result(T).value == b"t"


def test_conflict_names_the_key_leaves_nothing_and_retry_succeeds(kv: VersionedKvStore) -> None:
    kv.write("counter", b"0").result(T)
    txn = tsp.Transaction()
    v = kv.with_transaction(txn)
    n = int(v.read("counter").result(T).value)
    v.write("counter", b"%d" % (n + 1)).result(T)
    v.write("side", b"effect").result(T)
    kv.write("counter", b"10").result(T)  # a concurrent writer wins
    with pytest.raises(ConflictError, match="'counter'") as ei:
        txn.commit().result(T)
    assert ei.value.key == "counter" and txn.state == "failed"
    assert kv.read("side").result(T).state == "missing"
    assert kv.read("counter").result(T).value == b"10"
    with tsp.Transaction() as txn2:
        v2 = kv.with_transaction(txn2)
        n = int(v2.read("counter").result(T).value)
        v2.write("counter", b"%d" % (n + 1)).result(T)
    assert kv.read("counter").result(T).value == b"11"


def test_abort_and_exception_leave_nothing(kv: VersionedKvStore) -> None:
    with pytest.raises(RuntimeError, match="boom"), tsp.Transaction() as txn:
        kv.with_transaction(txn).write("a", b"1").result(T)
        raise RuntimeError("boom")
    assert txn.aborted
    txn2 = tsp.Transaction()
    kv.with_transaction(txn2).write("b", b"2").result(T)
    txn2.abort()
    assert kv.list().result(T) == []
    assert kv.newest_version().result(T) == 0


def test_if_equal_inside_a_transaction(kv: VersionedKvStore) -> None:
    g = kv.write("k", b"1").result(T)
    txn = tsp.Transaction()
    v = kv.with_transaction(txn)
    with pytest.raises(ConditionFailedError):
        v.write("k", b"x", if_equal=tsp.Generation.NO_VALUE).result(T)
    g2 = v.write("k", b"2", if_equal=g).result(T)
    assert v.read("k").result(T).generation == g2
    v.write("k", b"3", if_equal=g2).result(T)  # against the staged write
    v.write("fresh", b"f", if_equal=tsp.Generation.NO_VALUE).result(T)
    kv.write("fresh", b"other").result(T)  # the create-only condition is now stale
    with pytest.raises(ConflictError, match="'fresh'"):
        txn.commit().result(T)
    assert kv.read("k").result(T).value == b"1"


def test_empty_transaction_commits_nothing(kv: VersionedKvStore) -> None:
    kv.write("a", b"1").result(T)
    with tsp.Transaction() as txn:
        assert kv.with_transaction(txn).read("a").result(T).value == b"1"
    assert txn.commit().result(T).version == 1
    assert kv.newest_version().result(T) == 1


def test_large_values_are_written_before_commit(tmp_path: Any) -> None:
    base = FaultKvStore(FileKvStore(path=str(tmp_path)))
    kv = VersionedKvStore(base)
    txn = tsp.Transaction()
    kv.with_transaction(txn).write("ckpt", os.urandom(1 << 20)).result(T)
    # the value is already a data object; nothing is committed
    assert [n for n in base.list().result(T) if n.startswith("data/")]
    assert not [n for n in base.list().result(T) if n.startswith("commits/")]
    txn.commit().result(T)
    assert len(kv.read("ckpt").result(T).value) == 1 << 20


def test_lost_commit_response_is_neither_conflict_nor_double_commit() -> None:
    base = FaultKvStore(MemoryKvStore())
    base.inject(op="write", key_pattern="commits/*", nth=1, after_effect=True)
    kv = VersionedKvStore(base)
    with tsp.Transaction() as txn:
        kv.with_transaction(txn).write("a", b"1").result(T)
    assert txn.commit().result(T).version == 1
    assert base.faults["write"] == 1
    assert [n for n in base.list("commits/").result(T)] == ["commits/00000000000000000001"]
    # and outside transactions, a failed-before-landing commit write is retried
    base.inject(op="write", key_pattern="commits/*", nth=2)
    kv.write("b", b"2").result(T)
    assert kv.newest_version().result(T) == 2
    assert kv.read("b").result(T).value == b"2"


def test_failure_before_commit_point_leaves_old_version(tmp_path: Any) -> None:
    base = FaultKvStore(FileKvStore(path=str(tmp_path)))
    kv = VersionedKvStore(base)
    kv.write("a", b"old").result(T)
    base.inject(op="write", key_pattern="nodes/*")  # persistent: retries give up
    with pytest.raises(StorageError), tsp.Transaction() as txn:
        v = kv.with_transaction(txn)
        v.write("a", b"new").result(T)
        v.write("b", b"new").result(T)
    fresh = VersionedKvStore(FileKvStore(path=str(tmp_path)))
    fresh._root = type(fresh._root)(fresh.base)
    assert fresh.read("a").result(T).value == b"old"
    assert fresh.read("b").result(T).state == "missing"


def test_non_versioned_store_allows_one_key_only(tmp_path: Any) -> None:
    plain = FileKvStore(path=str(tmp_path))
    plain.write("x", b"0").result(T)
    with tsp.Transaction() as txn:
        v = plain.with_transaction(txn)
        assert v.read("x").result(T).value == b"0"
        v.write("x", b"1").result(T)
        assert v.read("x").result(T).value == b"1"
        assert plain.read("x").result(T).value == b"0"
        with pytest.raises(UnsupportedError, match="only one key.*'x'"):
            v.write("y", b"2").result(T)
    assert plain.read("x").result(T).value == b"1"
    assert plain.read("y").result(T).state == "missing"
    # the single write is conditional on what the transaction read
    txn = tsp.Transaction()
    v = plain.with_transaction(txn)
    v.read("x").result(T)
    v.write("x", b"2").result(T)
    plain.write("x", b"concurrent").result(T)
    with pytest.raises(ConflictError, match="'x'"):
        txn.commit().result(T)
    assert plain.read("x").result(T).value == b"concurrent"


def test_one_transaction_one_root(tmp_path: Any) -> None:
    a = VersionedKvStore(FileKvStore(path=str(tmp_path / "a")))
    b = VersionedKvStore(FileKvStore(path=str(tmp_path / "b")))
    b.write("r", b"readable").result(T)
    txn = tsp.Transaction()
    a.with_transaction(txn).write("k", b"1").result(T)
    assert b.with_transaction(txn).read("r").result(T).value == b"readable"
    with pytest.raises(UnsupportedError, match="one store root"):
        b.with_transaction(txn).write("k", b"1").result(T)
    # views with different paths over one root are one participant
    a.with_path("sub").with_transaction(txn).write("k", b"2").result(T)
    txn.commit().result(T)
    assert a.list().result(T) == ["k", "sub/k"]


def test_read_increment_write_threads_exactly_n(tmp_path: Any) -> None:
    path = str(tmp_path)
    VersionedKvStore(FileKvStore(path=path)).write("n", b"0").result(T)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            kv = VersionedKvStore(FileKvStore(path=path))
            for _ in range(10):
                while True:
                    try:
                        with tsp.Transaction() as txn:
                            v = kv.with_transaction(txn)
                            n = int(v.read("n").result(T).value)
                            v.write("n", b"%d" % (n + 1)).result(T)
                        break
                    except ConflictError:
                        continue
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert VersionedKvStore(FileKvStore(path=path)).read("n").result(T).value == b"40"


def test_staging_buffer_flushes_to_packed_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorstore_py.kvstore.versioned import txn as txn_mod

    monkeypatch.setattr(txn_mod, "STAGING_MAX", 10_000)
    base = MemoryKvStore()
    kv = VersionedKvStore(base)
    txn = tsp.Transaction()
    v = kv.with_transaction(txn)

    async def go() -> None:
        for i in range(30):
            await v.write(f"k{i:02d}", bytes([i]) * 1000)

    spawn(go()).result(T)
    assert len(base.list("data/").result(T)) >= 2  # flushed before commit
    txn.commit().result(T)
    assert all(bytes(kv.read(f"k{i:02d}").result(T).value) == bytes([i]) * 1000 for i in range(30))


def test_zarr3_arrays_in_a_transaction(tmp_path: Any) -> None:
    def spec(sub: str) -> dict[str, Any]:
        kvs = {"driver": "versioned", "base": f"file://{tmp_path}/run/", "path": sub}
        return {"driver": "zarr3", "kvstore": kvs}

    a = tsp.open(spec("a/"), create=True, dtype="float32", shape=[8, 8], chunks=[4, 4]).result(T)
    b = tsp.open(spec("b/"), create=True, dtype="int32", shape=[10], chunks=[5]).result(T)
    kv = VersionedKvStore(FileKvStore(path=f"{tmp_path}/run"))
    v0 = kv.newest_version().result(T)
    with tsp.Transaction() as txn:
        a.with_transaction(txn)[...].write(np.ones((8, 8), "float32")).result(T)
        b.with_transaction(txn)[0:10].write(np.arange(10, dtype="int32")).result(T)
        assert (a.with_transaction(txn)[...].read().result(T) == 1).all()
        assert (a[...].read().result(T) == 0).all()
    assert kv.newest_version().result(T) == v0 + 1
    a2 = tsp.open(spec("a/")).result(T)
    assert (a2[...].read().result(T) == 1).all()
    assert (b[...].read().result(T) == np.arange(10)).all()
    with pytest.raises(RuntimeError), tsp.Transaction() as txn:
        b.with_transaction(txn)[0:5].write(np.full(5, 7, "int32")).result(T)
        raise RuntimeError("abort")
    assert (b[...].read().result(T) == np.arange(10)).all()


def test_commit_waits_for_writes_issued_before_it() -> None:
    kv = VersionedKvStore(MemoryKvStore())
    txn = tsp.Transaction()
    v = kv.with_transaction(txn)
    futures = [v.write(f"k{i}", b"x" * (i * 1000)) for i in range(20)]
    info = txn.commit().result(T)
    assert all(f.done() for f in futures)
    assert info.keys_changed == 20 and len(kv.list().result(T)) == 20


DISJOINT_WORKER = r"""
import sys
import tensorstore_py as tsp
root, index = sys.argv[1], int(sys.argv[2])
kv = tsp.KvStore.open("versioned+file://" + root).result()
for j in range(10):
    with tsp.Transaction() as txn:          # a ConflictError here fails the test
        v = kv.with_transaction(txn)
        v.write(f"p{index}/{j}", b"%d" % j).result()
        v.write(f"p{index}/last", b"%d" % j).result()
    kv.write(f"p{index}/plain{j}", b"x").result()   # group-committed, outside transactions
"""


def test_disjoint_writer_processes_never_conflict(tmp_path: Any) -> None:
    import subprocess
    import sys

    root = str(tmp_path) + "/"
    procs = [
        subprocess.Popen([sys.executable, "-c", DISJOINT_WORKER, root, str(i)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(3)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    kv = VersionedKvStore(FileKvStore(path=root))
    assert kv.newest_version().result(T) == 60  # dense: one version per commit
    assert len(kv.list().result(T)) == 3 * 21
    assert all(kv.read(f"p{i}/last").result(T).value == b"9" for i in range(3))
