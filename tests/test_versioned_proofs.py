"""Proofs of the versioned store's guarantees: serialisable increments across
processes, no false conflicts, all-or-nothing commits under injected faults
(memory, file, gcs), and bad input refused with errors naming the object."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import pytest
from _versioned_workload import (
    BASES,
    check_version,
    commit_single,
    open_base,
    single_keys,
    write_counter,
)

import tensorstore_py as tsp
from tensorstore_py.errors import (
    ChecksumError,
    ConflictError,
    DataCorruptionError,
    TensorStoreError,
)
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned import root as root_module
from tensorstore_py.kvstore.versioned.format import MAGIC_NODE, CommitRecord, commit_name, frame
from tensorstore_py.kvstore.versioned.verify import verify

T = 60
_fork = multiprocessing.get_context("fork")


# -- concurrency -----------------------------------------------------------------------
def _incrementer(root: str, key: str, n: int, out: Any) -> None:
    try:
        kv = VersionedKvStore(FileKvStore(path=root))
        conflicts = 0
        for _ in range(n):
            while True:
                try:
                    with tsp.Transaction() as txn:
                        t = kv.with_transaction(txn)
                        res = t.read(key).result(T)
                        cur = int(bytes(res.value)) if res.state == "value" else 0
                        t.write(key, b"%d" % (cur + 1)).result(T)
                    break
                except ConflictError:
                    conflicts += 1
        out.put(conflicts)
    except BaseException as e:
        out.put(f"{type(e).__name__}: {e}")
    out.close()
    out.join_thread()  # flush before the hard exit
    os._exit(0)


def _run_incrementers(root: str, keys: list[str], n: int) -> list[int]:
    out = _fork.Queue()
    procs = [_fork.Process(target=_incrementer, args=(root, k, n, out)) for k in keys]
    for p in procs:
        p.start()
    conflicts = [out.get(timeout=120) for _ in procs]
    assert all(isinstance(c, int) for c in conflicts), conflicts
    for p in procs:
        p.join(T)
        assert p.exitcode == 0
    return conflicts


def test_four_processes_increment_one_key_forty_times(tmp_path: Any) -> None:
    root = str(tmp_path)
    conflicts = _run_incrementers(root, ["counter"] * 4, 10)
    kv = VersionedKvStore(FileKvStore(path=root))
    assert kv.read("counter").result(T).value == b"40"
    assert kv.newest_version().result(T) == 40  # one version per successful increment
    # every version holds the value before it plus one: no lost update, no double commit
    values = [int(bytes(kv.snapshot(v).read("counter").result(T).value)) for v in range(1, 41)]
    assert values == list(range(1, 41))
    print(f"conflicts retried: {conflicts}")
    assert verify(kv).result(T) == []


def test_disjoint_writers_never_conflict(tmp_path: Any) -> None:
    root = str(tmp_path)
    conflicts = _run_incrementers(root, [f"own/{i}" for i in range(4)], 10)
    assert conflicts == [0, 0, 0, 0]
    kv = VersionedKvStore(FileKvStore(path=root))
    assert [kv.read(f"own/{i}").result(T).value for i in range(4)] == [b"10"] * 4
    assert kv.newest_version().result(T) == 40


# -- fault injection at every step of a commit ---------------------------------------------
@pytest.fixture(params=BASES)
def base(request: pytest.FixtureRequest, tmp_path: Any) -> KvStore:
    return open_base(request, tmp_path)


def _fresh(base: KvStore) -> VersionedKvStore:
    root_module._roots.clear()  # no cached nodes or versions from the faulty run
    return VersionedKvStore(base)


def _newest_is_whole(base: KvStore, keys: list[str]) -> tuple[int, int]:
    kv = _fresh(base)
    v = kv.newest_version().result(T)
    return v, check_version(kv, v, keys)


@pytest.mark.parametrize(
    "after_effect,times",
    [(False, 1), (True, 1), (False, 10_000), (True, 10_000)],
    ids=["fails-once", "lands-but-fails-once", "fails-from-then-on", "lands-but-fails-from-then-on"],
)
def test_a_fault_at_every_write_of_a_commit_leaves_old_or_new(
    base: KvStore, after_effect: bool, times: int
) -> None:
    """The step-th base-store write of a transaction (staging + commit) fails,
    once (the engine may retry it away) or with every write after it; with
    ``lands-but-fails`` the write takes effect and only its response is lost.
    Every outcome is the old version or the new one, whole, and a retry works."""
    keys = single_keys()
    commit_single(VersionedKvStore(base), 0, keys)
    counter = 0
    step = 0
    outcomes = {"committed": 0, "failed": 0}
    while True:
        step += 1
        counter += 1
        fault = FaultKvStore(base)
        root_module._roots.clear()
        kv = VersionedKvStore(fault)
        old_v, old_c = _newest_is_whole(base, keys)
        fault.inject(op="write", nth=step, times=times, after_effect=after_effect)
        try:
            with tsp.Transaction(metadata={"counter": counter}) as txn:
                write_counter(kv.with_transaction(txn), keys, counter, extra="extra")
            ok = True
        except TensorStoreError:  # StorageError, or what the engine makes of it
            ok = False
        fired = fault.faults["write"] > 0
        v, c = _newest_is_whole(base, keys)
        if ok:
            assert (v, c) == (old_v + 1, counter), f"step {step}: commit reported but not visible"
            outcomes["committed"] += 1
        else:
            assert (v, c) == (old_v, old_c), f"step {step}: a failed commit became visible"
            outcomes["failed"] += 1
            counter += 1  # the retry, without faults, succeeds
            commit_single(_fresh(base), counter, keys)
            assert _newest_is_whole(base, keys) == (old_v + 1, counter)
        assert verify(_fresh(base)).result(T) == [], f"step {step}"
        if not fired:
            break  # the transaction made fewer than `step` writes: every step was covered
    assert step >= 5, step  # large values, packed data, node(s), commit record
    if times > 1 and not after_effect:
        assert outcomes["failed"] >= 4, outcomes  # a store that stays down fails the commit
    if after_effect:
        assert outcomes["committed"] >= 4, outcomes  # lost responses are recognised as success


# -- bad input ------------------------------------------------------------------------------
def _store_with_versions(tmp_path: Any) -> tuple[FileKvStore, VersionedKvStore]:
    base = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(base)
    for i in range(300):  # more than one leaf
        kv.with_path("k").write(f"{i:04d}", b"v%d" % i).result(T) if i % 100 == 0 else None
    with tsp.Transaction() as txn:
        t = kv.with_transaction(txn)
        for i in range(600):
            t.write(f"many/{i:04d}", b"x%d" % i).result(T)
    return base, kv


def _record(base: KvStore, v: int) -> CommitRecord:
    return CommitRecord.decode(bytes(base.read(commit_name(v)).result(T).value), commit_name(v))


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_damaged_commit_record_raises_checksum_error_naming_it(tmp_path: Any, damage: str) -> None:
    base, kv = _store_with_versions(tmp_path)
    v = kv.newest_version().result(T)
    name = commit_name(v)
    data = bytearray(base.read(name).result(T).value)
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = data[:3]
    base.write(name, bytes(data)).result(T)
    with pytest.raises(ChecksumError, match=name):
        _fresh(base).read("many/0001").result(T)
    problems = verify(base).result(T)
    assert [(p.object, p.kind) for p in problems] == [(name, "checksum")]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_index_node_raises_checksum_error_naming_it(tmp_path: Any, damage: str) -> None:
    base, kv = _store_with_versions(tmp_path)
    node = _record(base, kv.newest_version().result(T)).root
    assert node is not None
    data = bytearray(base.read(node).result(T).value)
    if damage == "truncate":
        data = data[:-9]
    else:
        data[6] ^= 0x01
    base.write(node, bytes(data)).result(T)
    with pytest.raises(ChecksumError, match=node):
        _fresh(base).read("many/0001").result(T)
    problems = verify(base).result(T)
    assert problems and {p.object for p in problems} == {node}
    assert all(p.kind == "checksum" for p in problems)


@pytest.mark.parametrize(
    "ref",
    ["nodes/../../etc/passwd", "/etc/passwd", "data/" + "a" * 32, "nodes/" + "A" * 32, "gs://x/nodes/1"],
)
def test_a_reference_out_of_the_prefix_is_refused(tmp_path: Any, ref: str) -> None:
    base, kv = _store_with_versions(tmp_path)
    v = kv.newest_version().result(T)
    # a well-checksummed inner node whose child points outside nodes/<hex32>
    evil = "nodes/" + "e" * 32
    base.write(evil, frame(MAGIC_NODE, {"t": "inner", "k": ["a"], "c": [ref], "n": [1]})).result(T)
    rec = _record(base, v)
    forged = CommitRecord(version=v + 1, parent=v, time=rec.time, write_id="f" * 32, root=evil,
                          count=1, changes=[])
    base.write(commit_name(v + 1), forged.encode()).result(T)
    with pytest.raises(DataCorruptionError, match="references"):
        _fresh(base).read("a").result(T)
    problems = verify(base).result(T)
    assert [(p.object, p.kind) for p in problems] == [(evil, "corrupt")]
    assert ref in problems[0].message or repr(ref) in problems[0].message


@pytest.mark.parametrize("retries", [{"max_attempts": 1}, {"max_attempts": 3, "initial_delay": 0.002}],
                         ids=["no-retries", "few-retries"])
def test_commits_through_a_faulty_network_are_all_or_nothing(gcs_emulator: Any, retries: Any) -> None:
    """The versioned store on GCS behind a loopback proxy that refuses requests,
    resets connections, loses responses of requests that landed and truncates
    bodies: every commit is visible whole or not at all, and verify passes."""
    from tensorstore_py.testing.fault_proxy import FaultProxy

    bucket = gcs_emulator.create_bucket()
    direct = tsp.KvStore.open(gcs_emulator.spec(bucket)).result(T)
    keys = single_keys()
    commit_single(VersionedKvStore(direct), 0, keys)
    outcomes = {"committed": 0, "failed": 0}
    with FaultProxy(gcs_emulator.endpoint, fault_rate=0.15, seed=11) as proxy:
        faulty = tsp.KvStore.open(
            gcs_emulator.spec(bucket, extra={"endpoint": proxy.endpoint, "retries": retries})
        ).result(T)
        for counter in range(1, 13):
            old_v, old_c = _newest_is_whole(direct, keys)
            root_module._roots.clear()
            try:
                commit_single(VersionedKvStore(faulty), counter, keys)
                ok = True
            except TensorStoreError:
                ok = False
            v, c = _newest_is_whole(direct, keys)
            if ok:
                assert (v, c) == (old_v + 1, counter)
                outcomes["committed"] += 1
            else:
                # unknown outcome (e.g. the answer to the commit record and every
                # read-back were lost): old or new, never a mix
                assert (v, c) in ((old_v, old_c), (old_v + 1, counter)), (counter, v, c)
                outcomes["failed"] += 1
        faults = proxy.counters()["faults"]
    assert faults > 5, proxy.counters()
    assert verify(direct).result(T) == []
    print(outcomes)
