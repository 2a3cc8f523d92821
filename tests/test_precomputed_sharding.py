"""``neuroglancer_uint64_sharded_v1`` against TensorStore: volumes it shards we
read chunk by chunk through the three ranged reads; shards we build it reads
back exactly (byte-identical files when nothing is gzip-compressed). Hostile
indexes raise typed errors."""

from __future__ import annotations

import itertools
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _precomputed import (
    cells,
    file_reader,
    label_volume,
    read_info,
    read_volume,
    region,
    ts_create,
    ts_open,
    write_volume,
)

from tensorstore_py.core.errors import (
    DataCorruptionError,
    InvalidArgumentError,
    InvalidSpecError,
    UnsupportedError,
)
from tensorstore_py.core.ranges import ByteRange
from tensorstore_py.drivers.precomputed import create_scale
from tensorstore_py.drivers.precomputed.sharding import (
    ShardingSpec,
    build_shard,
    chunk_reader,
    compressed_morton_code,
    compressed_morton_codes,
    decode_minishard_index,
    decode_shard_index,
    decode_shard_index_entry,
    encode_minishard_index,
    encode_shard_index,
    morton_bits,
    morton_cell,
    read_chunk,
    shard_cells,
    shard_shape,
    sharding_for,
    split_shard,
)

SIZE = (21, 13, 9)
CHUNK = (4, 4, 2)


def sharding(**kw: Any) -> dict[str, Any]:
    base = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
            "minishard_bits": 2, "shard_bits": 2, "minishard_index_encoding": "raw", "data_encoding": "raw"}
    return {**base, **kw}


SPECS = [
    sharding(),
    sharding(hash="murmurhash3_x86_128", preshift_bits=1, minishard_index_encoding="gzip", data_encoding="gzip"),
    sharding(hash="murmurhash3_x86_128", minishard_bits=0, shard_bits=3, data_encoding="gzip"),
    sharding(preshift_bits=3, minishard_bits=3, shard_bits=0, minishard_index_encoding="gzip"),
    sharding(preshift_bits=2, minishard_bits=1, shard_bits=1),
]


def _id(spec: dict[str, Any]) -> str:
    return "{hash:.8}-p{preshift_bits}-m{minishard_bits}-s{shard_bits}-{minishard_index_encoding}-{data_encoding}".format(
        **spec)


def _case(encoding: str) -> tuple[str, dict[str, Any], np.ndarray]:
    if encoding == "compressed_segmentation":
        return "uint64", {"compressed_segmentation_block_size": [2, 2, 2]}, label_volume(
            (*SIZE, 1), "uint64", np.random.default_rng(4))
    return "uint16", {}, np.random.default_rng(4).integers(0, 60000, (*SIZE, 1)).astype("uint16")


# -- compressed Morton codes ----------------------------------------------------------------

def test_compressed_morton_codes() -> None:
    # the bits of x, y, z interleave from the bottom; a dimension drops out when used up
    assert morton_bits((1, 2, 5)) == (0, 1, 3)
    assert compressed_morton_code((0, 1, 0), (1, 2, 5)) == 0b001
    assert compressed_morton_code((0, 0, 1), (1, 2, 5)) == 0b010
    assert compressed_morton_code((0, 1, 4), (1, 2, 5)) == 0b1001
    assert compressed_morton_code((3, 1, 2), (4, 4, 4)) == 0b101011  # x=11 y=01 z=10 -> z1y1x1 z0y0x0
    rng = np.random.default_rng(0)
    for grid in [(1, 1, 1), (7, 3, 100), (2**20, 5, 2**21), (1, 2**30, 2**33)]:
        pts = np.stack([rng.integers(0, g, 50) for g in grid], 1)
        vec = compressed_morton_codes(pts, grid)
        assert [int(v) for v in vec] == [compressed_morton_code(tuple(p), grid) for p in pts]
    # every cell of a grid gets its own id, and they are dense below 2**bits
    grid = (3, 5, 2)
    ids = compressed_morton_codes(np.array(list(np.ndindex(*grid))), grid)
    assert len(set(ids.tolist())) == 30 and ids.max() < 2 ** sum(morton_bits(grid))
    with pytest.raises(InvalidArgumentError):
        compressed_morton_code((3, 0, 0), (3, 5, 2))
    with pytest.raises(InvalidArgumentError):
        compressed_morton_codes(np.array([[0, 5, 0]]), (3, 5, 2))
    with pytest.raises(InvalidArgumentError):
        compressed_morton_code((0, 0, 0), (2**30, 2**30, 2**30))


# -- the sharding spec ----------------------------------------------------------------------

def test_sharding_spec_json_hash_and_keys() -> None:
    spec = ShardingSpec.from_json(sharding(hash="murmurhash3_x86_128", minishard_bits=3, shard_bits=9))
    assert ShardingSpec.from_json(spec.to_json()) == spec
    assert spec.num_shards == 512 and spec.num_minishards == 8 and spec.shard_index_size == 128
    assert spec.shard_key(10) == "00a.shard"
    assert ShardingSpec(0, "identity", 0, 0).shard_key(0) == "0.shard"
    assert ShardingSpec(0, "identity", 0, 4).shard_key(15) == "f.shard"
    # murmurhash3_x86_128 of the little-endian id, seed 0, low 64 bits
    assert spec.hash_chunk_id(0) == 0x4772B084E028AE41
    assert ShardingSpec(0, "murmurhash3_x86_128", 1, 1).hash_chunk_id(1) == 0xE8BD67D616D4CE9A
    ident = ShardingSpec(preshift_bits=2, hash="identity", minishard_bits=2, shard_bits=3)
    assert ident.shard_and_minishard(0b110_10_11) == (0b110, 0b10)  # preshift drops the low two bits
    assert ShardingSpec(64, "identity", 1, 1).hash_chunk_id(2**64 - 1) == 0
    assert ident.shard_index_range(3) == ByteRange(48, 64)
    for bad in [{"minishard_bits": 40}, {"shard_bits": 63}, {"hash": "md5"}, {"@type": "x"}, {"other": 1},
                {"data_encoding": "zstd"}, {"preshift_bits": 1.5}, {"preshift_bits": True}]:
        with pytest.raises(InvalidSpecError):
            ShardingSpec.from_json(sharding(**bad))
    with pytest.raises(InvalidSpecError, match="required"):
        ShardingSpec.from_json({"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0})
    with pytest.raises(InvalidSpecError):
        ShardingSpec(0, "identity", 33, 0)
    for bad_call in (lambda: ident.shard_key(8), lambda: ident.shard_index_range(4), lambda: ident.hash_chunk_id(-1)):
        with pytest.raises(InvalidArgumentError):
            bad_call()


# -- both ways with TensorStore ------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS, ids=_id)
@pytest.mark.parametrize("encoding", ["raw", "compressed_segmentation"])
def test_we_read_what_tensorstore_shards(tmp_path: Path, spec: dict[str, Any], encoding: str) -> None:
    dtype, extra, data = _case(encoding)
    store = ts_create(tmp_path, data_type=dtype, size=SIZE, chunk_size=CHUNK, encoding=encoding,
                      voxel_offset=[3, -1, 2], sharding=spec, **extra)
    store.write(data).result()
    np.testing.assert_array_equal(read_volume(tmp_path), data)
    # every shard file splits into exactly the chunks the volume has
    scale = read_info(tmp_path).scales[0]
    ids = {scale.chunk_id(c) for c in cells(scale) if data[region(scale, c)].any()}  # zero chunks: not stored
    found: set[int] = set()
    for path in (tmp_path / scale.key).iterdir():
        found |= set(split_shard(scale.sharding, path.read_bytes(), key=path.name))
    assert found == ids


@pytest.mark.parametrize("spec", SPECS, ids=_id)
@pytest.mark.parametrize("encoding", ["raw", "compressed_segmentation"])
def test_tensorstore_reads_shards_we_build(tmp_path: Path, spec: dict[str, Any], encoding: str) -> None:
    dtype, extra, data = _case(encoding)
    opened = create_scale(None, scale_metadata={
        "size": list(SIZE), "voxel_offset": [3, -1, 2], "resolution": [1, 1, 1], "chunk_size": list(CHUNK),
        "encoding": encoding, "sharding": spec, **extra},
        multiscale_metadata={"type": "segmentation", "data_type": dtype, "num_channels": 1})
    ours = write_volume(tmp_path / "ours", opened.info, data, skip_zero=True)  # as TensorStore does
    np.testing.assert_array_equal(ts_open(tmp_path / "ours").read().result(), data)
    ts_create(tmp_path / "ts", data_type=dtype, size=SIZE, chunk_size=CHUNK, encoding=encoding,
              voxel_offset=[3, -1, 2], sharding=spec, volume_type="segmentation", **extra).write(data).result()
    scale = opened.scale
    for key, blob in ours.items():
        if key == "info":
            assert blob == (tmp_path / "ts" / "info").read_bytes()
            continue
        theirs = (tmp_path / "ts" / key).read_bytes()
        if spec["data_encoding"] == "raw" and spec["minishard_index_encoding"] == "raw":
            assert blob == theirs, key  # the same layout, byte for byte
        else:  # deflate streams differ between zlib builds; the contents may not
            assert split_shard(scale.sharding, blob, key=key) == split_shard(scale.sharding, theirs, key=key)


# -- reading one chunk, request by request ------------------------------------------------------

def test_chunk_reader_makes_at_most_three_ranged_reads(tmp_path: Path) -> None:
    spec = ShardingSpec.from_json(sharding(minishard_bits=3, shard_bits=1, minishard_index_encoding="gzip",
                                           data_encoding="gzip"))
    chunks = {cid: bytes([cid]) * (cid + 1) for cid in range(0, 64, 2) if spec.shard_and_minishard(cid)[0] == 0}
    shard = build_shard(spec, chunks)
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / spec.shard_key(0)).write_bytes(shard)
    requests: list[tuple[str, ByteRange]] = []
    read = file_reader(tmp_path)

    def logged(key: str, r: ByteRange) -> bytes | None:
        requests.append((key, r))
        return read(key, r)

    for cid, data in chunks.items():
        requests.clear()
        assert read_chunk(spec, cid, logged, prefix="s/") == data
        assert [k for k, _ in requests] == ["s/0.shard"] * 3
        assert requests[0][1] == spec.shard_index_range(spec.shard_and_minishard(cid)[1])
    requests.clear()
    absent = next(c for c in range(64) if c not in chunks and spec.shard_and_minishard(c)[0] == 0)
    assert read_chunk(spec, absent, logged, prefix="s") is None and len(requests) <= 2
    other_shard = next(c for c in range(64) if spec.shard_and_minishard(c)[0] == 1)
    assert read_chunk(spec, other_shard, logged, prefix="s") is None  # no such shard file
    # the generator form, driven by hand (as an async driver would)
    gen = chunk_reader(spec, 2, prefix="s")
    key, r = next(gen)
    with pytest.raises(StopIteration) as done:
        while True:
            key, r = gen.send(read(key, r))
    assert done.value.value == chunks[2]


def test_minishard_index_round_trip_and_out_of_order_entries() -> None:
    spec = ShardingSpec(0, "identity", 1, 0)
    base = spec.shard_index_size
    entries = [(3, ByteRange(base, base + 10)), (9, ByteRange(base + 10, base + 10)), (2**63, ByteRange(base + 40, base + 41))]
    index = decode_minishard_index(encode_minishard_index(entries, spec), spec, key="k")
    assert list(index.items()) == entries and len(index) == 3
    assert index.find(9) == ByteRange(base + 10, base + 10) and index.find(4) is None
    # ids and chunks written out of order (deltas wrap modulo 2**64) decode and sort, as in TensorStore
    arr = np.array([[7, 2**64 - 4, 10], [20, 2**64 - 25, 50], [5, 5, 5]], "<u8")
    index = decode_minishard_index(arr.tobytes(), spec, key="k")
    assert [(c, r.start - base, r.stop - base) for c, r in index.items()] == [(3, 0, 5), (7, 20, 25), (13, 55, 60)]
    with pytest.raises(InvalidArgumentError):
        encode_minishard_index(list(reversed(entries)), spec)


def test_shard_index_round_trip() -> None:
    spec = ShardingSpec(0, "identity", 2, 0)
    ranges = [None, ByteRange(64, 100), None, ByteRange(100, 101)]
    raw = encode_shard_index(ranges, spec)
    assert len(raw) == 64 and decode_shard_index(raw, spec, key="k") == ranges
    assert decode_shard_index_entry(raw[16:32], spec, key="k") == ByteRange(64, 100)
    with pytest.raises(InvalidArgumentError):
        encode_shard_index(ranges[:3], spec)
    with pytest.raises(InvalidArgumentError):
        encode_shard_index([ByteRange(10, 20), None, None, None], spec)  # inside the index itself


# -- hostile shards ---------------------------------------------------------------------------

def test_hostile_indexes_raise_data_corruption() -> None:
    spec = ShardingSpec(0, "identity", 1, 0, minishard_index_encoding="raw")
    le = lambda *v: np.array(v, "<u8").tobytes()  # noqa: E731
    for entry in (le(10, 5), le(0, 2**64 - 8), b"\0" * 15):
        with pytest.raises(DataCorruptionError, match="'k'"):
            decode_shard_index_entry(entry, spec, key="k")
    with pytest.raises(DataCorruptionError):
        decode_shard_index(b"\0" * 16, spec, key="k")  # two minishards need 32 bytes
    for index in (b"\0" * 23, le(1, 0, 2**64 - 1), le(1, 2**64 - 40, 8)):
        with pytest.raises(DataCorruptionError, match="'k'"):
            decode_minishard_index(index, spec, key="k")
    gz = ShardingSpec(0, "identity", 1, 0, minishard_index_encoding="gzip")
    bomb = zlib.compress(b"\0" * (24 << 16), 9, wbits=31)
    with pytest.raises(DataCorruptionError, match="more than"):
        decode_minishard_index(bomb, gz, key="k", limit=1 << 20)
    with pytest.raises(DataCorruptionError):
        decode_minishard_index(b"not gzip", gz, key="k")
    with pytest.raises(DataCorruptionError, match="exceeds"):
        decode_minishard_index(b"\0" * 48, spec, key="k", limit=24)


def test_hostile_shards_raise_data_corruption(tmp_path: Path) -> None:
    spec = ShardingSpec(0, "identity", 1, 0, data_encoding="gzip")
    good = build_shard(spec, {0: b"a" * 100, 1: b"b" * 10, 3: b"c"})
    assert split_shard(spec, good, key="g") == {0: b"a" * 100, 1: b"b" * 10, 3: b"c"}
    with pytest.raises(DataCorruptionError, match="shorter"):
        split_shard(spec, good[:20], key="s")
    with pytest.raises(DataCorruptionError, match="past the end"):
        split_shard(spec, good[:-5], key="s")
    with pytest.raises(DataCorruptionError, match="more than"):
        split_shard(spec, good, key="s", limit=50)  # chunk 0 inflates to 100 bytes
    # a minishard listing one chunk twice
    raw = ShardingSpec(0, "identity", 0, 0)
    dup = encode_minishard_index([(5, ByteRange(16, 17)), (5, ByteRange(17, 18))], raw)
    shard = encode_shard_index([ByteRange(18, 18 + len(dup))], raw) + b"xy" + dup
    with pytest.raises(DataCorruptionError, match="more than once"):
        split_shard(raw, shard, key="s")
    # truncated reads while locating a chunk
    (tmp_path / "0.shard").write_bytes(good[:40])
    with pytest.raises(DataCorruptionError, match="'0.shard'"):
        read_chunk(spec, 1, file_reader(tmp_path))


def test_build_shard_refuses_mixed_shards_and_huge_indexes() -> None:
    spec = ShardingSpec(0, "identity", 0, 1)
    assert build_shard(spec, {}) is None
    with pytest.raises(InvalidArgumentError, match="shards"):
        build_shard(spec, {0: b"a", 1: b"b"})
    with pytest.raises(UnsupportedError, match="minishard_bits"):
        build_shard(ShardingSpec(0, "identity", 30, 0), {0: b"a"})


# -- shards as boxes of the grid ----------------------------------------------------------------

def test_morton_cell_inverts_the_compressed_morton_code() -> None:
    for grid in [(1, 1, 1), (5, 3, 9), (16, 2, 1), (7, 7, 7)]:
        for cell in itertools.product(*(range(g) for g in grid)):
            assert morton_cell(compressed_morton_code(cell, grid), grid) == cell


@pytest.mark.parametrize("grid,per_shard", [((8, 8, 8), (4, 4, 4)), ((16, 16, 2), (8, 8, 8)),
                                            ((6, 4, 5), (2, 2, 2)), ((3, 1, 1), (4, 4, 4)), ((1, 1, 1), (2, 2, 2))])
def test_sharding_for_makes_shards_that_are_boxes(grid: tuple[int, ...], per_shard: tuple[int, ...]) -> None:
    spec = sharding_for(grid, per_shard)
    box = shard_shape(spec, grid)
    assert box == tuple(min(p, 1 << max(g - 1, 0).bit_length()) for p, g in zip(per_shard, grid))
    shards: dict[int, list[tuple[int, ...]]] = {}
    for cell in itertools.product(*(range(g) for g in grid)):
        shard, _ = spec.shard_and_minishard(compressed_morton_code(cell, grid))
        shards.setdefault(shard, []).append(cell)
    for shard, members in shards.items():  # each shard: exactly the cells of one aligned box
        first = tuple(min(c[d] for c in members) for d in range(3))
        assert all(f % b == 0 for f, b in zip(first, box))
        expect = {c for c in itertools.product(*(range(f, min(f + b, g)) for f, b, g in zip(first, box, grid)))}
        assert set(members) == expect
        assert shard_cells(spec, grid, shard) == len(members)


def test_shards_that_are_not_boxes() -> None:
    grid = (6, 4, 5)
    folded = ShardingSpec(2, "identity", 2, 3)  # one id bit beyond shard_bits: boxes share files
    assert shard_shape(folded, grid) is None and shard_cells(folded, grid, 0) is None
    assert shard_shape(ShardingSpec(2, "murmurhash3_x86_128", 2, 4), grid) is None
    assert shard_shape(ShardingSpec(2, "identity", 2, 4), grid) == (4, 2, 2)
    with pytest.raises(InvalidArgumentError, match="box"):
        sharding_for((8, 8, 8), (8, 8, 1))
    with pytest.raises(InvalidArgumentError, match="powers of two"):
        sharding_for((8, 8, 8), (3, 3, 3))
