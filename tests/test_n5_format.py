"""The N5 format layer (tensorstore_py.drivers.n5) against TensorStore's ``n5``
driver (both ways, every compression it supports, odd shapes with edge
blocks), against blocks written by N5-Java's own compression streams
(tests/data/n5_java, see N5JavaGolden.java there), and against hostile input.
"""

from __future__ import annotations

import itertools
import json
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from _bombs import zstd_rle_frame
from numcodecs.blosc import list_compressors

from tensorstore_py.core.errors import (
    ChecksumError,
    DataCorruptionError,
    InvalidArgumentError,
    InvalidSpecError,
    OutOfRangeError,
    UnsupportedError,
)
from tensorstore_py.drivers.n5 import (
    ATTRIBUTES_KEY,
    DATA_TYPES,
    BlockHeader,
    N5Metadata,
    block_key,
    block_shape,
    compression_from_json,
    decode_block,
    decode_header,
    encode_block,
    encode_header,
    lz4block,
    read_block,
)
from tensorstore_py.drivers.n5.compression import GzipCompression, Lz4Compression

ts = pytest.importorskip("tensorstore")

JAVA = Path(__file__).parent / "data" / "n5_java"
SHAPE, BLOCK = (13, 7, 5), (4, 3, 2)  # every dimension has a clipped edge block

# what TensorStore's n5 driver supports (it has no lz4)
TS_COMPRESSIONS = [
    {"type": "raw"},
    {"type": "gzip", "level": 6, "useZlib": False},
    {"type": "gzip", "level": -1, "useZlib": True},
    {"type": "bzip2", "blockSize": 9},
    {"type": "xz", "preset": 6},
    {"type": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1, "blocksize": 0},
    {"type": "blosc", "cname": "zstd", "clevel": 3, "shuffle": 2, "blocksize": 0},
    {"type": "blosc", "cname": "blosclz", "clevel": 9, "shuffle": 0, "blocksize": 0},
    {"type": "zstd", "level": 3},
]
DTYPE_NAMES = list(DATA_TYPES)
# each compression with another data type, so that every type meets a compressor
CASES = [(c, DTYPE_NAMES[(3 * i) % len(DTYPE_NAMES)]) for i, c in enumerate(TS_COMPRESSIONS)]


def case_id(case: tuple[dict, str]) -> str:
    comp, dtype = case
    return "-".join(str(v) for v in comp.values()) + "-" + dtype


def sample(dtype: str, shape: tuple[int, ...] = SHAPE, seed: int = 0) -> np.ndarray:
    dt, rng = np.dtype(dtype), np.random.default_rng(seed)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    return (rng.standard_normal(shape) * 1000).astype(dt)


def region(meta: N5Metadata, grid: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(g * b, g * b + n) for g, b, n in zip(grid, meta.block_size, block_shape(meta, grid)))


def read_all(root: Path) -> np.ndarray:
    """The whole array from attributes.json and the block files, with this package only."""
    meta = N5Metadata.from_bytes((root / ATTRIBUTES_KEY).read_bytes())
    out = np.zeros(meta.shape, meta.dtype)
    for g in itertools.product(*map(range, meta.grid_shape)):
        path = root / block_key(g)
        if path.exists():
            block = decode_block(meta, path.read_bytes(), key=block_key(g))
            assert block.shape == meta.block_size and block.dtype == meta.dtype
            out[region(meta, g)] = block[tuple(slice(0, n) for n in block_shape(meta, g))]
    return out


def write_all(root: Path, meta: N5Metadata, array: np.ndarray, *, clipped: bool = True) -> None:
    """attributes.json and every block; edge blocks clipped (N5-Java) or padded (TensorStore)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / ATTRIBUTES_KEY).write_bytes(meta.encode())
    for g in itertools.product(*map(range, meta.grid_shape)):
        path = root / block_key(g)
        path.parent.mkdir(parents=True, exist_ok=True)
        if clipped:
            data = encode_block(meta, array[region(meta, g)], grid_index=g)
        else:
            full = np.zeros(meta.block_size, meta.dtype)
            full[tuple(slice(0, n) for n in block_shape(meta, g))] = array[region(meta, g)]
            data = encode_block(meta, full)
        path.write_bytes(data)


def ts_spec(root: Path) -> dict:
    return {"driver": "n5", "kvstore": {"driver": "file", "path": str(root)}}


def ts_write(root: Path, metadata: dict, array: np.ndarray) -> None:
    t = ts.open({**ts_spec(root), "metadata": metadata}, create=True).result()
    t.write(array).result()


def ts_read(root: Path) -> np.ndarray:
    return ts.open(ts_spec(root), open=True, read=True).result().read().result()


# -- axis order --------------------------------------------------------------------------


def test_axis_order_matches_tensorstore(tmp_path: Path) -> None:
    """TensorStore presents N5 dimensions in attributes.json order, keys and block
    headers use that order, and a block stores its first dimension fastest."""
    a = np.arange(5 * 7, dtype=np.uint16).reshape(5, 7)
    ts_write(tmp_path, {"dimensions": [5, 7], "blockSize": [4, 3], "dataType": "uint16",
                        "compression": {"type": "raw"}}, a)
    t = ts.open(ts_spec(tmp_path)).result()
    assert t.shape == (5, 7) and list(t.chunk_layout.inner_order) == [1, 0]
    raw = (tmp_path / "0" / "1").read_bytes()  # grid (0, 1): rows 0..3, columns 3..5
    assert decode_header(raw) == BlockHeader(0, (4, 3), 12)
    assert list(np.frombuffer(raw[12:], ">u2")) == list(a[0:4, 3:6].ravel(order="F"))
    meta = N5Metadata.from_bytes((tmp_path / ATTRIBUTES_KEY).read_bytes())
    assert np.array_equal(decode_block(meta, raw), a[0:4, 3:6])
    # TensorStore pads edge blocks: grid (1, 2) holds one element and zeros
    edge = (tmp_path / "1" / "2").read_bytes()
    assert decode_header(edge).shape == (4, 3)
    assert np.array_equal(decode_block(meta, edge)[:1, :1], a[4:, 6:])


def test_spec_example_block() -> None:
    """The N5 spec's 1x2x3 uint16 raw block storing 1..6, first dimension fastest."""
    raw = bytes.fromhex("0000 0003 00000001 00000002 00000003") + np.arange(1, 7, dtype=">u2").tobytes()
    meta = N5Metadata.create([1, 2, 3], [1, 2, 3], "uint16", compression={"type": "raw"})
    got = decode_block(meta, raw)
    assert got.dtype == np.uint16 and np.array_equal(got, np.arange(1, 7).reshape((1, 2, 3), order="F"))
    assert encode_block(meta, got) == raw


# -- TensorStore writes, we read; we write, TensorStore reads ----------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_read_what_tensorstore_writes(tmp_path: Path, case: tuple[dict, str]) -> None:
    comp, dtype = case
    a = sample(dtype)
    ts_write(tmp_path, {"dimensions": list(SHAPE), "blockSize": list(BLOCK), "dataType": dtype,
                        "compression": comp}, a)
    meta = N5Metadata.from_bytes((tmp_path / ATTRIBUTES_KEY).read_bytes())
    assert meta.compression == compression_from_json(comp) and meta.dtype == np.dtype(dtype)
    assert np.array_equal(read_all(tmp_path), a)


@pytest.mark.parametrize("clipped", [True, False], ids=["clipped", "padded"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tensorstore_reads_what_we_write(tmp_path: Path, case: tuple[dict, str], clipped: bool) -> None:
    comp, dtype = case
    a = sample(dtype, seed=1)
    meta = N5Metadata.create(SHAPE, BLOCK, dtype, compression=comp, attributes={"note": "kept"})
    write_all(tmp_path, meta, a, clipped=clipped)
    if clipped:  # N5-Java's edge blocks: the header holds the clipped shape
        assert decode_header((tmp_path / "3" / "2" / "2").read_bytes()).shape == (1, 1, 1)
    assert np.array_equal(ts_read(tmp_path), a)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_every_data_type_both_ways(tmp_path: Path, dtype: str) -> None:
    a, b = sample(dtype, seed=2), sample(dtype, seed=3)
    ts_write(tmp_path / "ts", {"dimensions": list(SHAPE), "blockSize": list(BLOCK), "dataType": dtype,
                               "compression": {"type": "raw"}}, a)
    assert np.array_equal(read_all(tmp_path / "ts"), a)
    write_all(tmp_path / "ours", N5Metadata.create(SHAPE, BLOCK, dtype, compression={"type": "raw"}), b)
    assert np.array_equal(ts_read(tmp_path / "ours"), b)


def test_rank_zero_both_ways(tmp_path: Path) -> None:
    ts_write(tmp_path / "ts", {"dimensions": [], "blockSize": [], "dataType": "int64",
                               "compression": {"type": "gzip"}}, np.int64(-7))
    assert read_all(tmp_path / "ts")[()] == -7 and (tmp_path / "ts" / "0").exists()
    meta = N5Metadata.create([], [], "float64", compression={"type": "zstd"})
    write_all(tmp_path / "ours", meta, np.array(2.5))
    assert ts_read(tmp_path / "ours")[()] == 2.5


def test_default_compression_is_tensorstores(tmp_path: Path) -> None:
    for dtype, shuffle in (("uint8", 2), ("float32", 1)):
        ours = N5Metadata.create([3], [3], dtype).compression.to_json()
        t = ts.open({**ts_spec(tmp_path / dtype), "metadata": {"dimensions": [3], "blockSize": [3]},
                     "dtype": dtype}, create=True).result()
        assert t is not None
        theirs = json.loads((tmp_path / dtype / ATTRIBUTES_KEY).read_text())["compression"]
        assert ours == theirs == {"type": "blosc", "cname": "lz4", "clevel": 5, "shuffle": shuffle,
                                  "blocksize": 0}


# -- blocks as N5-Java writes them --------------------------------------------------------

JAVA_DIMS, JAVA_BLOCK = (70, 9), (64, 4)
JAVA_FILES = {"lz4": {"type": "lz4", "blockSize": 64}, "gzip": {"type": "gzip"},
              "zlib": {"type": "gzip", "useZlib": True}, "bzip2": {"type": "bzip2"}, "xz": {"type": "xz"}}


def java_values() -> np.ndarray:
    """The int32 array N5JavaGolden.java writes."""
    x, y = np.meshgrid(np.arange(JAVA_DIMS[0], dtype=np.int64), np.arange(JAVA_DIMS[1], dtype=np.int64),
                       indexing="ij")
    mixed = ((x * 31 + y * 17) * 0x9E3779B1) & 0xFFFFFFFF
    return np.where(x < 32, x + 100 * y, mixed).astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("name", list(JAVA_FILES))
def test_blocks_written_by_n5_java(name: str) -> None:
    meta = N5Metadata.create(JAVA_DIMS, JAVA_BLOCK, "int32", compression=JAVA_FILES[name])
    full = java_values()
    for g in [(0, 0), (1, 2)]:
        data = (JAVA / f"{name}.{g[0]}.{g[1]}").read_bytes()
        header, stored = read_block(meta, data, key=name)
        assert header == BlockHeader(0, block_shape(meta, g), stored.size)
        assert np.array_equal(stored, full[region(meta, g)])
        mine = encode_block(meta, full[region(meta, g)], grid_index=g)
        assert np.array_equal(read_block(meta, mine)[1], stored)
        if name in ("lz4", "zlib", "xz"):  # same library, same settings: the same bytes
            assert mine == data


def test_lz4_framing_details() -> None:
    """Token, little-endian lengths, XXH32 with lz4-java's seed and 28-bit mask,
    RAW frames for incompressible data, the empty end frame."""
    data = (JAVA / "lz4.0.0").read_bytes()[12:]
    pos, methods = 0, set()
    while True:
        assert data[pos: pos + 8] == b"LZ4Block"
        token, clen, olen, check = struct.unpack_from("<Biii", data, pos + 8)
        assert token & 0x0F == 0  # blockSize 64 -> level 0
        if olen == 0:
            assert pos + 21 == len(data) and token == 0x10 and check == 0
            break
        methods.add(token & 0xF0)
        assert olen <= 64 and check >> 28 == 0
        pos += 21 + clen
    assert methods == {0x10, 0x20}
    block = np.ascontiguousarray(java_values()[:64, :4].astype(">i4").T).tobytes()
    assert lz4block.frame_checksum(block[:64]) == struct.unpack_from("<i", data, 17)[0]
    assert lz4block.level_of(1 << 16) == 6 and lz4block.level_of(1 << 25) == 15 and lz4block.level_of(100) == 0


def test_lz4_stream_checks() -> None:
    payload = np.arange(300, dtype=">u4").tobytes()
    stream = lz4block.encode(payload, block_size=256)
    assert bytes(lz4block.decode(stream, size=1200, key="k")) == payload
    # N5-Java reads exactly the block's bytes: a stream without its end frame reads
    assert bytes(lz4block.decode(stream[:-21], size=1200, key="k")) == payload
    with pytest.raises(DataCorruptionError, match="after the lz4 end frame"):
        lz4block.decode(stream + b"x", size=1200, key="k")
    bad = bytearray(stream)
    bad[17] ^= 1  # the first frame's checksum
    with pytest.raises(ChecksumError):
        lz4block.decode(bytes(bad), size=1200, key="k")
    bad = bytearray(stream)
    bad[8] = 0x30  # unknown method
    with pytest.raises(DataCorruptionError, match="corrupt lz4 frame"):
        lz4block.decode(bytes(bad), size=1200, key="k")
    with pytest.raises(DataCorruptionError, match="truncated"):
        lz4block.decode(stream[:100], size=1200, key="k")
    with pytest.raises(DataCorruptionError, match="decodes to 1200 bytes, expected 1300"):
        lz4block.decode(stream, size=1300, key="k")
    with pytest.raises(DataCorruptionError, match="bad or truncated frame header"):
        lz4block.decode(b"LZ4Blocx" + stream[8:], size=1200, key="k")


def test_lz4_without_xxhash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lz4block, "xxhash", None)
    with pytest.raises(UnsupportedError, match="xxhash"):
        Lz4Compression().encode(b"abc", itemsize=1)


# -- attributes.json ----------------------------------------------------------------------


def test_attributes_round_trip_keeps_other_attributes() -> None:
    doc = {"dimensions": [100, 200, 30], "blockSize": [64, 64, 8], "dataType": "float32",
           "compression": {"type": "blosc", "cname": "zstd", "clevel": 4, "shuffle": 2, "blocksize": 0,
                           "nthreads": 8},
           "axes": ["x", "y", "z"], "units": ["nm", "nm", "nm"], "resolution": [4, 4, 40.5],
           "pixelResolution": {"unit": "um", "dimensions": [1, 1, 1]}, "downsamplingFactors": [2, 2, 1]}
    meta = N5Metadata.from_bytes(json.dumps(doc).encode())
    assert meta.shape == (100, 200, 30) and meta.grid_shape == (2, 4, 4) and meta.axes == ("x", "y", "z")
    assert meta.dtype == np.float32 and meta.stored_dtype == np.dtype(">f4")
    assert meta.compression.extra == {"nthreads": 8}  # n5-blosc's parameter, kept
    assert json.loads(meta.encode()) == doc
    resized = meta.with_dimensions([10, 20, 3])
    assert json.loads(resized.encode()) == {**doc, "dimensions": [10, 20, 3]}
    with pytest.raises(InvalidSpecError, match="dimensions"):
        meta.with_dimensions([1, 2])


def test_legacy_compression_type() -> None:
    doc = {"dimensions": [4], "blockSize": [2], "dataType": "int16", "compressionType": "bzip2", "n5": "0.2"}
    meta = N5Metadata.from_json(doc)
    assert meta.legacy_compression and meta.compression.to_json() == {"type": "bzip2", "blockSize": 9}
    assert meta.to_json() == doc  # written back in the form it was found
    both = {**doc, "compression": {"type": "gzip"}}  # the modern object wins; the string is kept
    meta = N5Metadata.from_json(both)
    assert not meta.legacy_compression and meta.compression == GzipCompression()
    assert meta.to_json()["compressionType"] == "bzip2"
    with pytest.raises(UnsupportedError, match="'snappy'"):
        N5Metadata.from_json({**doc, "compressionType": "snappy"})
    with pytest.raises(InvalidSpecError, match="compressionType"):
        N5Metadata.from_json({**doc, "compressionType": {"type": "gzip"}})


VALID = {"dimensions": [10, 20], "blockSize": [5, 5], "dataType": "uint8", "compression": {"type": "raw"}}


@pytest.mark.parametrize("change, error, field", [
    ({"dimensions": None}, InvalidSpecError, "dimensions"),
    ({"dimensions": [10, -1]}, InvalidSpecError, "dimensions"),
    ({"dimensions": [10, 2.5]}, InvalidSpecError, "dimensions"),
    ({"dimensions": "10"}, InvalidSpecError, "dimensions"),
    ({"blockSize": [5, 0]}, InvalidSpecError, "blockSize"),
    ({"blockSize": [5]}, InvalidSpecError, "blockSize"),
    ({"blockSize": [65536, 65536]}, InvalidSpecError, "blockSize"),  # 4 GiB block
    ({"blockSize": [True, 5]}, InvalidSpecError, "blockSize"),
    ({"dataType": 8}, InvalidSpecError, "dataType"),
    ({"dataType": "float16"}, UnsupportedError, "'float16'"),
    ({"dataType": "object"}, UnsupportedError, "'object'"),
    ({"dataType": "string"}, UnsupportedError, "'string'"),
    ({"compression": None}, InvalidSpecError, "compression"),
    ({"compression": "gzip"}, InvalidSpecError, "compression"),
    ({"compression": {"level": 1}}, InvalidSpecError, "compression.type"),
    ({"compression": {"type": "jpeg"}}, UnsupportedError, "'jpeg'"),
    ({"compression": {"type": "gzip", "level": 10}}, InvalidSpecError, "compression.level"),
    ({"compression": {"type": "gzip", "useZlib": 1}}, InvalidSpecError, "compression.useZlib"),
    ({"compression": {"type": "bzip2", "blockSize": 0}}, InvalidSpecError, "compression.blockSize"),
    ({"compression": {"type": "xz", "preset": "6"}}, InvalidSpecError, "compression.preset"),
    ({"compression": {"type": "blosc", "cname": "lzma"}}, InvalidSpecError, "compression.cname"),
    ({"compression": {"type": "blosc", "shuffle": 3}}, InvalidSpecError, "compression.shuffle"),
    ({"compression": {"type": "zstd", "level": 23}}, InvalidSpecError, "compression.level"),
    ({"compression": {"type": "lz4", "blockSize": 32}}, InvalidSpecError, "compression.blockSize"),
    ({"axes": ["x"]}, InvalidSpecError, "axes"),
    ({"axes": ["x", "x"]}, InvalidSpecError, "axes"),
    ({"units": ["nm", 3]}, InvalidSpecError, "units"),
    ({"resolution": [1, "a"]}, InvalidSpecError, "resolution"),
])
def test_invalid_attributes(change: dict, error: type, field: str) -> None:
    doc = {k: v for k, v in {**VALID, **change}.items() if v is not None}
    with pytest.raises(error, match=field):
        N5Metadata.from_json(doc)


def test_blosc_codec_missing_from_the_build() -> None:
    if "snappy" in list_compressors():
        pytest.skip("this blosc build has snappy")
    snappy = compression_from_json({"type": "blosc", "cname": "snappy"})  # valid N5, opens
    with pytest.raises(UnsupportedError, match="snappy"):
        snappy.encode(bytes(8), itemsize=1)


def test_invalid_attribute_documents() -> None:
    with pytest.raises(InvalidSpecError, match="not valid JSON"):
        N5Metadata.from_bytes(b"{nope")
    with pytest.raises(InvalidSpecError, match="JSON object"):
        N5Metadata.from_json([1, 2])
    with pytest.raises(UnsupportedError, match="float16"):
        N5Metadata.create([1], [1], np.float16)


# -- block headers -----------------------------------------------------------------------


def test_headers() -> None:
    assert encode_header((3, 4)) == bytes.fromhex("0000 0002 00000003 00000004")
    assert encode_header((3, 4), num_elements=12) == encode_header((3, 4))
    varlength = encode_header((3, 4), num_elements=5)
    assert varlength == bytes.fromhex("0001 0002 00000003 00000004 00000005")
    assert decode_header(varlength) == BlockHeader(1, (3, 4), 5) and decode_header(varlength).size == 16
    obj = decode_header(bytes.fromhex("0002 00000009") + b"x" * 9)
    assert obj == BlockHeader(2, (), 9) and obj.size == 6
    with pytest.raises(InvalidArgumentError):
        encode_header((2**32,))
    assert block_key((0, 4, 1, 7)) == "0/4/1/7" and block_key(()) == "0"


def test_mode_one_with_matching_count_reads(tmp_path: Path) -> None:
    meta = N5Metadata.create([3, 4], [3, 4], "uint16", compression={"type": "gzip"})
    a = sample("uint16", (3, 4))
    mode0 = encode_block(meta, a)
    mode1 = b"\x00\x01" + mode0[2:12] + struct.pack(">I", 12) + mode0[12:]
    assert np.array_equal(decode_block(meta, mode1), a)


@pytest.mark.parametrize("data, error, match", [
    (b"\x00", DataCorruptionError, "shorter than its header"),
    (bytes.fromhex("0000 0002 00000003"), DataCorruptionError, "shorter than its header"),
    (bytes.fromhex("0007 0002"), DataCorruptionError, "unknown block mode 7"),
    (bytes.fromhex("0000 0003 00000001 00000001 00000001"), DataCorruptionError, "does not fit"),
    (bytes.fromhex("0000 0002 00000004 00000004") + bytes(32), DataCorruptionError, "does not fit"),
    (bytes.fromhex("0001 0002 00000002 00000002 00000003") + bytes(6), UnsupportedError, "varlength"),
    (bytes.fromhex("0002 00000004") + bytes(4), UnsupportedError, "mode 2"),
    (bytes.fromhex("0000 0002 00000002 00000002") + bytes(7), DataCorruptionError, "7 bytes, expected 8"),
])
def test_hostile_headers(data: bytes, error: type, match: str) -> None:
    meta = N5Metadata.create([4, 4], [4, 3], "uint16", compression={"type": "raw"})
    with pytest.raises(error, match=match):
        decode_block(meta, data, key="0/0")


def test_encode_block_checks_its_input() -> None:
    meta = N5Metadata.create([5, 7], [4, 3], "int32", compression={"type": "raw"})
    with pytest.raises(InvalidArgumentError, match="int64"):
        encode_block(meta, np.zeros((4, 3), np.int64))
    with pytest.raises(InvalidArgumentError, match="shape"):
        encode_block(meta, np.zeros((5, 3), np.int32))
    with pytest.raises(InvalidArgumentError, match="shape"):
        encode_block(meta, np.zeros((2, 3), np.int32), grid_index=(1, 2))  # edge block is (1, 1)
    with pytest.raises(OutOfRangeError):
        encode_block(meta, np.zeros((1, 1), np.int32), grid_index=(2, 0))
    assert block_shape(meta, (1, 2)) == (1, 1) and block_shape(meta, (0, 0)) == (4, 3)
    # big-endian input is the same data type
    a = np.arange(12, dtype=">i4").reshape(4, 3)
    assert np.array_equal(decode_block(meta, encode_block(meta, a)), a)


# -- bombs and lying data ----------------------------------------------------------------

EXPECTED = 4 * 3 * 2  # the blocks below: 4 x 3 uint16
BOMB = 8 << 20


def test_zstd_frame_without_content_size_reads() -> None:
    meta = N5Metadata.create([4, 3], [4, 3], "uint16", compression={"type": "zstd"})
    got = decode_block(meta, encode_header((4, 3)) + zstd_rle_frame(EXPECTED))
    assert np.all(got == 0x0707)


@pytest.fixture(scope="module")
def bombs() -> dict[str, tuple[dict, bytes]]:
    """compression -> (compression JSON, data decoding to BOMB bytes), for a block
    whose header promises EXPECTED bytes."""
    zeros = bytes(BOMB)
    out: dict[str, tuple[dict, bytes]] = {}
    for comp in [{"type": "gzip"}, {"type": "gzip", "useZlib": True}, {"type": "bzip2"},
                 {"type": "xz", "preset": 0}, {"type": "zstd"}, {"type": "blosc", "cname": "lz4"},
                 {"type": "lz4"}]:
        name = comp["type"] + ("-zlib" if comp.get("useZlib") else "")
        out[name] = (comp, bytes(compression_from_json(comp).encode(zeros, itemsize=2)))
    out["zstd-no-content-size"] = ({"type": "zstd"}, zstd_rle_frame(BOMB))
    out["raw"] = ({"type": "raw"}, zeros)
    return out


@pytest.mark.parametrize("name", ["gzip", "gzip-zlib", "bzip2", "xz", "zstd", "zstd-no-content-size",
                                  "blosc", "lz4", "raw"])
def test_bombs_are_refused_without_allocating(bombs: dict, name: str) -> None:
    comp, data = bombs[name]
    meta = N5Metadata.create([4, 3], [4, 3], "uint16", compression=comp)
    block = encode_header((4, 3)) + data
    tracemalloc.start()
    try:
        with pytest.raises(DataCorruptionError):
            decode_block(meta, block, key="0/0")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < len(data) + (1 << 20) if name == "raw" else peak < 1 << 20


@pytest.mark.parametrize("comp", [c for c, _ in CASES] + [{"type": "lz4"}], ids=lambda c: c["type"])
def test_short_long_and_garbage_data(comp: dict) -> None:
    meta = N5Metadata.create([4, 3], [4, 3], "uint16", compression=comp)
    c = meta.compression
    for n in (EXPECTED - 2, EXPECTED + 2):  # a stream of the wrong length for its header
        with pytest.raises(DataCorruptionError):
            decode_block(meta, encode_header((4, 3)) + bytes(c.encode(bytes(n), itemsize=2)), key="k")
    good = bytes(c.encode(np.arange(12, dtype=">u2").tobytes(), itemsize=2))
    if comp["type"] != "raw":
        for broken in (good[: len(good) // 2], b"\x00garbage" * 4):
            with pytest.raises(DataCorruptionError, match="'k'"):
                decode_block(meta, encode_header((4, 3)) + broken, key="k")


def test_gzip_reads_concatenated_members() -> None:
    """N5-Java's gzip reader decodes concatenated members; so do we."""
    meta = N5Metadata.create([4, 3], [4, 3], "uint16", compression={"type": "gzip"})
    data = np.arange(12, dtype=">u2").tobytes()
    c = meta.compression
    block = encode_header((4, 3)) + bytes(c.encode(data[:10], itemsize=2)) + bytes(c.encode(data[10:], itemsize=2))
    assert np.array_equal(decode_block(meta, block), np.arange(12).reshape((4, 3), order="F"))
