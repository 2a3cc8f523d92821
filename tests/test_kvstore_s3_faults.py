"""The s3 store through real injected faults: a loopback proxy in front of the moto
server answers 503/429, resets connections, loses or truncates responses."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from _objstore_faults import PATIENT, ledger_race, lost_answer_scenarios

import tensorstore_py as tsp
from tensorstore_py.errors import CommitOutcomeUnknownError, ConditionFailedError
from tensorstore_py.kvstore.s3 import S3KvStore
from tensorstore_py.testing.fault_proxy import FaultProxy
from tensorstore_py.testing.kvstore import cas_increment
from tensorstore_py.testing.s3_server import S3Server

T = 120


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    return s3_server.create_bucket()


@pytest.fixture
def direct(s3_server: S3Server, bucket: str) -> S3KvStore:
    return S3KvStore.from_spec(s3_server.spec(bucket))


def _store(server: S3Server, bucket: str, proxy: FaultProxy, **extra: Any) -> S3KvStore:
    return S3KvStore.from_spec(server.spec(bucket, extra={
        "endpoint_url": proxy.endpoint, "retries": PATIENT, **extra}))


def test_workload_survives_faults(s3_server: S3Server, bucket: str, direct: S3KvStore) -> None:
    """Writes (multipart ones too), reads, ranged reads, create-only, CAS, list and
    deletes at ~30% faults; the bucket then holds exactly what was acknowledged."""
    expected: dict[str, bytes] = {}
    with FaultProxy(s3_server.endpoint, fault_rate=0.3, seed=4321) as proxy:
        kv = _store(s3_server, bucket, proxy, multipart_threshold=6 << 20, part_size=5 << 20)
        sizes = [0, 1, 100, 70_000, 300_000, 7 << 20]
        futs = {}
        for i in range(18):
            key = f"w/{i:02d}"
            expected[key] = random.Random(i).randbytes(sizes[i % len(sizes)])
            futs[key] = kv.write(key, expected[key])
        gens = {k: f.result(T) for k, f in futs.items()}
        for k in expected:
            r = kv.read(k).result(T)
            assert bytes(r.value) == expected[k] and r.generation == gens[k], k
        big = "w/04"
        assert bytes(kv.read(big, byte_range=slice(100, 60_000)).result(T).value) == \
            expected[big][100:60_000]
        for i in range(10):
            kv.write(f"c/{i}", b"%d" % i, if_equal=tsp.Generation.NO_VALUE).result(T)
            expected[f"c/{i}"] = b"%d" % i
        kv.write("counter", b"0", if_equal=tsp.Generation.NO_VALUE).result(T)
        assert cas_increment(kv, "counter", 20, timeout=T) == 0  # one writer never loses
        expected["counter"] = b"20"
        assert kv.list().result(T) == sorted(expected)
        for i in range(0, 18, 3):
            kv.delete(f"w/{i:02d}").result(T)
            del expected[f"w/{i:02d}"]
        with pytest.raises(ConditionFailedError):
            kv.delete("w/01", if_equal=gens["w/02"]).result(T)
        kv.delete_range("c/").result(T)
        for k in [k for k in expected if k.startswith("c/")]:
            del expected[k]
        c = proxy.counters()
    assert direct.list().result(T) == sorted(expected)
    for k, v in expected.items():
        assert bytes(direct.read(k).result(T).value) == v, k
    print("fault proxy counters:", c)
    assert c["faults"] >= 0.2 * c["requests"], c
    assert all(n > 0 for n in c["by_kind"].values()), c


def test_lost_answers_of_conditional_requests(s3_server: S3Server, bucket: str,
                                              direct: S3KvStore) -> None:
    lost_answer_scenarios(lambda proxy: _store(s3_server, bucket, proxy), direct,
                          s3_server.endpoint, delete_requests=1)


def test_lost_answer_of_a_multipart_completion(s3_server: S3Server, bucket: str,
                                               direct: S3KvStore) -> None:
    """The completion's answer is lost: its retry is recognised (moto answers a
    completed upload again; S3 may say NoSuchUpload, settled by the write-id)."""
    data = os.urandom(11 << 20)
    with FaultProxy(s3_server.endpoint, fault_rate=0.0) as proxy:
        kv = _store(s3_server, bucket, proxy, multipart_threshold=6 << 20, part_size=5 << 20)
        proxy.script([None, None, None, None, "lost_response"])  # create, 3 parts, complete
        g = kv.write("big", data, if_equal=tsp.Generation.NO_VALUE).result(T)
        assert proxy.counters()["by_kind"]["lost_response"] == 1
    r = direct.read("big").result(T)
    assert r.generation == g and bytes(r.value) == data


def test_cas_ledger_race_through_faults(s3_server: S3Server, bucket: str,
                                        direct: S3KvStore) -> None:
    """4 workers x 15 increments at 10% faults of every kind: each landed once,
    as many as were acknowledged."""
    with FaultProxy(s3_server.endpoint, fault_rate=0.1, seed=77) as proxy:
        out = ledger_race(_store(s3_server, bucket, proxy), direct, workers=4, n=15)
        c = proxy.counters()
    print("ledger race:", out, c)
    assert c["faults"] > 0, c


def test_unconditional_multipart_whose_completion_answers_no_such_upload(
        s3_server: S3Server, bucket: str, direct: S3KvStore) -> None:
    """The completion lands, its answer is lost, and its retry is told the
    upload is gone (NoSuchUpload, as S3 may answer): the write-id on the object
    says it landed, so the write returns its generation (a StorageError before).
    When another writer's value is there instead, the outcome is unknown."""
    data = os.urandom(11 << 20)
    other: dict[str, Any] = {}

    def another_writer(kind: str, head: bytes) -> None:
        act = other.pop("act", None)
        if act is not None:
            act()

    with FaultProxy(s3_server.endpoint, fault_rate=0.0, on_fault=another_writer) as proxy:
        kv = _store(s3_server, bucket, proxy, multipart_threshold=6 << 20, part_size=5 << 20)
        # create, 3 parts, complete (lost), complete again (NoSuchUpload), abort
        proxy.script([None, None, None, None, "lost_response", "no_such_upload"])
        g = kv.write("big", data).result(T)
        assert proxy.counters()["by_kind"]["lost_response"] == 1
        r = direct.read("big").result(T)
        assert r.generation == g and bytes(r.value) == data

        other["act"] = lambda: direct.write("big", b"theirs").result(T)
        proxy.script([None, None, None, None, "lost_response", "no_such_upload"])
        with pytest.raises(CommitOutcomeUnknownError) as info:
            kv.write("big", data[::-1]).result(T)
        assert info.value.write_id and info.value.key is not None and info.value.key.endswith("big")
        assert "NoSuchUpload" in str(info.value)
        assert bytes(direct.read("big").result(T).value) == b"theirs"


@pytest.mark.parametrize("size", [100, 7 << 20])
def test_unconditional_write_whose_every_answer_was_lost_is_settled(
        s3_server: S3Server, bucket: str, direct: S3KvStore, size: int) -> None:
    """Every attempt of a plain write (a PUT, or a multipart completion) landed
    but lost its answer: RetriesExhaustedError before, though the value is
    there; now the write-id read back returns its generation."""
    data = os.urandom(size)
    with FaultProxy(s3_server.endpoint, fault_rate=0.0) as proxy:
        kv = _store(s3_server, bucket, proxy, multipart_threshold=6 << 20, part_size=5 << 20,
                    retries={"max_attempts": 2, "initial_delay": 0.002, "max_delay": 0.01})
        before = [None, None, None] if size > (6 << 20) else []  # create, 2 parts
        proxy.script(before + ["lost_response", "lost_response"])
        g = kv.write("k", data).result(T)
        assert proxy.counters()["by_kind"]["lost_response"] == 2
    r = direct.read("k").result(T)
    assert r.generation == g and bytes(r.value) == data
