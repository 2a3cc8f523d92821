"""The array driver contract: one open array = metadata + chunk I/O.

A driver maps an N-d array onto keys of a :class:`~tensorstore_py.kvstore.KvStore`
(it never knows which store). It does no numpy-style indexing sugar: the view
layer (``tensorstore_py.tensorstore``) turns user indexing into the normalised
``index`` tuples below, casts and broadcasts values, and checks bounds.

``index`` is a tuple of one ``slice`` per dimension with
``0 <= start <= stop <= shape[d]`` and ``step >= 1`` (already normalised; the
result has ``len(range(start, stop, step))`` elements along ``d``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from tensorstore_py.core.errors import UnsupportedError
from tensorstore_py.kvstore.base import KvStore

__all__ = ["ArrayDriver", "Index"]

Index = tuple[slice, ...]


class ArrayDriver(ABC):
    """An open chunked array (zarr3, zarr2, ...).

    Guarantees: ``write`` of a whole chunk replaces it atomically; a partial
    chunk write is a read-modify-write conditioned on the chunk's generation and
    retried when it loses a race, so concurrent writers of disjoint regions of
    one chunk never lose each other's data. Chunks equal to the fill value are
    deleted rather than stored (as zarr-python does).
    """

    #: spec name: "zarr3" or "zarr"
    driver: str
    kvstore: KvStore
    #: the key (relative to ``kvstore``) of the metadata document
    metadata_key: str

    @property
    @abstractmethod
    def shape(self) -> tuple[int, ...]: ...

    @property
    @abstractmethod
    def dtype(self) -> np.dtype: ...

    @property
    @abstractmethod
    def fill_value(self) -> Any:
        """The fill value as a numpy scalar of ``dtype`` (zarr2 ``null`` -> 0)."""

    @property
    @abstractmethod
    def dimension_names(self) -> tuple[str | None, ...]: ...

    @property
    def origin(self) -> tuple[int, ...]:
        """The coordinates of the first element: zeros, unless the format places its
        domain elsewhere (neuroglancer precomputed: the scale's ``voxel_offset``)."""
        return (0,) * len(self.shape)

    @property
    @abstractmethod
    def read_chunk_shape(self) -> tuple[int, ...]:
        """The smallest unit that can be read alone (inner chunk when sharded)."""

    @property
    @abstractmethod
    def write_chunk_shape(self) -> tuple[int, ...]:
        """The unit written atomically (the shard when sharded, else the chunk)."""

    @property
    @abstractmethod
    def metadata(self) -> dict[str, Any]:
        """The stored metadata document (zarr.json / .zarray fields) as JSON."""

    @property
    def attributes(self) -> dict[str, Any]:
        """The array's user attributes (zarr ``attributes`` / ``.zattrs``, N5
        attributes.json members); formats without any have none."""
        return {}

    async def update_attributes(self, changes: dict[str, Any], *, replace: bool = False) -> dict[str, Any]:
        """Store ``changes`` into the attributes (all of them with ``replace``),
        atomically; returns the attributes now stored."""
        raise UnsupportedError(f"{type(self).__name__}: attributes cannot be written")

    @abstractmethod
    def spec(self) -> dict[str, Any]:
        """``{"driver": ..., "kvstore": kvstore spec, "metadata": metadata}``."""

    @abstractmethod
    async def read(self, index: Index, *, out: np.ndarray | None = None) -> np.ndarray:
        """Read ``index``; missing chunks read as the fill value.

        With ``out`` (C-contiguous, exact shape and dtype) chunks are decoded
        straight into it and it is returned.
        """

    #: True when :meth:`read_blocking` may be used (the store's I/O is cheap blocking calls)
    reads_blocking: bool = False

    def read_blocking(self, index: Index, out: np.ndarray) -> np.ndarray:
        """``read`` on the calling thread (it blocks; pool threads may help), for
        drivers whose ``reads_blocking`` is True: no event loop round trips.
        Same results and guarantees as :meth:`read`."""
        raise UnsupportedError(f"{type(self).__name__}: no blocking read")

    @abstractmethod
    async def write(self, index: Index, value: np.ndarray) -> None:
        """Write ``value`` (exact shape of ``index``, dtype == ``self.dtype``)."""

    @abstractmethod
    async def resize(self, new_shape: tuple[int, ...]) -> ArrayDriver:
        """Write new metadata with ``new_shape``; chunks wholly outside it are deleted."""

    @abstractmethod
    def with_kvstore(self, kvstore: KvStore) -> ArrayDriver:
        """The same array over another view of its store (e.g. a transaction)."""

    # -- stored chunks (for tools that check or copy them; optional) ----------------
    def chunk_key(self, cell: tuple[int, ...]) -> str:
        """The key (relative to ``kvstore``) of the write chunk at grid ``cell``."""
        raise UnsupportedError(f"{type(self).__name__}: chunk_key is not supported")

    def decode_chunk(self, key: str, data: Any) -> np.ndarray:
        """Decode the stored bytes of one write chunk; CPU only, no I/O.

        Returns an array of ``write_chunk_shape`` and ``dtype`` for well-formed
        data; raises DataCorruptionError (or ValueError from a codec library)
        naming ``key`` for bytes that do not decode.
        """
        raise UnsupportedError(f"{type(self).__name__}: decode_chunk is not supported")

    @property
    def raw_chunk_nbytes(self) -> int | None:
        """Stored size of every write chunk when chunks are stored raw (no codec
        changes the bytes, so the size alone checks a chunk), else None."""
        return None
