"""Untrusted input gets a typed error, before any allocation or write (issue 10 item 15).

From stored bytes (metadata documents, commit records) the errors are
InvalidSpecError / DataCorruptionError naming the document or object; from
arguments InvalidArgumentError naming the argument. Never AttributeError,
TypeError, MemoryError or a write that fails later.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned.format import (
    MAGIC_COMMIT,
    CommitRecord,
    commit_name,
    decode_entry,
    frame,
)


# -- commit records ------------------------------------------------------------------------
def _record(**fields: Any) -> bytes:
    body = {"format": 1, "version": 1, "parent": 0, "time": 1.5, "write_id": "w" * 32,
            "root": None, "changes": [], "tags": {}, "deleted": []}
    body.update(fields)
    return frame(MAGIC_COMMIT, {k: v for k, v in body.items() if v is not ...})


def test_well_formed_commit_record_decodes() -> None:
    rec = CommitRecord.decode(_record(tags={"best": 1}, deleted=[[2, 3]], message="m"), commit_name(1))
    assert (rec.version, rec.tags, rec.deleted, rec.message) == (1, {"best": 1}, [[2, 3]], "m")


@pytest.mark.parametrize("fields", [
    {"tags": [1, 2]}, {"tags": {"t": "1"}}, {"tags": {"t": True}}, {"tags": "t"},
    {"deleted": [1, 2]}, {"deleted": [[1]]}, {"deleted": [["a", "b"]]}, {"deleted": {"a": 1}},
    {"metadata": [["k", "v"]]}, {"metadata": "m"}, {"message": 5}, {"message": ["m"]},
    {"version": "1"}, {"version": 1.0}, {"version": True}, {"parent": None}, {"parent": [0]},
    {"time": "now"}, {"time": True}, {"write_id": 7}, {"write_id": ...}, {"kind": 3},
    {"count": "3"}, {"count": 2.5}, {"txn_id": 9}, {"root": 5}, {"changes": "k"}, {"changes": [1]},
    {"changes_ref": ["changes/x"]}, {"format": True}, {"format": "1"},
])
def test_malformed_commit_record_is_data_corruption(fields: dict[str, Any]) -> None:
    """AttributeError ('list' object has no attribute 'items') for a list of tags
    before; now every field of the wrong type is DataCorruptionError naming the
    record."""
    with pytest.raises(tsp.DataCorruptionError, match="00000000000000000001"):
        CommitRecord.decode(_record(**fields), commit_name(1))


@pytest.mark.parametrize("raw", [
    [b"s", "data/" + "0" * 32, True, 1, 0], [b"s", "data/" + "0" * 32, 0, False, 0],
    [b"s", "data/" + "0" * 32, 0, 1, 2**32], ["s", b"v"], [b"s", "v"], [b"s"], "x", None,
])
def test_malformed_entries_are_data_corruption(raw: Any) -> None:
    with pytest.raises(tsp.DataCorruptionError, match="node"):
        decode_entry(raw, "node nodes/x")


# -- metadata documents ---------------------------------------------------------------------
def _open_doc(key: str, doc: Any) -> tsp.TensorStore:
    kv = MemoryKvStore()
    kv.write(key, json.dumps(doc).encode()).result()
    return tsp.open({"driver": "zarr3" if key == "zarr.json" else "zarr", "kvstore": kv}).result()


def _zarr3(**fields: Any) -> dict[str, Any]:
    doc = {"zarr_format": 3, "node_type": "array", "shape": [4], "data_type": "int8",
           "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4]}},
           "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
           "fill_value": 0, "codecs": [{"name": "bytes"}]}
    doc.update(fields)
    return doc


def _zarray(**fields: Any) -> dict[str, Any]:
    doc = {"zarr_format": 2, "shape": [4], "chunks": [4], "dtype": "<i4", "compressor": None,
           "fill_value": 0, "order": "C", "filters": None}
    doc.update(fields)
    return doc


@pytest.mark.parametrize("enc", [
    {"name": "default", "configuration": ["/"]}, {"name": "default", "configuration": "/"},
    {"name": "v2", "configuration": {"separator": "/", "extra": 1}},
    {"name": "default", "configuration": {"separator": ["/"]}},
])
def test_zarr3_chunk_key_encoding_configuration(enc: Any) -> None:
    """A list as configuration raised AttributeError before."""
    with pytest.raises(tsp.InvalidSpecError, match="chunk_key_encoding"):
        _open_doc("zarr.json", _zarr3(chunk_key_encoding=enc))


@pytest.mark.parametrize("compressor", [
    {"id": "zstd", "level": {}}, {"id": "zstd", "level": "1"}, {"id": "zstd", "checksum": 1},
    {"id": "gzip", "level": 10}, {"id": "zlib", "level": "x"}, {"id": "bz2", "level": 0},
    {"id": "blosc", "cname": 5}, {"id": "blosc", "cname": "nope"}, {"id": "blosc", "shuffle": 7},
    {"id": "blosc", "clevel": None}, {"id": "lz4", "acceleration": "fast"},
    {"id": "lzma", "format": 9}, {"id": "lzma", "filters": 5}, {"id": "lzma", "preset": 10},
    {"id": "zstd", "bogus": 1},
])
def test_zarr2_compressor_configuration_is_checked_at_open(compressor: dict[str, Any]) -> None:
    """{"id": "zstd", "level": {}} opened, then every write failed with
    TypeError; now open raises InvalidSpecError naming the field."""
    with pytest.raises(tsp.InvalidSpecError, match="compressor"):
        _open_doc(".zarray", _zarray(compressor=compressor))


def test_zarr2_filter_that_can_not_encode_is_invalid_spec() -> None:
    """numcodecs takes {"id": "delta", "dtype": {}} (as a zero-size void type) and fails
    at the first write: InvalidSpecError naming the codec, nothing written."""
    kv = MemoryKvStore()
    kv.write(".zarray", json.dumps(_zarray(filters=[{"id": "delta", "dtype": {}}])).encode()).result()
    a = tsp.open({"driver": "zarr", "kvstore": kv}).result()
    with pytest.raises(tsp.InvalidSpecError, match="delta"):
        a.write(np.arange(4, dtype="<i4")).result()
    assert kv.list().result() == [".zarray"]


# -- arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    ({"dtype": "bogus"}, "dtype"), ({"dtype": 3.5}, "dtype"),
    ({"shape": [1.5]}, "shape"), ({"shape": "12"}, "shape"), ({"shape": 12}, "shape"),
    ({"shape": [-1]}, "shape"), ({"shape": [True]}, "shape"), ({"shape": [2**63]}, "shape"),
    ({"shape": [1] * 33}, "rank"), ({"chunks": [0]}, "chunks"), ({"chunks": [2.0]}, "chunks"),
    ({"shards": [None]}, "shards"), ({"dimension_names": [1]}, "dimension_names"),
    ({"dimension_names": "x"}, "dimension_names"), ({"order": "X"}, "order"),
    ({"fill_value": "abc"}, "fill_value"), ({"fill_value": 300, "dtype": "uint8"}, "fill_value"),
    ({"fill_value": [1, 2]}, "fill_value"), ({"fill_value": {}}, "fill_value"),
])
def test_open_arguments(tmp_path: Path, kwargs: dict[str, Any], name: str) -> None:
    """dtype="bogus" raised TypeError and shape=[1.5] was accepted (as [1])."""
    args: dict[str, Any] = {"dtype": "int32", "shape": [4]}
    args.update(kwargs)
    with pytest.raises(tsp.InvalidArgumentError, match=name):
        tsp.open(f"file://{tmp_path}/a", create=True, **args).result()
    assert not (tmp_path / "a").exists()


def test_open_arguments_checked_when_opening_too(tmp_path: Path) -> None:
    tsp.open(f"file://{tmp_path}", create=True, dtype="int32", shape=[4]).result()
    for kwargs in ({"dtype": "bogus"}, {"shape": [4.0]}, {"chunks": "4"}):
        with pytest.raises(tsp.InvalidArgumentError):
            tsp.open(f"file://{tmp_path}", **kwargs).result()


_HUGE_CHILD = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a 15 GiB chunk fails fast without the check
import tensorstore_py as tsp
a = tsp.open(sys.argv[1], create=True, dtype="complex128", shape=[10**9], chunks=[10**9]).result()
try:
    a[0] = 1
    print("written")
except Exception as e:
    print(type(e).__name__, e)
"""


def test_one_element_write_into_a_huge_chunk_is_refused(tmp_path: Path) -> None:
    """A one-element write into chunks=[10**9] complex128 tried to allocate (and
    write) 14.9 GiB; now InvalidArgumentError names the limit and the array,
    before any allocation, and nothing is written."""
    url = f"file://{tmp_path}/huge"
    p = subprocess.run([sys.executable, "-c", _HUGE_CHILD, url], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("InvalidArgumentError"), p.stdout
    assert "MAX_WRITE_CHUNK_BYTES" in p.stdout and str(tmp_path / "huge") in p.stdout
    assert "16000000000 bytes" in p.stdout
    assert sorted(q.name for q in (tmp_path / "huge").iterdir() if q.name != ".__tsp__") == ["zarr.json"]


def test_sharded_writes_allocate_inner_chunks(tmp_path: Path) -> None:
    """A shard of 4 GiB is never materialised by a partial write (only its
    inner chunks are): allowed. A write covering the (edge-clipped) shard whole
    would materialise it: refused before anything is written."""
    a = tsp.open(f"file://{tmp_path}", create=True, dtype="complex128", shape=[10],
                 chunks=[1 << 16], shards=[1 << 28]).result()
    a[3] = 1 + 2j
    assert a[2:5].read().result().tolist() == [0, 1 + 2j, 0]
    with pytest.raises(tsp.InvalidArgumentError, match="MAX_WRITE_CHUNK_BYTES"):
        a[:] = 5
    assert a[3].read().result() == 1 + 2j
