"""zarr v2 (numcodecs) ``bz2`` and ``lzma``, decoded with a cap on the output.

numcodecs decompresses these with ``bz2.decompress`` / ``lzma.decompress``, which
allocate whatever the stream expands to. Here the standard library's incremental
decompressors stop one byte past the chunk's expected (or largest) size
(:func:`~tensorstore_py.drivers.codecs._limits.decompress_bounded`), so a
decompression bomb is refused after producing at most that much. Concatenated
streams are accepted, as those functions accept them. The lzma decoder's own
memory is capped too (``LZMA_MEMLIMIT``: a stream declares its dictionary
size). The zarr3 codecs ``numcodecs.bz2`` and ``numcodecs.lzma`` decode through
these too. The compressors' configuration fields are checked when an array is
opened.
"""

from __future__ import annotations

import bz2
import lzma
from typing import Any

from tensorstore_py.core.errors import DataCorruptionError
from tensorstore_py.drivers.codecs._limits import LZMA_MEMLIMIT, decompress_bounded
from tensorstore_py.drivers.codecs.registry import V2Param, register_v2_decoder
from tensorstore_py.kvstore.base import Buffer

__all__ = ["bz2_decode", "lzma_decode"]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def bz2_decode(codec: Any, buf: Buffer, *, key: str, size: int | None, limit: int,
               out: Buffer | None = None) -> Buffer:
    """Decode numcodecs BZ2 data, stopping at ``size`` (``limit``) bytes."""
    return decompress_bounded(bz2.BZ2Decompressor, buf, codec="bz2", key=key, size=size,
                              limit=limit, members=True)


def lzma_decode(codec: Any, buf: Buffer, *, key: str, size: int | None, limit: int,
                out: Buffer | None = None) -> Buffer:
    """Decode numcodecs LZMA data (its ``format`` and, for raw streams, ``filters``)."""
    fmt = codec.format
    if fmt == lzma.FORMAT_RAW:
        filters = codec.filters
        for f in filters or ():
            if int(f.get("dict_size", 0)) > LZMA_MEMLIMIT:
                raise DataCorruptionError(
                    f"chunk {key!r}: lzma filter dictionary of {f['dict_size']} bytes, more than "
                    f"the {LZMA_MEMLIMIT} a decoder may use")

        def new() -> Any:
            return lzma.LZMADecompressor(fmt, filters=filters)
    else:
        memlimit = (size if size is not None else limit) + LZMA_MEMLIMIT

        def new() -> Any:
            return lzma.LZMADecompressor(fmt, memlimit=memlimit)
    return decompress_bounded(new, buf, codec="lzma", key=key, size=size, limit=limit,
                              members=fmt != lzma.FORMAT_RAW)


register_v2_decoder("bz2", bz2_decode, params={"level": V2Param.integer(1, 9)})
register_v2_decoder("lzma", lzma_decode, params={
    "format": V2Param.one_of(lzma.FORMAT_AUTO, lzma.FORMAT_XZ, lzma.FORMAT_ALONE, lzma.FORMAT_RAW),
    "check": V2Param.one_of(-1, lzma.CHECK_NONE, lzma.CHECK_CRC32, lzma.CHECK_CRC64, lzma.CHECK_SHA256),
    # 0..9, possibly with lzma.PRESET_EXTREME; only encoding uses it
    "preset": V2Param("null or an integer 0..9 (| lzma.PRESET_EXTREME)", lambda v: v is None or (
        _is_int(v) and 0 <= v & ~lzma.PRESET_EXTREME <= 9 and v >= 0)),
    "filters": V2Param("null or a list of lzma filter objects with integer fields", lambda v: v is None or (
        isinstance(v, list) and all(isinstance(f, dict) and "id" in f and all(map(_is_int, f.values()))
                                    for f in v))),
})
