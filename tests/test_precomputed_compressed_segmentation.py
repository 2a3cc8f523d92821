"""compressed_segmentation: byte-identical to TensorStore's encoder on random
and realistic label volumes (large constant regions, few labels per block),
uint32 and uint64, several channels, any block size (smaller than, equal to,
larger than and not dividing the chunk); hostile data raises typed errors;
regions decode like the whole chunk. Decoding is tested both compiled and in numpy."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
from _precomputed import label_volume, ts_create

from tensorstore_py.core.errors import DataCorruptionError, InvalidArgumentError
from tensorstore_py.drivers.precomputed import cseg_kernel
from tensorstore_py.drivers.precomputed.compressed_segmentation import decode, encode


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with the compiled kernel (numba) and with the numpy decoder."""
    if request.param == "numpy":
        monkeypatch.setattr(cseg_kernel, "_KERNEL", [None])
    elif cseg_kernel.kernel() is None:
        pytest.skip("numba is not installed")
    return request.param

SHAPES = [  # (x, y, z, channels), block (x, y, z)
    ((8, 8, 8, 1), (4, 4, 4)),
    ((9, 7, 5, 2), (4, 3, 2)),
    ((5, 5, 5, 1), (8, 8, 8)),
    ((16, 3, 7, 1), (2, 8, 1)),
    ((6, 6, 6, 3), (1, 1, 1)),
    ((13, 11, 9, 1), (8, 8, 8)),
]


def volume(kind: str, shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "random":  # every voxel its own large label
        return rng.integers(0, np.iinfo(dtype).max, size=shape, dtype=dtype, endpoint=True)
    if kind == "few":  # a handful of labels, scattered: 1..3 bits per voxel
        return (rng.integers(0, 5, size=shape) * (2**40 + 3 if dtype == "uint64" else 1234567891)).astype(dtype)
    if kind == "constant":
        return np.full(shape, 7, dtype)
    return label_volume(shape, dtype, rng)  # realistic: Voronoi cells and a zero background


def tensorstore_encoding(tmp_path: Path, array: np.ndarray, block: tuple[int, int, int]) -> bytes:
    """The chunk TensorStore writes for ``array`` as one chunk."""
    x, y, z, c = array.shape
    store = ts_create(tmp_path, data_type=str(array.dtype), size=(x, y, z), chunk_size=(x, y, z),
                      num_channels=c, encoding="compressed_segmentation",
                      compressed_segmentation_block_size=list(block), volume_type="segmentation")
    store.write(array).result()
    return (tmp_path / "1_1_1" / f"0-{x}_0-{y}_0-{z}").read_bytes()


@pytest.mark.parametrize("dtype", ["uint32", "uint64"])
@pytest.mark.parametrize("kind", ["random", "few", "constant", "realistic"])
@pytest.mark.parametrize("shape,block", SHAPES, ids=lambda v: "x".join(map(str, v)))
def test_byte_identical_to_tensorstore(tmp_path: Path, dtype: str, kind: str, shape: tuple[int, ...],
                                       block: tuple[int, int, int]) -> None:
    rng = np.random.default_rng(zlib.crc32(repr((dtype, kind, shape)).encode()))
    array = volume(kind, shape, dtype, rng)
    if kind == "constant" and shape[0] * shape[1] * shape[2] % 2 == 0:
        array.reshape(-1)[::2] = 0  # still few values, but not all the same
    theirs = tensorstore_encoding(tmp_path, array, block)
    assert encode(array, block) == theirs
    np.testing.assert_array_equal(decode(theirs, shape, block, dtype), array)


def test_identical_tables_are_stored_once() -> None:
    array = np.zeros((8, 4, 4, 1), np.uint64)
    array[4:] = 5  # blocks x=0 and x=1 hold {0} and {5}; two 4x4x4 blocks along x
    array[0, 0, 0] = 5  # block 0 now holds {0, 5}
    array[4, 0, 0] = 0  # block 1 holds {0, 5} too: the same table
    words = np.frombuffer(encode(array, (4, 4, 4)), "<u4")
    assert words[0] == 1  # channel 0 starts after the one offset word
    h0, h1 = words[1:3], words[3:5]
    assert h0[0] & 0xFFFFFF == h1[0] & 0xFFFFFF  # same lookup table offset
    assert h0[0] >> 24 == h1[0] >> 24 == 1 and h0[1] != h1[1]  # 1 bit each, own values


def test_decoded_arrays_are_x_y_z_channel_views() -> None:
    rng = np.random.default_rng(1)
    array = label_volume((7, 6, 5, 2), "uint32", rng)
    out = decode(encode(array, (3, 3, 3)), array.shape, (3, 3, 3), "uint32")
    assert out.shape == array.shape and out.transpose(3, 2, 1, 0).flags.c_contiguous
    np.testing.assert_array_equal(out, array)
    # strided and non-contiguous inputs encode the same as contiguous ones
    base = label_volume((14, 6, 5, 2), "uint32", rng)
    assert encode(base[::2], (3, 3, 3)) == encode(np.ascontiguousarray(base[::2]), (3, 3, 3))


def _header(words: np.ndarray, block: int) -> tuple[int, int, int]:
    w0, w1 = int(words[1 + 2 * block]), int(words[2 + 2 * block])
    return w0 & 0xFFFFFF, w0 >> 24, w1


def _with_header(data: bytes, block: int, table: int, bits: int, values: int) -> bytes:
    words = np.frombuffer(data, "<u4").copy()
    words[1 + 2 * block] = table | (bits << 24)
    words[2 + 2 * block] = values
    return words.tobytes()


@pytest.mark.parametrize("shape,block", SHAPES)
def test_regions_decode_like_the_whole_chunk(shape: tuple[int, ...], block: tuple[int, int, int]) -> None:
    rng = np.random.default_rng(11)
    for dtype in ("uint32", "uint64"):
        array = volume("realistic", shape, dtype, rng)
        data = encode(array, block)
        regions = [tuple(slice(0, n, 1) for n in shape),
                   (slice(1, shape[0], 2), slice(0, shape[1], 1), slice(shape[2] // 2, shape[2] // 2 + 1, 1),
                    slice(0, shape[3], 1)),
                   (slice(shape[0] - 1, shape[0], 1), slice(1, shape[1], 3), slice(0, shape[2], 2),
                    slice(shape[3] - 1, shape[3], 1))]
        for region in regions:
            got = decode(data, shape, block, dtype, region=region)
            np.testing.assert_array_equal(got, array[region])
            holder = np.zeros((2 * got.shape[0], *got.shape[1:]), dtype)  # a strided destination
            assert decode(data, shape, block, dtype, region=region, out=holder[::2]) is not None
            np.testing.assert_array_equal(holder[::2], array[region])
            assert not holder[1::2].any()


def test_hostile_data_raises_data_corruption() -> None:
    array = np.arange(64, dtype=np.uint32).reshape(4, 4, 4, 1) % 3
    block = (2, 2, 2)
    good = encode(array, block)
    n = len(good) // 4
    table, bits, values = _header(np.frombuffer(good, "<u4"), 0)
    assert bits == 2
    bad = {
        "not words": good[:-1],
        "no channel offsets": b"",
        "channel offset past the end": np.array([n + 5], "<u4").tobytes() + good[4:],
        "headers cut off": good[:20],
        "bits not a power of two": _with_header(good, 0, table, 3, values),
        "absurd bit width": _with_header(good, 0, table, 64, values),
        "values past the end": _with_header(good, 0, table, 32, n - 2),
        "table past the end": _with_header(good, 0, n + 100, bits, values),
        "index past the table": _with_header(good, 0, n - 1, bits, values),
        "constant block with no table": _with_header(good, 0, n, 0, values),
    }
    for data in bad.values():
        with pytest.raises(DataCorruptionError, match="'c'"):
            decode(data, array.shape, block, "uint32", key="c")
    region = (slice(0, 4, 1), slice(1, 3, 1), slice(0, 4, 3), slice(0, 1, 1))
    for name, data in bad.items():  # decoding a region checks what it reads just as well
        if name not in ("index past the table", "constant block with no table"):  # blocks the region skips
            with pytest.raises(DataCorruptionError, match="'c'"):
                decode(data, array.shape, block, "uint32", key="c", region=region)
    good64 = encode(array.astype(np.uint64), block)
    with pytest.raises(DataCorruptionError):  # a uint64 table runs one word past the end
        decode(_with_header(good64, 0, len(good64) // 4 - 1, 0, 0), array.shape, block, "uint64")


def test_bad_arguments_raise_invalid_argument() -> None:
    ok = np.zeros((2, 2, 2, 1), np.uint32)
    for args in [(ok.astype(np.uint16), (1, 1, 1)), (ok[..., 0], (1, 1, 1)), (ok, (0, 1, 1)), (ok, (1, 1)),
                 (ok, (2**11, 2**11, 2**11))]:
        with pytest.raises(InvalidArgumentError):
            encode(*args)
    with pytest.raises(InvalidArgumentError):
        decode(b"", (2, 2, 2, 1), (1, 1, 1), "int32")
    with pytest.raises(InvalidArgumentError):
        decode(b"", (2, 2, 2), (1, 1, 1), "uint32")
    # an empty chunk and zero channels are well-formed
    assert decode(encode(np.zeros((0, 3, 3, 1), np.uint32), (2, 2, 2)), (0, 3, 3, 1), (2, 2, 2), "uint32").size == 0
    assert encode(np.zeros((3, 3, 3, 0), np.uint64), (2, 2, 2)) == b""
