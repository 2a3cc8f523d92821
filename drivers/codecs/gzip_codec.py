"""``gzip``: zlib's deflate in a gzip wrapper (zlib releases the GIL)."""

from __future__ import annotations

import zlib
from typing import Any

from tensorstore_py.core.errors import DataCorruptionError, InvalidSpecError
from tensorstore_py.drivers.codecs._limits import check_size
from tensorstore_py.drivers.codecs.base import BytesBytesCodec
from tensorstore_py.kvstore.base import Buffer


def inflate(buf: Buffer, *, wbits: int, codec: str, key: str, size: int | None, limit: int) -> bytes:
    """Decompress with a hard cap on the output (bombs stop at ``limit`` + 1 bytes)."""
    d = zlib.decompressobj(wbits)
    cap = (size if size is not None else limit) + 1
    try:
        out = d.decompress(buf, cap)
    except zlib.error as e:
        raise DataCorruptionError(f"chunk {key!r}: invalid {codec} data: {e}") from None
    if not d.eof and len(out) < cap:
        raise DataCorruptionError(f"chunk {key!r}: {codec} data is truncated")
    check_size(codec, key, len(out), size, limit)
    return out


class GzipCodec(BytesBytesCodec):
    name = "gzip"

    def __init__(self, level: int = 5) -> None:
        if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= 9:
            raise InvalidSpecError(f"gzip codec: 'level' must be an integer 0..9, got {level!r}")
        self.level = level

    @classmethod
    def from_json(cls, config: dict[str, Any]) -> GzipCodec:
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
