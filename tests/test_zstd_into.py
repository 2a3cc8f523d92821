"""Large chunks are zstd-compressed into recycled blocks (drivers/codecs/zstd_into.py):
the stored bytes are numcodecs' own, byte for byte, on every path that encodes
zstd (zarr3's codec, zarr v2's compressor), and a write of many chunks makes no
fresh block per chunk once the pool is warm."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from numcodecs import Zstd

import tensorstore_py as tsp
from tensorstore_py.drivers.chunk_buffers import POOLED_BYTES, chunk_buffers
from tensorstore_py.drivers.codecs import zstd_into
from tensorstore_py.drivers.codecs.zstd_codec import ZstdCodec

MiB = 1 << 20


def _floats(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n // 4).astype(np.float32)


@pytest.fixture
def numcodecs_only() -> Iterator[None]:
    """As where libzstd can not be reached through numcodecs' module."""
    saved = list(zstd_into._state)
    zstd_into._state[:] = [None]
    try:
        yield
    finally:
        zstd_into._state[:] = saved


@pytest.mark.parametrize(("level", "checksum"), [(1, False), (0, False), (3, True), (-7, False), (12, True)])
def test_the_bytes_are_numcodecs_own(level: int, checksum: bool) -> None:
    data = _floats(4 * MiB)
    got = zstd_into.compress_into(data, level, checksum)
    assert isinstance(got, memoryview)  # in a block of the pool, not a fresh bytes object
    assert bytes(got) == Zstd(level=level, checksum=checksum).encode(data)


def test_small_or_strided_input_is_left_to_numcodecs() -> None:
    data = _floats(4 * MiB).reshape(1024, 1024)
    assert zstd_into.compress_into(data[:, ::2], 1, False) is None  # not contiguous
    assert zstd_into.compress_into(_floats(POOLED_BYTES - 4), 1, False) is None
    codec = ZstdCodec(level=1)
    assert bytes(codec.encode(np.ascontiguousarray(data[:, ::2]))) == Zstd(1).encode(data[:, ::2].copy())


def test_output_far_below_its_bound_does_not_hold_a_full_block() -> None:
    """4 MiB of zeros compress to a few hundred bytes: kept as bytes of their
    own size, not as a view of a 4 MiB block (a memory store keeps values)."""
    zeros = np.zeros(4 * MiB, np.uint8)
    got = zstd_into.compress_into(zeros, 1, False)
    assert isinstance(got, bytes) and got == Zstd(1).encode(zeros)
    half = np.concatenate([_floats(2 * MiB), np.zeros(2 * MiB // 4, np.float32)])  # ~2/3 of the bound
    got = zstd_into.compress_into(half, 1, False)
    assert isinstance(got, memoryview) and bytes(got) == Zstd(1).encode(half)


def test_threads_compress_side_by_side_exactly() -> None:
    inputs = [_floats(2 * MiB, seed) for seed in range(6)]
    want = [Zstd(level=1 + s % 3).encode(x) for s, x in enumerate(inputs)]
    errors: list[str] = []

    def worker(k: int) -> None:
        for _ in range(5):
            for s, x in enumerate(inputs):
                got = zstd_into.compress_into(x, 1 + s % 3, False)
                if got is None or bytes(got) != want[s]:
                    errors.append(f"thread {k}, input {s}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_warm_pool_makes_no_block_per_chunk() -> None:
    data = _floats(4 * MiB)
    codec = ZstdCodec(level=1)
    chunk_buffers.clear()  # room in the free list, whatever earlier tests left there
    codec.encode(data)  # warms the pool; the value is dropped at once, as after its write
    made = chunk_buffers.made
    for _ in range(8):
        assert isinstance(codec.encode(data), memoryview)  # a pooled block's view
    assert chunk_buffers.made == made


@pytest.mark.parametrize("driver", ["zarr3", "zarr"])
def test_stored_chunks_are_numcodecs_bytes(tmp_path: Path, driver: str) -> None:
    """The files a write leaves are what numcodecs would have written, and read back exact."""
    data = np.random.default_rng(3).standard_normal((2048, 1024)).astype(np.float32)
    url = (tmp_path / "a").as_uri() + "/"
    a = tsp.open(url, create=True, driver=driver, dtype="float32", shape=data.shape, chunks=(1024, 1024),
                 compression=("zstd", 1)).result()
    a.write(data).result()
    for i in range(2):
        key = f"c/{i}/0" if driver == "zarr3" else f"{i}.0"
        stored = (tmp_path / "a" / key).read_bytes()
        assert stored == Zstd(1).encode(np.ascontiguousarray(data[i * 1024:(i + 1) * 1024])), key
    np.testing.assert_array_equal(tsp.open(url).result().read().result(), data)


def test_without_the_library_numcodecs_encodes(tmp_path: Path, numcodecs_only: None) -> None:
    data = _floats(4 * MiB)
    assert zstd_into.compress_into(data, 1, False) is None
    got = ZstdCodec(level=1).encode(data)
    assert bytes(got) == Zstd(1).encode(data)
