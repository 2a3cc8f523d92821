"""``crc32c``: append the CRC-32C of the bytes (4 bytes, little-endian)."""

from __future__ import annotations

from typing import Any

import crc32c as _crc

from tensorstore_py.core.errors import ChecksumError, DataCorruptionError, InvalidSpecError
from tensorstore_py.drivers.codecs.base import BytesBytesCodec, ChunkSpec
from tensorstore_py.drivers.codecs.registry import register_codec
from tensorstore_py.kvstore.base import Buffer


@register_codec
class Crc32cCodec(BytesBytesCodec):
    name = "crc32c"

    @classmethod
    def from_json(cls, config: dict[str, Any], chunk: ChunkSpec) -> Crc32cCodec:
        if config:
            raise InvalidSpecError(f"crc32c codec: takes no configuration, got {config!r}")
        return cls()

    def to_json(self) -> dict[str, Any]:
        return {"name": "crc32c"}

    def encode(self, buf: Buffer) -> Buffer:
        mv = memoryview(buf).cast("B")
        out = bytearray(len(mv) + 4)
        out[: len(mv)] = mv
        out[len(mv):] = _crc.crc32c(mv).to_bytes(4, "little")
        return out

    def encoded_size(self, size: int | None) -> int | None:
        return None if size is None else size + 4

    def decoded_size(self, size: int | None) -> int | None:
        return None if size is None else size - 4

    def decode(self, buf: Buffer, *, key: str, size: int | None, limit: int,
               out: Buffer | None = None) -> Buffer:
        mv = memoryview(buf).cast("B")
        if len(mv) < 4:
            raise DataCorruptionError(f"chunk {key!r}: {len(mv)} bytes, too short for a crc32c")
        body, stored = mv[:-4], int.from_bytes(mv[-4:], "little")
        found = _crc.crc32c(body)
        if found != stored:
            raise ChecksumError(
                f"chunk {key!r}: crc32c mismatch: stored {stored:#010x}, computed {found:#010x}"
            )
        if size is not None and len(body) != size:
            raise DataCorruptionError(f"chunk {key!r}: expected {size} bytes, found {len(body)}")
        return body
