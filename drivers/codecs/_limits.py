"""Size checks and bounded decoding shared by the decompressors (refuse bombs,
catch truncation).

Every decoder stops at the size it expects: the exact decoded size where the
format fixes it, else the chunk's limit. A compressed chunk that claims or
produces more raises DataCorruptionError naming its key after at most
``limit + 1`` bytes of output, whatever it would decode to.
"""

from __future__ import annotations

import lzma
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorstore_py.core.errors import DataCorruptionError
from tensorstore_py.drivers.dtypes import is_variable_length
from tensorstore_py.kvstore.base import Buffer

__all__ = [
    "LZMA_MEMLIMIT",
    "MAX_VLEN_CHUNK_BYTES",
    "check_size",
    "decode_limit",
    "decompress_bounded",
    "numcodecs_decode",
]

#: an xz/lzma decoder's own memory (its dictionary, which the stream declares)
#: on top of its output: enough for preset 9 (64 MiB dictionary), refused beyond
LZMA_MEMLIMIT = 96 << 20

#: the most a variable-length chunk (strings, bytes) may decode to: its size is
#: not known in advance, so a decompressor stops here instead
MAX_VLEN_CHUNK_BYTES = 1 << 30


def decode_limit(elements: int, dtype: np.dtype) -> int:
    """The most bytes any decoding stage of a chunk of ``elements`` of ``dtype``
    may produce: generous for fixed-size types (4x the chunk + 1 MiB), a fixed
    cap (MAX_VLEN_CHUNK_BYTES) for variable-length ones."""
    if is_variable_length(dtype):
        return MAX_VLEN_CHUNK_BYTES
    return 4 * elements * dtype.itemsize + (1 << 20)


def check_size(codec: str, key: str, found: int, size: int | None, limit: int) -> None:
    """Raise DataCorruptionError unless ``found`` matches ``size`` and is within ``limit``."""
    if size is not None and found != size:
        raise DataCorruptionError(
            f"chunk {key!r}: {codec} data decodes to {found} bytes, expected {size}"
        )
    if found > limit:
        raise DataCorruptionError(
            f"chunk {key!r}: {codec} data declares {found} decoded bytes, more than the "
            f"{limit} a chunk may hold"
        )


_STREAM_ERRORS: tuple[type[Exception], ...] = (zlib.error, lzma.LZMAError, OSError, EOFError, ValueError)


def decompress_bounded(new: Callable[[], Any], data: Buffer, *, codec: str, key: str,
                       size: int | None, limit: int, members: bool,
                       errors: tuple[type[Exception], ...] = ()) -> bytes:
    """Run a streaming decompressor (``new()`` makes one with zlib's, bz2's,
    lzma's or zstd's ``decompress(data, max_length)``/``eof``/``unused_data``),
    producing at most ``size + 1`` bytes (``limit + 1`` when the size is not
    known), then check the size.

    ``members``: concatenated streams (gzip members, zstd frames, xz streams)
    decode one after another; otherwise bytes after the first stream are
    ignored. The decompressor's errors (zlib's, lzma's, bz2's OSError, and
    ``errors``) become DataCorruptionError naming ``key``.
    """
    cap = (size if size is not None else limit) + 1
    parts: list[bytes] = []
    total, rest = 0, data
    while True:
        d = new()
        try:
            out = d.decompress(rest, cap - total)
        except _STREAM_ERRORS + errors as e:
            raise DataCorruptionError(f"chunk {key!r}: invalid {codec} data: {e}") from None
        parts.append(out)
        total += len(out)
        if total >= cap:
            raise DataCorruptionError(
                f"chunk {key!r}: {codec} data decodes to more than the {size} bytes expected"
                if size is not None else
                f"chunk {key!r}: {codec} data decodes to more than the {limit} bytes a chunk may hold")
        if not d.eof:
            raise DataCorruptionError(f"chunk {key!r}: {codec} data is truncated")
        rest = d.unused_data
        if not (members and rest):
            break
    check_size(codec, key, total, size, limit)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def numcodecs_decode(codec: Any, buf: Buffer, *, key: str, size: int | None, limit: int,
                     out: Buffer | None = None) -> Buffer:
    """Decode with the numcodecs ``codec`` and check the size afterwards (for
    compressors whose header declares no size to check first)."""
    try:
        res = codec.decode(buf)
    except Exception as e:  # numcodecs raises RuntimeError/ValueError/...
        raise DataCorruptionError(f"chunk {key!r}: invalid {codec.codec_id} data: {e}") from None
    check_size(codec.codec_id, key, memoryview(res).nbytes, size, limit)
    return res
