"""Compressed chunks read from the file store through one reused buffer per
thread (drivers/fastpath.py::read_batch_general, core/buffers.py::thread_scratch,
the file store's ``_read_into_blocking(smaller=True)``): values of every size in
one batch, partial chunks at the edges, other element orders, fill values and
missing chunks, stored chunks larger than the buffer, and many threads at once.
Each read is compared with the numpy array written.
"""

from __future__ import annotations

import gzip
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.core.errors import DataCorruptionError


def url(p: Path) -> str:
    return p.as_uri() + "/"


def noisy(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    """Values that compress to different sizes chunk by chunk (runs of equal
    values in some, noise in others)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 200, shape).astype(dtype)
    flat = a.reshape(-1)
    flat[: flat.size // 3] = 5  # long runs: small stored chunks before large ones
    return a


REGIONS = [
    np.s_[...],
    np.s_[3:61, 5:40],        # partial chunks on every side
    np.s_[60:, 30:],          # the clipped edge chunks of the grid
    np.s_[::3, 1::5],         # strided: parts of every chunk
    np.s_[17, :],             # one row through a row of chunks
    np.s_[:, 33],
]


@pytest.mark.parametrize("order", ["C", "F"])
def test_zarr3_compressed_chunks_of_varying_sizes(tmp_path: Path, order: str) -> None:
    data = noisy((67, 45), "int32")
    a = tsp.open(url(tmp_path / "a"), create=True, dtype="int32", shape=data.shape, chunks=(16, 16),
                 compression=("zstd", 1), fill_value=-3, order=order).result()
    a.write(data).result()
    sizes = {f.stat().st_size for f in (tmp_path / "a").rglob("*") if f.is_file() and f.name != "zarr.json"}
    assert len(sizes) > 3  # chunks of several stored sizes share the buffer
    for r in REGIONS:
        np.testing.assert_array_equal(a[r].read().result(), data[r], err_msg=str(r))


def test_missing_chunks_read_as_the_fill_value(tmp_path: Path) -> None:
    a = tsp.open(url(tmp_path / "a"), create=True, dtype="uint16", shape=(50, 50), chunks=(8, 8),
                 compression="gzip", fill_value=9).result()
    want = np.full((50, 50), 9, np.uint16)
    part = noisy((20, 13), "uint16", seed=1)
    a[10:30, 20:33].write(part).result()
    want[10:30, 20:33] = part
    for r in REGIONS:
        np.testing.assert_array_equal(a[r].read().result(), want[r], err_msg=str(r))


def test_n5_clipped_edge_blocks_and_planes(tmp_path: Path) -> None:
    data = noisy((70, 50, 37), "uint8")
    a = tsp.open(url(tmp_path / "n5"), driver="n5", create=True, dtype="uint8", shape=data.shape,
                 chunks=(16, 16, 16)).result()  # N5's default compression: blosc
    a.write(data).result()
    for r in [np.s_[...], np.s_[5, :, :], np.s_[:, 33, :], np.s_[:, :, 36], np.s_[3:67, 14:50, 30:37]]:
        np.testing.assert_array_equal(a[r].read().result(), data[r], err_msg=str(r))


def test_a_stored_chunk_larger_than_the_buffer(tmp_path: Path) -> None:
    """A valid stored block larger than the decoded chunk plus the buffer's
    slack (here a gzip stream followed by empty gzip members, which N5 reads as
    one stream) is read whole, not cut at the buffer's end."""
    data = noisy((32, 32), "uint8", seed=2)
    a = tsp.open(url(tmp_path / "n5"), driver="n5", create=True, dtype="uint8", shape=data.shape,
                 chunks=(16, 16), compression="gzip").result()
    a.write(data).result()
    block = tmp_path / "n5" / "1" / "0"
    stored = block.read_bytes()
    header = 2 + 2 + 4 * 2  # mode, ndim, two dimensions
    padded = stored + gzip.compress(b"") * 400  # ~8 KiB of empty members
    assert len(padded) > 16 * 16 + 4096
    block.write_bytes(padded)
    assert gzip.decompress(padded[header:]) == gzip.decompress(stored[header:])
    np.testing.assert_array_equal(a.read().result(), data)
    np.testing.assert_array_equal(a[20:30, 3:9].read().result(), data[20:30, 3:9])


def test_a_corrupt_chunk_names_its_key(tmp_path: Path) -> None:
    data = noisy((32, 32), "float32", seed=3)
    a = tsp.open(url(tmp_path / "a"), create=True, dtype="float32", shape=data.shape, chunks=(16, 16),
                 compression=("zstd", 3)).result()
    a.write(data).result()
    chunk = tmp_path / "a" / "c" / "1" / "1"
    good = chunk.read_bytes()
    chunk.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(DataCorruptionError, match="c/1/1"):
        a[20:30, 20:30].read().result()
    chunk.write_bytes(good + b"\0" * 100)  # trailing garbage after the frame
    with pytest.raises(DataCorruptionError, match="c/1/1"):
        a.read().result()


def test_many_threads_read_at_once(tmp_path: Path) -> None:
    """Every thread has its own buffer: concurrent reads of different regions
    (each with several chunks per batch) never see each other's bytes."""
    data = noisy((96, 96), "int16", seed=4)
    a = tsp.open(url(tmp_path / "a"), create=True, dtype="int16", shape=data.shape, chunks=(8, 8),
                 compression="gzip").result()
    a.write(data).result()
    rng = np.random.default_rng(5)
    boxes = []
    for _ in range(60):
        y, x = (int(v) for v in rng.integers(0, 90, 2))
        boxes.append(np.s_[y:y + int(rng.integers(1, 40)), x:x + int(rng.integers(1, 40))])
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda b: a[b].read().result(), boxes))
    for b, g in zip(boxes, got):
        np.testing.assert_array_equal(g, data[b], err_msg=str(b))


def test_a_chunk_rewritten_smaller_between_reads(tmp_path: Path) -> None:
    """The buffer keeps the bytes of an earlier, larger chunk: a smaller one
    read after it is decoded from its own bytes only."""
    big = noisy((16, 16), "uint8", seed=6)
    a = tsp.open(url(tmp_path / "a"), create=True, dtype="uint8", shape=(16, 32), chunks=(16, 16),
                 compression="gzip", fill_value=0).result()
    a[:, :16].write(big).result()
    a[:, 16:].write(np.full((16, 16), 4, np.uint8)).result()
    files = sorted((tmp_path / "a" / "c" / "0").iterdir())
    assert os.path.getsize(files[0]) > os.path.getsize(files[1])
    want = np.concatenate([big, np.full((16, 16), 4, np.uint8)], axis=1)
    np.testing.assert_array_equal(a.read().result(), want)
