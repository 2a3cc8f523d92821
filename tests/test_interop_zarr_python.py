"""Interop with zarr-python, both ways: what we write it reads bit-exactly, and back.

Matrix: dtypes x codecs x sharding (none, index at end, index at start) on an
odd shape whose edge chunks (and edge shards) are ragged, plus arrays created
by zarr-python with its own defaults (zarr v3 and v2). bfloat16 is absent:
zarr-python has no bfloat16 data type (see test_interop_tensorstore.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr
from zarr.storage import LocalStore

import tensorstore_py as tsp

pytest.importorskip("tensorstore_py.drivers.open")

SHAPE = (7, 11)
CHUNKS = (3, 4)
SHARDS = (6, 8)
REGION = (slice(1, 7), slice(2, 9))  # a partial write: leaves fill in some chunks

DTYPES = ["bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64", "complex64"]
CODECS = ["raw", "zstd", "gzip", "blosc", "crc32c", "transpose"]
SHARDING = [None, "end", "start"]


def _bytes(dt: np.dtype, endian: str = "little") -> dict:
    if dt.itemsize == 1:
        return {"name": "bytes", "configuration": {}}
    return {"name": "bytes", "configuration": {"endian": endian}}


def codec_chain(name: str, dt: np.dtype) -> list[dict]:
    if name == "raw":
        return [_bytes(dt)]
    if name == "zstd":
        return [_bytes(dt), {"name": "zstd", "configuration": {"level": 1, "checksum": False}}]
    if name == "gzip":
        return [_bytes(dt), {"name": "gzip", "configuration": {"level": 5}}]
    if name == "blosc":
        return [_bytes(dt), {"name": "blosc", "configuration": {
            "cname": "lz4", "clevel": 5, "shuffle": "shuffle", "typesize": dt.itemsize, "blocksize": 0}}]
    if name == "crc32c":
        return [_bytes(dt), {"name": "crc32c"}]
    if name == "transpose":
        return [{"name": "transpose", "configuration": {"order": [1, 0]}}, _bytes(dt, "big")]
    raise AssertionError(name)


def fill_for(dt: np.dtype):
    """(JSON fill value, numpy fill value): non-zero, to catch fill handling bugs."""
    if dt.kind == "b":
        return True, True
    if dt.kind == "c":
        return [0.5, -1.0], complex(0.5, -1.0)
    if dt.kind == "f" or dt.name == "bfloat16":
        return 0.5, 0.5
    return 3, 3


def metadata(dtype: str, codec: str, sharding: str | None) -> dict:
    dt = np.dtype(dtype)
    fill_json, _ = fill_for(dt)
    codecs = codec_chain(codec, dt)
    grid = CHUNKS
    if sharding is not None:
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(CHUNKS), "codecs": codecs,
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                             {"name": "crc32c"}],
            "index_location": sharding}}]
        grid = SHARDS
    return {
        "zarr_format": 3, "node_type": "array", "shape": list(SHAPE), "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(grid)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill_json, "codecs": codecs, "attributes": {},
    }


def sample(dtype: str, seed: int = 0) -> np.ndarray:
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    if dt.kind == "b":
        return rng.random(SHAPE) < 0.5
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, SHAPE, dtype=dt, endpoint=True)
    if dt.kind == "c":
        return (rng.standard_normal(SHAPE) + 1j * rng.standard_normal(SHAPE)).astype(dt)
    return (rng.standard_normal(SHAPE) * 100).astype(dt)


def expected(dtype: str, data: np.ndarray) -> np.ndarray:
    out = np.full(SHAPE, fill_for(np.dtype(dtype))[1], dtype=data.dtype)
    out[REGION] = data[REGION]
    return out


def assert_bit_exact(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


# Every dtype with every codec (sharding rotating), and every codec x sharding for int32.
CASES = sorted(
    {(d, c, SHARDING[(i + j) % 3]) for i, d in enumerate(DTYPES) for j, c in enumerate(CODECS)}
    | {("int32", c, s) for c in CODECS for s in SHARDING}
    | {("float32", c, s) for c in CODECS for s in SHARDING},
    key=str,
)


def case_id(case) -> str:
    return "-".join(str(x) for x in case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_we_write_zarr_python_reads(case, tmp_path):
    dtype, codec, sharding = case
    data = sample(dtype)
    spec = {"driver": "zarr3", "kvstore": tmp_path.as_uri() + "/",
            "metadata": metadata(dtype, codec, sharding)}
    a = tsp.open(spec, create=True).result()
    a[REGION].write(data[REGION]).result()
    z = zarr.open_array(LocalStore(tmp_path), mode="r")
    assert_bit_exact(z[...], expected(dtype, data))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_zarr_python_writes_we_read(case, tmp_path):
    dtype, codec, sharding = case
    data = sample(dtype, seed=1)
    (tmp_path / "zarr.json").write_text(json.dumps(metadata(dtype, codec, sharding)))
    z = zarr.open_array(LocalStore(tmp_path), mode="r+")
    z[REGION] = data[REGION]
    a = tsp.open(tmp_path.as_uri() + "/").result()
    assert_bit_exact(a.read().result(), expected(dtype, data))
    # a partial region through a strided, flipped view
    assert_bit_exact(a[5:0:-2, 1::3].read().result(), expected(dtype, data)[5:0:-2, 1::3])


@pytest.mark.parametrize("shards", [None, (6, 8)])
@pytest.mark.parametrize("dtype", ["uint8", "float64", "complex64", "bool"])
def test_zarr_python_native_arrays(dtype, shards, tmp_path):
    data = sample(dtype, seed=2)
    z = zarr.create_array(LocalStore(tmp_path), shape=SHAPE, chunks=CHUNKS, shards=shards,
                          dtype=dtype, dimension_names=["y", "x"])
    z[...] = data
    a = tsp.open(tmp_path.as_uri() + "/").result()
    assert a.labels == ("y", "x") and a.shape == SHAPE and a.chunks == CHUNKS
    assert_bit_exact(a.read().result(), data)
    # our write into their array, read back by them
    a[2:5, 3:10].write(np.zeros((3, 7), dtype)).result()
    data[2:5, 3:10] = 0
    assert_bit_exact(zarr.open_array(LocalStore(tmp_path), mode="r")[...], data)


@pytest.mark.parametrize("dtype", ["uint8", "int16", "int64", "float32", "float64", "complex128", "bool"])
@pytest.mark.parametrize("order", ["C", "F"])
def test_zarr2_default_compressor_both_ways(dtype, order, tmp_path):
    data = sample(dtype, seed=3)
    z = zarr.create_array(LocalStore(tmp_path / "theirs"), shape=SHAPE, chunks=CHUNKS, dtype=dtype,
                          zarr_format=2, order=order)
    z[...] = data
    a = tsp.open((tmp_path / "theirs").as_uri() + "/").result()
    assert a.spec()["driver"] == "zarr"
    assert_bit_exact(a.read().result(), data)
    ours = tsp.open((tmp_path / "ours").as_uri() + "/", create=True, driver="zarr", dtype=dtype,
                    shape=SHAPE, chunks=CHUNKS, compression="zstd", order=order).result()
    ours.write(data).result()
    back = zarr.open_array(LocalStore(tmp_path / "ours"), mode="r")
    assert back.metadata.zarr_format == 2
    assert_bit_exact(back[...], data)


@pytest.mark.parametrize("encoding", [
    {"name": "default", "configuration": {"separator": "/"}},
    {"name": "default", "configuration": {"separator": "."}},
    {"name": "v2", "configuration": {"separator": "."}},
    {"name": "v2", "configuration": {"separator": "/"}},
], ids=lambda e: f"{e['name']}{e['configuration']['separator']}")
def test_chunk_key_encodings_both_ways(encoding, tmp_path):
    data = sample("int16", seed=4)
    meta = {**metadata("int16", "zstd", None), "chunk_key_encoding": encoding}
    a = tsp.open({"driver": "zarr3", "kvstore": (tmp_path / "ours").as_uri() + "/", "metadata": meta},
                 create=True).result()
    a.write(data).result()
    assert_bit_exact(zarr.open_array(LocalStore(tmp_path / "ours"), mode="r")[...], data)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "zarr.json").write_text(json.dumps(meta))
    zarr.open_array(LocalStore(tmp_path / "theirs"), mode="r+")[...] = data
    assert_bit_exact(tsp.open((tmp_path / "theirs").as_uri() + "/").result().read().result(), data)


def test_3d_transpose_inside_shards_both_ways(tmp_path):
    shape, inner, shard = (5, 6, 7), (2, 4, 3), (4, 4, 6)
    meta = {
        "zarr_format": 3, "node_type": "array", "shape": list(shape), "data_type": "float64",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard)}},
        "chunk_key_encoding": {"name": "default"}, "fill_value": -1.5, "attributes": {},
        "dimension_names": ["z", "y", "x"],
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(inner),
            "codecs": [{"name": "transpose", "configuration": {"order": [2, 0, 1]}},
                       {"name": "bytes", "configuration": {"endian": "big"}},
                       {"name": "gzip", "configuration": {"level": 1}}],
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                             {"name": "crc32c"}],
            "index_location": "start"}}],
    }
    data = np.random.default_rng(5).standard_normal(shape)
    a = tsp.open({"driver": "zarr3", "kvstore": (tmp_path / "ours").as_uri() + "/", "metadata": meta},
                 create=True).result()
    a.dims["y"][1:].write(data[:, 1:]).result()
    want = data.copy()
    want[:, :1] = -1.5
    assert_bit_exact(zarr.open_array(LocalStore(tmp_path / "ours"), mode="r")[...], want)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "zarr.json").write_text(json.dumps(meta))
    zarr.open_array(LocalStore(tmp_path / "theirs"), mode="r+")[...] = data
    b = tsp.open((tmp_path / "theirs").as_uri() + "/").result()
    assert_bit_exact(b.read().result(), data)
    assert_bit_exact(b.transpose("x", "z", "y")[::-1].read().result(), data.transpose(2, 0, 1)[::-1])


@pytest.mark.parametrize("variant", ["delta-filter", "slash-separator", "fill-null", "zlib", "blosc"])
def test_zarr2_variants(variant, tmp_path):
    import numcodecs

    data = sample("int32", seed=6)
    kwargs: dict = {}
    if variant == "delta-filter":
        kwargs = {"filters": [numcodecs.Delta(dtype="<i4")], "compressors": numcodecs.Zstd(level=1)}
    elif variant == "slash-separator":
        kwargs = {"chunk_key_encoding": {"name": "v2", "separator": "/"}}
    elif variant == "fill-null":
        kwargs = {"fill_value": None}
    elif variant == "zlib":
        kwargs = {"compressors": numcodecs.Zlib(level=3)}
    elif variant == "blosc":
        kwargs = {"compressors": numcodecs.Blosc(cname="zstd", clevel=3, shuffle=numcodecs.Blosc.BITSHUFFLE)}
    z = zarr.create_array(LocalStore(tmp_path), shape=SHAPE, chunks=CHUNKS, dtype="int32",
                          zarr_format=2, **kwargs)
    z[1:, :] = data[1:, :]
    want = data.copy()
    want[0] = 0
    a = tsp.open(tmp_path.as_uri() + "/").result()
    assert_bit_exact(a.read().result(), want)
    a[0].write(data[0]).result()  # read-modify-write into their chunks
    assert_bit_exact(zarr.open_array(LocalStore(tmp_path), mode="r")[...], data)
