"""Chunks whose elements run the other way than the result's (N5 blocks, zarr
``order: F``, zarr3's ``transpose`` codec) are copied in slabs
(drivers/copies.py::copy_into), when read and when written: whole chunks,
unaligned parts, edge chunks, byte-swapped types and strided reads, each
compared with the array written; written chunks byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.drivers.copies import copy_into

SHAPE = (70, 45, 67)  # clipped edge chunks in every dimension
CHUNKS = (32, 32, 32)
REGIONS = [
    np.s_[...],
    np.s_[5:69, 3:40, 2:66],      # unaligned parts of every chunk
    np.s_[32:64, 0:32, 32:64],    # one whole interior chunk
    np.s_[64:, 32:, 64:],         # the far corner's edge chunk
    np.s_[::2, 1::3, ::5],
    np.s_[10, :, :],
    np.s_[:, :, 40],
]


def values(dtype: str) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 30000, SHAPE).astype(dtype)


def check(a: tsp.TensorStore, data: np.ndarray) -> None:
    for r in REGIONS:
        np.testing.assert_array_equal(a[r].read().result(), data[r], err_msg=str(r))


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float64"])
def test_n5_blocks(tmp_path: Path, dtype: str) -> None:
    data = values(dtype)
    a = tsp.open(tmp_path.as_uri() + "/n5/", driver="n5", create=True, dtype=dtype, shape=SHAPE,
                 chunks=CHUNKS).result()
    a.write(data).result()
    check(a, data)


@pytest.mark.parametrize("driver", ["zarr", "zarr3"])
def test_zarr_fortran_order(tmp_path: Path, driver: str) -> None:
    data = values("int32")
    a = tsp.open(tmp_path.as_uri() + "/z/", driver=driver, create=True, dtype="int32", shape=SHAPE,
                 chunks=CHUNKS, order="F", compression="zstd").result()
    a.write(data).result()
    check(a, data)


@pytest.mark.parametrize("shape", [(64, 64, 64), (9, 70, 23), (40, 2, 9, 33), (300, 300), (17, 5)])
def test_copy_into_matches_numpy(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    src_f = np.asfortranarray(rng.integers(0, 255, shape).astype(">u2"))  # the other order, byte-swapped
    for src in (src_f, src_f[..., ::-1], src_f[1:, ..., 2:]):
        dest = np.full(src.shape, 7, np.uint16)
        copy_into(dest, src)
        np.testing.assert_array_equal(dest, src)
        big = np.zeros(tuple(n + 3 for n in src.shape), np.uint16)  # a strided destination
        view = big[tuple(slice(1, 1 + n) for n in src.shape)]
        copy_into(view, src)
        np.testing.assert_array_equal(view, src)
        assert big.sum() == view.sum()  # nothing written outside it


# -- writing: a C-order source into chunks stored first dimension fastest -------------------
@pytest.mark.parametrize("dtype", ["uint8", "int16", "float32"])
def test_n5_raw_blocks_hold_the_elements_first_dimension_fastest(tmp_path: Path, dtype: str) -> None:
    data = values(dtype)
    a = tsp.open(tmp_path.as_uri() + "/n5/", driver="n5", create=True, dtype=dtype, shape=SHAPE,
                 chunks=CHUNKS, compression="raw").result()
    a.write(data).result()
    for cell in [(0, 0, 0), (1, 0, 1), (2, 1, 2)]:  # interior, and edge blocks stored clipped
        sl = tuple(slice(c * b, min((c + 1) * b, n)) for c, b, n in zip(cell, CHUNKS, SHAPE))
        block = data[sl]
        stored = (tmp_path / "n5" / "/".join(map(str, cell))).read_bytes()
        header = 4 + 4 * len(SHAPE)
        assert stored[header:] == block.astype(np.dtype(dtype).newbyteorder(">")).tobytes(order="F")
    check(a, data)


@pytest.mark.parametrize("dtype", ["uint8", "float64"])
def test_zarr2_fortran_chunks_hold_the_elements_first_dimension_fastest(tmp_path: Path, dtype: str) -> None:
    data = values(dtype)
    a = tsp.open(tmp_path.as_uri() + "/z/", driver="zarr", create=True, dtype=dtype, shape=SHAPE,
                 chunks=CHUNKS, order="F", compression=None).result()
    a.write(data).result()
    stored = (tmp_path / "z" / "1.0.1").read_bytes()
    assert stored == data[32:64, 0:32, 32:64].tobytes(order="F")
    check(a, data)
    ts = pytest.importorskip("tensorstore")
    theirs = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "z")}}).result()
    np.testing.assert_array_equal(theirs.read().result(), data)


def test_copy_into_fortran_destination() -> None:
    rng = np.random.default_rng(2)
    for shape in [(64, 64, 64), (33, 9, 70), (70, 300)]:
        src = rng.integers(0, 255, shape).astype("<u2")
        for s in (src, src[1:, ..., ::-1]):
            dest = np.empty(s.shape, ">u2", order="F")
            copy_into(dest, s)
            np.testing.assert_array_equal(dest, s)


# -- the same order, short rows: each row copied as one element ------------------------------
@pytest.mark.parametrize("dtype", ["uint8", "<u2", ">f4", "complex128", "V3", "M8[s]"])
def test_copy_into_short_rows(dtype: str) -> None:
    """Inner chunks placed into a shard (and their parts into a crop): rows of at most
    SHORT_ROW_BYTES copied whole, into strided destinations, nothing written outside."""
    rng = np.random.default_rng(3)
    for shape in [(64, 64, 64), (40, 9, 16, 3), (33, 70, 5)]:
        src = np.frombuffer(rng.bytes(int(np.prod(shape)) * np.dtype(dtype).itemsize), dtype).reshape(shape)
        for s in (src, src[3:, 1:-1], src[::2]):  # strided sources, rows still contiguous
            big = np.zeros(tuple(n + 5 for n in s.shape), dtype)
            view = big[tuple(slice(2, 2 + n) for n in s.shape)]
            copy_into(view, s)
            assert view.tobytes() == s.tobytes()
            rest = big.copy()
            rest[tuple(slice(2, 2 + n) for n in s.shape)] = np.zeros((), dtype)
            assert not rest.view(np.uint8).any()  # nothing written outside the destination


def test_copy_into_short_rows_converts_byte_order_and_skips_reversed_rows() -> None:
    """Rows are copied as bytes only between equal dtypes with contiguous rows: a
    byte-swapped or reversed source still converts element by element."""
    src = np.arange(64 * 64 * 32, dtype="<u2").reshape(64, 64, 32)
    for s in (src.astype(">u2"), src[..., ::-1], src[..., ::2]):
        dest = np.empty(s.shape, "<u2")
        copy_into(dest, s)
        np.testing.assert_array_equal(dest, s)


def test_sharded_inner_chunks_with_short_rows(tmp_path: Path) -> None:
    """A 3-d sharded array of zstd inner chunks (64-byte rows), read whole, in unaligned
    crops and strided, equals what was written; TensorStore reads it alike."""
    data = np.random.default_rng(4).integers(0, 8, (128, 96, 128)).astype(np.uint8)
    a = tsp.open(tmp_path.as_uri() + "/s/", create=True, dtype="uint8", shape=data.shape,
                 chunks=(64, 32, 64), shards=(128, 96, 128), compression=("zstd", 1)).result()
    a.write(data).result()
    for r in (np.s_[...], np.s_[5:120, 3:90, 7:101], np.s_[::3, 1::2, ::7], np.s_[:, 40, :]):
        np.testing.assert_array_equal(a[r].read().result(), data[r], err_msg=str(r))
    ts = pytest.importorskip("tensorstore")
    theirs = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "s")}}).result()
    np.testing.assert_array_equal(theirs.read().result(), data)
