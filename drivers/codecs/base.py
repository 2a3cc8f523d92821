"""The three kinds of zarr v3 codecs, and what a whole chunk encoding offers.

A chain is ``array->array* , array->bytes , bytes->bytes*``. Encoding runs left
to right, decoding right to left. Decoders are told the exact or maximum size
their output may have, so a corrupt or hostile chunk is refused before a large
allocation (decompression bombs) and a short one is an error, never garbage.

:class:`ChunkCodec` is the chunk engine's view of a format's encoding of one
chunk: the zarr3 codec chain, or zarr v2 filters and compressor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorstore_py.kvstore.base import Buffer

__all__ = ["ArrayArrayCodec", "ArrayBytesCodec", "BytesBytesCodec", "ChunkCodec", "ChunkSpec", "Codec"]


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """What a codec sees: the shape and dtype of its input array (after the
    array->array codecs before it) and the array's fill value."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fill_value: Any


class Codec(ABC):
    """One codec of a chain; ``name`` is its zarr v3 name."""

    name: str = ""

    @classmethod
    @abstractmethod
    def from_json(cls, config: dict[str, Any], chunk: ChunkSpec) -> Codec:
        """The codec for the ``configuration`` object of its metadata entry;
        InvalidSpecError naming the codec and the field for bad values."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """The codec's metadata entry (``{"name": ..., "configuration": ...}``)."""


class ArrayArrayCodec(Codec):
    """Transforms an array into another array (e.g. ``transpose``)."""

    @abstractmethod
    def resolve(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[tuple[int, ...], np.dtype]:
        """Shape and dtype of the encoded array."""

    @abstractmethod
    def encode(self, a: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def decode(self, a: np.ndarray) -> np.ndarray: ...


class ArrayBytesCodec(Codec):
    """Serialises an array into bytes (``bytes``, ``sharding_indexed``)."""

    #: ``decode(out=...)`` fills any view of the right shape in place, strided
    #: or not (a shard decodes its inner chunks straight into their places)
    fills_any_out: bool = False

    @abstractmethod
    def encode(self, a: np.ndarray) -> Buffer: ...

    @abstractmethod
    def decode(
        self, buf: Buffer, shape: tuple[int, ...], dtype: np.dtype, *, key: str,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """The array of ``shape``/``dtype``; with ``out`` it may decode into it."""

    def encoded_size(self, shape: tuple[int, ...], dtype: np.dtype) -> int | None:
        """Exact encoded size when fixed (raw bytes), else None."""
        return None

    def stores_native(self, dtype: np.dtype) -> bool:
        """True when the encoded bytes of a ``dtype`` array are its native
        C-order bytes (decoding is a reinterpretation, no copy)."""
        return False


class BytesBytesCodec(Codec):
    """Transforms bytes (compressors, checksums)."""

    #: ``decode(out=...)`` writes the result into ``out`` (when its size fits)
    decodes_into: bool = False

    @abstractmethod
    def encode(self, buf: Buffer) -> Buffer: ...

    @abstractmethod
    def decode(self, buf: Buffer, *, key: str, size: int | None, limit: int,
               out: Buffer | None = None) -> Buffer:
        """Decode ``buf``. ``size``: the exact decoded size when known (a mismatch
        is a DataCorruptionError); ``limit``: refuse to produce more than this.
        ``out`` (writable, exactly ``size`` bytes) may receive the result."""

    def encoded_size(self, size: int | None) -> int | None:
        """Exact encoded size for an input of ``size`` bytes, when fixed."""
        return None

    def decoded_size(self, size: int | None) -> int | None:
        """Exact decoded size for an encoded input of ``size`` bytes, when fixed."""
        return None


class ChunkCodec(ABC):
    """A format's encoding of one whole chunk, as the chunk engine uses it
    (:class:`~tensorstore_py.drivers.codecs.chain.CodecChain` for zarr3, filters
    and a compressor for zarr v2)."""

    #: the stored bytes are the chunk's native C-order bytes: no decoding at all
    raw: bool = False
    #: ``decode(out=...)`` may decompress straight into a C-contiguous ``out``
    direct: bool = False
    #: ``decode(out=...)`` fills any view of the chunk's shape in place
    strided_out: bool = False

    @abstractmethod
    def encode(self, a: np.ndarray) -> Buffer:
        """Encode one chunk (``a`` has exactly the chunk's shape)."""

    @abstractmethod
    def decode(self, buf: Buffer, *, key: str, out: np.ndarray | None = None) -> np.ndarray:
        """Decode one chunk. With ``out`` (exact shape and dtype) the result may
        be written into it and ``out`` returned; without it the result may be a
        read-only view of ``buf``. Bad bytes raise DataCorruptionError naming ``key``."""
