"""lz4-java's ``LZ4BlockOutputStream`` framing, the byte format of N5's ``lz4``
compression (N5-Java wraps each block's data in that stream).

The stream is a sequence of frames, each a 21-byte header and a payload::

    magic      8 bytes  b"LZ4Block"
    token      1 byte   method | level: method 0x10 = stored (RAW), 0x20 = LZ4 block;
                        level = max(0, ceil(log2(blockSize)) - 10), so a frame's
                        decoded length is at most 1 << (10 + level)
    compLen    int32 little-endian  payload length
    origLen    int32 little-endian  decoded length
    checksum   int32 little-endian  XXH32(decoded bytes, seed 0x9747b28c) & 0x0FFFFFFF
    payload    compLen bytes: raw LZ4 block data (no size prefix), or the bytes themselves

and ends with an empty frame (RAW, all three numbers 0). The checksum mask is
lz4-java's: ``StreamingXXHash32.asChecksum().getValue()`` returns the hash
``& 0xFFFFFFFL``, clearing the top four bits. A frame whose LZ4 data is not
smaller than its input is stored RAW, as lz4-java does.

The LZ4 block codec is numcodecs' (C, releases the GIL; its 4-byte size prefix
is stripped on encode and supplied on decode). XXH32 comes from the ``xxhash``
package (the ``n5`` extra); without it this module imports but encode/decode
raise UnsupportedError.
"""

from __future__ import annotations

import struct
from types import ModuleType

import numcodecs.lz4 as _lz4
import numpy as np

from tensorstore_py.core.errors import ChecksumError, DataCorruptionError, UnsupportedError
from tensorstore_py.core.ranges import Buffer

xxhash: ModuleType | None
try:  # optional: the "n5" extra; only lz4 blocks need it
    import xxhash
except ImportError:  # pragma: no cover - exercised where the extra is missing
    xxhash = None

__all__ = ["MAX_BLOCK_SIZE", "MIN_BLOCK_SIZE", "decode", "encode", "frame_checksum"]

MAGIC = b"LZ4Block"
_HEAD = struct.Struct("<Biii")  # token, compressed length, decoded length, checksum
HEADER_SIZE = len(MAGIC) + _HEAD.size
METHOD_RAW, METHOD_LZ4 = 0x10, 0x20
LEVEL_BASE = 10
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 64, 1 << (LEVEL_BASE + 0x0F)
SEED, CHECKSUM_MASK = 0x9747B28C, 0x0FFFFFFF


def _xxhash() -> ModuleType:
    if xxhash is None:
        raise UnsupportedError(
            "n5 lz4 compression needs the 'xxhash' package for its checksums: "
            "pip install 'tensorstore_py[n5]'"
        )
    return xxhash


def frame_checksum(data: Buffer | np.ndarray) -> int:
    """The checksum lz4-java stores for a frame's decoded ``data``."""
    return _xxhash().xxh32_intdigest(data, seed=SEED) & CHECKSUM_MASK


def level_of(block_size: int) -> int:
    """The token's level nibble for ``block_size`` (lz4-java's ``compressionLevel``)."""
    return max(0, (block_size - 1).bit_length() - LEVEL_BASE)


def encode(data: Buffer, *, block_size: int) -> bytes:
    """Frame ``data`` as ``LZ4BlockOutputStream(out, block_size)`` followed by
    ``close()`` writes it (the end frame included)."""
    _xxhash()
    level = level_of(block_size)
    mv = memoryview(data).cast("B")
    parts: list[Buffer] = []
    for start in range(0, len(mv), block_size):
        piece = mv[start: start + block_size]
        packed = memoryview(_lz4.compress(piece))[4:]  # drop numcodecs' size prefix
        method, payload = (METHOD_LZ4, packed) if len(packed) < len(piece) else (METHOD_RAW, piece)
        parts.append(MAGIC + _HEAD.pack(method | level, len(payload), len(piece), frame_checksum(piece)))
        parts.append(payload)
    parts.append(MAGIC + _HEAD.pack(METHOD_RAW | level, 0, 0, 0))
    return b"".join(parts)


def decode(data: Buffer, *, size: int, key: str) -> bytearray:
    """The ``size`` bytes a framed stream decodes to.

    Bounded: every frame's declared length is checked against what is still
    expected before anything is allocated beyond ``size`` bytes. A stream may
    stop right after ``size`` bytes without its end frame (N5-Java reads exactly
    the block's bytes and never looks for it); bytes after the end frame are an
    error. Raises DataCorruptionError (ChecksumError for a checksum mismatch).
    """
    _xxhash()
    mv = memoryview(data).cast("B")
    out = bytearray(size)
    dest = np.frombuffer(out, dtype=np.uint8)
    pos = done = 0
    while pos < len(mv):
        if len(mv) - pos < HEADER_SIZE or mv[pos: pos + len(MAGIC)] != MAGIC:
            raise DataCorruptionError(f"n5 block {key!r}: lz4 stream has a bad or truncated frame header")
        token, clen, olen, check = _HEAD.unpack_from(mv, pos + len(MAGIC))
        method, limit = token & 0xF0, 1 << (LEVEL_BASE + (token & 0x0F))
        pos += HEADER_SIZE
        if (method not in (METHOD_RAW, METHOD_LZ4) or not 0 <= olen <= limit or clen < 0
                or (olen == 0) != (clen == 0) or (method == METHOD_RAW and clen != olen)):
            raise DataCorruptionError(
                f"n5 block {key!r}: corrupt lz4 frame (token {token:#x}, lengths {clen}/{olen})")
        if olen == 0:  # the end frame
            if check != 0 or pos != len(mv):
                raise DataCorruptionError(f"n5 block {key!r}: bytes after the lz4 end frame")
            break
        if done + olen > size:
            raise DataCorruptionError(
                f"n5 block {key!r}: lz4 data decodes to more than the {size} bytes expected")
        if len(mv) - pos < clen:
            raise DataCorruptionError(f"n5 block {key!r}: lz4 data is truncated")
        payload, target = mv[pos: pos + clen], dest[done: done + olen]
        if method == METHOD_RAW:
            target[:] = payload
        else:
            try:
                _lz4.decompress(olen.to_bytes(4, "little") + payload, target)
            except Exception as e:  # numcodecs raises RuntimeError/ValueError
                raise DataCorruptionError(f"n5 block {key!r}: invalid lz4 data: {e}") from None
        if frame_checksum(target) != check:
            raise ChecksumError(f"n5 block {key!r}: lz4 frame checksum mismatch at byte {done}")
        pos += clen
        done += olen
    if done != size:
        raise DataCorruptionError(f"n5 block {key!r}: lz4 data decodes to {done} bytes, expected {size}")
    return out
