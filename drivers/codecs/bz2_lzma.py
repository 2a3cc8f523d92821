"""zarr v2 (numcodecs) ``bz2`` and ``lzma``, decoded with a cap on the output.

numcodecs decompresses these with ``bz2.decompress`` / ``lzma.decompress``, which
allocate whatever the stream expands to. Here the standard library's incremental
decompressors stop one byte past the chunk's expected (or largest) size, so a
decompression bomb is refused after producing at most that much. Concatenated
streams are accepted, as those functions accept them. The zarr3 codecs
``numcodecs.bz2`` and ``numcodecs.lzma`` decode through these too.
"""

from __future__ import annotations

import bz2
import lzma
from collections.abc import Callable
from typing import Any

from tensorstore_py.core.errors import DataCorruptionError
from tensorstore_py.drivers.codecs._limits import check_size
from tensorstore_py.drivers.codecs.registry import register_v2_decoder
from tensorstore_py.kvstore.base import Buffer

__all__ = ["capped_decompress"]


def capped_decompress(new: Callable[[], Any], buf: Buffer, *, codec: str, key: str,
                      size: int | None, limit: int) -> bytes:
    """Run the incremental decompressors ``new()`` over ``buf`` (one per stream),
    producing at most ``size`` (or ``limit``) + 1 bytes, then check the size."""
    cap = (size if size is not None else limit) + 1
    pieces: list[bytes] = []
    total = 0
    data: bytes | memoryview = memoryview(buf).cast("B")
    d = new()
    try:
        while total < cap:
            piece = d.decompress(data, cap - total)
            pieces.append(piece)
            total += len(piece)
            data = b""
            if d.eof:
                if not d.unused_data:
                    break
                data, d = d.unused_data, new()  # the next concatenated stream
            elif d.needs_input:
                raise DataCorruptionError(f"chunk {key!r}: {codec} data is truncated")
    except (OSError, ValueError, EOFError, lzma.LZMAError) as e:
        raise DataCorruptionError(f"chunk {key!r}: invalid {codec} data: {e}") from None
    check_size(codec, key, total, size, limit)
    return b"".join(pieces)


def _bz2(codec: Any, buf: Buffer, *, key: str, size: int | None, limit: int,
         out: Buffer | None) -> Buffer:
    return capped_decompress(bz2.BZ2Decompressor, buf, codec="bz2", key=key, size=size, limit=limit)


def _lzma(codec: Any, buf: Buffer, *, key: str, size: int | None, limit: int,
          out: Buffer | None) -> Buffer:
    def new() -> lzma.LZMADecompressor:
        return lzma.LZMADecompressor(format=codec.format, filters=codec.filters)

    return capped_decompress(new, buf, codec="lzma", key=key, size=size, limit=limit)


register_v2_decoder("bz2", _bz2)
register_v2_decoder("lzma", _lzma)
