"""``bytes``: the array's elements in C order with a given endianness."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from tensorstore_py.core.errors import DataCorruptionError, InvalidSpecError
from tensorstore_py.drivers.codecs.base import ArrayBytesCodec, ChunkSpec
from tensorstore_py.drivers.codecs.registry import register_codec
from tensorstore_py.drivers.dtypes import has_byte_order, is_variable_length
from tensorstore_py.kvstore.base import Buffer


@register_codec
class BytesCodec(ArrayBytesCodec):
    """Raw little/big-endian bytes; ``endian`` is None for 1-byte types."""

    name = "bytes"

    def __init__(self, endian: str | None = "little") -> None:
        if endian not in ("little", "big", None):
            raise InvalidSpecError(f"bytes codec: 'endian' must be 'little' or 'big', got {endian!r}")
        self.endian = endian

    @classmethod
    def from_json(cls, config: dict[str, Any], chunk: ChunkSpec) -> BytesCodec:
        dtype = chunk.dtype
        unknown = set(config) - {"endian"}
        if unknown:
            raise InvalidSpecError(f"bytes codec: unknown configuration fields {sorted(unknown)}")
        if is_variable_length(dtype):
            raise InvalidSpecError(
                f"bytes codec: cannot encode the variable-length type {dtype} (use 'vlen-utf8' "
                "for strings, 'vlen-bytes' for bytes)"
            )
        endian = config.get("endian")
        if endian is None and has_byte_order(dtype):
            raise InvalidSpecError(
                f"bytes codec: 'endian' is required for the {dtype.itemsize}-byte type {dtype}"
            )
        return cls(endian)

    def to_json(self) -> dict[str, Any]:
        if self.endian is None:
            return {"name": "bytes"}
        return {"name": "bytes", "configuration": {"endian": self.endian}}

    def _stored(self, dtype: np.dtype) -> np.dtype:
        if not has_byte_order(dtype) or self.endian is None:
            return dtype
        if dtype.kind == "V" or dtype.byteorder == "|":  # ml_dtypes are native-only
            return dtype
        return dtype.newbyteorder("<" if self.endian == "little" else ">")

    def needs_swap(self, dtype: np.dtype) -> bool:
        return has_byte_order(dtype) and self.endian is not None and self.endian != sys.byteorder

    def stores_native(self, dtype: np.dtype) -> bool:
        return not self.needs_swap(dtype)

    def encode(self, a: np.ndarray) -> Buffer:
        a = np.ascontiguousarray(a)
        if self.needs_swap(a.dtype):
            if a.dtype.kind == "V":  # ml_dtypes: no byte-swapped variant, reverse bytes
                a = a.view(np.uint8).reshape(a.shape + (a.dtype.itemsize,))[..., ::-1]
                return np.ascontiguousarray(a).reshape(-1).data
            a = a.astype(self._stored(a.dtype))
        # through uint8: memoryview cannot export ml_dtypes' bfloat16/float8
        return a.reshape(-1).view(np.uint8).data

    def encoded_size(self, shape: tuple[int, ...], dtype: np.dtype) -> int | None:
        return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def decode(
        self, buf: Buffer, shape: tuple[int, ...], dtype: np.dtype, *, key: str,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64))
        if len(memoryview(buf).cast("B")) != n * dtype.itemsize:
            raise DataCorruptionError(
                f"chunk {key!r}: expected {n * dtype.itemsize} bytes for {list(shape)} {dtype}, "
                f"found {len(memoryview(buf).cast('B'))}"
            )
        if self.needs_swap(dtype):
            if dtype.kind == "V":
                raw = np.frombuffer(buf, np.uint8).reshape(tuple(shape) + (dtype.itemsize,))
                return np.ascontiguousarray(raw[..., ::-1]).view(dtype).reshape(shape)
            a = np.frombuffer(buf, dtype=self._stored(dtype)).reshape(shape)
            return a.astype(dtype)
        return np.frombuffer(buf, dtype=dtype).reshape(shape)
