"""``zstd`` through numcodecs (C, releases the GIL).

Also decodes the zarr v2 compressor ``zstd``, and is ``compression="zstd"``
(level 1, no checksum).
"""

from __future__ import annotations

import sys
from typing import Any

import numcodecs.zstd as _nz
import numpy as np
from numcodecs import Zstd

from tensorstore_py.core.errors import (
    DataCorruptionError,
    InvalidSpecError,
    TensorStoreError,
    UnsupportedError,
)
from tensorstore_py.drivers.codecs._limits import check_size, decompress_bounded
from tensorstore_py.drivers.codecs.base import BytesBytesCodec, ChunkSpec
from tensorstore_py.drivers.codecs.registry import (
    Compression,
    V2Param,
    register_codec,
    register_compression,
    register_v2_decoder,
)
from tensorstore_py.kvstore.base import Buffer

_MAGIC = b"\x28\xb5\x2f\xfd"


def frame_content_size(mv: memoryview, key: str) -> int | None:
    """The decoded size a zstd frame header declares (None if not declared)."""
    head = bytes(mv[:18])
    if len(head) < 6 or head[:4] != _MAGIC:
        raise DataCorruptionError(f"chunk {key!r}: not zstd data (bad frame magic)")
    fhd = head[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    n = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if n == 0:
        return None
    if len(mv) < pos + n:
        raise DataCorruptionError(f"chunk {key!r}: zstd frame header is truncated")
    v = int.from_bytes(head[pos: pos + n], "little")
    return v + 256 if n == 2 else v


@register_codec
class ZstdCodec(BytesBytesCodec):
    name = "zstd"
    decodes_into = True

    def __init__(self, level: int = 0, checksum: bool = False) -> None:
        if not isinstance(level, int) or isinstance(level, bool) or not -131072 <= level <= 22:
            raise InvalidSpecError(f"zstd codec: 'level' must be an integer <= 22, got {level!r}")
        if not isinstance(checksum, bool):
            raise InvalidSpecError(f"zstd codec: 'checksum' must be a boolean, got {checksum!r}")
        self.level, self.checksum = level, checksum
        self._z = Zstd(level=level, checksum=checksum)

    @classmethod
    def from_json(cls, config: dict[str, Any], chunk: ChunkSpec) -> ZstdCodec:
        unknown = set(config) - {"level", "checksum"}
        if unknown:
            raise InvalidSpecError(f"zstd codec: unknown configuration fields {sorted(unknown)}")
        return cls(config.get("level", 0), config.get("checksum", False))

    def to_json(self) -> dict[str, Any]:
        return {"name": "zstd", "configuration": {"level": self.level, "checksum": self.checksum}}

    def encode(self, buf: Buffer) -> Buffer:
        return self._z.encode(buf)

    def decode(self, buf: Buffer, *, key: str, size: int | None, limit: int,
               out: Buffer | None = None) -> Buffer:
        return zstd_decode(self._z, buf, key=key, size=size, limit=limit, out=out)


def zstd_decode(z: Zstd, buf: Buffer, *, key: str, size: int | None, limit: int,
                out: Buffer | None = None) -> Buffer:
    """Decode zstd data into at most ``size`` bytes (``limit`` when the size is
    not known), whatever its frame header declares or omits.

    * A declared content size is checked first, then libzstd decodes in one call.
    * No declared size (a streaming writer's frame) but a known ``size``:
      libzstd decodes into a buffer of exactly ``size`` bytes and refuses to
      write past it.
    * Neither: a streaming decoder with a cap on its output (``compression.zstd``,
      or the ``backports.zstd`` package before Python 3.14: extra ``zstd``).
    """
    mv = memoryview(buf).cast("B")
    declared = frame_content_size(mv, key)
    try:
        if declared is not None:
            check_size("zstd", key, declared, size, limit)
            if declared == 0:  # numcodecs would stream it (0 reads as "unknown"), unbounded
                return b""
            # the module-level function skips the codec class's buffer checks
            if out is not None and len(out) == declared:
                return _nz.decompress(mv, out)
            return _nz.decompress(mv)
        if size:
            dest = out if out is not None and len(out) == size else np.empty(size, np.uint8)
            return _nz.decompress(mv, dest)  # the bound: libzstd stops at the end of dest
        return _decode_streaming(mv, key=key, size=size, limit=limit)
    except TensorStoreError:
        raise
    except Exception as e:  # numcodecs raises RuntimeError/ValueError
        raise DataCorruptionError(f"chunk {key!r}: invalid zstd data: {e}") from None


def _decode_streaming(mv: memoryview, *, key: str, size: int | None, limit: int) -> bytes:
    """Frames after frames, decoded by a streaming decoder that stops after
    ``size + 1`` (``limit + 1``) output bytes."""
    try:
        if sys.version_info >= (3, 14):
            from compression import zstd  # Python 3.14+
        else:
            from backports import zstd  # optional (extra "zstd"): Python < 3.14
    except ImportError:
        raise UnsupportedError(
            f"chunk {key!r}: a zstd frame that declares no content size, in a chunk whose "
            "decoded size is not fixed, needs a bounded streaming decoder: "
            'pip install "tensorstore_py[zstd]" (the backports.zstd package)'
        ) from None
    return decompress_bounded(zstd.ZstdDecompressor, mv, codec="zstd", key=key, size=size,
                              limit=limit, members=True, errors=(zstd.ZstdError,))


register_v2_decoder("zstd", zstd_decode, decodes_into=True, params={
    "level": V2Param.integer(-131072, 22), "checksum": V2Param.boolean()})
register_compression(Compression(
    "zstd", default_level=1,
    zarr3=lambda level, dtype: {"name": "zstd", "configuration": {"level": level, "checksum": False}},
    zarr2=lambda level, dtype: {"id": "zstd", "level": level},
))
