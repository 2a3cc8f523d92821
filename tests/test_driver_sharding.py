"""sharding_indexed: interop, partial reads that fetch only the index and the
needed inner chunks, index validation, read-modify-write of shards."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorstore as ts
import zarr
from test_driver_helpers import CountingKvStore, open_sync, read, write

from tensorstore_py.drivers.open import build_metadata
from tensorstore_py.errors import ChecksumError, DataCorruptionError
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore

SHAPE = (45, 37)


def _meta(loc="end", compression=None, inner=(4, 8), shard=(16, 16), dtype="int16", **kw):
    m = build_metadata("zarr3", shape=SHAPE, dtype=dtype, chunks=inner, shards=shard,
                       compression=compression, **kw)
    m["codecs"][0]["configuration"]["index_location"] = loc
    return m


def _data(dtype="int16", seed=1):
    x = np.random.default_rng(seed).integers(1, 1000, SHAPE).astype(dtype)
    x[:8, :8] = 0  # one whole inner chunk of fill values: omitted from the shard
    return x


def _files(root):
    out = {}
    for d, _dirs, files in os.walk(root):
        if ".__tsp__" in d:
            continue
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            if rel != "zarr.json":
                out[rel] = open(os.path.join(d, f), "rb").read()
    return out


@pytest.mark.parametrize("loc", ["end", "start"])
@pytest.mark.parametrize("compression", [None, "gzip", "zstd"])
def test_sharded_interop_with_tensorstore(tmp_path, loc, compression):
    meta, x = _meta(loc, compression), _data()
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    write(open_sync({"driver": "zarr3", "kvstore": "file://" + ours, "metadata": meta}, create=True), x)
    ts.open({"driver": "zarr3", "kvstore": "file://" + theirs, "metadata": meta}, create=True).result().write(x).result()
    assert (ts.open({"driver": "zarr3", "kvstore": "file://" + ours}).result().read().result() == x).all()
    assert (zarr.open_array(ours, mode="r")[:] == x).all()
    b = open_sync({"driver": "zarr3", "kvstore": "file://" + theirs})
    assert (read(b) == x).all()
    assert (read(b, (slice(3, 40, 3), slice(2, 30, 5))) == x[3:40:3, 2:30:5]).all()
    if compression is None:  # compressor output differs between zlib/zstd builds
        assert _files(ours) == _files(theirs)


def test_reads_zarr_python_shards(tmp_path):
    from zarr.codecs import ZstdCodec

    x = _data("float32")
    z = zarr.create_array(str(tmp_path / "z"), shape=SHAPE, chunks=(5, 4), shards=(20, 16),
                          dtype="float32", compressors=[ZstdCodec(level=1)], fill_value=0)
    z[:] = x
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "z")})
    assert a.read_chunk_shape == (5, 4) and a.write_chunk_shape == (20, 16)
    assert (read(a) == x).all()
    assert (read(a, (slice(7, 33), slice(1, 3))) == x[7:33, 1:3]).all()


def test_nested_codecs_transpose_and_crc_inside(tmp_path):
    meta = _meta()
    meta["codecs"][0]["configuration"]["codecs"] = [
        {"name": "transpose", "configuration": {"order": [1, 0]}},
        {"name": "bytes", "configuration": {"endian": "big"}},
        {"name": "crc32c"},
    ]
    x = _data()
    ours, theirs = str(tmp_path / "o"), str(tmp_path / "t")
    write(open_sync({"driver": "zarr3", "kvstore": "file://" + ours, "metadata": meta}, create=True), x)
    ts.open({"driver": "zarr3", "kvstore": "file://" + theirs, "metadata": meta}, create=True).result().write(x).result()
    assert _files(ours) == _files(theirs)


def test_small_read_fetches_index_and_needed_inner_chunks_only(tmp_path):
    meta = build_metadata("zarr3", shape=[256, 256], dtype="uint8", chunks=[16, 16], shards=[128, 128],
                          compression="zstd")
    x = np.random.default_rng(0).integers(1, 255, (256, 256)).astype(np.uint8)
    base = FileKvStore(path=str(tmp_path / "a"))
    write(open_sync({"driver": "zarr3", "kvstore": base, "metadata": meta}, create=True), x)
    counting = CountingKvStore(base)
    a = open_sync({"driver": "zarr3", "kvstore": counting})
    counting.reads.clear()
    got = read(a, (slice(20, 30), slice(5, 10)))  # inside inner chunk (1, 0) of shard c/0/0
    assert (got == x[20:30, 5:10]).all()
    assert [k for k, _ in counting.reads] == ["c/0/0", "c/0/0"]
    index_range, data_range = (r for _, r in counting.reads)
    assert index_range.start == -(8 * 8 * 16 + 4) and index_range.stop is None  # suffix read
    import numcodecs

    raw = open(str(tmp_path / "a/c/0/0"), "rb").read()
    idx = np.frombuffer(raw[-(8 * 8 * 16 + 4):-4], np.uint64).reshape(8, 8, 2)
    off, n = (int(v) for v in idx[1, 0])
    assert (data_range.start, data_range.stop) == (off, off + n)  # exactly that inner chunk
    inner = np.frombuffer(numcodecs.Zstd().decode(raw[off:off + n]), np.uint8).reshape(16, 16)
    assert (inner == x[16:32, 0:16]).all()
    # two inner chunks: the index read above is cached (used only with data read at
    # its generation), and the two chunks, 7 small ones apart, come in ONE request
    counting.reads.clear()
    got = read(a, (slice(20, 40), slice(5, 10)))
    assert (got == x[20:40, 5:10]).all()
    assert [k for k, _ in counting.reads] == ["c/0/0"]
    assert sum(r.stop - r.start for _, r in counting.reads) < len(raw) // 4


def test_missing_inner_chunks_and_missing_shards_read_fill(tmp_path):
    meta = _meta(fill_value=-1)
    a = open_sync({"driver": "zarr3", "kvstore": "memory://", "metadata": meta}, create=True)
    assert (read(a) == -1).all()
    write(a, np.full((2, 2), 5, np.int16), (slice(17, 19), slice(17, 19)))
    y = read(a)
    assert (y[17:19, 17:19] == 5).sum() == 4 and (y == -1).sum() == y.size - 4


def test_partial_shard_writes_keep_neighbours(tmp_path):
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "a"), "metadata": _meta()},
                  create=True)
    x = _data()
    write(a, x)
    x[3:30, 5:6] = 77
    write(a, x[3:30, 5:6], (slice(3, 30), slice(5, 6)))
    assert (read(a) == x).all()
    t = ts.open({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "a")}).result()
    assert (t.read().result() == x).all()
    # the same writes through TensorStore give the same shard bytes
    t2 = ts.open({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "b"), "metadata": _meta()},
                 create=True).result()
    t2.write(_data()).result()
    t2[3:30, 5:6].write(x[3:30, 5:6]).result()
    assert _files(str(tmp_path / "a")) == _files(str(tmp_path / "b"))
    # clearing a region back to the fill value drops the inner chunks it empties
    zero = np.zeros((45, 37), np.int16)
    write(a, zero[16:32, 16:32], (slice(16, 32), slice(16, 32)))
    x[16:32, 16:32] = 0
    assert (read(a) == x).all()


def _shard_setup(tmp_path, loc="end"):
    p = str(tmp_path / "a")
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + p, "metadata": _meta(loc)}, create=True)
    write(a, _data())
    return a, p + "/c/1/1"


def test_truncated_shard_is_an_error(tmp_path):
    a, shard = _shard_setup(tmp_path)
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[:-30])  # index damaged
    with pytest.raises(DataCorruptionError, match="c/1/1"):
        read(a)
    with pytest.raises(DataCorruptionError, match="c/1/1"):
        read(a, (slice(17, 18), slice(17, 18)))
    open(shard, "wb").write(b"\x00" * 10)  # shorter than the index
    with pytest.raises(DataCorruptionError, match="c/1/1"):
        read(a, (slice(17, 18), slice(17, 18)))


def test_index_pointing_outside_shard_is_an_error(tmp_path):
    import crc32c

    a, shard = _shard_setup(tmp_path, loc="start")
    data = bytearray(open(shard, "rb").read())
    n = 4 * 2 * 2 * 8  # 4x2 inner chunks, (offset, nbytes) uint64
    idx = np.frombuffer(bytes(data[:n]), np.uint64).copy().reshape(-1, 2)
    idx[3, 1] = 1 << 40  # an absurd length
    new_idx = idx.tobytes()
    data[:n] = new_idx
    data[n:n + 4] = crc32c.crc32c(new_idx).to_bytes(4, "little")
    open(shard, "wb").write(bytes(data))
    with pytest.raises(DataCorruptionError, match="c/1/1"):
        read(a)
    with pytest.raises(DataCorruptionError, match="c/1/1"):
        read(a, (slice(16, 32), slice(16, 32)))
    data[5] ^= 1  # now the index checksum is wrong
    open(shard, "wb").write(bytes(data))
    with pytest.raises(ChecksumError, match="c/1/1"):
        read(a, (slice(17, 18), slice(17, 18)))


def test_all_fill_shard_is_deleted(tmp_path):
    p = str(tmp_path / "a")
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + p, "metadata": _meta()}, create=True)
    write(a, np.ones((2, 2), np.int16), (slice(0, 2), slice(0, 2)))
    assert list(_files(p)) == ["c/0/0"]
    write(a, np.zeros((2, 2), np.int16), (slice(0, 2), slice(0, 2)))
    assert _files(p) == {}


def test_memory_store_round_trip():
    a = open_sync({"driver": "zarr3", "kvstore": MemoryKvStore(), "metadata": _meta("start", "zstd")},
                  create=True)
    x = _data()
    write(a, x)
    assert (read(a) == x).all()
    assert (read(a, (slice(0, 45, 7), slice(36, 37))) == x[0:45:7, 36:37]).all()


def test_absurd_shard_index_refused(tmp_path):
    from tensorstore_py.errors import InvalidSpecError

    meta = build_metadata("zarr3", shape=[1 << 16, 1 << 16], dtype="uint8", chunks=[1, 1],
                          shards=[1 << 12, 1 << 12])
    with pytest.raises(InvalidSpecError, match="inner chunks per shard"):
        open_sync({"driver": "zarr3", "kvstore": "memory://", "metadata": meta}, create=True)


def test_nested_sharding_interop(tmp_path):
    meta = _meta()
    meta["codecs"][0]["configuration"]["codecs"] = [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": [2, 4], "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "index_location": "end"}}]
    x = _data()
    ours, theirs = str(tmp_path / "o"), str(tmp_path / "t")
    write(open_sync({"driver": "zarr3", "kvstore": "file://" + ours, "metadata": meta}, create=True), x)
    ts.open({"driver": "zarr3", "kvstore": "file://" + theirs, "metadata": meta}, create=True).result().write(x).result()
    assert (read(open_sync({"driver": "zarr3", "kvstore": "file://" + theirs})) == x).all()
    assert (ts.open({"driver": "zarr3", "kvstore": "file://" + ours}).result().read().result() == x).all()
    assert _files(ours) == _files(theirs)


def test_partial_reads_over_http(tmp_path, serve_app):
    from aiohttp import web

    meta = build_metadata("zarr3", shape=[64, 64, 64], dtype="uint8", chunks=[8, 8, 8],
                          shards=[32, 32, 32], compression="zstd")
    x = np.random.default_rng(2).integers(0, 255, (64, 64, 64)).astype(np.uint8)
    write(open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "v"), "metadata": meta},
                    create=True), x)
    seen = []

    @web.middleware
    async def log(request, handler):
        seen.append((request.path, request.headers.get("Range")))
        return await handler(request)

    app = web.Application(middlewares=[log])
    app.router.add_static("/", str(tmp_path / "v"))
    server = serve_app(app)
    a = open_sync({"driver": "zarr3", "kvstore": server.url + "/"})
    seen.clear()
    crop = read(a, (slice(3, 12), slice(40, 47), slice(30, 35)))
    assert (crop == x[3:12, 40:47, 30:35]).all()
    assert {p for p, _ in seen} == {"/c/0/1/0", "/c/0/1/1"}
    assert all(r is not None for _, r in seen)  # ranged requests only, never a whole shard
    assert (read(a) == x).all()


class _SlowDecode:
    """What the ``test_slow_decode`` codec saw: how many decodes ran at once."""

    lock = __import__("threading").Lock()
    running = 0
    most = 0
    calls = 0


def _slow_decode_codec() -> None:
    import time

    from tensorstore_py.drivers.codecs.base import BytesBytesCodec
    from tensorstore_py.drivers.codecs.registry import codec_class, register_codec

    if codec_class("test_slow_decode") is not None:
        return

    @register_codec
    class SlowDecode(BytesBytesCodec):  # the bytes as they are; each decode takes 20 ms
        name = "test_slow_decode"

        @classmethod
        def from_json(cls, config, chunk):
            return cls()

        def to_json(self):
            return {"name": self.name}

        def encode(self, buf):
            return buf

        def decode(self, buf, *, key, size, limit, out=None):
            with _SlowDecode.lock:
                _SlowDecode.running += 1
                _SlowDecode.calls += 1
                _SlowDecode.most = max(_SlowDecode.most, _SlowDecode.running)
            time.sleep(0.02)
            with _SlowDecode.lock:
                _SlowDecode.running -= 1
            return buf


def test_whole_shard_over_http_is_decoded_on_several_threads(tmp_path, serve_app):
    """A shard read whole from a remote store, for all of it or for most of it:
    its encoded inner chunks are decoded on every codec thread at once (one
    shard alone keeps them all busy), and the values are exact, fill values
    included."""
    from aiohttp import web

    import tensorstore_py as tsp

    _slow_decode_codec()
    meta = build_metadata("zarr3", shape=[128, 128, 256], dtype="uint8", chunks=[64, 64, 64],
                          shards=[128, 128, 256])
    meta["codecs"][0]["configuration"]["codecs"].append({"name": "test_slow_decode"})
    x = np.random.default_rng(3).integers(1, 255, (128, 128, 256)).astype(np.uint8)
    x[64:, :64, :64] = 0  # one inner chunk of fill values: omitted, read back as fill
    write(open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "v"), "metadata": meta},
                    create=True), x)
    app = web.Application()
    app.router.add_static("/", str(tmp_path / "v"))
    server = serve_app(app)
    ctx = tsp.Context({"data_copy_concurrency": {"limit": 2}})
    a = tsp.open({"driver": "zarr3", "kvstore": server.url + "/"}, context=ctx).result(60)
    for region in ((slice(None),) * 3, (slice(None), slice(None), slice(1, 255))):
        _SlowDecode.most = _SlowDecode.calls = 0
        assert np.array_equal(np.asarray(a[region].read().result(60)), x[region])
        assert _SlowDecode.calls == 15  # one shard of 16 inner chunks, one of them missing
        assert _SlowDecode.most == 2, region
