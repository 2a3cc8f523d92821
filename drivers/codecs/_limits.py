"""Size checks shared by the compressors (refuse bombs, catch truncation)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorstore_py.core.errors import DataCorruptionError
from tensorstore_py.drivers.dtypes import is_variable_length
from tensorstore_py.kvstore.base import Buffer

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
