"""The memory store against the kvstore conformance suite, plus its own rules."""

from __future__ import annotations

import pytest

import tensorstore_py as tsp
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.testing.kvstore import KvStoreConformance


class TestMemoryConformance(KvStoreConformance):
    picklable = False  # a memory store without a name lives in one process

    @pytest.fixture
    def store(self) -> MemoryKvStore:
        return MemoryKvStore()


def test_instances_do_not_share_data() -> None:
    a, b = MemoryKvStore(), MemoryKvStore()
    a.write("k", b"a").result()
    assert b.read("k").result().state == "missing"
    assert a.spec()["name"] != b.spec()["name"]


def test_named_store_shared_by_spec() -> None:
    a = tsp.KvStore.open({"driver": "memory", "name": "shared-test", "path": ""}).result()
    b = tsp.KvStore.open({"driver": "memory", "name": "shared-test", "path": ""}).result()
    a.write("k", b"shared").result()
    assert bytes(b.read("k").result().value) == b"shared"
    assert a == b and hash(a) == hash(b)


def test_url_forms() -> None:
    kv = tsp.KvStore.open("memory://").result()
    assert isinstance(kv, MemoryKvStore) and kv.path == ""
    sub = tsp.KvStore.open("memory://x/y/").result()
    assert sub.path == "x/y/"
    assert sub.url() == "memory://x/y/"
    # two URL opens are two fresh stores
    kv.write("k", b"1").result()
    assert tsp.KvStore.open("memory://").result().read("k").result().state == "missing"


def test_stored_value_is_a_copy() -> None:
    kv = MemoryKvStore()
    buf = bytearray(b"abc")
    kv.write("k", buf).result()
    buf[0] = ord("z")
    assert bytes(kv.read("k").result().value) == b"abc"


def test_a_frozen_store_pickles_with_its_contents_and_refuses_writes() -> None:
    import pickle


    kv = MemoryKvStore.frozen({"a/b": b"xyz", "c": bytearray(b"12")})
    back = pickle.loads(pickle.dumps(kv))
    assert back.list().result() == ["a/b", "c"]
    assert bytes(back.read("a/b").result().value) == b"xyz" and bytes(back.read("c").result().value) == b"12"
    assert pickle.loads(pickle.dumps(kv.with_path("a/"))).list().result() == ["b"]
    for store in (kv, back):
        with pytest.raises(tsp.errors.TensorStoreError):
            store.write("c", b"new").result()
        assert bytes(store.read("c").result().value) == b"12"
