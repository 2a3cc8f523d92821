"""A parsed zarr v3 codec list bound to a chunk shape and dtype.

Each entry is built by the codec registered under its name
(:mod:`~tensorstore_py.drivers.codecs.registry`); the chain checks the order of
the three kinds and knows the shortcuts the engine may take (raw, direct,
strided_out).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorstore_py.core.errors import DataCorruptionError, InvalidSpecError
from tensorstore_py.drivers.codecs._limits import decode_limit
from tensorstore_py.drivers.codecs.base import (
    ArrayArrayCodec,
    ArrayBytesCodec,
    BytesBytesCodec,
    ChunkCodec,
    ChunkSpec,
    Codec,
)
from tensorstore_py.drivers.codecs.registry import codec_from_json
from tensorstore_py.kvstore.base import Buffer

__all__ = ["CodecChain"]


def _parse_one(
    entry: Any, shape: tuple[int, ...], dtype: np.dtype, fill_value: Any, where: str
) -> Codec:
    if isinstance(entry, str):
        entry = {"name": entry}
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise InvalidSpecError(f"{where}: each codec must be {{'name': ..., 'configuration': ...}}, got {entry!r}")
    unknown = set(entry) - {"name", "configuration", "must_understand"}
    if unknown:
        raise InvalidSpecError(f"{where}: codec {entry['name']!r} has unknown fields {sorted(unknown)}")
    name = entry["name"]
    config = entry.get("configuration", {}) or {}
    if not isinstance(config, dict):
        raise InvalidSpecError(f"{where}: codec {name!r} configuration must be an object")
    return codec_from_json(name, config, ChunkSpec(shape, dtype, fill_value), where=where)


class CodecChain(ChunkCodec):
    """``array->array* , array->bytes , bytes->bytes*`` for chunks of ``shape``."""

    def __init__(
        self,
        aa: Sequence[ArrayArrayCodec],
        ab: ArrayBytesCodec,
        bb: Sequence[BytesBytesCodec],
        shape: tuple[int, ...],
        dtype: np.dtype,
    ) -> None:
        self.aa, self.ab, self.bb = list(aa), ab, list(bb)
        self.shape, self.dtype = tuple(shape), dtype
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        s, d = self.shape, dtype
        for c in self.aa:
            s, d = c.resolve(s, d)
        self.ab_shape, self.ab_dtype = s, d
        # decode limit for variable-size stages: generous, but bounded
        self.limit = decode_limit(int(np.prod(shape, dtype=np.int64)), dtype)
        size = ab.encoded_size(s, d)
        self.bb_sizes: list[int | None] = []  # decoded size of each bytes->bytes stage
        for b in self.bb:
            self.bb_sizes.append(size)
            size = b.encoded_size(size)
        self.encoded_size = size
        native = not self.aa and ab.stores_native(dtype)
        # see ChunkCodec: raw (stored bytes = the array), direct (the one
        # compressor decodes into ``out``), strided_out (a shard fills views)
        self.raw = native and not self.bb
        self.direct = native and len(self.bb) == 1 and self.bb[0].decodes_into
        self.strided_out = not self.aa and not self.bb and ab.fills_any_out

    @classmethod
    def from_json(
        cls,
        codecs: Any,
        shape: tuple[int, ...],
        dtype: np.dtype,
        fill_value: Any,
        *,
        where: str = "zarr3 metadata field 'codecs'",
    ) -> CodecChain:
        if not isinstance(codecs, list) or not codecs:
            raise InvalidSpecError(f"{where}: expected a non-empty list of codecs, got {codecs!r}")
        aa: list[ArrayArrayCodec] = []
        ab: ArrayBytesCodec | None = None
        bb: list[BytesBytesCodec] = []
        s, d = tuple(shape), dtype
        for entry in codecs:
            c = _parse_one(entry, s, d, fill_value, where)
            if isinstance(c, ArrayArrayCodec):
                if ab is not None:
                    raise InvalidSpecError(f"{where}: array->array codec {c.name!r} after array->bytes codec")
                aa.append(c)
                s, d = c.resolve(s, d)
            elif isinstance(c, ArrayBytesCodec):
                if ab is not None:
                    raise InvalidSpecError(f"{where}: more than one array->bytes codec ({ab.name!r}, {c.name!r})")
                ab = c
            else:
                if ab is None:
                    raise InvalidSpecError(f"{where}: bytes->bytes codec {c.name!r} before the array->bytes codec")
                bb.append(c)  # type: ignore[arg-type]
        if ab is None:
            raise InvalidSpecError(f"{where}: no array->bytes codec (e.g. 'bytes' or 'sharding_indexed')")
        return cls(aa, ab, bb, shape, dtype)

    def to_json(self) -> list[dict[str, Any]]:
        return [c.to_json() for c in (*self.aa, self.ab, *self.bb)]

    def encode(self, a: np.ndarray) -> Buffer:
        """Encode one chunk (``a`` has exactly ``self.shape``)."""
        for c in self.aa:
            a = c.encode(a)
        buf = self.ab.encode(a)
        for b in self.bb:
            buf = b.encode(buf)
        return buf

    def decode(self, buf: Buffer, *, key: str, out: np.ndarray | None = None) -> np.ndarray:
        """Decode one chunk to an array of ``self.shape``.

        With ``out`` (C-contiguous, exact shape and dtype) the result may be
        written straight into it; the returned array is then ``out``. Without
        it the result may be a read-only view of ``buf``.
        """
        if self.strided_out and out is not None:  # a shard: inner chunks land in place
            return self.ab.decode(buf, self.shape, self.dtype, key=key, out=out)
        if self.raw:  # the stored bytes are the array: no copy at all
            n = memoryview(buf).nbytes
            if n != self.nbytes:
                raise DataCorruptionError(
                    f"chunk {key!r}: expected {self.nbytes} bytes for {list(self.shape)} "
                    f"{self.dtype}, found {n}"
                )
            return np.frombuffer(buf, dtype=self.dtype).reshape(self.shape)
        if self.direct:  # one compressor over native bytes: decompress into place
            target = out if out is not None else np.empty(self.shape, dtype=self.dtype)
            view = target.reshape(-1).view(np.uint8).data
            res = self.bb[0].decode(buf, key=key, size=self.nbytes, limit=self.limit, out=view)
            if res is view or res is target or np.shares_memory(np.frombuffer(res, np.uint8), target):
                return target
            return np.frombuffer(res, dtype=self.dtype).reshape(self.shape)
        for i in range(len(self.bb) - 1, -1, -1):
            buf = self.bb[i].decode(buf, key=key, size=self.bb_sizes[i], limit=self.limit)
        a = self.ab.decode(buf, self.ab_shape, self.ab_dtype, key=key)
        for c in reversed(self.aa):
            a = c.decode(a)
        return a
