"""``vlen-utf8`` and ``vlen-bytes``: variable-length strings and bytes.

The array->bytes codecs zarr-python 3 writes for the ``string`` and
``variable_length_bytes`` data types, and the zarr v2 object codecs of the same
ids (the first filter of a ``"|O"`` array). The layout is numcodecs' VLenUTF8 /
VLenBytes: a little-endian uint32 element count, then per element (C order) a
uint32 byte length and that many bytes (UTF-8 for strings).

numcodecs encodes and decodes (in C). Before it allocates anything the count is
checked against the chunk's element count; numcodecs checks every length against
the bytes present. So a hostile chunk costs at most its own size plus one object
per element, and invalid UTF-8 or a short buffer is a DataCorruptionError naming
the chunk.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numcodecs.vlen import VLenBytes, VLenUTF8

from tensorstore_py.core.errors import DataCorruptionError, InvalidSpecError
from tensorstore_py.drivers.codecs.base import ArrayBytesCodec, ChunkSpec
from tensorstore_py.drivers.codecs.registry import register_codec
from tensorstore_py.drivers.dtypes import BYTES_DTYPE, STRING_DTYPE
from tensorstore_py.kvstore.base import Buffer

__all__ = ["VlenBytesCodec", "VlenUtf8Codec", "decode_vlen", "encode_vlen"]

_CODECS: dict[str, Any] = {"vlen-utf8": VLenUTF8(), "vlen-bytes": VLenBytes()}
_DTYPES = {"vlen-utf8": STRING_DTYPE, "vlen-bytes": BYTES_DTYPE}


def encode_vlen(codec_id: str, a: np.ndarray) -> Buffer:
    """The ``codec_id`` encoding of ``a``'s elements in C order."""
    return _CODECS[codec_id].encode(a.reshape(-1))


def decode_vlen(codec_id: str, buf: Buffer, n: int, *, key: str) -> np.ndarray:
    """The ``n`` elements ``buf`` holds, as a 1-d array of the codec's dtype
    (:data:`STRING_DTYPE` for ``vlen-utf8``, ``object`` of bytes for ``vlen-bytes``)."""
    mv = memoryview(buf).cast("B")
    if len(mv) < 4:
        raise DataCorruptionError(f"chunk {key!r}: {codec_id} data of {len(mv)} bytes is truncated")
    count = int.from_bytes(mv[:4], "little")
    if count != n:
        raise DataCorruptionError(f"chunk {key!r}: {codec_id} data holds {count} elements, expected {n}")
    try:
        out = _CODECS[codec_id].decode(mv)
    except (ValueError, TypeError, RuntimeError) as e:  # truncated, invalid UTF-8 (a ValueError)
        raise DataCorruptionError(f"chunk {key!r}: invalid {codec_id} data: {e}") from None
    dt = _DTYPES[codec_id]
    return out if out.dtype == dt else out.astype(dt)


class _VlenCodec(ArrayBytesCodec):
    """The elements of a variable-length chunk, one length-prefixed run each."""

    @classmethod
    def from_json(cls, config: dict[str, Any], chunk: ChunkSpec) -> _VlenCodec:
        if config:
            raise InvalidSpecError(f"{cls.name} codec: unknown configuration fields {sorted(config)}")
        want = _DTYPES[cls.name]
        if chunk.dtype != want:
            raise InvalidSpecError(
                f"{cls.name} codec: encodes arrays of {want} "
                f"({'string' if cls.name == 'vlen-utf8' else 'variable_length_bytes'}), "
                f"not {chunk.dtype}"
            )
        return cls()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": {}}

    def encode(self, a: np.ndarray) -> Buffer:
        return encode_vlen(self.name, np.ascontiguousarray(a))

    def decode(self, buf: Buffer, shape: tuple[int, ...], dtype: np.dtype, *, key: str,
               out: np.ndarray | None = None) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64))
        return decode_vlen(self.name, buf, n, key=key).reshape(shape)


@register_codec
class VlenUtf8Codec(_VlenCodec):
    """``vlen-utf8``: the zarr3 ``string`` data type's serializer."""

    name = "vlen-utf8"


@register_codec
class VlenBytesCodec(_VlenCodec):
    """``vlen-bytes``: the zarr3 ``variable_length_bytes`` data type's serializer."""

    name = "vlen-bytes"
