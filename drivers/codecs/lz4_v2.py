"""zarr v2 ``lz4`` (numcodecs' LZ4; zarr v3 has no lz4 codec).

The decoded size in its 4-byte little-endian header is checked before
decompressing, so a hostile chunk cannot make it allocate more than a chunk.
"""

from __future__ import annotations

from typing import Any

from tensorstore_py.core.errors import DataCorruptionError
from tensorstore_py.drivers.codecs._limits import check_size, numcodecs_decode
from tensorstore_py.drivers.codecs.registry import V2Param, register_v2_decoder
from tensorstore_py.kvstore.base import Buffer


def lz4_decode(codec: Any, buf: Buffer, *, key: str, size: int | None, limit: int,
               out: Buffer | None = None) -> Buffer:
    """Decode numcodecs LZ4 data after checking the size its header declares."""
    mv = memoryview(buf).cast("B")
    if len(mv) < 4:
        raise DataCorruptionError(f"chunk {key!r}: lz4 data is truncated")
    check_size("lz4", key, int.from_bytes(mv[:4], "little"), size, limit)
    return numcodecs_decode(codec, buf, key=key, size=size, limit=limit)


register_v2_decoder("lz4", lz4_decode, params={"acceleration": V2Param.integer(1, 2**16)})
