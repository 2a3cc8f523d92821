"""Threads and budgets come from the CPUs this process may use, and a Context
overrides them: the engine is not sized for the machine it was measured on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.core import pools
from tensorstore_py.core.budget import ByteBudget, default_bytes_in_flight, default_max_tasks
from tensorstore_py.core.pools import Concurrency, available_cpus
from tensorstore_py.drivers.sizing import (
    MIN_WRITE_BATCH_BYTES,
    WRITE_BATCH_BYTES,
    async_tasks,
    blocking_read_tasks,
    prepared_read_tasks,
    write_batch_bytes,
    write_tasks,
)
from tensorstore_py.errors import InvalidSpecError
from tensorstore_py.kvstore.file import FileKvStore

T = 60
MiB = 1 << 20


def test_defaults_follow_the_usable_cpus():
    c = Concurrency.default()
    n = available_cpus()
    assert n == len(os.sched_getaffinity(0))
    assert (c.cpu, c.io) == (n, max(32, 4 * n))
    assert default_bytes_in_flight() == max(256 * MiB, 16 * MiB * n)
    assert default_max_tasks() == max(64, 4 * n)
    assert ByteBudget(1).concurrency == c
    assert Concurrency.default(cpu=3) == Concurrency(cpu=3, io=c.io)


def test_a_taskset_limit_is_what_the_pools_see():
    """An affinity of one CPU (a container's or taskset's limit) gives one codec
    thread and the I/O floor, whatever the machine has."""
    script = textwrap.dedent("""
        import os
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        from tensorstore_py.core.pools import Concurrency, cpu_pool
        from tensorstore_py.core.budget import default_bytes_in_flight
        c = Concurrency.default()
        print(c.cpu, c.io, cpu_pool()._max_workers, default_bytes_in_flight() >> 20)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=T)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "32", "1", "256"]


def test_sixteen_cpus_run_sixteen_decoders():
    c16 = Concurrency(cpu=16, io=64)
    c2 = Concurrency(cpu=2, io=32)
    zstd_4mib = 4 * MiB
    # decoding chunks: one batch per CPU (at least 4: I/O waits overlap decoding)
    assert blocking_read_tasks(c16, zstd_4mib, raw=False) == 16
    assert blocking_read_tasks(c2, zstd_4mib, raw=False) == 4
    assert prepared_read_tasks(c16) == 16
    # raw chunks under 64 KiB are GIL-bound: two batches on 2 CPUs, up to 4
    assert blocking_read_tasks(c2, 16 << 10, raw=True) == 2
    assert blocking_read_tasks(c16, 16 << 10, raw=True) == 4
    assert blocking_read_tasks(c16, 256 << 10, raw=True) == 8
    # writes wait on fsync: two per CPU, at least 16
    assert write_tasks(c16) == 32 and write_tasks(c2) == 16
    # never more than the I/O threads
    assert blocking_read_tasks(Concurrency(cpu=16, io=6), zstd_4mib, raw=False) == 6
    # remote stores: more chunks in flight with more codec threads
    assert async_tasks(c16, 4 * MiB, write=False) == 16
    assert async_tasks(c2, 4 * MiB, write=False) == 8


def test_write_batches_hold_about_2_mib_unless_the_write_is_small():
    c16, c2 = Concurrency(cpu=16, io=64), Concurrency(cpu=2, io=32)
    assert WRITE_BATCH_BYTES == 2 * MiB and MIN_WRITE_BATCH_BYTES == 256 << 10
    assert write_batch_bytes(c2, 128 * MiB) == 2 * MiB == write_batch_bytes(c16, 128 * MiB)
    # at least 4 batches per codec thread, down to 256 KiB
    assert write_batch_bytes(c16, 32 * MiB) == 512 << 10
    assert write_batch_bytes(c16, 8 * MiB) == 256 << 10 == write_batch_bytes(c2, 4 << 10)


def _count_store_calls(monkeypatch) -> list[int]:
    """The number of chunks of each ``_write_many_blocking`` call of the file
    store from now on (the real method does the writing)."""
    calls: list[int] = []
    original = FileKvStore._write_many_blocking

    def counting(self, items):
        calls.append(len(items))
        return original(self, items)

    monkeypatch.setattr(FileKvStore, "_write_many_blocking", counting)
    return calls


@pytest.mark.parametrize(("cpus", "blocks_per_store_call"), [(2, 8), (4, 4), (16, 1)])
def test_a_write_stores_its_chunks_in_batches_of_about_2_mib(tmp_path, monkeypatch, cpus,
                                                             blocks_per_store_call):
    """64 N5 blocks of 256 KiB (16 MiB): eight to a store call with 2 codec
    threads, four with 4, one with 16 (each thread still gets 4 batches); the
    values read back."""
    calls = _count_store_calls(monkeypatch)
    ctx = tsp.Context({"data_copy_concurrency": {"limit": cpus}})
    a = tsp.open(f"file://{tmp_path}/n5/", driver="n5", create=True, dtype="uint8", shape=[256] * 3,
                 chunks=[64] * 3, context=ctx).result(T)
    x = np.random.default_rng(1).integers(0, 255, (256,) * 3, dtype=np.uint8)
    a.write(x).result(T)
    assert calls == [blocks_per_store_call] * (64 // blocks_per_store_call)
    assert np.array_equal(np.asarray(tsp.open(f"file://{tmp_path}/n5/").result(T).read().result(T)), x)


def test_whole_chunks_beside_partial_ones_are_stored_together(tmp_path, monkeypatch):
    """A write whose last dimension is unaligned puts partial chunks in every batch:
    the whole chunks of each batch still go to the store in one call."""
    ctx = tsp.Context({"data_copy_concurrency": {"limit": 2}})
    a = tsp.open(f"file://{tmp_path}/n5/", driver="n5", create=True, dtype="uint8", shape=[256] * 3,
                 chunks=[64] * 3, context=ctx).result(T)
    x = np.random.default_rng(2).integers(0, 255, (256,) * 3, dtype=np.uint8)
    a.write(x).result(T)
    calls = _count_store_calls(monkeypatch)
    a[:, :, 1:255].write(x[:, :, 1:255] ^ 0xFF).result(T)
    # 8 batches of 8 chunks: 2 rows of 4, the first and last of each row partial
    assert calls == [4] * 8
    want = x.copy()
    want[:, :, 1:255] ^= 0xFF
    assert np.array_equal(np.asarray(a.read().result(T)), want)


def test_context_thread_limits_round_trip_and_validate():
    ctx = tsp.Context({"data_copy_concurrency": {"limit": 3}, "file_io_concurrency": {"limit": 5}})
    assert ctx.concurrency == Concurrency(cpu=3, io=5)
    assert tsp.Context(ctx.spec()).spec() == ctx.spec()
    assert tsp.Context().concurrency == Concurrency.default()
    assert tsp.Context().spec()["data_copy_concurrency"] == {"limit": None}
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(InvalidSpecError, match="data_copy_concurrency.limit"):
            tsp.Context({"data_copy_concurrency": {"limit": bad}})
    with pytest.raises(InvalidSpecError, match="file_io_concurrency"):
        tsp.Context({"file_io_concurrency": {"threads": 4}})


def test_an_array_works_on_the_threads_its_context_gives(tmp_path):
    ctx = tsp.Context({"data_copy_concurrency": {"limit": 3}, "file_io_concurrency": {"limit": 5},
                       "bytes_in_flight": {"limit": 8 * MiB}})
    a = tsp.open(f"file://{tmp_path}/a/", create=True, dtype="float32", shape=[256, 256], chunks=[64, 64],
                 compression="zstd", context=ctx).result(T)
    drv = a._driver
    assert drv._threads == Concurrency(cpu=3, io=5) and drv._budget.limit == 8 * MiB
    x = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)
    a.write(x).result(T)
    assert np.array_equal(a.read().result(T), x)
    assert ("cpu", 3) in pools._pools and ("io", 5) in pools._pools  # pools of those sizes did the work
    # the same Context's arrays share the pools; the default context keeps the default ones
    b = tsp.open(f"file://{tmp_path}/a/", context=ctx).result(T)
    assert b._driver._threads.cpu_pool() is drv._threads.cpu_pool()
    assert tsp.open(f"file://{tmp_path}/a/").result(T)._driver._threads == Concurrency.default()


def test_peak_memory_of_a_read_is_the_request_plus_the_budget(tmp_path):
    """Whole 16 MiB shards read with a 32 MiB budget: at most two in flight
    whatever the CPU count (the blocking read path too)."""
    script = textwrap.dedent(f"""
        import numpy as np, tensorstore_py as tsp
        def status(field):
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))
        ctx = tsp.Context({{"bytes_in_flight": {{"limit": 32 << 20}}, "data_copy_concurrency": {{"limit": 16}}}})
        url = "file://{tmp_path}/a/"
        a = tsp.open(url, create=True, dtype="uint8", shape=[256, 1024, 1024], chunks=[16, 256, 256],
                     shards=[16, 1024, 1024], context=ctx).result()
        a.write(np.full(a.shape, 3, np.uint8)).result()
        del a
        a = tsp.open(url, context=ctx).result()
        base = status("VmRSS")
        x = a.read().result()
        assert x[-1, -1, -1] == 3
        print((status("VmHWM") - base) // 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    growth_mib = int(out.stdout.strip())
    assert growth_mib < 256 + 32 + 40, growth_mib  # the 256 MiB output, the budget, slack
