"""What the chunk engine reads of a format's metadata.

A format (zarr3, zarr2, n5, neuroglancer precomputed) validates its metadata
document into a :class:`ParsedMetadata`, the only members the engine
(drivers/engine.py) reads; :func:`json_object` is how a stored JSON document
(array metadata, group documents, attributes) is read, with the error it
raises on anything but a JSON object.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import numpy as np

from tensorstore_py.core.errors import InvalidSpecError
from tensorstore_py.drivers.codecs.base import ChunkCodec

__all__ = ["ParsedMetadata", "json_object"]


class ParsedMetadata(Protocol):
    """A format's validated metadata document, as the engine needs it (it only reads
    these members: a format may hold them as plain attributes, properties or frozen
    dataclass fields, its codec of any ChunkCodec type)."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> np.dtype: ...
    @property
    def fill(self) -> np.generic: ...
    @property
    def chunk_shape(self) -> tuple[int, ...]: ...
    @property
    def codec(self) -> ChunkCodec: ...
    @property
    def dimension_names(self) -> tuple[str | None, ...]: ...

    def chunk_key(self, cell: tuple[int, ...]) -> str:
        """The kvstore key of the chunk at grid position ``cell`` (the format's key encoding)."""
        ...


def json_object(raw: Any, where: str) -> dict[str, Any]:
    """The JSON object stored in ``raw``; InvalidSpecError naming ``where`` otherwise."""
    try:
        meta = json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidSpecError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise InvalidSpecError(f"{where}: expected a JSON object, got {type(meta).__name__}")
    return meta
