"""zarr v2 driver: interop with zarr-python (format 2) and TensorStore's zarr driver."""

from __future__ import annotations

import json
import os

import numcodecs
import numpy as np
import pytest
import tensorstore as ts
import zarr
from test_driver_helpers import open_sync, read, write

from tensorstore_py.drivers.open import build_metadata
from tensorstore_py.errors import (
    DataCorruptionError,
    InvalidSpecError,
    NotFoundError,
    UnsupportedError,
)

SHAPE = (29, 17)
CHUNKS = (8, 6)

COMPRESSORS = {
    "none": None,
    "blosc": numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE),
    "zstd": numcodecs.Zstd(level=3),
    "zlib": numcodecs.Zlib(level=4),
    "gzip": numcodecs.GZip(level=5),
    "bz2": numcodecs.BZ2(level=2),
    "lz4": numcodecs.LZ4(),
}


def _data(dtype="<i4", seed=0):
    x = np.random.default_rng(seed).integers(-1000, 1000, SHAPE).astype(dtype)
    x[:8, :6] = 0
    return x


def _files(root):
    out = {}
    for d, _dirs, files in os.walk(root):
        if ".__tsp__" in d:
            continue
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            if not rel.startswith(".z"):
                out[rel] = open(os.path.join(d, f), "rb").read()
    return out


@pytest.mark.parametrize("comp", sorted(COMPRESSORS))
@pytest.mark.parametrize("order", ["C", "F"])
def test_zarr_python_v2_both_ways(tmp_path, comp, order):
    x = _data()
    zp = str(tmp_path / "zp")
    z = zarr.create_array(zp, shape=SHAPE, chunks=CHUNKS, dtype="<i4", zarr_format=2,
                          compressors=COMPRESSORS[comp], order=order, fill_value=0)
    z[:] = x
    a = open_sync({"driver": "zarr", "kvstore": "file://" + zp})
    assert (read(a) == x).all()
    assert (read(a, (slice(1, 29, 5), slice(2, 17, 2))) == x[1:29:5, 2:17:2]).all()
    meta = json.loads(open(zp + "/.zarray").read())
    ours = str(tmp_path / "ours")
    b = open_sync({"driver": "zarr", "kvstore": "file://" + ours, "metadata": meta}, create=True)
    write(b, x)
    assert (zarr.open_array(ours, mode="r")[:] == x).all()
    if comp in ("none", "zstd", "zlib", "bz2", "lz4", "blosc"):
        assert _files(ours) == _files(zp)


@pytest.mark.parametrize("dtype", ["<f8", ">f4", ">i2", "|u1", "|b1", "<c8", ">u8"])
@pytest.mark.parametrize("sep", [".", "/"])
def test_dtypes_and_separators_with_tensorstore(tmp_path, dtype, sep):
    x = _data("<i4").astype(dtype)
    meta = {"zarr_format": 2, "shape": list(SHAPE), "chunks": list(CHUNKS), "dtype": dtype,
            "compressor": {"id": "zstd", "level": 1}, "fill_value": None, "order": "C",
            "filters": None, "dimension_separator": sep}
    ours, theirs = str(tmp_path / "o"), str(tmp_path / "t")
    write(open_sync({"driver": "zarr", "kvstore": "file://" + ours, "metadata": meta}, create=True),
          x.astype(x.dtype.newbyteorder("=")))
    t = ts.open({"driver": "zarr", "kvstore": "file://" + theirs, "metadata": meta}, create=True).result()
    t.write(x).result()
    got = ts.open({"driver": "zarr", "kvstore": "file://" + ours}).result().read().result()
    assert (got == x).all()
    b = open_sync({"driver": "zarr", "kvstore": "file://" + theirs})
    assert (read(b) == x).all()
    # with fill_value null TensorStore also stores all-zero chunks; we omit them
    assert set(_files(ours)) <= set(_files(theirs))
    assert (zarr.open_array(ours, mode="r")[:] == x).all()


def test_filters_delta_and_shuffle(tmp_path):
    x = _data("<i8")
    zp = str(tmp_path / "zp")
    z = zarr.create_array(zp, shape=SHAPE, chunks=CHUNKS, dtype="<i8", zarr_format=2,
                          filters=[numcodecs.Delta(dtype="<i8"), numcodecs.Shuffle(elementsize=8)],
                          compressors=numcodecs.Zstd(level=1), fill_value=0)
    z[:] = x
    a = open_sync({"driver": "zarr", "kvstore": "file://" + zp})
    assert (read(a) == x).all()
    meta = json.loads(open(zp + "/.zarray").read())
    b = open_sync({"driver": "zarr", "kvstore": "file://" + str(tmp_path / "o"), "metadata": meta}, create=True)
    write(b, x)
    assert _files(str(tmp_path / "o")) == _files(zp)


def test_fill_value_nan_and_null(tmp_path):
    m = build_metadata("zarr", shape=SHAPE, dtype="float32", chunks=CHUNKS, fill_value=float("nan"))
    p = str(tmp_path / "a")
    a = open_sync({"driver": "zarr", "kvstore": "file://" + p, "metadata": m}, create=True)
    assert json.loads(open(p + "/.zarray").read())["fill_value"] == "NaN"
    assert np.isnan(read(a)).all()
    assert np.isnan(zarr.open_array(p, mode="r")[:]).all()
    m2 = build_metadata("zarr", shape=SHAPE, dtype="int16", chunks=CHUNKS)
    b = open_sync({"driver": "zarr", "kvstore": "file://" + str(tmp_path / "b"), "metadata": m2}, create=True)
    assert b.fill_value == 0 and (read(b) == 0).all()


def test_attrs_untouched_and_errors(tmp_path):
    p = tmp_path / "a"
    z = zarr.create_array(str(p), shape=SHAPE, chunks=CHUNKS, dtype="<i4", zarr_format=2)
    z.attrs["x"] = 1
    before = (p / ".zattrs").read_bytes()
    a = open_sync({"driver": "zarr", "kvstore": "file://" + str(p)})
    write(a, _data())
    b = open_sync({"driver": "zarr", "kvstore": "file://" + str(p),
                   "metadata": {"dtype": "<i4", "chunks": list(CHUNKS)}}, create=True)
    assert b.shape == SHAPE
    run_resize = __import__("tensorstore_py.core.future", fromlist=["run_sync"]).run_sync
    c = run_resize(a.resize((10, 17)))
    assert c.shape == (10, 17)
    assert zarr.open_array(str(p), mode="r").shape == (10, 17)
    assert (p / ".zattrs").read_bytes() == before
    with pytest.raises(InvalidSpecError, match="dtype"):
        open_sync({"driver": "zarr", "kvstore": "file://" + str(p), "metadata": {"dtype": "<f4"}})
    with pytest.raises(NotFoundError, match=".zarray"):
        open_sync({"driver": "zarr", "kvstore": "file://" + str(tmp_path / "nothing")})
    bad = tmp_path / "bad"
    bad.mkdir()
    meta = json.loads((p / ".zarray").read_text())
    (bad / ".zarray").write_text(json.dumps({**meta, "compressor": {"id": "nonesuch"}}))
    with pytest.raises(UnsupportedError, match="nonesuch"):
        open_sync({"driver": "zarr", "kvstore": "file://" + str(bad)})
    (bad / ".zarray").write_text(json.dumps({**meta, "chunks": [1 << 20, 1 << 20]}))
    with pytest.raises(InvalidSpecError, match="chunks"):
        open_sync({"driver": "zarr", "kvstore": "file://" + str(bad)})
    (bad / ".zarray").write_text("{not json")
    with pytest.raises(InvalidSpecError, match=".zarray"):
        open_sync({"driver": "zarr", "kvstore": "file://" + str(bad)})


def test_corrupt_and_bomb_chunks(tmp_path):
    p = str(tmp_path / "a")
    m = build_metadata("zarr", shape=SHAPE, dtype="int32", chunks=CHUNKS, compression="zstd")
    a = open_sync({"driver": "zarr", "kvstore": "file://" + p, "metadata": m}, create=True)
    write(a, _data() + 1)
    open(p + "/1.1", "wb").write(numcodecs.Zstd().encode(bytes(100 << 20)))
    with pytest.raises(DataCorruptionError, match="1.1"):
        read(a)
    open(p + "/1.1", "wb").write(b"garbage")
    with pytest.raises(DataCorruptionError, match="1.1"):
        read(a)
