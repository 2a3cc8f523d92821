"""The three kinds of zarr v3 codecs and the chain that runs them.

A chain is ``array->array* , array->bytes , bytes->bytes*``. Encoding runs left
to right, decoding right to left. Decoders are told the exact or maximum size
their output may have, so a corrupt or hostile chunk is refused before a large
allocation (decompression bombs) and a short one is an error, never garbage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from tensorstore_py.kvstore.base import Buffer

__all__ = ["ArrayArrayCodec", "ArrayBytesCodec", "BytesBytesCodec", "Codec"]


class Codec(ABC):
    """One codec of a chain; ``name`` is its zarr v3 name."""

    name: str = ""

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


class BytesBytesCodec(Codec):
    """Transforms bytes (compressors, checksums)."""

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
