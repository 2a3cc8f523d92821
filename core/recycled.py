"""Large buffers handed out again once nothing uses them any more.

A buffer allocated fresh for every large network answer costs the kernel a page
fault and the clearing of every page on its first touch: reading 32 MiB of 4 MiB
objects at zero latency spent about a third of its CPU time in the kernel
clearing pages (``clear_page_erms``), as much as in copying the bytes. Memory
touched a moment ago costs nothing of that.

:class:`RecycledBuffers` hands out ``n``-byte uint8 arrays that are views of
kept page-aligned blocks. A block goes back to the free list when its view is
gone: when the caller, and everything made from the view (memoryviews, numpy
arrays over it, slices), has dropped it. Nothing is ever reused while anything
still refers to it, so a caller that keeps a value (or an array decoded as a
view of it) simply keeps its block. The free list keeps at most ``keep_bytes``;
blocks beyond it go back to the system. Thread-safe: views may die on any
thread.
"""

from __future__ import annotations

import bisect
import threading
import weakref

import numpy as np

from tensorstore_py.core.buffers import aligned_empty

__all__ = ["RecycledBuffers"]

#: blocks are made in multiples of this (bodies of similar sizes share blocks)
_GRAIN = 256 << 10


class RecycledBuffers:
    """Blocks handed out again once their views are gone (see the module doc)."""

    def __init__(self, *, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[tuple[int, int, np.ndarray]] = []  # (size, serial, block), by size
        self._kept = 0
        self._serial = 0
        self._lock = threading.Lock()
        #: blocks made fresh so far (a get that found none free to reuse)
        self.made = 0

    @property
    def kept_bytes(self) -> int:
        """Bytes of blocks in the free list now."""
        return self._kept

    def get(self, n: int) -> np.ndarray:
        """An uninitialised uint8 array of ``n`` bytes, page-aligned: a kept block
        of at most twice that size when one is free, else a new one."""
        with self._lock:
            i = bisect.bisect_left(self._free, (n, -1))
            if i < len(self._free) and self._free[i][0] <= 2 * max(n, _GRAIN):
                size, _, block = self._free.pop(i)
                self._kept -= size
            else:
                block = aligned_empty(-(-n // _GRAIN) * _GRAIN)
                self.made += 1
        tracked = block[:n]
        weakref.finalize(tracked, self._put_back, block).atexit = False
        # Handed out through a memoryview of ``tracked``, not as ``tracked`` itself:
        # numpy collapses the base of a slice (``view[:k]``, ``view.reshape(...)``) to
        # the array that owns the memory, the block, so a slice of ``tracked`` would
        # not keep it alive and the block would serve again under the slice. Every
        # array made from this one refers to the memoryview, which refers to ``tracked``.
        return np.frombuffer(tracked.data, np.uint8)

    def _put_back(self, block: np.ndarray) -> None:
        with self._lock:
            if self._kept + block.nbytes > self.keep_bytes:
                return  # enough kept: this one goes back to the system
            self._serial += 1
            bisect.insort(self._free, (block.nbytes, self._serial, block))
            self._kept += block.nbytes

    def clear(self) -> None:
        """Let every free block go (blocks in use come back as usual)."""
        with self._lock:
            self._free.clear()
            self._kept = 0

    def after_fork_in_child(self) -> None:
        """A forked child's fresh start: a new lock (another thread of the parent
        may have held the old one), no free blocks."""
        self._lock = threading.Lock()
        self._free, self._kept = [], 0
