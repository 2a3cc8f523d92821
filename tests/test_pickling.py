"""Stores, views and Contexts pickle as their spec and reopen in another process.

Real processes: a ``ProcessPoolExecutor`` with the spawn start method (nothing
inherited from this process), so everything the worker uses arrives by pickle.
"""

from __future__ import annotations

import multiprocessing
import pickle
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.errors import UnsupportedError
from tensorstore_py.kvstore.memory import MemoryKvStore


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcessPoolExecutor]:
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as ex:
        yield ex


# -- run in the worker processes --------------------------------------------------------
def _read_keys(store: Any, keys: list[str]) -> list[bytes | None]:
    out = []
    for k in keys:
        r = store.read(k).result()
        out.append(bytes(r.value) if r.state == "value" else None)
    return out


def _write_key(store: Any, key: str, value: bytes) -> dict[str, Any]:
    store.write(key, value).result()
    return store.spec()


def _read_views(views: list[Any]) -> list[np.ndarray]:
    return [v.read().result() for v in views]


def _context_report(a: Any, b: Any) -> tuple[bool, bool, int, dict[str, Any]]:
    """Whether two unpickled views share one Context and one opened array, and its settings."""
    ctx = a._context
    return (ctx is b._context, a.driver is b.driver, ctx.cache_pool_bytes, ctx.spec())


def _write_view(view: Any, value: np.ndarray) -> None:
    view.write(value).result()


# -- stores -----------------------------------------------------------------------------------
def test_stores_reopen_in_a_spawned_process(pool: ProcessPoolExecutor, tmp_path: Path) -> None:
    file_kv = tsp.KvStore.open(f"file://{tmp_path}/plain/").result()
    file_kv.write("a/k", b"file value").result()
    live = tsp.KvStore.open(f"versioned+file://{tmp_path}/v/").result()
    live.write("k", b"one").result()
    live.write("k", b"two").result()
    pinned = live.snapshot(1)
    tagged = live.snapshot("first")
    live.tag("first", 1).result()
    tagged.read("k").result()  # resolves the tag here: it travels as version 1
    live.tag("first", 2).result()  # the receiver still reads what this process resolved
    fault = tsp.KvStore.open({"driver": "fault", "base": f"file://{tmp_path}/plain/", "seed": 5,
                              "latency": [0.0, 0.001]}).result()

    assert pool.submit(_read_keys, file_kv.with_path("a"), ["k", "missing"]).result(60) == [
        b"file value", None]
    assert pool.submit(_read_keys, live, ["k"]).result(60) == [b"two"]
    assert pool.submit(_read_keys, pinned, ["k"]).result(60) == [b"one"]
    assert pool.submit(_read_keys, tagged, ["k"]).result(60) == [b"one"]
    assert pool.submit(_read_keys, fault, ["a/k"]).result(60) == [b"file value"]
    # writes from the other process land in the same place
    spec = pool.submit(_write_key, live, "from-worker", b"w").result(60)
    assert spec == live.spec()
    assert bytes(live.read("from-worker").result().value) == b"w"
    assert pool.submit(_write_key, file_kv, "w", b"x").result(60) == file_kv.spec()
    assert bytes(file_kv.read("w").result().value) == b"x"


def test_named_memory_store_reopens_that_name_in_the_receiver() -> None:
    kv = tsp.KvStore.open({"driver": "memory", "name": "pickle-named", "path": "p/"}).result()
    kv.write("k", b"v").result()
    again = pickle.loads(pickle.dumps(kv))
    assert again == kv and bytes(again.read("k").result().value) == b"v"


def test_stores_that_can_not_travel_refuse_at_pickling_time(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match="memory store without a name"):
        pickle.dumps(MemoryKvStore())
    fault = tsp.KvStore.open({"driver": "fault", "base": "memory://"}).result()
    with pytest.raises(UnsupportedError, match="memory store without a name"):
        pickle.dumps(fault)
    kv = tsp.KvStore.open(f"versioned+file://{tmp_path}/").result()
    with pytest.raises(UnsupportedError, match="bound to a transaction"):
        pickle.dumps(kv.with_transaction(tsp.Transaction()))


# -- views -------------------------------------------------------------------------------------
def _array(tmp_path: Path, url: str, **kw: Any) -> tuple[Any, np.ndarray]:
    data = np.arange(20 * 30, dtype="int32").reshape(20, 30)
    ts = tsp.open(url, create=True, shape=data.shape, dtype=data.dtype, chunks=(6, 7), **kw).result()
    ts.write(data).result()
    return ts, data


def test_views_reopen_with_their_transform(pool: ProcessPoolExecutor, tmp_path: Path) -> None:
    ts, data = _array(tmp_path, f"file://{tmp_path}/arr/")
    views = [ts, ts[3:17:2, ::-3], ts.T[5], ts.translate_to((100, 200)).at[105:110, 210:], ts[None, 4]]
    got = pool.submit(_read_views, views).result(60)
    for v, g in zip(views, got):
        np.testing.assert_array_equal(g, v.read().result())
    np.testing.assert_array_equal(got[1], data[3:17:2, ::-3])
    # a sub-box at the origin is not the whole array: its spec says so (it used not to)
    assert tsp.open(ts[0:6, 0:7].spec()).result().shape == (6, 7)
    # a view written from another process
    pool.submit(_write_view, ts[0:6, 0:7], np.full((6, 7), -1, "int32")).result(60)
    assert (ts[0:6, 0:7].read().result() == -1).all()


def test_view_of_a_versioned_snapshot_reads_its_version(pool: ProcessPoolExecutor, tmp_path: Path) -> None:
    ts, data = _array(tmp_path, f"versioned+file://{tmp_path}/v/")
    kv = ts.kvstore
    version = kv.newest_version().result()
    snap = tsp.open({"driver": "zarr3", "kvstore": kv.snapshot(version)}).result()
    ts.write(np.zeros_like(data)).result()  # a newer version changes everything
    got = pool.submit(_read_views, [snap, snap[2:5], ts]).result(60)
    np.testing.assert_array_equal(got[0], data)
    np.testing.assert_array_equal(got[1], data[2:5])
    assert (got[2] == 0).all()


def test_context_resources_are_per_process(pool: ProcessPoolExecutor, tmp_path: Path) -> None:
    ctx = tsp.Context({"cache_pool": {"total_bytes_limit": 1 << 20}, "bytes_in_flight": {"limit": 1 << 22}})
    ts = tsp.open(f"file://{tmp_path}/arr/", create=True, shape=(8,), dtype="uint8", context=ctx).result()
    same, one_array, limit, spec = pool.submit(_context_report, ts, ts[2:]).result(60)
    assert same and one_array and limit == 1 << 20 and spec == ctx.spec()
    # in this process the Context is the original one, pool and all
    a, b = pickle.loads(pickle.dumps((ts, ts[1:])))
    assert a._context is ctx and b._context is ctx
    plain = tsp.open(f"file://{tmp_path}/arr/").result()
    assert pickle.loads(pickle.dumps(plain))._context in (None, tsp.context.default_context())


def test_views_that_can_not_travel_refuse_at_pickling_time(tmp_path: Path) -> None:
    mem = tsp.open("memory://", create=True, shape=(4,), dtype="uint8").result()
    with pytest.raises(UnsupportedError, match="memory store without a name"):
        pickle.dumps(mem[1:])
    ts, _ = _array(tmp_path, f"versioned+file://{tmp_path}/v/")
    with pytest.raises(UnsupportedError, match="bound to a transaction"):
        pickle.dumps(ts.with_transaction(tsp.Transaction())[0])
