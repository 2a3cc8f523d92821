"""tsp.open and TensorStore end to end over the real zarr drivers and stores."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.errors import InvalidArgumentError, InvalidSpecError, NotFoundError

pytest.importorskip("tensorstore_py.drivers.open")


def url(p) -> str:
    return p.as_uri() + "/"


def test_create_write_read_reopen(tmp_path):
    a = tsp.open(url(tmp_path / "v"), create=True, dtype="uint16", shape=[10, 13],
                 chunks=[4, 5], dimension_names=["y", "x"], fill_value=7).result()
    assert isinstance(a, tsp.TensorStore)
    assert a.shape == (10, 13) and a.ndim == 2 and a.dtype == np.dtype("uint16")
    assert a.chunks == (4, 5) and a.shards is None and a.labels == ("y", "x")
    assert a.fill_value == 7 and a.domain.inclusive_min == (0, 0)
    np.testing.assert_array_equal(a.read().result(), np.full((10, 13), 7, np.uint16))
    data = np.arange(130, dtype=np.uint16).reshape(10, 13)
    a.write(data).result()
    a[2:9:3, ::-2].write(0).result()
    data[2:9:3, ::-2] = 0
    b = tsp.open(url(tmp_path / "v")).result()  # no driver: detected from zarr.json
    assert b.spec()["driver"] == "zarr3"
    np.testing.assert_array_equal(b.read().result(), data)
    np.testing.assert_array_equal(np.asarray(b.dims["x"][3]), data[:, 3])
    np.testing.assert_array_equal(b.T[1:4, 5].read().result(), data.T[1:4, 5])
    assert json.loads(json.dumps(a.spec()))["metadata"]["shape"] == [10, 13]
    assert "TensorStore(" in repr(a)


def test_spec_dict_create_and_view_spec_round_trip(tmp_path):
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(tmp_path / "s") + "/"},
        "metadata": {
            "shape": [6, 8], "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [3, 3]}},
            "chunk_key_encoding": {"name": "default"}, "fill_value": 0.0,
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            "dimension_names": ["r", "c"],
        },
    }
    a = tsp.open(spec, create=True).result()
    data = np.random.default_rng(0).random((6, 8)).astype(np.float32)
    a.write(data).result()
    v = a[1:5, ::-3].translate_to([10, 0])
    again = tsp.open(v.spec()).result()
    assert again.shape == v.shape and again.origin == (10, 0) and again.labels == ("r", "c")
    np.testing.assert_array_equal(again.read().result(), data[1:5, ::-3])


def test_sharded_and_zarr2(tmp_path):
    a = tsp.open(url(tmp_path / "sh"), create=True, dtype="int32", shape=[20, 30],
                 chunks=[4, 5], shards=[8, 10], compression="zstd").result()
    assert a.chunks == (4, 5) and a.shards == (8, 10)
    data = np.arange(600, dtype=np.int32).reshape(20, 30)
    a[...] = data
    np.testing.assert_array_equal(a[3:17, 4:29:3].read().result(), data[3:17, 4:29:3])
    z = tsp.open(url(tmp_path / "z2"), create=True, driver="zarr", dtype="<f8", shape=[7, 5],
                 chunks=[3, 2]).result()
    z.write(np.eye(7, 5)).result()
    z2 = tsp.open(url(tmp_path / "z2")).result()
    assert z2.spec()["driver"] == "zarr"
    np.testing.assert_array_equal(z2.read().result(), np.eye(7, 5))


def test_open_missing_and_mismatch_errors(tmp_path):
    with pytest.raises(NotFoundError):
        tsp.open(url(tmp_path / "nothing")).result()
    tsp.open(url(tmp_path / "a"), create=True, dtype="uint8", shape=[4, 4], chunks=[2, 2]).result()
    with pytest.raises(InvalidSpecError, match="shape"):
        tsp.open(url(tmp_path / "a"), shape=[5, 4]).result()
    with pytest.raises(InvalidSpecError, match="dtype"):
        tsp.open(url(tmp_path / "a"), dtype="int8").result()
    with pytest.raises(InvalidSpecError):
        tsp.open(url(tmp_path / "a"), create=True, dtype="uint8", shape=[9, 4], chunks=[2, 2]).result()
    # compatible create=True opens the existing array
    again = tsp.open(url(tmp_path / "a"), create=True, dtype="uint8", shape=[4, 4],
                     chunks=[2, 2]).result()
    assert again.shape == (4, 4)
    new = tsp.open(url(tmp_path / "a"), delete_existing=True, dtype="uint8", shape=[9, 4],
                   chunks=[2, 2]).result()
    assert new.shape == (9, 4)
    with pytest.raises(InvalidArgumentError):
        tsp.open(url(tmp_path / "b"), create=True, dtype="uint8").result()


def test_mismatched_write_writes_no_bytes(tmp_path):
    a = tsp.open(url(tmp_path / "m"), create=True, dtype="uint8", shape=[8, 8], chunks=[4, 4]).result()
    before = a.kvstore.list().result()
    with pytest.raises(ValueError):
        a[:4].write(np.ones((3, 8), np.uint8)).result()
    with pytest.raises(ValueError):
        a.write(np.ones((8, 8), np.float64)).result()
    assert a.kvstore.list().result() == before


def test_resize(tmp_path):
    a = tsp.open(url(tmp_path / "r"), create=True, dtype="int16", shape=[6, 6], chunks=[2, 2]).result()
    a.write(np.arange(36, dtype=np.int16).reshape(6, 6)).result()
    b = a.resize([3, 8]).result()
    assert b.shape == (3, 8)
    got = tsp.open(url(tmp_path / "r")).result().read().result()
    np.testing.assert_array_equal(got[:, :6], np.arange(36, dtype=np.int16).reshape(6, 6)[:3])
    assert not got[:, 6:].any()


def test_memory_url_and_await(tmp_path):
    async def main():
        a = await tsp.open("memory://arr/", create=True, dtype="float64", shape=[5], chunks=[2])
        await a.write(np.arange(5.0))
        return await a[::-1].read()

    np.testing.assert_array_equal(asyncio.run(main()), np.arange(5.0)[::-1])


def test_context_cache_pool_is_shared(tmp_path):
    ctx = tsp.Context({"cache_pool": {"total_bytes_limit": 1 << 20}})
    assert tsp.Context().cache_pool is None  # off by default
    a = tsp.open(url(tmp_path / "c"), create=True, dtype="uint8", shape=[64, 64], chunks=[16, 16],
                 context=ctx).result()
    a.write(np.arange(64 * 64, dtype=np.uint8).reshape(64, 64)).result()
    b = tsp.open(url(tmp_path / "c"), context=ctx).result()
    b[:16, :16].read().result()
    b[:16, :16].read().result()
    pool = ctx.cache_pool
    assert pool is not None and pool.hits >= 1 and pool.nbytes > 0
    assert tsp.Context(ctx.spec()).spec() == ctx.spec()
    with pytest.raises(InvalidSpecError):
        tsp.Context({"cache_pool": {"total_bytes_limit": -1}})
    spec = b.spec()
    assert spec["context"]["cache_pool"]["total_bytes_limit"] == 1 << 20


def test_with_transaction(tmp_path):
    from tensorstore_py.kvstore.transaction import Transaction

    # one chunk = one key: a plain file store can commit that atomically
    a = tsp.open(url(tmp_path / "t"), create=True, dtype="int32", shape=[4, 4], chunks=[4, 4]).result()
    a.write(1).result()
    with Transaction() as txn:
        t = a.with_transaction(txn)
        assert t.shape == a.shape
        t[1:3, 1:3].write(5).result()
        np.testing.assert_array_equal(t[1:3, 1:3].read().result(), np.full((2, 2), 5))
        assert a.read().result().sum() == 16  # invisible before the commit
    want = np.ones((4, 4), np.int32)
    want[1:3, 1:3] = 5
    np.testing.assert_array_equal(a.read().result(), want)


@pytest.fixture
def http_root(tmp_path):
    """A static HTTP server (Range, ETag) over tmp_path on 127.0.0.1, port 0."""
    import threading

    from aiohttp import web

    loop = asyncio.new_event_loop()
    box: dict = {}
    ready = threading.Event()

    async def start():
        app = web.Application()
        app.router.add_static("/", str(tmp_path))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        box["runner"], box["port"] = runner, runner.addresses[0][1]

    def run():
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    ready.wait(10)
    yield tmp_path, f"http://127.0.0.1:{box['port']}"
    asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    th.join(10)
    loop.close()


def test_read_over_http(http_root):
    root, base = http_root
    data = np.arange(24 * 20, dtype=np.uint16).reshape(24, 20)
    a = tsp.open(url(root / "vol"), create=True, dtype="uint16", shape=[24, 20], chunks=[4, 5],
                 shards=[8, 10], dimension_names=["y", "x"]).result()
    a.write(data).result()
    by_url = tsp.open(f"{base}/vol/").result()
    by_spec = tsp.open({"driver": "zarr3",
                        "kvstore": {"driver": "http", "base_url": base, "path": "/vol/"}}).result()
    for r in (by_url, by_spec):
        assert r.labels == ("y", "x") and r.shards == (8, 10)
        np.testing.assert_array_equal(r[3:17:2, ::-3].read().result(), data[3:17:2, ::-3])
        np.testing.assert_array_equal(r.dims["x"][7].read().result(), data[:, 7])
    with pytest.raises(tsp.ReadOnlyError):
        by_url[0, 0].write(1).result()


def test_large_reads_land_in_page_aligned_buffers(tmp_path):
    a = tsp.open(url(tmp_path / "al"), create=True, dtype="float32", shape=[256, 256],
                 chunks=[64, 256]).result()
    a.write(np.ones((256, 256), np.float32)).result()
    whole = a.read().result()
    assert whole.ctypes.data % 4096 == 0 and whole.flags.c_contiguous and whole.sum() == 256 * 256
    flipped = a[::-1].read().result()  # a view of an aligned box
    assert flipped.base is not None and flipped.shape == (256, 256)
