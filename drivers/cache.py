"""A byte-limited LRU of decoded chunks, shared by the arrays that use it.

Entries are keyed by (store identity, store path, chunk key) and carry the
generation they were decoded from. A reader revalidates with
``read(key, if_not_equal=generation)``: an "unchanged" answer reuses the cached
array, so a cached chunk is never stale (the revalidation is one small request
per chunk; it saves the transfer and the decode). Chunks and shards read whole
are cached; reads of part of a shard go to the store (index + inner chunks).
An array opened with a pool uses the generic async I/O path. Off by default
(no pool, no caching).
Thread-safe: one lock guards the map.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

from tensorstore_py.core.errors import InvalidArgumentError
from tensorstore_py.kvstore.base import Generation

__all__ = ["CachePool"]


class CachePool:
    """LRU of decoded chunk arrays holding at most ``total_bytes_limit`` bytes.

    Cached arrays are made read-only; a chunk larger than the limit is not cached.
    """

    def __init__(self, total_bytes_limit: int) -> None:
        if not isinstance(total_bytes_limit, int) or total_bytes_limit < 0:
            raise InvalidArgumentError(
                f"CachePool: total_bytes_limit must be a non-negative int, got {total_bytes_limit!r}"
            )
        self.total_bytes_limit = total_bytes_limit
        self._lock = threading.Lock()
        self._items: OrderedDict[Hashable, tuple[Generation, np.ndarray]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """Bytes currently held."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable) -> tuple[Generation, np.ndarray] | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item

    def put(self, key: Hashable, generation: Generation, array: np.ndarray) -> None:
        n = array.nbytes
        if n > self.total_bytes_limit:
            return
        array = array.view()
        array.flags.writeable = False
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1].nbytes
            self._items[key] = (generation, array)
            self._bytes += n
            while self._bytes > self.total_bytes_limit and self._items:
                _k, (_g, a) = self._items.popitem(last=False)
                self._bytes -= a.nbytes

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __repr__(self) -> str:
        return f"CachePool(total_bytes_limit={self.total_bytes_limit}, nbytes={self._bytes})"
