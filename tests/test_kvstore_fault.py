"""The fault-injection wrapper store: conformance when quiet, exact faults when asked."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import tensorstore_py as tsp
from tensorstore_py.errors import ConditionFailedError, InvalidSpecError, StorageError
from tensorstore_py.kvstore.fault import FaultKvStore, FaultRule
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.testing.kvstore import KvStoreConformance


class TestFaultOverMemoryConformance(KvStoreConformance):
    """With no faults configured the wrapper is transparent."""

    picklable = False  # its base is a memory store without a name

    @pytest.fixture
    def store(self) -> FaultKvStore:
        return FaultKvStore(MemoryKvStore(), seed=1, latency=(0.0, 0.0005))


class TestFaultOverFileConformance(KvStoreConformance):
    race_increments = 10

    @pytest.fixture
    def store(self, tmp_path: Path) -> FaultKvStore:
        return FaultKvStore(FileKvStore(path=str(tmp_path), sync=False))


def _outcomes(kv: FaultKvStore, n: int) -> list[str]:
    out = []
    for i in range(n):
        try:
            kv.write(f"k{i % 7}", b"v").result()
            out.append("ok")
        except StorageError:
            out.append("err")
    return out


def test_seeded_schedule_is_reproducible() -> None:
    a = _outcomes(FaultKvStore(MemoryKvStore(), seed=42, error_rate=0.3), 200)
    b = _outcomes(FaultKvStore(MemoryKvStore(), seed=42, error_rate=0.3), 200)
    c = _outcomes(FaultKvStore(MemoryKvStore(), seed=43, error_rate=0.3), 200)
    assert a == b
    assert a != c
    assert 30 < a.count("err") < 90  # about 30 %


def test_random_errors_happen_before_the_effect() -> None:
    base = MemoryKvStore()
    kv = FaultKvStore(base, seed=3, error_rate=0.5, fail_ops=["write"])
    for i in range(100):
        try:
            kv.write(f"k{i}", b"v").result()
        except StorageError:
            assert base.read(f"k{i}").result().state == "missing"
        else:
            assert bytes(base.read(f"k{i}").result().value) == b"v"
    assert kv.calls["write"] == 100
    assert 20 < kv.faults["write"] < 80
    assert all(e.kind == "error" and e.op == "write" for e in kv.events)
    # reads were not in fail_ops
    for i in range(100):
        kv.read(f"k{i}").result()
    assert kv.faults["read"] == 0 and kv.calls["read"] == 100


def test_short_reads_truncate_the_value() -> None:
    base = MemoryKvStore()
    data = bytes(range(256)) * 4
    base.write("k", data).result()
    kv = FaultKvStore(base, seed=5, short_read_rate=0.5)
    lengths = [len(kv.read("k").result().value) for _ in range(60)]
    short = [n for n in lengths if n < len(data)]
    assert 10 < len(short) < 50
    assert kv.faults["read"] == len(short)
    # a short read is a prefix of the real value, reported with the real generation
    kv2 = FaultKvStore(base, seed=5, short_read_rate=1.0)
    r = kv2.read("k").result()
    assert len(r.value) < len(data) and data.startswith(bytes(r.value))
    assert r.generation == base.read("k").result().generation


def test_latency_is_applied() -> None:
    kv = FaultKvStore(MemoryKvStore(), latency=0.05)
    t0 = time.perf_counter()
    kv.write("k", b"v").result()
    kv.read("k").result()
    assert time.perf_counter() - t0 >= 0.1


def test_fail_nth_call_of_op() -> None:
    base = MemoryKvStore()
    kv = FaultKvStore(base)
    kv.inject(op="write", nth=3, times=2)
    results = []
    for i in range(6):
        try:
            kv.write(f"k{i}", b"v").result()
            results.append(True)
        except StorageError as e:
            assert "write #1" in str(e) and f"k{i}" in str(e)
            results.append(False)
    assert results == [True, True, False, False, True, True]
    assert base.list().result() == ["k0", "k1", "k4", "k5"]
    assert kv.calls["write"] == 6 and kv.faults["write"] == 2


def test_key_pattern_and_custom_error() -> None:
    kv = FaultKvStore(MemoryKvStore())
    kv.inject(op="read", key_pattern="data/*", error=ConditionFailedError)
    kv.write("data/a/b", b"1").result()
    kv.write("meta", b"2").result()
    with pytest.raises(ConditionFailedError, match="injected"):
        kv.read("data/a/b").result()
    assert bytes(kv.read("meta").result().value) == b"2"
    kv.clear()
    assert bytes(kv.read("data/a/b").result().value) == b"1"


def test_after_effect_is_a_lost_response() -> None:
    """The write lands, but the caller sees an error (the lost-response case)."""
    base = MemoryKvStore()
    kv = FaultKvStore(base)
    kv.inject(op="write", key_pattern="commits/*", after_effect=True, times=1)
    with pytest.raises(StorageError, match="after it took effect"):
        kv.write("commits/0001", b"commit", if_equal=tsp.Generation.NO_VALUE).result()
    assert bytes(base.read("commits/0001").result().value) == b"commit"
    # a retry of the create-only write now loses against its own landed write
    with pytest.raises(ConditionFailedError):
        kv.write("commits/0001", b"commit", if_equal=tsp.Generation.NO_VALUE).result()
    assert [e.kind for e in kv.events] == ["error_after_effect"]


def test_after_effect_delete_and_delete_range() -> None:
    base = MemoryKvStore()
    for k in ("a/1", "a/2", "b"):
        base.write(k, b"x").result()
    kv = FaultKvStore(
        base,
        schedule=[
            FaultRule(op="delete", after_effect=True),
            FaultRule(op="delete_range", after_effect=True),
        ],
    )
    with pytest.raises(StorageError):
        kv.delete("b").result()
    with pytest.raises(StorageError):
        kv.delete_range("a/").result()
    assert base.list().result() == []


def test_latency_only_rule() -> None:
    kv = FaultKvStore(MemoryKvStore())
    kv.inject(op="write", key_pattern="slow", error=None, latency=0.1)
    t0 = time.perf_counter()
    kv.write("slow", b"v").result()
    assert time.perf_counter() - t0 >= 0.1
    assert kv.events[0].kind == "latency"


def test_views_share_counters_and_rules() -> None:
    kv = FaultKvStore(MemoryKvStore())
    sub = kv.with_path("sub")
    kv.inject(op="write", key_pattern="sub/x")
    with pytest.raises(StorageError):
        sub.write("x", b"v").result()
    sub.write("y", b"v").result()
    assert kv.calls["write"] == 2 and kv.faults["write"] == 1
    assert kv.list().result() == ["sub/y"]


def test_spec_round_trip_with_nested_base(tmp_path: Path) -> None:
    spec = {
        "driver": "fault",
        "base": {"driver": "file", "path": f"{tmp_path}/"},
        "seed": 9,
        "error_rate": 0.25,
        "latency": [0.0, 0.001],
        "short_read_rate": 0.0,
        "fail_ops": ["write"],
        "schedule": [{"op": "read", "key_pattern": "x/*", "nth": 2, "error": "ChecksumError"}],
        "path": "",
    }
    kv = tsp.KvStore.open(json.loads(json.dumps(spec))).result()
    assert isinstance(kv, FaultKvStore) and isinstance(kv.base, FileKvStore)
    assert kv.spec() == spec
    assert tsp.KvStore.open(kv.spec()).result().spec() == spec
    kv.base.write("x/1", b"data").result()
    assert bytes(kv.read("x/1").result().value) == b"data"
    with pytest.raises(tsp.ChecksumError):
        kv.read("x/1").result()
    url = tsp.KvStore.open(f"fault+file://{tmp_path}/").result()
    assert url.spec()["base"] == {"driver": "file", "path": f"{tmp_path}/"}


@pytest.mark.parametrize(
    "spec",
    [
        {"driver": "fault"},
        {"driver": "fault", "base": {"driver": "memory"}, "error_rate": 2},
        {"driver": "fault", "base": {"driver": "memory"}, "fail_ops": ["explode"]},
        {"driver": "fault", "base": {"driver": "memory"}, "schedule": [{"error": "NoSuchError"}]},
        {"driver": "fault", "base": {"driver": "memory"}, "schedule": [{"nth": 0}]},
        {"driver": "fault", "base": {"driver": "memory"}, "bogus": True},
    ],
)
def test_bad_specs(spec: dict) -> None:
    with pytest.raises(InvalidSpecError):
        tsp.KvStore.open(spec).result()
