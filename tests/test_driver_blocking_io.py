"""The blocking-I/O hooks (KvStore.blocking_io, KvStore._prepare_read) and the
array paths that use them: same values and the same checks as the async path."""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_driver_helpers import open_sync, read, write

import tensorstore_py as tsp
from tensorstore_py.core.future import run_sync, spawn
from tensorstore_py.drivers.fastpath import has_sync_io
from tensorstore_py.drivers.open import build_metadata
from tensorstore_py.errors import ChecksumError, DataCorruptionError
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.fsspec_store import FsspecKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.registry import open_kvstore
from tensorstore_py.kvstore.versioned import VersionedKvStore

T = 60


def test_only_stores_with_the_hooks_take_the_batched_path(tmp_path):
    f = FileKvStore(path=str(tmp_path))
    assert has_sync_io(f) and has_sync_io(f.with_path("sub"))
    assert not has_sync_io(FaultKvStore(f))
    assert not has_sync_io(MemoryKvStore())
    # fsspec has private blocking helpers with other signatures: not the hooks
    assert not has_sync_io(FsspecKvStore(url="memory://blocking-io-test/"))
    assert not has_sync_io(VersionedKvStore(f))


def test_prepared_read_of_the_versioned_store(tmp_path):
    kv = VersionedKvStore(FileKvStore(path=str(tmp_path)))
    big = os.urandom(300_000)
    kv.write("big", big).result(T)
    kv.write("small", b"s" * 1000).result(T)
    kv.write("tiny", b"t").result(T)
    for key, want in (("big", big), ("small", b"s" * 1000), ("tiny", b"t")):
        reader = spawn(kv._prepare_read(key)).result(T)
        assert reader is not None
        res = reader()
        assert res.state == "value" and bytes(res.value) == want
        assert res.generation == kv.read(key).result(T).generation
    missing = spawn(kv._prepare_read("nope")).result(T)
    assert missing is not None and missing().state == "missing"
    # over a store without blocking I/O there is nothing to prepare
    assert spawn(VersionedKvStore(MemoryKvStore())._prepare_read("big")).result(T) is None


def test_large_values_are_checked_on_the_one_hop_path(tmp_path):
    raw = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(raw)
    big = os.urandom(400_000)
    kv.write("big", big).result(T)
    assert bytes(kv.read("big").result(T).value) == big
    assert bytes(kv.read("big", byte_range=slice(10, 20)).result(T).value) == big[10:20]
    obj = next(n for n in raw.list("data/").result(T))
    blob = bytearray(bytes(raw.read(obj).result(T).value))
    blob[123_456] ^= 0x40
    raw.write(obj, bytes(blob)).result(T)
    with pytest.raises(ChecksumError, match=f"'big'.*{obj}"):
        kv.read("big").result(T)
    with pytest.raises(ChecksumError, match=f"'big'.*{obj}"):
        spawn(kv._prepare_read("big")).result(T)()
    raw.write(obj, bytes(blob[:1000])).result(T)
    with pytest.raises(DataCorruptionError, match="truncated"):
        kv.read("big").result(T)
    raw.delete(obj).result(T)
    with pytest.raises(DataCorruptionError, match="missing"):
        kv.read("big").result(T)


def _array(kv, **kw):
    m = build_metadata("zarr3", shape=[64, 96], dtype="float32", chunks=[32, 32], **kw)
    return open_sync({"driver": "zarr3", "kvstore": kv, "metadata": m}, create=True)


@pytest.mark.parametrize("shards", [None, [64, 96]])
def test_zarr3_over_versioned_file_matches_numpy(tmp_path, shards):
    kv = run_sync(open_kvstore("versioned+file://" + str(tmp_path) + "/"))
    a = _array(kv, **({"shards": shards} if shards else {}))
    x = np.random.default_rng(1).standard_normal((64, 96), dtype=np.float32)
    assert (read(a) == 0).all()  # missing chunks read as the fill value
    write(a, x[:32, :64], (slice(0, 32), slice(0, 64)))
    got = read(a)
    assert np.array_equal(got[:32, :64], x[:32, :64]) and (got[32:] == 0).all() and (got[:, 64:] == 0).all()
    write(a, x)
    assert np.array_equal(read(a), x)
    # strided and partial regions (partial shards go through byte ranges)
    assert np.array_equal(read(a, (slice(3, 61, 5), slice(7, 90, 3))), x[3:61:5, 7:90:3])


def test_zarr3_read_over_versioned_file_detects_corruption(tmp_path):
    raw = FileKvStore(path=str(tmp_path))
    kv = VersionedKvStore(raw)
    a = _array(kv)
    x = np.random.default_rng(2).standard_normal((64, 96), dtype=np.float32)
    write(a, x)  # 4 KiB chunks: packed into data objects
    for obj in raw.list("data/").result(T):  # flip a bit in every value
        blob = bytearray(bytes(raw.read(obj).result(T).value))
        for i in range(len(blob) - 1, 0, -4096):
            blob[i] ^= 0x01
        raw.write(obj, bytes(blob)).result(T)
    with pytest.raises(ChecksumError, match="crc32c mismatch in data object 'data/"):
        read(a)


def test_zarr3_in_a_transaction_reads_its_own_writes(tmp_path):
    kv = VersionedKvStore(FileKvStore(path=str(tmp_path)))
    a = _array(kv)
    x = np.arange(64 * 96, dtype=np.float32).reshape(64, 96)
    with tsp.Transaction() as txn:
        t = a.with_kvstore(a.kvstore.with_transaction(txn))
        write(t, x)
        assert np.array_equal(read(t), x)
        assert (read(a) == 0).all()  # not visible outside before the commit
    assert np.array_equal(read(a), x)


def _raw_array(tmp_path, shape=(10, 12), chunks=(4, 4), fill=-1.0):
    url = f"file://{tmp_path}/raw/"
    a = tsp.open(url, create=True, dtype="float32", shape=list(shape), chunks=list(chunks),
                 fill_value=fill).result(T)
    x = np.arange(np.prod(shape), dtype="float32").reshape(shape)
    a.write(x).result(T)
    return a, x, tmp_path / "raw"


def test_raw_fast_path_reads_exact_values_ragged_and_strided(tmp_path):
    a, x, _ = _raw_array(tmp_path)
    np.testing.assert_array_equal(a.read().result(T), x)
    np.testing.assert_array_equal(a[1:9:3, ::-2].read().result(T), x[1:9:3, ::-2])
    # a whole chunk that is contiguous in the output (one chunk row of a 1-row read)
    np.testing.assert_array_equal(a[4:8, 0:4].read().result(T), x[4:8, 0:4])


def test_raw_fast_path_missing_chunk_reads_fill_value(tmp_path):
    a, x, root = _raw_array(tmp_path)
    os.remove(root / "c" / "1" / "1")  # chunk rows 4..7, cols 4..7
    got = a.read().result(T)
    want = x.copy()
    want[4:8, 4:8] = -1.0
    np.testing.assert_array_equal(got, want)


def test_raw_fast_path_wrong_size_chunk_is_corruption_naming_the_key(tmp_path):
    a, _x, root = _raw_array(tmp_path)
    path = root / "c" / "0" / "1"
    path.write_bytes(path.read_bytes()[:-4])  # truncated raw chunk
    with pytest.raises(DataCorruptionError, match="c/0/1"):
        a.read().result(T)


def test_raw_fast_path_longer_chunk_is_corruption_and_a_folder_is_missing(tmp_path):
    """Raw chunks are read with one read of one byte more than expected (no
    fstat): a longer value is still caught, and a folder where a chunk would be
    reads as missing."""
    a, x, root = _raw_array(tmp_path)
    longer = root / "c" / "1" / "2"
    longer.write_bytes(longer.read_bytes() + b"\0")
    with pytest.raises(DataCorruptionError, match="c/1/2"):
        a.read().result(T)
    os.remove(longer)
    os.mkdir(longer)
    got = a.read().result(T)
    want = x.copy()
    want[4:8, 8:12] = -1.0
    np.testing.assert_array_equal(got, want)
    kv = FileKvStore(path=str(root))
    assert kv._read_into_blocking(str(longer), np.empty(64, np.uint8)) == -1
    assert kv._read_into_blocking(str(root / "c" / "0" / "0"), np.empty(63, np.uint8)) == 64
