"""The fsspec store over fsspec's own local and in-memory filesystems."""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest

import tensorstore_py as tsp
from tensorstore_py.errors import InvalidSpecError, UnsupportedError
from tensorstore_py.kvstore.fsspec_store import FsspecKvStore
from tensorstore_py.testing.kvstore import KvStoreConformance


class TestFsspecLocalConformance(KvStoreConformance):
    supports_conditional_writes = False
    unique_generations = False
    large_value_size = 1 << 20

    @pytest.fixture
    def store(self, tmp_path: Path) -> tsp.KvStore:
        return tsp.KvStore.open({"driver": "fsspec", "url": f"file://{tmp_path}/root/"}).result()


class TestFsspecMemoryConformance(KvStoreConformance):
    supports_conditional_writes = False
    unique_generations = False
    large_value_size = 1 << 20

    @pytest.fixture
    def store(self) -> tsp.KvStore:
        root = f"memory://tsp-test-{uuid.uuid4().hex}/"
        yield tsp.KvStore.open({"driver": "fsspec", "url": root}).result()
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)


def test_data_lands_in_the_filesystem(tmp_path: Path) -> None:
    kv = tsp.KvStore.open({"driver": "fsspec", "url": f"file://{tmp_path}"}).result()
    kv.write("a/b/c", b"payload").result()
    assert (tmp_path / "a" / "b" / "c").read_bytes() == b"payload"
    (tmp_path / "x").write_bytes(b"external")
    assert bytes(kv.read("x").result().value) == b"external"
    assert kv.list().result() == ["a/b/c", "x"]
    # a directory is not a key
    assert kv.read("a").result().state == "missing"


def test_conditional_write_names_operation_and_store(tmp_path: Path) -> None:
    kv = tsp.KvStore.open({"driver": "fsspec", "url": f"file://{tmp_path}/"}).result()
    with pytest.raises(UnsupportedError) as info:
        kv.write("k", b"v", if_equal=tsp.Generation.NO_VALUE).result()
    msg = str(info.value)
    assert "create-only" in msg and "'k'" in msg and str(tmp_path) in msg
    assert not (tmp_path / "k").exists()  # nothing written


def test_generation_tracks_metadata(tmp_path: Path) -> None:
    kv = tsp.KvStore.open({"driver": "fsspec", "url": f"file://{tmp_path}/"}).result()
    g1 = kv.write("k", b"short").result()
    assert kv.read("k", if_not_equal=g1).result().state == "unchanged"
    g2 = kv.write("k", b"a longer value").result()
    assert g2 != g1
    r = kv.read("k", if_not_equal=g1).result()
    assert r.state == "value" and bytes(r.value) == b"a longer value" and r.generation == g2


def test_spec_round_trip_with_options(tmp_path: Path) -> None:
    spec = {
        "driver": "fsspec",
        "url": f"file://{tmp_path}/",
        "path": "sub",
        "storage_options": {"auto_mkdir": True},
    }
    kv = tsp.KvStore.open(spec).result()
    assert kv.spec() == {**spec, "path": "sub/"}
    kv.write("k", b"v").result()
    assert (tmp_path / "sub" / "k").read_bytes() == b"v"
    assert tsp.KvStore.open(kv.spec()).result().spec() == kv.spec()
    assert isinstance(kv, FsspecKvStore) and "storage_options" in repr(kv)


def test_other_fsspec_urls_open_through_it() -> None:
    root = f"memory://tsp-url-{uuid.uuid4().hex}/"
    # memory:// is the native memory store; an fsspec protocol it has no name for
    # opens through the fsspec driver
    assert tsp.KvStore.open(root).result().driver == "memory"
    from tensorstore_py.kvstore.registry import spec_from_url

    assert spec_from_url("az://bucket/x/") == {
        "driver": "fsspec",
        "url": "az://bucket/x/",
        "path": "",
    }


@pytest.mark.parametrize(
    "spec",
    [
        {"driver": "fsspec"},
        {"driver": "fsspec", "url": "no-protocol"},
        {"driver": "fsspec", "url": "nosuchproto://x/"},
        {"driver": "fsspec", "url": "file:///tmp/", "path": "/abs"},
        {"driver": "fsspec", "url": "file:///tmp/", "unknown": 1},
    ],
)
def test_bad_specs(spec: dict) -> None:
    with pytest.raises(InvalidSpecError):
        tsp.KvStore.open(spec).result()


def test_a_versioned_store_over_fsspec_refuses_writes_before_any_data_lands(tmp_path: Path) -> None:
    """A commit needs create-only writes: a write (large enough for a data
    object), a delete and a transaction are refused with the stores that can,
    and the folder stays empty; reading such a store still works."""
    base = tsp.KvStore.open({"driver": "fsspec", "url": f"file://{tmp_path}/"}).result()
    kv = tsp.KvStore.open({"driver": "versioned", "base": base.spec()}).result()
    for call in (lambda: kv.write("big", b"x" * (1 << 20)), lambda: kv.delete("k"),
                 lambda: kv.delete_range("p/")):
        with pytest.raises(UnsupportedError, match="versioned store .*file://"):
            call().result()
    with pytest.raises(UnsupportedError, match="versioned store transaction"):
        with tsp.Transaction() as txn:
            kv.with_transaction(txn).write("a", b"1").result()
    assert list(tmp_path.iterdir()) == []
    assert kv.list().result() == [] and kv.read("a").result().state == "missing"
