"""Large chunks decoded only to be copied into a result reuse pooled blocks
(drivers/chunk_buffers.py) for their stored and decoded bytes: exact values on
every path (local files, memory, the chunk cache, reads in flight at once),
and no fresh block per chunk once the pool is warm."""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.drivers.chunk_buffers import POOLED_BYTES, chunk_buffer, chunk_buffers

SHAPE, CHUNKS = (2048, 1536), (512, 1024)  # 2 MiB float32 chunks, clipped ones at the edge


def _array(url: str, seed: int, **kw: object) -> tuple[tsp.TensorStore, np.ndarray]:
    data = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)
    a = tsp.open(url, create=True, dtype="float32", shape=SHAPE, chunks=CHUNKS,
                 compression=("zstd", 1), **kw).result()
    a.write(data).result()
    return a, data


@pytest.mark.parametrize("where", ["file", "memory"])
def test_reads_of_large_chunks_are_exact(tmp_path: Path, where: str) -> None:
    url = (tmp_path / "a").as_uri() + "/" if where == "file" else "memory://"
    a, data = _array(url, 1)
    for sel in (np.s_[...], np.s_[100:1900, 3:1500], np.s_[::3, 7::5], np.s_[511:513, :]):
        np.testing.assert_array_equal(a[sel].read().result(), data[sel], err_msg=str(sel))


def test_reads_in_flight_at_once_never_share_a_block(tmp_path: Path) -> None:
    """Eight threads read four arrays of different values over and over: a
    block handed out while another chunk still used it would mix their bytes."""
    arrays = [_array((tmp_path / f"a{i}").as_uri() + "/", 10 + i) for i in range(4)]
    errors: list[str] = []

    def reader(k: int) -> None:
        a, data = arrays[k % 4]
        for _ in range(4):
            if not np.array_equal(a.read().result(), data):
                errors.append(f"reader {k}: wrong values")

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_warm_pool_makes_no_block_per_chunk(tmp_path: Path) -> None:
    a, data = _array((tmp_path / "a").as_uri() + "/", 2)
    np.testing.assert_array_equal(a.read().result(), data)  # warms the pool
    made = chunk_buffers.made
    for _ in range(3):
        np.testing.assert_array_equal(a.read().result(), data)
    # 12 chunks per read, two buffers each (stored and decoded): 72 without the pool
    assert chunk_buffers.made - made <= 4


def test_the_chunk_cache_keeps_chunks_of_their_own(tmp_path: Path) -> None:
    """With the decoded-chunk cache a chunk is kept, so it is never decoded into
    a pooled block that later chunks write over: reads of another array between
    two cached reads leave the cached values intact."""
    ctx = tsp.Context({"cache_pool": {"total_bytes_limit": 64 << 20}})
    a, data = _array((tmp_path / "a").as_uri() + "/", 3, context=ctx)
    other, other_data = _array((tmp_path / "b").as_uri() + "/", 4)
    np.testing.assert_array_equal(a.read().result(), data)  # into the cache
    for _ in range(2):
        np.testing.assert_array_equal(other.read().result(), other_data)  # through the pool
    np.testing.assert_array_equal(a.read().result(), data)  # from the cache
    np.testing.assert_array_equal(a[5:600, 1000:].read().result(), data[5:600, 1000:])


def test_small_chunks_use_the_allocator() -> None:
    assert chunk_buffer(POOLED_BYTES - 1) is None
    block = chunk_buffer(POOLED_BYTES)
    assert block is not None and block.nbytes == POOLED_BYTES and block.ctypes.data % 4096 == 0


def test_a_mapping_the_kernel_refuses_is_a_memory_error() -> None:
    """Restored blocks are mappings of their own (core/buffers.mapped_empty): one the
    kernel refuses raises MemoryError, as numpy's allocations do, not OSError."""
    from tensorstore_py.core.buffers import MAPPED_BYTES, mapped_empty

    block = mapped_empty(MAPPED_BYTES, np.float32)
    assert block.ctypes.data % 4096 == 0 and block.flags.writeable
    with pytest.raises(MemoryError, match="bytes"):
        mapped_empty(1 << 55)


def _vm_flags(address: int) -> list[str] | None:
    """The kernel's VmFlags of the mapping holding ``address`` (None off Linux)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def _owner(a: np.ndarray) -> object:
    """What finally holds ``a``'s memory (through views and memoryviews)."""
    owner: object = a
    while isinstance(owner, np.ndarray | memoryview):
        owner = owner.base if isinstance(owner, np.ndarray) else owner.obj
    return owner


@pytest.mark.parametrize("where", ["file", "memory"])
def test_a_large_read_lands_in_a_mapping_of_4k_pages(tmp_path: Path, where: str) -> None:
    """A result of 32 MiB or more is a mapping of its own that asks for no huge pages
    (core/buffers.py: numpy's memory is advised MADV_HUGEPAGE, whose first touch
    cost 4x here on a VM that hands free memory back); a smaller one is not."""
    from tensorstore_py.core.buffers import RESULT_MAPPED_BYTES

    url = (tmp_path / "a").as_uri() + "/" if where == "file" else "memory://"
    shape = (RESULT_MAPPED_BYTES // 4 // 1024, 1024)
    data = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    a = tsp.open(url, create=True, dtype="float32", shape=shape, chunks=(512, 1024)).result()
    a.write(data).result()
    got = a.read().result()
    assert np.array_equal(got, data)
    assert got.ctypes.data % 4096 == 0 and got.flags.c_contiguous and got.flags.writeable
    assert isinstance(_owner(got), mmap.mmap), type(_owner(got))
    part = a[1:-1].read().result()  # under the threshold: the allocator's memory
    assert np.array_equal(part, data[1:-1]) and part.nbytes < RESULT_MAPPED_BYTES
    assert not isinstance(_owner(part), mmap.mmap)
    flags = _vm_flags(got.ctypes.data + got.nbytes // 2)  # (numpy advises its 2 MiB-aligned part)
    if flags is None:
        pytest.skip("no /proc/self/smaps here")
    assert "hg" not in flags, flags
