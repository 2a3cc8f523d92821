"""Buffers for large chunks that live only while one chunk is decoded and copied.

A read of chunks of a few MiB makes two buffers per chunk that die a moment
later: the stored bytes read from a file (larger than the per-thread buffer of
``core/buffers.thread_scratch``) and the decoded chunk before its copy into the
result. numpy asks for transparent huge pages on every allocation of 4 MiB or
more and the allocator gives such blocks back to the kernel when they are
freed, so each chunk's buffers were fresh memory again: a page fault and a
cleared page on every first touch. Reading 1 GiB of float32 in 4 MiB zstd
chunks from local files took 0.90-1.57 s instead of 1.81-1.94 s (CPU 1.8-3.1 s
instead of 3.6-3.8 s; 2 cores, old and new alternating, three runs each) once
both buffers came from :data:`chunk_buffers`, blocks handed out again once
nothing refers to them (:class:`~tensorstore_py.core.recycled.RecycledBuffers`).

Smaller chunks keep the allocator's memory, which it hands back already
touched. The free list keeps at most :data:`KEPT_BYTES_PER_CPU` per CPU this
process may use (at least :data:`MIN_KEPT_BYTES`): one stored and one decoded
chunk of 4 MiB per helper thread.
"""

from __future__ import annotations

import os

import numpy as np

from tensorstore_py.core.pools import available_cpus
from tensorstore_py.core.recycled import RecycledBuffers

__all__ = ["KEPT_BYTES_PER_CPU", "MIN_KEPT_BYTES", "POOLED_BYTES", "chunk_buffer", "chunk_buffers"]

#: chunks of this many bytes or more (stored or decoded) use the pool
POOLED_BYTES = 1 << 20
#: idle bytes the free list keeps per CPU
KEPT_BYTES_PER_CPU = 8 << 20
#: idle bytes the free list keeps at least
MIN_KEPT_BYTES = 32 << 20

chunk_buffers = RecycledBuffers(keep_bytes=max(MIN_KEPT_BYTES, KEPT_BYTES_PER_CPU * available_cpus()))
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=chunk_buffers.after_fork_in_child)


def chunk_buffer(nbytes: int) -> np.ndarray | None:
    """A page-aligned uint8 array of ``nbytes`` from :data:`chunk_buffers`, or
    None below :data:`POOLED_BYTES`. Its block serves another chunk only once
    this array and everything made from it are gone."""
    return chunk_buffers.get(nbytes) if nbytes >= POOLED_BYTES else None
