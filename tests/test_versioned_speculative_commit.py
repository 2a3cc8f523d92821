"""A commit's first attempt, planned against this process's cached newest version
while the probe for the newest version is in flight (``VersionedRoot.commit``),
is kept only when the probe confirms that version; otherwise it is dropped and
re-planned. Another process commits in between, for real, through the GCS
emulator behind a proxy that holds every request, so the probe is in flight
when the commit is planned.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import pytest

import tensorstore_py as tsp
from tensorstore_py.errors import ConditionFailedError, StorageError
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.testing.shaping_proxy import ShapingProxy

T = 60

_OTHER = """
import json, sys, tensorstore_py as tsp
kv = tsp.KvStore.open({"driver": "versioned", "base": json.loads(sys.argv[1])}).result()
txn = tsp.Transaction()
view = kv.with_transaction(txn)
for k, v in json.loads(sys.argv[2]).items():
    view.write(k, v.encode()).result()
txn.commit().result()
"""


def _other_process_commits(spec: dict[str, Any], values: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-c", _OTHER, json.dumps(spec), json.dumps(values)],
                   check=True, timeout=120)


def _nodes(direct: dict[str, Any]) -> int:
    """How many tree-node objects the store holds."""
    return len(tsp.KvStore.open(direct).result(T).list("nodes/").result(T))


@pytest.fixture()
def stores(gcs_emulator: Any) -> Any:
    bucket = gcs_emulator.create_bucket()
    direct = gcs_emulator.spec(bucket, path="v/")
    with ShapingProxy(gcs_emulator.endpoint, ttfb=0.05, handshake=0.0) as proxy:
        store = tsp.KvStore.open({"driver": "versioned",
                                  "base": {**direct, "endpoint": proxy.endpoint}}).result(T)
        for i in range(3):
            store.write(f"k{i}", b"old %d" % i).result(T)  # this process knows version 3
        yield store, direct, proxy


def _fresh(direct: dict[str, Any]) -> Any:
    return tsp.KvStore.open({"driver": "versioned", "base": direct}).result(T)


def test_a_write_planned_against_a_stale_version_is_replanned_on_the_newest(stores: Any) -> None:
    store, direct, _proxy = stores
    _other_process_commits(direct, {"k1": "theirs", "other": "x"})  # version 4
    nodes = _nodes(direct)
    store.write("k2", b"mine").result(T)
    reader = _fresh(direct)
    assert reader.newest_version().result(T) == 5
    assert {k: reader.read(k).result(T).value for k in ("k0", "k1", "k2", "other")} == {
        "k0": b"old 0", "k1": b"theirs", "k2": b"mine", "other": b"x"}
    assert _nodes(direct) == nodes + 2  # the dropped attempt's node, then the one committed
    assert [r.version for r in (reader.commit_details(v).result(T) for v in range(1, 6))] == [1, 2, 3, 4, 5]


def test_a_condition_true_only_at_the_stale_version_fails(stores: Any) -> None:
    store, direct, _proxy = stores
    gen = store.read("k1").result(T).generation
    _other_process_commits(direct, {"k1": "theirs"})  # version 4 changes k1
    with pytest.raises(ConditionFailedError):
        store.write("k1", b"mine", if_equal=gen).result(T)
    reader = _fresh(direct)
    assert reader.read("k1").result(T).value == b"theirs"
    assert reader.newest_version().result(T) == 4  # nothing committed by the failed write


def test_a_condition_true_only_at_a_version_this_process_has_not_seen_holds(stores: Any) -> None:
    """The writer's probe re-reads the version this process knows and does not
    look above it (the record's create-only write would find a newer one). A
    write whose condition fails there writes no record, so the newest version
    is looked up before the failure is reported: it holds there, and commits."""
    store, direct, _proxy = stores
    _other_process_commits(direct, {"k1": "theirs"})  # version 4, unseen by `store`
    gen = _fresh(direct).read("k1").result(T).generation  # learnt elsewhere
    store.write("k1", b"mine", if_equal=gen).result(T)
    reader = _fresh(direct)
    assert reader.read("k1").result(T).value == b"mine"
    assert reader.newest_version().result(T) == 5
    with pytest.raises(ConditionFailedError):  # and one false at the newest still fails
        store.write("k1", b"again", if_equal=gen).result(T)
    assert _fresh(direct).newest_version().result(T) == 5


def test_a_delete_of_a_key_only_a_version_this_process_has_not_seen_holds(stores: Any) -> None:
    store, direct, _proxy = stores
    _other_process_commits(direct, {"new": "theirs"})  # version 4, unseen by `store`
    store.delete("new").result(T)  # planned on version 3; its record write finds version 4
    reader = _fresh(direct)
    assert reader.newest_version().result(T) == 5
    assert reader.read("new").result(T).state == "missing"
    assert reader.read("k1").result(T).value == b"old 1"


def test_a_transaction_is_rebased_over_a_commit_it_did_not_know(stores: Any) -> None:
    # the transaction is based on version 3 (its first write); another process
    # commits version 4 (other keys) before the commit, which this process has
    # not seen: the attempt planned against 3 is dropped, the rebase on 4 lands
    store, direct, _proxy = stores
    txn = tsp.Transaction()
    view = store.with_transaction(txn)
    view.write("k1", b"mine").result(T)
    _other_process_commits(direct, {"other": "x"})
    nodes = _nodes(direct)
    txn.commit().result(T)
    reader = _fresh(direct)
    assert {k: reader.read(k).result(T).value for k in ("k1", "other")} == {"k1": b"mine", "other": b"x"}
    assert reader.newest_version().result(T) == 5
    assert _nodes(direct) == nodes + 2


def test_a_transaction_that_read_is_still_checked_from_its_snapshot(stores: Any) -> None:
    store, direct, _proxy = stores
    txn = tsp.Transaction()
    view = store.with_transaction(txn)
    assert view.read("k1").result(T).value == b"old 1"  # pins version 3
    _other_process_commits(direct, {"k1": "theirs"})  # version 4 changes k1
    view.write("k1", b"mine").result(T)
    with pytest.raises(tsp.errors.ConflictError):
        txn.commit().result(T)
    assert _fresh(direct).read("k1").result(T).value == b"theirs"



def test_a_failed_upload_fails_its_own_write_and_the_batch_commits_the_rest() -> None:
    # a large value's upload runs while the batch's nodes are written: when it
    # fails, that write fails with its error and the others in the batch commit
    mem = MemoryKvStore()
    fault = FaultKvStore(mem)
    kv = VersionedKvStore(fault)
    kv.write("k", b"old").result(T)
    fault.inject(op="write", key_pattern="data/*", times=10**6)  # every data upload fails
    # the next commit record lands late: the writes below queue up meanwhile and
    # are committed together, as ONE batch, after it
    fault.inject(op="write", key_pattern="commits/*", error=None, latency=1.0, times=1)
    first = kv.write("first", b"1")
    time.sleep(0.2)
    big = kv.write("big", b"x" * 300_000)
    time.sleep(0.2)  # its checksum is computed and it is queued
    small = [kv.write(f"s{i}", b"%d" % i) for i in range(3)]  # inline: no data object
    first.result(T)
    with pytest.raises(StorageError):
        big.result(T)
    for f in small:
        f.result(T)
    fault.clear()
    reader = VersionedKvStore(mem)
    assert reader.read("big").result(T).state == "missing"
    assert [reader.read(f"s{i}").result(T).value for i in range(3)] == [b"0", b"1", b"2"]
    assert reader.read("k").result(T).value == b"old"
    assert reader.newest_version().result(T) == 3  # "k", "first", then the batch of the 3 others
    kv.write("big", b"y" * 300_000).result(T)  # and the next upload commits
    assert VersionedKvStore(mem).read("big").result(T).value == b"y" * 300_000


def test_a_cancelled_write_whose_upload_is_in_flight_leaves_the_rest_of_its_batch_committing() -> None:
    # the caller of a large write gives up while its value still uploads, after
    # the write joined a batch: that write is dropped (its upload is cancelled,
    # nothing references it) and the other writes of the batch commit
    mem = MemoryKvStore()
    fault = FaultKvStore(mem)
    kv = VersionedKvStore(fault)
    kv.write("k", b"old").result(T)
    fault.inject(op="write", key_pattern="commits/*", error=None, latency=1.0, times=1)
    fault.inject(op="write", key_pattern="data/*", error=None, latency=2.0, times=1)  # big's upload
    first = kv.write("first", b"1")
    time.sleep(0.2)
    big = kv.write("big", b"x" * 300_000)
    time.sleep(0.2)  # its checksum is computed and it is queued
    small = [kv.write(f"s{i}", b"%d" % i) for i in range(3)]  # queued in the same batch
    time.sleep(0.1)
    assert big.cancel()
    first.result(T)
    for f in small:
        assert isinstance(f.result(T), tsp.Generation)
    assert big.cancelled()
    reader = VersionedKvStore(mem)
    assert reader.newest_version().result(T) == 3  # "k", "first", then the batch of the 3 others
    assert [reader.read(f"s{i}").result(T).value for i in range(3)] == [b"0", b"1", b"2"]
    assert reader.read("big").result(T).state == "missing"


def test_a_first_commit_planned_on_the_empty_store_is_replanned_over_a_new_commit(gcs_emulator: Any) -> None:
    # this process found the store empty; its commit plans against version 0
    # while the probe runs, and another process committed meanwhile: the
    # attempt is dropped and planned again on version 1 (both values survive)
    bucket = gcs_emulator.create_bucket()
    direct = gcs_emulator.spec(bucket, path="v/")
    with ShapingProxy(gcs_emulator.endpoint, ttfb=0.05, handshake=0.0) as proxy:
        store = tsp.KvStore.open({"driver": "versioned", "base": {**direct, "endpoint": proxy.endpoint}}).result(T)
        assert store.newest_version().result(T) == 0
        txn = tsp.Transaction()
        store.with_transaction(txn).write("mine", b"1").result(T)  # reads version 0
        _other_process_commits(direct, {"theirs": "2"})
        assert txn.commit().result(T).version == 2
    fresh = _fresh(direct)
    assert fresh.read("mine").result(T).value == b"1"
    assert fresh.read("theirs").result(T).value == b"2"
    assert [v.version for v in fresh.versions().result(T)] == [1, 2]


def test_a_hint_is_checked_with_the_version_above_it() -> None:
    # the newest version named by the hint costs one round of probes (it and the
    # one above it together), a store found empty one as well
    from tensorstore_py.kvstore.versioned.newest import probe_newest

    def rounds(newest: int, known: int, hint: int) -> tuple[int, int]:
        state = {"in_flight": 0, "rounds": 0}

        async def exists(v: int) -> bool:
            if state["in_flight"] == 0:
                state["rounds"] += 1
            state["in_flight"] += 1
            await asyncio.sleep(0.001)
            state["in_flight"] -= 1
            return v <= newest

        return asyncio.run(probe_newest(exists, known, hint)), state["rounds"]

    assert rounds(7, 0, 7) == (7, 1)  # the hint names the newest
    assert rounds(7, 1, 7) == (7, 1)
    assert rounds(0, 0, 0) == (0, 1)
    assert rounds(9, 0, 7) == (9, 4)  # behind: 7 and 8 exist, then 9, 11 (no), 10 (no)
    assert rounds(7, 3, 0) == (7, 5)  # no hint: 4, 6, 10 (no), 8 (no), 7
    assert rounds(3, 0, 7)[0] == 3  # a hint ahead (the store was recreated): probed from known
