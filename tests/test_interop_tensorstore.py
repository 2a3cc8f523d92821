"""Interop with TensorStore, both ways, over the same matrix as zarr-python plus bfloat16.

For codecs whose output is deterministic (raw bytes, crc32c, transpose) the
chunk files we write must also be byte-identical to TensorStore's.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

import tensorstore_py as tsp

pytest.importorskip("tensorstore_py.drivers.open")

from test_interop_zarr_python import (
    CHUNKS,
    CODECS,
    DTYPES,
    REGION,
    SHAPE,
    SHARDING,
    assert_bit_exact,
    case_id,
    fill_for,
    metadata,
)

ALL_DTYPES = DTYPES + ["bfloat16"]
CASES = sorted(
    {(d, c, SHARDING[(i + j) % 3]) for i, d in enumerate(ALL_DTYPES) for j, c in enumerate(CODECS)}
    | {("bfloat16", c, None) for c in CODECS}
    | {("int32", c, s) for c in CODECS for s in SHARDING},
    key=str,
)


def np_dtype(dtype: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def sample(dtype: str, seed: int = 0) -> np.ndarray:
    dt = np_dtype(dtype)
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
    out = np.full(SHAPE, fill_for(np_dtype(dtype))[1], dtype=data.dtype)
    out[REGION] = data[REGION]
    return out


def ts_spec(path, meta=None, driver="zarr3") -> dict:
    spec = {"driver": driver, "kvstore": {"driver": "file", "path": str(path) + "/"}}
    if meta is not None:
        spec["metadata"] = meta
    return spec


def as_bits(a: np.ndarray, dtype: str) -> np.ndarray:
    # TensorStore returns its own bfloat16 type; compare raw bytes in our dtype.
    return np.ascontiguousarray(a).view(np_dtype(dtype))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_we_write_tensorstore_reads(case, tmp_path):
    dtype, codec, sharding = case
    data = sample(dtype)
    a = tsp.open({"driver": "zarr3", "kvstore": tmp_path.as_uri() + "/",
                  "metadata": metadata(dtype, codec, sharding)}, create=True).result()
    a[REGION].write(data[REGION]).result()
    t = ts.open(ts_spec(tmp_path)).result()
    assert_bit_exact(as_bits(t.read().result(), dtype), expected(dtype, data))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tensorstore_writes_we_read(case, tmp_path):
    dtype, codec, sharding = case
    data = sample(dtype, seed=1)
    t = ts.open(ts_spec(tmp_path, metadata(dtype, codec, sharding)), create=True).result()
    t[REGION].write(data[REGION]).result()
    a = tsp.open(tmp_path.as_uri() + "/").result()
    assert_bit_exact(a.read().result(), expected(dtype, data))
    assert_bit_exact(a[::-1, 3:10:2].read().result(), expected(dtype, data)[::-1, 3:10:2])


def chunk_files(root) -> list:
    # the file store keeps its lock files in hidden ".__tsp__" folders; they are not chunks
    return sorted(p.relative_to(root) for p in (root / "c").rglob("*")
                  if p.is_file() and ".__tsp__" not in p.parts)


DETERMINISTIC = [(d, c) for d in ALL_DTYPES for c in ("raw", "crc32c", "transpose")]


@pytest.mark.parametrize("dtype,codec", DETERMINISTIC, ids=lambda x: str(x))
def test_chunk_files_byte_identical(dtype, codec, tmp_path):
    data = sample(dtype, seed=2)
    meta = metadata(dtype, codec, None)
    tsp.open({"driver": "zarr3", "kvstore": (tmp_path / "ours").as_uri() + "/", "metadata": meta},
             create=True).result().write(data).result()
    t = ts.open(ts_spec(tmp_path / "theirs", meta), create=True).result()
    t.write(data).result()
    ours, theirs = chunk_files(tmp_path / "ours"), chunk_files(tmp_path / "theirs")
    assert ours == theirs and ours
    for rel in ours:
        assert (tmp_path / "ours" / rel).read_bytes() == (tmp_path / "theirs" / rel).read_bytes(), rel


@pytest.mark.parametrize("dtype", ["uint8", "int32", "float32", "float64", "complex64", "bool", "bfloat16"])
def test_zarr2_both_ways(dtype, tmp_path):
    data = sample(dtype, seed=3)
    t = ts.open({**ts_spec(tmp_path / "theirs", driver="zarr"),
                 "metadata": {"shape": list(SHAPE), "chunks": list(CHUNKS),
                              "dtype": "bfloat16" if dtype == "bfloat16" else np.dtype(dtype).str,
                              "compressor": {"id": "zstd", "level": 1}}},
                create=True).result()
    t.write(data).result()
    a = tsp.open((tmp_path / "theirs").as_uri() + "/").result()
    assert a.spec()["driver"] == "zarr"
    assert_bit_exact(a.read().result(), data)
    ours = tsp.open((tmp_path / "ours").as_uri() + "/", create=True, driver="zarr", dtype=np_dtype(dtype),
                    shape=SHAPE, chunks=CHUNKS, compression="zstd").result()
    ours[1:, 2:].write(data[1:, 2:]).result()
    back = ts.open(ts_spec(tmp_path / "ours", driver="zarr")).result().read().result()
    want = np.zeros(SHAPE, np_dtype(dtype))
    want[1:, 2:] = data[1:, 2:]
    assert_bit_exact(as_bits(back, dtype), want)


def test_labels_and_shards_visible_to_tensorstore(tmp_path):
    a = tsp.open(tmp_path.as_uri() + "/", create=True, dtype="uint8", shape=[20, 30],
                 chunks=[4, 5], shards=[8, 10], dimension_names=["y", "x"]).result()
    a.write(np.arange(600).reshape(20, 30).astype(np.uint8)).result()
    t = ts.open(ts_spec(tmp_path)).result()
    assert list(t.domain.labels) == ["y", "x"]
    assert tuple(t.chunk_layout.read_chunk.shape) == (4, 5)
    assert tuple(t.chunk_layout.write_chunk.shape) == (8, 10)
    np.testing.assert_array_equal(t.read().result(), a.read().result())


@pytest.mark.parametrize("encoding", [
    {"name": "default", "configuration": {"separator": "."}},
    {"name": "v2", "configuration": {"separator": "."}},
    {"name": "v2", "configuration": {"separator": "/"}},
], ids=lambda e: f"{e['name']}{e['configuration']['separator']}")
def test_chunk_key_encodings_and_3d_sharded_transpose(encoding, tmp_path):
    shape, inner, shard = (5, 6, 7), (2, 4, 3), (4, 4, 6)
    meta = {
        "shape": list(shape), "data_type": "uint16", "fill_value": 9,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard)}},
        "chunk_key_encoding": encoding,
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(inner),
            "codecs": [{"name": "transpose", "configuration": {"order": [2, 0, 1]}},
                       {"name": "bytes", "configuration": {"endian": "big"}},
                       {"name": "blosc", "configuration": {"cname": "zstd", "clevel": 3,
                                                           "shuffle": "bitshuffle", "typesize": 2,
                                                           "blocksize": 0}}],
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                             {"name": "crc32c"}],
            "index_location": "end"}}],
    }
    data = np.random.default_rng(7).integers(0, 60000, shape, dtype=np.uint16)
    a = tsp.open({"driver": "zarr3", "kvstore": (tmp_path / "ours").as_uri() + "/", "metadata": meta},
                 create=True).result()
    a[:, 2:].write(data[:, 2:]).result()
    want = data.copy()
    want[:, :2] = 9
    assert_bit_exact(ts.open(ts_spec(tmp_path / "ours")).result().read().result(), want)
    t = ts.open(ts_spec(tmp_path / "theirs", meta), create=True).result()
    t.write(data).result()
    b = tsp.open((tmp_path / "theirs").as_uri() + "/").result()
    assert_bit_exact(b[1:4, ::-1, 6].read().result(), data[1:4, ::-1, 6])
