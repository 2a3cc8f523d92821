"""Partial shard reads (drivers/shard_reads.py) and the vectorised raw inner
chunk paths (drivers/codecs/_cells.py), on both I/O paths: the async one
(memory store, wrappers) and the blocking one (local files)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from test_driver_helpers import CountingKvStore, norm, open_sync, read, run_sync, write

from tensorstore_py.drivers.codecs._cells import MISSING
from tensorstore_py.drivers.open import build_metadata
from tensorstore_py.errors import DataCorruptionError
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore

SHAPE = (40, 36, 20)
INNER = (4, 6, 5)
SHARD = (20, 18, 10)  # 5 x 3 x 2 = 30 inner chunks


class CountingFileKvStore(FileKvStore):
    """The file store (blocking path) recording every read as (key, byte_range)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.reads = []

    def _read_blocking(self, key, byte_range, if_not_equal):
        self.reads.append((key[len(self.path):], byte_range))
        return super()._read_blocking(key, byte_range, if_not_equal)


def _stores(tmp_path):
    mem = MemoryKvStore()
    return {"async": (mem, CountingKvStore(mem)),
            "blocking": (FileKvStore(path=str(tmp_path)), CountingFileKvStore(path=str(tmp_path)))}


def _meta(compression=None, loc="end", dtype="int16"):
    m = build_metadata("zarr3", shape=SHAPE, dtype=dtype, chunks=INNER, shards=SHARD, compression=compression)
    m["codecs"][0]["configuration"]["index_location"] = loc
    return m


def _data(seed=0):
    x = np.random.default_rng(seed).integers(1, 30000, SHAPE).astype(np.int16)
    x[:4, :6, :5] = 0  # inner chunk (0, 0, 0) of shard c/0/0/0 is all fill: not stored
    return x


@pytest.mark.parametrize("path", ["async", "blocking"])
@pytest.mark.parametrize("loc", ["end", "start"])
def test_regions_of_raw_shards_match_numpy(tmp_path, path, loc):
    base, _counting = _stores(tmp_path)[path]
    a = open_sync({"driver": "zarr3", "kvstore": base, "metadata": _meta(loc=loc)}, create=True)
    x = _data()
    write(a, x)
    assert np.array_equal(read(a), x)
    rng = np.random.default_rng(1)
    for _ in range(40):
        index = []
        for n in SHAPE:
            lo = int(rng.integers(0, n))
            hi = int(rng.integers(lo + 1, n + 1))
            index.append(slice(lo, hi, int(rng.choice([1, 1, 2, 3]))))
        assert np.array_equal(read(a, tuple(index)), x[tuple(index)]), index
    # aligned boxes of many inner chunks land in place; unaligned ones through a scratch box
    for index in [(slice(0, 20), slice(0, 18), slice(0, 10)), (slice(4, 16), slice(6, 18), slice(0, 10)),
                  (slice(1, 19), slice(2, 17), slice(1, 9))]:
        assert np.array_equal(read(a, index), x[index])


@pytest.mark.parametrize("path", ["async", "blocking"])
def test_most_of_a_shard_is_one_whole_read_and_a_little_is_index_plus_ranges(tmp_path, path):
    base, counting = _stores(tmp_path)[path]
    write(open_sync({"driver": "zarr3", "kvstore": base, "metadata": _meta()}, create=True), _data())
    a = open_sync({"driver": "zarr3", "kvstore": counting})
    x = _data()
    counting.reads.clear()
    region = (slice(1, 19), slice(0, 18), slice(0, 10))  # 30 of 30 inner chunks, not the whole shard
    assert np.array_equal(read(a, region), x[region])
    assert counting.reads == [("c/0/0/0", None)]  # ONE request: the shard with its index
    counting.reads.clear()
    region = (slice(20, 23), slice(18, 20), slice(10, 12))  # one inner chunk of another shard
    assert np.array_equal(read(a, region), x[region])
    keys = [k for k, _ in counting.reads]
    assert keys == ["c/1/1/1", "c/1/1/1"]  # its index, then that inner chunk
    assert counting.reads[1][1].stop - counting.reads[1][1].start == 4 * 6 * 5 * 2


@pytest.mark.parametrize("path", ["async", "blocking"])
def test_a_cached_index_never_serves_another_version(tmp_path, path):
    base, counting = _stores(tmp_path)[path]
    meta = _meta(compression="zstd")  # inner chunks move when the shard is rewritten
    writer = open_sync({"driver": "zarr3", "kvstore": base, "metadata": meta}, create=True)
    x = _data()
    write(writer, x)
    a = open_sync({"driver": "zarr3", "kvstore": counting})
    region = (slice(5, 9), slice(7, 11), slice(2, 4))
    assert np.array_equal(read(a, region), x[region])  # index now cached
    counting.reads.clear()
    assert np.array_equal(read(a, region), x[region])
    assert len(counting.reads) == 1  # the cached index and one data range
    # another handle rewrites the shard: offsets and sizes change
    y = np.random.default_rng(7).integers(1, 5, SHAPE).astype(np.int16)
    write(writer, y)
    assert np.array_equal(read(a, region), y[region])
    # an inner chunk missing in the cached index, written since: seen, not filled
    write(writer, np.zeros(SHAPE, np.int16))
    write(writer, np.full((1, 1, 1), 9, np.int16), (slice(10, 11), slice(12, 13), slice(0, 1)))
    assert read(a, (slice(10, 11), slice(12, 13), slice(0, 1)))[0, 0, 0] == 9
    assert (read(a, (slice(0, 4), slice(0, 6), slice(0, 5))) == 0).all()  # cache: that chunk missing
    write(writer, np.full((1, 1, 1), 5, np.int16), (slice(1, 2), slice(1, 2), slice(1, 2)))
    assert read(a, (slice(1, 2), slice(1, 2), slice(1, 2)))[0, 0, 0] == 5
    # the shard deleted: fill values, not the cached index's chunks
    base.delete("c/0/0/0").result(60)
    assert (read(a, region) == 0).all()


def test_inner_chunks_out_of_grid_order_and_bad_entries(tmp_path):
    """Shards from other writers may store inner chunks in any order: the
    vectorised path places them by their offsets; an entry that is not a whole
    raw chunk is decoded chunk by chunk, which names the key."""
    kv = MemoryKvStore()
    meta = _meta()
    a = open_sync({"driver": "zarr3", "kvstore": kv, "metadata": meta}, create=True)
    x = _data()
    write(a, x)
    sh = a._shard
    raw = bytes(kv.read("c/1/0/1").result(60).value)
    idx = sh.whole_index(raw, key="k").reshape(-1, 2).copy()
    # rebuild the shard with its inner chunks in reverse order
    order = [i for i in range(len(idx)) if idx[i, 0] != MISSING][::-1]
    parts, new = [], np.full_like(idx, MISSING)
    at = 0
    for i in order:
        off, n = int(idx[i, 0]), int(idx[i, 1])
        parts.append(raw[off: off + n])
        new[i] = (at, n)
        at += n
    body = b"".join(parts) + bytes(memoryview(sh.index.encode(new.reshape(sh.cps + (2,)))).cast("B"))
    kv.write("c/1/0/1", body).result(60)
    region = (slice(20, 40), slice(0, 18), slice(10, 20))
    assert np.array_equal(read(a, region), x[region])  # the whole shard
    assert np.array_equal(read(a, (slice(21, 39), slice(1, 17), slice(11, 19))), x[21:39, 1:17, 11:19])
    # an entry one byte short: a corrupt shard, named
    new[order[0], 1] -= 1
    body = b"".join(parts) + bytes(memoryview(sh.index.encode(new.reshape(sh.cps + (2,)))).cast("B"))
    kv.write("c/1/0/1", body).result(60)
    with pytest.raises(DataCorruptionError, match="c/1/0/1"):
        read(a, region)


@pytest.mark.parametrize("dtype", ["uint8", "float32", "bool", "complex128"])
def test_raw_shards_skip_fill_inner_chunks_like_tensorstore(tmp_path, dtype):
    import tensorstore as ts

    meta = _meta(dtype=dtype)
    meta["fill_value"] = {"uint8": 7, "float32": -0.0, "bool": False, "complex128": [0.0, 0.0]}[dtype]
    x = np.random.default_rng(3).integers(0, 3, SHAPE) > 0
    x = x.astype(dtype) if dtype == "bool" else (x * 5).astype(dtype)
    x[:4, :6, :5] = np.array(meta["fill_value"] if dtype != "complex128" else 0, dtype=dtype)
    x[4:8, :6, :5] = 0 if dtype != "float32" else 0.0  # +0.0 differs bitwise from a -0.0 fill: stored
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    write(open_sync({"driver": "zarr3", "kvstore": "file://" + str(ours), "metadata": meta}, create=True), x)
    ts.open({"driver": "zarr3", "kvstore": "file://" + str(theirs), "metadata": meta},
            create=True).result().write(x).result()
    for key in ("c/0/0/0", "c/1/1/1"):
        assert (ours / key).read_bytes() == (theirs / key).read_bytes(), key
    assert np.array_equal(read(open_sync({"driver": "zarr3", "kvstore": "file://" + str(theirs)})), x)


@pytest.mark.parametrize("path", ["async", "blocking"])
def test_many_raw_inner_chunks_come_in_one_span(tmp_path, path):
    """Under half of a shard but more than a few raw inner chunks: the index and
    ONE data request, the chunks placed as records (also with gaps of missing
    inner chunks, and with steps)."""
    base, counting = _stores(tmp_path)[path]
    x = _data()
    write(open_sync({"driver": "zarr3", "kvstore": base, "metadata": _meta()}, create=True), x)
    a = open_sync({"driver": "zarr3", "kvstore": counting})

    def one_by_one(*args):
        raise AssertionError("raw inner chunks decoded one by one")

    a._shard.decode_present = one_by_one
    for region in [(slice(0, 8), slice(0, 18), slice(0, 10)),      # 2 x 3 x 2 = 12 of 30 inner chunks
                   (slice(1, 7), slice(1, 17), slice(1, 9)),       # the same cells, unaligned
                   (slice(20, 28, 3), slice(18, 36, 2), slice(10, 20))]:
        counting.reads.clear()
        assert np.array_equal(read(a, region), x[region]), region
        data = [r for _, r in counting.reads if r is not None and r.start >= 0]
        assert len(data) == 1, counting.reads


def _zstd_shard(kv):
    """A zstd-sharded array on ``kv`` (written through its base) and its data."""
    x = _data()
    write(open_sync({"driver": "zarr3", "kvstore": kv, "metadata": _meta(compression=("zstd", 1))},
                    create=True), x)
    return x


def _counting_decodes(a):
    """Count the inner chunk decodes of array driver ``a`` (a list of the thread of each)."""
    inner, calls = a._shard.inner, []
    decode = inner.decode

    def counted(buf, **kw):
        calls.append(threading.get_ident())
        return decode(buf, **kw)

    inner.decode = counted
    return calls


def test_concurrent_reads_of_one_shard_decode_each_inner_chunk_once():
    """Crops of one shard in flight together (their inner chunk ranges come in one
    request) decode each zstd inner chunk they need once, not once per crop; the
    shared chunks land in every crop's bytes."""
    mem = MemoryKvStore()
    x = _zstd_shard(mem)
    a = open_sync({"driver": "zarr3", "kvstore": CountingKvStore(mem)})
    read(a, (slice(0, 1), slice(0, 1), slice(0, 1)))  # the shard's index cached
    calls = _counting_decodes(a)
    # 6 crops of shard c/0/0/0 (5 x 3 x 2 inner chunks of 4 x 6 x 5), each 2 x 2 x 2 inner chunks
    regions = [(slice(2 + i % 3, 6 + i % 3), slice(3, 9), slice(1 + i // 3, 6 + i // 3)) for i in range(6)]
    cells = {(z // 4, y // 6, w // 5) for r in regions for z in range(r[0].start, r[0].stop)
             for y in range(r[1].start, r[1].stop) for w in range(r[2].start, r[2].stop)}
    cells.discard((0, 0, 0))  # all fill: not stored, never decoded

    async def together():
        return await asyncio.gather(*(a.read(norm(r, a.shape)) for r in regions))

    got = run_sync(together())
    for r, g in zip(regions, got, strict=True):
        assert np.array_equal(g, x[r]), r
    assert len(calls) == len(cells)  # one decode per distinct inner chunk (each crop alone: 42)


def _volume():
    """A 256^3 uint8 volume in one zstd shard of 64^3 inner chunks (256 KiB each:
    a crop's decodes run on the codec threads) in a memory store: (store, data)."""
    mem = MemoryKvStore()
    x = np.random.default_rng(4).integers(0, 8, size=(256, 256, 256), dtype=np.uint8)
    meta = build_metadata("zarr3", shape=x.shape, dtype="uint8", chunks=(64,) * 3, shards=(256,) * 3,
                          compression=("zstd", 1))
    write(open_sync({"driver": "zarr3", "kvstore": mem, "metadata": meta}, create=True), x)
    return mem, x


def test_a_corrupt_inner_chunk_shared_by_concurrent_reads_fails_each_of_them():
    """The reads that share a decode share its failure: every crop that needs the
    corrupt inner chunk raises DataCorruptionError naming the shard, also those
    that waited for another thread's decode of it (none hangs, none gets stale
    bytes); a crop that does not need it reads correctly."""
    mem, x = _volume()
    a = open_sync({"driver": "zarr3", "kvstore": CountingKvStore(mem)})
    raw = bytearray(mem.read("c/0/0/0").result(60).value)
    off, n = (int(v) for v in a._shard.whole_index(bytes(raw), key="k")[1, 1, 1])
    raw[off + 8: off + n] = bytes(n - 8)  # inner chunk (1, 1, 1): its frame header kept, its blocks zeroed
    mem.write("c/0/0/0", bytes(raw)).result(60)
    read(a, (slice(0, 1), slice(0, 1), slice(0, 1)))  # the shard's index cached
    inner = a._shard.inner
    decode = inner.decode

    def slow_when_corrupt(buf, **kw):
        if "[1, 1, 1]" in kw.get("key", ""):
            time.sleep(0.3)  # the other codec threads come for it meanwhile, and wait
        return decode(buf, **kw)

    inner.decode = slow_when_corrupt
    needing = [tuple(slice(40 + 4 * i + d, 104 + 4 * i + d) for d in (0, 1, 2)) for i in range(6)]
    clear = (slice(130, 194), slice(130, 194), slice(130, 194))

    async def together():
        return await asyncio.gather(*(a.read(norm(r, a.shape)) for r in [*needing, clear]),
                                    return_exceptions=True)

    got = run_sync(together(), timeout=60)  # a read left waiting for the decode fails here
    for r, g in zip(needing, got, strict=False):
        assert isinstance(g, DataCorruptionError) and "c/0/0/0" in str(g), (r, g)
    assert np.array_equal(got[-1], x[clear])


class _SlowKvStore(CountingKvStore):
    """Answers every read after ``delay`` seconds (requests overlap as at cloud latency)."""

    delay = 0.05

    async def _read(self, key, byte_range, if_not_equal):
        await asyncio.sleep(self.delay)
        return await super()._read(key, byte_range, if_not_equal)


def test_reads_of_one_shard_in_flight_share_decodes_across_their_requests():
    """Crops of one zstd shard started in different turns of the event loop go out
    as different range requests; while they are all in flight, each inner chunk
    (256 KiB, decoded on the codec threads) is decoded once for all of them, and
    once they are done nothing is kept: the same crops read again decode again."""
    mem, x = _volume()
    slow = _SlowKvStore(mem)
    a = open_sync({"driver": "zarr3", "kvstore": slow})
    read(a, (slice(0, 1), slice(0, 1), slice(0, 1)))  # the shard's index cached
    calls = _counting_decodes(a)
    # 8 crops around the same 2 x 2 x 2 inner chunks, in two groups one turn apart
    regions = [tuple(slice(40 + 3 * i + d, 104 + 3 * i + d) for d in (0, 1, 2)) for i in range(8)]

    async def two_groups():
        first = [asyncio.ensure_future(a.read(norm(r, a.shape))) for r in regions[:4]]
        for _ in range(3):
            await asyncio.sleep(0)  # the first group's request is out
        second = [asyncio.ensure_future(a.read(norm(r, a.shape))) for r in regions[4:]]
        return await asyncio.gather(*first, *second)

    slow.reads.clear()
    got = run_sync(two_groups(), timeout=60)
    for r, g in zip(regions, got, strict=True):
        assert np.array_equal(g, x[r]), r
    assert len([rg for _, rg in slow.reads if rg is not None]) >= 2 * 4  # two requests' worth of ranges
    assert len(calls) == 8  # each of the 8 inner chunks once (per request: 16)
    calls.clear()
    assert np.array_equal(run_sync(a.read(norm(regions[0], a.shape))), x[regions[0]])
    assert len(calls) == 8  # nothing kept after the reads
