"""``transpose``: permute the chunk's axes before serialisation."""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorstore_py.core.errors import InvalidSpecError
from tensorstore_py.drivers.codecs.base import ArrayArrayCodec, ChunkSpec
from tensorstore_py.drivers.codecs.registry import register_codec


@register_codec
class TransposeCodec(ArrayArrayCodec):
    """Encoded array = ``a.transpose(order)``."""

    name = "transpose"

    def __init__(self, order: tuple[int, ...]) -> None:
        self.order = tuple(order)
        self.inverse = tuple(int(i) for i in np.argsort(self.order))

    @classmethod
    def from_json(cls, config: dict[str, Any], chunk: ChunkSpec) -> TransposeCodec:
        ndim = len(chunk.shape)
        unknown = set(config) - {"order"}
        if unknown:
            raise InvalidSpecError(f"transpose codec: unknown configuration fields {sorted(unknown)}")
        order = config.get("order")
        if order == "C":
            order = list(range(ndim))
        elif order == "F":
            order = list(range(ndim))[::-1]
        if (
            not isinstance(order, list)
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in order)
            or sorted(order) != list(range(ndim))
        ):
            raise InvalidSpecError(
                f"transpose codec: 'order' must be a permutation of 0..{ndim - 1}, got {order!r}"
            )
        return cls(tuple(order))

    def to_json(self) -> dict[str, Any]:
        return {"name": "transpose", "configuration": {"order": list(self.order)}}

    def resolve(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[tuple[int, ...], np.dtype]:
        return tuple(shape[i] for i in self.order), dtype

    def encode(self, a: np.ndarray) -> np.ndarray:
        return a.transpose(self.order)

    def decode(self, a: np.ndarray) -> np.ndarray:
        return a.transpose(self.inverse)
