"""The chunk engine: region mapping against numpy, read-modify-write races
(threads and processes), bounded memory, the cache pool."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_driver_helpers import CountingKvStore, full, open_sync, read, write

from tensorstore_py.core.budget import ByteBudget, run_bounded
from tensorstore_py.core.future import run_sync
from tensorstore_py.drivers.cache import CachePool
from tensorstore_py.drivers.grid import chunk_parts, out_shape
from tensorstore_py.drivers.open import build_metadata, default_chunks
from tensorstore_py.errors import InvalidArgumentError
from tensorstore_py.kvstore.file import FileKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore


@st.composite
def _region(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 12)) for _ in range(ndim))
    chunks = tuple(draw(st.integers(1, 5)) for _ in range(ndim))
    index = []
    for n in shape:
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        index.append(slice(a, b, draw(st.integers(1, 4))))
    return shape, chunks, tuple(index)


@settings(max_examples=200, deadline=None)
@given(_region())
def test_chunk_parts_cover_the_region_exactly(case):
    shape, chunks, index = case
    src = np.arange(int(np.prod(shape))).reshape(shape)
    expect = src[index]
    got = np.full(out_shape(index), -1)
    for p in chunk_parts(index, chunks, shape):
        origin = tuple(slice(c * s, c * s + s) for c, s in zip(p.cell, chunks))
        chunk = np.full(chunks, -2)
        data = src[origin]
        chunk[tuple(slice(0, n) for n in data.shape)] = data
        assert (got[p.out] == -1).all()  # no element supplied twice
        got[p.out] = chunk[p.chunk]
    assert (got == expect).all()


@pytest.mark.parametrize("store", ["memory", "file"])
def test_strided_writes_and_reads_match_numpy(tmp_path_factory, store):
    """Both I/O paths: generic async (memory) and batched blocking (file)."""
    counter = iter(range(10**6))

    @settings(max_examples=40 if store == "memory" else 20, deadline=None)
    @given(_region(), st.sampled_from([None, "zstd"]), st.booleans())
    def check(case, compression, sharded):
        kv = MemoryKvStore() if store == "memory" else FileKvStore(
            path=str(tmp_path_factory.mktemp("h") / str(next(counter))), sync=False)
        _strided_case(kv, case, compression, sharded)

    check()


def _strided_case(kv, case, compression, sharded):
    shape, chunks, index = case
    shards = tuple(2 * c for c in chunks) if sharded else None
    m = build_metadata("zarr3", shape=shape, dtype="int32", chunks=chunks, shards=shards,
                       compression=compression, fill_value=-1)
    a = open_sync({"driver": "zarr3", "kvstore": kv, "metadata": m}, create=True)
    model = np.full(shape, -1, np.int32)
    value = np.arange(int(np.prod(out_shape(index))), dtype=np.int32).reshape(out_shape(index))
    run_sync(a.write(index, value))
    model[index] = value
    assert (read(a) == model).all()
    assert (run_sync(a.read(index)) == model[index]).all()


def test_bad_arguments():
    m = build_metadata("zarr3", shape=[4, 4], dtype="int32", chunks=[2, 2])
    a = open_sync({"driver": "zarr3", "kvstore": "memory://", "metadata": m}, create=True)
    with pytest.raises(InvalidArgumentError):
        run_sync(a.read((slice(0, 5, 1), slice(0, 4, 1))))
    with pytest.raises(InvalidArgumentError):
        run_sync(a.write(full(a.shape), np.zeros((4, 3), np.int32)))
    with pytest.raises(InvalidArgumentError):
        run_sync(a.write(full(a.shape), np.zeros((4, 4), np.float32)))
    out = np.empty((4, 4), np.int32)
    assert run_sync(a.read(full(a.shape), out=out)) is out


def test_threads_writing_disjoint_parts_of_one_chunk(tmp_path):
    m = build_metadata("zarr3", shape=[8, 64], dtype="int32", chunks=[8, 64], compression="zstd")
    a = open_sync({"driver": "zarr3", "kvstore": "file://" + str(tmp_path / "a"), "metadata": m},
                  create=True)

    def worker(i):
        for r in range(8):
            run_sync(a.write((slice(r, r + 1, 1), slice(i * 8, i * 8 + 8, 1)),
                             np.full((1, 8), i * 100 + r + 1, np.int32)))

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    x = read(a)
    for i in range(8):
        for r in range(8):
            assert (x[r, i * 8:(i + 1) * 8] == i * 100 + r + 1).all()


def test_two_processes_writing_disjoint_parts_of_one_chunk(tmp_path):
    url = "file://" + str(tmp_path / "a")
    m = build_metadata("zarr3", shape=[2, 4096], dtype="uint16", chunks=[2, 4096])
    open_sync({"driver": "zarr3", "kvstore": url, "metadata": m}, create=True)
    script = textwrap.dedent(f"""
        import sys, numpy as np
        from tensorstore_py.drivers.open import open_driver
        from tensorstore_py.core.future import run_sync
        k = int(sys.argv[1])
        a = run_sync(open_driver({{"driver": "zarr3", "kvstore": {url!r}}}))
        for j in range(40):
            run_sync(a.write((slice(k, k + 1, 1), slice(j * 100, j * 100 + 100, 1)),
                             np.full((1, 100), k * 1000 + j + 1, np.uint16)))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(k)]) for k in range(2)]
    assert [p.wait(120) for p in procs] == [0, 0]
    x = read(open_sync({"driver": "zarr3", "kvstore": url}))
    for k in range(2):
        for j in range(40):
            assert (x[k, j * 100:(j + 1) * 100] == k * 1000 + j + 1).all()


def test_budget_bounds_bytes_in_flight():
    budget = ByteBudget(100)
    peak = 0

    async def go():
        nonlocal peak

        async def one(i):
            nonlocal peak
            peak = max(peak, budget.used)
            import asyncio

            await asyncio.sleep(0.001)

        await run_bounded(range(50), one, budget=budget, cost=30)

    run_sync(go())
    assert peak <= 90 and budget.used == 0

    async def failing():
        async def one(i):
            if i == 3:
                raise ValueError("boom")

        await run_bounded(range(100), one, budget=budget, cost=60)

    with pytest.raises(ValueError, match="boom"):
        run_sync(failing())
    assert budget.used == 0


def test_large_write_memory_stays_bounded(tmp_path):
    """Encoding is chunk by chunk under the budget: the process never holds
    much more than the request plus the budget."""
    script = textwrap.dedent(f"""
        import numpy as np
        from tensorstore_py.drivers.open import open_driver, build_metadata
        from tensorstore_py.testing.rss import PeakRss
        from tensorstore_py.core.future import run_sync
        m = build_metadata("zarr3", shape=[256, 1024, 1024], dtype="uint8", chunks=[16, 512, 512],
                           compression="zstd")
        a = run_sync(open_driver({{"driver": "zarr3", "kvstore": {{"driver": "file", "path": {str(tmp_path / 'a')!r}, "sync": False}},
                                   "metadata": m}}, create=True, bytes_in_flight=32 << 20))
        x = np.random.default_rng(0).integers(0, 4, (256, 1024, 1024), dtype=np.uint8)
        peak = PeakRss()
        run_sync(a.write(tuple(slice(0, s, 1) for s in a.shape), x))
        print(peak.extra() >> 20)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    growth_mib = int(out.stdout.strip())
    assert growth_mib < 160, growth_mib  # a 256 MiB request, 32 MiB budget


def test_cache_pool_reuses_decoded_chunks(tmp_path):
    base = FileKvStore(path=str(tmp_path / "a"))
    m = build_metadata("zarr3", shape=[64, 64], dtype="float32", chunks=[32, 32], compression="zstd")
    write(open_sync({"driver": "zarr3", "kvstore": base, "metadata": m}, create=True),
          np.ones((64, 64), np.float32))
    pool = CachePool(1 << 20)
    counting = CountingKvStore(base)
    a = open_sync({"driver": "zarr3", "kvstore": counting}, cache_pool=pool)
    assert (read(a, (slice(0, 4), slice(0, 4))) == 1).all()
    assert pool.misses == 1 and len(pool) == 1
    assert (read(a, (slice(1, 5), slice(2, 9))) == 1).all()
    assert pool.hits == 1
    # a write elsewhere changes the chunk's generation: the cache never serves stale data
    b = open_sync({"driver": "zarr3", "kvstore": base})
    write(b, np.full((1, 1), 7, np.float32), (slice(0, 1), slice(0, 1)))
    assert read(a, (slice(0, 2), slice(0, 2)))[0, 0] == 7
    small = CachePool(5000)
    c = open_sync({"driver": "zarr3", "kvstore": base}, cache_pool=small)
    read(c)
    assert small.nbytes <= 5000 and len(small) == 1  # 4 KiB chunks: only one fits
    with pytest.raises(InvalidArgumentError):
        CachePool(-1)


def test_default_chunks():
    assert default_chunks([10], 4) == (10,)
    cs = default_chunks([100000, 100000], 8)
    assert (1 << 20) <= np.prod(cs) * 8 <= (4 << 20)


def test_partial_writes_inside_a_transaction(tmp_path):
    import tensorstore_py as tsp
    from tensorstore_py.kvstore.registry import open_kvstore

    kv = run_sync(open_kvstore("versioned+file://" + str(tmp_path) + "/"))
    m = build_metadata("zarr3", shape=[8, 8], dtype="int32", chunks=[4, 4], shards=[8, 8])
    a = open_sync({"driver": "zarr3", "kvstore": kv, "metadata": m}, create=True)
    with tsp.Transaction() as txn:
        t = a.with_kvstore(a.kvstore.with_transaction(txn))
        write(t, np.ones((2, 8), np.int32), (slice(0, 2), slice(0, 8)))
        write(t, np.full((1, 8), 2, np.int32), (slice(2, 3), slice(0, 8)))
        assert (read(t)[:3] == [[1] * 8, [1] * 8, [2] * 8]).all()
        assert (read(a) == 0).all()  # nothing visible before the commit
    x = read(open_sync({"driver": "zarr3", "kvstore": kv}))
    assert (x[:2] == 1).all() and (x[2] == 2).all() and (x[3:] == 0).all()
