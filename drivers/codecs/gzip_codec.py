"""``gzip``: zlib's deflate in a gzip wrapper (zlib releases the GIL).

Also decodes the zarr v2 compressors ``gzip`` and ``zlib`` (the same deflate
stream, other wrappers), and is ``compression="gzip"`` (level 5).
"""

from __future__ import annotations

import zlib
from typing import Any

from tensorstore_py.core.errors import InvalidSpecError
from tensorstore_py.drivers.codecs._limits import decompress_bounded
from tensorstore_py.drivers.codecs.base import BytesBytesCodec, ChunkSpec
from tensorstore_py.drivers.codecs.registry import (
    Compression,
    V2Param,
    register_codec,
    register_compression,
    register_v2_decoder,
)
from tensorstore_py.kvstore.base import Buffer


def inflate(buf: Buffer, *, wbits: int, codec: str, key: str, size: int | None, limit: int) -> bytes:
    """Decompress one deflate stream with a hard cap on the output (bombs stop
    at ``size`` + 1 bytes, ``limit`` + 1 when the size is not known)."""
    return decompress_bounded(lambda: zlib.decompressobj(wbits), buf, codec=codec, key=key,
                              size=size, limit=limit, members=False)


@register_codec
class GzipCodec(BytesBytesCodec):
    name = "gzip"

    def __init__(self, level: int = 5) -> None:
        if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= 9:
            raise InvalidSpecError(f"gzip codec: 'level' must be an integer 0..9, got {level!r}")
        self.level = level

    @classmethod
    def from_json(cls, config: dict[str, Any], chunk: ChunkSpec) -> GzipCodec:
        unknown = set(config) - {"level"}
        if unknown:
            raise InvalidSpecError(f"gzip codec: unknown configuration fields {sorted(unknown)}")
        if "level" not in config:
            raise InvalidSpecError("gzip codec: 'level' is required")
        return cls(config["level"])

    def to_json(self) -> dict[str, Any]:
        return {"name": "gzip", "configuration": {"level": self.level}}

    def encode(self, buf: Buffer) -> Buffer:
        return zlib.compress(buf, self.level, wbits=31)

    def decode(self, buf: Buffer, *, key: str, size: int | None, limit: int,
               out: Buffer | None = None) -> Buffer:
        return inflate(buf, wbits=31, codec="gzip", key=key, size=size, limit=limit)


def _v2_gzip(codec: Any, buf: Buffer, *, key: str, size: int | None, limit: int,
             out: Buffer | None) -> Buffer:
    # wbits 47: a gzip or zlib header, as numcodecs' GZip accepts
    return inflate(buf, wbits=47, codec="gzip", key=key, size=size, limit=limit)


def _v2_zlib(codec: Any, buf: Buffer, *, key: str, size: int | None, limit: int,
             out: Buffer | None) -> Buffer:
    return inflate(buf, wbits=15, codec="zlib", key=key, size=size, limit=limit)


register_v2_decoder("gzip", _v2_gzip, params={"level": V2Param.integer(0, 9)})
register_v2_decoder("zlib", _v2_zlib, params={"level": V2Param.integer(-1, 9)})
register_compression(Compression(
    "gzip", default_level=5,
    zarr3=lambda level, dtype: {"name": "gzip", "configuration": {"level": level}},
    zarr2=lambda level, dtype: {"id": "gzip", "level": level},
))
