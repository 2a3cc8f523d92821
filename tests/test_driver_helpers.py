"""Helpers shared by the driver tests: a counting wrapper store and shortcuts."""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorstore_py.core.future import run_sync
from tensorstore_py.drivers.open import open_driver
from tensorstore_py.kvstore.base import KvStore


class CountingKvStore(KvStore):
    """Forwards to ``base`` and records every backend read as (key, byte_range)."""

    driver = "counting"

    def __init__(self, base: KvStore) -> None:
        super().__init__(path=base.path)
        self.base = base
        self.reads: list[tuple[str, Any]] = []

    def _spec_fields(self) -> dict[str, Any]:
        return {"base": self.base.spec()}

    async def _read(self, key, byte_range, if_not_equal):
        self.reads.append((key[len(self.path):], byte_range))
        return await self.base._read(key, byte_range, if_not_equal)

    async def _write(self, key, value, if_equal):
        return await self.base._write(key, value, if_equal)

    async def _delete(self, key, if_equal):
        return await self.base._delete(key, if_equal)

    async def _list(self, prefix):
        return await self.base._list(prefix)


def full(shape) -> tuple[slice, ...]:
    return tuple(slice(0, s, 1) for s in shape)


def norm(index, shape) -> tuple[slice, ...]:
    """Normalise a tuple of step>0 slices like numpy does."""
    return tuple(slice(*s.indices(n)) for s, n in zip(index, shape))


def open_sync(spec, **kw):
    return run_sync(open_driver(spec, **kw))


def read(a, index=None) -> np.ndarray:
    return run_sync(a.read(full(a.shape) if index is None else norm(index, a.shape)))


def write(a, value, index=None) -> None:
    run_sync(a.write(full(a.shape) if index is None else norm(index, a.shape), value))
