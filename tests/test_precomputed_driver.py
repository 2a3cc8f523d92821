"""The ``neuroglancer_precomputed`` driver against TensorStore's, both ways, on every
encoding TensorStore writes, unsharded and sharded; the domain, the spec, scale
creation, ranged reads of shards, whole-shard writes and hostile shards."""

from __future__ import annotations

import asyncio
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts
from _precomputed import label_volume, ts_create, ts_open, written_files
from test_driver_helpers import CountingKvStore

import tensorstore_py as tsp
from tensorstore_py import errors
from tensorstore_py.core.budget import ByteBudget
from tensorstore_py.core.future import run_sync
from tensorstore_py.core.ranges import ByteRange
from tensorstore_py.drivers.formats import OpenOptions
from tensorstore_py.drivers.precomputed.driver import PrecomputedArray, open_precomputed
from tensorstore_py.drivers.precomputed.sharding import ShardingSpec, build_shard, encode_minishard_index

SIZE = (21, 13, 9)
CHUNK = (4, 4, 2)
OFFSET = (3, -2, 1)

IDENTITY = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 2, "hash": "identity",
            "minishard_bits": 2, "shard_bits": 3, "minishard_index_encoding": "raw", "data_encoding": "raw"}
MURMUR = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 1, "hash": "murmurhash3_x86_128",
          "minishard_bits": 1, "shard_bits": 2, "minishard_index_encoding": "gzip", "data_encoding": "gzip"}
SHARDINGS = {"unsharded": None, "identity": IDENTITY, "murmur-gzip": MURMUR}

# (encoding, data type, channels)
ENCODINGS = [("raw", "uint16", 1), ("raw", "float32", 2), ("jpeg", "uint8", 3), ("png", "uint16", 2),
             ("compressed_segmentation", "uint64", 1), ("compressed_segmentation", "uint32", 2)]


def _data(encoding: str, dtype: str, channels: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (*SIZE, channels)
    if encoding == "compressed_segmentation":
        return label_volume(shape, dtype, rng)
    if encoding == "jpeg":  # smooth, like an image
        x, y, z = np.meshgrid(*(np.arange(s) for s in SIZE), indexing="ij")
        base = (x * 9 + y * 5 + z * 3) % 256
        return np.stack([(base + 40 * c) % 256 for c in range(channels)], -1).astype(dtype)
    if dtype == "float32":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, np.iinfo(dtype).max, shape, endpoint=True).astype(dtype)


def _scale(encoding: str, sharding: dict[str, Any] | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"voxel_offset": list(OFFSET)}
    if encoding == "compressed_segmentation":
        extra["compressed_segmentation_block_size"] = [2, 3, 2]
    if sharding is not None:
        extra["sharding"] = sharding
    return extra


def _spec(path: Path, **members: Any) -> dict[str, Any]:
    return {"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(path) + "/"}, **members}


CASES = [pytest.param(e, d, c, s, id=f"{e}-{d}x{c}-{s}") for e, d, c in ENCODINGS for s in SHARDINGS]


@pytest.mark.parametrize("encoding,dtype,channels,sharding", CASES)
def test_reads_what_tensorstore_writes(tmp_path: Path, encoding: str, dtype: str, channels: int,
                                       sharding: str) -> None:
    data = _data(encoding, dtype, channels)
    theirs = ts_create(tmp_path, data_type=dtype, size=SIZE, chunk_size=CHUNK, num_channels=channels,
                       encoding=encoding, **_scale(encoding, SHARDINGS[sharding]))
    theirs.write(data).result()
    expected = theirs.read().result()  # jpeg is lossy: what TensorStore decodes from its bytes
    ours = tsp.open(tmp_path.as_uri() + "/").result()
    assert ours.domain.inclusive_min == (*OFFSET, 0)
    assert ours.domain.exclusive_max == tuple(theirs.domain.exclusive_max)
    assert ours.labels == ("x", "y", "z", "channel")
    assert ours.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(ours.read().result(), expected)
    # a box crossing chunk edges, a strided view, a single plane
    np.testing.assert_array_equal(ours.at[5:19, 0:9, 2:7].read().result(),
                                  theirs[5:19, 0:9, 2:7].read().result())
    np.testing.assert_array_equal(ours[::3, ::-2, 4].read().result(), expected[::3, ::-2, 4])
    np.testing.assert_array_equal(ours.at[:, :, 9].read().result(), theirs[:, :, 9].read().result())


@pytest.mark.parametrize("encoding,dtype,channels,sharding", CASES)
def test_tensorstore_reads_what_we_write(tmp_path: Path, encoding: str, dtype: str, channels: int,
                                         sharding: str) -> None:
    data = _data(encoding, dtype, channels, seed=1)
    sm = {"size": list(SIZE), "chunk_size": list(CHUNK), "resolution": [8, 8, 40], "encoding": encoding,
          **_scale(encoding, SHARDINGS[sharding])}
    ours = tsp.open(_spec(tmp_path, multiscale_metadata={"type": "image", "data_type": dtype,
                                                         "num_channels": channels},
                          scale_metadata=sm), create=True).result()
    # whole-chunk writes, then partial writes over chunk (and shard) edges
    ours.write(data).result()
    patch = _data(encoding, dtype, channels, seed=2)[2:11, 3:12, 1:6]
    ours.at[6:15, 1:10, 2:7].write(patch).result()
    expected = data.copy()
    expected[3:12, 3:12, 1:6] = patch
    theirs = ts_open(tmp_path)
    got = theirs.read().result()
    if encoding == "jpeg":  # lossy: as close to the data as TensorStore's own encoding of it
        np.testing.assert_array_equal(got, ours.read().result())
        own = ts_create(tmp_path / "ts", data_type=dtype, size=SIZE, chunk_size=CHUNK, num_channels=channels,
                        encoding=encoding)
        own.write(expected).result()
        error = np.abs(own.read().result().astype(int) - expected).mean()
        assert np.abs(got.astype(int) - expected).mean() <= 1.5 * error + 1
    else:
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(ours.read().result(), expected)
    assert tuple(theirs.domain.inclusive_min) == (*OFFSET, 0)


@pytest.mark.parametrize("encoding,dtype,sharding", [
    ("raw", "uint16", None), ("compressed_segmentation", "uint64", None), ("raw", "uint16", IDENTITY),
    ("compressed_segmentation", "uint32", IDENTITY)])
def test_files_are_byte_identical_to_tensorstore(tmp_path: Path, encoding: str, dtype: str,
                                                 sharding: dict[str, Any] | None) -> None:
    """Where the format fixes the bytes (no image codec, no gzip), our files are TensorStore's."""
    data = _data(encoding, dtype, 1, seed=3)
    data[:6] = 0  # all-zero chunks are not stored by either
    scale = _scale(encoding, sharding)
    ts_create(tmp_path / "ts", data_type=dtype, size=SIZE, chunk_size=CHUNK, encoding=encoding,
              **scale).write(data).result()
    sm = {"size": list(SIZE), "chunk_size": list(CHUNK), "resolution": [1, 1, 1], "encoding": encoding, **scale}
    ours = tsp.open(_spec(tmp_path / "tsp", multiscale_metadata={"type": "image", "data_type": dtype,
                                                                 "num_channels": 1},
                          scale_metadata=sm), create=True).result()
    ours.write(data).result()
    theirs_files, our_files = written_files(tmp_path / "ts"), written_files(tmp_path / "tsp")
    our_files = {k: v for k, v in our_files.items() if ".__tsp__" not in k}
    assert set(our_files) == set(theirs_files)
    for key, value in theirs_files.items():
        assert our_files[key] == value, key


def test_domain_labels_spec_and_chunk_layout(tmp_path: Path) -> None:
    ts_create(tmp_path, data_type="uint8", size=SIZE, chunk_size=CHUNK, voxel_offset=list(OFFSET),
              sharding={**IDENTITY, "shard_bits": 4}).write(np.ones((*SIZE, 1), np.uint8)).result()
    a = tsp.open(_spec(tmp_path, scale_index=0)).result()
    assert a.origin == (*OFFSET, 0) and a.shape == (*SIZE, 1)
    assert a.chunk_layout.read_chunk_shape == (*CHUNK, 1)
    assert a.chunk_layout.grid_origin == (*OFFSET, 0)
    # identity hash, every chunk id bit above preshift + minishard kept as a shard bit:
    # each shard is a box of 4x2x2 chunks (the grid is 6x4x5: x, y, z, x, ... bits)
    assert a.chunk_layout.write_chunk_shape == (16, 8, 4, 1)
    # with one shard bit fewer, several boxes share a shard file: no box to write alone
    folded = ts_create(tmp_path / "folded", data_type="uint8", size=SIZE, chunk_size=CHUNK, sharding=IDENTITY)
    del folded
    assert tsp.open(_spec(tmp_path / "folded", scale_index=0)).result().chunk_layout.write_chunk_shape == (*SIZE, 1)
    spec = a.spec()
    assert "transform" not in spec and spec["scale_index"] == 0
    assert spec["scale_metadata"]["voxel_offset"] == list(OFFSET)
    again = tsp.open(spec).result()
    assert again.domain == a.domain
    theirs = ts.open(json.loads(json.dumps(spec))).result()  # TensorStore takes our spec
    assert tuple(theirs.domain.inclusive_min) == a.origin
    # a view's spec reopens the view
    view = a.at[4:9, 0, 2:3]
    np.testing.assert_array_equal(tsp.open(view.spec()).result().read().result(), view.read().result())


def test_open_create_through_keyword_options(tmp_path: Path) -> None:
    labels = label_volume((40, 24, 16, 1), "uint64", np.random.default_rng(5))
    url = tmp_path.as_uri() + "/seg/"
    a = tsp.open(url, create=True, driver="neuroglancer_precomputed", dtype="uint64", shape=labels.shape,
                 chunks=[8, 8, 8], shards=[16, 16, 16], compression="compressed_segmentation").result()
    a.write(labels).result()
    info = json.loads((tmp_path / "seg" / "info").read_bytes())
    scale = info["scales"][0]
    assert info["type"] == "segmentation" and scale["encoding"] == "compressed_segmentation"
    assert scale["compressed_segmentation_block_size"] == [8, 8, 8]
    assert scale["sharding"]["hash"] == "identity"
    assert a.chunk_layout.write_chunk_shape == (16, 16, 16, 1)
    np.testing.assert_array_equal(ts_open(tmp_path / "seg").read().result(), labels)
    # reopening by URL detects the format and checks the keyword options
    b = tsp.open(url, shape=labels.shape, dtype="uint64").result()
    assert isinstance(b.driver, PrecomputedArray)
    with pytest.raises(errors.InvalidSpecError, match="shape"):
        tsp.open(url, shape=(40, 24, 15, 1)).result()
    with pytest.raises(errors.InvalidArgumentError, match="chunks"):
        tsp.open(tmp_path.as_uri() + "/x/", create=True, driver="neuroglancer_precomputed", dtype="uint8",
                 shape=[8, 8, 8, 1], chunks=[4, 4]).result()
    with pytest.raises(errors.InvalidArgumentError, match="box"):
        tsp.open(tmp_path.as_uri() + "/y/", create=True, driver="neuroglancer_precomputed", dtype="uint8",
                 shape=[64, 64, 64, 1], chunks=[8, 8, 8], shards=[64, 64, 8]).result()
    with pytest.raises(errors.UnsupportedError, match="float64"):
        tsp.open(tmp_path.as_uri() + "/z/", create=True, driver="neuroglancer_precomputed", dtype="float64",
                 shape=[8, 8, 8, 1]).result()


def test_adding_scales_is_a_compare_and_swap_on_info(tmp_path: Path) -> None:
    """Creators of different scales racing on one volume all land in ``info``."""
    mm = {"type": "image", "data_type": "uint8", "num_channels": 1}
    tsp.open(_spec(tmp_path, multiscale_metadata=mm, scale_metadata={
        "size": [64, 64, 64], "chunk_size": [16, 16, 16], "resolution": [1, 1, 1]}), create=True).result()

    async def add(i: int) -> Any:
        f = 2 ** i
        return await tsp.open(_spec(tmp_path, scale_metadata={
            "size": [64 // f] * 3, "chunk_size": [8, 8, 8], "resolution": [f, f, f]}), create=True)

    async def race() -> list[Any]:
        return await asyncio.gather(*(add(i) for i in range(1, 7)))

    opened = run_sync(race())
    info = json.loads((tmp_path / "info").read_bytes())
    assert sorted(s["key"] for s in info["scales"]) == sorted(["1_1_1", *(f"{2**i}_{2**i}_{2**i}" for i in range(1, 7))])
    for a in opened:  # each opened its own scale
        assert a.spec()["scale_metadata"]["key"] == info["scales"][a.spec()["scale_index"]]["key"]
    # TensorStore sees them all
    assert ts_open(tmp_path, 6).shape[:3] == tuple(info["scales"][6]["size"])
    with pytest.raises(errors.InvalidSpecError, match="already exists"):
        tsp.open(_spec(tmp_path, scale_metadata={"size": [32] * 3, "chunk_size": [8] * 3,
                                                 "resolution": [2, 2, 2]}), create=True, open=False).result()


def test_open_errors_are_typed_and_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(errors.NotFoundError, match="info"):
        tsp.open(_spec(tmp_path / "none", scale_index=0)).result()
    ts_create(tmp_path, data_type="uint8", size=SIZE, chunk_size=CHUNK)
    with pytest.raises(errors.NotFoundError, match="scale 3"):
        tsp.open(_spec(tmp_path, scale_index=3)).result()
    with pytest.raises(errors.InvalidSpecError, match="scale_metadata.*encoding"):
        tsp.open(_spec(tmp_path, scale_metadata={"encoding": "jpeg"})).result()
    with pytest.raises(errors.InvalidSpecError, match="multiscale_metadata.data_type"):
        tsp.open(_spec(tmp_path, multiscale_metadata={"data_type": "uint16"})).result()
    with pytest.raises(errors.InvalidSpecError, match="unknown fields"):
        tsp.open(_spec(tmp_path, scale_idx=0)).result()
    (tmp_path / "info").write_text('{"type": "image", "data_type": "uint8", "num_channels": 1, '
                                   '"scales": [{"key": "a", "size": [1, 1, 1], "resolution": [1, 1, 1], '
                                   '"chunk_sizes": [[1, 1, 1]], "encoding": "zfp"}]}')
    with pytest.raises(errors.UnsupportedError, match="zfp.*info at"):
        tsp.open(_spec(tmp_path, scale_index=0)).result()
    a = ts_create(tmp_path / "ro", data_type="uint8", size=SIZE, chunk_size=CHUNK)
    del a
    with pytest.raises(errors.UnsupportedError, match="resiz"):
        tsp.open(_spec(tmp_path / "ro", scale_index=0)).result().resize((1, 1, 1, 1)).result()


# -- sharded reads: ranged, cached, consistent ---------------------------------------------------

def _counting(path: Path, members: dict[str, Any]) -> tuple[tsp.TensorStore, CountingKvStore]:
    kv = CountingKvStore(tsp.KvStore.open(path.as_uri() + "/").result())
    opts = OpenOptions(create=False, open=True, delete_existing=False, cache_pool=None,
                       budget=ByteBudget(1 << 30))
    drv = run_sync(open_precomputed({"driver": "neuroglancer_precomputed", **members}, kv, opts))
    return tsp.TensorStore(drv), kv


def test_sharded_reads_fetch_byte_ranges_never_whole_shards(tmp_path: Path) -> None:
    size = (64, 64, 32)
    data = np.random.default_rng(7).integers(0, 255, (*size, 1), dtype=np.uint8)
    spec = {**IDENTITY, "preshift_bits": 3, "minishard_bits": 3, "shard_bits": 3}
    ts_create(tmp_path, data_type="uint8", size=size, chunk_size=(8, 8, 8), sharding=spec).write(data).result()
    shard_sizes = {p.name: p.stat().st_size for p in (tmp_path / "1_1_1").iterdir()}
    a, kv = _counting(tmp_path, {"scale_index": 0})
    kv.reads.clear()
    np.testing.assert_array_equal(a[10:30, 5:20, 3:12].read().result(), data[10:30, 5:20, 3:12])
    shard_reads = [(k, r) for k, r in kv.reads if k.endswith(".shard")]
    assert shard_reads and all(isinstance(r, ByteRange) and r.stop is not None for _, r in shard_reads)
    for key, r in shard_reads:  # no request spans a whole shard
        assert r.stop - r.start < shard_sizes[key.rsplit("/", 1)[-1]]
    # the three rounds: shard index entries, minishard indexes, chunks
    first = len(shard_reads)
    kv.reads.clear()
    np.testing.assert_array_equal(a[10:30, 5:20, 3:12].read().result(), data[10:30, 5:20, 3:12])
    again = [(k, r) for k, r in kv.reads if k.endswith(".shard")]
    assert len(again) < first  # the shard and minishard indexes come from the array's cache
    total = sum(r.stop - r.start for _, r in again)
    assert total < 2 * data[8:32, 0:24, 0:16].nbytes  # about the chunks needed, nothing more


def test_sharded_reads_see_rewritten_shards(tmp_path: Path) -> None:
    """Cached indexes never serve a stale chunk: a changed shard is looked up again."""
    data = np.zeros((*SIZE, 1), np.uint16)
    theirs = ts_create(tmp_path, data_type="uint16", size=SIZE, chunk_size=CHUNK, sharding=IDENTITY)
    theirs[:4, :4, :2].write(np.full((4, 4, 2, 1), 5, np.uint16)).result()
    a = tsp.open(tmp_path.as_uri() + "/").result()
    data[:4, :4, :2] = 5
    np.testing.assert_array_equal(a.read().result(), data)
    for value in (6, 7):
        theirs[4:12, 2:6, 1:5].write(np.full((8, 4, 4, 1), value, np.uint16)).result()  # chunks not there before
        data[4:12, 2:6, 1:5] = value
        np.testing.assert_array_equal(a.read().result(), data)
        np.testing.assert_array_equal(a.at[7:15, 0:4, 2:4].read().result(), data[7:15, 0:4, 2:4])


def test_partial_writes_of_a_shard_keep_its_other_chunks(tmp_path: Path) -> None:
    data = _data("compressed_segmentation", "uint64", 1, seed=9)
    sm = {"size": list(SIZE), "chunk_size": list(CHUNK), "resolution": [1, 1, 1], "encoding":
          "compressed_segmentation", "compressed_segmentation_block_size": [2, 2, 2], "sharding": MURMUR}
    a = tsp.open(_spec(tmp_path, multiscale_metadata={"type": "segmentation", "data_type": "uint64",
                                                      "num_channels": 1}, scale_metadata=sm), create=True).result()
    expected = np.zeros_like(data)
    rng = np.random.default_rng(0)
    for _ in range(12):  # random boxes, most of them cutting chunks
        lo = [int(rng.integers(0, s)) for s in SIZE]
        hi = [int(rng.integers(a + 1, s + 1)) for a, s in zip(lo, SIZE)]
        box = tuple(slice(a, b) for a, b in zip(lo, hi))
        a[box].write(data[box]).result()
        expected[box] = data[box]
    np.testing.assert_array_equal(a.read().result(), expected)
    np.testing.assert_array_equal(ts_open(tmp_path).read().result(), expected)
    a.write(np.zeros_like(data)).result()  # all fill: every shard is deleted
    assert not [p for p in (tmp_path / "1_1_1").iterdir() if p.suffix == ".shard"]


def test_concurrent_writers_of_one_shard_lose_nothing(tmp_path: Path) -> None:
    """Whole-shard read-modify-write under the shard's generation: disjoint chunks of one
    shard written by racing writers all survive."""
    sm = {"size": [32, 8, 8], "chunk_size": [4, 4, 4], "resolution": [1, 1, 1],
          "sharding": {**IDENTITY, "preshift_bits": 2, "minishard_bits": 2, "shard_bits": 0}}
    mm = {"type": "image", "data_type": "uint8", "num_channels": 1}
    a = tsp.open(_spec(tmp_path, multiscale_metadata=mm, scale_metadata=sm), create=True).result()
    views = [tsp.open(_spec(tmp_path, scale_index=0)).result() for _ in range(8)]

    async def race() -> None:
        await asyncio.gather(*(v[4 * i:4 * i + 4, :4, :4].write(np.full((4, 4, 4, 1), i + 1, np.uint8))
                               for i, v in enumerate(views)))

    run_sync(race())
    got = a.read().result()
    for i in range(8):
        assert (got[4 * i:4 * i + 4, :4, :4] == i + 1).all()
    assert (got[:, 4:] == 0).all() and (got[:, :, 4:] == 0).all()


def _hostile_volume(tmp_path: Path, shard: bytes) -> tsp.TensorStore:
    spec = {**IDENTITY, "preshift_bits": 0, "minishard_bits": 1, "shard_bits": 0}
    info = {"@type": "neuroglancer_multiscale_volume", "type": "image", "data_type": "uint8", "num_channels": 1,
            "scales": [{"key": "s", "size": [4, 4, 4], "resolution": [1, 1, 1], "chunk_sizes": [[2, 2, 2]],
                        "encoding": "raw", "sharding": spec}]}
    (tmp_path / "s").mkdir(parents=True, exist_ok=True)
    (tmp_path / "info").write_text(json.dumps(info))
    (tmp_path / "s" / "0.shard").write_bytes(shard)
    return tsp.open(tmp_path.as_uri() + "/").result()


def test_hostile_shard_and_minishard_indexes_raise_typed_errors(tmp_path: Path) -> None:
    spec = ShardingSpec(0, "identity", 1, 0)
    good = build_shard(spec, {0: bytes(8), 1: bytes(range(8))})
    assert good is not None
    a = _hostile_volume(tmp_path / "good", good)
    # raw chunks are stored x fastest
    np.testing.assert_array_equal(a[2:4, 0:2, 0:2, 0].read().result(),
                                  np.arange(8, dtype=np.uint8).reshape(2, 2, 2).transpose(2, 1, 0))
    cases = {
        "entry past the end": np.array([[0, 10**6], [0, 0]], "<u8").tobytes() + good[32:],
        "entry reversed": np.array([[24, 0], [0, 0]], "<u8").tobytes() + good[32:],
        "index not 24k bytes": np.array([[0, 25], [25, 50]], "<u8").tobytes() + bytes(60),
        "chunk larger than a chunk": good[:32] + encode_minishard_index(
            [(0, ByteRange(32, 32 + 10**6))], spec),
        "truncated": good[:20],
    }
    for i, (what, shard) in enumerate(cases.items()):
        a = _hostile_volume(tmp_path / str(i), shard)
        with pytest.raises(errors.DataCorruptionError, match="shard"):
            a.read().result()
            pytest.fail(what)


# -- every kvstore --------------------------------------------------------------------------------

@pytest.mark.parametrize("sharding", [None, MURMUR], ids=["unsharded", "sharded"])
def test_memory_store_and_transactions(sharding: dict[str, Any] | None) -> None:
    data = _data("raw", "uint16", 1, seed=4)
    kv = {"driver": "memory", "path": f"vol-{sharding is None}/"}
    mm = {"type": "image", "data_type": "uint16", "num_channels": 1}
    sm = {"size": list(SIZE), "chunk_size": list(CHUNK), "resolution": [1, 1, 1], **_scale("raw", sharding)}
    a = tsp.open({"driver": "neuroglancer_precomputed", "kvstore": kv, "multiscale_metadata": mm,
                  "scale_metadata": sm}, create=True).result()
    a.write(data).result()
    np.testing.assert_array_equal(a.read().result(), data)


def test_versioned_store_commits_a_scale_atomically(tmp_path: Path) -> None:
    data = _data("compressed_segmentation", "uint32", 1, seed=6)
    kv = tsp.KvStore.open("versioned+file://" + str(tmp_path) + "/").result()
    mm = {"type": "segmentation", "data_type": "uint32", "num_channels": 1}
    sm = {"size": list(SIZE), "chunk_size": list(CHUNK), "resolution": [1, 1, 1],
          "encoding": "compressed_segmentation", **_scale("compressed_segmentation", IDENTITY)}
    a = tsp.open({"driver": "neuroglancer_precomputed", "kvstore": kv.spec(), "multiscale_metadata": mm,
                  "scale_metadata": sm}, create=True).result()
    with tsp.Transaction() as txn:
        a.with_transaction(txn).write(data).result()
        assert not a.read().result().any()  # nothing visible before the commit
    np.testing.assert_array_equal(a.read().result(), data)


def test_reads_over_http(tmp_path: Path, serve_app: Any) -> None:
    from aiohttp import web

    data = _data("raw", "uint16", 1, seed=8)
    ts_create(tmp_path / "vol", data_type="uint16", size=SIZE, chunk_size=CHUNK, voxel_offset=list(OFFSET),
              sharding=MURMUR).write(data).result()
    app = web.Application()
    app.router.add_static("/", tmp_path)
    server = serve_app(app)
    a = tsp.open(server.url + "/vol/").result()
    np.testing.assert_array_equal(a.read().result(), data)
    np.testing.assert_array_equal(a.at[4:9, :, 5].read().result(), data[1:6, :, 4])
    with pytest.raises(errors.ReadOnlyError):
        a.write(data).result()


def test_compresso_chunks_written_by_the_compresso_package_are_read(tmp_path: Path) -> None:
    compresso = pytest.importorskip("compresso")
    labels = label_volume((10, 9, 7, 1), "uint32", np.random.default_rng(3))
    info = {"type": "segmentation", "data_type": "uint32", "num_channels": 1, "scales": [
        {"key": "c", "size": [10, 9, 7], "resolution": [1, 1, 1], "chunk_sizes": [[4, 4, 4]], "encoding": "compresso"}]}
    (tmp_path / "c").mkdir()
    (tmp_path / "info").write_text(json.dumps(info))
    for x in range(0, 10, 4):
        for y in range(0, 9, 4):
            for z in range(0, 7, 4):
                chunk = labels[x:x + 4, y:y + 4, z:z + 4, 0]
                name = f"{x}-{x + chunk.shape[0]}_{y}-{y + chunk.shape[1]}_{z}-{z + chunk.shape[2]}"
                (tmp_path / "c" / name).write_bytes(compresso.compress(np.asfortranarray(chunk)))
    a = tsp.open(tmp_path.as_uri() + "/").result()
    np.testing.assert_array_equal(a.read().result(), labels)
    a[1:3, 1:3, 1:3].write(np.full((2, 2, 2, 1), 9, np.uint32)).result()  # encoded by compresso too
    labels[1:3, 1:3, 1:3] = 9
    np.testing.assert_array_equal(tsp.open(tmp_path.as_uri() + "/").result().read().result(), labels)


def test_scale_keys_may_leave_the_volume_folder(tmp_path: Path) -> None:
    info = {"type": "image", "data_type": "uint8", "num_channels": 1, "scales": [
        {"key": "../shared/s0", "size": [4, 4, 4], "resolution": [1, 1, 1], "chunk_sizes": [[4, 4, 4]],
         "encoding": "raw"}]}
    (tmp_path / "vol").mkdir()
    (tmp_path / "vol" / "info").write_text(json.dumps(info))
    a = tsp.open((tmp_path / "vol").as_uri() + "/").result()
    a.write(np.arange(64, dtype=np.uint8).reshape(4, 4, 4, 1)).result()
    assert (tmp_path / "shared" / "s0" / "0-4_0-4_0-4").exists()
    shutil.copytree(tmp_path, tmp_path.parent / (tmp_path.name + "-copy"))
    theirs = ts.open(_spec(tmp_path.parent / (tmp_path.name + "-copy") / "vol", scale_index=0)).result()
    np.testing.assert_array_equal(theirs.read().result(), a.read().result())


def test_gcs_emulator_sharded_volume(gcs_emulator: Any) -> None:
    """A sharded scale written and read on a (fake) GCS bucket: ranged GETs, generations."""
    bucket = gcs_emulator.create_bucket()
    spec = gcs_emulator.spec(bucket, path="seg/")
    data = _data("compressed_segmentation", "uint64", 1, seed=12)
    mm = {"type": "segmentation", "data_type": "uint64", "num_channels": 1}
    sm = {"size": list(SIZE), "chunk_size": list(CHUNK), "resolution": [1, 1, 1], "encoding": "compressed_segmentation",
          **_scale("compressed_segmentation", MURMUR)}
    a = tsp.open({"driver": "neuroglancer_precomputed", "kvstore": spec, "multiscale_metadata": mm,
                  "scale_metadata": sm}, create=True).result(60)
    a.write(data).result(60)
    a.at[4:9, 0:3, 2:4].write(np.full((5, 3, 2, 1), 3, np.uint64)).result(60)
    data[1:6, 2:5, 1:3] = 3
    again = tsp.open({"driver": "neuroglancer_precomputed", "kvstore": spec, "scale_index": 0}).result(60)
    np.testing.assert_array_equal(again.read().result(60), data)


def test_views_pickle_as_their_spec(tmp_path: Path) -> None:
    data = _data("raw", "uint16", 1, seed=13)
    ts_create(tmp_path, data_type="uint16", size=SIZE, chunk_size=CHUNK, voxel_offset=list(OFFSET),
              sharding=MURMUR).write(data).result()
    a = tsp.open(tmp_path.as_uri() + "/").result()
    for view in (a, a.at[5:12, -1:6, 2], a[::2, ::-3].label("i", "j", "k", "c")):
        back = pickle.loads(pickle.dumps(view))
        assert back.domain == view.domain
        np.testing.assert_array_equal(back.read().result(), view.read().result())
