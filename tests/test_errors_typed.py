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


@pytest.mark.parametrize("config", [{"level": {}}, {"level": 99}, {"checksum": "yes"}])
def test_zarr3_numcodecs_compressor_configuration_is_checked_at_open(config: dict[str, Any]) -> None:
    """zarr-python's ``numcodecs.zstd`` gets the same checks as the zarr v2 compressor."""
    with pytest.raises(tsp.InvalidSpecError, match="numcodecs.zstd"):
        _open_doc("zarr.json", _zarr3(codecs=[{"name": "bytes"},
                                              {"name": "numcodecs.zstd", "configuration": config}]))


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


# -- a fuzz pass over stored documents -----------------------------------------------------
# Valid documents, then 1-2 fields replaced (by a JSON leaf or any JSON value) or
# removed: opening, reading and writing either works or raises a TensorStoreError.
# (Found this way: a list as blosc 'shuffle' -> TypeError; a .zarray 'dtype' numpy's
# parser rejects with ValueError.)
_DOCS: list[tuple[str, dict[str, Any]]] = [
    ("zarr.json", _zarr3(shape=[6, 5], data_type="int16", dimension_names=["y", "x"],
                         chunk_grid={"name": "regular", "configuration": {"chunk_shape": [4, 3]}},
                         codecs=[{"name": "transpose", "configuration": {"order": [1, 0]}},
                                 {"name": "bytes", "configuration": {"endian": "little"}},
                                 {"name": "zstd", "configuration": {"level": 1, "checksum": False}},
                                 {"name": "crc32c"}])),
    ("zarr.json", _zarr3(shape=[8], data_type="float32", fill_value="NaN",
                         chunk_grid={"name": "regular", "configuration": {"chunk_shape": [8]}},
                         chunk_key_encoding={"name": "v2", "configuration": {"separator": "."}},
                         codecs=[{"name": "sharding_indexed", "configuration": {
                             "chunk_shape": [4], "index_location": "end",
                             "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                        {"name": "gzip", "configuration": {"level": 1}}],
                             "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                              {"name": "crc32c"}]}}])),
    ("zarr.json", _zarr3(shape=[5], data_type="complex64", fill_value=[1.0, "NaN"],
                         chunk_grid={"name": "regular", "configuration": {"chunk_shape": [2]}},
                         codecs=[{"name": "bytes", "configuration": {"endian": "big"}},
                                 {"name": "blosc", "configuration": {"cname": "lz4", "clevel": 5,
                                  "shuffle": "shuffle", "typesize": 8, "blocksize": 0}}])),
    (".zarray", _zarray(shape=[6, 5], chunks=[4, 3], dimension_separator=".",
                        compressor={"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1, "blocksize": 0},
                        filters=[{"id": "delta", "dtype": "<i4"}])),
    (".zarray", _zarray(shape=[7], chunks=[3], dtype=">f8", fill_value="NaN", order="F",
                        compressor={"id": "zstd", "level": 3})),
    (".zarray", _zarray(shape=[7], chunks=[3], dtype="|b1", fill_value=True,
                        compressor={"id": "lzma", "format": 1, "check": -1, "preset": None, "filters": None})),
]


def _fuzz_strategies() -> tuple[Any, Any]:
    from hypothesis import strategies as st

    leaf = st.one_of(
        st.none(), st.booleans(), st.integers(-2**70, 2**70),
        st.sampled_from([0, 1, -1, 2**31, 2**62, 2**63, 2**64]), st.floats(), st.text(max_size=6),
        st.sampled_from(["", "NaN", "Infinity", "0x7fc00000", "/", ".", "C", "F", "little", "big",
                         "<i4", "int8", "regular", "default", "v2", "bytes", "zstd", "gzip", "blosc",
                         "crc32c", "transpose", "sharding_indexed", "lz4", "zlib", "bz2", "lzma",
                         "delta", "start", "end", "shuffle", "bitshuffle"]))
    value = st.recursive(leaf, lambda ch: st.one_of(st.lists(ch, max_size=3),
                                                    st.dictionaries(st.text(max_size=5), ch, max_size=3)),
                         max_leaves=6)
    return leaf, value


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        out += _paths(v, prefix + (k,))
    return out


def _mutated(data: Any) -> tuple[str, Any]:
    import copy

    from hypothesis import strategies as st

    leaf, value = _fuzz_strategies()
    key, doc = copy.deepcopy(data.draw(st.sampled_from(_DOCS)))
    leaves_only = data.draw(st.booleans())
    for _ in range(data.draw(st.integers(1, 2))):
        paths = _paths(doc)
        if leaves_only:
            paths = [p for p in paths if not isinstance(_at(doc, p), (dict, list))] or paths
        path = data.draw(st.sampled_from(paths))
        parent = _at(doc, path[:-1])
        if data.draw(st.integers(0, 5)) == 0:
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(leaf if leaves_only else value)
    return key, doc


def _at(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _exercise(key: str, doc: Any) -> None:
    """Open, read and write the array ``doc`` describes: any error must be typed."""
    try:
        a = _open_doc(key, doc)
        origin = (0,) * a.ndim
        if a.size:
            a[origin].write(a[origin].read().result()).result()
        if 0 < a.size <= 10**4:
            a.write(a.read().result()).result()
            a.read().result()
    except tsp.TensorStoreError:
        pass
    except Exception as e:
        raise AssertionError(f"untyped {type(e).__name__} for {key} {json.dumps(doc)[:400]}") from e


def _check_fuzzed_documents(max_examples: int) -> None:
    import warnings

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data: Any) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy: overflow casting a fill value
            _exercise(*_mutated(data))

    run()


def test_fuzzed_metadata_documents_fail_typed() -> None:
    _check_fuzzed_documents(150)


@pytest.mark.slow
def test_fuzzed_metadata_documents_fail_typed_long() -> None:
    _check_fuzzed_documents(600)


def test_fuzz_findings() -> None:
    """What the fuzz pass found, pinned."""
    with pytest.raises(tsp.InvalidSpecError, match="shuffle"):
        _open_doc("zarr.json", _DOCS[2][1] | {"codecs": [
            {"name": "bytes", "configuration": {"endian": "big"}},
            {"name": "blosc", "configuration": {"cname": "lz4", "shuffle": [1], "typesize": 8}}]})
    with pytest.raises(tsp.UnsupportedError, match="dtype"):
        _open_doc(".zarray", _zarray(dtype="8[\udbd1\udfc2"))


def test_fuzzed_commit_records_fail_typed() -> None:
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st

    _, value = _fuzz_strategies()
    fields = ["format", "version", "parent", "time", "write_id", "message", "metadata", "root",
              "count", "changes", "changes_ref", "kind", "tags", "deleted", "txn_id"]

    @settings(max_examples=150, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(st.sampled_from(fields), value, max_size=3))
    def run(changes: dict[str, Any]) -> None:
        try:
            stored = _record(**changes)
        except OverflowError:  # msgpack holds integers of at most 64 bits
            assume(False)
        try:
            CommitRecord.decode(stored, commit_name(1))
        except tsp.DataCorruptionError:
            pass

    run()


@pytest.mark.parametrize("shape", [(10**18, 10**18), (10**9, 10**9), (2**62,)])
@pytest.mark.parametrize("kvstore", ["memory://", "file"])
def test_reading_an_array_of_absurd_shape_is_resource_exhausted(
        tmp_path: Path, shape: tuple[int, ...], kvstore: str) -> None:
    """Reading the whole of a 10^18 x 10^18 array raised numpy's ValueError
    (more than the address space) or MemoryError (10^18 bytes); now
    ResourceExhaustedError (still a MemoryError) names the region and the size,
    and nothing was read or written."""
    url = kvstore if kvstore != "file" else f"file://{tmp_path}/a/"
    a = tsp.open({"driver": "zarr3", "kvstore": url}, create=True, dtype="uint8", shape=shape,
                 chunks=[64] * len(shape)).result()
    nbytes = np.prod([float(s) for s in shape])
    with pytest.raises(tsp.ResourceExhaustedError, match="read a smaller region") as info:
        a.read().result()
    assert isinstance(info.value, MemoryError)
    assert str(shape[0]) in str(info.value)
    with pytest.raises(tsp.ResourceExhaustedError):
        np.asarray(a)
    with pytest.raises(tsp.ResourceExhaustedError):
        tsp.downsample(a, [2] * len(shape), "mean").read().result()
    assert nbytes > 2**59
    # a region that fits reads (fill value)
    assert a[(slice(0, 2),) * len(shape)].read().result().tolist() == (
        [[0, 0], [0, 0]] if len(shape) == 2 else [0, 0])
