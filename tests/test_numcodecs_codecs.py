"""The zarr3 ``numcodecs.*`` codecs: interop with zarr-python 3 for each (both
ways, byte-identical chunks), bounded decoding of every compressor (bombs are
refused without allocating them), checksums, configuration errors."""

from __future__ import annotations

import bz2
import json
import lzma
import tracemalloc
import warnings
import zlib
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import zarr
import zarr.codecs.numcodecs as zn

import tensorstore_py as tsp
from tensorstore_py.drivers.codecs import CodecChain, numcodecs_family, registry
from tensorstore_py.drivers.codecs._limits import numcodecs_decode
from tensorstore_py.errors import DataCorruptionError, InvalidSpecError, UnsupportedError

# zarr-python warns that numcodecs.* codecs are not in the zarr3 specification
pytestmark = pytest.mark.filterwarnings("ignore:Numcodecs codecs are not in the Zarr version 3")

SHAPE, CHUNKS = (7, 9), (4, 4)


def _cases() -> list[tuple[str, str, list, list]]:
    """(id, dtype, zarr-python filters, zarr-python compressors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr-python warns as each codec is built
        return [
            ("delta", "int32", [zn.Delta(dtype="<i4")], []),
            ("delta-astype", "int32", [zn.Delta(dtype="<i4", astype="<i8")], []),
            ("fixedscaleoffset", "float64", [zn.FixedScaleOffset(offset=0.5, scale=100, dtype="<f8", astype="<i4")], []),
            ("quantize", "float32", [zn.Quantize(digits=3, dtype="<f4")], []),
            ("bitround", "float32", [zn.BitRound(keepbits=5)], []),
            ("packbits", "bool", [zn.PackBits()], []),
            ("astype", "float64", [zn.AsType(encode_dtype="<f4", decode_dtype="<f8")], []),
            ("zlib", "int16", [], [zn.Zlib(level=3)]),
            ("gzip", "int16", [], [zn.GZip(level=3)]),
            ("bz2", "int16", [], [zn.BZ2(level=3)]),
            ("lzma", "int16", [], [zn.LZMA()]),
            ("lz4", "int16", [], [zn.LZ4()]),
            ("zstd", "int16", [], [zn.Zstd(level=3)]),
            ("blosc", "int16", [], [zn.Blosc(cname="zstd", shuffle=2)]),
            ("shuffle", "int16", [], [zn.Shuffle(), zn.Zlib()]),
            ("crc32", "int16", [], [zn.CRC32()]),
            ("crc32c", "int16", [], [zn.CRC32C()]),
            ("adler32", "int16", [], [zn.Adler32()]),
            ("fletcher32", "int16", [], [zn.Fletcher32()]),
            ("jenkins_lookup3", "int16", [], [zn.JenkinsLookup3()]),
            ("delta+bz2+fletcher32", "uint16", [zn.Delta(dtype="<u2")], [zn.BZ2(level=1), zn.Fletcher32()]),
        ]


CASES = _cases()


def sample(dtype: str) -> np.ndarray:
    rng = np.random.default_rng(1)
    if dtype == "bool":
        return rng.random(SHAPE) < 0.3
    return (rng.random(SHAPE) * 1000).astype(dtype)


@pytest.mark.parametrize("name,dtype,filters,compressors", CASES, ids=[c[0] for c in CASES])
def test_interop_with_zarr_python_both_ways(tmp_path: Path, name: str, dtype: str, filters: list,
                                            compressors: list) -> None:
    v = sample(dtype)
    z = zarr.create_array(str(tmp_path / "z"), shape=SHAPE, chunks=CHUNKS, dtype=dtype, filters=filters,
                          compressors=compressors, fill_value=0)
    z[1:, :7] = v[1:, :7]  # chunk (1, 2) partly, chunk (0, 2) ... some chunks partial
    codecs = json.loads((tmp_path / "z" / "zarr.json").read_text())["codecs"]
    assert any(c["name"].startswith("numcodecs.") for c in codecs)
    a = tsp.open("file://" + str(tmp_path / "z")).result()
    assert np.array_equal(a.read().result(), z[:])  # lossy codecs: the same loss on both sides

    b = tsp.open("file://" + str(tmp_path / "t"), create=True, dtype=dtype, shape=SHAPE, chunks=CHUNKS,
                 codecs=codecs).result()
    b[1:, :7] = v[1:, :7]
    assert np.array_equal(zarr.open_array(str(tmp_path / "t"), mode="r")[:], z[:])
    for key in ("c/0/0", "c/1/1"):
        ours, theirs = (tmp_path / "t" / key).read_bytes(), (tmp_path / "z" / key).read_bytes()
        if name == "gzip":  # numcodecs stamps the gzip header's MTIME (bytes 4-7) with the clock
            ours, theirs = ours[:4] + ours[8:], theirs[:4] + theirs[8:]
        assert ours == theirs, key


def test_every_compressor_decodes_through_a_checked_decoder() -> None:
    for cid in numcodecs_family.COMPRESSORS:
        assert registry.v2_decoder(cid).decode is not numcodecs_decode, cid
    names = {n.removeprefix("numcodecs.") for n in registry.codec_names() if n.startswith("numcodecs.")}
    assert names == {*numcodecs_family.ARRAY_TO_ARRAY, *numcodecs_family.COMPRESSORS,
                     *numcodecs_family.FILTERS, *numcodecs_family.CHECKSUMS}


BOMB = 64 << 20  # decodes to 64 MiB; a chunk of 4x4 int16 may hold 32 bytes


def _zstd_frame_without_size(n: int) -> bytes:
    """A zstd frame of ``n`` zero bytes that declares no content size (as a
    streaming encoder writes it): 64 KiB window, one RLE block per 64 KiB."""
    frame = bytearray(b"\x28\xb5\x2f\xfd\x00\x30")
    blocks = n >> 16
    for i in range(blocks):
        header = (i == blocks - 1) | (1 << 1) | ((1 << 16) << 3)  # last?, RLE, size
        frame += header.to_bytes(3, "little") + b"\x00"
    return bytes(frame)


def _bomb(cid: str) -> bytes:
    zeros = bytes(BOMB)
    if cid == "zstd-streamed":
        return _zstd_frame_without_size(BOMB)
    if cid == "zlib":
        return zlib.compress(zeros, 9)
    if cid == "gzip":
        return numcodecs.GZip(9).encode(zeros)
    if cid == "bz2":
        return bz2.compress(zeros, 9)
    if cid == "lzma":
        return lzma.compress(zeros)
    return numcodecs.get_codec({"id": cid}).encode(zeros)


@pytest.mark.parametrize("fmt", ["zarr3", "zarr"])
@pytest.mark.parametrize("cid", [*numcodecs_family.COMPRESSORS, "zstd-streamed"])
def test_compression_bombs_are_refused_without_allocating_them(tmp_path: Path, cid: str, fmt: str) -> None:
    bomb = _bomb(cid)
    cid = cid.removesuffix("-streamed")
    if fmt == "zarr3":
        a = tsp.open("file://" + str(tmp_path), create=True, dtype="int16", shape=[4, 4], chunks=[4, 4],
                     codecs=[{"name": "bytes", "configuration": {"endian": "little"}},
                             {"name": "numcodecs." + cid, "configuration": {}}]).result()
        key = tmp_path / "c" / "0" / "0"
    else:
        a = tsp.open({"driver": "zarr", "kvstore": "file://" + str(tmp_path),
                      "metadata": {"zarr_format": 2, "shape": [4, 4], "chunks": [4, 4], "dtype": "<i2",
                                   "compressor": {"id": cid}, "fill_value": 0, "filters": None}},
                     create=True).result()
        key = tmp_path / "0.0"
    a[...] = 7
    assert (a.read().result() == 7).all()
    key.parent.mkdir(parents=True, exist_ok=True)
    key.write_bytes(bomb)
    tracemalloc.start()
    try:
        with pytest.raises(DataCorruptionError, match="chunk"):
            a.read().result()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # lzma's decoder holds its 8 MiB dictionary; nothing grows with the bomb
    assert peak < 16 << 20, f"{cid}: {peak} bytes allocated to refuse a {BOMB}-byte bomb"


@pytest.mark.parametrize("cid", numcodecs_family.CHECKSUMS)
def test_checksum_mismatch_is_data_corruption_naming_the_chunk(tmp_path: Path, cid: str) -> None:
    a = tsp.open("file://" + str(tmp_path), create=True, dtype="uint8", shape=[8], chunks=[8],
                 codecs=[{"name": "bytes"}, {"name": "numcodecs." + cid}]).result()
    a[...] = np.arange(8, dtype="uint8")
    chunk = tmp_path / "c" / "0"
    raw = bytearray(chunk.read_bytes())
    assert len(raw) == 12
    raw[6] ^= 1  # a data byte whichever end the checksum sits at
    chunk.write_bytes(bytes(raw))
    with pytest.raises(DataCorruptionError, match="c/0"):
        a.read().result()


@pytest.mark.parametrize("dtype,codec,match", [
    ("int32", {"name": "numcodecs.delta"}, "numcodecs.delta codec: bad configuration"),
    ("int32", {"name": "numcodecs.delta", "configuration": {"dtype": "<i2"}}, "does not fit"),
    ("int32", {"name": "numcodecs.bitround", "configuration": {"keepbits": 3}}, "float16/32/64"),
    ("float16", {"name": "numcodecs.bitround", "configuration": {"keepbits": 11}}, "mantissa"),
    ("uint8", {"name": "numcodecs.packbits"}, "bool"),
    ("int32", {"name": "numcodecs.quantize", "configuration": {"digits": 2}}, "bad configuration"),
    ("int32", {"name": "numcodecs.zlib", "configuration": {"id": "gzip"}}, "'id'"),
    ("int32", {"name": "numcodecs.zlib", "configuration": {"level": 3, "frobnicate": 1}}, "bad configuration"),
])
def test_bad_configurations_are_invalid_specs(dtype: str, codec: dict, match: str) -> None:
    codecs = [codec, {"name": "bytes", "configuration": {"endian": "little"}}]
    if codec["name"] == "numcodecs.zlib":
        codecs = codecs[::-1]
    with pytest.raises(InvalidSpecError, match=match):
        CodecChain.from_json(codecs, (4,), np.dtype(dtype), 0)


@pytest.mark.parametrize("name", ["numcodecs.pcodec", "numcodecs.zfpy", "numcodecs.nonesuch"])
def test_unsupported_codecs_name_themselves_and_the_supported_ones(name: str) -> None:
    with pytest.raises(UnsupportedError, match=f"'{name}'; supported: .*numcodecs.delta.*vlen-utf8"):
        CodecChain.from_json([{"name": name}], (4,), np.dtype("float32"), 0)


def test_defaults_are_filled_from_the_array_as_zarr_python_fills_them(tmp_path: Path) -> None:
    """A codec entry without shuffle's elementsize or fixedscaleoffset's dtype
    means the array's, on both sides."""
    codecs: list[dict[str, Any]] = [
        {"name": "numcodecs.fixedscaleoffset", "configuration": {"offset": 0, "scale": 10}},
        {"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "numcodecs.shuffle"}, {"name": "numcodecs.zlib"}]
    a = tsp.open("file://" + str(tmp_path), create=True, dtype="float64", shape=[10], chunks=[5],
                 codecs=codecs).result()
    a[...] = np.linspace(0, 1, 10)
    z = zarr.open_array(str(tmp_path), mode="r")
    assert np.array_equal(z[:], a.read().result())
    assert np.allclose(z[:], np.linspace(0, 1, 10), atol=0.05)
    chain = a.base._driver._codec  # the resolved chain shows the filled-in values
    assert chain.aa[0].to_json()["configuration"]["dtype"] == "<f8"
    assert chain.bb[0].to_json()["configuration"] == {"elementsize": 8}
