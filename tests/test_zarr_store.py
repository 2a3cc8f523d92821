"""``tsp.zarr_store``: zarr-python's own Store conformance tests, then zarr-python,
xarray and TensorStore reading what goes through it (pinned versions, commits)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
xarray = pytest.importorskip("xarray")

from zarr.core.buffer import Buffer, cpu, default_buffer_prototype
from zarr.core.sync import sync
from zarr.testing.store import StoreTests

import tensorstore_py as tsp
from tensorstore_py.errors import UnsupportedError
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.zarr_store import TspZarrStore


class _Conformance(StoreTests[TspZarrStore, cpu.Buffer]):
    store_cls = TspZarrStore
    buffer_cls = cpu.Buffer

    @pytest.fixture
    def store(self, open_kwargs: dict[str, Any]) -> TspZarrStore:
        return sync(self.store_cls.open(**open_kwargs))

    @pytest.fixture
    def store_not_open(self, store_kwargs: dict[str, Any]) -> TspZarrStore:
        return self.store_cls(**store_kwargs)

    # reads and writes that bypass the Store's methods: the kvstore it wraps
    async def set(self, store: TspZarrStore, key: str, value: Buffer) -> None:
        await store._view(write=True).write(key, value.to_bytes())

    async def get(self, store: TspZarrStore, key: str) -> Buffer:
        res = await store._view(write=False).read(key)
        assert res.state == "value"
        return self.buffer_cls.from_bytes(bytes(res.value))

    def test_store_repr(self, store: TspZarrStore) -> None:
        assert repr(store).startswith("TspZarrStore(") and store.kvstore.driver in repr(store)

    def test_store_supports_writes(self, store: TspZarrStore) -> None:
        assert store.supports_writes

    def test_store_supports_listing(self, store: TspZarrStore) -> None:
        assert store.supports_listing


class TestOverFile(_Conformance):
    @pytest.fixture
    def store_kwargs(self, tmp_path: Path) -> dict[str, Any]:
        return {"kvstore": tsp.KvStore.open(f"file://{tmp_path}/z/").result(), "read_only": False}


class TestOverLiveVersionedStore(_Conformance):
    """Writes go into the store's transaction: its reads see them before any commit."""

    @pytest.fixture
    def store_kwargs(self, tmp_path: Path) -> dict[str, Any]:
        kv = tsp.KvStore.open(f"versioned+file://{tmp_path}/v/").result()
        return {"kvstore": kv.with_path("root"), "read_only": False}


# -- the ecosystem through it ----------------------------------------------------------------------
def _versions(url: str) -> int:
    kv: Any = tsp.KvStore.open(url).result()
    return kv.newest_version().result()


def test_zarr_writes_commit_as_one_version_and_pins_read_it(tmp_path: Path) -> None:
    url = f"versioned+file://{tmp_path}/run/"
    data = np.arange(12 * 10, dtype="float32").reshape(12, 10)
    zs = tsp.zarr_store(url, path="ds")
    arr = zarr.create_array(store=zs, name="x", shape=data.shape, chunks=(5, 4), dtype="float32",
                            fill_value=0.0)
    arr[:] = data
    assert _versions(url) == 0  # nothing visible before the commit
    info = zs.commit().result()
    assert info.version == 1 and _versions(url) == 1
    # a later change is a second version; the pin still reads the first
    with tsp.zarr_store(url, path="ds") as zs2:
        zarr.open_array(store=zs2, path="x")[0, :] = -1
    assert _versions(url) == 2
    pinned = tsp.zarr_store(f"{url}@1", path="ds")
    assert pinned.read_only
    np.testing.assert_array_equal(zarr.open_array(store=pinned, path="x", mode="r")[:], data)
    newest = zarr.open_array(store=tsp.zarr_store(url, path="ds", read_only=True), path="x", mode="r")[:]
    assert (newest[0] == -1).all() and (newest[1:] == data[1:]).all()
    with pytest.raises(ValueError, match="read-only"):
        zarr.open_array(store=pinned, path="x", mode="r+")[0, 0] = 5
    # TensorStore-compatible layout: tsp's own zarr3 driver reads the same array at version 1
    ts = tsp.open({"driver": "zarr3", "kvstore": {"driver": "versioned", "base": f"file://{tmp_path}/run/",
                                                  "version": 1, "path": "ds/x"}}).result()
    np.testing.assert_array_equal(ts.read().result(), data)


def test_an_exception_in_the_with_block_commits_nothing(tmp_path: Path) -> None:
    url = f"versioned+file://{tmp_path}/run/"
    with pytest.raises(RuntimeError, match="boom"):
        with tsp.zarr_store(url) as zs:
            zarr.create_array(store=zs, name="x", shape=(4,), dtype="int8")[:] = 1
            raise RuntimeError("boom")
    assert _versions(url) == 0


def test_xarray_reads_a_pinned_version(tmp_path: Path) -> None:
    url = f"versioned+file://{tmp_path}/run/"
    temp = np.linspace(0, 1, 6 * 4, dtype="float64").reshape(6, 4)
    ds = xarray.Dataset({"temp": (("time", "x"), temp)},
                        coords={"time": np.arange(6), "x": [10, 20, 30, 40]}, attrs={"title": "t"})
    with tsp.zarr_store(url, path="climate") as zs:
        ds.to_zarr(zs, zarr_format=3, consolidated=False)
    version = _versions(url)
    assert version == 1
    with tsp.zarr_store(url) as zs:  # a second version rewrites the data
        zarr.open_array(store=zs, path="climate/temp")[:] = 0.0
    back = xarray.open_zarr(tsp.zarr_store(f"{url}@{version}", path="climate"), consolidated=False)
    xarray.testing.assert_identical(back.load(), ds)
    assert back.attrs == {"title": "t"}


def test_byte_ranges_and_partial_values(tmp_path: Path) -> None:
    kv = tsp.KvStore.open(f"versioned+file://{tmp_path}/v/").result()
    kv.write("a/b", bytes(range(100))).result()
    zs = tsp.zarr_store(kv.snapshot(1))
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

    got = sync(zs.get_partial_values(default_buffer_prototype(), [
        ("a/b", RangeByteRequest(10, 20)), ("a/b", OffsetByteRequest(95)),
        ("a/b", SuffixByteRequest(3)), ("missing", None), ("a/b", None)]))
    assert [None if g is None else g.to_bytes() for g in got] == [
        bytes(range(10, 20)), bytes(range(95, 100)), bytes(range(97, 100)), None, bytes(range(100))]
    assert sync(zs.exists("a/b")) and not sync(zs.exists("a"))
    assert sync(zs.getsize("a/b")) == 100


def test_a_store_with_a_transaction_does_not_pickle(tmp_path: Path) -> None:
    url = f"versioned+file://{tmp_path}/run/"
    zs = tsp.zarr_store(url)
    assert pickle.loads(pickle.dumps(zs)) == zs  # nothing written yet: it travels
    sync(zs.set("k", cpu.Buffer.from_bytes(b"v")))
    with pytest.raises(UnsupportedError, match="transaction"):
        pickle.dumps(zs)
    zs.commit().result()
    again = pickle.loads(pickle.dumps(zs))
    assert sync(again.get("k")).to_bytes() == b"v"
    pinned = tsp.zarr_store(f"{url}@1")
    assert pickle.loads(pickle.dumps(pinned)).read_only
    mem: KvStore = tsp.KvStore.open("memory://").result()
    with pytest.raises(UnsupportedError, match="memory store without a name"):
        pickle.dumps(tsp.zarr_store(mem))
