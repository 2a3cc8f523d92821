"""The ``n5`` array driver (drivers/n5/driver.py) through ``tsp.open``: interop
with TensorStore's n5 driver both ways for every compression it supports and
every data type, odd shapes whose edge blocks we write clipped as N5-Java does,
the N5-Java golden blocks read through the driver, attributes.json members kept,
and the stores it runs on (file, memory, http).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

import tensorstore_py as tsp
from tensorstore_py.core.errors import (
    DataCorruptionError,
    InvalidArgumentError,
    InvalidSpecError,
    NotFoundError,
)
from tensorstore_py.drivers.n5 import ATTRIBUTES_KEY, N5Metadata, block_shape, decode_header

ts = pytest.importorskip("tensorstore")

from test_n5_format import (
    CASES,
    DTYPE_NAMES,
    JAVA,
    JAVA_BLOCK,
    JAVA_DIMS,
    JAVA_FILES,
    case_id,
    java_values,
    region,
    sample,
)

SHAPE, BLOCK = (13, 7, 5), (4, 3, 2)  # every dimension has a clipped edge block


def url(p: Path) -> str:
    return p.as_uri() + "/"


def ts_open(p: Path, **kw) -> ts.TensorStore:
    return ts.open({"driver": "n5", "kvstore": {"driver": "file", "path": str(p) + "/"}}, **kw).result()


def tsp_create(p: Path, dtype: str, compression, shape=SHAPE, block=BLOCK, **kw) -> tsp.TensorStore:
    return tsp.open(url(p), driver="n5", create=True, dtype=dtype, shape=shape, chunks=block,
                    compression=compression, **kw).result()


# -- interop with TensorStore -------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tensorstore_writes_we_read(tmp_path: Path, case) -> None:
    comp, dtype = case
    data = sample(dtype)
    t = ts.open({"driver": "n5", "kvstore": {"driver": "file", "path": str(tmp_path) + "/"},
                 "metadata": {"dimensions": list(SHAPE), "blockSize": list(BLOCK), "dataType": dtype,
                              "compression": comp}}, create=True).result()
    t.write(data).result()
    a = tsp.open(url(tmp_path)).result()  # detected as N5
    assert a.driver.driver == "n5" and a.dtype == np.dtype(dtype) and a.shape == SHAPE
    assert np.array_equal(a.read().result(), data)
    assert np.array_equal(a[3:11, 2:, 1:4].read().result(), data[3:11, 2:, 1:4])
    assert np.array_equal(a[::-2, 1, ::3].read().result(), data[::-2, 1, ::3])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_we_write_tensorstore_reads(tmp_path: Path, case) -> None:
    comp, dtype = case
    data = sample(dtype, seed=1)
    a = tsp_create(tmp_path, dtype, comp)
    a.write(data).result()
    assert json.loads((tmp_path / ATTRIBUTES_KEY).read_text())["compression"] == comp
    assert np.array_equal(ts_open(tmp_path).read().result(), data)
    # partial writes are read-modify-writes of stored blocks, edge blocks included
    a[5:13, 1:6, 4].write(data[:8, :5, 0]).result()
    expected = data.copy()
    expected[5:13, 1:6, 4] = data[:8, :5, 0]
    assert np.array_equal(ts_open(tmp_path).read().result(), expected)
    assert np.array_equal(a.read().result(), expected)


def test_edge_blocks_are_written_as_n5_java_writes_them(tmp_path: Path) -> None:
    a = tsp_create(tmp_path, "int16", "raw")
    a.write(sample("int16")).result()
    meta = N5Metadata.from_bytes((tmp_path / ATTRIBUTES_KEY).read_bytes())
    for g in [(0, 0, 0), (3, 0, 0), (3, 2, 2), (1, 2, 0)]:
        data = (tmp_path / "/".join(map(str, g))).read_bytes()
        header = decode_header(data)
        assert header.shape == block_shape(meta, g)  # clipped to the array
        assert len(data) == header.size + 2 * int(np.prod(header.shape))


def test_tensorstores_padded_edge_blocks_read_and_rewrite(tmp_path: Path) -> None:
    data = sample("uint32")
    t = ts_open(tmp_path, create=True, dtype="uint32", shape=list(SHAPE),
                chunk_layout=ts.ChunkLayout(chunk_shape=list(BLOCK)))
    t.write(data).result()
    assert decode_header((tmp_path / "3/2/2").read_bytes()).shape == BLOCK  # TensorStore pads
    a = tsp.open(url(tmp_path)).result()
    assert np.array_equal(a.read().result(), data)
    a[12, 6, 4].write(7).result()  # a read-modify-write of a padded edge block
    data[12, 6, 4] = 7
    assert decode_header((tmp_path / "3/2/2").read_bytes()).shape == (1, 1, 1)
    assert np.array_equal(ts_open(tmp_path).read().result(), data)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_every_data_type_both_ways(tmp_path: Path, dtype: str) -> None:
    data = sample(dtype, (9, 4), seed=3)
    tsp_create(tmp_path / "ours", dtype, "gzip", shape=(9, 4), block=(2, 3)).write(data).result()
    assert np.array_equal(ts_open(tmp_path / "ours").read().result(), data)
    t = ts_open(tmp_path / "theirs", create=True, dtype=dtype, shape=[9, 4],
                chunk_layout=ts.ChunkLayout(chunk_shape=[2, 3]))
    t.write(data).result()
    assert np.array_equal(tsp.open(url(tmp_path / "theirs")).result().read().result(), data)


def test_rank_zero_and_empty(tmp_path: Path) -> None:
    a = tsp.open(url(tmp_path / "s"), driver="n5", create=True, dtype="float64", shape=[]).result()
    a.write(2.5).result()
    assert ts_open(tmp_path / "s").read().result()[()] == 2.5
    e = tsp.open(url(tmp_path / "e"), driver="n5", create=True, dtype="uint8", shape=[0, 5]).result()
    assert e.read().result().shape == (0, 5)
    assert ts_open(tmp_path / "e").shape == (0, 5)


def test_axes_are_dimension_names(tmp_path: Path) -> None:
    a = tsp_create(tmp_path, "uint8", None, dimension_names=["x", "y", "z"])
    assert a.labels == ("x", "y", "z")
    assert ts_open(tmp_path).domain.labels == ("x", "y", "z")
    assert tsp.open(url(tmp_path)).result().dims["y"][2].shape == (13, 5)


# -- defaults and compression= ------------------------------------------------------------
def test_default_compression_is_tensorstores(tmp_path: Path) -> None:
    for dtype in ("uint8", "float32"):
        tsp_create(tmp_path / f"ours-{dtype}", dtype, None)
        ts_open(tmp_path / f"ts-{dtype}", create=True, dtype=dtype, shape=list(SHAPE))
        ours, theirs = (json.loads((tmp_path / f"{w}-{dtype}" / ATTRIBUTES_KEY).read_text())["compression"]
                        for w in ("ours", "ts"))
        assert ours == theirs


@pytest.mark.parametrize("alias, expected", [
    ("raw", {"type": "raw"}),
    ("zstd", {"type": "zstd", "level": 1}),
    (("zstd", 7), {"type": "zstd", "level": 7}),
    ("gzip", {"type": "gzip", "level": 5, "useZlib": False}),
    ("blosc", {"type": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1, "blocksize": 0}),
    (("bzip2", 3), {"type": "bzip2", "blockSize": 3}),
    (("xz", 9), {"type": "xz", "preset": 9}),
    ("lz4", {"type": "lz4", "blockSize": 65536}),
    ({"type": "gzip", "useZlib": True}, {"type": "gzip", "level": -1, "useZlib": True}),
])
def test_compression_aliases(tmp_path: Path, alias, expected) -> None:
    data = sample("int32")
    a = tsp_create(tmp_path, "int32", alias)
    a.write(data).result()
    assert json.loads((tmp_path / ATTRIBUTES_KEY).read_text())["compression"] == expected
    assert np.array_equal(tsp.open(url(tmp_path)).result().read().result(), data)
    if expected["type"] != "lz4":  # TensorStore has no lz4
        assert np.array_equal(ts_open(tmp_path).read().result(), data)


def test_bad_options_are_refused_before_writing(tmp_path: Path) -> None:
    for kw, match in [({"compression": "nonesuch"}, "compression"), ({"shards": [8, 6, 4]}, "sharding"),
                      ({"fill_value": 3}, "fill value"), ({"order": "F"}, "order"),
                      ({"compression": ("lz4", 3)}, "level")]:
        with pytest.raises(InvalidArgumentError, match=match):
            tsp_create(tmp_path, "int32", **{"compression": None, **kw})
        assert not tmp_path.exists() or not any(tmp_path.iterdir())
    with pytest.raises(NotFoundError, match="n5"):
        tsp.open({"driver": "n5", "kvstore": url(tmp_path)}).result()


# -- attributes.json ----------------------------------------------------------------------
def test_other_attributes_survive_create_resize_and_updates(tmp_path: Path) -> None:
    # a group's attributes.json is there first (N5-Java's root: the version)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / ATTRIBUTES_KEY).write_text(json.dumps({"n5": "4.0.0", "pixelResolution": [4, 4, 40]}))
    a = tsp_create(tmp_path, "uint16", "raw")
    doc = json.loads((tmp_path / ATTRIBUTES_KEY).read_text())
    assert doc["n5"] == "4.0.0" and doc["pixelResolution"] == [4, 4, 40] and doc["dimensions"] == list(SHAPE)
    assert a.attributes == {"n5": "4.0.0", "pixelResolution": [4, 4, 40]}
    a.write(sample("uint16")).result()
    b = a.resize([20, 7, 3]).result()
    assert b.shape == (20, 7, 3)
    assert not (tmp_path / "0/0/2").exists()  # wholly outside: deleted
    b.update_attributes({"scale": 2}).result()
    doc = json.loads((tmp_path / ATTRIBUTES_KEY).read_text())
    assert doc["dimensions"] == [20, 7, 3] and doc["n5"] == "4.0.0" and doc["scale"] == 2
    assert tsp.open(url(tmp_path)).result().attributes == {"n5": "4.0.0", "pixelResolution": [4, 4, 40],
                                                          "scale": 2}
    assert ts_open(tmp_path).shape == (20, 7, 3)
    with pytest.raises(InvalidArgumentError, match="dataset fields"):
        b.update_attributes({"blockSize": [1, 1, 1]}).result()
    with pytest.raises(InvalidSpecError, match="units"):
        b.update_attributes({"units": ["nm"]}).result()  # one per dimension
    assert json.loads((tmp_path / ATTRIBUTES_KEY).read_text()) == doc


def test_spec_round_trips_without_user_attributes(tmp_path: Path) -> None:
    a = tsp_create(tmp_path, "uint8", "gzip")
    a.update_attributes({"note": "x"}).result()
    spec = a.spec()
    assert "note" not in spec["metadata"] and spec["driver"] == "n5"
    a.update_attributes({"note": "y"}).result()
    assert tsp.open(spec).result().shape == SHAPE
    with pytest.raises(InvalidSpecError, match="dataType"):
        tsp.open({**spec, "metadata": {**spec["metadata"], "dataType": "int8"}}).result()


# -- N5-Java's blocks, through the driver -------------------------------------------------
@pytest.mark.parametrize("name", list(JAVA_FILES))
def test_n5_java_dataset_reads(tmp_path: Path, name: str) -> None:
    meta = N5Metadata.create(JAVA_DIMS, JAVA_BLOCK, "int32", compression=JAVA_FILES[name])
    (tmp_path / ATTRIBUTES_KEY).write_bytes(meta.encode())
    for g in [(0, 0), (1, 2)]:
        (tmp_path / str(g[0])).mkdir(exist_ok=True)
        shutil.copy(JAVA / f"{name}.{g[0]}.{g[1]}", tmp_path / str(g[0]) / str(g[1]))
    a = tsp.open(url(tmp_path)).result()
    expected = np.zeros(JAVA_DIMS, np.int32)
    for g in [(0, 0), (1, 2)]:
        expected[region(meta, g)] = java_values()[region(meta, g)]
    assert np.array_equal(a.read().result(), expected)
    assert np.array_equal(a[60:70, 7:9].read().result(), expected[60:70, 7:9])


# -- stores ---------------------------------------------------------------------------------
def test_memory_store() -> None:
    a = tsp.open("memory://n5/", driver="n5", create=True, dtype="float32", shape=SHAPE, chunks=BLOCK,
                 compression="zstd").result()
    data = sample("float32")
    a.write(data).result()
    assert np.array_equal(a[::2].read().result(), data[::2])


def test_versioned_store_transaction(tmp_path: Path) -> None:
    a = tsp.open({"driver": "n5", "kvstore": {"driver": "versioned", "base": url(tmp_path)}}, create=True,
                 dtype="float32", shape=SHAPE, chunks=BLOCK, compression="zstd").result()
    data = sample("float32")
    with tsp.Transaction() as txn:
        a.with_transaction(txn).write(data).result()
        assert np.array_equal(a.read().result(), np.zeros(SHAPE, np.float32))  # not yet visible
    assert np.array_equal(a.read().result(), data)


def test_http_reads(tmp_path: Path, serve_app: Callable) -> None:
    data = sample("uint16")
    ts.open({"driver": "n5", "kvstore": {"driver": "file", "path": str(tmp_path / "vol") + "/"},
             "metadata": {"dimensions": list(SHAPE), "blockSize": list(BLOCK), "dataType": "uint16",
                          "compression": {"type": "gzip"}}}, create=True).result().write(data).result()
    app = web.Application()
    app.router.add_static("/data/", tmp_path)
    server = serve_app(app)
    a = tsp.open(f"{server.url}/data/vol/").result()
    assert a.driver.driver == "n5"
    assert np.array_equal(a[2:11, ::2, 3].read().result(), data[2:11, ::2, 3])


def test_corrupt_block_in_a_many_block_read_names_it(tmp_path: Path) -> None:
    """The blocking read path (local files) spreads a read over helper threads:
    an error in any of them reaches the caller, after every helper is done."""
    data = sample("uint16", (40, 30, 6), seed=5)
    a = tsp_create(tmp_path, "uint16", "gzip", shape=(40, 30, 6), block=(4, 3, 2))
    a.write(data).result()
    assert a.driver.reads_blocking
    assert np.array_equal(a.read().result(), data)
    (tmp_path / "7/5/1").write_bytes((tmp_path / "7/5/1").read_bytes()[:20])  # truncated gzip
    with pytest.raises(DataCorruptionError, match="7/5/1"):
        a.read().result()
    assert np.array_equal(a[:28].read().result(), data[:28])  # the rest still reads
