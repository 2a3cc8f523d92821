"""Multi-writer commits: N participants, one transaction id, ONE version."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from _multiwriter import in_threads

import tensorstore_py as tsp
from tensorstore_py.errors import (
    ConflictError,
    InvalidArgumentError,
    ParticipantFailedError,
    StorageError,
)
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.format import InlineEntry, RefEntry, new_stamp
from tensorstore_py.kvstore.versioned.fragments import (
    Fragment,
    decode_attempt,
    encode_fragment,
    fragment_name,
)

T = 120

WORKER = r"""
import json, sys
import tensorstore_py as tsp
root, index, count, txn_id, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
skip = sys.argv[6] == "skip"
kv = tsp.KvStore.open({"driver": "versioned", "base": "file://" + root, "path": "params/"}).result()
txn = tsp.Transaction(txn_id=txn_id, process_index=index, process_count=count, timeout=timeout,
                      message="step", metadata={"step": 100})
v = kv.with_transaction(txn)
if skip:
    sys.exit(0)  # dies before delivering its fragment
for j in range(5):
    v.write(f"shard{index}/{j}", (b"%d-%d" % (index, j)) * (100 if j % 2 else 100000)).result()
try:
    info = txn.commit().result()
    print(json.dumps({"version": info.version, "write_id": info.write_id}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


def _run(root: str, count: int, txn_id: str, timeout: float, skip: set[int] = frozenset()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, root, str(i), str(count), txn_id, str(timeout),
             "skip" if i in skip else "go"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(count)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=T)
        assert p.returncode == 0, stderr
        out.append(json.loads(stdout) if stdout.strip() else {})
    return out


def test_three_processes_commit_one_version(tmp_path: Any) -> None:
    root = str(tmp_path / "run") + "/"
    kv = VersionedKvStore(FileKvStore(path=root)).with_path("params")
    kv.write("before", b"b").result(T)
    res = _run(root, 3, "step-100", 60.0)
    assert all("version" in r for r in res), res
    assert {r["version"] for r in res} == {2}
    assert len({r["write_id"] for r in res}) == 1
    assert kv.newest_version().result(T) == 2
    assert len(kv.list().result(T)) == 16
    for i in range(3):
        for j in range(5):
            expect = (b"%d-%d" % (i, j)) * (100 if j % 2 else 100000)
            assert bytes(kv.read(f"shard{i}/{j}").result(T).value) == expect
    info = kv.versions().result(T)[-1]  # type: ignore[attr-defined]
    assert info.metadata == {"step": 100} and info.message == "step"
    # the merged fragments and the attempt are deleted; the small result stays
    assert FileKvStore(path=root).list("txns/").result(T) == ["txns/step-100/result"]


def test_participant_that_never_writes_means_no_commit(tmp_path: Any) -> None:
    root = str(tmp_path / "run") + "/"
    t = time.monotonic()
    res = _run(root, 3, "step-7", 3.0, skip={2})
    assert time.monotonic() - t < 60
    assert res[0]["error"] == "DeadlineExceededError" and "participant(s) [2]" in res[0]["message"]
    assert res[1]["error"] == "DeadlineExceededError"
    kv = VersionedKvStore(FileKvStore(path=root))
    assert kv.newest_version().result(T) == 0
    assert kv.list().result(T) == []


class ThreadCoordinator:
    """A minimal in-process coordination service (the protocol jax.distributed's
    key-value store fulfils across processes)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._kv: dict[str, str] = {}
        self.published: list[str] = []

    def publish(self, key: str, value: str) -> None:
        with self._cv:
            self._kv[key] = value
            self.published.append(key)
            self._cv.notify_all()

    def wait_for(self, key: str, timeout: float) -> str:
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._kv, timeout):
                raise TimeoutError(f"no {key!r} after {timeout} s")
            return self._kv[key]


def _threads(kv: VersionedKvStore, n: int, body: Any, **kw: Any) -> list[Any]:
    def run(i: int) -> Any:
        txn = tsp.Transaction(process_index=i, process_count=n, **kw)
        body(i, kv.with_transaction(txn))
        return txn.commit().result(T)

    return in_threads(n, run)


def test_coordinator_object_is_used_as_barrier() -> None:
    kv = VersionedKvStore(MemoryKvStore())
    coord = ThreadCoordinator()
    res = _threads(kv, 4, lambda i, v: v.write(f"k{i}", b"%d" % i).result(T),
                   txn_id="c1", coordinator=coord, timeout=30)
    assert [r.version for r in res] == [1, 1, 1, 1]
    assert kv.list().result(T) == ["k0", "k1", "k2", "k3"]
    assert set(coord.published) == {"tsp/c1/attempt", "tsp/c1/fragment/1", "tsp/c1/fragment/2",
                                    "tsp/c1/fragment/3", "tsp/c1/result"}
    # each fragment was written for the attempt process 0 announced (its nonce in the name)
    nonce = json.loads(coord._kv["tsp/c1/attempt"])["nonce"]
    assert all(nonce in coord._kv[f"tsp/c1/fragment/{i}"] for i in (1, 2, 3))


def test_duplicate_key_across_participants_is_an_error() -> None:
    kv = VersionedKvStore(MemoryKvStore())
    res = _threads(kv, 3, lambda i, v: v.write("same" if i else "x", b"%d" % i).result(T),
                   txn_id="dup", timeout=30)
    assert all(isinstance(r, InvalidArgumentError) for r in res), res
    assert "'same'" in str(res[0])
    assert kv.newest_version().result(T) == 0


def test_conflict_is_reported_to_every_participant() -> None:
    kv = VersionedKvStore(MemoryKvStore())
    kv.write("k1", b"old").result(T)
    pinned = threading.Barrier(3)

    def body(i: int, v: Any) -> None:
        v.write(f"k{i}", b"new").result(T)
        pinned.wait(30)
        if i == 0:
            kv.write("k1", b"concurrent").result(T)  # after every participant pinned

    res = _threads(kv, 3, body, txn_id="cf", timeout=30)
    assert all(isinstance(r, ConflictError) for r in res), res
    assert kv.read("k1").result(T).value == b"concurrent"
    assert kv.read("k2").result(T).state == "missing"


def test_wait_false_returns_once_the_fragment_landed_and_ids_are_single_use() -> None:
    kv = VersionedKvStore(MemoryKvStore())
    # a fragment belongs to an attempt of process 0, so process 0 starts first;
    # participant 2 holds the merge back until participant 1 has returned
    t0 = tsp.Transaction(txn_id="w", process_index=0, process_count=3, timeout=30)
    kv.with_transaction(t0).write("a", b"0").result(T)
    fut0 = t0.commit()
    t1 = tsp.Transaction(txn_id="w", process_index=1, process_count=3, timeout=30)
    kv.with_transaction(t1).write("b", b"1").result(T)
    info = t1.commit(wait=False).result(T)
    assert info.version is None and kv.newest_version().result(T) == 0
    t2 = tsp.Transaction(txn_id="w", process_index=2, process_count=3, timeout=30)
    kv.with_transaction(t2).write("c", b"2").result(T)
    assert t2.commit().result(T).version == 1
    assert fut0.result(T).version == 1
    again = tsp.Transaction(txn_id="w", process_index=1, process_count=3, timeout=30)
    kv.with_transaction(again).write("b", b"2").result(T)
    with pytest.raises(InvalidArgumentError, match="must not be reused"):
        again.commit().result(T)


def test_merging_1000_fragments_is_fast(tmp_path: Any) -> None:
    n = 1000
    base = FileKvStore(path=str(tmp_path), sync=False)
    kv = VersionedKvStore(base)
    obj = "data/" + "0" * 32
    base.write(obj, b"d" * 80).result(T)  # what the fragments reference (checked before the commit)
    t0 = tsp.Transaction(txn_id="big", process_index=0, process_count=n + 1, timeout=60)
    kv.with_transaction(t0).write("p/0000/0", b"coordinator").result(T)
    fut = t0.commit()
    name = "txns/big/attempts/000001"  # opened by process 0 at its first write
    while base.read(name).result(T).state != "value":
        time.sleep(0.01)
    attempt = decode_attempt(base.read(name).result(T).value, name, "big")
    for i in range(1, n + 1):
        changes = [
            (f"p/{i:04d}/{j}", RefEntry(new_stamp(), obj, j * 10, 10, 0) if j % 2 else InlineEntry(new_stamp(), b"v"))
            for j in range(8)
        ]
        base.write(fragment_name("big", 1, attempt.nonce, i),
                   encode_fragment("big", attempt, "0" * 32, Fragment(i, 0, changes))).result(T)
    start = time.perf_counter()  # from the last fragment landing to the commit
    info = fut.result(T)
    dt = time.perf_counter() - start
    assert info.version == 1 and info.keys_changed == n * 8 + 1
    assert dt < 5.0, f"merging {n} fragments took {dt:.2f} s"
    assert len(kv.list("p/").result(T)) == n * 8 + 1
    print(f"merge+commit of {n} fragments: {dt:.3f} s")


def test_multi_writer_needs_a_txn_id_and_a_versioned_store(tmp_path: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="txn_id"):
        tsp.Transaction(process_index=0, process_count=2)
    with pytest.raises(InvalidArgumentError, match="process_index"):
        tsp.Transaction(txn_id="x", process_index=2, process_count=2)
    txn = tsp.Transaction(txn_id="x", process_index=1, process_count=2)
    plain = FileKvStore(path=str(tmp_path))
    with pytest.raises(tsp.UnsupportedError, match="versioned"):
        plain.with_transaction(txn).write("a", b"1").result(T)
    with pytest.raises(InvalidArgumentError, match="exactly one versioned"):
        tsp.Transaction(txn_id="y", process_index=1, process_count=2).commit().result(T)


@pytest.mark.parametrize("where", ["file", "gcs"])
def test_polling_barrier_on_file_and_gcs(where: str, tmp_path: Any, request: pytest.FixtureRequest) -> None:
    if where == "file":
        base: tsp.KvStore = FileKvStore(path=str(tmp_path))
    else:
        emu = request.getfixturevalue("gcs_emulator")
        base = tsp.KvStore.open(emu.spec(emu.create_bucket())).result(T)
    kv = VersionedKvStore(base)
    kv.write("seed", b"s").result(T)
    res = _threads(kv, 3, lambda i, v: v.write(f"w{i}", b"x" * (300_000 if i == 1 else 50)).result(T),
                   txn_id="poll", timeout=30)
    assert [getattr(r, "version", r) for r in res] == [2, 2, 2]
    assert kv.list().result(T) == ["seed", "w0", "w1", "w2"]
    assert len(kv.read("w1").result(T).value) == 300_000


def test_participant_finds_a_commit_whose_result_was_never_published() -> None:
    mem = MemoryKvStore()
    kv = VersionedKvStore(mem)
    t1 = tsp.Transaction(txn_id="lost", process_index=1, process_count=2, timeout=1.5)
    kv.with_transaction(t1).write("b", b"1").result(T)
    fut = t1.commit()
    # a coordinator that commits (the record carries the txn id) and never manages
    # to write the result
    lossy = FaultKvStore(mem)
    lossy.inject(op="write", key_pattern="txns/*/result")
    t0 = tsp.Transaction(txn_id="lost", process_index=0, process_count=2, timeout=30)
    VersionedKvStore(lossy).with_transaction(t0).write("a", b"0").result(T)
    assert t0.commit().result(T).version == 1
    assert mem.read("txns/lost/result").result(T).state == "missing"
    assert fut.result(T).version == 1


def test_participant_failing_before_its_fragment_releases_the_others_at_once() -> None:
    base = MemoryKvStore()
    VersionedKvStore(base).write("x", b"0").result(T)
    failing = FaultKvStore(base)
    failing.inject(op="write", key_pattern="data/*")  # participant 2 can not store its data
    stores = [VersionedKvStore(base), VersionedKvStore(base), VersionedKvStore(failing)]
    coord = ThreadCoordinator()

    def run(i: int) -> Any:
        txn = tsp.Transaction(process_index=i, process_count=3, txn_id="f1", coordinator=coord, timeout=60)
        stores[i].with_transaction(txn).write(f"k{i}", b"v" * 5000).result(T)  # staged until the commit
        return txn.commit().result(T)

    t = time.monotonic()
    res = in_threads(3, run)
    assert time.monotonic() - t < 20  # not the 60 s timeout
    assert isinstance(res[2], StorageError) and "injected fault" in str(res[2]), res
    for r in res[:2]:  # process 0 and the other participant: process 2's error, typed
        assert isinstance(r, ParticipantFailedError), res
        assert "process 2 of 3" in str(r) and "StorageError" in str(r) and "injected fault" in str(r)
    assert res[0].process_index == 2 and res[0].cause == "StorageError"
    assert json.loads(coord._kv["tsp/f1/fragment/2"])["failed"]["process"] == 2
    kv = VersionedKvStore(base)
    assert kv.newest_version().result(T) == 1 and kv.list().result(T) == ["x"]
