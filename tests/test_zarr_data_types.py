"""Strings, bytes, datetimes and fixed-length text in zarr v3 and v2, with
zarr-python (and TensorStore for v2 ``|S``) as oracles, both ways.

Each case: zarr-python writes part of an array (some chunks stay missing, so the
fill value as zarr-python writes it is read back), we read it with the natural
numpy dtype; we write the same values under the same metadata (and through
``tsp.open``'s keywords), zarr-python reads them, and where no compressor is
involved the chunk files are byte-identical.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from zarr.core.dtype import VariableLengthBytes

import tensorstore_py as tsp
from tensorstore_py.drivers.dtypes import BYTES_DTYPE, STRING_DTYPE, dtype_from_v2, dtype_from_v3
from tensorstore_py.errors import (
    DataCorruptionError,
    InvalidArgumentError,
    InvalidSpecError,
    UnsupportedError,
)

# zarr-python warns that these data types have no zarr3 specification yet
pytestmark = pytest.mark.filterwarnings("ignore:The data type .* does not have a Zarr V3 specification")

SHAPE = (9,)
CHUNKS = (2,)
WRITTEN = slice(1, 6)  # chunks 3 and 4 stay missing: they read as the fill value

VALUES: dict[str, np.ndarray] = {
    "string": np.array(["", "a", "héllo wörld", "\x00nul\x00", "long " * 40, "x", "y", "z", "w"],
                       dtype=STRING_DTYPE),
    "bytes": np.array([b"", b"\x00", b"ab\x00", b"\xff" * 100, b"q", b"r", b"s", b"t", b"u"],
                      dtype=object),
    "datetime": np.array([0, 1, -5, 2**40, 7, 8, 9, 10, 11]).astype("M8[10ms]"),
    "timedelta": np.array([0, 1, -5, 2**40, 7, 8, 9, 10, 11]).astype("m8[s]"),
    "U": np.array(["", "a", "héllo", "abcd", "x", "y", "z", "w", "v"], dtype="<U5"),
    "S": np.array([b"", b"a", b"b\x00c", b"abcde", b"x", b"y", b"z", b"w", b"v"], dtype="S5"),
    "V": np.array([b"abc", b"\x00\x01\x02", b"xyz", b"\xff\xff\xff"] + [b"qqq"] * 5, dtype="V3"),
}


def zarr_dtype(name: str) -> Any:
    """The data type argument zarr-python takes for our case."""
    return {"string": str, "bytes": VariableLengthBytes()}.get(name, VALUES[name].dtype)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values and dtype (times compared by their integers: NaT != NaT)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind in "mM":
        return bool((a.view("i8") == b.view("i8")).all())
    return bool((a == b).all())


def expected(name: str, fill: Any) -> np.ndarray:
    out = np.full(SHAPE, fill, dtype=VALUES[name].dtype)
    out[WRITTEN] = VALUES[name][WRITTEN]
    return out


def chunk_files(p: Path) -> dict[str, bytes]:
    """The chunk files under ``p`` (no metadata, no lock files of the file store)."""
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*"))
            if f.is_file() and not f.name.startswith((".z", "zarr.json")) and ".__tsp__" not in f.parts}


V3_CASES = [(n, s, c) for n in VALUES for s in (None, (4,)) for c in (None, "zstd")
            if not (n == "V" and s)]  # zarr-python 3.1 cannot shard raw_bytes (unhashable void)


@pytest.mark.parametrize("name,shards,compressor", V3_CASES, ids=str)
def test_v3_data_types_interop_both_ways(tmp_path: Path, name: str, shards: Any, compressor: Any) -> None:
    src = tmp_path / "theirs"
    comp = [zarr.codecs.ZstdCodec(level=1)] if compressor else None
    z = zarr.create_array(str(src), shape=SHAPE, chunks=CHUNKS, shards=shards, dtype=zarr_dtype(name),
                          compressors=comp)
    z[WRITTEN] = VALUES[name][WRITTEN]
    meta = json.loads((src / "zarr.json").read_text())
    theirs = z[:]

    a = tsp.open("file://" + str(src)).result()
    assert a.dtype == VALUES[name].dtype
    got = a.read().result()
    assert same(got, theirs)
    assert same(got, expected(name, z.fill_value))
    assert same(a[2:8:3].read().result(), theirs[2:8:3])

    dst = tmp_path / "ours"
    fields = {k: meta[k] for k in ("shape", "data_type", "chunk_grid", "fill_value", "codecs")}
    b = tsp.open({"driver": "zarr3", "kvstore": "file://" + str(dst), "metadata": fields},
                 create=True).result()
    b[WRITTEN] = VALUES[name][WRITTEN]
    assert same(zarr.open_array(str(dst), mode="r")[:], theirs)
    if compressor is None:
        assert chunk_files(dst) == chunk_files(src)


@pytest.mark.parametrize("name", list(VALUES))
def test_v3_created_from_keywords_reads_in_zarr_python(tmp_path: Path, name: str) -> None:
    dtype = {"string": str, "bytes": bytes}.get(name, VALUES[name].dtype)
    a = tsp.open("file://" + str(tmp_path), create=True, dtype=dtype, shape=SHAPE, chunks=CHUNKS,
                 compression="zstd").result()
    assert a.dtype == VALUES[name].dtype
    a[WRITTEN] = VALUES[name][WRITTEN]
    z = zarr.open_array(str(tmp_path), mode="r")
    assert same(z[:], a.read().result())
    assert same(z[:], expected(name, z.fill_value))
    # defaults as zarr-python's: NaT for times, empty strings/bytes, zero bytes
    meta = json.loads((tmp_path / "zarr.json").read_text())
    assert meta["fill_value"] == {"datetime": -(2**63), "timedelta": -(2**63), "V": "AAAA"}.get(name, "")
    assert meta["data_type"] == zarr.open_array(str(tmp_path)).metadata.to_dict()["data_type"]
    # reopening with the same keyword dtype is accepted
    tsp.open("file://" + str(tmp_path), dtype=dtype).result()


V3_FILLS = [  # (case, fill as given to zarr-python, its JSON)
    ("string", "zz", "zz"),
    ("bytes", b"\x00fill", "AGZpbGw="),
    ("datetime", np.datetime64("2001-02-03T04:05:06.07"), 98117310607),
    ("U", "é", "é"),
    ("S", b"ab", "YWI="),
]


@pytest.mark.parametrize("name,fill,fill_json", V3_FILLS, ids=[c[0] for c in V3_FILLS])
def test_v3_fill_values_as_zarr_python_writes_them(tmp_path: Path, name: str, fill: Any, fill_json: Any) -> None:
    z = zarr.create_array(str(tmp_path / "z"), shape=SHAPE, chunks=CHUNKS, dtype=zarr_dtype(name),
                          fill_value=fill)
    assert json.loads((tmp_path / "z" / "zarr.json").read_text())["fill_value"] == fill_json
    a = tsp.open("file://" + str(tmp_path / "z")).result()
    assert same(a.read().result(), z[:])
    b = tsp.open("file://" + str(tmp_path / "t"), create=True, dtype=a.dtype, shape=SHAPE,
                 chunks=CHUNKS, fill_value=fill).result()
    assert json.loads((tmp_path / "t" / "zarr.json").read_text())["fill_value"] == fill_json
    assert same(zarr.open_array(str(tmp_path / "t"))[:], z[:])
    assert b.fill_value == a.fill_value


V2_CASES = ["string", "bytes", "datetime", "timedelta", "U", "S"]


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("name", V2_CASES)
def test_v2_data_types_interop_both_ways(tmp_path: Path, name: str, order: str) -> None:
    shape, chunks = (3, 3), (2, 2)
    vals = VALUES[name].reshape(shape)
    region = (slice(0, 2), slice(0, 3))
    z = zarr.create_array(str(tmp_path / "z"), shape=shape, chunks=chunks, dtype=zarr_dtype(name),
                          zarr_format=2, order=order, compressors=None)
    z[region] = vals[region]
    a = tsp.open("file://" + str(tmp_path / "z")).result()
    assert a.dtype == vals.dtype
    assert same(a.read().result(), z[:])

    meta = json.loads((tmp_path / "z" / ".zarray").read_text())
    b = tsp.open({"driver": "zarr", "kvstore": "file://" + str(tmp_path / "t"), "metadata": meta},
                 create=True).result()
    b[region] = vals[region]
    assert same(zarr.open_array(str(tmp_path / "t"), mode="r")[:], z[:])
    assert chunk_files(tmp_path / "t") == chunk_files(tmp_path / "z")

    kw = tsp.open({"driver": "zarr", "kvstore": "file://" + str(tmp_path / "k")}, create=True,
                  dtype={"string": str, "bytes": bytes}.get(name, vals.dtype), shape=shape, chunks=chunks,
                  order=order, compression="gzip").result()
    kw[region] = vals[region]
    assert same(zarr.open_array(str(tmp_path / "k"), mode="r")[:], z[:])


V2_NULL_FILLS = [("|O", [{"id": "vlen-utf8"}], ""), ("|O", [{"id": "vlen-bytes"}], b""),
                 ("<M8[ns]", None, np.datetime64("NaT", "ns")), ("|S3", None, b""), ("<U2", None, ""),
                 ("|V2", None, b"\x00\x00")]


@pytest.mark.parametrize("dtype,filters,fill", V2_NULL_FILLS, ids=[c[0] + str(c[1]) for c in V2_NULL_FILLS])
def test_v2_null_fill_reads_as_zarr_python_reads_it(tmp_path: Path, dtype: str, filters: Any, fill: Any) -> None:
    (tmp_path / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [2], "chunks": [2], "dtype": dtype, "compressor": None,
        "fill_value": None, "order": "C", "filters": filters}))
    got = tsp.open("file://" + str(tmp_path)).result().read().result()
    theirs = zarr.open_array(str(tmp_path), mode="r")[:]
    assert same(got, theirs)
    assert same(got, np.full(2, fill, dtype=got.dtype))


def test_v2_fill_values_zarr_python_2_style(tmp_path: Path) -> None:
    """zarr-python 2 wrote 0 as the fill of string arrays (read as "0"), and
    base64 fill values for |S; TensorStore requires the base64 of all n bytes."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [2], "chunks": [2], "dtype": "|O", "compressor": None,
        "fill_value": 0, "order": "C", "filters": [{"id": "vlen-utf8"}]}))
    got = tsp.open("file://" + str(tmp_path / "s")).result().read().result()
    assert same(got, zarr.open_array(str(tmp_path / "s"), mode="r")[:])
    assert list(got) == ["0", "0"]
    a = tsp.open({"driver": "zarr", "kvstore": "file://" + str(tmp_path / "b")}, create=True, dtype="S4",
                 shape=[2], chunks=[2], fill_value=b"ab").result()
    assert json.loads((tmp_path / "b" / ".zarray").read_text())["fill_value"] == "YWIAAA=="
    assert list(zarr.open_array(str(tmp_path / "b"), mode="r")[:]) == [b"ab", b"ab"]
    assert a.fill_value == b"ab"


def test_v2_fixed_bytes_interop_with_tensorstore(tmp_path: Path) -> None:
    """TensorStore presents zarr v2 ``|S5`` as ``char`` with a trailing dim of 5."""
    ts = pytest.importorskip("tensorstore")
    vals = VALUES["S"][:4]
    t = ts.open({"driver": "zarr", "kvstore": "file://" + str(tmp_path / "ts"),
                 "metadata": {"shape": [4], "chunks": [3], "dtype": "|S5", "compressor": {"id": "zlib", "level": 1}}},
                create=True).result()
    t[...] = np.frombuffer(vals.tobytes(), dtype="S1").reshape(4, 5)
    got = tsp.open("file://" + str(tmp_path / "ts")).result().read().result()
    assert same(got, vals)

    a = tsp.open({"driver": "zarr", "kvstore": "file://" + str(tmp_path / "ours")}, create=True,
                 dtype="S5", shape=[5], chunks=[3], fill_value=b"fi", compression="zstd").result()
    a[:4] = vals
    # TensorStore's Python API cannot hand char arrays to numpy: it copies ours
    # (missing chunk = our padded fill value) into an array of its own instead
    t2 = ts.open({"driver": "zarr", "kvstore": "file://" + str(tmp_path / "ours")}).result()
    assert t2.shape == (5, 5)
    copy = ts.open({"driver": "zarr", "kvstore": "file://" + str(tmp_path / "copy"),
                    "metadata": {"shape": [5], "chunks": [5], "dtype": "|S5", "compressor": None}},
                   create=True).result()
    copy.write(t2).result()
    got = tsp.open("file://" + str(tmp_path / "copy")).result().read().result()
    assert same(got, np.append(vals, np.array(b"fi", "S5")))


@pytest.mark.parametrize("url", ["memory://dt/", "file"])
def test_vlen_partial_writes_merge_and_all_fill_chunks_are_deleted(tmp_path: Path, url: str) -> None:
    """Read-modify-write of string chunks (async and blocking-store paths), and a
    chunk set back to the fill value is deleted (value comparison, no bit view)."""
    url = "file://" + str(tmp_path) if url == "file" else url
    a = tsp.open(url, create=True, delete_existing=True, dtype=str, shape=[6], chunks=[4],
                 fill_value="-").result()
    a[1:3] = ["b", "c"]
    a[2:5] = ["C", "D", "E"]
    assert list(a.read().result()) == ["-", "b", "C", "D", "E", "-"]
    a[:] = "-"
    assert list(a.kvstore.list().result()) == ["zarr.json"]
    big = np.array([str(i) * (i % 7) for i in range(20000)], dtype=STRING_DTYPE)  # > 64 KiB of pointers
    b = tsp.open(url + "big/" if url.startswith("memory") else url + "/big", create=True,
                 delete_existing=True, dtype=str, shape=big.shape, chunks=[3000]).result()
    b[:] = big
    assert same(b.read().result(), big)
    assert same(b[::-7].read().result(), big[::-7])


def test_writes_of_the_wrong_element_type_fail_before_any_io(tmp_path: Path) -> None:
    s = tsp.open("file://" + str(tmp_path / "s"), create=True, dtype=str, shape=[3], chunks=[1]).result()
    b = tsp.open("file://" + str(tmp_path / "b"), create=True, dtype=bytes, shape=[3], chunks=[1]).result()
    for arr, bad in [(s, [b"x", b"y", b"z"]), (s, np.array(["a", 1, "c"], dtype=object)),
                     (b, ["x", "y", "z"]), (b, np.array([b"a", None, b"c"], dtype=object)), (s, [1, 2, 3])]:
        with pytest.raises(InvalidArgumentError, match="expected (str|bytes) elements"):
            arr.write(bad)
    assert chunk_files(tmp_path / "s") == {} and chunk_files(tmp_path / "b") == {}
    s[:] = np.array(["a", "b", "c"], dtype=object)  # objects that are all str are fine
    b[:] = np.array([b"a", b"b\x00", b""], dtype="S2")
    assert list(b.read().result()) == [b"a", b"b", b""]  # numpy's S drops trailing NULs
    b[:] = [b"a", b"b\x00", b""]  # a list keeps them
    assert list(b.read().result()) == [b"a", b"b\x00", b""]


def _one_chunk_array(tmp_path: Path, fmt: str, dtype: Any) -> tuple[Any, Path]:
    a = tsp.open({"driver": fmt, "kvstore": "file://" + str(tmp_path)}, create=True, dtype=dtype,
                 shape=[3], chunks=[3]).result()
    return a, tmp_path / ("c/0" if fmt == "zarr3" else "0")


@pytest.mark.parametrize("fmt", ["zarr3", "zarr"])
@pytest.mark.parametrize("dtype", [str, bytes])
def test_hostile_vlen_chunks_are_typed_errors_before_allocation(tmp_path: Path, fmt: str, dtype: Any) -> None:
    a, chunk = _one_chunk_array(tmp_path, fmt, dtype)
    good = struct.pack("<IIsI", 3, 1, b"a", 0) + struct.pack("<I", 0)
    bad = {
        "a count of 2^31 elements": struct.pack("<I", 2**31) + good[4:],
        "a count below the chunk's": struct.pack("<I", 2) + good[4:],
        "a length past the end": struct.pack("<III", 3, 2**31, 0),
        "three bytes": b"\x03\x00\x00",
    }
    if dtype is str:
        bad["invalid UTF-8"] = struct.pack("<IIsII", 3, 1, b"\xff", 0, 0)
    for why, raw in bad.items():
        chunk.parent.mkdir(parents=True, exist_ok=True)
        chunk.write_bytes(raw)
        with pytest.raises(DataCorruptionError, match="chunk"):
            a.read().result()
        assert why
    chunk.write_bytes(good)
    assert list(a.read().result()) == (["a", "", ""] if dtype is str else [b"a", b"", b""])


@pytest.mark.parametrize("data_type,exc,match", [
    ("float128", UnsupportedError, "'float128' is not supported; supported: .*string"),
    ({"name": "structured", "configuration": {"fields": []}}, UnsupportedError, "'structured'.*numpy.datetime64"),
    ({"name": "numpy.datetime64", "configuration": {"unit": "fortnight", "scale_factor": 1}},
     InvalidSpecError, "unit"),
    ({"name": "numpy.timedelta64", "configuration": {"unit": "s", "scale_factor": 0}},
     InvalidSpecError, "scale_factor"),
    ({"name": "numpy.datetime64"}, InvalidSpecError, "configuration"),
    ({"name": "fixed_length_utf32", "configuration": {"length_bytes": 5}}, InvalidSpecError, "multiple of 4"),
    ({"name": "null_terminated_bytes", "configuration": {"length_bytes": 2**40}}, UnsupportedError, "maximum"),
    (7, InvalidSpecError, "data_type"),
    ({"configuration": {}}, InvalidSpecError, "data_type"),
])
def test_v3_data_type_errors(data_type: Any, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        dtype_from_v3(data_type)


@pytest.mark.parametrize("dtype,filters,exc,match", [
    ("|O", [{"id": "json2"}], UnsupportedError, "object codec 'json2'.*vlen-utf8, vlen-bytes"),
    ("|O", None, UnsupportedError, "object codec None"),
    ([["a", "<i4"]], None, UnsupportedError, "structured"),
    ("<U0", None, UnsupportedError, "kind"),
    (5, None, InvalidSpecError, "dtype"),
])
def test_v2_dtype_errors(tmp_path: Path, dtype: Any, filters: Any, exc: type, match: str) -> None:
    (tmp_path / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [2], "chunks": [2], "dtype": dtype, "compressor": None,
        "fill_value": None, "order": "C", "filters": filters}))
    with pytest.raises(exc, match=match):
        tsp.open("file://" + str(tmp_path)).result()


def test_v2_unknown_codec_lists_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [2], "chunks": [2], "dtype": "<i4", "compressor": {"id": "nonesuch"},
        "fill_value": None, "order": "C", "filters": None}))
    with pytest.raises(UnsupportedError, match="'nonesuch'; supported: .*zstd"):
        tsp.open("file://" + str(tmp_path)).result()


@pytest.mark.parametrize("driver", ["zarr3", "zarr"])
def test_creating_an_unsupported_dtype_names_it_and_the_supported_ones(tmp_path: Path, driver: str) -> None:
    dt = np.dtype([("a", "<i4")])
    with pytest.raises(UnsupportedError, match=r"\[\('a', '<i4'\)\].*supported: .*(string|str and bytes)"):
        tsp.open({"driver": driver, "kvstore": "file://" + str(tmp_path)}, create=True, dtype=dt,
                 shape=[2]).result()
    assert not any(tmp_path.iterdir())


def test_the_byte_budget_counts_an_estimate_per_variable_length_element(tmp_path: Path) -> None:
    a = tsp.open("file://" + str(tmp_path), create=True, dtype=str, shape=[100], chunks=[10]).result()
    assert a.base._driver._chunk_nbytes == 10 * (STRING_DTYPE.itemsize + 64)


def test_natural_dtypes() -> None:
    assert dtype_from_v3("string") == STRING_DTYPE and STRING_DTYPE.kind == "T"
    assert dtype_from_v3("variable_length_bytes") == BYTES_DTYPE == np.dtype(object)
    assert dtype_from_v3({"name": "numpy.datetime64", "configuration": {"unit": "generic", "scale_factor": 1}}) \
        == np.dtype("M8")
    assert dtype_from_v2("<M8[ns]") == np.dtype("M8[ns]")
    assert dtype_from_v2(">U3") == np.dtype(">U3")  # stored big-endian, read native


def test_checkpoints_store_fixed_size_types_and_refuse_variable_length_ones(tmp_path: Path) -> None:
    """Checkpoint chunks are raw bytes: times and fixed-length text round-trip,
    strings and object arrays are refused up front (their memory is pointers)."""
    tree = {"t": VALUES["datetime"], "u": VALUES["U"], "s": VALUES["S"]}
    tsp.checkpoint.save(str(tmp_path), tree, step=1).result()
    back = tsp.checkpoint.restore(str(tmp_path), step=1)
    assert all(same(back[k], v) for k, v in tree.items())
    for leaf in (VALUES["string"], VALUES["bytes"]):
        with pytest.raises(InvalidArgumentError, match="can not be stored"):
            tsp.checkpoint.save(str(tmp_path), {"x": leaf}, step=2).result()
