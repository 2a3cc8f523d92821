"""zarr v3 driver: byte-exact interop with TensorStore and zarr-python, metadata
validation, fill-value semantics, corruption and bad input."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr
from test_driver_helpers import open_sync, read, write

from tensorstore_py.core.future import run_sync
from tensorstore_py.drivers.open import build_metadata
from tensorstore_py.errors import (
    ChecksumError,
    DataCorruptionError,
    InvalidSpecError,
    NotFoundError,
    UnsupportedError,
)

SHAPE = (23, 18)  # ragged edge chunks with 8x5 chunks
CHUNKS = (8, 5)

CODECS = {
    "raw": [],
    "zstd": [{"name": "zstd", "configuration": {"level": 3, "checksum": False}}],
    "zstd_crc": [{"name": "zstd", "configuration": {"level": 1, "checksum": True}}, {"name": "crc32c"}],
    "gzip": [{"name": "gzip", "configuration": {"level": 6}}],
    "blosc": [{"name": "blosc", "configuration": {"cname": "lz4", "clevel": 5, "shuffle": "shuffle",
                                                   "typesize": 4, "blocksize": 0}}],
    "crc": [{"name": "crc32c"}],
}
DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128", "bfloat16", "float8_e4m3fn",
          "float8_e5m2"]


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def _data(name: str, shape=SHAPE, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = _np_dtype(name)
    if dt.kind == "b":
        return rng.random(shape) > 0.5
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    x = rng.standard_normal(shape) * 4
    if dt.kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    x = x.astype(dt)
    x[0, :3] = 0  # some fill-valued elements
    return x


def _meta(dtype: str, codecs: list, endian: str = "little", fill=0, **extra) -> dict:
    dt = _np_dtype(dtype)
    bytes_codec = {"name": "bytes"} if dt.itemsize == 1 else {"name": "bytes", "configuration": {"endian": endian}}
    if dt.kind == "c":
        fill = [fill, 0]
    elif dt.kind == "b":
        fill = False
    return {
        "zarr_format": 3, "node_type": "array", "shape": list(SHAPE), "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(CHUNKS)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill, "codecs": [bytes_codec] + codecs, **extra,
    }


def _chunk_files(root: str) -> dict[str, bytes]:
    out = {}
    for d, _dirs, files in os.walk(root):
        if ".__tsp__" in d:
            continue
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            if rel != "zarr.json":
                with open(os.path.join(d, f), "rb") as fh:
                    out[rel] = fh.read()
    return out


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == np.asarray(b, dtype=a.dtype).tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_interop_with_tensorstore_both_ways(tmp_path, dtype):
    meta = _meta(dtype, CODECS["crc"])
    x = _data(dtype)
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + ours, "metadata": meta}, create=True)
    write(a, x)
    t = ts.open({"driver": "zarr3", "kvstore": "file://" + theirs, "metadata": meta}, create=True).result()
    t.write(x).result()
    # they read ours, we read theirs, and the chunk bytes are identical
    got = ts.open({"driver": "zarr3", "kvstore": "file://" + ours}).result().read().result()
    assert _equal(x, got)
    b = open_sync({"driver": "zarr3", "kvstore": "file://" + theirs})
    assert b.dtype == _np_dtype(dtype)
    assert _equal(x, read(b))
    assert _chunk_files(ours) == _chunk_files(theirs)


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("endian", ["little", "big"])
def test_codecs_interop(tmp_path, codec, endian):
    meta = _meta("float32", CODECS[codec], endian=endian)
    x = _data("float32")
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    write(open_sync({"driver": "zarr3", "kvstore": "file://" + ours, "metadata": meta}, create=True), x)
    t = ts.open({"driver": "zarr3", "kvstore": "file://" + theirs, "metadata": meta}, create=True).result()
    t.write(x).result()
    assert _equal(x, ts.open({"driver": "zarr3", "kvstore": "file://" + ours}).result().read().result())
    assert _equal(x, zarr.open_array(ours, mode="r")[:])
    assert _equal(x, read(open_sync({"driver": "zarr3", "kvstore": "file://" + theirs})))
    # TensorStore bundles its own zlib/zstd/blosc builds whose output differs
    # from numcodecs' (each decodes the other's); zarr-python uses numcodecs.
    if codec not in ("blosc", "zstd", "zstd_crc", "gzip"):
        assert _chunk_files(ours) == _chunk_files(theirs)
    elif codec != "gzip":  # gzip headers differ (OS byte) between writers
        _zarr_python_write(tmp_path / "zp", meta, x)
        assert _chunk_files(ours) == _chunk_files(str(tmp_path / "zp"))


def _zarr_python_write(path, meta: dict, x: np.ndarray) -> None:
    path.mkdir()
    (path / "zarr.json").write_text(json.dumps(meta))
    z = zarr.open_array(str(path), mode="r+", config={"write_empty_chunks": False})
    z[...] = x


@pytest.mark.parametrize("codec", ["raw", "zstd", "gzip", "blosc", "crc"])
def test_reads_what_zarr_python_writes(tmp_path, codec):
    from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, ZstdCodec

    comp = {"raw": [], "zstd": [ZstdCodec(level=2)], "gzip": [GzipCodec(level=4)],
            "blosc": [BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle")], "crc": [Crc32cCodec()]}[codec]
    x = _data("int32", seed=3)
    z = zarr.create_array(str(tmp_path / "z"), shape=SHAPE, chunks=CHUNKS, dtype="int32",
                          serializer=BytesCodec(endian="big"), compressors=comp, fill_value=7)
    z[:] = x
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "z")})
    assert a.fill_value == 7
    assert _equal(x, read(a))
    assert _equal(x[3:20:3, 1:17:4], read(a, (slice(3, 20, 3), slice(1, 17, 4))))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "complex64", "uint64"])
def test_big_endian_bytes_with_tensorstore(tmp_path, dtype):
    meta = _meta(dtype, [], endian="big")
    x = _data(dtype)
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    write(open_sync({"driver": "zarr3", "kvstore": "file://" + ours, "metadata": meta}, create=True), x)
    ts.open({"driver": "zarr3", "kvstore": "file://" + theirs, "metadata": meta}, create=True).result().write(x).result()
    assert _chunk_files(ours) == _chunk_files(theirs)
    assert _equal(x, read(open_sync({"driver": "zarr3", "kvstore": "file://" + theirs})))


def test_transpose_and_key_encodings(tmp_path):
    x = _data("uint16")
    for i, enc in enumerate([{"name": "default", "configuration": {"separator": "."}},
                             {"name": "v2", "configuration": {"separator": "/"}},
                             {"name": "v2"}]):
        meta = _meta("uint16", [], chunk_key_encoding=enc)
        meta["codecs"].insert(0, {"name": "transpose", "configuration": {"order": [1, 0]}})
        ours, theirs = str(tmp_path / f"o{i}"), str(tmp_path / f"t{i}")
        write(open_sync({"driver": "zarr3", "kvstore": "file://" + ours, "metadata": meta}, create=True), x)
        ts.open({"driver": "zarr3", "kvstore": "file://" + theirs, "metadata": meta}, create=True).result().write(x).result()
        assert _chunk_files(ours) == _chunk_files(theirs)
        assert _equal(x, zarr.open_array(ours, mode="r")[:])


@pytest.mark.parametrize("fill", ["NaN", "Infinity", "-Infinity", "0x7fc00001", 1.5])
def test_fill_values(tmp_path, fill):
    meta = _meta("float32", [], fill=fill)
    p = str(tmp_path / "a")
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + p, "metadata": meta}, create=True)
    x = read(a)
    t = ts.open({"driver": "zarr3", "kvstore": "file://" + p}).result()
    assert x.tobytes() == t.read().result().tobytes()
    assert json.loads(open(p + "/zarr.json").read())["fill_value"] == fill


def test_complex_fill_and_bfloat16_jax_style(tmp_path):
    meta = _meta("complex64", [], fill=2.5)
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "c"), "metadata": meta}, create=True)
    assert read(a)[0, 0] == 2.5 + 0j
    # bfloat16 written by TensorStore's way of writing JAX parameters
    x = np.arange(40, dtype=np.float32).reshape(5, 8).astype(ml_dtypes.bfloat16)
    t = ts.open({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "b"),
                 "metadata": {"shape": [5, 8], "data_type": "bfloat16"}}, create=True).result()
    t.write(x).result()
    b = open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "b")})
    assert _equal(x, read(b))


def test_fill_chunks_are_deleted(tmp_path):
    p = str(tmp_path / "a")
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + p, "metadata": _meta("int32", [])}, create=True)
    x = np.zeros(SHAPE, np.int32)
    x[10, 10] = 5
    write(a, x)
    assert sorted(_chunk_files(p)) == ["c/1/2"]
    write(a, np.zeros((1, 1), np.int32), (slice(10, 11), slice(10, 11)))
    assert _chunk_files(p) == {}
    assert (read(a) == 0).all()


def test_missing_array_and_create_semantics(tmp_path):
    url = "file://" + str(tmp_path / "a")
    with pytest.raises(NotFoundError, match="zarr.json"):
        open_sync({"driver": "zarr3", "kvstore": url})
    meta = _meta("int32", [])
    a = open_sync({"driver": "zarr3", "kvstore": url, "metadata": meta}, create=True)
    write(a, _data("int32"))
    # compatible: opened, data kept
    b = open_sync({"driver": "zarr3", "kvstore": url, "metadata": {"data_type": "int32"}}, create=True)
    assert _equal(read(a), read(b))
    with pytest.raises(InvalidSpecError, match="data_type"):
        open_sync({"driver": "zarr3", "kvstore": url, "metadata": {"data_type": "int16"}}, create=True)
    with pytest.raises(InvalidSpecError, match="shape"):
        open_sync({"driver": "zarr3", "kvstore": url, "metadata": {"shape": [1, 2]}})
    with pytest.raises(InvalidSpecError, match="codecs"):
        open_sync({"driver": "zarr3", "kvstore": url,
                   "metadata": {"codecs": [{"name": "bytes", "configuration": {"endian": "big"}}]}})
    c = open_sync({"driver": "zarr3", "kvstore": url, "metadata": {**meta, "shape": [4, 4]}},
                  create=True, delete_existing=True)
    assert c.shape == (4, 4) and (read(c) == 0).all()


def test_concurrent_creators_one_wins(tmp_path):
    import asyncio

    from tensorstore_py.drivers.open import open_driver

    url = "file://" + str(tmp_path / "a")

    async def both():
        return await asyncio.gather(
            open_driver({"driver": "zarr3", "kvstore": url, "metadata": _meta("int32", [])}, create=True),
            open_driver({"driver": "zarr3", "kvstore": url, "metadata": _meta("int16", [])}, create=True),
            return_exceptions=True,
        )

    res = run_sync(both())
    assert sum(isinstance(r, InvalidSpecError) for r in res) == 1


@pytest.mark.parametrize(
    "field,value,exc,match",
    [
        ("data_type", "float128", UnsupportedError, "float128"),
        ("codecs", [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "lzma"}],
         UnsupportedError, "lzma"),
        ("chunk_grid", {"name": "regular", "configuration": {"chunk_shape": [2**16, 2**16]}},
         InvalidSpecError, "chunk_grid"),
        ("chunk_grid", {"name": "rectilinear"}, InvalidSpecError, "chunk_grid"),
        ("shape", [-1, 3], InvalidSpecError, "shape"),
        ("shape", [2**63, 3], InvalidSpecError, "shape"),
        ("fill_value", "banana", InvalidSpecError, "fill_value"),
        ("storage_transformers", [{"name": "x"}], InvalidSpecError, "storage_transformers"),
        ("codecs", [{"name": "gzip", "configuration": {"level": 1}}], InvalidSpecError, "codecs"),
        ("zarr_format", 2, InvalidSpecError, "zarr_format"),
        ("frobnicate", 1, InvalidSpecError, "frobnicate"),
    ],
)
def test_malformed_metadata(tmp_path, field, value, exc, match):
    meta = _meta("int32", [])
    meta[field] = value
    p = tmp_path / "a"
    p.mkdir()
    (p / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(exc, match=match):
        open_sync({"driver": "zarr3", "kvstore": "file://" + str(p)})


def test_corrupt_chunks(tmp_path):
    p = str(tmp_path / "a")
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + p,
                   "metadata": _meta("int32", CODECS["zstd"] + [{"name": "crc32c"}])}, create=True)
    write(a, _data("int32"))
    raw = bytearray(open(p + "/c/0/0", "rb").read())
    raw[5] ^= 0xFF
    open(p + "/c/0/0", "wb").write(raw)
    with pytest.raises(ChecksumError, match="c/0/0"):
        read(a)
    # a truncated raw chunk is an error, not garbage
    b = open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "b"),
                   "metadata": _meta("int32", [])}, create=True)
    write(b, _data("int32"))
    data = open(str(tmp_path / "b/c/1/1"), "rb").read()
    open(str(tmp_path / "b/c/1/1"), "wb").write(data[:-3])
    with pytest.raises(DataCorruptionError, match="c/1/1"):
        read(b)


def test_decompression_bomb_refused(tmp_path):
    import numcodecs

    p = str(tmp_path / "a")
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + p,
                   "metadata": _meta("int32", CODECS["zstd"])}, create=True)
    bomb = numcodecs.Zstd(level=1).encode(bytes(200 << 20))  # declares 200 MiB
    os.makedirs(p + "/c/0", exist_ok=True)
    open(p + "/c/0/0", "wb").write(bomb)
    with pytest.raises(DataCorruptionError, match="c/0/0"):
        read(a)
    g = open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "g"),
                   "metadata": _meta("int32", CODECS["gzip"])}, create=True)
    import gzip

    os.makedirs(str(tmp_path / "g/c/0"), exist_ok=True)
    open(str(tmp_path / "g/c/0/0"), "wb").write(gzip.compress(bytes(50 << 20), 1))
    with pytest.raises(DataCorruptionError, match="c/0/0"):
        read(g)


def test_resize_deletes_outside_chunks(tmp_path):
    p = str(tmp_path / "a")
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + p, "metadata": _meta("int32", [])}, create=True)
    x = _data("int32") | 1
    write(a, x)
    b = run_sync(a.resize((9, 18)))
    assert b.shape == (9, 18)
    assert sorted(_chunk_files(p)) == [f"c/{i}/{j}" for i in range(2) for j in range(4)]
    assert _equal(x[:9], read(b))
    assert ts.open({"driver": "zarr3", "kvstore": "file://" + p}).result().shape == (9, 18)
    c = run_sync(b.resize((30, 20)))
    assert c.shape == (30, 20)


def test_build_metadata_defaults_and_zero_dim(tmp_path):
    m = build_metadata("zarr3", shape=[4096, 4096], dtype="float32")
    cs = m["chunk_grid"]["configuration"]["chunk_shape"]
    assert 1 << 20 <= np.prod(cs) * 4 <= 4 << 20
    m0 = build_metadata("zarr3", shape=[], dtype="int32", fill_value=3)
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "z"), "metadata": m0}, create=True)
    assert read(a) == 3
    run_sync(a.write((), np.array(5, np.int32)))
    assert ts.open({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "z")}).result().read().result() == 5


def test_spec_and_with_kvstore(tmp_path):
    from tensorstore_py.kvstore.memory import MemoryKvStore

    a = open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "a"),
                   "metadata": _meta("int32", [])}, create=True)
    spec = a.spec()
    assert spec["driver"] == "zarr3" and spec["metadata"]["shape"] == list(SHAPE)
    b = open_sync(json.loads(json.dumps(spec)))
    assert b.shape == a.shape
    m = a.with_kvstore(MemoryKvStore())
    write(m, np.ones(SHAPE, np.int32))
    assert (read(m) == 1).all() and (read(a) == 0).all()
    assert a.read_chunk_shape == CHUNKS == a.write_chunk_shape


def test_codec_list_without_serializer_gets_bytes(tmp_path):
    meta = _meta("int32", [])
    meta["codecs"] = [{"name": "zstd", "configuration": {"level": 1, "checksum": False}}]
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "a"), "metadata": meta},
                  create=True)
    assert [c["name"] for c in a.metadata["codecs"]] == ["bytes", "zstd"]
    x = _data("int32")
    write(a, x)
    assert _equal(x, zarr.open_array(str(tmp_path / "a"), mode="r")[:])
    b = open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "a"),
                   "metadata": {"codecs": [{"name": "zstd", "configuration": {"level": 1}}]}})
    assert b.shape == SHAPE
