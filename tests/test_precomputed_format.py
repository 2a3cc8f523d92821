"""Neuroglancer precomputed, the format layer: the ``info`` document, the spec
members, chunk keys and chunk encodings, against TensorStore as the oracle.

TensorStore writes volumes and our functions decode the very same arrays from
its files; our encoders write volumes (info + chunk files) that TensorStore
reads back exactly. Volumes are small (edge chunks and a voxel offset
included) so this stays fast.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _precomputed import label_volume, read_info, read_volume, ts_create, ts_open, write_volume

from tensorstore_py.core import errors
from tensorstore_py.drivers.precomputed import ChunkCodec, MultiscaleMetadata
from tensorstore_py.drivers.precomputed.metadata import join_key
from tensorstore_py.drivers.precomputed.spec import create_scale, open_scale, resolve_scale, scale_spec

SIZE = (10, 7, 5)
CHUNK = (4, 4, 2)
OFFSET = (1, -2, 3)


def sample(dtype: str, channels: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (*SIZE, channels)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


# -- the info document ----------------------------------------------------------------------

INFO = {
    "@type": "neuroglancer_multiscale_volume", "type": "segmentation", "data_type": "uint64", "num_channels": 1,
    "mesh": "mesh", "segment_properties": "props",
    "scales": [
        {"key": "8_8_8", "size": [100, 80, 60], "voxel_offset": [5, 6, 7], "resolution": [8, 8, 8],
         "chunk_sizes": [[64, 64, 64], [32, 32, 32]], "encoding": "compressed_segmentation",
         "compressed_segmentation_block_size": [8, 8, 8], "hidden": True},
        {"key": "16_16_16", "size": [50, 40, 30], "resolution": [16, 16, 16], "chunk_sizes": [[32, 32, 32]],
         "encoding": "raw", "sharding": {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 3,
                                         "hash": "murmurhash3_x86_128", "minishard_bits": 2, "shard_bits": 1,
                                         "minishard_index_encoding": "gzip", "data_encoding": "gzip"}},
    ],
}


def test_info_parses_and_keeps_unknown_members() -> None:
    info = MultiscaleMetadata.from_json(INFO)
    assert (info.type, info.data_type, info.num_channels, info.dtype) == ("segmentation", "uint64", 1,
                                                                          np.dtype("<u8"))
    s0, s1 = info.scales
    assert s0.chunk_sizes == ((64, 64, 64), (32, 32, 32)) and s0.chunk_size == (64, 64, 64)
    assert s0.compressed_segmentation_block_size == (8, 8, 8) and s0.extra == {"hidden": True}
    assert s1.voxel_offset == (0, 0, 0) and s1.sharding is not None and s1.sharding.preshift_bits == 3
    again = json.loads(info.encode())
    assert again["mesh"] == "mesh" and again["segment_properties"] == "props"
    assert again["scales"][0]["hidden"] is True
    assert MultiscaleMetadata.decode(info.encode()) == info


@pytest.mark.parametrize("scale", [
    {"encoding": "raw"},
    {"encoding": "jpeg", "jpeg_quality": 40},
    {"encoding": "jpeg"},
    {"encoding": "png", "png_level": 3},
    {"encoding": "compressed_segmentation", "compressed_segmentation_block_size": [2, 3, 1]},
    {"encoding": "raw", "sharding": {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 1,
                                     "hash": "identity", "minishard_bits": 2, "shard_bits": 3,
                                     "minishard_index_encoding": "gzip", "data_encoding": "raw"}},
    {"encoding": "raw", "resolution": [4.5, 3, 40], "voxel_offset": [-3, 0, 9]},
], ids=lambda s: "-".join(f"{k}" for k in s))
def test_info_round_trips_tensorstore_bytes(tmp_path: Path, scale: dict[str, Any]) -> None:
    """What TensorStore writes, we parse and encode back to the same bytes."""
    dtype = "uint32" if scale["encoding"] == "compressed_segmentation" else "uint8"
    ts_create(tmp_path, data_type=dtype, size=SIZE, chunk_size=CHUNK, **scale)
    raw = (tmp_path / "info").read_bytes()
    assert MultiscaleMetadata.decode(raw).encode() == raw


def _mutate(path: str, value: Any) -> dict[str, Any]:
    info = copy.deepcopy(INFO)
    *parents, last = path.split(".")
    node: Any = info
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    if value is _DELETE:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return info


_DELETE = object()
_SHARD = "scales.1.sharding"


@pytest.mark.parametrize("path,value,error,names", [
    ("@type", "something", errors.InvalidSpecError, "@type"),
    ("type", "mesh", errors.InvalidSpecError, "type"),
    ("type", _DELETE, errors.InvalidSpecError, "type"),
    ("data_type", "float64", errors.UnsupportedError, "float64"),
    ("data_type", 8, errors.InvalidSpecError, "data_type"),
    ("num_channels", 0, errors.InvalidSpecError, "num_channels"),
    ("num_channels", "1", errors.InvalidSpecError, "num_channels"),
    ("scales", {}, errors.InvalidSpecError, "scales"),
    ("scales.0.key", 5, errors.InvalidSpecError, "scales[0].key"),
    ("scales.0.key", _DELETE, errors.InvalidSpecError, "scales[0].key"),
    ("scales.0.size", [1, 2], errors.InvalidSpecError, "scales[0].size"),
    ("scales.0.size", [-1, 2, 3], errors.InvalidSpecError, "scales[0].size[0]"),
    ("scales.0.size", [2**62, 1, 1], errors.InvalidSpecError, "scales[0].size"),
    ("scales.0.voxel_offset", [0, 1.5, 0], errors.InvalidSpecError, "scales[0].voxel_offset[1]"),
    ("scales.0.resolution", [1, "a", 1], errors.InvalidSpecError, "scales[0].resolution"),
    ("scales.0.chunk_sizes", [], errors.InvalidSpecError, "scales[0].chunk_sizes"),
    ("scales.0.chunk_sizes", [[0, 1, 1]], errors.InvalidSpecError, "scales[0].chunk_sizes[0][0]"),
    ("scales.0.chunk_sizes", [[2**11, 2**11, 2**11]], errors.InvalidSpecError, "scales[0].chunk_sizes[0]"),
    ("scales.0.encoding", "zfp", errors.UnsupportedError, "zfp"),
    ("scales.0.compressed_segmentation_block_size", _DELETE, errors.InvalidSpecError,
     "compressed_segmentation_block_size"),
    ("scales.0.compressed_segmentation_block_size", [8, 0, 8], errors.InvalidSpecError,
     "compressed_segmentation_block_size[1]"),
    ("scales.0.jpeg_quality", 50, errors.InvalidSpecError, "scales[0].jpeg_quality"),
    ("scales.1.png_level", 3, errors.InvalidSpecError, "scales[1].png_level"),
    ("scales.1.encoding", "jpeg", errors.InvalidSpecError, "scales[1].encoding"),
    ("scales.1.chunk_sizes", [[32, 32, 32], [16, 16, 16]], errors.InvalidSpecError, "scales[1].chunk_sizes"),
    (f"{_SHARD}.hash", "md5", errors.InvalidSpecError, "scales[1].sharding"),
    (f"{_SHARD}.@type", "v2", errors.InvalidSpecError, "scales[1].sharding"),
    (f"{_SHARD}.minishard_bits", 33, errors.InvalidSpecError, "minishard_bits"),
    (f"{_SHARD}.shard_bits", 63, errors.InvalidSpecError, "shard_bits"),
    (f"{_SHARD}.preshift_bits", -1, errors.InvalidSpecError, "preshift_bits"),
    (f"{_SHARD}.data_encoding", "zstd", errors.InvalidSpecError, "data_encoding"),
    (f"{_SHARD}.extra", 1, errors.InvalidSpecError, "extra"),
    ("scales.1.size", [2**40, 2**40, 1], errors.InvalidSpecError, "scales[1].sharding"),
])
def test_info_validation_names_the_field(path: str, value: Any, error: type, names: str) -> None:
    with pytest.raises(error) as e:
        MultiscaleMetadata.from_json(_mutate(path, value))
    assert names in str(e.value)


@pytest.mark.parametrize("encoding,data_type,channels", [
    ("jpeg", "uint16", 1), ("jpeg", "uint8", 2), ("png", "uint32", 1), ("png", "uint8", 5),
    ("compressed_segmentation", "uint16", 1), ("compresso", "int32", 1), ("compresso", "uint32", 2),
])
def test_encodings_refuse_data_they_cannot_hold(encoding: str, data_type: str, channels: int) -> None:
    info = {"type": "image", "data_type": data_type, "num_channels": channels, "scales": [
        {"key": "s", "size": [4, 4, 4], "resolution": [1, 1, 1], "chunk_sizes": [[4, 4, 4]],
         "encoding": encoding, **({"compressed_segmentation_block_size": [2, 2, 2]}
                                  if encoding == "compressed_segmentation" else {})}]}
    with pytest.raises(errors.InvalidSpecError, match="scales\\[0\\].encoding"):
        MultiscaleMetadata.from_json(info)


def test_lenient_where_tensorstore_is() -> None:
    """Case-insensitive names (as the neuroglancer spec says), integral floats, extra members."""
    info = _mutate("data_type", "UINT64")
    info["scales"][0]["encoding"] = "Compressed_Segmentation"
    info["scales"][0]["size"] = [100.0, 80, 60]
    info["num_channels"] = 1.0
    del info["@type"]
    m = MultiscaleMetadata.from_json(info)
    assert m.data_type == "uint64" and m.scales[0].encoding == "compressed_segmentation"
    assert m.scales[0].size == (100, 80, 60) and m.num_channels == 1
    with pytest.raises(errors.InvalidSpecError, match="not valid JSON"):
        MultiscaleMetadata.decode(b"{not json")


# -- domain, grid and chunk keys ------------------------------------------------------------

def test_domain_grid_and_chunk_keys_match_tensorstore(tmp_path: Path) -> None:
    store = ts_create(tmp_path, data_type="uint8", size=SIZE, chunk_size=CHUNK, voxel_offset=list(OFFSET))
    store.write(np.ones(store.shape, np.uint8)).result()
    info = read_info(tmp_path)
    scale = info.scales[0]
    dom = info.domain(0)
    assert dom.inclusive_min == tuple(store.domain.inclusive_min)
    assert dom.exclusive_max == tuple(store.domain.exclusive_max)
    assert dom.labels == tuple(store.domain.labels) == ("x", "y", "z", "channel")
    assert scale.grid_shape() == (3, 2, 3)
    keys = {scale.chunk_key(c) for c in np.ndindex(*scale.grid_shape())}
    on_disk = {f"1_1_1/{p.name}" for p in (tmp_path / "1_1_1").iterdir()}
    assert keys == on_disk
    assert scale.chunk_box((2, 1, 2)) == ((9, 2, 7), (11, 5, 8))  # clipped at the upper edges
    assert scale.chunk_shape((2, 1, 2)) == (2, 3, 1)
    assert scale.chunk_key((0, 0, 0), path="vol") == "vol/1_1_1/1-5_-2-2_3-5"
    with pytest.raises(errors.InvalidArgumentError):
        scale.chunk_box((3, 0, 0))
    with pytest.raises(errors.InvalidArgumentError):
        scale.grid_shape((1, 1, 1))  # not one of the scale's chunk sizes
    with pytest.raises(errors.InvalidArgumentError):
        scale.shard_key((0, 0, 0))


def test_scale_keys_are_relative_to_the_volume() -> None:
    assert join_key("data/vol", "../other/8_8_8", "0-1_0-1_0-1") == "data/other/8_8_8/0-1_0-1_0-1"
    assert join_key("", "./s", "c") == "s/c"
    with pytest.raises(errors.InvalidSpecError, match="escapes"):
        join_key("vol", "../../s")


# -- spec members: open and create ----------------------------------------------------------

def test_open_scale_selects_and_checks() -> None:
    info = MultiscaleMetadata.from_json(INFO)
    assert open_scale(info).index == 0
    assert open_scale(info, scale_index=1).scale.key == "16_16_16"
    assert open_scale(info, scale_metadata={"resolution": [16, 16, 16]}).index == 1
    assert open_scale(info, scale_metadata={"key": "16_16_16", "sharding": INFO["scales"][1]["sharding"]}).index == 1
    opened = open_scale(info, scale_metadata={"key": "8_8_8", "chunk_size": [32, 32, 32]},
                        multiscale_metadata={"data_type": "uint64", "num_channels": 1})
    assert opened.chunk_size == (32, 32, 32)
    with pytest.raises(errors.NotFoundError):
        open_scale(info, scale_metadata={"resolution": [9, 9, 9]})
    with pytest.raises(errors.NotFoundError):
        open_scale(info, scale_index=2)
    for sm, mm, field in [
        ({"key": "8_8_8", "size": [1, 2, 3]}, None, "size"),
        ({"key": "8_8_8", "encoding": "raw"}, None, "encoding"),
        ({"key": "8_8_8", "chunk_size": [1, 2, 3]}, None, "chunk_size"),
        ({"key": "8_8_8", "sharding": None}, None, None),
        ({"key": "16_16_16", "sharding": None}, None, "sharding"),
        ({"key": "8_8_8", "compressed_segmentation_block_size": [4, 4, 4]}, None, "block_size"),
        (None, {"data_type": "uint32"}, "data_type"),
        (None, {"type": "image"}, "type"),
        (None, {"num_channels": 2}, "num_channels"),
    ]:
        if field is None:
            open_scale(info, scale_metadata=sm, multiscale_metadata=mm)
            continue
        with pytest.raises(errors.InvalidSpecError, match=field):
            open_scale(info, scale_metadata=sm, multiscale_metadata=mm)
    with pytest.raises(errors.InvalidSpecError, match="key"):  # scale_index and key disagree
        open_scale(info, scale_index=0, scale_metadata={"key": "16_16_16"})
    with pytest.raises(errors.InvalidSpecError, match="unknown members"):
        open_scale(info, scale_metadata={"chunk_sizes": [[1, 1, 1]]})


@pytest.mark.parametrize("scale_metadata,multiscale", [
    ({"size": [10, 7, 5], "resolution": [4.5, 4, 40], "chunk_size": [4, 4, 2], "encoding": "raw"},
     {"type": "segmentation", "data_type": "uint32", "num_channels": 1}),
    ({"size": [10, 7, 5], "voxel_offset": [1, 2, 3], "resolution": [1234567, 0.1, 3.333333333],
      "chunk_size": [4, 4, 2], "encoding": "jpeg"}, {"type": "image", "data_type": "uint8", "num_channels": 3}),
    ({"size": [10, 7, 5], "resolution": [8, 8, 8], "chunk_size": [4, 4, 2], "encoding": "png", "png_level": 2,
      "key": "custom/key"}, {"type": "image", "data_type": "uint16", "num_channels": 2}),
    ({"size": [10, 7, 5], "resolution": [8, 8, 8], "chunk_size": [4, 4, 2], "encoding": "compressed_segmentation",
      "compressed_segmentation_block_size": [2, 2, 2],
      "sharding": {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "murmurhash3_x86_128",
                   "minishard_bits": 1, "shard_bits": 1}},
     {"type": "segmentation", "data_type": "uint64", "num_channels": 1}),
])
def test_create_scale_writes_what_tensorstore_writes(tmp_path: Path, scale_metadata: dict[str, Any],
                                                     multiscale: dict[str, Any]) -> None:
    import tensorstore as ts

    spec = {"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(tmp_path)},
            "scale_metadata": scale_metadata, "multiscale_metadata": multiscale}
    store = ts.open(spec, create=True).result()
    opened = create_scale(None, scale_metadata=scale_metadata, multiscale_metadata=multiscale)
    assert opened.info.encode() == (tmp_path / "info").read_bytes()
    theirs = store.spec().to_json()
    ours = scale_spec(opened)
    assert ours["scale_index"] == theirs["scale_index"] == 0
    assert ours["scale_metadata"] == theirs["scale_metadata"]
    assert ours["multiscale_metadata"] == {**theirs["multiscale_metadata"], "data_type": str(store.dtype.name)}


def test_create_scale_adds_to_a_volume_and_refuses_bad_specs() -> None:
    mm = {"type": "image", "data_type": "uint8", "num_channels": 1}
    sm = {"size": [8, 8, 8], "resolution": [1, 1, 1], "chunk_size": [4, 4, 4]}
    first = create_scale(None, scale_metadata=sm, multiscale_metadata=mm)
    assert first.scale.key == "1_1_1" and first.scale.encoding == "raw" and first.index == 0
    second = create_scale(first.info, scale_index=1, scale_metadata={**sm, "resolution": [2, 2, 2]},
                          multiscale_metadata={"data_type": "uint8"})
    assert [s.key for s in second.info.scales] == ["1_1_1", "2_2_2"] and second.index == 1
    bad = [
        (None, sm, {"type": "image", "data_type": "uint8"}, "num_channels"),
        (None, {"resolution": [1, 1, 1], "chunk_size": [4, 4, 4]}, mm, "size"),
        (None, {"size": [8, 8, 8], "resolution": [1, 1, 1]}, mm, "chunk_size"),
        (None, {**sm, "encoding": "compressed_segmentation"}, {**mm, "data_type": "uint32"},
         "compressed_segmentation_block_size"),
        (None, {**sm, "encoding": "jpeg"}, {**mm, "num_channels": 2}, "encoding"),
        (None, {**sm, "jpeg_quality": 50}, mm, "jpeg_quality"),
        (None, {"voxel_offset": [1, 1, 1], "resolution": [1, 1, 1], "chunk_size": [4, 4, 4]}, mm, "voxel_offset"),
        (first.info, sm, None, "already exists"),
        (first.info, {**sm, "key": "other"}, {"data_type": "uint16"}, "data_type"),
    ]
    for info, s, m, match in bad:
        with pytest.raises(errors.InvalidSpecError, match=match):
            create_scale(info, scale_metadata=s, multiscale_metadata=m)
    with pytest.raises(errors.InvalidSpecError, match="scale_index"):
        create_scale(first.info, scale_index=0, scale_metadata={**sm, "key": "x"})
    # open if it exists, create if asked to
    opened, changed = resolve_scale(first.info, create=True, scale_metadata={"key": "1_1_1"})
    assert not changed and opened.index == 0
    made, changed = resolve_scale(first.info, create=True, scale_metadata={**sm, "resolution": [4, 4, 4]})
    assert changed and made.index == 1
    with pytest.raises(errors.NotFoundError):
        resolve_scale(None, scale_metadata=sm, multiscale_metadata=mm)


# -- chunk encodings, both ways ---------------------------------------------------------------

CASES = [
    ("raw", "uint8", 1), ("raw", "uint16", 2), ("raw", "int16", 1), ("raw", "int32", 3), ("raw", "uint64", 1),
    ("raw", "float32", 2), ("png", "uint8", 1), ("png", "uint8", 3), ("png", "uint8", 4), ("png", "uint16", 2),
    ("jpeg", "uint8", 1), ("jpeg", "uint8", 3),
    ("compressed_segmentation", "uint32", 1), ("compressed_segmentation", "uint64", 2),
]


def _scale_extra(encoding: str) -> dict[str, Any]:
    return {"compressed_segmentation_block_size": [2, 3, 1]} if encoding == "compressed_segmentation" else {}


def _data(encoding: str, dtype: str, channels: int) -> np.ndarray:
    if encoding == "jpeg":  # smooth content, like images
        x, y, z = np.meshgrid(*(np.arange(s) for s in SIZE), indexing="ij")
        base = x * 10 + y * 5 + z * 20  # at most 200: no wrap-around edges
        return np.stack([base + 15 * c for c in range(channels)], -1).astype(dtype)
    if encoding == "compressed_segmentation":
        return label_volume((*SIZE, channels), dtype, np.random.default_rng(3))
    return sample(dtype, channels)


@pytest.mark.parametrize("encoding,dtype,channels", CASES, ids=lambda v: str(v))
def test_we_decode_what_tensorstore_writes(tmp_path: Path, encoding: str, dtype: str, channels: int) -> None:
    store = ts_create(tmp_path, data_type=dtype, size=SIZE, chunk_size=CHUNK, num_channels=channels,
                      encoding=encoding, voxel_offset=list(OFFSET), **_scale_extra(encoding))
    store.write(_data(encoding, dtype, channels)).result()
    expected = store.read().result()  # for jpeg: what TensorStore itself decodes
    np.testing.assert_array_equal(read_volume(tmp_path), expected)


@pytest.mark.parametrize("encoding,dtype,channels", CASES, ids=lambda v: str(v))
def test_tensorstore_reads_what_we_write(tmp_path: Path, encoding: str, dtype: str, channels: int) -> None:
    opened = create_scale(None, scale_metadata={
        "size": list(SIZE), "voxel_offset": list(OFFSET), "resolution": [1, 1, 1], "chunk_size": list(CHUNK),
        "encoding": encoding, **_scale_extra(encoding)},
        multiscale_metadata={"type": "image", "data_type": dtype, "num_channels": channels})
    data = _data(encoding, dtype, channels)
    ours = write_volume(tmp_path, opened.info, data)
    got = ts_open(tmp_path).read().result()
    if encoding == "jpeg":
        np.testing.assert_array_equal(got, read_volume(tmp_path))  # lossy: same pixels as our decoder
        assert np.abs(got.astype(int) - data).max() < 40
    else:
        np.testing.assert_array_equal(got, data)
    if encoding in ("raw", "compressed_segmentation"):
        # fixed by the format: TensorStore's chunk files are the same bytes (jpeg and png are too
        # with today's libjpeg-turbo and libpng builds, but that is up to the libraries)
        theirs_dir = tmp_path / "ts"
        ts_create(theirs_dir, data_type=dtype, size=SIZE, chunk_size=CHUNK, num_channels=channels,
                  encoding=encoding, voxel_offset=list(OFFSET), **_scale_extra(encoding)).write(data).result()
        for key, blob in ours.items():
            if key != "info":
                assert (theirs_dir / key).read_bytes() == blob, key


def test_decoded_chunks_are_views_in_domain_order() -> None:
    codec = ChunkCodec("raw", "uint16", 2)
    arr = np.arange(4 * 3 * 2 * 2, dtype=np.uint16).reshape(4, 3, 2, 2)
    data = codec.encode(arr)
    # on disk: [channel][z][y][x], x fastest
    assert np.frombuffer(data, "<u2")[:4].tolist() == arr[:, 0, 0, 0].tolist()
    out = codec.decode(data, (4, 3, 2))
    np.testing.assert_array_equal(out, arr)
    assert out.base is not None and out.shape == (4, 3, 2, 2)
    assert codec.max_encoded_size((4, 3, 2)) == len(data)


def test_compresso_round_trips_and_matches_the_compresso_package() -> None:
    compresso = pytest.importorskip("compresso")
    info = MultiscaleMetadata.from_json({"type": "segmentation", "data_type": "uint64", "num_channels": 1,
                                         "scales": [{"key": "s", "size": [9, 8, 7], "resolution": [1, 1, 1],
                                                     "chunk_sizes": [[9, 8, 7]], "encoding": "compresso"}]})
    codec = ChunkCodec.for_scale(info, 0)
    labels = label_volume((9, 8, 7, 1), "uint64", np.random.default_rng(5))
    data = codec.encode(labels)
    np.testing.assert_array_equal(codec.decode(data, (9, 8, 7)), labels)
    # a stream the compresso package wrote (x fastest) decodes to the same voxels
    theirs = compresso.compress(np.asfortranarray(labels[..., 0]))
    np.testing.assert_array_equal(codec.decode(theirs, (9, 8, 7)), labels)
    for uint in ("uint8", "uint16", "uint32"):
        c = ChunkCodec("compresso", uint, 1)
        small = (labels % 200).astype(uint)
        np.testing.assert_array_equal(c.decode(c.encode(small), (9, 8, 7)), small)


# -- hostile and wrong input ----------------------------------------------------------------

def test_corrupt_chunks_raise_data_corruption_naming_the_key() -> None:
    raw = ChunkCodec("raw", "uint16", 1)
    with pytest.raises(errors.DataCorruptionError, match="'k1'"):
        raw.decode(b"\0" * 7, (2, 2, 2), key="k1")
    png = ChunkCodec("png", "uint8", 1)
    good_png = png.encode(np.zeros((4, 4, 2, 1), np.uint8))
    huge = bytearray(good_png)
    huge[16:24] = (1 << 30).to_bytes(4, "big") * 2  # a header declaring a 2**60-pixel image
    for bad in (b"", b"not an image", bytes(huge), good_png[:40]):
        with pytest.raises(errors.DataCorruptionError, match="'p'"):
            png.decode(bad, (4, 4, 2), key="p")
    with pytest.raises(errors.DataCorruptionError, match="does not hold"):
        png.decode(good_png, (4, 4, 3), key="p")
    jpeg = ChunkCodec("jpeg", "uint8", 3)
    good_jpeg = jpeg.encode(np.zeros((4, 4, 2, 3), np.uint8))
    sof = good_jpeg.index(b"\xff\xc0")
    huge = bytearray(good_jpeg)
    huge[sof + 5:sof + 9] = b"\xff\xff\xff\xff"
    for bad in (b"\xff\xd8", b"\xff\xd8\xff\xda\x00\x02", bytes(huge), good_jpeg[: len(good_jpeg) // 2],
                b"garbage"):
        with pytest.raises(errors.DataCorruptionError, match="'j'"):
            jpeg.decode(bad, (4, 4, 2), key="j")
    with pytest.raises(errors.DataCorruptionError, match="3 channels"):
        ChunkCodec("jpeg", "uint8", 1).decode(good_jpeg, (4, 4, 2), key="j")


def test_corrupt_compresso_streams_are_refused_before_decoding() -> None:
    pytest.importorskip("compresso")
    codec = ChunkCodec("compresso", "uint32", 1)
    good = codec.encode(label_volume((6, 5, 4, 1), "uint32", np.random.default_rng(2)))
    inflated = bytearray(good)
    inflated[15:23] = (2**40).to_bytes(8, "little")  # id_size (u64 at byte 15): a 4 TiB id table
    for bad, match in [(b"", "not a compresso"), (b"cpso" + b"\0" * 10, "not a compresso"),
                       (good, "does not hold"), (bytes(inflated), "sections")]:
        shape = (6, 5, 4) if bad is not good else (6, 5, 5)
        with pytest.raises(errors.DataCorruptionError, match=match):
            codec.decode(bad, shape, key="c")
    with pytest.raises(errors.DataCorruptionError, match="data_width|does not hold"):
        ChunkCodec("compresso", "uint64", 1).decode(good, (6, 5, 4))


def test_encode_checks_shape_and_dtype() -> None:
    codec = ChunkCodec("raw", "uint16", 2)
    for bad in (np.zeros((2, 2, 2, 1), np.uint16), np.zeros((2, 2, 2, 2), np.int16), np.zeros((2, 2, 2), np.uint16)):
        with pytest.raises(errors.InvalidArgumentError):
            codec.encode(bad)
    with pytest.raises(errors.InvalidSpecError):
        ChunkCodec("jpeg", "uint16", 1)
    with pytest.raises(errors.InvalidArgumentError):
        ChunkCodec("zfp", "uint8", 1)
    big_endian = np.zeros((2, 2, 2, 2), ">u2") + 258
    assert codec.encode(big_endian) == codec.encode(big_endian.astype("<u2"))


def test_missing_optional_packages_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorstore_py.drivers.precomputed import sharding

    monkeypatch.setitem(sys.modules, "imagecodecs", None)
    monkeypatch.setitem(sys.modules, "compresso", None)
    monkeypatch.setattr(sharding, "mmh3", None)
    for codec in (ChunkCodec("png", "uint8", 1), ChunkCodec("compresso", "uint8", 1)):
        with pytest.raises(ImportError, match=r"tensorstore_py\[precomputed\]"):
            codec.encode(np.zeros((2, 2, 2, 1), np.uint8))
    spec = sharding.ShardingSpec(preshift_bits=0, hash="murmurhash3_x86_128", minishard_bits=0, shard_bits=0)
    with pytest.raises(ImportError, match=r"tensorstore_py\[precomputed\]"):
        spec.shard_and_minishard(1)
    # identity hashing and raw chunks need none of them
    assert sharding.ShardingSpec(0, "identity", 1, 1).shard_and_minishard(3) == (1, 1)
    assert ChunkCodec("raw", "uint8", 1).encode(np.zeros((1, 1, 1, 1), np.uint8)) == b"\0"
