"""The codec registry: the built-in codecs, the compression= aliases with their
exact defaults (stored bytes depend on them), and a codec added by registering it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_driver_helpers import open_sync, read, write

from tensorstore_py.drivers.codecs import CodecChain, registry
from tensorstore_py.drivers.codecs.base import BytesBytesCodec, ChunkSpec
from tensorstore_py.drivers.open import build_metadata
from tensorstore_py.errors import InvalidArgumentError, UnsupportedError

NUMCODECS = ["adler32", "astype", "bitround", "blosc", "bz2", "crc32", "crc32c", "delta",
             "fixedscaleoffset", "fletcher32", "gzip", "jenkins_lookup3", "lz4", "lzma", "packbits",
             "quantize", "shuffle", "zlib", "zstd"]
BUILTIN = ["blosc", "bytes", "crc32c", "gzip", *(f"numcodecs.{n}" for n in NUMCODECS),
           "sharding_indexed", "transpose", "vlen-bytes", "vlen-utf8", "zstd"]


def test_every_builtin_codec_is_registered() -> None:
    assert registry.codec_names() == BUILTIN
    with pytest.raises(UnsupportedError, match="'lzma'; supported: " + ", ".join(BUILTIN)):
        CodecChain.from_json([{"name": "bytes", "configuration": {"endian": "little"}},
                              {"name": "lzma"}], (4,), np.dtype("int16"), 0)


@pytest.mark.parametrize("compression,dtype,v3,v2", [
    ("zstd", "int16", {"name": "zstd", "configuration": {"level": 1, "checksum": False}},
     {"id": "zstd", "level": 1}),
    (("zstd", 7), "int16", {"name": "zstd", "configuration": {"level": 7, "checksum": False}},
     {"id": "zstd", "level": 7}),
    ("gzip", "float32", {"name": "gzip", "configuration": {"level": 5}}, {"id": "gzip", "level": 5}),
    (["gzip", 2], "float32", {"name": "gzip", "configuration": {"level": 2}}, {"id": "gzip", "level": 2}),
    ("blosc", "float32", {"name": "blosc", "configuration": {
        "cname": "lz4", "clevel": 5, "shuffle": "shuffle", "typesize": 4, "blocksize": 0}},
     {"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1, "blocksize": 0}),
    (("blosc", 9), "uint8", {"name": "blosc", "configuration": {
        "cname": "lz4", "clevel": 9, "shuffle": "noshuffle", "typesize": 1, "blocksize": 0}},
     {"id": "blosc", "cname": "lz4", "clevel": 9, "shuffle": 1, "blocksize": 0}),
])
def test_compression_aliases_keep_their_defaults(compression: Any, dtype: str, v3: dict, v2: dict) -> None:
    m3 = build_metadata("zarr3", shape=[8], dtype=dtype, chunks=[4], compression=compression)
    assert m3["codecs"][1:] == [v3]
    m2 = build_metadata("zarr", shape=[8], dtype=dtype, chunks=[4], compression=compression)
    assert m2["compressor"] == v2
    assert build_metadata("zarr", shape=[8], dtype=dtype, chunks=[4])["compressor"] is None


@pytest.mark.parametrize("bad", ["lzma", ("lzma", 1), 3, ("zstd",)])
@pytest.mark.parametrize("driver", ["zarr3", "zarr"])
def test_unknown_compression_is_refused(driver: str, bad: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="'blosc', 'gzip', 'zstd'"):
        build_metadata(driver, shape=[8], dtype="uint8", compression=bad)


class InvertCodec(BytesBytesCodec):
    """A toy codec: every byte inverted."""

    name = "test.invert"

    @classmethod
    def from_json(cls, config: dict[str, Any], chunk: ChunkSpec) -> InvertCodec:
        return cls()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name}

    def encode(self, buf: Any) -> Any:
        return (np.frombuffer(buf, np.uint8) ^ 0xFF).tobytes()

    def decode(self, buf: Any, *, key: str, size: int | None, limit: int, out: Any = None) -> Any:
        return (np.frombuffer(buf, np.uint8) ^ 0xFF).tobytes()


def test_a_registered_codec_is_usable_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_CODECS", dict(registry._CODECS))  # undone after the test
    registry.register_codec(InvertCodec)
    assert "test.invert" in registry.codec_names()
    with pytest.raises(InvalidArgumentError, match="test.invert"):
        registry.register_codec(type("Other", (InvertCodec,), {}))
    codecs = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "test.invert"}]
    a = open_sync({"driver": "zarr3", "kvstore": "memory://registry/",
                   "metadata": {"shape": [4], "data_type": "uint16", "codecs": codecs,
                                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4]}}}},
                  create=True)
    x = np.array([1, 2, 3, 0xABCD], np.uint16)
    write(a, x)
    np.testing.assert_array_equal(read(a), x)
    stored = a.kvstore.read("c/0").result().value
    assert bytes(stored) == bytes(~x.astype("<u2").view(np.uint8))
